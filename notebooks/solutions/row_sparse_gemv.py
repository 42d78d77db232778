"""Chapter 07: a row-sparse GEMV in Triton: y[i] = W[idx[i]] . x, reading only the rows idx.

Without a GPU, set TRITON_INTERPRET=1 before the kernel is defined (the notebook's first cell
does) to run it on CPU tensors; the course's check and plug run CPU launches interpreted anyway.
"""

import torch
import triton
import triton.language as tl

BLOCK_M = 64  # gathered rows per program
BLOCK_K = 256  # columns per step along a row


@triton.jit
def row_sparse_kernel(W, x, idx, y, m, K, stride_w, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    i = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # the outputs this program owns
    live = i < m  # the last program may own fewer than BLOCK_M outputs
    rows = tl.load(idx + i, mask=live, other=0).to(tl.int64)  # which rows of W to read
    acc = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        inside = ks < K  # the last block of a row may be short
        w = tl.load(
            W + rows[:, None] * stride_w + ks[None, :],  # row r starts stride_w elements after r-1
            mask=live[:, None] & inside[None, :],
            other=0.0,
        )
        xv = tl.load(x + ks, mask=inside, other=0.0)
        acc += w * xv[None, :]
    tl.store(y + i, tl.sum(acc, axis=1), mask=live)


def row_sparse_gemv(W, x, idx):
    m = idx.numel()
    y = torch.empty(m, dtype=torch.float32, device=x.device)
    if m == 0:  # nothing to compute: no launch
        return y
    x = x.contiguous()
    grid = (triton.cdiv(m, BLOCK_M),)
    row_sparse_kernel[grid](
        W, x, idx, y, m, W.shape[1], W.stride(0), BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K
    )
    return y
