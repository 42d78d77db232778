"""The Triton kernels compiled for a real GPU, and the model's CUDA paths, against references.

Everything else in the suite runs the Triton kernels in the interpreter on CPU tensors; these
tests need a CUDA device and are skipped (with that reason) without one. They compare:

* each Triton kernel in float32, float16 and bfloat16 with its reference evaluated in float64,
  on odd shapes (no multiple of a block size), empty, full, random and repeated index sets,
  batch 1 and batch > 1;
* ``SparseMLP`` with the Triton backend against the masked dense MLP;
* the hot/cold executor with its hot part on the GPU against the unsplit masked model;
* cached greedy decoding on the GPU against the same model on the CPU.
"""

from __future__ import annotations

import copy
import zlib

import pytest
import torch
from test_kernels import make_idx

from conftest import IdTokenizer, tiny_model
from minisparse import kernels
from minisparse.kernels.reference import (
    gather_gemv_ref,
    scatter_gemv_ref,
    sparse_ffn_ref,
)

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device: the GPU kernels cannot run here"
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Relative error (max |out - ref| / max |ref|) allowed per dtype: the output's own rounding
# (fp32 1e-7, fp16 5e-4, bf16 4e-3) plus accumulation-order differences.
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
SHAPES = [(37, 29), (300, 129), (1536, 576), (4099, 1031)]  # rows (neurons) x inputs
INDEX_KINDS = ["empty", "full", "random", "clustered", "repeated"]


