"""Chapter 01: causal grouped-query attention."""

import math

import torch


def gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]  # query heads per K/V head
    # K/V head g serves query heads g * group .. (g + 1) * group - 1: repeat each in place
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    t = q.shape[2]
    future = torch.ones(t, t, dtype=torch.bool).triu(1)  # key j > query i
    scores = scores.masked_fill(future, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v
