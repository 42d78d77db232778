"""Predictors end to end: train them for a model, run it on their predictions, count the cost.

**Training** (``train_predictors``): record the layers' inputs and true sets on training
windows and on held-out ones (``records``), then size one predictor per layer
(``sizing``) and, if asked, add head predictors. ``fit_predictors`` does the same on
already recorded layers, to try several configurations on one recording.

**Using the predictions** (``predicted_masks_applied``): every MLP computes only the kept
neurons, y = W_down (h * m) with m_j in {0, 1}, as masked dense math. Three masks:

* "predicted": m = the predictor's set;
* "oracle": per token, as many neurons as predicted, but the largest |h_j| (the best set of
  that size);
* "true": the true active set |h_j| > t_l.

``predicted_quality`` compares perplexity and agreement with the dense model's greedy tokens
for each. **Cost** (``mlp_cost``): per token a sparse MLP with density rho reads rows of W_gate,
W_up and columns of W_down for a share rho of the neurons, 6 d n rho FLOPs per layer against
6 d n, and a rank-r predictor adds 2 (d r + r n); the share skipped is
1 - (sparse + predictors) / dense.

References: Liu et al., "Deja Vu: Contextual Sparsity for Efficient LLMs at Inference Time"
(ICML 2023); Song et al., "PowerInfer: Fast Large Language Model Serving with a Consumer-grade
GPU" (2023).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from ..core.model import Transformer
from ..sparsity.contextual import Tally, drop_heads
from .collection import Predictors, model_fingerprint
from .lowrank import predict_heads, predict_neurons
from .records import LayerRecord, record_layers
from .sizing import PredictorConfig, size_layer

__all__ = [
    "fit_predictors",
    "keep_largest",
    "mlp_cost",
    "predicted_masks_applied",
    "predicted_quality",
    "train_predictors",
]


def train_predictors(
    model: Transformer,
    token_batches: Tensor,
    target_recall: float = 0.95,
    kind: str = "lowrank",
    thresholds: Sequence[float] | None = None,
    validation: Tensor | None = None,
    config: PredictorConfig | None = None,
    progress: bool = True,
) -> Predictors:
    """Train one neuron predictor per layer (and head predictors if asked), sized adaptively.

    ``token_batches`` [n, seq]: training windows; ``validation``: held-out windows for the
    cutoffs and the size search (default: the last eighth of ``token_batches``).
    ``thresholds``: per-layer activity thresholds (default 0: nonzero, for ReLU models).
    ``config`` overrides ``kind`` and ``target_recall`` when given.
    """
    config = config or PredictorConfig(kind=kind, target_recall=target_recall)
    n_layers = len(model.layers)
    thresholds = [0.0] * n_layers if thresholds is None else [float(t) for t in thresholds]
    if len(thresholds) != n_layers:
        raise ValueError(f"Got {len(thresholds)} thresholds for {n_layers} layers.")
    if validation is None:
        if token_batches.shape[0] < 2:
            raise ValueError("Need at least two windows to hold one out, or pass validation=.")
        cut = token_batches.shape[0] - max(1, token_batches.shape[0] // 8)
        token_batches, validation = token_batches[:cut], token_batches[cut:]
    train = record_layers(model, token_batches, thresholds, progress=progress)
    val = record_layers(model, validation, thresholds)
    return fit_predictors(model, train, val, thresholds, config, progress)


def fit_predictors(
    model: Transformer,
    train: Sequence[LayerRecord],
    val: Sequence[LayerRecord],
    thresholds: Sequence[float],
    config: PredictorConfig,
    progress: bool = True,
    directions: Sequence[Tensor] | None = None,
) -> Predictors:
    """``train_predictors`` on already recorded layers (record once, try several configs).

    ``directions``: per layer, the gate's principal directions on ``train`` (computed when
    missing; pass them to reuse them across configs with the same inputs).
    """
    n_layers = len(model.layers)
    result = Predictors(nn.ModuleList(), list(thresholds), config.kind, config.lookahead)
    result.made_for = model_fingerprint(model)
    for i in tqdm(range(n_layers), desc="predictors", disable=not progress):
        gate = model.layers[i].mlp.gate_proj.weight.detach()
        x, x_val = result.neuron_input(train, i), result.neuron_input(val, i)
        known = None if directions is None else directions[i]
        predictor, tried = size_layer(gate, x, train[i].active, x_val, val[i].active, config, known)
        result.neurons.append(predictor)
        result.history.append(tried)
    if config.head_sparsity > 0:
        result.attach_heads(model, train, config)
    return result


@contextlib.contextmanager
def predicted_masks_applied(
    model: Transformer, predictors: Predictors, mode: str = "predicted", heads: bool = True
) -> Iterator[list[Tensor]]:
    """Run a block with every MLP computing only the predicted neurons (masked dense math).

    ``mode``: "predicted" keeps the predicted set; "oracle" keeps, per token, the same number
    of neurons but the largest |h_j| (the best set of that size); "true" keeps the true active
    set |h_j| > t_l. Head predictors, when present and ``heads`` is true, drop the heads they
    do not predict.
    Yields a list that collects each layer's kept share per call (the density).
    """
    if mode not in ("predicted", "oracle", "true"):
        raise ValueError(f"Unknown mode {mode!r}; use 'predicted', 'oracle' or 'true'.")
    n_heads = model.config.n_heads
    densities: list[Tensor] = []
    mlp_in: dict[int, Tensor] = {}  # layer -> its MLP input in this forward pass
    attn_in: dict[int, Tensor] = {}

    def store(inputs: dict[int, Tensor], i: int):
        def pre_hook(_m: nn.Module, args: tuple) -> None:
            inputs[i] = args[0]

        return pre_hook

    def mask_neurons(i: int):
        def hook(_m: nn.Module, _a: tuple, h: Tensor) -> Tensor:
            source = mlp_in[predictors.source_layer(i)]
            predicted = predict_neurons(predictors.neurons[i], source)
            if mode == "true":
                keep = h.abs() > predictors.thresholds[i]
            elif mode == "oracle":
                keep = keep_largest(h.abs(), predicted.sum(-1))
            else:
                keep = predicted
            densities.append(keep.float().mean())
            return h * keep.to(h.dtype)

        return hook

    def mask_heads(i: int):
        def pre_hook(_m: nn.Module, args: tuple) -> tuple:
            keep = predict_heads(predictors.heads[i], attn_in[i], predictors.head_keep)
            return (drop_heads(args[0], keep, n_heads),)

        return pre_hook

    handles = []
    for i, layer in enumerate(model.layers):
        handles.append(layer.mlp.register_forward_pre_hook(store(mlp_in, i)))
        handles.append(layer.mlp.down_in_act.register_forward_hook(mask_neurons(i)))
        if heads and predictors.heads is not None:
            handles.append(layer.attn.register_forward_pre_hook(store(attn_in, i)))
            handles.append(layer.attn.o_proj.register_forward_pre_hook(mask_heads(i)))
    try:
        yield densities
    finally:
        for h in handles:
            h.remove()


def keep_largest(scores: Tensor, counts: Tensor) -> Tensor:
    """Per row, a mask of the ``counts[row]`` largest entries of ``scores`` [..., n]."""
    order = scores.argsort(dim=-1, descending=True)
    positions = torch.arange(scores.shape[-1], device=scores.device).expand_as(order)
    ranks = torch.empty_like(order).scatter_(-1, order, positions)
    return ranks < counts[..., None]


@torch.inference_mode()
def predicted_quality(
    model: Transformer,
    predictors: Predictors,
    windows: Tensor,
    modes: Sequence[str] = ("true", "predicted", "oracle"),
    heads: bool = False,
    batch_size: int = 4,
) -> dict[str, dict[str, Any]]:
    """End to end: perplexity, agreement with dense and kept-neuron density for each mode, and
    ``window_nll``, each window's mean NLL (for ``minisparse.io.eval.perplexity_ratio``).

    ``heads``: also drop the heads the head predictors leave out (in every mode).
    """
    device = next(model.parameters()).device
    tallies = {m: Tally() for m in ("dense", *modes)}
    density: dict[str, list[float]] = {m: [] for m in modes}
    for tokens in windows.split(batch_size):
        tokens = tokens.to(device)
        logits = model(tokens)
        reference = logits[:, :-1].argmax(-1)
        tallies["dense"].add(logits, tokens, reference)
        for m in modes:
            with predicted_masks_applied(model, predictors, m, heads) as kept:
                tallies[m].add(model(tokens), tokens, reference)
            density[m].append(float(torch.stack(kept).mean()))
    dense = tallies["dense"]
    out: dict[str, dict[str, Any]] = {
        "dense": {"ppl": dense.ppl, "agreement": 1.0, "density": 1.0, "window_nll": dense.windows}
    }
    for m in modes:
        t = tallies[m]
        out[m] = {
            "ppl": t.ppl,
            "agreement": t.agree / t.count,
            "density": sum(density[m]) / len(density[m]),
            "window_nll": t.windows,
        }
    return out


def mlp_cost(model: Transformer, predictors: Predictors, density: float) -> dict[str, float]:
    """Per-token FLOPs of the MLPs, dense and with predicted sets, with the predictors counted.

    A predicted-sparse MLP reads rows of W_gate, W_up and columns of W_down for a share
    ``density`` of the neurons: 6 d n density FLOPs per layer against 6 d n; a predictor costs
    2 (d r + r n) (weights are read once each, so bytes follow the same ratio at one dtype).
    """
    c = model.config
    dense = 6 * c.dim * c.ffn_dim * c.n_layers
    predictor = 2 * sum(p.num_parameters() for p in predictors.neurons)
    sparse = dense * density
    return {
        "dense_flops": float(dense),
        "sparse_flops": float(sparse),
        "predictor_flops": float(predictor),
        "skipped_share": 1 - (sparse + predictor) / dense,
    }
