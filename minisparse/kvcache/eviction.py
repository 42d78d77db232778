"""Bounded KV caches: keep a fixed number of tokens by evicting the rest (StreamingLLM, H2O).

A full cache grows by one key and one value per layer and K/V head with every token, and a decode
step reads all of it. A bounded cache keeps at most a budget of entries per layer, so memory and
attention cost stop growing; the question is which tokens to keep.

**Attention sinks** (StreamingLLM, Xiao et al., 2024). Keeping only the last ``window`` tokens
fails as soon as the first tokens leave: softmax needs somewhere to put attention mass that has
no better target, and models learn to park it on the first tokens. Keeping ``n_sink`` (4) first
tokens plus the window restores quality at a fixed memory. A query at position p sees the keys

    { j <= p : j < n_sink  or  j > p − window }.

**Heavy hitters** (H2O, Zhang et al., 2023). A few tokens collect most of the attention. Each
kept key accumulates the attention it receives, s_j = Σ_queries softmax(q k^T / √d)_j; keep,
per K/V head, the ``budget − recent`` tokens with the largest s_j plus the ``recent`` newest
tokens, and evict the rest.

Positions. Both caches keep every key rotated at its *original* position, so a query sees exactly
the relative offsets it would see with the full cache; only which keys remain changes.
StreamingLLM instead renumbers positions inside the cache, which is needed to run past the
model's trained context; within it (our experiments) original positions isolate the effect of
eviction from that of new offsets.

Both are per-layer objects with ``attend(q, k, v, input_pos)``: the model's attention hands them
the new keys and values and gets the attention output back.

References: Xiao et al., "Efficient Streaming Language Models with Attention Sinks" (ICLR 2024);
Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language
Models" (NeurIPS 2023).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from ..core.attention import attention_weights, kv_group, position_mask, repeat_kv
from ..core.model import check_count

Visible = Callable[[Tensor, Tensor, int, int], Tensor]


def sink_visible(q_pos: Tensor, k_pos: Tensor, n_sink: int, window: int) -> Tensor:
    """[t, n]: True where the query at position q_pos[i] sees the key at k_pos[j], i.e.
    j <= p and (j < n_sink or j > p - window)."""
    kept = (k_pos[None, :] < n_sink) | (k_pos[None, :] > q_pos[:, None] - window)
    return position_mask(q_pos, k_pos) & kept


class SinkCache:
    """StreamingLLM for one layer: the first ``n_sink`` tokens plus the last ``window`` tokens.

    A query at position p sees keys at positions j <= p with j < n_sink or j > p - window. Keys
    no later query can see are dropped at the next call, so the cache holds at most
    n_sink + window - 1 + (new tokens) entries and a prefill chunk is masked exactly as if its
    tokens had been fed one by one. ``rule(q_pos, k_pos, n_sink, window)`` decides what is
    visible (default ``sink_visible``; chapter 02's learner writes their own).
    """

    def __init__(self, n_sink: int = 4, window: int = 256, rule: Visible | None = None) -> None:
        check_count(n_sink, "n_sink", minimum=0, fix="StreamingLLM keeps 4")
        check_count(window, "window", fix="e.g. 256 recent tokens")
        self.n_sink, self.window = n_sink, window
        self.rule = sink_visible if rule is None else rule
        self.k: Tensor | None = None
        self.v: Tensor | None = None
        self.pos: Tensor | None = None  # [n] positions of the stored keys

    def visible(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """[t, n] mask: causal, and either a sink or inside the query's window (``rule``)."""
        return self.rule(q_pos, k_pos, self.n_sink, self.window)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor) -> Tensor:
        if self.k is None:
            self.k, self.v, self.pos = k, v, input_pos.clone()
        else:
            keep = self.visible(input_pos[:1], self.pos)[0]
            self.k = torch.cat([self.k[:, :, keep], k], dim=2)
            self.v = torch.cat([self.v[:, :, keep], v], dim=2)
            self.pos = torch.cat([self.pos[keep], input_pos])
        gqa = kv_group(q, k) > 1
        if q.shape[2] == 1:  # everything kept is visible to the newest token
            return F.scaled_dot_product_attention(q, self.k, self.v, enable_gqa=gqa)
        mask = self.visible(input_pos, self.pos)
        return F.scaled_dot_product_attention(q, self.k, self.v, attn_mask=mask, enable_gqa=gqa)

    @property
    def size(self) -> int:
        return 0 if self.pos is None else int(self.pos.numel())


