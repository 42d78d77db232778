"""One engine: the course's techniques combined, configured by one dataclass (chapter 11).

Each chapter built one way to read fewer bytes per token. ``build`` composes them on a model,
calling each chapter's own code, in the order the bytes flow:

1. which neurons are active: the fine-tuned ReLU model of chapter 04 (exact zeros) or
   chapter 03's CATS thresholds on act(W_gate x) (training-free, approximate);
2. how they are found: the threshold itself (an oracle that computes the gate densely), or
   chapter 06's predictors (``predictors=`` a file saved by ``minisparse predictors``);
3. how they are computed: chapter 07's sparse kernels (``SparseMLP``), or the masked dense
   reference (``sparse_kernels=False``: same result, every byte read);
4. where they live: chapter 08's hot/cold split under a fast-device budget (its speed is
   modelled without a GPU; the logits are computed exactly on the CPU);
5. how many bits each weight has: chapter 09's weight-only int8 / int4 layers;
6. how many tokens one pass yields: chapter 10's speculative decoding with a draft.

What does not combine is refused with the reason. Sparsity and int8 weights multiply: the model
is quantized first (chapter 09, every linear layer), then its int8 MLPs become sparse int8
MLPs that read the int8 codes of the active neurons only (``minisparse.kernels.cpu_int8``):
(1 - s) / 4 of the float32 bytes of a sparse matrix. Sparse int4 weights are not done (there
is no sparse int4 kernel), so int4 and sparsity are refused; so is the hot/cold split of
chapter 08 with low-bit weights (it places float32 neurons); a draft cannot be the target
itself (an int8 draft for an int8 target).

``Engine.generate`` decodes with the result; for lossless configurations (speculative
decoding, the ReLU model with exact masks) its greedy tokens equal plain greedy decoding of
the same model, which the tests check.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from ..core.generate import generate
from ..core.model import Transformer, check_count
from ..offload.placement import Placement

__all__ = [
    "DRAFTS",
    "SPARSITY",
    "WEIGHTS",
    "Engine",
    "EngineConfig",
    "build",
    "low_bit",
    "sparse_model",
    "step_bytes",
]

SPARSITY = ("none", "relu", "cats")
WEIGHTS = ("fp32", "int8", "int4")
DRAFTS = (None, "prompt-lookup", "int8", "sparse")
INT4_GROUP = 32  # int4 weights: one scale and zero point per 32 weights (chapter 09)


@dataclass(frozen=True)
class EngineConfig:
    """Which technique of each chapter the engine uses (defaults: the dense model)."""

    sparsity: str = "none"  # "relu" (chapter 04), "cats" (chapter 03) or "none"
    cats_sparsity: float = 0.5  # share of neurons the CATS thresholds skip
    predictors: str | None = None  # chapter 06 predictors file; None: the threshold (oracle)
    sparse_kernels: bool = True  # chapter 07 kernels; False: the masked dense reference
    offload_budget: float | None = None  # chapter 08: share of FFN bytes on the fast device
    weights: str = "fp32"  # chapter 09: "int8" / "int4" weight-only layers
    draft: str | None = None  # chapter 10: "prompt-lookup", "int8" or "sparse"
    gamma: int = 4  # tokens the draft proposes per pass

    def check(self) -> EngineConfig:
        """Return self, or raise one ValueError that names the conflicting settings."""
        choices = (("sparsity", SPARSITY), ("weights", WEIGHTS), ("draft", DRAFTS))
        for name, allowed in choices:
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}.")
        if not 0.0 <= self.cats_sparsity < 1.0:
            raise ValueError(f"cats_sparsity must be in [0, 1), got {self.cats_sparsity}.")
        check_count(self.gamma, "gamma", fix="the number of tokens a draft proposes per pass")
        if not isinstance(self.sparse_kernels, bool):
            raise ValueError(f"sparse_kernels is True or False, got {self.sparse_kernels!r}.")
        sparse = self.sparsity != "none"
        if self.offload_budget is not None and not 0 < self.offload_budget <= 1:
            raise ValueError(f"offload_budget is a share in (0, 1], got {self.offload_budget}.")
        needs_sparsity = {
            "predictors": self.predictors is not None,
            "offload_budget": self.offload_budget is not None,
            "sparse_kernels=False": not self.sparse_kernels,
        }
        for name, used in needs_sparsity.items():
            if used and not sparse:
                raise ValueError(f"{name} needs active neurons: set sparsity='relu' or 'cats'.")
        if sparse and self.weights == "int4":
            raise ValueError(
                "Sparse int4 weights are not done (there is no sparse int4 kernel): sparsity "
                "and weights='int4' do not combine. Choose weights='int8' (sparse int8 kernels), "
                "weights='fp32', or sparsity='none'."
            )
        if self.offload_budget is not None and self.weights != "fp32":
            raise ValueError(
                "The hot/cold split (offload_budget) places float32 neurons: it does not combine "
                f"with weights={self.weights!r}. Choose weights='fp32' or offload_budget=None."
            )
        if self.draft in ("int8", "sparse") and self.weights == "int4":
            raise ValueError(
                f"A {self.draft} draft is made from the model's float32 weights, which "
                "weights='int4' replaces: use draft='prompt-lookup' with int4 weights, or "
                "weights='fp32' / 'int8'."
            )
        if self.draft == "int8" and self.weights == "int8":
            raise ValueError("An int8 draft of an int8 model is the model itself; pick another.")
        if self.draft == "sparse" and sparse:
            raise ValueError("A sparse draft of a sparse model is the model itself; pick another.")
        return self


@dataclass
class Engine:
    """A built configuration: the model to run, its draft, and what chapter 08 placed."""

    config: EngineConfig
    model: Transformer
    tokenizer: Any
    draft: Any = None
    placement: Placement | None = None
    description: str = ""
    last_stats: Any = None  # the last speculative run's SpeculativeStats (None without a draft)
    dense_model: Transformer | None = None  # with predictors: the model before they chose neurons

    def generate(self, prompt: Any, max_new_tokens: int = 64, **sampling: Any) -> list[int]:
        """New token ids after ``prompt``, as ``minisparse.generate`` returns them."""
        if self.draft is None:
            return generate(self.model, self.tokenizer, prompt, max_new_tokens, **sampling)
        from ..speculative.loop import speculative_generate

        ids, self.last_stats = speculative_generate(
            self.model, self.tokenizer, prompt, self.draft, self.config.gamma, max_new_tokens,
            **sampling,
        )  # fmt: skip
        return ids

    def bytes_per_token(self) -> float:
        """Weight bytes read per emitted token, at the sparse MLPs' last measured density.

        One decode step reads ``step_bytes(model)``; speculative decoding reads one target pass
        (the weights once for all gamma + 1 positions, at batch 1 bandwidth-bound) and the
        draft's steps per pass, and emits ``tokens_per_call`` tokens per pass (the last run's).
        """
        target = step_bytes(self.model)
        stats = self.last_stats
        if self.draft is None or stats is None or not stats.target_calls:
            return target
        draft_model = getattr(self.draft, "model", None)
        draft = 0.0 if draft_model is None else step_bytes(draft_model)
        per_pass = target + draft * stats.draft_calls / stats.target_calls
        return per_pass / stats.tokens_per_call

    def resident_bytes(self) -> int:
        """Bytes of the model's parameters and buffers (what must sit in memory)."""
        tensors = [*self.model.parameters(), *self.model.buffers()]
        return sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())


