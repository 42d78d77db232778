"""Chapter 03: how much of all activity the most active neurons carry (a Lorenz curve point)."""

import torch


def top_share(values: torch.Tensor, share: float) -> float:
    total = float(values.sum())
    if total == 0:
        return 0.0
    k = round(share * values.numel())
    largest = values.double().sort(descending=True).values[:k]
    return float(largest.sum()) / total
