"""Measuring sparse decoding: speed side by side, bytes per token, per-token perplexity.

The functions behind ``minisparse bench sparse-decode`` (``minisparse.bench.sparse_decode``).
Only decoding is timed: each model prefills the prompt once into a static KV cache and keeps
one ``Decoder``; each timed run makes exactly N greedy ``decoder.step`` calls from the same
first token (the model's own greedy one) and position, never stopping at an end token. The
models alternate within each repeat (``minisparse.measure.timing``); speed: N / median time.

The ceiling. A batch-1 step is bound by memory: its time is about B / bandwidth, B the weight
bytes it reads (dense: B_d = ``engine.step_bytes``). A zero input x_j makes the column W[:, j]
of each projection it feeds useless. With s_{l,site} the share of zero inputs of layer l at a
site, W_{l,site} the weight bytes of the projections it feeds, P the predictors' bytes:

    B_s = step_bytes(sparse) - sum_{l, site} s_{l,site} W_{l,site} + P,   ceiling = B_d / B_s.

``step_bytes`` counts a sparse MLP at the share d of neurons it read over the decode runs (d of
gate, up and down); P is added as the MLPs call the predictors without holding them as modules.
The s are measured by one untimed pass of the sparse model as torch modules over the decoded
tokens, forward hooks on the threshold modules counting the zeros they output; o_proj and the
LM head stay dense. ``share_of_ceiling`` = (sparse / dense tokens/s) / ceiling.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ..core.hooks import capture_outputs, zero_fraction
from ..core.model import Transformer
from ..core.sampling import check_length
from ..io.eval import perplexity
from ..kvcache.contiguous import make_kv_cache
from ..measure.compare import Interval, median_interval
from ..measure.timing import ModelSpeed, interleaved_decode, read_bandwidth, rounds_until_narrow
from ..predictors import LayerSelect, Predictors
from ..predictors.pipeline import predicted_masks_applied
from ..quant.apply import streamed_bytes
from ..runtime.decoder import Decoder
from ..sparse.mlp import SparseMLP
from ..sparse.traffic import step_bytes
from ..sparsity import SLOTS, MagnitudeThreshold

__all__ = [
    "SITE_PROJECTIONS",
    "SparseDecodeResult",
    "bench_sparse_decode",
    "called_predictors",
    "greedy_steps",
    "predictor_bytes",
    "prefill",
    "site_zero_shares",
    "sparse_perplexity",
    "thresholded_step_bytes",
]

#: Per threshold site: the part of the block and the projections whose inputs it is.
SITE_PROJECTIONS = {
    "attn_in": ("attn", ("q_proj", "k_proj", "v_proj")),
    "mlp_in": ("mlp", ("gate_proj", "up_proj")),
    "down_in": ("mlp", ("down_proj",)),
}
Shares = dict[str, Sequence[float]]  # per site, per layer: the share of zero inputs


@dataclass
class SparseDecodeResult:
    """Decode speed, bytes per token and perplexity of a dense model and its sparse version."""

    method: str
    new_tokens: int
    dense_tok_s: float
    sparse_tok_s: float
    dense_mb_per_token: float
    sparse_mb_per_token: float  # at the measured sparsity, predictors included
    ppl_dense: float
    ppl_sparse: float
    sparsity: float  # mean share of skipped inputs (per site and layer) or neurons (per layer)
    same_tokens: bool  # the two greedy token lists, first token included, are equal
    ratio: float  # sparse / dense speed, paired per round (``ModelSpeed.paired_speedup``)
    site_sparsity: dict[str, float] = field(default_factory=dict)  # the mean of each site
    ratio_low: float = float("nan")  # the 95 % interval of ``ratio`` (``median_interval``)
    ratio_high: float = float("nan")
    rounds: int = 0  # interleaved rounds the ratio rests on
    read_gbs: float = float("nan")  # read bandwidth measured in the same run, around the rounds
    ceiling: float = field(init=False)  # dense / sparse bytes per token
    share_of_ceiling: float = field(init=False)  # ratio / ceiling
    dense_gbs: float = field(init=False)  # weight bytes streamed per second while decoding
    sparse_gbs: float = field(init=False)

    def __post_init__(self) -> None:
        self.ceiling = self.dense_mb_per_token / self.sparse_mb_per_token
        self.share_of_ceiling = self.ratio / self.ceiling
        self.dense_gbs = self.dense_mb_per_token * self.dense_tok_s / 1e3
        self.sparse_gbs = self.sparse_mb_per_token * self.sparse_tok_s / 1e3

    def interval(self) -> Interval:
        """The paired ratio within its 95 % interval."""
        return Interval(self.ratio, self.ratio_low, self.ratio_high)

    def share_interval(self) -> Interval:
        """The share of the ceiling within its 95 % interval."""
        c = self.ceiling
        return Interval(self.ratio / c, self.ratio_low / c, self.ratio_high / c)


def thresholded_step_bytes(model: Transformer, shares: Shares) -> float:
    """``engine.step_bytes`` less, per layer and site, the share ``shares[site][l]`` of the
    weight bytes of the projections that site feeds (``SITE_PROJECTIONS``; 0: not looked up)."""
    total = step_bytes(model)
    for site, values in shares.items():
        part, names = SITE_PROJECTIONS[site]
        for layer, s in zip(model.layers, values, strict=True):
            weights = [getattr(getattr(layer, part), n).weight for n in names] if s else []
            total -= s * sum(w.numel() * w.element_size() for w in weights)
    return total


def called_predictors(model: Transformer) -> tuple[Predictors | None, list[nn.Module]]:
    """The ``Predictors`` whose ``select`` the model's sparse MLPs call (None if none do), and
    the per-layer predictors they call."""
    owner, found = None, {}
    for m in model.modules():
        select = m.select if isinstance(m, SparseMLP) else None
        if isinstance(select, LayerSelect):
            owner, layer = select.owner, select.predictor
            found[id(layer)] = layer
    return owner, list(found.values())


def predictor_bytes(model: Transformer) -> int:
    """Bytes of the predictors the model's sparse MLPs call at every step (``Predictors.select``
    of one layer); they are not modules of the model, so ``step_bytes`` leaves them out."""
    return sum(streamed_bytes(p) for p in called_predictors(model)[1])


@torch.inference_mode()
def sparse_perplexity(dense: Transformer, sparse: Transformer, eval_ids: Tensor) -> float:
    """Perplexity of ``sparse`` on ``eval_ids`` as it decodes: every token with its own neurons.

    A sparse MLP given many tokens at once computes the union of their predicted neurons (one
    weight read for all), so ``perplexity(sparse)`` over 256-token windows would keep nearly
    every neuron. When predictors choose the neurons, the dense model runs instead with each
    token's MLP masked to its own predicted set (chapter 06's ``predicted_masks_applied``):
    the function a decode step computes. Threshold masks are per token already.
    """
    predictors, _ = called_predictors(sparse)
    if predictors is None:
        return perplexity(sparse, eval_ids, seq_len=256, progress=False)
    with predicted_masks_applied(dense, predictors, "predicted", heads=False):
        return perplexity(dense, eval_ids, seq_len=256, progress=False)


@torch.inference_mode()
def prefill(model: Transformer, prompt_ids: list[int], new_tokens: int) -> tuple[Any, int]:
    """A static KV cache holding the prompt, and the model's greedy token after it."""
    total = check_length(model, len(prompt_ids), new_tokens + 1)
    kv = make_kv_cache("static", model.config, total, 1, torch.float32, "cpu")
    hidden = model.hidden_states(torch.tensor([prompt_ids]), torch.arange(len(prompt_ids)), kv)
    return kv, int(model.lm_head(hidden[0, -1]).argmax())


