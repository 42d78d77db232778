"""Sparse MLPs in a whole model: build one per layer, swap them in and out.

``sparse_mlps`` makes one ``SparseMLP`` per layer from per-layer thresholds or a selector
(``select(layer, x)``, e.g. ``Predictors.select``); ``sparsify_`` puts them in place and
returns the dense MLPs, which ``swap_mlps_`` puts back; ``using_mlps`` does both around a
block of code.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

from torch import Tensor, nn

from ..core.model import MLP, Transformer
from .masks import layer_selector, per_layer_or_none
from .mlp import SparseMLP

__all__ = [
    "mean_density",
    "sparse_mlps",
    "sparsify",
    "sparsify_",
    "swap_mlps",
    "swap_mlps_",
    "using_mlps",
]


def sparse_mlps(
    model: Transformer,
    thresholds: float | Sequence[float] | None = None,
    select: Callable[[int, Tensor], Tensor] | None = None,
    backend: str = "auto",
) -> list[SparseMLP]:
    """One ``SparseMLP`` per layer of ``model`` (the model itself is not changed).

    ``thresholds``: one number for all layers or one per layer; ``select(layer, x)``: returns
    the active neuron indices of a layer for the MLP input x [tokens, dim].
    """
    n = len(model.layers)
    limits = per_layer_or_none(thresholds, n)
    if not all(isinstance(layer.mlp, MLP) for layer in model.layers):
        raise ValueError(
            "Every layer's MLP must be a dense minisparse.core.model.MLP; put the dense MLPs back "
            "(swap_mlps with the list sparsify returned) before sparsifying again."
        )
    return [
        SparseMLP(
            layer.mlp,
            threshold=limits[i],
            select=None if select is None else layer_selector(select, i),
            backend=backend,
        )
        for i, layer in enumerate(model.layers)
    ]


def swap_mlps_(model: Transformer, mlps: Sequence[nn.Module]) -> list[nn.Module]:
    """Put ``mlps`` into the model's layers, in place; return the MLPs they replaced."""
    if len(mlps) != len(model.layers):
        raise ValueError(f"Got {len(mlps)} MLPs for a model with {len(model.layers)} layers.")
    old = [layer.mlp for layer in model.layers]
    for layer, mlp in zip(model.layers, mlps, strict=True):
        layer.mlp = mlp
    return old


def sparsify_(
    model: Transformer,
    thresholds: float | Sequence[float] | None = None,
    select: Callable[[int, Tensor], Tensor] | None = None,
    backend: str = "auto",
) -> list[nn.Module]:
    """Replace every MLP of ``model`` by a ``SparseMLP``, in place; return the dense MLPs.

    ``swap_mlps_(model, returned)`` puts the dense MLPs back.
    """
    return swap_mlps_(model, sparse_mlps(model, thresholds, select, backend))


@contextlib.contextmanager
def using_mlps(model: Transformer, mlps: Sequence[nn.Module]) -> Iterator[Transformer]:
    """Run a block with ``mlps`` in place of the model's MLPs, then restore them."""
    old = swap_mlps_(model, mlps)
    try:
        yield model
    finally:
        swap_mlps_(model, old)


def mean_density(mlps: Sequence[nn.Module]) -> float:
    """Mean fraction of neurons read in the last call, over the SparseMLPs given."""
    values = [m.last_density for m in mlps if isinstance(m, SparseMLP)]
    return sum(values) / len(values) if values else 1.0


# The names before the in-place convention (a trailing underscore), kept for existing code.
sparsify = sparsify_
swap_mlps = swap_mlps_
