"""``relu``, chapter 04's sparsity method: the fine-tuned ReLU model and its exact zeros.

Registered with ``minisparse.sparsity.methods`` like chapter 03's training-free methods: the
engine and the benches list it from there. The model is the one ``minisparse relufy`` (or
``minisparse prepare``) saved, loaded onto the given base weights; its MLP neurons are active
where the ReLU is non-zero, so the per-layer threshold is 0 and sparse kernels skip exactly the
neurons that contribute nothing.
"""

from __future__ import annotations

from torch import Tensor

from ..core.model import Transformer
from ..sparsity.methods import SparsityMethod, register_sparsity
from . import recipe

__all__ = ["RELU"]


def _relu(model: Transformer, calibration: Tensor | None, share: float) -> Transformer:
    return recipe.load_relufied(model, 1)[0]  # looked up at each call (tests replace it)


def _zeros(model: Transformer, calibration: Tensor | None, share: float) -> list[float]:
    return [0.0] * len(model.layers)


RELU = register_sparsity(
    SparsityMethod(
        name="relu",
        chapter="04",
        summary="the fine-tuned ReLU model: exact zeros (ReLUfication)",
        calibrated=False,
        model=_relu,
        thresholds=_zeros,
        sites=("mlp_act",),
    )
)
