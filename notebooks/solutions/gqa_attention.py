"""Chapter 01: causal grouped-query attention, for a prompt (t = n) and after a cache (t < n)."""

import math

import torch


def gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]  # query heads per K/V head
    # K/V head g serves query heads g * group .. (g + 1) * group - 1: repeat each in place
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    t, n = q.shape[2], k.shape[2]
    query_pos = torch.arange(n - t, n)[:, None]  # the queries are the last t tokens
    future = torch.arange(n)[None, :] > query_pos  # key j after query i: hidden
    scores = scores.masked_fill(future, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v
