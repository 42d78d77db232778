"""Chapter 07's builds: a row-sparse GEMV kernel in Triton, and where the chapter runs it.

``row_sparse_gemv(W, x, idx)`` is the learner's ``@triton.jit`` kernel and its launcher:

    y_i = sum_k W[idx_i, k] x_k,        i = 0 .. m - 1

reading only the m rows named by ``idx`` (any order, repeats allowed, possibly none). It is graded
against ``kernels.reference.gather_gemv_ref``, the definition the library's own Triton kernel
(``kernels.gather_gemv``) is tested against and what the chapter runs until the learner's kernel
passes (fast on a CPU, where the kernels are interpreted), on odd shapes: K never a multiple of
a block size, m = 0, more entries than rows. Each case hands the kernel W as a view of wider
memory (rows ``W.stride(0)`` = K + 5 elements apart) with NaN in the gaps and past the ends of
W, x and idx, so three mistakes show up as wrong numbers instead of passing by luck: reading rows
0 .. m - 1 instead of idx, a load without the ``ks < K`` mask on the last block of a row (it
reads NaN), and a row address computed with K instead of the row stride. On a CPU the launches
run in Triton's interpreter (``kernels.interpreter.interpreted_launches``), whether or not
``TRITON_INTERPRET`` was set when the kernel was defined.

``row_kernel_in(mlps, gemv)`` then makes the chapter's ``SparseMLP`` modules compute their
row-sparse products with it (``SparseMLP.gather``), one token at a time.

The column-sparse product of the chapter, ``scatter_gemv(W_t, x, threshold)`` (a small exercise
registered with the others), runs inside the model through ``down_with``: every layer's down
projection becomes y = scatter_gemv(W_down^T, h, t_l), TEAL's thresholded down projection in
which the rows of W_down^T whose input |h_k| <= t_l are never read.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ...core.model import Transformer
from ...kernels.interpreter import interpreted_launches
from ...kernels.reference import gather_gemv_ref
from ...sparse.mlp import SparseMLP
from ..grading import Exercise, loose, register

__all__ = ["ScatterDown", "down_with", "row_kernel_in"]

Cases = list[tuple[Any, ...]]
Gemv = Callable[[Tensor, Tensor, Tensor], Tensor]  # (W [N, K], x [K], idx [m]) -> [m]
Scatter = Callable[[Tensor, Tensor, float], Tensor]  # (W_t [K, N], x [B, K], t) -> [B, N]

GAP = 5  # extra elements between two rows of W in the memory the check hands the kernel
TAIL = 2048  # NaN past the end of W and x (and zeros past idx): an unmasked block reads them


def _gemv_cases(gen: torch.Generator) -> Cases:
    out: Cases = []
    shapes = ((1, 1, 1), (6, 7, 3), (40, 130, 17), (64, 300, 0), (20, 33, 45), (37, 517, 9))
    for n, k, m in shapes:  # (rows N, columns K, outputs m); 45 > 20: repeated rows
        W = torch.randn(n, k, generator=gen)
        idx = torch.randint(0, n, (m,), generator=gen)  # any order
        out.append((W, torch.randn(k, generator=gen), idx))
    W = torch.randn(29, 257, generator=gen)
    out.append((W, torch.randn(257, generator=gen), torch.randperm(29, generator=gen)[:13]))
    return out


def _in_wide_memory(W: Tensor, x: Tensor, idx: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The same values, laid out as a kernel may meet them: W a view of a wider matrix, NaN in
    the gaps between rows and past the ends of W and x, zeros (a valid row) past idx."""
    n, k = W.shape
    flat = torch.full((n * (k + GAP) + TAIL,), math.nan, dtype=W.dtype)
    wide = flat[: n * (k + GAP)].view(n, k + GAP)[:, :k]
    wide.copy_(W)
    xs = torch.full((k + TAIL,), math.nan, dtype=x.dtype)
    xs[:k] = x
    ids = torch.zeros(idx.numel() + TAIL, dtype=idx.dtype)
    ids[: idx.numel()] = idx
    return wide, xs[:k], ids[: idx.numel()]


def _launched(gemv: Gemv, args: tuple[Any, ...]) -> Tensor:
    """Call ``gemv`` on the case laid out in wide memory; CPU launches run interpreted."""
    with interpreted_launches():
        return gemv(*_in_wide_memory(*args))


def _library_gemv(W: Tensor, x: Tensor, idx: Tensor) -> Tensor:
    return gather_gemv_ref(W, x, idx)