Keep = Callable[[Tensor, int, int], Tensor]


def h2o_keep(score: Tensor, budget: int, recent: int) -> Tensor:
    """Which of n entries (in position order) H2O keeps: [..., n] accumulated attention ->
    indices [..., min(n, budget)] in position order: the budget - recent entries with the largest
    score among all but the newest ``recent``, then those ``recent``."""
    n = score.shape[-1]
    if n <= budget:
        return torch.arange(n, device=score.device).expand(score.shape)
    old = n - recent  # entries are kept in position order: the newest are last
    heavy = score[..., :old].topk(budget - recent, dim=-1).indices
    newest = torch.arange(old, n, device=score.device).expand(*score.shape[:-1], recent)
    return torch.cat([heavy.sort(dim=-1).values, newest], dim=-1)


class H2OCache:
    """Heavy-hitter oracle for one layer: ``recent`` newest tokens + top accumulated attention.

    Each call appends the new keys, attends with explicit softmax weights (keys are per-head
    subsets, so positions are tracked per K/V head), adds every key's received attention
    (summed over queries and the query heads of its group) to its score, then evicts down to
    ``budget`` entries per K/V head. A prefill chunk therefore sees up to (chunk - 1) tokens
    beyond the budget before the eviction that follows it.
    """

    def __init__(
        self, budget: int = 256, recent: int | None = None, rule: Keep | None = None
    ) -> None:
        check_count(budget, "budget", fix="e.g. 256 kept tokens per head")
        recent = budget // 2 if recent is None else check_count(recent, "recent", minimum=0)
        if recent > budget:
            raise ValueError(f"Need budget >= 1 and 0 <= recent <= budget; got {budget}, {recent}.")
        self.budget, self.recent = budget, recent
        self.rule = h2o_keep if rule is None else rule  # which entries survive an eviction
        self.k: Tensor | None = None
        self.v: Tensor | None = None
        self.pos: Tensor | None = None  # [b, kv_heads, n]
        self.score: Tensor | None = None  # [b, kv_heads, n] accumulated attention

    def attend(self, q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor) -> Tensor:
        b, g, t, _ = k.shape
        pos = input_pos.expand(b, g, t)
        fresh = torch.zeros(b, g, t, dtype=torch.float32, device=k.device)
        if self.k is None:
            self.k, self.v, self.pos, self.score = k, v, pos.clone(), fresh
        else:
            self.k = torch.cat([self.k, k], dim=2)
            self.v = torch.cat([self.v, v], dim=2)
            self.pos = torch.cat([self.pos, pos], dim=2)
            self.score = torch.cat([self.score, fresh], dim=2)
        group = kv_group(q, k)
        mask = repeat_kv(position_mask(input_pos, self.pos), group) if t > 1 else None
        weights = attention_weights(q, self.k, mask)  # [b, H, t, n]
        out = weights @ repeat_kv(self.v, group)
        n = self.pos.shape[-1]
        self.score += weights.float().sum(2).view(b, g, group, n).sum(2)
        self.evict()
        return out

    def evict(self) -> None:
        if self.pos.shape[-1] <= self.budget:
            return
        keep = self.rule(self.score, self.budget, self.recent)
        gather = keep[..., None].expand(-1, -1, -1, self.k.shape[-1])
        self.k, self.v = self.k.gather(2, gather), self.v.gather(2, gather)
        self.pos, self.score = self.pos.gather(2, keep), self.score.gather(2, keep)

    @property
    def size(self) -> int:
        return 0 if self.pos is None else int(self.pos.shape[-1])


__all__ = ["H2OCache", "SinkCache", "h2o_keep", "sink_visible"]
