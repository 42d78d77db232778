"""Sparse kernels (Triton under the interpreter, and the CPU fast path) against their references.

Every kernel is compared with the torch reference in float32 and with the reference evaluated
in float64, on fresh seeded random inputs, odd shapes (not multiples of any block size), empty
and full active sets, random and clustered masks, batch 1 and batch > 1.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from minisparse import kernels
from minisparse.kernels import cpu, cpu_build, cpu_int8
from minisparse.kernels.reference import (
    gather_gemv_ref,
    scatter_gemv_ref,
    sparse_ffn_ref,
)
from minisparse.quant.tensor import QuantSpec, quantize_tensor

TRITON_GATHER = [kernels.gather_gemv, kernels.gather_gemv_naive]
TRITON_FFN = [kernels.sparse_ffn, kernels.sparse_ffn_unfused]
ALL_GATHER = [*TRITON_GATHER, cpu.gather_gemv]
ALL_INPUT = [kernels.scatter_gemv, cpu.scatter_gemv]
ALL_FFN = [*TRITON_FFN, cpu.sparse_ffn]
RTOL = 1e-5  # fp32 relative error, measured against the largest output


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref| (the error scale of a sum of many terms)."""
    scale = ref.abs().max().item() or 1.0
    return (out.double() - ref.double()).abs().max().item() / scale


