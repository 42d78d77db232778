"""Chapter 12: Wanda's mask, per output row, from the weights and the inputs' norms."""

import torch


def wanda_mask(w, x_norm, sparsity):
    scores = w.abs() * x_norm  # |W_ij| * ||X_j||: one norm per input column, broadcast on rows
    k = round(sparsity * w.shape[-1])  # pruned per row
    keep = torch.ones_like(w, dtype=torch.bool)
    lowest = scores.argsort(dim=-1, stable=True)[..., :k]  # compared within each row
    return keep.scatter_(-1, lowest, False)
