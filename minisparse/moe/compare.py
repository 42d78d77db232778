"""MoE experts against neuron predictors at equal compute: recall, perplexity, bytes per token.

MoEfication and chapter 06's predictors answer the same question, which neurons a token needs,
at different granularity: a router picks k of E experts (blocks of m = n / E neurons chosen
offline), a neuron predictor scores all n neurons. At equal compute both keep the same share
rho of the neurons per token:

* **MoE** (co-activation or random experts): the router's top k = rho E experts;
* **predictor** (chapter 06, rank r, compressed-gate start): the top rho n neuron logits;
  fitted with the same number of BCE epochs on the same tokens as the routers;
* **oracle**: the rho n neurons with the largest true |h_j| (the best any selector can do).

For each, on held-out windows of the target model (``predictors.prediction_target``: chapter
04's ReLU model when cached, else the SiLU model with chapter 03's 50 % thresholds):

* **recall**: the share of the truly active neurons (|h_j| > t_l, on the dense model's own
  inputs) that the selection keeps, pooled over tokens and layers;
* **perplexity** with every MLP computing only its selection, with a 95 % bootstrap interval
  over the windows (``io.eval``);
* **MLP bytes per token**: rho (3 d n) weights per layer plus the selector's parameters
  (router or predictor), at the model's dtype; dense reads 3 d n per layer. The oracle counts
  no selector, an ideal: it needs h itself, i.e. the dense gate and up projections.

An expert is read as a whole (contiguous rows), a predicted set neuron by neuron: the byte
counts are the same, the memory access pattern favours the experts.

References: Zhang et al., "MoEfication: Transformer Feed-forward Layers are Mixtures of Experts"
(Findings of ACL 2022); Liu et al., "Deja Vu: Contextual Sparsity for Efficient LLMs at
Inference Time" (ICML 2023).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from ..core.model import Transformer
from ..io.eval import bootstrap_perplexity, window_nlls
from ..measure.compare import Interval
from ..predictors.collection import Predictors
from ..predictors.lowrank import principal_directions
from ..predictors.pipeline import fit_predictors
from ..predictors.records import LayerRecord, prediction_target, record_layers
from ..predictors.sizing import PredictorConfig
from ..sparse.swap import using_mlps
from ..sparsity.contextual import top_k_mask
from .convert import MoELayer, fit_moe_layers, moe_mlps
from .routing import expert_mask, route

__all__ = ["Choose", "Row", "compare_with_predictors", "masks_chosen", "recall_of"]

#: (layer, MLP input x [tokens, d], h [tokens, n]) -> the neurons kept [tokens, n] (bool)
Choose = Callable[[int, Tensor, Tensor], Tensor]


@dataclass
class Row:
    """One selector at one compute share, measured on held-out windows."""

    method: str  # "dense", "oracle", "moe coactivation", "moe random", "predictor r=8", ...
    density: float  # share of the neurons computed per token
    recall: float  # share of the truly active neurons computed (tokens and layers pooled)
    ppl: Interval  # perplexity with the 95 % bootstrap interval over windows
    mlp_bytes: int  # MLP weight bytes read per token over all layers, the selector's included
    selector_bytes: int  # of which the routers or predictors


@contextlib.contextmanager
def masks_chosen(model: Transformer, choose: Choose) -> Iterator[Transformer]:
    """Run a block with every MLP's h = act(W_gate x) * (W_up x) masked by ``choose``."""
    inputs: dict[int, Tensor] = {}

    def keep_input(i: int):
        def pre_hook(_m: nn.Module, args: tuple) -> None:
            inputs[i] = args[0]

        return pre_hook

    def mask(i: int):
        def hook(_m: nn.Module, _a: tuple, h: Tensor) -> Tensor:
            x = inputs[i].reshape(-1, inputs[i].shape[-1])
            keep = choose(i, x, h.reshape(-1, h.shape[-1])).reshape(h.shape)
            return h * keep.to(h.dtype)

        return hook

    handles = []
    for i, layer in enumerate(model.layers):
        handles.append(layer.mlp.register_forward_pre_hook(keep_input(i)))
        handles.append(layer.mlp.down_in_act.register_forward_hook(mask(i)))
    try:
        yield model
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def recall_of(model: Transformer, records: Sequence[LayerRecord], choose: Choose) -> float:
    """Share of the active neurons of ``records`` (the dense model's) that ``choose`` keeps,
    pooled over layers and tokens; h is recomputed from each layer's recorded input."""
    kept = total = 0
    for i, (layer, record) in enumerate(zip(model.layers, records, strict=True)):
        mlp, x = layer.mlp, record.mlp_in
        h = mlp.act(mlp.gate_proj(x)) * mlp.up_proj(x)
        keep = choose(i, x, h)
        kept += int((keep & record.active).sum())
        total += int(record.active.sum())
    return kept / total if total else 1.0


