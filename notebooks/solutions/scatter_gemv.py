"""Chapter 07: column-sparse GEMV: only the rows of W^T of the active inputs are read."""

import torch


def scatter_gemv(W_t: torch.Tensor, x: torch.Tensor, threshold: float) -> torch.Tensor:
    rows = x if x.dim() == 2 else x[None]  # one active set per row of a batch
    out = torch.zeros(rows.shape[0], W_t.shape[1], dtype=x.dtype)
    for b, row in enumerate(rows):
        active = row.abs() > threshold
        out[b] = row[active] @ W_t[active]  # the inactive rows of W_t are never touched
    return out if x.dim() == 2 else out[0]
