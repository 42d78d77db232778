"""Houlsby adapters: a small trainable bottleneck after each MLP (Houlsby et al. 2019).

An adapter adds a residual bottleneck to the output y [.., d] of a block's MLP:

    y' = y + U relu(D y)        D [k, d], U [d, k], k << d (the bottleneck)

with U = 0 at the start, so y' = y and the model is unchanged until training moves U. Only D
and U train: 2 d k numbers a layer (36 864 at d = 576, k = 32).

Unlike LoRA's B A, which is linear and folds into W, the adapter has a ReLU between D and U:
it cannot be merged into the MLP's weights and stays as two extra products (and a ReLU) per
token and layer at inference. ``adapter_decode_cost`` measures what that costs in torch
decoding beside the same model without adapters (a merged LoRA model, for instance).

The adapter sits on the MLP's down projection, whose output is the MLP's output, so every
other part of the MLP (its activation, which ``minisparse.sparsity`` records) is untouched.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core.checks import check_count
from ..core.model import Transformer
from ..measure.compare import spread
from ..measure.timing import interleaved_decode
from ..runtime.generate import generate

__all__ = ["HoulsbyAdapter", "adapter_decode_cost", "add_adapters_"]


class HoulsbyAdapter(nn.Module):
    """base(x) followed by the residual bottleneck y + U relu(D y); D, U trainable, U = 0."""

    def __init__(self, base: nn.Module, bottleneck: int, seed: int = 0) -> None:
        super().__init__()
        self.base = base
        dim = base.out_features
        weight = base.weight
        gen = torch.Generator().manual_seed(seed)
        down = torch.randn(bottleneck, dim, generator=gen) / dim**0.5
        self.down = nn.Parameter(down.to(device=weight.device, dtype=weight.dtype))
        self.up = nn.Parameter(
            torch.zeros(dim, bottleneck, device=weight.device, dtype=weight.dtype)
        )

    def forward(self, x: Tensor) -> Tensor:
        y = self.base(x)
        return y + F.linear(F.relu(F.linear(y, self.down)), self.up)


def add_adapters_(model: Transformer, bottleneck: int = 32, seed: int = 0) -> Transformer:
    """An adapter after the MLP of every block; in place, returns ``model``.

    Everything else is frozen; the adapters' ``down`` and ``up`` train.
    """
    check_count(bottleneck, "bottleneck", fix="Houlsby et al. use 8 to 256; try 32")
    if bottleneck >= model.config.dim:
        raise ValueError(
            f"bottleneck {bottleneck} is not smaller than the model's width {model.config.dim}; "
            "an adapter is a narrow bottleneck, e.g. 32."
        )
    for p in model.parameters():
        p.requires_grad_(False)
    for i, layer in enumerate(model.layers):
        if isinstance(layer.mlp.down_proj, HoulsbyAdapter):
            raise ValueError(f"layer {i} already has an adapter; add adapters once.")
        layer.mlp.down_proj = HoulsbyAdapter(layer.mlp.down_proj, bottleneck, seed=seed + i)
    return model


def adapter_decode_cost(
    model: Transformer,
    tokenizer: Any,
    bottleneck: int = 32,
    prompt: str = "The quick brown fox",
    new_tokens: int = 16,
    repeats: int = 3,
    progress: bool = False,
) -> dict[str, Any]:
    """Greedy torch decode speed of ``model`` and of a copy with adapters, timed in turn.

    ``model`` (left unchanged) stands for the merged LoRA model: its projections are plain, so
    it decodes at the base model's cost. Returns ``plain_tok_s``, ``adapters_tok_s``,
    ``slowdown`` (the paired median of adapter / plain seconds per token, 1.0 = free),
    ``speed_ratio`` (adapter / plain speed per round: its median within the rounds' range, a
    ``minisparse.measure.compare.Interval`` for ``verdict``),
    ``adapter_params`` and ``same_tokens`` (the adapters start as the identity, so greedy
    decoding must give the same tokens). Both run the torch modules (``compiled=False``) after
    one warm-up round (``minisparse.measure.timing``).
    """
    check_count(new_tokens, "new_tokens", minimum=2, fix="time at least 2 new tokens")
    check_count(repeats, "repeats", fix="3 repeats take a few seconds")
    adapted = add_adapters_(copy.deepcopy(model), bottleneck)

    def run(m: Transformer):
        return lambda: generate(m, tokenizer, prompt, new_tokens, compiled=False, stop_at_eos=False)

    with torch.inference_mode():
        speeds = interleaved_decode(
            {"plain": run(model), "adapters": run(adapted)}, repeats, 1, progress
        )
    params = sum(p.numel() for p in adapted.parameters() if p.requires_grad)
    return {
        "plain_tok_s": speeds["plain"].tok_s,
        "adapters_tok_s": speeds["adapters"].tok_s,
        "slowdown": speeds["plain"].paired_speedup(speeds["adapters"]),
        "speed_ratio": spread(speeds["adapters"].round_speedups(speeds["plain"])),
        "adapter_params": params,
        "same_tokens": speeds["plain"].tokens == speeds["adapters"].tokens,
    }
