"""One engine: the course's techniques combined, configured by one dataclass (chapter 11).

Each chapter built one way to read fewer bytes per token. ``build`` composes them on a model,
calling each chapter's own code, in the order the bytes flow. Every axis is a registry, so a
method registered there is an engine option without a change here:

1. which work is skipped: a sparsity method (``minisparse.sparsity.SPARSITY_METHODS``): the
   fine-tuned ReLU model of chapter 04 (exact zeros), chapter 03's CATS thresholds on
   act(W_gate x) or TEAL thresholds on every projection's input (training-free, approximate);
2. how active neurons are found (methods that choose MLP neurons): the threshold itself (an
   oracle that computes the gate densely), or chapter 06's predictors (``predictors=`` a file
   saved by ``minisparse predictors``);
3. how they are computed: chapter 07's sparse kernels (``SparseMLP``), or the masked dense
   reference (``sparse_kernels=False``: same result, every byte read);
4. where they live: chapter 08's hot/cold split under a fast-device budget (its speed is
   modelled without a GPU; the logits are computed exactly on the CPU);
5. how many bits each weight has: a weight format (``minisparse.quant.WEIGHT_FORMATS``,
   chapter 09's weight-only int8 / int4 layers);
6. how many tokens one pass yields: a draft (``minisparse.speculative.DRAFTS``, chapter 10).

What does not combine is refused with the reason, read from the registries: predictors,
sparse kernels off and the hot/cold split need a method that chooses neurons; sparse MLPs need
a weight format a sparse kernel reads (int8 is quantized first, then its MLPs become sparse
int8 MLPs that read the int8 codes of the active neurons only: (1 - s) / 4 of the float32 bytes
of a sparse matrix; there is no sparse int4 kernel); the hot/cold split places float32
neurons; a draft is made only from the weight formats it names, and never is the target
itself (an int8 draft for an int8 target).

``Engine.generate`` decodes with the result; for lossless configurations (speculative
decoding, the ReLU model with exact masks) its greedy tokens equal plain greedy decoding of
the same model, which the tests check.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from ..core.checks import check_count
from ..core.model import Transformer
from ..offload.placement import Placement
from ..quant.formats import WEIGHT_FORMATS, low_bit
from ..relufy import method as _relu_method  # noqa: F401  (registers the method relu)
from ..runtime.generate import generate
from ..sparse.traffic import step_bytes
from ..sparsity.methods import SPARSITY_METHODS, SparsityMethod, sparsity_method
from ..speculative.registry import DRAFTS, DraftKind, draft_kind, make_draft

__all__ = [
    "Engine",
    "EngineConfig",
    "build",
    "choices",
    "low_bit",
    "make_draft",
    "sparse_model",
    "step_bytes",
]


def choices() -> dict[str, tuple[Any, ...]]:
    """What each axis of ``EngineConfig`` accepts now: read from the registries."""
    return {
        "sparsity": ("none", *SPARSITY_METHODS),
        "weights": tuple(WEIGHT_FORMATS),
        "draft": (None, *DRAFTS),
    }


@dataclass(frozen=True)
class EngineConfig:
    """Which technique of each chapter the engine uses (defaults: the dense model)."""

    sparsity: str = "none"  # a sparsity method ("relu", "cats", "teal", ...) or "none"
    share: float = 0.5  # training-free methods (CATS, TEAL): share their thresholds zero
    predictors: str | None = None  # chapter 06 predictors file; None: the threshold (oracle)
    sparse_kernels: bool = True  # chapter 07 kernels; False: the masked dense reference
    offload_budget: float | None = None  # chapter 08: share of FFN bytes on the fast device
    weights: str = "fp32"  # a weight format: "fp32", "int8", "int4", ...
    draft: str | None = None  # a draft: "prompt-lookup", "int8", "sparse", "early-exit", ...
    gamma: int = 4  # tokens the draft proposes per pass

    @property
    def method(self) -> SparsityMethod | None:
        return None if self.sparsity == "none" else sparsity_method(self.sparsity)

    @property
    def draft_kind(self) -> DraftKind | None:
        return None if self.draft is None else draft_kind(self.draft)

    def check(self) -> EngineConfig:
        """Return self, or raise one ValueError that names the conflicting settings."""
        for name, allowed in choices().items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}.")
        if not 0.0 <= self.share < 1.0:
            raise ValueError(f"share must be in [0, 1), got {self.share}.")
        check_count(self.gamma, "gamma", fix="the number of tokens a draft proposes per pass")
        if not isinstance(self.sparse_kernels, bool):
            raise ValueError(f"sparse_kernels is True or False, got {self.sparse_kernels!r}.")
        if self.offload_budget is not None and not 0 < self.offload_budget <= 1:
            raise ValueError(f"offload_budget is a share in (0, 1], got {self.offload_budget}.")
        neurons = self.method is not None and self.method.neurons
        choosers = [n for n, m in SPARSITY_METHODS.items() if m.neurons]
        needs_neurons = {
            "predictors": self.predictors is not None,
            "offload_budget": self.offload_budget is not None,
            "sparse_kernels=False": not self.sparse_kernels,
        }
        for name, used in needs_neurons.items():
            if used and not neurons:
                raise ValueError(
                    f"{name} acts on active MLP neurons: set sparsity to a method that chooses "
                    f"them ({', '.join(choosers)}), not {self.sparsity!r}."
                )
        fmt = WEIGHT_FORMATS[self.weights]
        if neurons and not fmt.sparse_kernel:
            readable = [n for n, f in WEIGHT_FORMATS.items() if f.sparse_kernel]
            raise ValueError(
                f"Sparse {self.weights} weights are not done (there is no sparse {self.weights} "
                f"kernel): sparsity={self.sparsity!r} and weights={self.weights!r} do not "
                f"combine. Choose weights in {readable}, or a sparsity that keeps the MLPs dense."
            )
        if self.offload_budget is not None and fmt.bits is not None:
            raise ValueError(
                "The hot/cold split (offload_budget) places float32 neurons: it does not combine "
                f"with weights={self.weights!r}. Choose weights='fp32' or offload_budget=None."
            )
        kind = self.draft_kind
        if kind is not None and kind.is_target(self.weights, neurons):
            raise ValueError(
                f"A {kind.name} draft of this model (sparsity={self.sparsity!r}, weights="
                f"{self.weights!r}) is the model itself; pick another draft."
            )
        if kind is not None and (
            (kind.mlps == "dense" and neurons) or (kind.mlps == "plain" and self.method is not None)
        ):
            raise ValueError(
                f"A {kind.name} draft is made from the target's {kind.mlps} MLPs, which "
                f"sparsity={self.sparsity!r} changes: choose another draft (prompt-lookup, "
                "early-exit) or sparsity='none'."
            )
        if kind is not None and kind.weights is not None and self.weights not in kind.weights:
            raise ValueError(
                f"A {kind.name} draft is made from {' or '.join(kind.weights)} weights, which "
                f"weights={self.weights!r} replaces: choose weights in {list(kind.weights)} or "
                "another draft (prompt-lookup works with any)."
            )
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


def build(
    base: Transformer,
    tokenizer: Any,
    config: EngineConfig,
    calibration: Tensor | None = None,
) -> Engine:
    """The engine ``config`` describes, built on ``base`` (left unchanged).

    ``calibration`` [batch, seq] token ids: needed by calibrated sparsity methods (CATS, TEAL),
    a placement and calibrated drafts (the sparse draft).
    """
    config.check()
    method, kind = config.method, config.draft_kind
    needs = (method is not None and method.calibrated) or config.offload_budget is not None
    if (needs or (kind is not None and kind.calibrated)) and calibration is None:
        raise ValueError("This configuration calibrates on text: pass calibration= token ids.")
    model, parts = base, []
    thresholds = None
    if method is not None:
        model = method.model(base, calibration, config.share)
        parts.append(f"{method.name} (ch. {method.chapter})")
    neurons = method is not None and method.neurons
    select = load_selector(model, config.predictors)  # predictors are made for float weights
    if config.weights != "fp32" and neurons:
        model = low_bit(model, config.weights)  # first: the sparse MLPs take int8 projections
    if neurons:
        thresholds = method.thresholds(model, calibration, config.share)  # type: ignore[union-attr]
    dense = model if select is not None else None  # the per-token perplexity's reference
    placement = None
    if config.offload_budget is not None:
        placement = place_neurons(model, thresholds, config.offload_budget, calibration)
        model = split(model, placement, thresholds, select)
        parts.append(f"hot/cold split at {config.offload_budget:.0%} of FFN bytes (ch. 08)")
    elif thresholds is not None:
        model = sparse_model(model, thresholds, select, config.sparse_kernels)
        kernels = (
            f"sparse {config.weights} kernels" if config.weights != "fp32" else "sparse kernels"
        )
        made = kernels if config.sparse_kernels else "masked dense MLPs"
        finder = "predictors" if select else "thresholds"
        parts.append(f"{made}, neurons from {finder} (ch. {'06, ' if select else ''}07)")
    if config.weights != "fp32":
        if not neurons:
            model = low_bit(model, config.weights)
        fmt = WEIGHT_FORMATS[config.weights]
        grid = f"blocks of {fmt.group_size}" if fmt.group_size else "a scale per row"
        parts.append(f"{config.weights} weights, {grid} (ch. 09)")
    draft = None if kind is None else make_draft(kind.name, model, calibration)
    if draft is not None:
        parts.append(f"{kind.name} draft, gamma {config.gamma} (ch. 10)")  # type: ignore[union-attr]
    text = ", ".join(parts) or "the dense model"
    return Engine(config, model, tokenizer, draft, placement, text, dense_model=dense)


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
    from ..sparse.masks import masked_mlps
    from ..sparse.swap import sparse_mlps, swap_mlps_

    new = copy.deepcopy(model)
    limits = None if select is not None else thresholds
    make = sparse_mlps if kernels else masked_mlps
    swap_mlps_(new, make(new, limits, select))
    return new
