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

Parallelism: a down projection has few outputs (N = the model dim, e.g. 4096) and many inputs
(K = the FFN width, 11008). One program per BLOCK_N outputs would give a GPU only 64 programs,
each walking all K rows alone: a few of the GPU's multiprocessors busy, most of its bandwidth
unused. The inputs are therefore split as well (split-K): program (i, b, s) sums its share s of
the active rows into a float32 partial result, and the partials are added at the end. The
number of splits is chosen so that there are a few programs per multiprocessor
(``split_count``); on CPU tensors (the interpreter) there is one.

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
from .validate import check_scatter

__all__ = ["BLOCK_K", "BLOCK_N", "PROGRAMS_PER_SM", "scatter_gemv", "split_count"]

# Tuned on an H200 (fp16 CUDA graph replays, 4096x11008 and 8192x28672 at s = 0, 0.5, 0.9):
# the split-K target mattered most (down at s = 0 went from 6.2x to 1.06x the dense time).
BLOCK_N = 128
BLOCK_K = 64
PROGRAMS_PER_SM = 8  # split-K target: about this many programs per multiprocessor


def split_count(rows: int, programs: int, device: torch.device) -> int:
    """How many slices to split ``rows`` active rows into, for ``programs`` output programs.

    Enough slices for about ``PROGRAMS_PER_SM`` programs per multiprocessor, and never a slice
    of less than BLOCK_K rows. One on the CPU (the interpreter runs programs one by one).
    """
    if device.type != "cuda" or rows == 0:
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    wanted = -(-PROGRAMS_PER_SM * sms // max(programs, 1))
    return max(1, min(wanted, -(-rows // BLOCK_K)))


@triton.jit
def _threshold_kernel(
    W_t,
    x,
    partial,
    K,
    N,
    threshold,
    chunk,
    stride_w,
    stride_xb,
    stride_ps,
    stride_pb,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)  # which block of outputs
    b = tl.program_id(1)  # which batch row
    s = tl.program_id(2)  # which slice of the inputs (split-K)
    ns = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = ns < N
    acc = tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float32)
    for k0 in range(s * chunk, tl.minimum(s * chunk + chunk, K), BLOCK_K):
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
    tl.store(partial + s * stride_ps + b * stride_pb + ns, tl.sum(acc, axis=0), mask=nmask)


@triton.jit
def _index_kernel(
    W_t,
    x,
    idx,
    partial,
    n,
    N,
    chunk,
    stride_w,
    stride_xb,
    stride_ps,
    stride_pb,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    b = tl.program_id(1)
    s = tl.program_id(2)
    ns = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = ns < N
    acc = tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float32)
    for j0 in range(s * chunk, tl.minimum(s * chunk + chunk, n), BLOCK_K):
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
    tl.store(partial + s * stride_ps + b * stride_pb + ns, tl.sum(acc, axis=0), mask=nmask)


def scatter_gemv(
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
    check_scatter(W_t, x, threshold, idx)
    check_launchable(W_t, x)
    W_t = W_t.contiguous()
    x2 = (x.reshape(1, -1) if x.dim() == 1 else x).contiguous()
    K, N = W_t.shape
    B = x2.shape[0]
    rows = K if idx is None else idx.numel()
    if B * N == 0 or rows == 0:  # nothing to launch: no outputs, or no active input
        y = torch.zeros(B, N, dtype=x.dtype, device=x.device)
        return y[0] if x.dim() == 1 else y
    blocks = triton.cdiv(N, BLOCK_N)
    splits = split_count(rows, blocks * B, x.device)
    chunk = triton.cdiv(triton.cdiv(rows, splits), BLOCK_K) * BLOCK_K
    splits = triton.cdiv(rows, chunk)
    partial = torch.empty(splits, B, N, dtype=torch.float32, device=x.device)
    common = (N, chunk, W_t.stride(0), x2.stride(0), partial.stride(0), partial.stride(1))
    if idx is not None:
        kernel, args = _index_kernel, (W_t, x2, idx.contiguous(), partial, rows, *common)
    else:
        kernel, args = (
            _threshold_kernel,
            (W_t, x2, partial, K, *common[:1], float(threshold), *common[1:]),
        )
    launch(kernel, (blocks, B, splits), *args, BLOCK_K=BLOCK_K, BLOCK_N=BLOCK_N)
    y = (partial[0] if splits == 1 else partial.sum(0)).to(x.dtype)
    return y[0] if x.dim() == 1 else y
