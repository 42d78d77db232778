"""MoEfication of a whole model: group every layer's neurons, train its router, swap in MoE MLPs.

For every layer l, on calibration windows:

1. record the MLP's input x and the activity matrix A (|h_j| > t_l, ``predictors.record_layers``);
2. group the n neurons into E experts of n / E (``grouping.group_neurons``: balanced k-means on
   the co-activation profiles, or the random baseline);
3. fit the router to the experts' active shares (``routing.train_router``);

then ``moefy`` returns a copy of the model whose MLPs are ``MoEMLP``s computing each token's
top-k experts. ``fit_moe_layers`` does steps 2-3 on records already made, so that one recording
serves several groupings, and ``moe_mlps`` builds the modules for any k from the same experts
and routers (the router does not depend on k).

The activity rule t_l is the one of chapters 05-06: for a ReLU model t_l = 0; for the SiLU model
chapter 03's TEAL thresholds on the down projection's input at 50 % (the default here when no
``thresholds`` are given, calibrated on the same windows).

Reference: Zhang et al., "MoEfication: Transformer Feed-forward Layers are Mixtures of Experts"
(Findings of ACL 2022).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor
from tqdm.auto import tqdm

from ..core.checks import check_count
from ..core.model import Transformer, check_tokens
from ..predictors.lowrank import Predictor
from ..predictors.records import LayerRecord, record_layers
from ..sparse.swap import swap_mlps_
from ..sparsity import calibrate_thresholds
from .grouping import GROUPINGS, expert_size, group_neurons
from .mlp import MoEMLP
from .routing import check_top_k, train_router

__all__ = [
    "MoELayer",
    "activity_thresholds",
    "check_moe_arguments",
    "fit_moe_layers",
    "moe_mlps",
    "moefy",
]


@dataclass
class MoELayer:
    """One layer's experts [E, m] (neuron indices) and the router that scores them."""

    experts: Tensor
    router: Predictor


def activity_thresholds(
    model: Transformer, calibration: Tensor, thresholds: Sequence[float] | None
) -> list[float]:
    """``thresholds`` checked against the layer count, or (None) chapter 03's 50 % TEAL
    thresholds on the down projection's input, calibrated on ``calibration``."""
    n_layers = len(model.layers)
    if thresholds is None:
        return calibrate_thresholds(model, calibration, 0.5, ("down_in",), progress=False)[
            "down_in"
        ]
    if len(thresholds) != n_layers:
        raise ValueError(f"Got {len(thresholds)} thresholds for a model with {n_layers} layers.")
    return [float(t) for t in thresholds]


def fit_moe_layers(
    records: Sequence[LayerRecord],
    n_experts: int = 32,
    grouping: str = "coactivation",
    router_rank: int | None = None,
    epochs: int = 8,
    seed: int = 0,
    progress: bool = False,
) -> list[MoELayer]:
    """Per recorded layer: its experts (``group_neurons``) and a router trained on them."""
    layers = []
    for record in tqdm(records, desc=f"experts ({grouping})", disable=not progress):
        experts = group_neurons(record.active, n_experts, grouping, seed)
        router = train_router(record.mlp_in, record.active, experts, router_rank, epochs, seed=seed)
        layers.append(MoELayer(experts, router))
    return layers


def moe_mlps(model: Transformer, layers: Sequence[MoELayer], top_k: int) -> list[MoEMLP]:
    """One ``MoEMLP`` per layer of ``model`` (unchanged) from fitted ``layers``, top ``top_k``."""
    if len(layers) != len(model.layers):
        raise ValueError(f"Got {len(layers)} MoE layers for a model with {len(model.layers)}.")
    return [
        MoEMLP(block.mlp, layer.experts, copy.deepcopy(layer.router), top_k)
        for block, layer in zip(model.layers, layers, strict=True)
    ]


def check_moe_arguments(
    model: Transformer, n_experts: int, top_k: int, grouping: str, epochs: int
) -> None:
    """Every check ``moefy`` makes before it records or fits anything (one ValueError each)."""
    expert_size(model.config.ffn_dim, n_experts)
    check_top_k(top_k, n_experts)
    if grouping not in GROUPINGS:
        raise ValueError(f"Unknown grouping {grouping!r}; use one of {GROUPINGS}.")
    check_count(epochs, "epochs", fix="the routers train for a few epochs, e.g. 8")


def moefy(
    model: Transformer,
    n_experts: int = 32,
    top_k: int = 8,
    calibration: Tensor | None = None,
    grouping: str = "coactivation",
    thresholds: Sequence[float] | None = None,
    router_rank: int | None = None,
    epochs: int = 8,
    seed: int = 0,
    progress: bool = False,
) -> Transformer:
    """A copy of ``model`` whose MLPs compute only their router's top ``top_k`` of ``n_experts``.

    ``calibration`` [n, seq]: the token windows the experts and routers are fitted on.
    ``thresholds``: per layer, neuron j is active when |h_j| > t_l (default: chapter 03's 50 %
    TEAL thresholds; zeros for a ReLU model). ``grouping``: "coactivation" or "random".
    """
    if calibration is None or calibration.dim() != 2:
        raise ValueError(
            "moefy needs calibration token windows [n, seq] (e.g. "
            "minisparse.io.data.token_batches(tok, corpus(split='train'), 256, 8))."
        )
    check_moe_arguments(model, n_experts, top_k, grouping, epochs)
    check_tokens(calibration, model.config.vocab_size)
    limits = activity_thresholds(model, calibration, thresholds)
    records = record_layers(model, calibration, limits, progress=progress)
    layers = fit_moe_layers(records, n_experts, grouping, router_rank, epochs, seed, progress)
    new = copy.deepcopy(model)
    swap_mlps_(new, moe_mlps(new, layers, top_k))
    return new