def step_bytes(model: Transformer) -> float:
    """Weight bytes one batch-1 decode step reads, sparse MLPs at their last density.

    Every weight is read once (``quant.streamed_bytes``), except in a ``SparseMLP``: with a
    threshold it reads its gate densely and the active share d of up and down,
    (1 + 2 d) / 3 of its bytes; with a selector, d of all three. d is the mean share the
    module read over its one-token calls so far (``step_density``: the decode steps it ran);
    before any, the mean per-token share of its last call's mask (``last_keep``). A
    verification pass over several tokens reads the union of their neurons, more than this.
    """
    from ..quant.apply import streamed_bytes
    from ..sparse.mlp import SparseMLP

    total = float(streamed_bytes(model))
    for m in model.modules():
        if not isinstance(m, SparseMLP):
            continue
        counted = streamed_bytes(m)
        own = sum(t.numel() * t.element_size() for t in m.buffers())
        summed, steps = m.step_density
        keep = m.last_keep
        if steps:
            d = summed / steps
        else:
            d = float(keep.float().mean()) if keep is not None else m.last_density
        share = (1 + 2 * d) / 3 if m.threshold is not None else d
        total += own * share - counted
    return total


def build(
    base: Transformer,
    tokenizer: Any,
    config: EngineConfig,
    calibration: Tensor | None = None,
) -> Engine:
    """The engine ``config`` describes, built on ``base`` (left unchanged).

    ``calibration`` [batch, seq] token ids: needed for CATS thresholds, a placement and the
    sparse draft.
    """
    config.check()
    needs = config.sparsity == "cats" or config.offload_budget is not None
    if (needs or config.draft == "sparse") and calibration is None:
        raise ValueError("This configuration calibrates on text: pass calibration= token ids.")
    model, parts = base, []
    if config.sparsity == "relu":
        from ..relufy.recipe import load_relufied

        model, _ = load_relufied(base, 1)
        parts.append("ReLU model (ch. 04)")
    select = load_selector(model, config.predictors)  # predictors are made for float weights
    if config.weights == "int8" and config.sparsity != "none":
        model = low_bit(model, config.weights)  # first: the sparse MLPs take int8 projections
    thresholds = active_thresholds(model, config, calibration)
    dense = model if select is not None else None  # the per-token perplexity's reference
    placement = None
    if config.offload_budget is not None:
        placement = place_neurons(model, thresholds, config.offload_budget, calibration)
        model = split(model, placement, thresholds, select)
        parts.append(f"hot/cold split at {config.offload_budget:.0%} of FFN bytes (ch. 08)")
    elif thresholds is not None:
        model = sparse_model(model, thresholds, select, config.sparse_kernels)
        kernels = "sparse int8 kernels" if config.weights == "int8" else "sparse kernels"
        kind = kernels if config.sparse_kernels else "masked dense MLPs"
        finder = "predictors" if select else "thresholds"
        parts.append(f"{kind}, neurons from {finder} (ch. 0{6 if select else 3}, 07)")
    if config.weights != "fp32":
        if config.sparsity == "none":
            model = low_bit(model, config.weights)
        parts.append(f"{config.weights} weights (ch. 09)")
    draft = make_draft(model, config.draft, calibration)
    if draft is not None:
        parts.append(f"{config.draft} draft, gamma {config.gamma} (ch. 10)")
    text = ", ".join(parts) or "the dense model"
    return Engine(config, model, tokenizer, draft, placement, text, dense_model=dense)