register(
    "row_sparse_gemv",
    Exercise(
        "07",
        "row_sparse_gemv(W [N, K], x [K], idx [m]) -> y [m] float32, y[i] = sum_k W[idx[i], k] "
        "x[k], computed by a @triton.jit kernel that you launch over blocks of the m outputs: "
        "only the rows idx of W are read; idx in any order, with repeats, possibly empty (m = 0); "
        "W may be a view of a wider matrix: its rows are W.stride(0) elements apart, its "
        "columns adjacent",
        _library_gemv,
        _gemv_cases,
        loose,
        "program p owns outputs i = p * BLOCK_M + tl.arange(0, BLOCK_M) (mask i < m) and reads "
        "rows r = tl.load(idx + i), not rows i; walk each row in blocks ks = k0 + tl.arange(0, "
        "BLOCK_K) with mask ks < K on the W and the x loads (past a row's end lies other memory: "
        "the check puts NaN there); row r starts at W + r * W.stride(0); for m = 0 return an "
        "empty tensor without launching",
        run=_launched,
        core=True,
    ),
)


def _per_token(gemv: Gemv) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """A ``SparseMLP.gather`` from a one-vector gemv: x [tokens, K] -> [tokens, m]."""

    def gather(W: Tensor, x: Tensor, idx: Tensor) -> Tensor:
        with interpreted_launches():
            rows = [gemv(W, token.contiguous(), idx).to(x.dtype) for token in x]
        return torch.stack(rows) if rows else x.new_zeros(0, idx.numel())

    return gather


@contextlib.contextmanager
def row_kernel_in(mlps: Sequence[nn.Module], gemv: Gemv) -> Iterator[None]:
    """Within the block the ``SparseMLP`` modules of ``mlps`` run ``gemv`` for their rows.

    ``gemv(W, x [K], idx) -> [m]`` computes the row-sparse products (the active rows of up; of
    gate and up in select mode), one token at a time; the modules' own kernels come back after.
    """
    sparse = [m for m in mlps if isinstance(m, SparseMLP)]
    if not sparse or any(m.int8 for m in sparse):
        raise ValueError(
            "row_kernel_in needs float32 SparseMLP modules (minisparse.sparse.sparse_mlps)."
        )
    before = [m.gather for m in sparse]
    try:
        for m in sparse:
            m.gather = _per_token(gemv)
        yield
    finally:
        for m, old in zip(sparse, before, strict=True):
            m.gather = old


class ScatterDown(nn.Module):
    """A down projection computed by a column-sparse product: y = scatter(W_down^T, h, t).

    The rows of W_down^T whose input |h_k| <= t are not part of the sum (TEAL's thresholded
    down projection)."""

    def __init__(self, down: nn.Module, threshold: float, scatter: Scatter) -> None:
        super().__init__()
        if getattr(down, "bias", None) is not None:
            raise ValueError("ScatterDown takes a bias-free down projection (the Llama family).")
        self.register_buffer("W_t", down.weight.detach().T.contiguous(), persistent=False)
        self.threshold, self.scatter = float(threshold), scatter
        self.read = 1.0  # share of W_t's rows the last call needed (over its tokens)
        self.last_in: Tensor | None = None  # the last call's h [tokens, K] and y [tokens, N],
        self.last_out: Tensor | None = None  # to hold against a reference on the same input

    def forward(self, h: Tensor) -> Tensor:
        flat = h.reshape(-1, h.shape[-1])
        self.read = float((flat.abs() > self.threshold).float().mean())
        y = self.scatter(self.W_t, flat, self.threshold)
        self.last_in, self.last_out = flat.detach(), y.detach()
        return y.reshape(*h.shape[:-1], y.shape[-1])


@contextlib.contextmanager
def down_with(
    model: Transformer, thresholds: Sequence[float], scatter: Scatter
) -> Iterator[list[ScatterDown]]:
    """Within the block, layer l's down projection is ``scatter(W_down^T, h, thresholds[l])``.

    Yields the ``ScatterDown`` modules; the model's own projections come back on exit."""
    layers = list(model.layers)
    if len(thresholds) != len(layers):
        raise ValueError(f"Got {len(thresholds)} thresholds for {len(layers)} layers.")
    originals = [layer.mlp.down_proj for layer in layers]
    try:
        downs = [ScatterDown(d, t, scatter) for d, t in zip(originals, thresholds, strict=True)]
        for layer, down in zip(layers, downs, strict=True):
            layer.mlp.down_proj = down
        yield downs
    finally:
        for layer, down in zip(layers, originals, strict=True):
            layer.mlp.down_proj = down
