"""Chapter 09: GPTQ, column by column, each column's rounding error pushed onto the columns
not yet quantized through the upper Cholesky factor of the inverse Hessian."""

import math

import torch


def grid(w, bits):
    """Asymmetric grid of each row of w [rows, g]: scale and offset [rows]."""
    lo, hi = w.amin(1), w.amax(1)
    scale = ((hi - lo) / (2**bits - 1)).clamp_min(1e-30)  # a constant group is stored exactly
    return scale, lo


def gptq_quantize(w, x, bits, group_size, damp):
    w = w.clone()  # corrected in place, column by column
    rows, cols = w.shape
    g = cols if group_size is None else group_size
    h = x.T @ x
    dead = h.diagonal() == 0  # an input that is always 0: its weights do not matter
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h += damp * h.diagonal().mean() * torch.eye(cols, dtype=h.dtype)
    u = torch.linalg.cholesky(torch.linalg.inv(h), upper=True)  # H^-1 = U^T U

    # Lazy updates: a column's error corrects the rest of its block at once, and the columns
    # after the block once per block (one matrix product). Blocks hold whole groups, so a
    # group's range is measured after every correction from the columns before it.
    block = 128 if group_size is None else g * math.ceil(128 / g)
    q = torch.zeros_like(w)
    scales, offsets = [], []
    for start in range(0, cols, block):
        end = min(start + block, cols)
        errors = torch.zeros(rows, end - start, dtype=w.dtype)
        for i in range(start, end):
            if i % g == 0:  # a new group: its range as corrected so far
                scale, offset = grid(w[:, i : i + g], bits)
                scales.append(scale)
                offsets.append(offset)
            q[:, i] = torch.round((w[:, i] - offset) / scale).clamp(0, 2**bits - 1)
            err = (w[:, i] - (q[:, i] * scale + offset)) / u[i, i]
            w[:, i + 1 : end] -= err[:, None] * u[i, i + 1 : end][None, :]
            errors[:, i - start] = err
        w[:, end:] -= errors @ u[start:end, end:]  # the columns after the block
    return q, torch.stack(scales, 1), torch.stack(offsets, 1)
