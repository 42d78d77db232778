"""The dense reference of a sparse MLP: the same masks applied to the full computation.

A sparse MLP must compute exactly what the dense MLP computes with the inactive neurons'
h_j = act(W_gate[j] . x) (W_up[j] . x) set to zero. ``MaskedMLP`` is that definition: it reads
every weight, applies a mask (from a threshold, a selector, or the mask a ``SparseMLP`` really
used) and is slow on purpose; the tests and notebooks compare every sparse path against it.
``gate_activations`` gives the values CATS's thresholds on |act(W_gate x)| are read from
(``minisparse.sparsity.cats_thresholds``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from ..core.model import MLP, Transformer

__all__ = [
    "MaskedMLP",
    "Selector",
    "gate_activations",
    "layer_selector",
    "masked_mlps",
    "per_layer_or_none",
    "same_masks",
]

#: A function of the MLP input x [tokens, dim] that returns the active neuron indices.
Selector = Callable[[Tensor], Tensor]


def layer_selector(select: Callable[[int, Tensor], Tensor], layer: int) -> Selector:
    """One layer's ``Selector`` from ``select(layer, x)``.

    An object that offers ``for_layer(layer)`` (``Predictors.select``) gives its own per-layer
    selector, whose type the compiled decode step may know how to run; any other function is
    bound with ``functools.partial``.
    """
    for_layer = getattr(select, "for_layer", None)
    return for_layer(layer) if callable(for_layer) else functools.partial(select, layer)


def per_layer_or_none(values: float | Sequence[float] | None, n_layers: int) -> list[float | None]:
    """One threshold per layer from None, one number, or a sequence (checked)."""
    if values is None or isinstance(values, (int, float)):
        return [values] * n_layers
    values = list(values)
    if len(values) != n_layers:
        raise ValueError(f"Got {len(values)} thresholds for a model with {n_layers} layers.")
    return values


class MaskedMLP(nn.Module):
    """The dense MLP with a neuron mask applied to act(gate x) * (up x): the reference.

    ``threshold``: zero the neurons with |act(gate x)| <= threshold; ``select``: keep only the
    neurons it returns; ``keep``: a given boolean mask [tokens, ffn] (e.g. a SparseMLP's
    ``last_keep``, to apply exactly the same mask). Every weight is read: exact and slow.
    """

    def __init__(
        self,
        mlp: MLP,
        threshold: float | None = None,
        select: Selector | None = None,
        keep: Tensor | None = None,
    ) -> None:
        super().__init__()
        self.mlp, self.threshold, self.select, self.keep = mlp, threshold, select, keep

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        a = self.mlp.act(self.mlp.gate_proj(flat))
        h = a * self.mlp.up_proj(flat)
        if self.keep is not None:
            keep = self.keep
        elif self.threshold is not None:
            keep = a.abs() > self.threshold
        else:
            keep = torch.zeros_like(h, dtype=torch.bool)
            keep[:, self.select(flat).long()] = True
        y = self.mlp.down_proj(self.mlp.down_in_act(torch.where(keep, h, torch.zeros_like(h))))
        return y.reshape(*x.shape[:-1], y.shape[-1])


def masked_mlps(
    model: Transformer,
    thresholds: float | Sequence[float] | None = None,
    select: Callable[[int, Tensor], Tensor] | None = None,
) -> list[MaskedMLP]:
    """One ``MaskedMLP`` per layer, the dense reference for ``sparse_mlps``."""
    limits = per_layer_or_none(thresholds, len(model.layers))
    return [
        MaskedMLP(
            layer.mlp,
            threshold=limits[i],
            select=None if select is None else layer_selector(select, i),
        )
        for i, layer in enumerate(model.layers)
    ]


def same_masks(model: Transformer, sparse: Sequence[nn.Module]) -> list[MaskedMLP]:
    """Dense MLPs of ``model`` masked exactly as ``sparse`` masked its last call.

    With thresholds, the dense model recomputing its own masks can flip neurons whose
    |act(gate x)| lies within rounding of the threshold (its inputs differ from the sparse
    model's by float rounding), and one flip moves the rest of the computation. Replaying the
    sparse model's masks compares the kernels, not the luck of the ties.
    """
    return [
        MaskedMLP(layer.mlp, keep=sp.last_keep)
        for layer, sp in zip(model.layers, sparse, strict=True)
    ]


@torch.no_grad()
def gate_activations(model: Transformer, tokens: Tensor) -> list[Tensor]:
    """|act(gate x)| of every layer's MLP on ``tokens`` [batch, seq]: [tokens, ffn] each."""
    out: list[Tensor] = []
    hooks = [
        layer.mlp.act.register_forward_hook(
            lambda _m, _i, y: out.append(y.detach().reshape(-1, y.shape[-1]).abs())
        )
        for layer in model.layers
    ]
    try:
        model(tokens)
    finally:
        for h in hooks:
            h.remove()
    return out
