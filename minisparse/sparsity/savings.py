"""What activation sparsity saves: FLOPs and weight bytes a sparse kernel may skip per token.

A projection y = W x with W [out, in] costs 2 · out · in FLOPs and reads out · in weights per
token. When a share s of x's entries is zero (or below the threshold a kernel treats as zero), a
kernel that reads only the columns of the nonzero inputs skips a share s of both:

    skipped FLOPs = 2 · out · in · s,      skipped bytes = out · in · bytes_per_weight · s.

Each projection skips by the sparsity of its own input (``stats``' sites): q/k/v by
``attn_in``, gate by ``mlp_in``, down by ``down_in``, o by the heads whose output is zero. up
can skip twice: the rows whose output is multiplied by a zero of act(W_gate x) (``mlp_act``)
and the columns of zero inputs (``mlp_in``); treating the two as independent it keeps
(1 − s_act)(1 − s_in) of its weights. The attention scores over the cached context and the LM
head stay dense, which bounds the saving (Amdahl): at batch 1 a decode step is memory-bound, so
the skipped bytes, not FLOPs, predict the speedup.

References: Liu et al., "Deja Vu: Contextual Sparsity for Efficient LLMs at Inference Time"
(ICML 2023); Song et al., "PowerInfer: Fast Large Language Model Serving with a Consumer-grade
GPU" (2023); Liu et al., "Training-Free Activation Sparsity in Large Language Models" (TEAL,
2024).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..core.model import Transformer
from .stats import SITES, SparsityStats


@dataclass
class ProjectionSavings:
    """Per-token FLOPs and weight bytes of one kind of projection (all layers), and the skipped."""

    name: str
    flops: float
    skipped_flops: float
    bytes: float
    skipped_bytes: float

    @property
    def skipped_share(self) -> float:
        return self.skipped_flops / self.flops if self.flops else 0.0


def projection_skips(stats: SparsityStats, magnitude: Mapping[str, float | Sequence[float]]):
    """Per projection name, per layer, the share of its weights a sparse kernel may skip.

    q/k/v skip the columns of zero ``attn_in`` entries, gate those of ``mlp_in``, down those of
    ``down_in``, o the heads whose output is zero. up skips rows where ``mlp_act`` is zero (its
    output is multiplied by zero) and columns where ``mlp_in`` is zero; treating the two as
    independent, it keeps (1 - s_act)(1 - s_in) of its weights. Sites not recorded count dense.
    """

    def s(site: str) -> list[float]:
        n = len(next(iter(stats.sites.values())))
        if site not in stats.sites:
            return [0.0] * n
        return stats.fraction_at_most(site, magnitude.get(site, 0.0))

    attn_in, mlp_in, act, down_in, heads = (s(x) for x in SITES)
    up = [1 - (1 - a) * (1 - b) for a, b in zip(act, mlp_in, strict=True)]
    return {
        "q_proj": attn_in,
        "k_proj": attn_in,
        "v_proj": attn_in,
        "o_proj": heads,
        "gate_proj": mlp_in,
        "up_proj": up,
        "down_proj": down_in,
    }


def savings(
    model: Transformer,
    stats: SparsityStats,
    magnitude: Mapping[str, float | Sequence[float]] | None = None,
    context: int = 0,
) -> list[ProjectionSavings]:
    """FLOPs and weight bytes per token a sparse kernel would skip, per projection, then totals.

    Entries with |x| <= ``magnitude[site]`` (default: exact zeros) count as skippable. The
    attention scores over ``context`` cached tokens (4 n_heads head_dim context FLOPs per layer,
    KV bytes not counted) and the LM head stay dense. The last entry is the total.
    """
    skips = projection_skips(stats, magnitude or {})
    rows: list[ProjectionSavings] = []
    for name, per_layer_skip in skips.items():
        flops = skipped = nbytes = skipped_bytes = 0.0
        for layer, skip in zip(model.layers, per_layer_skip, strict=True):
            owner = layer.attn if hasattr(layer.attn, name) else layer.mlp
            w = getattr(owner, name).weight
            flops += 2 * w.numel()
            nbytes += w.numel() * w.element_size()
            skipped += 2 * w.numel() * skip
            skipped_bytes += w.numel() * w.element_size() * skip
        rows.append(ProjectionSavings(name, flops, skipped, nbytes, skipped_bytes))
    c = model.config
    attention = 4 * c.n_heads * c.head_dim * context * c.n_layers
    rows.append(ProjectionSavings("attention scores", attention, 0.0, 0.0, 0.0))
    head = model.lm_head.weight
    rows.append(
        ProjectionSavings("lm_head", 2 * head.numel(), 0.0, head.numel() * head.element_size(), 0.0)
    )
    total = ProjectionSavings(
        "total",
        sum(r.flops for r in rows),
        sum(r.skipped_flops for r in rows),
        sum(r.bytes for r in rows),
        sum(r.skipped_bytes for r in rows),
    )
    return [*rows, total]


__all__ = ["ProjectionSavings", "projection_skips", "savings"]
