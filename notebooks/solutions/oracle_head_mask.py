"""Chapter 05: DejaVu's oracle for attention heads, from the attention output before W_o."""

import torch


def oracle_head_mask(o, n_heads, sparsity):
    # head i owns the consecutive channels i*d .. (i+1)*d - 1 of o
    heads = o.reshape(*o.shape[:-1], n_heads, o.shape[-1] // n_heads)
    scores = heads.norm(dim=-1)  # ||o_i||_2 per token and head: [..., n_heads]
    k = max(1, n_heads - round(sparsity * n_heads))
    keep = torch.zeros_like(scores, dtype=torch.bool)
    return keep.scatter_(-1, scores.topk(k, dim=-1).indices, True)
