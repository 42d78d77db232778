"""Drafts, one registry: what proposes tokens for speculative decoding, by name, with its cost.

The engine (chapter 11) and ``minisparse bench speculative`` list the drafts registered here,
so a new draft is one file that calls ``register_draft`` (plus its tests) and the package face
importing it. A ``DraftKind`` says how to make the draft from the target (``make``), what one
draft step costs against a target step (``cost``: the bytes it reads, the quantity that sets
the speed-up of chapter 10's theory at batch 1), whether it needs calibration text, whether it
can be made from the target's weight format, and when it would be the target itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from ..core.model import Transformer
from ..core.registry import Registry
from ..sparsity import check_sparsity
from .drafts import Draft, early_exit_draft, int8_draft, prompt_lookup_draft, sparse_draft

__all__ = ["DRAFTS", "DraftKind", "draft_kind", "make_draft", "register_draft"]


@dataclass(frozen=True)
class DraftKind:
    """One kind of draft: ``make(target, calibration, **options)`` -> a ``Draft``."""

    name: str
    cost: str  # what one draft step reads, against a target step
    make: Callable[..., Draft]
    options: dict[str, Any] = field(default_factory=dict)  # the options ``make`` takes
    calibrated: bool = False  # needs calibration token ids
    weights: tuple[str, ...] | None = None  # target weight formats it is made from (None: any)
    # what it needs of the target's MLPs: "any"; "dense" (MLP modules, thresholds inside allowed:
    # not the sparse MLPs a neuron-choosing method puts there); "plain" (untouched by any method)
    mlps: str = "any"
    # (weights format, whether the target's MLPs are sparse) -> True when it is the target
    is_target: Callable[[str, bool], bool] = lambda weights, sparse: False


DRAFTS: Registry[DraftKind] = Registry("draft")
register_draft = DRAFTS.register
draft_kind = DRAFTS.find


def make_draft(
    name: str, target: Transformer, calibration: Tensor | None = None, **options: Any
) -> Draft:
    """The draft ``name`` for ``target``; ``options`` override the kind's defaults."""
    kind = draft_kind(name)
    unknown = set(options) - set(kind.options)
    if unknown:
        raise ValueError(
            f"The {name} draft takes {sorted(kind.options) or 'no options'}, not {sorted(unknown)}."
        )
    if kind.calibrated and calibration is None:
        raise ValueError(f"The {name} draft calibrates on text: pass calibration= token ids.")
    return kind.make(target, calibration, **{**kind.options, **options})


def _lookup(target: Transformer, calibration: Tensor | None, ngram: int) -> Draft:
    return prompt_lookup_draft(ngram=ngram)


def _int8(target: Transformer, calibration: Tensor | None) -> Draft:
    return int8_draft(target)


def _sparse(target: Transformer, calibration: Tensor | None, sparsity: float) -> Draft:
    check_sparsity(sparsity)
    assert calibration is not None
    return sparse_draft(target, calibration, sparsity)


def _early_exit(target: Transformer, calibration: Tensor | None, exit_layers: int | None) -> Draft:
    layers = (3 * target.config.n_layers) // 4 if exit_layers is None else exit_layers
    return early_exit_draft(target, layers)


register_draft(
    DraftKind("prompt-lookup", "no weights: n-gram matches in the context", _lookup, {"ngram": 3})
)
register_draft(
    DraftKind(
        "int8",
        "a quarter of the linear layers' bytes (int8 codes)",
        _int8,
        weights=("fp32",),
        mlps="dense",
        is_target=lambda weights, sparse: weights == "int8",
    )
)
register_draft(
    DraftKind(
        "sparse",
        "the MLPs' active share (CATS thresholds) plus attention",
        _sparse,
        {"sparsity": 0.5},
        calibrated=True,
        weights=("fp32", "int8"),
        mlps="plain",
        is_target=lambda weights, sparse: sparse,
    )
)
register_draft(
    DraftKind(
        "early-exit",
        "the first layers (three quarters by default) and the LM head",
        _early_exit,
        {"exit_layers": None},
    )
)
