"""Chapter 09: symmetric round-to-nearest quantization with one scale per group of columns."""

import torch


def quantize_groups(x: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    rows, cols = x.shape
    groups = x.reshape(rows, cols // group_size, group_size)
    qmax = 2 ** (bits - 1) - 1
    scale = (groups.abs().amax(-1, keepdim=True) / qmax).clamp_min(1e-30)
    q = torch.round(groups / scale).clamp(-qmax - 1, qmax)
    return (q * scale).reshape(rows, cols)