def seeded(*key: object) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def indices(n: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    if kind == "repeated":  # with repeats, any order
        return torch.randint(0, n, (max(2, n // 4),), generator=gen)
    return make_idx(n, kind, gen)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if ref.numel() == 0:
        return 0.0
    scale = ref.abs().max().item() or 1.0
    return (out.double() - ref.double()).abs().max().item() / scale


def on_gpu(*tensors: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]:
    return [t.to("cuda", dtype if t.is_floating_point() else t.dtype) for t in tensors]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("kind", INDEX_KINDS)
@pytest.mark.parametrize("batch", [None, 3])
@pytest.mark.parametrize("fn", [kernels.gather_gemv, kernels.gather_gemv_naive])
def test_row_sparse_gemv_on_the_gpu(fn, batch, kind, shape, dtype):
    n, k = shape
    gen = seeded("row", fn.__name__, batch, kind, shape, str(dtype))
    W = torch.randn(n, k, generator=gen)
    x = torch.randn(*(() if batch is None else (batch,)), k, generator=gen)
    idx = indices(n, kind, gen)
    W_g, x_g, idx_g = on_gpu(W, x, idx, dtype=dtype)
    out = fn(W_g, x_g, idx_g)
    assert out.device.type == "cuda" and out.dtype == dtype
    ref = gather_gemv_ref(W_g.cpu().double(), x_g.cpu().double(), idx)
    assert out.shape == ref.shape
    assert rel_err(out.cpu(), ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("mode", ["threshold", *INDEX_KINDS])
@pytest.mark.parametrize("batch", [None, 3])
def test_column_sparse_gemv_on_the_gpu(batch, mode, shape, dtype):
    k, n = shape  # W_t is [inputs, outputs]
    gen = seeded("column", batch, mode, shape, str(dtype))
    W_t = torch.randn(k, n, generator=gen)
    x = torch.randn(*(() if batch is None else (batch,)), k, generator=gen)
    W_g, x_g = on_gpu(W_t, x, dtype=dtype)
    if mode == "threshold":
        out = kernels.scatter_gemv(W_g, x_g, threshold=0.7)
        ref = scatter_gemv_ref(W_g.cpu().double(), x_g.cpu().double(), threshold=0.7)
    else:
        idx = indices(k, mode, gen)
        out = kernels.scatter_gemv(W_g, x_g, idx=idx.cuda())
        ref = scatter_gemv_ref(W_g.cpu().double(), x_g.cpu().double(), idx=idx)
    assert out.device.type == "cuda" and out.dtype == dtype and out.shape == ref.shape
    assert rel_err(out.cpu(), ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(29, 37), (129, 300), (576, 1536)], ids=str)
@pytest.mark.parametrize("kind", INDEX_KINDS)
@pytest.mark.parametrize("act", ["silu", "relu", "gelu"])
@pytest.mark.parametrize("batch", [None, 2])
@pytest.mark.parametrize("fn", [kernels.sparse_ffn, kernels.sparse_ffn_unfused])
def test_sparse_ffn_on_the_gpu(fn, batch, act, kind, shape, dtype):
    dim, ffn = shape
    gen = seeded("ffn", fn.__name__, batch, act, kind, shape, str(dtype))
    W_gate, W_up = torch.randn(ffn, dim, generator=gen), torch.randn(ffn, dim, generator=gen)
    W_down_t = torch.randn(ffn, dim, generator=gen)
    x = torch.randn(*(() if batch is None else (batch,)), dim, generator=gen) / dim**0.5
    idx = indices(ffn, kind, gen)
    tensors = on_gpu(x, W_gate, W_up, W_down_t, idx, dtype=dtype)
    out = fn(*tensors, act)
    assert out.device.type == "cuda" and out.dtype == dtype
    ref = sparse_ffn_ref(
        *(t.cpu().double() if t.is_floating_point() else t.cpu() for t in tensors), act
    )
    assert out.shape == ref.shape
    assert rel_err(out.cpu(), ref) < TOL[dtype]


def test_a_bad_index_on_the_gpu_is_a_clear_error():
    W, x = torch.randn(8, 5, device="cuda"), torch.randn(5, device="cuda")
    with pytest.raises(ValueError, match="outside"):
        kernels.gather_gemv(W, x, torch.tensor([0, 8], device="cuda"))


@torch.inference_mode()
def test_sparse_mlp_with_the_triton_backend_matches_the_masked_mlp():
    from minisparse.sparse import MaskedMLP, SparseMLP

    model = tiny_model(seed=3).cuda()
    mlp = model.layers[0].mlp
    x = torch.randn(5, model.config.dim, generator=seeded("mlp")).cuda()
    sparse = SparseMLP(copy.deepcopy(mlp), threshold=0.01, backend="triton")
    out = sparse(x)
    keep = sparse.last_keep
    assert 0.1 < keep.float().mean() < 0.9
    reference = MaskedMLP(copy.deepcopy(mlp), keep=keep)(x)
    assert (out - reference).abs().max() < 1e-5 * max(1.0, reference.abs().max().item())


@torch.inference_mode()
def test_hot_cold_model_with_its_hot_part_on_the_gpu_matches_the_masked_model():
    from minisparse import offload as O
    from minisparse.offload import hybrid as H
    from minisparse.sparse import MaskedMLP, swap_mlps_
    from minisparse.sparsity import cats_thresholds

    model = tiny_model(seed=0)
    tokens = torch.randint(0, model.config.vocab_size, (2, 24), generator=seeded("hotcold"))
    thresholds = cats_thresholds(model, tokens, 0.5)
    f = O.profile(model, tokens, thresholds, progress=False)
    nb = O.neuron_bytes(model)
    placement = O.place(f, nb, O.budget_for(f, nb, 0.4))
    hybrid = H.apply(model, placement, thresholds=thresholds, fast_device="cuda")
    fast = [layer.mlp.fast for layer in hybrid.layers if layer.mlp.fast is not None]
    assert fast and {part.W_gate.device.type for part in fast} == {"cuda"}
    out = hybrid(tokens)
    masks = [layer.mlp.keep() for layer in hybrid.layers]
    reference = copy.deepcopy(model)
    swap_mlps_(
        reference,
        [MaskedMLP(layer.mlp, keep=m) for layer, m in zip(reference.layers, masks, strict=True)],
    )
    assert (out - reference(tokens)).abs().max() < 1e-4
    # the profile ran on the CPU: a few activations within rounding of a threshold can flip
    assert H.executed_load(hybrid) == pytest.approx(placement.load(f), abs=1e-2)


@torch.inference_mode()
def test_greedy_decoding_on_the_gpu_gives_the_cpu_tokens():
    from minisparse.runtime.generate import generate

    model = tiny_model(seed=5, std=0.2)
    prompt = "5 17 3 88 41 2 60"
    cpu_tokens = generate(model, IdTokenizer(), prompt, max_new_tokens=20)
    gpu_tokens = generate(copy.deepcopy(model).cuda(), IdTokenizer(), prompt, max_new_tokens=20)
    assert len(cpu_tokens) == 20 and gpu_tokens == cpu_tokens


def test_a_kernel_captured_in_a_cuda_graph_reads_the_indices_of_each_replay():
    gen = seeded("graph")
    W = torch.randn(300, 129, generator=gen).cuda()
    x = torch.randn(129, generator=gen).cuda()
    idx = torch.randperm(300, generator=gen)[:50].cuda()
    kernels.gather_gemv(W, x, idx)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = kernels.gather_gemv(W, x, idx)
    for trial in range(3):
        idx.copy_(torch.randperm(300, generator=gen)[:50].cuda())
        graph.replay()
        ref = gather_gemv_ref(W.cpu().double(), x.cpu().double(), idx.cpu())
        assert rel_err(y.cpu(), ref) < TOL[torch.float32], trial


def test_the_kernel_benchmark_times_graph_replays():
    from minisparse.bench.kernels import bench_shape

    rows = bench_shape(256, 512, (0.5,), repeats=3, warmup=1, device="cuda", cuda_graphs=True)
    assert len(rows) == 3 and all(r.sparse_ms > 0 and r.dense_ms > 0 for r in rows)
