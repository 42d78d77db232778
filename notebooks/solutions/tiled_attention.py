"""Chapter 02: attention over blocks of keys with the online softmax (FlashAttention's loop)."""

import math

import torch


def tiled_attention(q, k, v, block):
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # GQA: K/V head g serves query heads g*group ..
    v = v.repeat_interleave(group, dim=1)
    t, n = q.shape[2], k.shape[2]
    query_pos = torch.arange(n - t, n)[:, None]  # the queries are the last t tokens
    q = q / math.sqrt(q.shape[-1])
    m = torch.full((*q.shape[:-1], 1), float("-inf"))  # running max of each query row
    l = torch.zeros_like(m)  # running sum of exp(score - m)
    a = torch.zeros_like(q)  # running sum of exp(score - m) * v
    for start in range(0, n, block):
        stop = min(start + block, n)  # the last block may be short
        s = q @ k[:, :, start:stop].transpose(-1, -2)
        future = torch.arange(start, stop)[None, :] > query_pos
        s = s.masked_fill(future, float("-inf"))
        # key 0 is visible to every query, so m_new is finite from the first block on
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        p = torch.exp(s - m_new)
        rescale = torch.exp(m - m_new)  # exp(-inf) = 0 at the first block
        l = l * rescale + p.sum(-1, keepdim=True)
        a = a * rescale + p @ v[:, :, start:stop]
        m = m_new
    return a / l
