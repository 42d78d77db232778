"""Inputs and library references for the checked exercises of chapters 00 to 05.

``CASES`` maps each exercise name of ``minisparse.course.exercises`` to a pair (reference,
cases): the library's own function that the learner's version is compared with (called here,
never written again), and a generator of fresh inputs for one round of the check, with odd shapes
and the edge cases a first attempt tends to miss (a row of zeros, an empty cache, k larger than the
vocabulary). The task, the hint and the comparison of each exercise live in the registry.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .grading import draw_int

__all__ = ["CASES"]

Cases = list[tuple[Any, ...]]


# --- 00 tour ----------------------------------------------------------------------------------


def _rms_norm_cases(gen: torch.Generator) -> Cases:
    out: Cases = []
    for shape, eps in (((1,), 1e-5), ((3, 5), 1e-6), ((2, 4, 7), 1e-5), ((2, 64), 0.5)):
        x = torch.randn(*shape, generator=gen) * 3
        out.append((x, torch.rand(shape[-1], generator=gen) + 0.5, eps))
    x = torch.randn(3, 8, generator=gen)
    x[1] = 0.0  # a row of zeros: eps keeps it finite
    out.append((x, torch.rand(8, generator=gen), 1e-5))
    return out


@torch.no_grad()
def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    from ..core.layers import RMSNorm

    norm = RMSNorm(x.shape[-1], eps)
    norm.weight.copy_(weight)
    return norm(x)


def _sampling_cases(gen: torch.Generator) -> Cases:
    settings = (((7,), 1.0, None), ((2, 11), 0.5, 3), ((3, 50), 2.0, 1), ((1, 5), 0.8, 8))
    out: Cases = [(torch.randn(*s, generator=gen) * 3, t, k) for s, t, k in settings]
    out.append((torch.randn(4, 33, generator=gen) * 3, 1.3, 10))
    return out


def _sampling_probs(logits: Tensor, temperature: float, top_k: int | None) -> Tensor:
    from ..core.sampling import logits_to_probs

    return logits_to_probs(logits, temperature, top_k)


# --- 01 building blocks -----------------------------------------------------------------------


def _rope_cases(gen: torch.Generator) -> Cases:
    from ..core.rope import rope_cos_sin, rope_inv_freq

    out: Cases = []
    for batch, heads, seq, dim in ((1, 1, 1, 2), (2, 3, 5, 8), (1, 4, 7, 6), (3, 2, 4, 64)):
        x = torch.randn(batch, heads, seq, dim, generator=gen)
        positions = torch.randint(0, 4096, (seq,), generator=gen)
        cos, sin = rope_cos_sin(rope_inv_freq(dim, 10000.0), positions, torch.float32)
        out.append((x, cos, sin))
    return out


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    from ..core.rope import apply_rope

    return apply_rope(x, cos, sin)


def _gqa_cases(gen: torch.Generator) -> Cases:
    """t queries, the last t of n >= t keys (a prompt: t = n; a decode step: t = 1)."""
    out: Cases = []
    shapes = (
        (1, 1, 1, 1, 1, 4), (2, 4, 2, 5, 5, 8), (1, 6, 1, 7, 7, 16), (2, 3, 3, 4, 4, 8),
        (1, 8, 2, 1, 9, 6), (2, 4, 2, 3, 10, 8), (1, 9, 3, 6, 6, 4),
    )  # fmt: skip
    for batch, heads, kv_heads, t, n, dim in shapes:
        q = torch.randn(batch, heads, t, dim, generator=gen)
        k = torch.randn(batch, kv_heads, n, dim, generator=gen)
        v = torch.randn(batch, kv_heads, n, dim, generator=gen)
        out.append((q, k, v))
    return out


def _gqa_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    from ..core.attention import attention, position_mask

    t, n = q.shape[2], k.shape[2]
    return attention(q, k, v, position_mask(torch.arange(n - t, n), torch.arange(n)))


# --- 02 the KV cache --------------------------------------------------------------------------


def _kv_cases(gen: torch.Generator) -> Cases:
    highs = (81, 65, 257, 32769, 65)  # layers, kv_heads, head_dim, seq, batch
    return [tuple(draw_int(gen, 1, hi) for hi in highs) for _ in range(6)]


def _kv_bytes(layers: int, kv_heads: int, head_dim: int, seq: int, batch: int) -> int:
    from ..kvcache.contiguous import kv_cache_bytes

    return kv_cache_bytes(layers, kv_heads, head_dim, seq, batch, 2)


def _sink_cases(gen: torch.Generator) -> Cases:
    out: Cases = []
    settings = ((1, 0, 4, 8), (1, 40, 4, 8), (5, 20, 2, 6), (7, 7, 0, 3), (3, 30, 4, 1))
    for t, start, n_sink, window in (*settings, (4, 10, 16, 64)):  # t queries from ``start``
        q_pos = torch.arange(start, start + t)
        k_pos = torch.arange(start + t)
        k_pos = k_pos[torch.rand(k_pos.numel(), generator=gen) < 0.7]  # a cache that lost some
        out.append((q_pos, k_pos, n_sink, window))
    out.append((torch.arange(3, 5), torch.arange(0), 4, 8))  # an empty cache
    return out


def _sink_visible(q_pos: Tensor, k_pos: Tensor, n_sink: int, window: int) -> Tensor:
    from ..kvcache.eviction import sink_visible

    return sink_visible(q_pos, k_pos, n_sink, window)


def _paged_cases(gen: torch.Generator) -> Cases:
    out: Cases = []
    for blocks, size, n in ((1, 1, 1), (3, 4, 9), (5, 16, 30), (4, 5, 0), (7, 3, 12)):
        table = torch.randperm(2 * blocks, generator=gen)[:blocks].tolist()  # any free blocks
        out.append((table, size, torch.randint(0, blocks * size, (n,), generator=gen)))
    return out


def _paged_slots(table: list[int], block_size: int, positions: Tensor) -> Tensor:
    from ..kvcache.paged import table_slots

    return table_slots(table, block_size, positions)


# --- 03 activation sparsity -------------------------------------------------------------------


def _top_share_cases(gen: torch.Generator) -> Cases:
    out: Cases = []
    for n, share in ((1, 1.0), (10, 0.2), (101, 0.1), (1000, 0.2), (333, 0.05), (64, 0.0)):
        values = torch.rand(n, generator=gen, dtype=torch.float64) ** 6  # a few hot, many cold
        out.append((values, share))
    out.append((torch.zeros(8, dtype=torch.float64), 0.5))  # no neuron ever fired
    return out


def _top_share(values: Tensor, share: float) -> float:
    from ..sparsity.stats import top_share

    return top_share(values, share)


# --- 04 ReLUfication --------------------------------------------------------------------------


def _lr_cases(gen: torch.Generator) -> Cases:
    out: Cases = []
    settings = ((1e-4, 10, 100, 0.1), (3e-4, 0, 50, 0.0), (1.0, 5, 5, 0.5), (2e-5, 3, 20, 1.0))
    for lr, warmup, steps, floor in settings:  # warm-up 0, and warm-up as long as the run
        for step in (0, warmup - 1, warmup, draw_int(gen, 0, steps + 10), steps - 1, steps + 3):
            if step >= 0:
                out.append((step, lr, warmup, steps, floor))
    return out


def _lr_schedule(step: int, lr: float, warmup: int, steps: int, min_lr_ratio: float) -> float:
    from ..relufy.finetune import FinetuneConfig, lr_at

    return lr_at(step, FinetuneConfig(steps=steps, lr=lr, warmup=warmup, min_lr_ratio=min_lr_ratio))


# --- 05 contextual sparsity -------------------------------------------------------------------


def _top_mask_cases(gen: torch.Generator) -> Cases:
    settings = (((1,), 0.5), ((10,), 0.0), ((3, 20), 0.5), ((2, 5, 33), 0.9), ((4, 7), 0.99))
    out: Cases = [(torch.randn(*shape, generator=gen), s) for shape, s in settings]
    out.append((torch.randn(2, 100, generator=gen), 0.25))
    return out


def _top_mask(scores: Tensor, sparsity: float) -> Tensor:
    from ..sparsity.contextual import top_mask

    return top_mask(scores, sparsity)


def _drop_heads_cases(gen: torch.Generator) -> Cases:
    out: Cases = []
    for lead, heads, dim in (((1,), 1, 4), ((2, 3), 4, 8), ((5,), 9, 2), ((2, 2), 3, 16)):
        x = torch.randn(*lead, heads * dim, generator=gen)
        out.append((x, torch.rand(*lead, heads, generator=gen) < 0.6, heads))
    keep = torch.tensor([True, False, True, True, False, False])  # one set for every row
    out.append((torch.randn(3, 6 * 4, generator=gen), keep, 6))
    return out


def _drop_heads(x: Tensor, keep: Tensor, n_heads: int) -> Tensor:
    from ..sparsity.contextual import drop_heads

    return drop_heads(x, keep, n_heads)


#: exercise name -> (the library's reference, fresh inputs for one round)
CASES: dict[str, tuple[Callable[..., Any], Callable[[torch.Generator], Cases]]] = {
    "rms_norm": (_rms_norm, _rms_norm_cases),
    "sampling_probs": (_sampling_probs, _sampling_cases),
    "rope": (_rope, _rope_cases),
    "gqa_attention": (_gqa_attention, _gqa_cases),
    "kv_bytes": (_kv_bytes, _kv_cases),
    "sink_visible": (_sink_visible, _sink_cases),
    "paged_slots": (_paged_slots, _paged_cases),
    "top_share": (_top_share, _top_share_cases),
    "lr_schedule": (_lr_schedule, _lr_cases),
    "top_mask": (_top_mask, _top_mask_cases),
    "drop_heads": (_drop_heads, _drop_heads_cases),
}