def _perplexity(model: Transformer, windows: Tensor) -> Interval:
    nll = window_nlls(model, windows, seq_len=windows.shape[1], progress=False)
    return bootstrap_perplexity(nll)


def _moe_choose(layers: Sequence[MoELayer], top_k: int) -> Choose:
    def choose(i: int, x: Tensor, _h: Tensor) -> Tensor:
        return expert_mask(route(layers[i].router, x.float(), top_k), layers[i].experts)

    return choose


def _top_logits(predictors: Predictors, k: int) -> Choose:
    def choose(i: int, x: Tensor, _h: Tensor) -> Tensor:
        return top_k_mask(predictors.neurons[i](x.float()), k)

    return choose


def _oracle(k: int) -> Choose:
    def choose(_i: int, _x: Tensor, h: Tensor) -> Tensor:
        return top_k_mask(h.abs(), k)

    return choose


@torch.no_grad()
def compare_with_predictors(
    base: Transformer,
    calibration: Tensor,
    evaluation: Tensor,
    densities: Sequence[float] = (0.25, 0.5),
    n_experts: int = 32,
    predictor_ranks: Sequence[int] = (8,),
    epochs: int = 8,
    seed: int = 0,
    progress: bool = True,
) -> list[Row]:
    """Dense, oracle, MoE (co-activation and random experts) and rank-r neuron predictors at
    each compute share in ``densities``; see the module docstring for what each row measures.

    ``calibration`` [n, seq]: windows the thresholds, experts, routers and predictors are fitted
    on; ``evaluation`` [n, seq]: held-out windows. ``epochs``: BCE epochs of every router and
    every predictor (after its compressed-gate start). Each density must be a multiple of
    1 / ``n_experts`` so that the MoE and the neuron selectors compute the same share.
    """
    if calibration.dim() != 2 or evaluation.dim() != 2:
        raise ValueError("calibration and evaluation must be token windows [n, seq].")
    for rho in densities:
        if not 0 < rho <= 1 or abs(rho * n_experts - round(rho * n_experts)) > 1e-9:
            raise ValueError(
                f"density {rho} must be in (0, 1] and a multiple of 1/n_experts = "
                f"{1 / n_experts:g}, so that k = density * n_experts experts is whole."
            )
    target = prediction_target(base, calibration)
    model, limits = target.model, target.thresholds
    train = record_layers(model, calibration, limits)
    held_out = record_layers(model, evaluation, limits)
    c = model.config
    size = next(model.parameters()).element_size()
    dense_bytes = 3 * c.dim * c.ffn_dim * c.n_layers * size
    rows = [Row("dense", 1.0, 1.0, _perplexity(model, evaluation), dense_bytes, 0)]

    steps = tqdm(total=2 + len(predictor_ranks), desc="selectors", disable=not progress)
    moe = {}
    for grouping in ("coactivation", "random"):
        moe[grouping] = fit_moe_layers(train, n_experts, grouping, epochs=epochs, seed=seed)
        steps.update()
    directions = [
        principal_directions(layer.mlp.gate_proj.weight, record.mlp_in)
        for layer, record in zip(model.layers, train, strict=True)
    ]
    predictors = {}
    for r in predictor_ranks:
        config = PredictorConfig(ranks=(r,), start_rank=r, epochs=epochs, seed=seed)
        predictors[r] = fit_predictors(model, train, train, limits, config, False, directions)
        steps.update()
    steps.close()

    for rho in densities:
        k_experts, k_neurons = round(rho * n_experts), round(rho * c.ffn_dim)
        with masks_chosen(model, _oracle(k_neurons)):
            ppl = _perplexity(model, evaluation)
        recall = recall_of(model, held_out, _oracle(k_neurons))
        rows.append(Row("oracle", rho, recall, ppl, round(rho * dense_bytes), 0))
        for grouping, layers in moe.items():
            mlps = moe_mlps(model, layers, k_experts)
            with using_mlps(model, mlps):
                ppl = _perplexity(model, evaluation)
            recall = recall_of(model, held_out, _moe_choose(layers, k_experts))
            total = sum(m.bytes_per_token() for m in mlps)
            router = sum(p.numel() for m in mlps for p in m.router.parameters()) * size
            rows.append(Row(f"moe {grouping}", rho, recall, ppl, total, router))
        for r, found in predictors.items():
            choose = _top_logits(found, k_neurons)
            with masks_chosen(model, choose):
                ppl = _perplexity(model, evaluation)
            recall = recall_of(model, held_out, choose)
            extra = found.num_parameters() * size
            rows.append(
                Row(f"predictor r={r}", rho, recall, ppl, round(rho * dense_bytes) + extra, extra)
            )
    return rows