def greedy_steps(
    model: Transformer, prompt_ids: list[int], n: int, lib: Any = None
) -> tuple[int, Callable]:
    """The greedy token after the prompt, and a function that decodes the n after it with
    compiled decode steps (``lib``: a build of ``runtime/step.c``, default the chosen one)."""
    kv, first = prefill(model, prompt_ids, n)
    decoder, pos = Decoder(model, kv, lib), len(prompt_ids)

    @torch.inference_mode()
    def run() -> list[int]:
        tokens = [first]
        for i in range(n):
            tokens.append(int(decoder.step(tokens[-1], pos + i).argmax()))
        return tokens[1:]

    return first, run


@torch.inference_mode()
def site_zero_shares(model: Transformer, prompt_ids: list[int], tokens: list[int]) -> Shares:
    """Per site, per layer: the share of zeros its threshold module (0 without) output while the
    model, as torch modules, stepped through ``tokens``, ``tokens[i]`` at len(prompt) + i."""
    kv, _ = prefill(model, prompt_ids, len(tokens))
    modules = {}
    for site in SITE_PROJECTIONS:
        for i, layer in enumerate(model.layers):
            owner, name = SLOTS[site](layer)
            if isinstance(module := getattr(owner, name), MagnitudeThreshold):
                modules[f"{site}.{i}"] = module
    with capture_outputs(modules) as outputs:  # hooks see only the decode steps below
        for i, t in enumerate(tokens):
            model(torch.tensor([[t]]), torch.tensor([len(prompt_ids) + i]), kv)
    return {
        site: [
            zero_fraction(torch.cat(outputs[key])) if (key := f"{site}.{i}") in outputs else 0.0
            for i in range(len(model.layers))
        ]
        for site in SITE_PROJECTIONS
    }


