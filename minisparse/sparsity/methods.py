"""Sparsity methods, one registry: how a model is made to skip work, by name.

The engine (chapter 11), ``minisparse bench engine`` and the CLI list the methods registered
here, so a new method is one file that calls ``register_sparsity`` (plus its tests) and its
package face importing that file. A method takes the model, calibration token ids (when it
needs them) and the share of work to skip. ``model`` returns the model to run (the ReLU model,
a copy with thresholds installed, or the model itself); ``thresholds``, for a method that
chooses MLP neurons, one threshold per layer on |act(W_gate x)| of that model: what chapter
07's sparse kernels, chapter 06's predictors (which replace the thresholds' oracle) and chapter
08's hot/cold split act on. A method that does not choose neurons (TEAL zeroes the inputs of
projections) has no ``thresholds``, and those options are refused with it. The two steps are
apart because int8 weights (chapter 09) come between them: the thresholds of a sparse int8
model are calibrated on its int8 MLPs.

Chapter 03's two training-free methods are registered here:

* ``cats`` (Lee et al. 2024, CATS): zero the gate activations with |act(W_gate x)| <= t_l, so
  a share of the up and down rows is skipped; the gate itself is computed densely.
* ``teal`` (Liu et al. 2024, TEAL): zero the inputs of every projection (q/k/v, gate/up, down)
  whose magnitude is <= t_site,l; the compiled decode step reads only the weight rows of the
  inputs that remain, in attention and MLP alike.

Chapter 04's ``relu`` (the fine-tuned ReLU model's exact zeros) registers in ``minisparse.relufy``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import Tensor

from ..core.model import Transformer
from ..core.registry import Registry
from .stats import SparsityStats, record
from .thresholds import apply_thresholds_, cats_thresholds, thresholds_at

__all__ = [
    "SPARSITY_METHODS",
    "TEAL_SITES",
    "SparsityMethod",
    "register_sparsity",
    "sparsity_method",
    "teal_model",
    "unchanged",
]

#: TEAL's sites: the inputs of q/k/v, of gate/up and of down.
TEAL_SITES = ("attn_in", "mlp_in", "down_in")

Maker = Callable[[Transformer, Tensor | None, float], Transformer]
Limits = Callable[[Transformer, Tensor | None, float], list[float]]


@dataclass(frozen=True)
class SparsityMethod:
    """One way to skip work: ``model(base, calibration, share)`` -> the model to run, and
    ``thresholds(model, calibration, share)`` -> per-layer neuron thresholds (None: the method
    does not choose MLP neurons)."""

    name: str
    chapter: str  # where the course teaches it, e.g. "03"
    summary: str  # one line for listings
    calibrated: bool  # needs calibration token ids
    model: Maker
    thresholds: Limits | None = None
    sites: tuple[str, ...] = ()  # where it makes zeros (``sparsity.stats``' site names)

    @property
    def neurons(self) -> bool:
        """Whether it chooses MLP neurons (predictors, sparse kernels and offload apply)."""
        return self.thresholds is not None


SPARSITY_METHODS: Registry[SparsityMethod] = Registry("sparsity method", reserved=("none",))
register_sparsity = SPARSITY_METHODS.register
sparsity_method = SPARSITY_METHODS.find


def unchanged(model: Transformer, calibration: Tensor | None, share: float) -> Transformer:
    return model


def _cats(model: Transformer, calibration: Tensor | None, share: float) -> list[float]:
    assert calibration is not None
    return cats_thresholds(model, calibration, share)


def teal_model(
    model: Transformer,
    calibration: Tensor,
    share: float,
    sites: Sequence[str] = TEAL_SITES,
    stats: SparsityStats | None = None,
) -> Transformer:
    """TEAL, set up in this one place: a copy of ``model`` whose inputs at ``sites`` pass a
    magnitude threshold t_site,l, the ``share``-quantile of |x| on the calibration tokens
    (``thresholds_at``). ``stats`` recorded once on the calibration text serve every share
    (a sweep); without them they are recorded here. The engine, ``bench sparse-decode`` and
    ``bench engine`` run every site (``TEAL_SITES``); the pruning sweep the MLP's only, beside
    weight pruning of the MLP."""
    stats = stats or record(model, calibration, tuple(sites), progress=False)
    return apply_thresholds_(copy.deepcopy(model), thresholds_at(stats, share, tuple(sites)))


def _teal(model: Transformer, calibration: Tensor | None, share: float) -> Transformer:
    assert calibration is not None
    return teal_model(model, calibration, share)


register_sparsity(
    SparsityMethod(
        name="cats",
        chapter="03",
        sites=("mlp_act",),
        summary="thresholds on |act(W_gate x)|: skip up/down rows (CATS)",
        calibrated=True,
        model=unchanged,
        thresholds=_cats,
    )
)
register_sparsity(
    SparsityMethod(
        name="teal",
        chapter="03",
        sites=TEAL_SITES,
        summary="thresholds on every projection's input: skip its rows (TEAL)",
        calibrated=True,
        model=_teal,
    )
)
