"""Attention three ways: the reference formula, shared key/value heads, and tiles.

**Scaled dot-product attention** (Vaswani et al., 2017). For one head, queries Q [t, d],
keys K and values V [n, d]:

    O = softmax(Q K^T / sqrt(d) + B) V,

where B is 0 for visible keys and -inf for hidden ones (the causal mask: the query at position
p sees keys at positions <= p), or a position bias such as ALiBi's.

**MHA, MQA, GQA.** Multi-head attention gives each of the H query heads its own K/V head.
Multi-query attention (Shazeer, 2019) shares one K/V head among all of them; grouped-query
attention (Ainslie et al., 2023) sits between: G K/V heads, each serving H / G consecutive query
heads. The KV cache shrinks by H / G and so does the memory traffic of every decode step.
``repeat_kv`` makes the sharing explicit; with G = H it is the identity, so GQA *is* MHA there.
The GQA paper turns a multi-head checkpoint into a grouped one by **mean-pooling** the K and V
projections of the heads in each group (then a short uptraining); ``mha_to_gqa`` does the
pooling, ``expand_kv_heads`` the exact inverse direction (copying a K/V head to every query head
it serves gives an MHA model with identical outputs).

**Tiled attention** (FlashAttention, Dao et al., 2022). The t x n score matrix need not exist in
memory at once. Walk the keys in blocks and keep, per query row, the running maximum m, the
running normaliser l and the running output a (online softmax, Milakov & Gimelshein, 2018):

    m' = max(m, max_j s_j)            p_j = exp(s_j - m')
    l' = l exp(m - m') + sum_j p_j    a' = a exp(m - m') + sum_j p_j v_j

and finish with O = a / l. Each tile is exact, so the result equals softmax attention up to
rounding; memory drops from O(t n) to O(block^2), and with a causal mask the tiles above the
diagonal are skipped outright.
"""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import torch
from torch import Tensor

from .model import Attention, Transformer


def repeat_kv(x: Tensor, group: int) -> Tensor:
    """[batch, kv_heads, n, d] -> [batch, kv_heads * group, n, d]: K/V head g serves query
    heads g * group .. (g + 1) * group - 1."""
    return x if group == 1 else x.repeat_interleave(group, dim=1)


def kv_group(q: Tensor, k: Tensor) -> int:
    """Query heads per K/V head, with a clear error when the head counts do not divide."""
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(
            "q and k must be [batch, heads, seq, head_dim]; "
            f"got {tuple(q.shape)} and {tuple(k.shape)}."
        )
    h, g = q.shape[1], k.shape[1]
    if h % g != 0:
        raise ValueError(f"{h} query heads cannot share {g} K/V heads; use a divisor of {h}.")
    return h // g


def position_mask(q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """Causal mask from positions: True where the key's position <= the query's.

    ``q_pos`` [t] and ``k_pos`` [..., n] (keys may be any subset of earlier tokens, in any
    order, as in a cache that evicts) -> bool [..., t, n].
    """
    return k_pos[..., None, :] <= q_pos[:, None]


def attention_weights(
    q: Tensor, k: Tensor, mask: Tensor | None = None, bias: Tensor | None = None
) -> Tensor:
    """softmax(q k^T / sqrt(d) + bias) with hidden keys at -inf: [batch, heads, t, n]."""
    k = repeat_kv(k, kv_group(q, k))
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if bias is not None:
        scores = scores + bias
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(q.dtype)


def attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, bias: Tensor | None = None
) -> Tensor:
    """MHA, MQA and GQA in one formula: q [b, H, t, d], k, v [b, G, n, d] with G dividing H.

    ``mask`` (bool, True = visible) and ``bias`` broadcast to [b, H, t, n]. The score matrix is
    materialised: this is the reference that the fused and tiled versions are checked against.
    """
    weights = attention_weights(q, k, mask, bias)
    return weights @ repeat_kv(v, kv_group(q, k))


def tiled_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool = False,
    block_q: int = 64,
    block_k: int = 64,
) -> Tensor:
    """Attention computed tile by tile with an online softmax (the FlashAttention algorithm).

    Shapes as in ``attention``. With ``causal`` the queries are the last t of the n tokens
    (query i sits at position n - t + i, as in a decode step after a cache), which is the usual
    causal mask when t = n. Tiles entirely above the diagonal are skipped.
    """
    group = kv_group(q, k)
    t, n = q.shape[2], k.shape[2]
    if causal and t > n:
        raise ValueError(
            f"A causal mask needs q_len <= k_len (queries are keys too); got {t} > {n}."
        )
    if block_q < 1 or block_k < 1:
        raise ValueError(f"Block sizes must be positive, got block_q={block_q}, block_k={block_k}.")
    k, v = repeat_kv(k, group), repeat_kv(v, group)
    scale = 1.0 / math.sqrt(q.shape[-1])
    out = torch.empty_like(q)
    for q0 in range(0, t, block_q):
        qb = q[:, :, q0 : q0 + block_q] * scale
        q_pos = torch.arange(q0, q0 + qb.shape[2], device=q.device) + (n - t)
        row_max = torch.full((*qb.shape[:-1], 1), float("-inf"), dtype=q.dtype, device=q.device)
        row_sum = torch.zeros_like(row_max)
        acc = torch.zeros_like(qb)
        last_key = int(q_pos[-1]) + 1 if causal else n
        for k0 in range(0, last_key, block_k):
            scores = qb @ k[:, :, k0 : k0 + block_k].transpose(-1, -2)
            if causal and k0 + scores.shape[-1] - 1 > int(q_pos[0]):  # a tile on the diagonal
                k_pos = torch.arange(k0, k0 + scores.shape[-1], device=q.device)
                scores = scores.masked_fill(~position_mask(q_pos, k_pos), float("-inf"))
            new_max = torch.maximum(row_max, scores.amax(-1, keepdim=True))
            p = torch.exp(scores - new_max)
            rescale = torch.exp(row_max - new_max)
            row_sum = row_sum * rescale + p.sum(-1, keepdim=True)
            acc = acc * rescale + p @ v[:, :, k0 : k0 + block_k]
            row_max = new_max
        out[:, :, q0 : q0 + block_q] = acc / row_sum
    return out


