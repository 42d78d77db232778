"""The compiled libraries built for other x86 instruction sets than this machine's best.

The rest of the suite runs the libraries ``-march=native`` gives, so a machine with AVX-512
never runs the AVX2 code of ``simd.h`` (v16 as two 8-float registers, with its own loads and
conversions) nor the generic one (plain vector arithmetic, no intrinsics). Here the same
sources are compiled for each of them, and for AVX-512 under a 256-bit tuning: the decode step
must give the logits torch gives (float32, int8 and int4 weights, thresholded and predicted
sparse MLPs, one token and several), and the chapter 07 sparse loops, float32 and int8, the
float64 references' values.
"""

from __future__ import annotations

import ctypes
import platform
import subprocess
from pathlib import Path

import pytest
import torch
from test_decode import INT4_SHAPE, assert_close, low_bit, predicted_model
from test_kernels import RTOL, int8_down, int8_rows, make_idx, randn, rel_err, seeded

from conftest import tiny_model
from minisparse.core.model import make_cache
from minisparse.kernels import cpu, cpu_int8, cpu_isa
from minisparse.kernels.cpu_build import (
    BASE_FLAGS,
    LOOPS_SOURCE,
    declare_loops,
    find_compiler,
    resolve_compiler,
    with_local_headers,
)
from minisparse.kernels.reference import gather_gemv_ref, scatter_gemv_ref, sparse_ffn_ref
from minisparse.runtime.decoder import Decoder
from minisparse.runtime.step import declare_step_library
from minisparse.sparse import sparsify

#: instruction set -> the flags that select its code in simd.h. "avx512-256": AVX-512 tuned for
#: a core that prefers 256-bit vectors (the tuning GCC 12's -march=native picks on Intel Xeons
#: of the Ice Lake / Rocket Lake kind), whose spills made the decode step 3x slower.
TARGETS = {
    "avx2": "-march=haswell",
    "generic": "-march=x86-64",
    "avx512-256": "-march=x86-64-v4 -mtune=rocketlake",
}
KERNELS = Path(__file__).parents[1] / "minisparse" / "kernels"
AVX512_FLAGS = {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}  # x86-64-v4


def cpu_flags() -> set[str]:
    try:
        return cpu_isa.cpu_flags(Path("/proc/cpuinfo").read_text())
    except OSError:
        return set()


def _runs_here(isa: str) -> str | None:
    """Why this machine cannot build or run ``isa`` code, or None."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "not an x86-64 machine"
    if isa == "avx2" and torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return "this CPU has no AVX2"
    if isa == "avx512-256" and not AVX512_FLAGS <= cpu_flags():
        return "this CPU lacks one of " + ", ".join(sorted(AVX512_FLAGS))
    if resolve_compiler(find_compiler() or "") is None:
        return "no C compiler"
    return None


def build(source: str, declare, isa: str, folder: Path) -> ctypes.CDLL:
    """``source`` compiled for ``isa`` (with OpenMP when the compiler has it), declared."""
    compiler = resolve_compiler(find_compiler() or "")
    src, out = folder / "source.c", folder / "library.so"
    src.write_text(source)
    base = [*compiler.command, *BASE_FLAGS, str(src), "-o", str(out), "-lm", *TARGETS[isa].split()]
    for extra in (["-fopenmp"], []):
        if subprocess.run(base + extra, capture_output=True, check=False).returncode == 0:
            break
    else:
        pytest.fail(f"{compiler.path} could not compile for {TARGETS[isa]}")
    lib = ctypes.CDLL(str(out))
    declare(lib)
    return lib


@pytest.fixture(scope="module", params=list(TARGETS))
def isa(request) -> str:
    reason = _runs_here(request.param)
    if reason:
        pytest.skip(reason)
    return request.param


@pytest.fixture(scope="module")
def library(isa, tmp_path_factory) -> ctypes.CDLL:
    """runtime/step.c compiled for the instruction set."""
    source = with_local_headers((KERNELS.parent / "runtime" / "step.c").read_text())
    return build(source, declare_step_library, isa, tmp_path_factory.mktemp(f"decode-{isa}"))


@pytest.fixture(scope="module")
def loops(isa, tmp_path_factory) -> tuple[ctypes.CDLL, ctypes.CDLL]:
    """The float32 sparse loops (cpu.c) and the int8 ones (cpu_int8.c)."""
    folder = tmp_path_factory.mktemp(f"loops-{isa}")
    f32 = build(LOOPS_SOURCE, declare_loops, isa, folder)
    int8_folder = tmp_path_factory.mktemp(f"int8-{isa}")
    int8 = with_local_headers((KERNELS / "cpu_int8.c").read_text())
    return f32, build(int8, cpu_int8.declare_int8_loops, isa, int8_folder)


def check(model, reference, lib: ctypes.CDLL, n: int, seed: int) -> None:
    """Three single steps, then one call of n tokens, against reference's cached forward."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, model.config.vocab_size, (1, 9 + n), generator=gen)
    with torch.inference_mode():
        ref_cache, dec_cache = make_cache(model.config, 1, 16), make_cache(model.config, 1, 16)
        for cache in (ref_cache, dec_cache):
            reference(tokens[:, :6], torch.arange(6), cache)
        decoder = Decoder(model, dec_cache)
        assert all(line.endswith(": C") for line in decoder.plan()) and decoder.c_head
        decoder.lib = lib
        for p in range(6, 9):
            ref = reference(tokens[:, p : p + 1], torch.tensor([p]), ref_cache)[0, 0]
            assert_close(ref, decoder.step(int(tokens[0, p]), p))
        ref = reference(tokens[:, 9:], torch.arange(9, 9 + n), ref_cache)[0]
        assert_close(ref, decoder.forward(tokens[0, 9:].tolist(), 9))


