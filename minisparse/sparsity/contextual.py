"""Contextual sparsity: which neurons and heads matter depends on the input (DejaVu).

Chapter 03 showed that most MLP activations are small. Two ways to exploit it differ in *when*
the set of kept units is chosen:

* **static** (pruning): one fixed set per layer, the units with the largest mean score over
  calibration text, the same for every token;
* **contextual** (Liu et al. 2023, "Deja Vu"): a new set for every token, the units that matter
  *for this input*.

DejaVu's oracle measures how far the contextual kind can go. Pass 1 runs the dense model and
records, per token and layer, a score for every unit; pass 2 runs the model again and keeps,
per token, only the top (1 - s) of the units by that score. The scores are the magnitudes the
projections read (chapter 03's sites):

    neuron j of the MLP:   |h_j|,  h = act(W_gate x) * (W_up x)   (the down projection's input)
    attention head i:      ||o_i||_2, the head's output            (its slice of W_o's input)

A kept unit computes exactly as in the dense model; a dropped one contributes zero. Which units
pass 1 keeps is an ``Oracle``: by default ``ScoreOracle`` (``record_scores``, ``oracle_masks``);
``sparsity.oracle.ActivationOracle`` computes each layer's masks from its activations with
functions that can be swapped. Quality is
the held-out perplexity and the *agreement*: the share of positions where the masked model's
most likely next token equals the dense model's. The oracle is not a method (pass 1 costs a
dense pass); it bounds what a predictor of the sets (chapter 06) can reach.

Why predicting is possible at all: the residual stream changes little from one layer to the
next, x_{l+1} = x_l + Attn(...) + MLP(...) with small updates, so cos(x_l, x_{l+1}) is close to
1 (``layer_similarity``). A predictor for layer l + 1 can therefore start from layer l's input,
one layer ahead, and run while layer l computes.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm.auto import tqdm

from ..core.hooks import capture_inputs
from ..core.model import Transformer
from ..io.eval import perplexity_ratio, token_nlls
from ..measure.compare import Interval
from . import check_sparsity, head_norms, record


@dataclass
class UnitScores:
    """Pass 1's record for one batch: per layer, the score of every unit for every token.

    ``neurons[l]``: [batch, seq, ffn_dim], |h_j|; ``heads[l]``: [batch, seq, n_heads], ||o_i||.
    """

    neurons: list[Tensor]
    heads: list[Tensor]


@torch.inference_mode()
def record_scores(model: Transformer, tokens: Tensor) -> tuple[Tensor, UnitScores]:
    """Pass 1: the dense logits of ``tokens`` [batch, seq] and every unit's score.

    |h| is the down projection's input, the head norms come from the o projection's input.
    """
    n_heads = model.config.n_heads
    downs = {str(i): layer.mlp.down_proj for i, layer in enumerate(model.layers)}
    outs = {str(i): layer.attn.o_proj for i, layer in enumerate(model.layers)}

    def per_head(x: Tensor) -> Tensor:
        return head_norms(x, n_heads).view(*x.shape[:-1], n_heads)

    with capture_inputs(downs, torch.abs) as h, capture_inputs(outs, per_head) as o:
        logits = model(tokens)
    return logits, UnitScores([h[k][0] for k in downs], [o[k][0] for k in outs])


def keep_count(n: int, sparsity: float) -> int:
    """Units kept out of n at a given sparsity: n - round(s n), at least one."""
    return max(1, n - round(check_sparsity(sparsity) * n))


def top_mask(scores: Tensor, sparsity: float) -> Tensor:
    """Boolean mask of the top (1 - s) units along the last axis."""
    return top_k_mask(scores, keep_count(scores.shape[-1], sparsity))


def top_k_mask(scores: Tensor, k: int) -> Tensor:
    """Boolean mask of the k largest scores along the last axis."""
    keep = torch.zeros_like(scores, dtype=torch.bool)
    return keep.scatter_(-1, scores.topk(k, dim=-1).indices, True)


@dataclass
class StaticScores:
    """Per layer, the mean score of every unit over calibration text (what pruning keeps)."""

    neurons: list[Tensor]
    heads: list[Tensor]


def static_scores(
    model: Transformer, calibration: Tensor, batch_size: int = 4, progress: bool = False
) -> StaticScores:
    """Mean |h_j| and mean ||o_i|| per layer over ``calibration`` [n, seq] (chapter 03's record)."""
    stats = record(model, calibration, ("down_in", "heads"), batch_size, progress=progress)
    return StaticScores(
        [s.mass / s.tokens for s in stats.sites["down_in"]],
        [s.mass / s.tokens for s in stats.sites["heads"]],
    )


@dataclass
class Masks:
    """What pass 2 keeps: per layer, boolean masks broadcastable to [batch, seq, units].

    ``None`` for a kind keeps every unit of that kind (and installs no hook).
    """

    neurons: list[Tensor] | None = None
    heads: list[Tensor] | None = None


@dataclass(frozen=True)
class Setting:
    """One point of a quality-vs-sparsity curve: the share of neurons and of heads dropped per
    layer, chosen per token (contextual, the oracle) or once for all tokens (static)."""

    mlp: float = 0.0
    heads: float = 0.0
    static: bool = False

    def __post_init__(self) -> None:
        check_sparsity(self.mlp)
        check_sparsity(self.heads)

    @property
    def label(self) -> str:
        parts = []
        if self.mlp:
            parts.append(f"MLP {self.mlp:.0%}")
        if self.heads:
            parts.append(f"heads {self.heads:.0%}")
        how = "static" if self.static else "contextual"
        return f"{how} {' + '.join(parts)}" if parts else "dense"


def oracle_masks(scores: UnitScores | StaticScores, setting: Setting) -> Masks:
    """Masks keeping the top (1 - s) units of each layer by score.

    With per-token ``UnitScores`` (pass 1) this is DejaVu's contextual oracle; with
    ``StaticScores`` (calibration means) the same count of units, one fixed set for all tokens.
    """
    neurons = [top_mask(s, setting.mlp) for s in scores.neurons] if setting.mlp else None
    heads = [top_mask(s, setting.heads) for s in scores.heads] if setting.heads else None
    return Masks(neurons, heads)


class Oracle(Protocol):
    """Pass 1 of a contextual oracle: what it records in the dense pass, and the masks it keeps."""

    def record(self, model: Transformer, tokens: Tensor) -> tuple[Tensor, Any]: ...

    def masks(self, model: Transformer, recorded: Any, setting: Setting) -> Masks: ...


class ScoreOracle:
    """DejaVu's oracle as ``oracle_quality`` runs it by default: ``record_scores``, then
    ``oracle_masks`` (``sparsity.oracle.ActivationOracle`` computes the masks from each layer's
    activations with given functions instead)."""

    def record(self, model: Transformer, tokens: Tensor) -> tuple[Tensor, UnitScores]:
        return record_scores(model, tokens)

    def masks(self, model: Transformer, recorded: UnitScores, setting: Setting) -> Masks:
        return oracle_masks(recorded, setting)


def drop_heads(x: Tensor, keep: Tensor, n_heads: int) -> Tensor:
    """Zero the heads not in ``keep`` [..., n_heads] of an attention output x [..., heads * d]."""
    heads = x.view(*x.shape[:-1], n_heads, -1) * keep.to(x.device, x.dtype)[..., None]
    return heads.view(x.shape)


@contextlib.contextmanager
def masks_applied(model: Transformer, masks: Masks) -> Iterator[Transformer]:
    """Pass 2: run a block with the dropped neurons' h_j and heads' outputs set to zero.

    Hooks multiply the down projection's input by the neuron masks and the o projection's input
    by the head masks, so a kept unit computes exactly as in the dense model.
    """
    n_heads = model.config.n_heads
    handles = []

    def mask_neurons(keep: Tensor):
        return lambda _m, _a, out: out * keep.to(out.device, out.dtype)

    def mask_heads(keep: Tensor):
        return lambda _m, args: (drop_heads(args[0], keep, n_heads),)

    for i, layer in enumerate(model.layers):
        if masks.neurons is not None:
            hook = mask_neurons(masks.neurons[i])
            handles.append(layer.mlp.down_in_act.register_forward_hook(hook))
        if masks.heads is not None:
            handles.append(layer.attn.o_proj.register_forward_pre_hook(mask_heads(masks.heads[i])))
    try:
        yield model
    finally:
        for h in handles:
            h.remove()


@dataclass
class Quality:
    """Held-out quality of one setting next to the dense model on the same tokens."""

    setting: Setting
    ppl: float
    dense_ppl: float
    agreement: float  # share of positions whose argmax equals the dense model's
    neuron_density: float  # share of neurons kept per layer
    head_density: float  # share of heads kept per layer
    overall: float  # share of attention + MLP weights not read (``overall_sparsity``)
    window_nll: tuple[float, ...] = ()  # mean NLL of each held-out window, masked model
    dense_window_nll: tuple[float, ...] = ()  # the same windows, dense model

    @property
    def ppl_increase(self) -> float:
        return self.ppl / self.dense_ppl - 1

    def ratio(self, rounds: int = 2000, seed: int = 0) -> Interval:
        """Perplexity over the dense model's on the same windows, with its 95 % paired
        bootstrap interval (``minisparse.io.eval.perplexity_ratio``)."""
        if not self.window_nll or len(self.window_nll) != len(self.dense_window_nll):
            raise ValueError(
                "This Quality has no per-window NLLs for both models; make it with "
                "oracle_quality, which records them."
            )
        nll = torch.tensor(self.window_nll, dtype=torch.float64)
        dense = torch.tensor(self.dense_window_nll, dtype=torch.float64)
        return perplexity_ratio(nll, dense, rounds, seed)


class Tally:
    """Sums of negative log-likelihood and agreeing argmaxes over the batches."""

    def __init__(self) -> None:
        self.nll, self.agree, self.count = 0.0, 0, 0
        self.windows: list[float] = []  # mean NLL of each window (row of tokens)

    def add(self, logits: Tensor, tokens: Tensor, reference: Tensor) -> None:
        per_token = token_nlls(logits, tokens)
        self.nll += float(per_token.sum())
        self.windows += per_token.double().mean(1).tolist()
        self.agree += int((logits[:, :-1].argmax(-1) == reference).sum())
        self.count += per_token.numel()

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.count)