def regroup_kv_heads(model: Transformer, n_kv_heads: int, how: str = "mean") -> Transformer:
    """A copy of ``model`` whose attention uses ``n_kv_heads`` K/V heads.

    Fewer heads (a divisor of the current count): each new head pools a group of old ones,
    ``how="mean"`` (the GQA paper) or ``how="first"`` (keep the group's first head, the paper's
    weaker baseline). More heads (a multiple of the current count, up to n_heads): each old head
    is copied to the heads that shared it, which changes nothing in the outputs.
    """
    c = model.config
    old = c.n_kv_heads
    if n_kv_heads < 1 or c.n_heads % n_kv_heads != 0:
        raise ValueError(
            f"n_kv_heads must divide n_heads ({c.n_heads}); got {n_kv_heads}. "
            f"Choose one of {[g for g in range(1, c.n_heads + 1) if c.n_heads % g == 0]}."
        )
    if old % n_kv_heads != 0 and n_kv_heads % old != 0:
        raise ValueError(
            f"Cannot regroup {old} K/V heads into {n_kv_heads}: one count must divide the other."
        )
    if how not in ("mean", "first"):
        raise ValueError(f"Unknown pooling {how!r}; use 'mean' or 'first'.")
    new = copy.deepcopy(model)
    new.config = replace(c, n_kv_heads=n_kv_heads)
    for layer in new.layers:
        attn: Attention = layer.attn
        attn.n_kv_heads = n_kv_heads
        for name in ("k_proj", "v_proj"):
            setattr(attn, name, regroup_projection(getattr(attn, name), old, n_kv_heads, how))
    new.tie_weights()
    return new


def regroup_projection(proj: torch.nn.Linear, old: int, new: int, how: str) -> torch.nn.Linear:
    """The K or V projection with its ``old`` output heads pooled or copied into ``new``."""
    w = proj.weight.detach().reshape(old, -1, proj.in_features)  # [old heads, head_dim, in]
    b = None if proj.bias is None else proj.bias.detach().reshape(old, -1)
    if new < old:
        pool = (lambda x: x.mean(1)) if how == "mean" else (lambda x: x[:, 0])
        w = pool(w.reshape(new, old // new, *w.shape[1:]))
        b = None if b is None else pool(b.reshape(new, old // new, -1))
    else:
        w = w.repeat_interleave(new // old, dim=0)
        b = None if b is None else b.repeat_interleave(new // old, dim=0)
    out = type(proj)(proj.in_features, w.shape[0] * w.shape[1], bias=b is not None)
    out = out.to(proj.weight.device, proj.weight.dtype)
    with torch.no_grad():
        out.weight.copy_(w.reshape(-1, proj.in_features))
        if b is not None:
            out.bias.copy_(b.reshape(-1))
    return out  # output-major weights: call use_streaming_gemv again for the fast decode path


def mha_to_gqa(model: Transformer, n_kv_heads: int, how: str = "mean") -> Transformer:
    """Convert to fewer K/V heads by mean-pooling groups (the GQA paper's recipe); a copy."""
    if n_kv_heads > model.config.n_kv_heads:
        raise ValueError(
            f"mha_to_gqa reduces K/V heads ({model.config.n_kv_heads} now), got {n_kv_heads}; "
            "use expand_kv_heads to add heads."
        )
    return regroup_kv_heads(model, n_kv_heads, how)


def expand_kv_heads(model: Transformer, n_kv_heads: int | None = None) -> Transformer:
    """Copy K/V heads so more query heads have their own (default: full MHA); outputs unchanged."""
    target = model.config.n_heads if n_kv_heads is None else n_kv_heads
    if target < model.config.n_kv_heads:
        raise ValueError(
            f"expand_kv_heads adds K/V heads ({model.config.n_kv_heads} now), got {target}; "
            "use mha_to_gqa to pool heads."
        )
    return regroup_kv_heads(model, target)


__all__ = [
    "attention",
    "attention_weights",
    "expand_kv_heads",
    "kv_group",
    "mha_to_gqa",
    "position_mask",
    "regroup_kv_heads",
    "repeat_kv",
    "tiled_attention",
]
