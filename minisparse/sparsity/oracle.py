"""DejaVu's oracle masks computed from one layer's activations, by functions one can swap.

``contextual.oracle_quality`` keeps, per token, the units with the largest scores. Here the two
rules that turn a layer's activations into its masks are plain functions of tensors:

    neurons:  g = W_gate x, u = W_up x  (the gate and up projections' outputs, [..., n])
              h = act(g) * u,  score_j = |h_j|,  keep the k = max(1, n - round(s n)) largest
    heads:    o = the attention output before W_o, [..., H * d], head i owning the channels
              i d .. (i + 1) d - 1;  score_i = ||o_i||_2,  keep the k largest of the H

``ActivationOracle(neurons=..., heads=...)`` records g, u and o in the dense pass (pass 1) and
calls the rules for every layer and setting; it is what ``oracle_quality(..., oracle=...)``
takes. With the default rules it keeps the same units as the library's ``ScoreOracle``
(``record_scores`` + ``oracle_masks``), which reads |h| at the down projection's input.

Reference: Liu et al., "Deja Vu: Contextual Sparsity for Efficient LLMs at Inference Time"
(ICML 2023).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..core.config import ACTIVATIONS
from ..core.hooks import capture_inputs, capture_outputs
from ..core.model import Transformer
from .contextual import Masks, Setting, top_mask

__all__ = [
    "ActivationOracle",
    "LayerActivations",
    "oracle_head_mask",
    "oracle_neuron_mask",
    "record_activations",
]

#: (gate [..., n], up [..., n], act name, sparsity) -> bool [..., n]
NeuronRule = Callable[[Tensor, Tensor, str, float], Tensor]
#: (o [..., H * d], H, sparsity) -> bool [..., H]
HeadRule = Callable[[Tensor, int, float], Tensor]


def oracle_neuron_mask(gate: Tensor, up: Tensor, act: str, sparsity: float) -> Tensor:
    """Per token, the neurons with the top (1 - s) |h_j|, h = act(gate) * up: bool [..., n]."""
    return top_mask((ACTIVATIONS[act]()(gate) * up).abs(), sparsity)


def oracle_head_mask(o: Tensor, n_heads: int, sparsity: float) -> Tensor:
    """Per token, the heads with the top (1 - s) output norms ||o_i||: bool [..., n_heads]."""
    return top_mask(o.reshape(*o.shape[:-1], n_heads, -1).norm(dim=-1), sparsity)


@dataclass
class LayerActivations:
    """Pass 1's record for one batch, per layer: the gate and up projections' outputs
    [batch, seq, n] and the attention output before W_o [batch, seq, H * d]."""

    gate: list[Tensor]
    up: list[Tensor]
    attn_out: list[Tensor]


@torch.inference_mode()
def record_activations(model: Transformer, tokens: Tensor) -> tuple[Tensor, LayerActivations]:
    """The dense logits of ``tokens`` [batch, seq] and every layer's activations."""
    reshaped = [
        i
        for i, layer in enumerate(model.layers)
        if not isinstance(layer.mlp.down_in_act, nn.Identity)
    ]
    if reshaped:
        raise ValueError(
            f"Layers {reshaped} change h before the down projection (mlp.down_in_act), so "
            "act(W_gate x) * (W_up x) is not what the model computes; run oracle_quality "
            "without oracle= (it scores h where the down projection reads it)."
        )

    def each(name: str) -> dict[str, nn.Module]:
        return {str(i): layer.get_submodule(name) for i, layer in enumerate(model.layers)}

    with contextlib.ExitStack() as stack:
        gate = stack.enter_context(capture_outputs(each("mlp.gate_proj")))
        up = stack.enter_context(capture_outputs(each("mlp.up_proj")))
        out = stack.enter_context(capture_inputs(each("attn.o_proj")))
        logits = model(tokens)
    keys = [str(i) for i in range(len(model.layers))]
    return logits, LayerActivations(
        [gate[k][0] for k in keys], [up[k][0] for k in keys], [out[k][0] for k in keys]
    )


@dataclass(frozen=True)
class ActivationOracle:
    """A contextual oracle whose masks come from ``neurons`` and ``heads`` applied to each
    layer's activations (``oracle_quality(..., oracle=ActivationOracle(mine, mine))``)."""

    neurons: NeuronRule = oracle_neuron_mask
    heads: HeadRule = oracle_head_mask

    def record(self, model: Transformer, tokens: Tensor) -> tuple[Tensor, LayerActivations]:
        return record_activations(model, tokens)

    def masks(self, model: Transformer, recorded: LayerActivations, setting: Setting) -> Masks:
        c = model.config
        neurons = heads = None
        if setting.mlp:
            pairs = zip(recorded.gate, recorded.up, strict=True)
            neurons = [self.neurons(g, u, c.hidden_act, setting.mlp) for g, u in pairs]
        if setting.heads:
            heads = [self.heads(o, c.n_heads, setting.heads) for o in recorded.attn_out]
        return Masks(neurons, heads)
