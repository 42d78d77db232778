"""LoRA: fine-tune a large weight matrix through a low-rank update, then fold it back in.

A projection y = W x with W [out, in] gets a trainable low-rank update while W stays frozen
(Hu et al. 2021):

    y = W x + (alpha / r) B A x        A [r, in], B [out, r], r << min(in, out)

A starts random (scaled by 1 / sqrt(in)) and B at zero, so the model is unchanged before the
first step. Only A and B train: r (in + out) numbers instead of in * out, about 4% of a
576 x 1536 MLP matrix at r = 16, which shrinks the optimiser state and the gradient work by as
much. After training, ``merge_lora_`` folds the update into the weight, W <- W + (alpha / r) B A,
and the model is a plain ``Transformer`` again: no extra work per token at inference.

``add_lora_`` wraps every projection of the blocks (``LORA_TARGETS``: q, k, v, o of attention,
gate, up, down of the MLP) in a ``LoRALinear``; ``minisparse.relufy.finetune`` trains them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core.checks import check_count, check_positive
from ..core.layers import Linear
from ..core.model import Transformer

__all__ = [
    "LORA_TARGETS",
    "LoRALinear",
    "add_lora",
    "add_lora_",
    "check_targets",
    "lora_weight_names",
    "merge_lora",
    "merge_lora_",
    "plain_linear",
]


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRALinear(nn.Module):
    """base(x) + (alpha / r) B A x with a frozen ``base`` and trainable A [r, in], B [out, r].

    ``base`` is an ``nn.Linear``, or any module with ``in_features``, ``out_features`` and a
    ``weight`` [out, in] it computes with (a quantized layer whose ``weight`` dequantizes).
    """

    def __init__(self, base: nn.Module, rank: int, alpha: float, seed: int = 0) -> None:
        super().__init__()
        self.base, self.scale = base, alpha / rank
        gen = torch.Generator().manual_seed(seed)
        a = torch.randn(rank, base.in_features, generator=gen) / math.sqrt(base.in_features)
        w = base.weight
        self.A = nn.Parameter(a.to(device=w.device, dtype=w.dtype))
        self.B = nn.Parameter(torch.zeros(base.out_features, rank, device=w.device, dtype=w.dtype))

    def forward(self, x: Tensor) -> Tensor:
        return self.base(x) + F.linear(F.linear(x, self.A), self.B) * self.scale

    @torch.no_grad()
    def merged(self) -> nn.Linear:
        """``base`` with B A folded into its weight (in place); a base that is not an
        ``nn.Linear`` becomes a plain ``Linear`` holding its ``weight`` first."""
        base = self.base if isinstance(self.base, nn.Linear) else plain_linear(self.base)
        base.weight += (self.B @ self.A) * self.scale
        return base


@torch.no_grad()
def plain_linear(module: nn.Module) -> Linear:
    """A float ``Linear`` with the ``weight`` (and ``bias``) that ``module`` computes with."""
    weight = module.weight.detach()
    bias = getattr(module, "bias", None)
    linear = Linear(module.in_features, module.out_features, bias=bias is not None)
    linear.to(device=weight.device, dtype=weight.dtype)
    linear.weight.copy_(weight)
    if bias is not None:
        linear.bias.copy_(bias)
    return linear.requires_grad_(False)


def check_targets(targets: Sequence[str]) -> None:
    """Projection names among ``LORA_TARGETS`` (at least one), else a ValueError."""
    if isinstance(targets, str) or not targets or set(targets) - set(LORA_TARGETS):
        raise ValueError(
            f"targets must be a list of projection names among {LORA_TARGETS}, got {targets!r}."
        )


def add_lora_(
    model: Transformer,
    rank: int,
    alpha: float,
    seed: int = 0,
    targets: Sequence[str] = LORA_TARGETS,
) -> Transformer:
    """Wrap every block projection named in ``targets`` in a ``LoRALinear``; in place, returns
    ``model``."""
    check_count(rank, "rank", fix="LoRA commonly uses 8 or 16")
    check_positive(alpha, "alpha", "32")
    check_targets(targets)
    for i, layer in enumerate(model.layers):
        for owner in (layer.attn, layer.mlp):
            for j, name in enumerate(n for n in LORA_TARGETS if hasattr(owner, n)):
                if name in targets:
                    base = getattr(owner, name)
                    setattr(owner, name, LoRALinear(base, rank, alpha, seed=seed + 100 * i + j))
    return model


def lora_weight_names(model: Transformer) -> list[str]:
    """Names of the base weights wrapped by a ``LoRALinear`` (as they read after merging)."""
    return [
        f"layers.{i}.{part}.{name}.weight"
        for i, layer in enumerate(model.layers)
        for part, owner in (("attn", layer.attn), ("mlp", layer.mlp))
        for name in LORA_TARGETS
        if isinstance(getattr(owner, name, None), LoRALinear)
    ]


def merge_lora_(model: Transformer) -> Transformer:
    """Fold every ``LoRALinear`` back into a plain linear; in place, returns ``model``."""
    for layer in model.layers:
        for owner in (layer.attn, layer.mlp):
            for name in LORA_TARGETS:
                module = getattr(owner, name, None)
                if isinstance(module, LoRALinear):
                    setattr(owner, name, module.merged())
    return model


def merge_lora(model: Transformer) -> list[str]:
    """The name before the in-place convention: ``merge_lora_``, returning the merged names."""
    names = lora_weight_names(model)
    merge_lora_(model)
    return names


# The name before the in-place convention (a trailing underscore), kept for existing code.
add_lora = add_lora_
