"""Chapter 01: rotary embeddings, the "rotate half" layout."""

import torch


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)  # (x1, x2) -> (-x2, x1)
    return x * cos + rotated * sin