@pytest.mark.parametrize("weights", ["fp32", "int8", "int4"])
def test_dense_steps_equal_torch(library, weights):
    model, reference = low_bit(tiny_model(seed=21, std=0.1, **INT4_SHAPE), weights)
    check(model, reference, library, n=5, seed=22)


@pytest.mark.parametrize("mode", ["threshold", "lowrank"])
def test_sparse_mlp_steps_equal_torch(library, mode):
    if mode == "threshold":
        model = tiny_model(seed=23, std=0.1)
        sparsify(model, thresholds=0.1)
    else:
        model = predicted_model(mode)
    check(model, model, library, n=3, seed=24)
    assert all(0.05 < layer.mlp.last_density < 1 for layer in model.layers)


@pytest.mark.parametrize("kind", ["random", "clustered", "full"])
@pytest.mark.parametrize("batch", [None, 3])
def test_sparse_loops_equal_the_float64_references(loops, monkeypatch, kind, batch):
    """gather_gemv, scatter_gemv and sparse_ffn over float32 and int8 weights, each run
    through this instruction set's loops (odd sizes: the vector loops and their tails)."""
    f32, int8 = loops
    monkeypatch.setattr(cpu, "load_library", lambda: f32)
    monkeypatch.setattr(cpu_int8, "int8_library", lambda: int8)
    gen = seeded("isa", kind, batch)
    F_, D = 97, 131
    W_gate, W_up, W_down_t = (randn(F_, D, gen=gen) for _ in range(3))
    x = randn(D, gen=gen) if batch is None else randn(batch, D, gen=gen)
    idx = make_idx(F_, kind, gen)
    g64, x64 = W_gate.double(), x.double()
    assert rel_err(cpu.gather_gemv(W_gate, x, idx), gather_gemv_ref(g64, x64, idx)) <= RTOL
    v = randn(F_, gen=gen) if batch is None else randn(batch, F_, gen=gen)
    got = cpu.scatter_gemv(W_down_t, v, idx=idx)
    assert rel_err(got, scatter_gemv_ref(W_down_t.double(), v.double(), idx=idx)) <= RTOL
    ref = sparse_ffn_ref(x64, g64, W_up.double(), W_down_t.double(), idx, "silu")
    assert rel_err(cpu.sparse_ffn(x, W_gate, W_up, W_down_t, idx, "silu"), ref) <= RTOL
    (qg, sg, wg), (qu, su, wu) = int8_rows(F_, D, gen), int8_rows(F_, D, gen)
    qd_t, sd, wd_t = int8_down(F_, D, gen)
    got = cpu_int8.gather_gemv_i8(qg, sg, x, idx)
    assert rel_err(got, gather_gemv_ref(wg, x64, idx)) <= RTOL
    got = cpu_int8.sparse_ffn_i8(x, qg, sg, qu, su, qd_t, sd, idx, "relu")
    assert rel_err(got, sparse_ffn_ref(x64, wg, wu, wd_t, idx, "relu")) <= RTOL
