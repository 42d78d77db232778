"""Chapter 03: a TEAL threshold: the magnitude below which a share `sparsity` of |x| lies."""

import torch


def threshold(x: torch.Tensor, sparsity: float) -> float:
    magnitudes = x.abs().flatten().sort().values
    k = round(sparsity * magnitudes.numel())
    return float(magnitudes[k - 1]) if k > 0 else 0.0
