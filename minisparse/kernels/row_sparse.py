"""Row-sparse GEMV in Triton: read only the weight rows of the active neurons.

The gate and up projections of a gated FFN compute one output per neuron, ``g_j = W[j] . x``,
and ``W`` (``nn.Linear.weight``, shape [N, K]) is stored row-major, so neuron j's weights are
one contiguous run of K numbers. If a predictor (DejaVu) or a threshold says which neurons
``idx`` will be active, the kernel computes

    y_i = sum_k W[idx_i, k] x_k        i = 0 .. n - 1,  n = len(idx)

and reads n K elements of W instead of N K. At batch 1 the GEMV is memory-bound, so the time
falls with the bytes: at best ``n / N = 1 - s`` of the dense time.

Two versions, naive to fast:

* ``gather_gemv_naive``: one program per active row; it walks the row in blocks of BLOCK_K and
  reduces. Simple, but each program does little work and the grid has n programs.
* ``gather_gemv``: each program owns BLOCK_N active rows and loads a [BLOCK_N, BLOCK_K] tile per
  step, with a 2-D accumulator reduced once at the end: fewer programs, wide loads, and rows
  whose indices are consecutive land in adjacent memory.

Both accumulate in float32 whatever the input dtype, and mask the tails so K and n need not be
multiples of the block sizes. A batch x [B, K] runs one program column per batch row; all rows
share ``idx`` (the union of their active sets), so the weight bytes stay those of n rows while
the work grows with B (on a GPU the B re-reads of a tile hit the L2 cache).

References: DejaVu (Liu et al., 2023) and PowerInfer (Song et al., 2023) gather the rows of
predicted-active neurons this way.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from .interpreter import check_launchable, launch
from .validate import check_gather

__all__ = ["BLOCK_K", "BLOCK_N", "gather_gemv", "gather_gemv_naive"]

BLOCK_N = 16
BLOCK_K = 128


@triton.jit
def _gather_row_kernel(W, x, idx, y, K, stride_w, stride_xb, stride_yb, BLOCK_K: tl.constexpr):
    i = tl.program_id(0)  # which active row
    b = tl.program_id(1)  # which batch row
    row = tl.load(idx + i).to(tl.int64)
    acc = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < K
        w = tl.load(W + row * stride_w + ks, mask=kmask, other=0.0).to(tl.float32)
        xv = tl.load(x + b * stride_xb + ks, mask=kmask, other=0.0).to(tl.float32)
        acc += w * xv
    tl.store(y + b * stride_yb + i, tl.sum(acc, axis=0).to(y.dtype.element_ty))


@triton.jit
def _gather_tile_kernel(
    W,
    x,
    idx,
    y,
    n,
    K,
    stride_w,
    stride_xb,
    stride_yb,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)  # which block of active rows
    b = tl.program_id(1)  # which batch row
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < n
    r = tl.load(idx + rows, mask=rmask, other=0).to(tl.int64)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < K
        w = tl.load(
            W + r[:, None] * stride_w + ks[None, :],
            mask=rmask[:, None] & kmask[None, :],
            other=0.0,
        ).to(tl.float32)
        xv = tl.load(x + b * stride_xb + ks, mask=kmask, other=0.0).to(tl.float32)
        acc += w * xv[None, :]
    out = tl.sum(acc, axis=1)
    tl.store(y + b * stride_yb + rows, out.to(y.dtype.element_ty), mask=rmask)


def _prepare(W: Tensor, x: Tensor, idx: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    check_gather(W, x, idx)
    check_launchable(W, x, idx)
    W = W.contiguous()
    x2 = x.reshape(1, -1) if x.dim() == 1 else x
    x2 = x2.contiguous()
    idx = idx.contiguous()
    y = torch.empty(x2.shape[0], idx.numel(), dtype=x.dtype, device=x.device)
    return W, x2, idx, y


def _finish(y: Tensor, x: Tensor) -> Tensor:
    return y[0] if x.dim() == 1 else y


def gather_gemv_naive(W: Tensor, x: Tensor, idx: Tensor) -> Tensor:
    """Row-sparse GEMV, one program per active row: y = x @ W[idx].T.

    W: [N, K] row-major (``nn.Linear.weight``); x: [K] or [B, K]; idx: [n] integer rows.
    Returns [n] or [B, n] in x's dtype, accumulated in float32.
    """
    W, x2, idx, y = _prepare(W, x, idx)
    if y.numel():
        grid = (idx.numel(), x2.shape[0])
        launch(
            _gather_row_kernel,
            grid,
            W,
            x2,
            idx,
            y,
            W.shape[1],
            W.stride(0),
            x2.stride(0),
            y.stride(0),
            BLOCK_K=BLOCK_K,
        )
    return _finish(y, x)


def gather_gemv(W: Tensor, x: Tensor, idx: Tensor) -> Tensor:
    """Row-sparse GEMV, BLOCK_N rows per program: y = x @ W[idx].T.

    Math: y[b, i] = sum_k W[idx[i], k] x[b, k], float32 accumulation.
    Layout: W [N, K] row-major so each neuron's K weights are contiguous (one gathered row is
    one burst of memory); x [K] or [B, K]; idx [n] integer rows in [0, N), any order (a
    repeated row gives a repeated output).
    Returns [n] or [B, n] in x's dtype. An empty idx gives an empty result. CUDA tensors run
    the compiled kernel, CPU tensors the Triton interpreter (``interpreter.launch``).
    """
    W, x2, idx, y = _prepare(W, x, idx)
    n = idx.numel()
    if y.numel():
        grid = (triton.cdiv(n, BLOCK_N), x2.shape[0])
        launch(
            _gather_tile_kernel,
            grid,
            W,
            x2,
            idx,
            y,
            n,
            W.shape[1],
            W.stride(0),
            x2.stride(0),
            y.stride(0),
            BLOCK_N=BLOCK_N,
            BLOCK_K=BLOCK_K,
        )
    return _finish(y, x)
