"""What the predictors learn from: each layer's inputs and its true active sets.

A predictor is trained on examples (x, y): x is what the layer reads, y the units that turn out
to matter. ``record_layers`` runs the dense model over text once and keeps, per layer:

* the MLP's normed input x [tokens, d] (what a neuron predictor reads) and the attention's
  normed input (what a head predictor reads);
* the true neuron set: neuron j is *active* when |h_j| > t_l, with
  h = act(W_gate x) * (W_up x) the down projection's input;
* the heads' output norms ||o_i||: a head is active when its norm is among the top k of its
  layer (DejaVu's head predictor).

**The target** (``prediction_target``) fixes the model and the thresholds t_l. For chapter
04's fine-tuned ReLU model t_l = 0: the active set is exactly the nonzero neurons, and a perfect
predictor reproduces the dense model. For the SiLU model t_l is chapter 03's calibrated
threshold, P(|h_j| <= t_l) = s on calibration text (TEAL), or the same on act(W_gate x) (CATS).

References: Liu et al., "Deja Vu: Contextual Sparsity for Efficient LLMs at Inference Time"
(ICML 2023); Song et al., "PowerInfer: Fast Large Language Model Serving with a Consumer-grade
GPU" (2023).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from ..core.hooks import capture_inputs
from ..core.model import Transformer
from ..sparsity import calibrate_thresholds, head_norms

__all__ = ["LayerRecord", "Target", "prediction_target", "record_layers"]


@dataclass
class Target:
    """What the predictors are asked to find: the model and, per layer, the activity threshold.

    Neuron j of layer l is active when |h_j| > ``thresholds[l]`` (all 0 for a ReLU model).
    """

    model: Transformer
    thresholds: list[float]
    description: str


def prediction_target(
    base: Transformer,
    calibration: Tensor,
    sparsity: float = 0.5,
    stage: int = 1,
    site: str = "down_in",
) -> Target:
    """The fine-tuned ReLU model of chapter 04 when the cache has it, else the SiLU model.

    For the SiLU model the active set is |x_j| > t_l at ``site`` with t_l calibrated on
    ``calibration`` at ``sparsity``: chapter 03's TEAL thresholds on the down projection's input
    h (``"down_in"``), or its CATS thresholds on act(W_gate x) (``"mlp_act"``).
    """
    from ..relufy.recipe import load_relufied, result_dir

    if site not in ("down_in", "mlp_act"):
        raise ValueError(f"site must be 'down_in' or 'mlp_act', got {site!r}.")
    try:
        model, info = load_relufied(base, stage)
    except FileNotFoundError:
        found = calibrate_thresholds(base, calibration, sparsity, (site,), progress=False)
        what = "h" if site == "down_in" else "act(W_gate x)"
        return Target(
            base,
            found[site],
            f"the embedded SiLU model; active = |{what}| above chapter 03's {sparsity:.0%} "
            f"thresholds (no fine-tuned ReLU model in {result_dir(stage, 'mlp').parent}; "
            "make it once with `minisparse prepare`, about 30 minutes)",
        )
    steps = info.get("config", {}).get("steps", "?")
    zeros = info.get("finetuned", {}).get("zeros_mlp_act", float("nan"))
    return Target(
        model,
        [0.0] * len(model.layers),
        f"chapter 04's fine-tuned ReLU model (stage {stage}, {steps} steps, {zeros:.1%} zeros); "
        "active = nonzero",
    )


@dataclass
class LayerRecord:
    """What one layer saw on some tokens: the predictors' inputs and the true sets."""

    mlp_in: Tensor  # [tokens, dim], the MLP's (normed) input
    attn_in: Tensor  # [tokens, dim], the attention's (normed) input
    active: Tensor  # [tokens, ffn] bool, |h| > threshold
    head_norms: Tensor  # [tokens, n_heads], ||o_i||


@torch.inference_mode()
def record_layers(
    model: Transformer,
    windows: Tensor,
    thresholds: Sequence[float],
    batch_size: int = 4,
    progress: bool = False,
) -> list[LayerRecord]:
    """Run the dense model over ``windows`` [n, seq] and keep, per layer, inputs and sets."""
    n_heads = model.config.n_heads
    layers = dict(enumerate(model.layers))

    def per_layer(module: str) -> dict[int, nn.Module]:
        return {i: layer.get_submodule(module) for i, layer in layers.items()}

    def flat(x: Tensor) -> Tensor:
        return x.reshape(-1, x.shape[-1])

    device = next(model.parameters()).device
    with contextlib.ExitStack() as stack:
        mlp_in = stack.enter_context(capture_inputs(per_layer("mlp"), flat))
        attn_in = stack.enter_context(capture_inputs(per_layer("attn"), flat))
        heads = stack.enter_context(
            capture_inputs(per_layer("attn.o_proj"), lambda x: head_norms(x, n_heads))
        )
        active = {  # the down projection's input h, thresholded per layer
            i: stack.enter_context(
                capture_inputs({i: layer.mlp.down_proj}, lambda h, t=t: flat(h.abs() > t))
            )[i]
            for (i, layer), t in zip(layers.items(), thresholds, strict=True)
        }
        for chunk in tqdm(windows.split(batch_size), desc="recording", disable=not progress):
            model(chunk.to(device))
    return [
        LayerRecord(
            torch.cat(mlp_in[i]), torch.cat(attn_in[i]), torch.cat(active[i]), torch.cat(heads[i])
        )
        for i in layers
    ]
