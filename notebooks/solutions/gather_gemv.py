"""Chapter 07: row-sparse GEMV: only the rows of the active neurons are read."""

import torch


def gather_gemv(W: torch.Tensor, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    rows = W[idx]  # [m, K], in idx's order (a repeated index gives a repeated row)
    return x @ rows.T  # [m], or [B, m] for a batch
