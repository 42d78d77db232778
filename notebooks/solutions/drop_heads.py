"""Chapter 05: drop attention heads by zeroing their slice of the attention output."""

import torch


def drop_heads(x: torch.Tensor, keep: torch.Tensor, n_heads: int) -> torch.Tensor:
    heads = x.reshape(*x.shape[:-1], n_heads, -1)  # head i: channels i*d .. (i+1)*d - 1
    return (heads * keep[..., None].to(x.dtype)).reshape(x.shape)