def active_thresholds(
    model: Transformer, config: EngineConfig, calibration: Tensor | None
) -> list[float] | None:
    """Per-layer thresholds on |act(W_gate x)|: 0 for the ReLU model, CATS's otherwise."""
    if config.sparsity == "none":
        return None
    if config.sparsity == "relu":
        return [0.0] * len(model.layers)
    from ..sparse.mlp import calibrate_thresholds

    return calibrate_thresholds(model, calibration, config.cats_sparsity)


def load_selector(model: Transformer, path: str | None) -> Any:
    if path is None:
        return None
    from ..predictors import Predictors

    return Predictors.load(path, model).select


def place_neurons(
    model: Transformer, thresholds: Sequence[float], share: float, calibration: Tensor
) -> Placement:
    from ..offload.placement import budget_for, neuron_bytes, place, profile

    frequencies = profile(model, calibration, thresholds, progress=False)
    size = neuron_bytes(model)
    return place(frequencies, size, budget_for(frequencies, size, share), "ilp", group_size=32)


def split(model: Transformer, placement: Placement, thresholds: Any, select: Any) -> Transformer:
    from ..offload.hybrid import apply

    if select is not None:
        return apply(model, placement, select=select)
    return apply(model, placement, thresholds=thresholds)


def sparse_model(model: Transformer, thresholds: Any, select: Any, kernels: bool) -> Transformer:
    from ..sparse.mlp import masked_mlps, sparse_mlps, swap_mlps_

    new = copy.deepcopy(model)
    limits = None if select is not None else thresholds
    make = sparse_mlps if kernels else masked_mlps
    swap_mlps_(new, make(new, limits, select))
    return new


def low_bit(model: Transformer, weights: str) -> Transformer:
    """A copy of ``model`` with chapter 09's weight-only layers: "int8" (one scale per row) or
    "int4" (a scale and zero per ``INT4_GROUP`` weights), LM head included."""
    from ..quant.apply import quantize_model

    bits, group = (8, None) if weights == "int8" else (4, INT4_GROUP)
    return quantize_model(model, bits=bits, group_size=group, packed=True, progress=False)


def make_draft(model: Transformer, kind: str | None, calibration: Tensor | None) -> Any:
    from ..speculative.loop import int8_draft, prompt_lookup_draft, sparse_draft

    makers = {
        "prompt-lookup": prompt_lookup_draft,
        "int8": functools.partial(int8_draft, model),
        "sparse": functools.partial(sparse_draft, model, calibration, 0.5),
    }
    return None if kind is None else makers[kind]()