def bench_sparse_decode(
    dense: Transformer, sparse: Transformer, prompt_ids: list[int], eval_ids: Tensor | None,
    method: str = "teal", max_new_tokens: int = 64, repeats: int = 5, progress: bool = True,
    most: int | None = None,
) -> SparseDecodeResult:  # fmt: skip
    """Decode tokens/s of ``dense`` and ``sparse`` side by side, their bytes per token at the
    sparsity measured on the decoded tokens, and their perplexity on ``eval_ids`` (NaN when
    it is None: random weights).

    ``repeats`` interleaved rounds first (after one warm-up round), then more, up to ``most``
    (default: ``repeats``, no more), while the paired ratio's 95 % interval is wider than
    ±10 % (``timing.rounds_until_narrow``). The read bandwidth is measured just before and
    just after the rounds, in this process (the mean of the two)."""
    firsts, runs = {}, {}
    for name, model in (("dense", dense), ("sparse", sparse)):
        firsts[name], runs[name] = greedy_steps(model, prompt_ids, max_new_tokens)
    mlps = [m for m in sparse.modules() if isinstance(m, SparseMLP)]
    for m in mlps:  # count the decode runs' steps only
        m.step_density = [0.0, 0]
    before = read_bandwidth(repeats=5)
    speeds: dict[str, ModelSpeed] = {}

    def more(n: int) -> list[float]:
        first = not speeds
        got = interleaved_decode(runs, n, 1 if first else 0, progress)
        for name, speed in got.items():  # the rounds so far, and the latest tokens
            rounds = speed.rounds if first else [*speeds[name].rounds, *speed.rounds]
            speeds[name] = ModelSpeed(1.0 / statistics.median(rounds), speed.tokens, rounds)
        return got["sparse"].round_speedups(got["dense"])

    ratios = rounds_until_narrow(more, repeats, max(repeats, most or repeats))
    bandwidth = (before + read_bandwidth(repeats=5)) / 2
    ratio = median_interval(ratios)
    tokens = {name: [firsts[name], *speeds[name].tokens] for name in runs}
    means = {"neurons": [1 - d / n for d, n in (m.step_density for m in mlps) if n]}
    shares = {site: [0.0] * len(sparse.layers) for site in SITE_PROJECTIONS}
    if any(isinstance(m, MagnitudeThreshold) for m in sparse.modules()):
        shares = site_zero_shares(sparse, prompt_ids, tokens["sparse"][:-1])
        means |= {site: v for site, v in shares.items() if any(v)}
    values = [x for v in means.values() for x in v]
    sparse_bytes = thresholded_step_bytes(sparse, shares) + predictor_bytes(sparse)
    ppl = [float("nan")] * 2  # random weights (``eval_ids`` None): no perplexity to speak of
    if eval_ids is not None:
        with torch.inference_mode():
            ppl = [perplexity(dense, eval_ids, seq_len=256, progress=False)]
        ppl.append(sparse_perplexity(dense, sparse, eval_ids))
    return SparseDecodeResult(
        method=method,
        new_tokens=max_new_tokens,
        dense_tok_s=speeds["dense"].tok_s,
        sparse_tok_s=speeds["sparse"].tok_s,
        dense_mb_per_token=step_bytes(dense) / 1e6,
        sparse_mb_per_token=sparse_bytes / 1e6,
        ppl_dense=ppl[0],
        ppl_sparse=ppl[1],
        sparsity=sum(values) / len(values) if values else 0.0,
        same_tokens=tokens["dense"] == tokens["sparse"],
        ratio=ratio.mid,
        site_sparsity={site: sum(v) / len(v) for site, v in means.items() if v},
        ratio_low=ratio.low,
        ratio_high=ratio.high,
        rounds=len(ratios),
        read_gbs=bandwidth,
    )