@torch.inference_mode()
def oracle_quality(
    model: Transformer,
    windows: Tensor,
    settings: Sequence[Setting],
    static: StaticScores | None = None,
    batch_size: int = 4,
    progress: bool = True,
    oracle: Oracle | None = None,
) -> list[Quality]:
    """Perplexity and agreement with dense for each setting, on ``windows`` [n, seq].

    One dense pass per batch (pass 1) serves every setting; each setting then costs one masked
    pass. Static settings need ``static`` (``static_scores`` on calibration text, not on
    ``windows``). ``oracle`` chooses the contextual masks (default ``ScoreOracle``).
    """
    if any(s.static for s in settings) and static is None:
        raise ValueError("Static settings need static=static_scores(model, calibration_windows).")
    oracle = ScoreOracle() if oracle is None else oracle
    device = next(model.parameters()).device
    dense, tallies = Tally(), {s: Tally() for s in settings}
    batches = windows.split(batch_size)
    bar = tqdm(total=len(batches) * (1 + len(settings)), desc="oracle", disable=not progress)
    for tokens in batches:
        tokens = tokens.to(device)
        logits, recorded = oracle.record(model, tokens)
        reference = logits[:, :-1].argmax(-1)
        dense.add(logits, tokens, reference)
        bar.update()
        for s in settings:
            if s.static and static is not None:
                masks = oracle_masks(static, s)
            else:
                masks = oracle.masks(model, recorded, s)
            with masks_applied(model, masks):
                tallies[s].add(model(tokens), tokens, reference)
            bar.update()
    bar.close()
    c = model.config
    results = []
    for s in settings:
        neurons = keep_count(c.ffn_dim, s.mlp) / c.ffn_dim
        heads = keep_count(c.n_heads, s.heads) / c.n_heads
        tally = tallies[s]
        results.append(
            Quality(
                s,
                tally.ppl,
                dense.ppl,
                tally.agree / tally.count,
                neurons,
                heads,
                overall_sparsity(model, neurons, heads),
                tuple(tally.windows),
                tuple(dense.windows),
            )
        )
    return results