def make_idx(n: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    """Active indices out of n: empty, full, random (any order), or clustered runs."""
    if kind == "empty":
        return torch.empty(0, dtype=torch.int64)
    if kind == "full":
        return torch.arange(n)
    if kind == "random":
        return torch.randperm(n, generator=gen)[: max(1, n // 3)]
    start = torch.randint(0, max(1, n - 12), (3,), generator=gen)  # three runs of 10
    return torch.unique((start[:, None] + torch.arange(10)).flatten().clamp(max=n - 1))


def seeded(*key: object) -> torch.Generator:
    """A generator seeded from the test's parameters (stable across runs)."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def randn(*shape: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen)


@pytest.fixture
def fast_path():
    """Skip (with the reason) where the compiled CPU loops are not available."""
    if not cpu.fast_path_available():
        pytest.skip("no C compiler builds the CPU fast path here; the torch fallback is tested")


def test_interpreter_is_the_default_without_cuda_and_sets_nothing():
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the kernels compile for the GPU")
    if "TRITON_INTERPRET" in os.environ:
        pytest.skip("the user set TRITON_INTERPRET for this run")
    assert kernels.INTERPRETING
    W, x, idx = torch.randn(9, 7), torch.randn(7), torch.tensor([8, 0])
    assert torch.allclose(kernels.gather_gemv(W, x, idx), W[idx] @ x, atol=1e-5)
    # the kernels stay compiled-kind functions: only each CPU launch is interpreted
    assert type(kernels.row_sparse._gather_tile_kernel).__name__ == "JITFunction"
    assert "TRITON_INTERPRET" not in os.environ


def test_interpreter_runs_after_an_earlier_triton_import_and_leaves_triton_alone(tmp_path):
    """The user imported triton first; a CPU call of our kernels runs interpreted, and the
    user's own kernels, triton.language and the environment are as before."""
    script = tmp_path / "user_code.py"  # @triton.jit needs its function in a file
    script.write_text(
        "import os, sys\n"
        "os.environ.pop('TRITON_INTERPRET', None)\n"
        "before = dict(os.environ)\n"
        "import torch, triton, triton.language as tl\n"
        "from triton.runtime.jit import JITFunction\n"
        "from minisparse import kernels\n"
        "standard = sys.modules['triton.language.standard']\n"
        "names = set(vars(standard))\n"
        "W = torch.randn(37, 29); x = torch.randn(29); idx = torch.tensor([3, 0, 36])\n"
        "err = (kernels.gather_gemv(W, x, idx) - W[idx] @ x).abs().max().item()\n"
        "@triton.jit\n"
        "def user_kernel(p):\n"
        "    tl.store(p, tl.sum(tl.zeros([4], tl.float32), axis=0))\n"
        "print(kernels.INTERPRETING, err < 1e-4, dict(os.environ) == before,\n"
        "      isinstance(user_kernel, JITFunction), isinstance(tl.sum, JITFunction),\n"
        "      set(vars(standard)) == names)\n"
    )
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the interpreter is not needed")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True"] * 6


@pytest.mark.parametrize("fn", ALL_GATHER, ids=lambda f: f"{f.__module__}.{f.__name__}")
@pytest.mark.parametrize("kind", ["empty", "full", "random", "clustered"])
@pytest.mark.parametrize("batch", [None, 3])
def test_gather_gemv(fn, kind, batch):
    gen = seeded(fn.__module__, fn.__name__, kind, batch)
    N, K = 157, 203  # odd: no block size divides them
    W = randn(N, K, gen=gen)
    x = randn(K, gen=gen) if batch is None else randn(batch, K, gen=gen)
    idx = make_idx(N, kind, gen)
    out = fn(W, x, idx)
    expected_shape = (idx.numel(),) if batch is None else (batch, idx.numel())
    assert out.shape == expected_shape and out.dtype == x.dtype
    if idx.numel():
        assert rel_err(out, gather_gemv_ref(W, x, idx)) <= RTOL
        assert rel_err(out, gather_gemv_ref(W.double(), x.double(), idx)) <= RTOL


@pytest.mark.parametrize("fn", ALL_INPUT, ids=lambda f: f.__module__)
@pytest.mark.parametrize("mode", ["threshold", "empty", "full", "random", "clustered"])
@pytest.mark.parametrize("batch", [None, 2])
def test_scatter_gemv(fn, mode, batch):
    gen = seeded(fn.__module__, mode, batch)
    K, N = 149, 211
    W_t = randn(K, N, gen=gen)
    x = randn(K, gen=gen) if batch is None else randn(batch, K, gen=gen)
    kw = {"threshold": 0.8} if mode == "threshold" else {"idx": make_idx(K, mode, gen)}
    out = fn(W_t, x, **kw)
    assert out.shape == ((*x.shape[:-1], N))
    ref = scatter_gemv_ref(W_t, x, **kw)
    ref64 = scatter_gemv_ref(W_t.double(), x.double(), **kw)
    if mode == "empty":
        assert torch.equal(out, torch.zeros_like(out))
    else:
        assert rel_err(out, ref) <= RTOL and rel_err(out, ref64) <= RTOL
    if mode == "threshold":  # the threshold really drops inputs: dense differs
        assert rel_err((x @ W_t), ref64) > 1e-3


@pytest.mark.parametrize("fn", ALL_FFN, ids=lambda f: f"{f.__module__}.{f.__name__}")
@pytest.mark.parametrize("act", ["silu", "relu", "gelu"])
@pytest.mark.parametrize("kind", ["random", "clustered", "full"])
def test_sparse_ffn(fn, act, kind):
    gen = seeded(fn.__module__, fn.__name__, act, kind)
    F_, D = 97, 131
    Wg, Wu, Wd_t = randn(F_, D, gen=gen), randn(F_, D, gen=gen), randn(F_, D, gen=gen)
    x = randn(2, D, gen=gen)
    idx = make_idx(F_, kind, gen)
    out = fn(x, Wg, Wu, Wd_t, idx, act)
    ref64 = sparse_ffn_ref(x.double(), Wg.double(), Wu.double(), Wd_t.double(), idx, act)
    assert rel_err(out, sparse_ffn_ref(x, Wg, Wu, Wd_t, idx, act)) <= RTOL
    assert rel_err(out, ref64) <= RTOL
    if kind == "full":  # all neurons active: the dense gated FFN
        act_fn = {"silu": F.silu, "relu": F.relu, "gelu": F.gelu}[act]
        xd = x.double()
        dense = (act_fn(xd @ Wg.double().T) * (xd @ Wu.double().T)) @ Wd_t.double()
        assert rel_err(out, dense) <= RTOL


@pytest.mark.parametrize("fn", ALL_FFN, ids=lambda f: f"{f.__module__}.{f.__name__}")
def test_sparse_ffn_empty_set_gives_zeros(fn):
    gen = torch.Generator().manual_seed(5)
    Wg, Wu, Wd_t = randn(33, 17, gen=gen), randn(33, 17, gen=gen), randn(33, 17, gen=gen)
    out = fn(randn(17, gen=gen), Wg, Wu, Wd_t, torch.empty(0, dtype=torch.int64), "silu")
    assert out.shape == (17,) and torch.equal(out, torch.zeros(17))


def test_sparse_ffn_equals_dense_ffn_with_masked_activations():
    gen = torch.Generator().manual_seed(11)
    F_, D = 64, 40
    Wg, Wu, Wd_t, x = (
        randn(F_, D, gen=gen),
        randn(F_, D, gen=gen),
        randn(F_, D, gen=gen),
        randn(D, gen=gen),
    )
    idx = torch.tensor([1, 7, 8, 9, 30, 63])
    h = torch.nn.functional.silu(Wg @ x) * (Wu @ x)
    mask = torch.zeros(F_, dtype=torch.bool)
    mask[idx] = True
    expected = torch.where(mask, h, torch.zeros_like(h)) @ Wd_t
    assert rel_err(cpu.sparse_ffn(x, Wg, Wu, Wd_t, idx), expected) <= RTOL
    assert rel_err(kernels.sparse_ffn(x, Wg, Wu, Wd_t, idx), expected) <= RTOL


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_accumulate_in_float32(dtype):
    gen = torch.Generator().manual_seed(3)
    W, x = randn(70, 300, gen=gen), randn(2, 300, gen=gen)
    idx = torch.tensor([0, 5, 69, 33])
    out = kernels.gather_gemv(W.to(dtype), x.to(dtype), idx)
    ref32 = gather_gemv_ref(W.to(dtype).double(), x.to(dtype).double(), idx)
    assert out.dtype == dtype
    # one rounding of the float32 sum to the output dtype, no more
    assert rel_err(out, ref32) <= torch.finfo(dtype).eps
    W_t = randn(50, 40, gen=gen).to(dtype)
    xi = randn(50, gen=gen).to(dtype)
    out = kernels.scatter_gemv(W_t, xi, threshold=0.5)
    ref = scatter_gemv_ref(W_t.double(), xi.double(), threshold=0.5)
    assert rel_err(out, ref) <= torch.finfo(dtype).eps


@settings(max_examples=8, deadline=None)
@given(
    n_rows=st.integers(1, 80),
    k=st.integers(1, 300),
    batch=st.integers(1, 3),
    density=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
)
def test_gather_gemv_shapes_property(n_rows, k, batch, density, seed):
    gen = torch.Generator().manual_seed(seed)
    W, x = randn(n_rows, k, gen=gen), randn(batch, k, gen=gen)
    idx = torch.randperm(n_rows, generator=gen)[: round(density * n_rows)]
    ref = gather_gemv_ref(W.double(), x.double(), idx)
    # the forward-error scale of a dot product: sum_k |W_ik x_k| (cancellation can make the
    # result itself far smaller than the terms, so |ref| alone is no fair yardstick)
    scale = gather_gemv_ref(W.double().abs(), x.double().abs(), idx)
    for fn in (kernels.gather_gemv, cpu.gather_gemv):
        out = fn(W, x, idx)
        assert out.shape == (batch, idx.numel())
        if idx.numel():
            assert (out.double() - ref).abs().max().item() <= RTOL * scale.max().item()


@settings(max_examples=8, deadline=None)
@given(
    k=st.integers(1, 150),
    n=st.integers(1, 150),
    threshold=st.floats(0.0, 2.0),
    seed=st.integers(0, 2**16),
)
def test_scatter_gemv_shapes_property(k, n, threshold, seed):
    gen = torch.Generator().manual_seed(seed)
    W_t, x = randn(k, n, gen=gen), randn(k, gen=gen)
    ref = scatter_gemv_ref(W_t.double(), x.double(), threshold=threshold)
    for fn in (kernels.scatter_gemv, cpu.scatter_gemv):
        out = fn(W_t, x, threshold=threshold)
        assert out.shape == (n,)
        assert (out.double() - ref).abs().max().item() <= RTOL * max(ref.abs().max().item(), 1.0)


@settings(max_examples=5, deadline=None)
@given(f=st.integers(1, 50), d=st.integers(1, 140), seed=st.integers(0, 2**16))
def test_sparse_ffn_shapes_property(f, d, seed):
    gen = torch.Generator().manual_seed(seed)
    Wg, Wu, Wd_t, x = (
        randn(f, d, gen=gen),
        randn(f, d, gen=gen),
        randn(f, d, gen=gen),
        randn(d, gen=gen),
    )
    idx = torch.randperm(f, generator=gen)[: (f + 1) // 2]
    ref = sparse_ffn_ref(x.double(), Wg.double(), Wu.double(), Wd_t.double(), idx, "silu")
    for fn in (kernels.sparse_ffn, cpu.sparse_ffn):
        out = fn(x, Wg, Wu, Wd_t, idx, "silu")
        assert out.shape == (d,)
        assert (out.double() - ref).abs().max().item() <= RTOL * max(ref.abs().max().item(), 1.0)


def test_cpu_fast_path_builds_wherever_a_compiler_is_found():
    spec = cpu.find_compiler()
    if spec is None or cpu.resolve_compiler(spec) is None:
        pytest.skip("no C compiler here: test_cpu_fallback_without_compiler covers this machine")
    assert cpu.fast_path_available()


def test_cpu_prefetch_switch_does_not_change_results(fast_path):
    gen = torch.Generator().manual_seed(2)
    W, x = randn(300, 257, gen=gen), randn(257, gen=gen)
    idx = torch.randperm(300, generator=gen)[:100]
    a = cpu.gather_rows_dot(W, x, idx, prefetch=True)
    b = cpu.gather_rows_dot(W, x, idx, prefetch=False)
    assert torch.equal(a, b)
    assert rel_err(a[0], gather_gemv_ref(W.double(), x.double(), idx)) <= RTOL


def test_the_cpu_loops_follow_torch_threads(fast_path):
    """torch.set_num_threads (the CLI's --threads) sets the C loops' team, and the result does
    not depend on it beyond rounding."""
    gen = torch.Generator().manual_seed(6)
    W_t, v = randn(1100, 1000, gen=gen), randn(2, 700, gen=gen)  # above the parallel minimum
    idx = torch.randperm(1100, generator=gen)[:700]
    ref = (v.double() @ W_t.double()[idx]).float()
    old = torch.get_num_threads()
    try:
        outs = {}
        for threads in (1, 2):
            torch.set_num_threads(threads)
            openmp = cpu.load_library().built_with_openmp()
            assert cpu.fast_path_threads() == (threads if openmp else 1)
            outs[threads] = cpu.scatter_rows_sum(W_t, v, idx)
            assert rel_err(outs[threads], ref) <= RTOL
    finally:
        torch.set_num_threads(old)
    assert rel_err(outs[1], outs[2]) <= RTOL


def test_hugepage_copy_is_an_aligned_equal_copy():
    t = torch.randn(1100, 1000)
    h = cpu.hugepage_copy(t)
    assert torch.equal(h, t) and h.is_contiguous() and h.data_ptr() % cpu.HUGE_PAGE == 0
    assert h.data_ptr() != t.data_ptr()


def test_cpu_fallback_without_compiler(monkeypatch):
    gen = torch.Generator().manual_seed(4)
    W, x = randn(40, 30, gen=gen), randn(30, gen=gen)
    idx = torch.tensor([4, 1, 39])
    monkeypatch.setattr(cpu, "load_library", lambda: None)
    ref = gather_gemv_ref(W.double(), x.double(), idx)
    assert rel_err(cpu.gather_gemv(W, x, idx), ref) <= RTOL
    assert rel_err(cpu.gather_rows_dot(W, x, idx)[0], ref) <= RTOL
    W_t, idx = randn(30, 40, gen=gen), torch.tensor([4, 1, 29])
    ref = scatter_gemv_ref(W_t.double(), x.double(), idx=idx)
    assert rel_err(cpu.scatter_gemv(W_t, x, idx=idx), ref) <= RTOL
    assert rel_err(cpu.scatter_rows_sum(W_t, x[idx], idx)[0], ref) <= RTOL
    assert rel_err(cpu.dense_gemv(W_t, x), x.double() @ W_t.double()) <= RTOL
    assert cpu.fast_path_threads() == 0


def test_missing_compiler_warns_with_the_fix(monkeypatch):
    monkeypatch.setattr(cpu_build, "find_compiler", lambda: None)  # load_library reads it there
    cpu.load_library.cache_clear()
    try:
        with pytest.warns(UserWarning, match="Install gcc or clang"):
            assert cpu.load_library() is None
    finally:
        cpu.load_library.cache_clear()


# ---- bad input: one clear exception naming the fix ----------------------------------------


ALL_BACKENDS = [kernels, cpu]


@pytest.mark.parametrize("mod", ALL_BACKENDS, ids=["triton", "cpu"])
def test_bad_shapes_and_indices_raise(mod):
    W, x = torch.randn(10, 8), torch.randn(8)
    with pytest.raises(ValueError, match=r"x must have shape \[8\]"):
        mod.gather_gemv(W, torch.randn(9), torch.tensor([0]))
    with pytest.raises(ValueError, match=r"outside \[0, 10\)"):
        mod.gather_gemv(W, x, torch.tensor([0, 10]))
    with pytest.raises(ValueError, match=r"outside \[0, 10\)"):
        mod.gather_gemv(W, x, torch.tensor([-1]))
    with pytest.raises(ValueError, match="integer tensor"):
        mod.gather_gemv(W, x, torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="2-D weight"):
        mod.gather_gemv(torch.randn(10), x, torch.tensor([0]))
    with pytest.raises(ValueError, match="exactly one of threshold"):
        mod.scatter_gemv(torch.randn(8, 5), x)
    with pytest.raises(ValueError, match="exactly one of threshold"):
        mod.scatter_gemv(torch.randn(8, 5), x, threshold=0.1, idx=torch.tensor([0]))
    with pytest.raises(ValueError, match="threshold must be a number >= 0"):
        mod.scatter_gemv(torch.randn(8, 5), x, threshold=-1.0)
    with pytest.raises(ValueError, match="W_t is W transposed"):
        mod.scatter_gemv(torch.randn(5, 8), x, threshold=0.1)
    Wg = torch.randn(6, 8)
    with pytest.raises(ValueError, match="Unknown activation"):
        mod.sparse_ffn(x, Wg, Wg, Wg, torch.tensor([0]), "tanh")
    with pytest.raises(ValueError, match=r"down_proj\.weight\.T"):
        mod.sparse_ffn(x, Wg, Wg, Wg.T, torch.tensor([0]), "silu")


def test_triton_on_cpu_with_interpreter_forbidden_names_the_fix(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not kernels.INTERPRETING
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        kernels.gather_gemv(torch.randn(4, 3), torch.randn(3), torch.tensor([1]))


def test_c_loops_refuse_out_of_range_indices_themselves():
    """The last line of defence: even past the Python checks, the C loops test every index."""
    lib = cpu.load_library()
    if lib is None:
        pytest.skip("no compiled library here")
    W, x, v, y = torch.randn(4, 8), torch.randn(8), torch.randn(2), torch.zeros(8)
    for bad in ([0, 4], [-1, 0], [0, 10**12]):
        idx = torch.tensor(bad)
        # gather: W [4, 8] (ldw 8), x [1, 8], idx [2] -> y [1, 2]
        gather = (W.data_ptr(), 4, 8, x.data_ptr(), 1, 8, idx.data_ptr(), 2, y.data_ptr(), 1, 1)
        # scatter: W_t [4, 8] (ldw 8), v [1, 2], idx [2] -> y [1, 8]
        scatter = (W.data_ptr(), 4, 8, v.data_ptr(), 1, 2, idx.data_ptr(), 8, y.data_ptr(), 1, 1)
        assert lib.gather_gemv_f32(*gather) == cpu.BAD_INDEX
        assert lib.scatter_gemv_f32(*scatter) == cpu.BAD_INDEX
    assert torch.equal(y, torch.zeros(8))  # refused before writing anything


@pytest.mark.parametrize("mode", ["idx", "threshold"])
def test_split_k_partial_sums_add_up_to_the_reference(monkeypatch, mode):
    """The column-sparse kernel's split-K path (used on GPUs) on the interpreter: 3 slices."""
    monkeypatch.setattr(kernels.column_sparse, "split_count", lambda rows, programs, dev: 3)
    gen = seeded("split-k", mode)
    W_t, x = randn(100, 45, gen=gen), randn(2, 100, gen=gen)
    if mode == "idx":
        idx = torch.randperm(100, generator=gen)[:70]
        out, ref = (
            kernels.scatter_gemv(W_t, x, idx=idx),
            scatter_gemv_ref(W_t, x, idx=idx),
        )
    else:
        out = kernels.scatter_gemv(W_t, x, threshold=0.5)
        ref = scatter_gemv_ref(W_t, x, threshold=0.5)
    assert rel_err(out, ref) < RTOL


# ---- int8 weights: the sparse kernels over chapter 09's codes ---------------------------------

INT8_BATCHES = [None, 3]  # a vector and a batch of 3 (the C loops)
PROMPT_BATCH = cpu_int8.LOOP_MAX_BATCH + 1  # the torch path (dequantized rows, matmul)


def int8_rows(rows: int, cols: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Codes [rows, cols] int8, one scale per row (chapter 09's per-channel symmetric format),
    and the dequantized weight in float64 (the reference's weight)."""
    qt = quantize_tensor(randn(rows, cols, gen=gen), QuantSpec(bits=8))
    scale = qt.scale.flatten().float()
    return qt.q, scale, qt.q.double() * scale.double()[:, None]


def int8_down(ffn: int, dim: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """down_proj [dim, ffn] quantized per output channel, stored transposed: codes [ffn, dim],
    scales [dim] (one per output column), and the dequantized W_down^T [ffn, dim] in float64."""
    q, scale, w = int8_rows(dim, ffn, gen)
    return q.T.contiguous(), scale, w.T


def batch_of(batch: int | None, width: int, gen: torch.Generator) -> torch.Tensor:
    return randn(width, gen=gen) if batch is None else randn(batch, width, gen=gen)


@pytest.mark.parametrize("kind", ["empty", "full", "random", "clustered"])
@pytest.mark.parametrize("batch", [*INT8_BATCHES, PROMPT_BATCH])
def test_int8_gather_gemv_matches_the_dequantized_float64_reference(kind, batch):
    gen = seeded("int8-gather", kind, batch)
    N, K = 157, 203
    q, scale, w = int8_rows(N, K, gen)
    x, idx = batch_of(batch, K, gen), make_idx(N, kind, gen)
    out = cpu_int8.gather_gemv_i8(q, scale, x, idx)
    assert out.shape == ((idx.numel(),) if batch is None else (batch, idx.numel()))
    assert out.dtype == torch.float32
    if idx.numel():
        assert rel_err(out, gather_gemv_ref(w, x.double(), idx)) <= RTOL


@pytest.mark.parametrize("mode", ["threshold", "empty", "full", "random", "clustered"])
@pytest.mark.parametrize("batch", [*INT8_BATCHES, PROMPT_BATCH])
def test_int8_scatter_gemv_matches_the_dequantized_float64_reference(mode, batch):
    gen = seeded("int8-scatter", mode, batch)
    K, N = 149, 211
    q_t, scale, w_t = int8_down(K, N, gen)
    x = batch_of(batch, K, gen)
    kw = {"threshold": 0.8} if mode == "threshold" else {"idx": make_idx(K, mode, gen)}
    out = cpu_int8.scatter_gemv_i8(q_t, scale, x, **kw)
    assert out.shape == (*x.shape[:-1], N)
    ref = scatter_gemv_ref(w_t, x.double(), **kw)
    if mode == "empty":
        assert torch.equal(out, torch.zeros_like(out))
    else:
        assert rel_err(out, ref) <= RTOL
    if mode == "threshold":  # the threshold really drops inputs
        assert rel_err(x.double() @ w_t, ref) > 1e-3


@pytest.mark.parametrize("act", ["silu", "relu", "gelu"])
@pytest.mark.parametrize("kind", ["empty", "full", "random", "clustered"])
@pytest.mark.parametrize("batch", INT8_BATCHES)
def test_int8_sparse_ffn_matches_the_dequantized_float64_reference(act, kind, batch):
    gen = seeded("int8-ffn", act, kind, batch)
    F_, D = 97, 131
    (qg, sg, wg), (qu, su, wu) = int8_rows(F_, D, gen), int8_rows(F_, D, gen)
    qd_t, sd, wd_t = int8_down(F_, D, gen)
    x, idx = batch_of(batch, D, gen), make_idx(F_, kind, gen)
    out = cpu_int8.sparse_ffn_i8(x, qg, sg, qu, su, qd_t, sd, idx, act)
    assert out.shape == x.shape
    if kind == "empty":
        assert torch.equal(out, torch.zeros_like(out))
        return
    ref = sparse_ffn_ref(x.double(), wg, wu, wd_t, idx, act)
    assert rel_err(out, ref) <= RTOL


def test_int8_gather_and_scatter_loops_with_and_without_prefetch(fast_path):
    gen = seeded("int8-loops")
    q, scale, w = int8_rows(300, 257, gen)
    x, idx = randn(3, 257, gen=gen), torch.randperm(300, generator=gen)[:100]
    a = cpu_int8.gather_rows_dot_i8(q, scale, x, idx, prefetch=True)
    b = cpu_int8.gather_rows_dot_i8(q, scale, x, idx, prefetch=False)
    assert torch.equal(a, b) and rel_err(a, gather_gemv_ref(w, x.double(), idx)) <= RTOL
    v = randn(3, 100, gen=gen)
    q_t, s_t, w_t = int8_down(300, 75, gen)
    y = cpu_int8.scatter_rows_sum_i8(q_t, s_t, v, idx)
    assert torch.equal(y, cpu_int8.scatter_rows_sum_i8(q_t, s_t, v, idx, prefetch=False))
    assert rel_err(y, v.double() @ w_t[idx]) <= RTOL


def test_int8_loops_split_over_threads_give_the_same_sums(fast_path):
    """Above the parallel minimum (2^20 weights) the rows are split over threads."""
    gen = seeded("int8-threads")
    F_, D = 1500, 1000
    (qg, sg, wg), (qu, su, wu) = int8_rows(F_, D, gen), int8_rows(F_, D, gen)
    qd_t, sd, wd_t = int8_down(F_, D, gen)
    x, idx = randn(2, D, gen=gen), torch.randperm(F_, generator=gen)[:1200]
    ref = sparse_ffn_ref(x.double(), wg, wu, wd_t, idx, "silu")
    old = torch.get_num_threads()
    try:
        outs = {}
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs[threads] = cpu_int8.sparse_ffn_i8(x, qg, sg, qu, su, qd_t, sd, idx, "silu")
            assert rel_err(outs[threads], ref) <= RTOL
            up = cpu_int8.gather_gemv_i8(qu, su, x, idx)
            assert rel_err(up, gather_gemv_ref(wu, x.double(), idx)) <= RTOL
    finally:
        torch.set_num_threads(old)
    assert rel_err(outs[1], outs[2]) <= RTOL


def test_int8_kernels_fall_back_to_torch_without_a_compiler(monkeypatch):
    gen = seeded("int8-fallback")
    (qg, sg, wg), (qu, su, wu) = int8_rows(40, 30, gen), int8_rows(40, 30, gen)
    qd_t, sd, wd_t = int8_down(40, 30, gen)
    x, idx = randn(2, 30, gen=gen), torch.tensor([4, 1, 39, 4])
    monkeypatch.setattr(cpu_int8, "int8_library", lambda: None)
    assert not cpu_int8.int8_fast_path_available()
    assert rel_err(cpu_int8.gather_gemv_i8(qg, sg, x, idx), x.double() @ wg[idx].T) <= RTOL
    h = randn(2, 40, gen=gen)
    out = cpu_int8.scatter_gemv_i8(qd_t, sd, h, idx=idx)
    assert rel_err(out, h[:, idx].double() @ wd_t[idx]) <= RTOL
    ffn = cpu_int8.sparse_ffn_i8(x[0], qg, sg, qu, su, qd_t, sd, idx, "gelu")
    assert rel_err(ffn, sparse_ffn_ref(x[0].double(), wg, wu, wd_t, idx, "gelu")) <= RTOL
    with pytest.raises(RuntimeError, match="falls back to torch"):
        cpu_int8.gather_rows_dot_i8(qg, sg, x, idx)


def test_int8_kernels_refuse_bad_codes_scales_and_indices():
    q, s = torch.zeros(10, 8, dtype=torch.int8), torch.ones(10)
    x = torch.randn(8)
    with pytest.raises(ValueError, match="int8 codes"):
        cpu_int8.gather_gemv_i8(q.float(), s, x, torch.tensor([0]))
    with pytest.raises(ValueError, match="10 scales"):
        cpu_int8.gather_gemv_i8(q, torch.ones(8), x, torch.tensor([0]))
    with pytest.raises(ValueError, match=r"outside \[0, 10\)"):
        cpu_int8.gather_gemv_i8(q, s, x, torch.tensor([0, 10]))
    with pytest.raises(ValueError, match=r"x must have shape \[8\]"):
        cpu_int8.gather_gemv_i8(q, s, torch.randn(9), torch.tensor([0]))
    with pytest.raises(ValueError, match="one per output column"):
        cpu_int8.scatter_gemv_i8(q, s, torch.randn(10), idx=torch.tensor([0]))
    with pytest.raises(ValueError, match="exactly one of threshold"):
        cpu_int8.scatter_gemv_i8(q, torch.ones(8), torch.randn(10))
    with pytest.raises(ValueError, match="Unknown activation"):
        cpu_int8.sparse_ffn_i8(x, q, s, q, s, q, torch.ones(8), torch.tensor([0]), "tanh")
    with pytest.raises(ValueError, match=r"must all be \[ffn, dim\]"):
        cpu_int8.sparse_ffn_i8(x, q, s, q, s, q[:9], torch.ones(8), torch.tensor([0]))


def test_int8_c_loops_check_every_index_themselves():
    lib = cpu_int8.int8_library()
    if lib is None:
        pytest.skip("no compiled library here")
    q, s = torch.ones(4, 8, dtype=torch.int8), torch.ones(8)
    x, v, y = torch.randn(8), torch.randn(2), torch.zeros(8)
    for bad in ([0, 4], [-1, 0], [0, 10**12]):
        idx = torch.tensor(bad)
        gather = (q.data_ptr(), 4, 8, s.data_ptr(), x.data_ptr(), 1, 8, idx.data_ptr(), 2)
        assert lib.gather_gemv_i8(*gather, y.data_ptr(), 1, 1) == cpu.BAD_INDEX
        scatter = (q.data_ptr(), 4, 8, s.data_ptr(), v.data_ptr(), 1, 2, idx.data_ptr(), 8)
        assert lib.scatter_gemv_i8(*scatter, y.data_ptr(), 1, 1) == cpu.BAD_INDEX
        ffn = (q.data_ptr(), s.data_ptr(), q.data_ptr(), s.data_ptr(), q.data_ptr(), s.data_ptr())
        rest = (4, 8, x.data_ptr(), 1, idx.data_ptr(), 2, 0, y.data_ptr(), 1, 1)
        assert lib.sparse_ffn_i8(*ffn, *rest) == cpu.BAD_INDEX
    assert torch.equal(y, torch.zeros(8))  # refused before writing anything
