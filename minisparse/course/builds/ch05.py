"""Chapter 05's builds: DejaVu's oracle masks, computed from one layer's activations.

``oracle_neuron_mask(gate, up, act, sparsity)`` gets a layer's gate and up projections' outputs
g = W_gate x and u = W_up x ([..., n], one row per token) and the activation's name; the
neuron's score is the magnitude the down projection reads, |h_j| with h = act(g) * u, and the
mask keeps, per row, the k = max(1, n - round(s n)) largest scores.
``oracle_head_mask(o, n_heads, sparsity)`` gets the attention output before W_o, [..., H * d],
head i owning the consecutive channels i d .. (i + 1) d - 1; the score is ||o_i||_2 and the mask
keeps the k largest of the H per row.

Both are graded against the library's (``sparsity.oracle``) on odd shapes, 2-D and 3-D inputs,
the three activations, a single unit, sparsities whose k falls to the floor of 1, and rows of
exact ties (ReLU zeros, all-zero rows). Where scores tie any top-k set is right, so a mask passes
when it keeps exactly k units per row and no dropped unit scores above a kept one (float64
scores, 1e-5 of the row's largest as slack). The chapter then runs its oracle-quality curves
with ``oracle_quality(..., oracle=ActivationOracle(neurons, heads))``: the learner's functions
choose every contextual mask whose perplexity it prints.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ...sparsity.contextual import keep_count
from ...sparsity.oracle import oracle_head_mask, oracle_neuron_mask
from ..grading import Exercise, equal, keeps_top, register

__all__: list[str] = []

Cases = list[tuple[Any, ...]]

_ACTS = {"silu": F.silu, "relu": F.relu, "gelu": F.gelu}


def _keeps_top_k(scores: Tensor, got: Any, sparsity: float) -> bool:
    """A mask keeping k = max(1, n - round(s n)) per row, no dropped score above a kept one."""
    return keeps_top(scores, got, keep_count(scores.shape[-1], sparsity))


def _neuron_cases(gen: torch.Generator) -> Cases:
    out: Cases = []
    shapes = (  # rows, n, act, sparsity
        ((1, 1), "silu", 0.5), ((3, 7), "silu", 0.0), ((4, 13), "relu", 0.6),
        ((2, 5, 24), "gelu", 0.3), ((6, 40), "silu", 0.99), ((2, 3, 64), "relu", 0.9),
    )  # fmt: skip
    for shape, act, sparsity in shapes:
        gate = torch.randn(*shape, generator=gen) * 2
        up = torch.randn(*shape, generator=gen)
        out.append((gate, up, act, sparsity))
    up = torch.randn(4, 11, generator=gen)
    up[1] = 0  # a row of ties: h = 0 for every neuron
    out.append((torch.randn(4, 11, generator=gen), up, "silu", 0.5))
    return out


def _neuron_accepts(args: tuple[Any, ...], got: Any, expected: Any) -> bool:
    gate, up, act, sparsity = args
    return _keeps_top_k((_ACTS[act](gate.double()) * up.double()).abs(), got, sparsity)


register(
    "oracle_neuron_mask",
    Exercise(
        "05",
        "oracle_neuron_mask(gate [..., n], up [..., n], act, sparsity) -> bool [..., n]: one "
        "layer's oracle mask from its gate and up projections' outputs g = W_gate x and "
        "u = W_up x; per row, True for the k = max(1, n - round(sparsity * n)) neurons with the "
        "largest |h_j|, h = act(g) * u (act: 'silu', 'relu' or 'gelu')",
        oracle_neuron_mask,
        _neuron_cases,
        equal,  # replaced by ``accepts``: any top-k set is right where scores tie
        "score each neuron by |act(gate) * up| (what the down projection reads, not the gate "
        "alone, and its magnitude, not its sign); sparsity is the share dropped, so keep "
        "k = max(1, n - round(sparsity * n)) per row along the last axis: "
        "torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, scores.topk(k).indices, True)",
        accepts=_neuron_accepts,
        core=True,
    ),
)


def _head_cases(gen: torch.Generator) -> Cases:
    out: Cases = []
    shapes = (  # rows, n_heads, head_dim, sparsity
        ((1,), 1, 4, 0.5), ((5,), 3, 2, 1 / 3), ((2, 4), 9, 8, 2 / 9),
        ((6,), 4, 1, 0.5), ((3,), 6, 5, 0.95), ((2, 3), 4, 16, 0.0),
    )  # fmt: skip
    for rows, heads, dim, sparsity in shapes:
        out.append((torch.randn(*rows, heads * dim, generator=gen), heads, sparsity))
    o = torch.randn(4, 5 * 3, generator=gen)
    o[2] = 0  # a row of ties: every head's output is zero
    out.append((o, 5, 0.4))
    return out


def _head_accepts(args: tuple[Any, ...], got: Any, expected: Any) -> bool:
    o, n_heads, sparsity = args
    norms = o.double().reshape(*o.shape[:-1], n_heads, -1).norm(dim=-1)
    return _keeps_top_k(norms, got, sparsity)


register(
    "oracle_head_mask",
    Exercise(
        "05",
        "oracle_head_mask(o [..., n_heads * d], n_heads, sparsity) -> bool [..., n_heads]: one "
        "layer's oracle mask of attention heads from the attention output before W_o (head i "
        "owns channels i*d .. (i+1)*d - 1); per row, True for the "
        "k = max(1, n_heads - round(sparsity * n_heads)) heads with the largest ||o_i||_2",
        oracle_head_mask,
        _head_cases,
        equal,  # replaced by ``accepts``
        "view o as [..., n_heads, d] (consecutive channels per head, not interleaved), take the "
        "L2 norm over d, then keep k = max(1, n_heads - round(sparsity * n_heads)) per row "
        "with topk along the last axis",
        accepts=_head_accepts,
        core=True,
    ),
)