def overall_sparsity(model: Transformer, neuron_density: float, head_density: float) -> float:
    """Share of the attention + MLP weights a token need not read, counting what stays dense.

    Dropping head i skips its rows of W_q and its columns of W_o; with grouped-query attention
    W_k and W_v are shared by a group and stay dense. Dropping neuron j skips row j of W_gate
    and W_up and column j of W_down.
    """
    c = model.config
    q_o = 2 * c.dim * c.n_heads * c.head_dim
    k_v = 2 * c.dim * c.n_kv_heads * c.head_dim
    mlp = 3 * c.dim * c.ffn_dim
    kept = q_o * head_density + k_v + mlp * neuron_density
    return 1 - kept / (q_o + k_v + mlp)


@torch.inference_mode()
def layer_similarity(model: Transformer, tokens: Tensor) -> dict[str, list[float]]:
    """Mean cosine similarity between consecutive layers' inputs, per layer l (l -> l + 1).

    ``residual``: cos(x_l, x_{l+1}) of the residual stream entering layers l and l + 1;
    ``mlp_in``: the same for the normed MLP inputs, what a neuron predictor reads.
    """
    layers = {str(i): layer for i, layer in enumerate(model.layers)}
    mlps = {str(i): layer.mlp for i, layer in enumerate(model.layers)}
    with capture_inputs(layers) as x, capture_inputs(mlps) as m:
        model(tokens.to(next(model.parameters()).device))
    stream = [x[k][0] for k in layers]
    mlp_in = [m[k][0] for k in mlps]

    def consecutive(xs: list[Tensor]) -> list[float]:
        return [float(F.cosine_similarity(a, b, dim=-1).mean()) for a, b in itertools.pairwise(xs)]

    return {"residual": consecutive(stream), "mlp_in": consecutive(mlp_in)}


__all__ = [
    "Masks",
    "Oracle",
    "Quality",
    "ScoreOracle",
    "Setting",
    "StaticScores",
    "Tally",
    "UnitScores",
    "drop_heads",
    "keep_count",
    "layer_similarity",
    "masks_applied",
    "oracle_masks",
    "oracle_quality",
    "overall_sparsity",
    "record_scores",
    "static_scores",
    "top_k_mask",
    "top_mask",
]
