"""Chapter 00: RMSNorm, the normalisation before every attention and MLP."""

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    mean_square = x.pow(2).mean(dim=-1, keepdim=True)  # over the features of each token
    return x / torch.sqrt(mean_square + eps) * weight  # no mean is subtracted (not LayerNorm)
