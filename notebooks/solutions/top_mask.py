"""Chapter 05: the contextual oracle's mask: the top (1 - s) units of every row."""

import torch


def top_mask(scores: torch.Tensor, sparsity: float) -> torch.Tensor:
    n = scores.shape[-1]
    keep = max(1, n - round(sparsity * n))  # sparsity is the share dropped
    best = scores.topk(keep, dim=-1).indices
    mask = torch.zeros_like(scores, dtype=torch.bool)
    return mask.scatter(-1, best, True)
