"""QLoRA: LoRA adapters trained on a frozen base stored in NF4 (Dettmers et al. 2023).

LoRA (``minisparse.relufy.lora``) trains a low-rank update B A beside each frozen projection
W. The frozen W is only read, so it can be kept in 4 bits: QLoRA stores it in NF4 with
double-quantized block scales (``minisparse.quant.nf4``, ≈ 4.127 bits a weight) and computes

    y = dequant(W_nf4) x + (alpha / r) B A x

with gradients flowing only into A and B (and through the dequantized W into x). The memory
of fine-tuning shrinks twice: the base weights to about an eighth of float32, and the trained
state (parameters plus Adam's two moments, 3 × 4 bytes a number) from every weight to the
r (in + out) numbers of each adapter (``trainable_state_bytes``).

After training, ``merge_qlora`` returns a plain float model: W ← dequant(W_nf4) + (alpha / r) B A
in every projection, which computes the same logits as the adapter model without the extra
products per token. (Merging into the 4-bit codes would round the update away; the merged
model is float32, or is quantized again afterwards.)

``nf4_base_`` alone puts the NF4 base in; ``minisparse.relufy.finetune.finetune_`` with
``trainable="lora"`` then adds the adapters and trains them, which is ``qlora_`` followed by
chapter 04's distillation loop.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

from torch import nn

from ..core.model import Transformer
from ..quant.nf4 import NF4Linear, QuantizeFn
from ..relufy.lora import (
    LORA_TARGETS,
    LoRALinear,
    add_lora_,
    check_targets,
    merge_lora_,
    plain_linear,
)

__all__ = [
    "ADAM_COPIES",
    "merge_qlora",
    "nf4_base_",
    "qlora_",
    "trainable_state_bytes",
]

ADAM_COPIES = 3  # a trained number keeps itself and Adam's two moments, each float32


def projections(model: Transformer, targets: Sequence[str]) -> list[tuple[nn.Module, str]]:
    """(owner, name) of every block projection named in ``targets``."""
    check_targets(targets)
    return [
        (owner, name)
        for layer in model.layers
        for owner in (layer.attn, layer.mlp)
        for name in targets
        if hasattr(owner, name)
    ]


def nf4_base_(
    model: Transformer,
    block_size: int = 64,
    targets: Sequence[str] = LORA_TARGETS,
    double: bool = True,
    quantize_fn: QuantizeFn | None = None,
) -> Transformer:
    """Replace every projection in ``targets`` by its frozen ``NF4Linear``; in place.

    ``quantize_fn(w, block_size) -> (codes, absmax)`` replaces ``nf4_quantize`` when given.
    """
    for owner, name in projections(model, targets):
        linear = getattr(owner, name)
        if not isinstance(linear, nn.Linear):
            raise ValueError(
                f"{name} is a {type(linear).__name__}, not a float linear layer: put the NF4 "
                "base in before adding adapters or other wrappers."
            )
        setattr(owner, name, NF4Linear.from_linear(linear, block_size, double, quantize_fn))
    return model


def qlora_(
    model: Transformer,
    rank: int = 16,
    alpha: float = 32.0,
    block_size: int = 64,
    targets: Sequence[str] = LORA_TARGETS,
    quantize_fn: QuantizeFn | None = None,
    double: bool = True,
    seed: int = 0,
) -> Transformer:
    """NF4 bases under LoRA adapters in every projection of ``targets``; in place.

    Every parameter is frozen except the adapters' A and B (B = 0: the logits are those of the
    NF4 model until training moves B).
    """
    nf4_base_(model, block_size, targets, double, quantize_fn)
    add_lora_(model, rank, alpha, seed=seed, targets=targets)
    for name, p in model.named_parameters():
        p.requires_grad_(name.endswith((".A", ".B")))
    return model


def trainable_state_bytes(model: nn.Module) -> dict[str, int | float]:
    """Bytes of trained state (parameters + Adam's two moments, float32) vs full fine-tuning.

    ``trainable``: the numbers that require a gradient; ``full``: every weight the model
    computes with (NF4 weights counted as the float weights they stand for, adapters left
    out). Each is multiplied by 3 × 4 bytes (``*_bytes``); ``ratio`` = trainable / full.
    Gradients (one more copy of the trained numbers) and activations are not counted.
    """
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    adapters = {id(p) for m in model.modules() if isinstance(m, LoRALinear) for p in (m.A, m.B)}
    full = sum(p.numel() for p in model.parameters() if id(p) not in adapters)
    full += sum(
        m.in_features * m.out_features + (0 if m.bias is None else m.out_features)
        for m in model.modules()
        if isinstance(m, NF4Linear)
    )
    per_number = ADAM_COPIES * 4
    return {
        "trainable": trainable,
        "full": full,
        "trainable_bytes": trainable * per_number,
        "full_bytes": full * per_number,
        "ratio": trainable / full,
    }


def merge_qlora(model: Transformer) -> Transformer:
    """A plain float copy of ``model``: every NF4 base dequantized, every adapter merged.

    ``model`` is left unchanged. A projection with an NF4 base and no adapter is dequantized
    too, so the copy holds no NF4 layer.
    """
    merged = merge_lora_(copy.deepcopy(model))
    for owner, name in projections(merged, LORA_TARGETS):
        module = getattr(owner, name)
        if isinstance(module, NF4Linear):
            setattr(owner, name, plain_linear(module))
    for p in merged.parameters():
        p.requires_grad_(False)
    return merged
