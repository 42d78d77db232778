"""Column-sparse GEMV in Triton: skip the weights of input channels that are (near) zero.

For y = W x with W of shape [N, K], a zero input x_k multiplies column k of W, so the column
need not be read. Row-major W scatters column k over N rows (stride K), so skipping it saves no
memory traffic. Stored transposed, ``W_t = W^T`` of shape [K, N], input channel k's weights are
one contiguous row and skipping it skips a contiguous burst:

    y_n = sum_{k in A} W_t[k, n] x_k,     A = {k : |x_k| > t}  (threshold)  or  A = idx

That is the layout lesson: the sparse dimension must be the slow (outer) dimension of the
stored matrix. The down projection of an FFN is column-sparse in the neurons; TEAL applies the
same kernel with a magnitude threshold t on the hidden state to every projection.

Two ways to name the active channels:

* ``threshold``: the kernel tests |x_k| > t itself (TEAL). Each program owns BLOCK_N outputs
  and walks all K inputs in blocks; the weight load is masked by the test, so inactive rows are
  never fetched (on a GPU a fully masked 32-byte sector costs no DRAM traffic). No index list,
  no extra launch, but every program scans all of x.
* ``idx``: the caller gives the active channels (a predictor, or a top-k), and the kernel walks
  only those: W_t[idx] rows times x[idx].

Accumulation is float32. With a batch x [B, K] the threshold is applied per row (each row keeps
its own large entries); the weight rows any row needs are read, so the bytes moved are those of
the union of the rows' active sets.

Reference: TEAL, training-free activation sparsity (Liu et al., 2024).
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from .interpreter import check_launchable, launch
from .validate import check_sparse_input

__all__ = ["BLOCK_K", "BLOCK_N", "sparse_input_gemv"]

BLOCK_N = 64
BLOCK_K = 32


@triton.jit
def _threshold_kernel(
    W_t,
    x,
    y,
    K,
    N,
    threshold,
    stride_w,
    stride_xb,
    stride_yb,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)  # which block of outputs
    b = tl.program_id(1)  # which batch row
    ns = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = ns < N
    acc = tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        xv = tl.load(x + b * stride_xb + ks, mask=ks < K, other=0.0).to(tl.float32)
        active = (tl.abs(xv) > threshold) & (ks < K)
        xv = tl.where(active, xv, 0.0)  # an inactive NaN or inf must not reach 0 * x
        w = tl.load(
            W_t + ks.to(tl.int64)[:, None] * stride_w + ns[None, :],
            mask=active[:, None] & nmask[None, :],
            other=0.0,
        ).to(tl.float32)
        acc += w * xv[:, None]
    tl.store(y + b * stride_yb + ns, tl.sum(acc, axis=0).to(y.dtype.element_ty), mask=nmask)


@triton.jit
def _index_kernel(
    W_t,
    x,
    idx,
    y,
    n,
    N,
    stride_w,
    stride_xb,
    stride_yb,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    b = tl.program_id(1)
    ns = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = ns < N
    acc = tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float32)
    for j0 in range(0, n, BLOCK_K):
        js = j0 + tl.arange(0, BLOCK_K)
        jmask = js < n
        ks = tl.load(idx + js, mask=jmask, other=0).to(tl.int64)
        xv = tl.load(x + b * stride_xb + ks, mask=jmask, other=0.0).to(tl.float32)
        w = tl.load(
            W_t + ks[:, None] * stride_w + ns[None, :],
            mask=jmask[:, None] & nmask[None, :],
            other=0.0,
        ).to(tl.float32)
        acc += w * xv[:, None]
    tl.store(y + b * stride_yb + ns, tl.sum(acc, axis=0).to(y.dtype.element_ty), mask=nmask)


def sparse_input_gemv(
    W_t: Tensor, x: Tensor, threshold: float | None = None, idx: Tensor | None = None
) -> Tensor:
    """Column-sparse GEMV: y = (x * mask) @ W_t, reading only the active rows of W_t.

    Math: y[b, n] = sum_{k in A_b} W_t[k, n] x[b, k] with A_b = {k : |x[b, k]| > threshold}
    or A_b = idx; float32 accumulation.
    Layout: W_t [K, N] is W transposed and contiguous (``down_proj.weight.T.contiguous()``),
    so input channel k's N weights are one contiguous row; x [K] or [B, K].
    Give exactly one of ``threshold`` (>= 0) and ``idx`` ([n] integer channels in [0, K), any
    order; a repeated channel is added once per entry). With a threshold a NaN input counts as
    inactive (``|NaN| > t`` is false), as in the reference.
    Returns [N] or [B, N] in x's dtype.
    """
    check_sparse_input(W_t, x, threshold, idx)
    check_launchable(W_t, x)
    W_t = W_t.contiguous()
    x2 = (x.reshape(1, -1) if x.dim() == 1 else x).contiguous()
    K, N = W_t.shape
    y = torch.empty(x2.shape[0], N, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(N, BLOCK_N), x2.shape[0])
    if y.numel() == 0 or (idx is not None and idx.numel() == 0):
        y.zero_()  # nothing to launch: no outputs, or no active input
    elif idx is not None:
        launch(
            _index_kernel,
            grid,
            W_t,
            x2,
            idx.contiguous(),
            y,
            idx.numel(),
            N,
            W_t.stride(0),
            x2.stride(0),
            y.stride(0),
            BLOCK_K=BLOCK_K,
            BLOCK_N=BLOCK_N,
        )
    else:
        launch(
            _threshold_kernel,
            grid,
            W_t,
            x2,
            y,
            K,
            N,
            float(threshold),
            W_t.stride(0),
            x2.stride(0),
            y.stride(0),
            BLOCK_K=BLOCK_K,
            BLOCK_N=BLOCK_N,
        )
    return y[0] if x.dim() == 1 else y
