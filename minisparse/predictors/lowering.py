"""How the compiled decode step runs a predictor's neuron selection (chapter 06).

A ``LayerSelect`` (one layer's ``Predictors.select``) is registered by exact type with
``minisparse.runtime.lowering``: the C step evaluates the low-rank predictor itself,
z = V act(U x + b_U) + b_V, and keeps the neurons whose logit passes the layer's cutoff, so a
sparse MLP driven by predictors runs in one C call. A predictor of another type, a hooked one,
or weights that are not plain float32 stay in torch.
"""

from __future__ import annotations

from typing import Any

from ..runtime.lowering import hooked, lowers, plain_f32, ptr
from .collection import LayerSelect
from .lowrank import Predictor

__all__ = ["selector_fields"]


@lowers("selector", LayerSelect)
def selector_fields(select: LayerSelect) -> tuple[Any, ...] | None:
    """(rank, U, b_U, V, b_V, hidden ReLU, cutoff) for the C step, or None."""
    predictor = select.predictor
    if select.owner.lookahead:  # it reads the previous layer's input, which C does not keep
        return None
    if type(predictor) is not Predictor or hooked(predictor, predictor.down, predictor.up):
        return None
    down, up = predictor.down, predictor.up
    if not plain_f32(down.weight, down.bias, up.weight, up.bias) or up.bias is None:
        return None
    return (
        predictor.rank, ptr(down.weight), ptr(down.bias), ptr(up.weight), ptr(up.bias),
        int(predictor.kind == "mlp"), float(predictor.cutoff),
    )  # fmt: skip
