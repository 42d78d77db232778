"""Chapter 07's core build: the check rejects the plausible wrong Triton kernels, and the learner's
kernel (and column-sparse product) run inside the model's sparse MLPs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

import triton
import triton.language as tl

from conftest import tiny_model
from minisparse import sparse as S
from minisparse.core.model import make_cache
from minisparse.course.builds.ch07 import down_with, row_kernel_in
from minisparse.course.plug import solution
from minisparse.sparse.lowering import sparse_mlp_layer
from minisparse.sparsity import calibrate_thresholds, cats_thresholds, thresholds_applied

SOLUTIONS = Path(__file__).resolve().parents[1] / "notebooks" / "solutions"
gemv = solution("row_sparse_gemv", SOLUTIONS)
scatter = solution("scatter_gemv", SOLUTIONS)
BLOCK_M, BLOCK_K = 16, 64


@triton.jit
def _rows_in_order(W, x, idx, y, m, K, stride_w, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Reads rows 0 .. m - 1: idx is never loaded."""
    i = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    live = i < m
    acc = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        inside = ks < K
        w = tl.load(W + i[:, None] * stride_w + ks[None, :], mask=live[:, None] & inside[None, :])
        acc += w * tl.load(x + ks, mask=inside, other=0.0)[None, :]
    tl.store(y + i, tl.sum(acc, axis=1), mask=live)


@triton.jit
def _no_tail_mask(W, x, idx, y, m, K, stride_w, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Loads whole blocks of a row: the last one runs past the row's end."""
    i = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    live = i < m
    rows = tl.load(idx + i, mask=live, other=0).to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(W + rows[:, None] * stride_w + ks[None, :], mask=live[:, None], other=0.0)
        acc += w * tl.load(x + ks)[None, :]
    tl.store(y + i, tl.sum(acc, axis=1), mask=live)


def _launcher(kernel, row_stride):
    def row_sparse_gemv(W, x, idx):
        m = idx.numel()
        y = torch.empty(m, dtype=torch.float32)
        if m:
            grid = (triton.cdiv(m, BLOCK_M),)
            args = (W, x, idx, y, m, W.shape[1], row_stride(W))
            kernel[grid](*args, BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K)
        return y

    return row_sparse_gemv


def nan_leaks(W_t, x, t):
    """A masked dense product: 0 x NaN = NaN when an inactive row of W_t holds a NaN."""
    return (x * (x.abs() > t)) @ W_t


def at_or_above(W_t, x, t):
    """|x| >= t instead of > t: an input exactly at the threshold counts as active."""
    return scatter(W_t, torch.where(x.abs() >= t, x, 0.0), -1.0)


def one_set_for_the_batch(W_t, x, t):
    """The union of the rows' active channels, used for every row of the batch."""
    active = (x.abs() > t).reshape(-1, x.shape[-1]).any(0)
    return x[..., active] @ W_t[active]


WRONG = {
    "row_sparse_gemv": [
        _launcher(_rows_in_order, lambda W: W.stride(0)),  # idx ignored
        _launcher(_no_tail_mask, lambda W: W.stride(0)),  # no mask on the last K block
        _launcher(gemv.__globals__["row_sparse_kernel"], lambda W: W.shape[1]),  # rows K apart
    ],
    "scatter_gemv": [nan_leaks, at_or_above, one_set_for_the_batch],
}


def test_the_kernel_runs_on_cpu_tensors_without_triton_interpret():
    """The check and the plug interpret CPU launches; the kernel stays a compiled-kind one."""
    W, x, idx = torch.randn(9, 7), torch.randn(7), torch.tensor([8, 0, 8])
    from minisparse.kernels.interpreter import interpreted_launches

    with interpreted_launches():
        y = gemv(W, x, idx)
    assert torch.allclose(y, W[idx] @ x, atol=1e-5)
    assert type(gemv.__globals__["row_sparse_kernel"]).__name__ == "JITFunction"
    from triton.runtime.jit import JITFunction

    assert "__getitem__" not in JITFunction.__dict__  # launches compile again after the block


def decode_logits(model, mlps, tokens):
    """Logits of a decode step after a prompt, the model running ``mlps``."""
    with torch.no_grad(), S.using_mlps(model, mlps):
        cache = make_cache(model.config, 1, 16)
        model(tokens[:, :-1], torch.arange(tokens.shape[1] - 1), cache)
        return model(tokens[:, -1:], torch.arange(tokens.shape[1] - 1, tokens.shape[1]), cache)


@pytest.mark.parametrize("mode", ["threshold", "select"])
def test_the_learners_kernel_computes_the_sparse_mlps(mode):
    model = tiny_model(seed=1)
    tokens = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(2))
    if mode == "threshold":
        mlps = S.sparse_mlps(model, cats_thresholds(model, tokens, 0.5))
    else:
        keep = torch.randperm(model.config.ffn_dim, generator=torch.Generator().manual_seed(3))
        mlps = S.sparse_mlps(model, select=lambda layer, x: keep[: 40 + 10 * layer])
    want = decode_logits(model, mlps, tokens)
    calls = []

    def counted(W, x, idx):
        calls.append(idx.numel())
        return gemv(W, x, idx)

    with row_kernel_in(mlps, counted):
        assert all(sparse_mlp_layer(m, None, None, []) is None for m in mlps)  # stays in torch
        got = decode_logits(model, mlps, tokens)
    assert len(calls) >= len(mlps) * (1 if mode == "threshold" else 2) and sum(calls) > 0
    assert torch.allclose(got, want, atol=1e-5)
    assert all(m.gather is None for m in mlps)  # the library's kernels are back


def test_the_learners_scatter_gemv_is_teals_down_projection():
    model = tiny_model(seed=2)
    tokens = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(4))
    teal = calibrate_thresholds(model, tokens, 0.5, progress=False)["down_in"]
    with torch.no_grad():
        with thresholds_applied(model, {"down_in": teal}):
            want = model(tokens)
        with down_with(model, teal, scatter) as downs:
            got = model(tokens)
            read = [d.read for d in downs]
    assert torch.allclose(got, want, atol=1e-5)
    assert all(0.3 < r < 0.7 for r in read)  # about half the rows of W_down^T read
    assert all(type(layer.mlp.down_proj).__name__ == "Linear" for layer in model.layers)
