"""Weight formats, one registry: how many bytes a weight takes when the model decodes.

The engine's ``weights=`` (chapter 11), ``minisparse bench decode --weights``, ``bench isa`` and
``bench quant`` list the formats registered here. A format is chapter 09's weight-only
round-to-nearest quantization of every linear layer (LM head included) into layers that the
CPU kernels and the compiled decode step read directly: int8 codes with one scale per output
row (a quarter of the float32 bytes), or 4-bit codes with a scale and zero point per
``INT4_GROUP`` weights (20 bytes per 32 weights: 0.156 of the float32 bytes).
``sparse_kernel``: whether a sparse MLP kernel reads the format (chapter 07's int8 loops do;
there is no sparse int4 kernel). ``int4-a8`` is the one format that is not exact arithmetic on
its weights: the activations are rounded to int8 per 32 inputs so that the compiled step can
use integer dot products (``quant.layers.q8_activations``); it is an explicit choice, never a
default, and its perplexity is the price to check.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.memory import to_huge_pages_
from ..core.model import Transformer
from ..core.registry import Registry
from .apply import quantize_model
from .layers import int8_activations_

__all__ = ["INT4_GROUP", "WEIGHT_FORMATS", "WeightFormat", "low_bit", "register_format"]

INT4_GROUP = 32  # int4 weights: one scale and zero point per 32 weights


@dataclass(frozen=True)
class WeightFormat:
    name: str
    summary: str
    bits: int | None  # None: the float32 weights as they are
    group_size: int | None = None  # weights sharing a scale (None: one per output row)
    sparse_kernel: bool = True  # a sparse MLP kernel reads this format
    act_int8: bool = False  # int4 layers multiply with int8-rounded activations (an approximation)


WEIGHT_FORMATS: Registry[WeightFormat] = Registry("weight format")
register_format = WEIGHT_FORMATS.register


def low_bit(model: Transformer, weights: str) -> Transformer:
    """``model`` in the weight format ``weights``: the model itself for float32, else a copy
    with chapter 09's packed weight-only layers, LM head included."""
    fmt = WEIGHT_FORMATS.find(weights)
    if fmt.bits is None:
        return model
    quantized = quantize_model(
        model, bits=fmt.bits, group_size=fmt.group_size, packed=True, progress=False
    )
    if fmt.act_int8:
        int8_activations_(quantized)
    return to_huge_pages_(quantized)  # the packed weights in 2 MB pages, as load's


register_format(WeightFormat("fp32", "float32 weights, 4 bytes each", None))
register_format(WeightFormat("int8", "int8 codes, one scale per output row", 8))
register_format(
    WeightFormat(
        "int4",
        f"4-bit codes, a scale and zero per {INT4_GROUP}",
        4,
        INT4_GROUP,
        sparse_kernel=False,
    )
)
register_format(
    WeightFormat(
        "int4-a8",
        f"int4's weights times activations rounded to int8 per {INT4_GROUP} (integer dot "
        "products, as llama.cpp's Q4 x Q8; not exact: compare perplexities)",
        4,
        INT4_GROUP,
        sparse_kernel=False,
        act_int8=True,
    )
)
