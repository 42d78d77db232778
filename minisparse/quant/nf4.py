"""NF4, the 4-bit NormalFloat data type of QLoRA (Dettmers et al. 2023), and its layer.

Pretrained weights are close to normally distributed, so a 4-bit code should place its 16
levels where a normal distribution puts equal probability mass, not on an even grid. NF4 takes
its levels from quantiles of N(0, 1), normalised to [-1, 1]:

    positive side  Q(p_i), p_i = linspace(δ, 1/2, 9)[:8]        8 levels > 0
    negative side -Q(p_j), p_j = linspace(δ, 1/2, 8)[:7]        7 levels < 0
    plus an exact 0;  every level divided by Q(δ), the largest one

with Q = Φ⁻¹ the quantile function of the standard normal. The two sides are built separately
so that 0 is a level exactly (padding and pruned weights stay 0) while all 16 codes are used:
8 positive, 7 negative, the asymmetry the paper describes. The extreme probability
δ = 1 - ½ (1/30 + 1/32) is the mean of the half-bin offsets of 15 and 16 equal bins; Q(1) is
infinite, so the outermost level sits at Q(δ) and maps to ±1. This reproduces the published
table to float32 rounding (2e-7).

A weight matrix W [rows, cols] is cut into blocks of ``block_size`` consecutive weights of a
row. Each block keeps its absmax c = max|w| (float32) and each weight the code of the level
nearest to w / c (computed in float32); the way back is ŵ = c · level[code]. Cost: 4 bits a
weight plus 32 / 64 = 0.5 bit of scale at block 64, 4.5 bits in all.

**Double quantization** quantizes those scales in turn, to 8 bits each on a logarithmic grid:
cut them into blocks of 256; each block keeps its largest scale M (float32), and each scale c
the code q = 255 − round(log2(M / c) / h) in 1..255 (0 stands for an all-zero block), with one
step h per tensor (float32) so that the smallest non-zero scale of the widest block gets code 1.
The way back is ĉ = M · 2^(−(255 − q) h): never negative, never above M (no overflow), and off
by at most a factor 2^(h/2) whatever the scales hold, an outlier of 1e38 included. The paper
stores the second level as FP8 after subtracting the scales' mean; a linear int8 grid after the
mean (the plain alternative) breaks on one outlier weight: its block's scale stretches the grid
so that every other scale rounds to the mean or below it, negative, and the weights of those
blocks flip sign. A log grid is an 8-bit float with a fine exponent and no mantissa: its error
is relative, as an outlier needs. Cost: 4 + 8/64 + 32/(64 · 256) ≈ 4.127 bits a weight (plus
the one step per tensor).

``NF4Linear`` keeps only the codes and (double-quantized) scales of its frozen weight and
dequantizes it at every forward pass, then multiplies in float: QLoRA's base layer. The codes
are held one per byte for clarity (a kernel packs two per byte; ``bits_per_weight`` counts the
packed size). ``nf4_vs_int4`` compares NF4 with symmetric absmax int4 RTN on the same blocks
(``minisparse.quant.tensor``), the same 4 bits and the same scale cost.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core.checks import check_count
from .tensor import QuantSpec, check_finite, fake_quantize

__all__ = [
    "DOUBLE_BLOCK",
    "NF4_LEVELS",
    "NF4Linear",
    "NF4Tensor",
    "QuantizeFn",
    "bits_per_weight",
    "double_dequantize",
    "double_quantize",
    "nf4_dequantize",
    "nf4_levels",
    "nf4_quantize",
    "nf4_vs_int4",
]

DOUBLE_BLOCK = 256  # scales per second-level block (QLoRA's choice)
LOG_CODES = 255  # the largest code of the second level (0: a zero scale)
#: An NF4 weight's scale fields (``NF4Tensor``) and buffers (``NF4Linear``), in order.
SCALE_FIELDS = ("absmax", "absmax_codes", "absmax_scales", "absmax_step")

#: (w [rows, cols], block_size) -> (codes uint8 [rows, cols], absmax float32 [rows, blocks])
QuantizeFn = Callable[[Tensor, int], tuple[Tensor, Tensor]]


def nf4_levels() -> Tensor:
    """The 16 NF4 levels, ascending, float32 (see the module docstring for the construction)."""
    delta = 1 - 0.5 * (1 / 30 + 1 / 32)
    positive = torch.special.ndtri(torch.linspace(delta, 0.5, 9, dtype=torch.float64)[:-1])
    negative = -torch.special.ndtri(torch.linspace(delta, 0.5, 8, dtype=torch.float64)[:-1])
    levels = torch.cat([positive, negative, torch.zeros(1, dtype=torch.float64)])
    return (levels / levels.max()).sort().values.float()


NF4_LEVELS = nf4_levels()


def check_block(cols: int, block_size: object) -> int:
    """``block_size`` as an int that divides the rows of ``cols`` columns, else a ValueError."""
    block = check_count(block_size, "block_size", fix="QLoRA uses 64")
    if cols % block:
        divisors = [b for b in (32, 64, 128, 256) if cols % b == 0]
        raise ValueError(
            f"block_size {block} does not divide the rows ({cols} columns); use a block size "
            f"that divides {cols}" + (f", e.g. {divisors[-1]}." if divisors else ".")
        )
    return block


def check_matrix(w: Tensor) -> None:
    """A non-empty, finite 2-D float weight, else one ValueError that says which it is not."""
    if not isinstance(w, Tensor) or w.dim() != 2 or not w.is_floating_point():
        shape = tuple(w.shape) if isinstance(w, Tensor) else type(w).__name__
        raise ValueError(f"Expected a 2-D float weight [rows, cols], got {shape}.")
    if w.numel() == 0:
        raise ValueError(
            f"The weight {tuple(w.shape)} is empty: there is nothing to quantize; pass a layer "
            "with at least one row and one column."
        )
    check_finite(w, "the weight to quantize")


def check_codes(codes: Tensor) -> None:
    """NF4 codes: a 2-D uint8 tensor of values 0..15, else one ValueError naming the fault."""
    if not isinstance(codes, Tensor) or codes.dim() != 2 or codes.dtype != torch.uint8:
        what = f"{codes.dtype} {tuple(codes.shape)}" if isinstance(codes, Tensor) else type(codes)
        raise ValueError(f"NF4 codes are a 2-D uint8 tensor (nf4_quantize's), got {what}.")
    if codes.numel() and int(codes.max()) >= len(NF4_LEVELS):
        raise ValueError(
            f"NF4 codes index 16 levels (0..15), but one is {int(codes.max())}; the codes are "
            "damaged or not NF4's: quantize the weight again with nf4_quantize."
        )


def block_absmax(w: Tensor, block_size: int) -> Tensor:
    """max|w| of every block of ``block_size`` consecutive weights of a row: [rows, blocks]."""
    rows, cols = w.shape
    return w.detach().abs().reshape(rows, cols // block_size, block_size).amax(-1).float()


def nf4_quantize(w: Tensor, block_size: int = 64) -> tuple[Tensor, Tensor]:
    """(codes uint8 [rows, cols], absmax float32 [rows, cols / block_size]) of ``w``.

    Each weight's code is the index of the NF4 level nearest to w / absmax of its block (a tie
    goes to the lower level); an all-zero block keeps absmax 0 and the code of level 0.
    """
    check_matrix(w)
    rows, cols = w.shape
    block = check_block(cols, block_size)
    absmax = block_absmax(w, block)
    safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    x = w.detach().float().reshape(rows, -1, block) / safe[..., None]
    levels = NF4_LEVELS.to(w.device)
    codes = torch.bucketize(x, (levels[1:] + levels[:-1]) / 2)
    return codes.reshape(rows, cols).to(torch.uint8), absmax


def nf4_dequantize(
    codes: Tensor, absmax: Tensor, block_size: int = 64, dtype: torch.dtype = torch.float32
) -> Tensor:
    """ŵ = absmax · level[code] [rows, cols], computed in ``dtype`` (float32 by default)."""
    check_codes(codes)
    rows, cols = codes.shape
    block = check_block(cols, block_size)
    if tuple(absmax.shape) != (rows, cols // block):
        raise ValueError(
            f"absmax must hold one scale per block, shape [{rows}, {cols // block}], got "
            f"{tuple(absmax.shape)}; pass the block_size the codes were made with."
        )
    return _scaled_levels(codes, absmax, block, dtype)


def _scaled_levels(codes: Tensor, absmax: Tensor, block: int, dtype: torch.dtype) -> Tensor:
    """absmax · level[code] without the checks (``NF4Tensor`` checks its codes once)."""
    rows, cols = codes.shape
    levels = NF4_LEVELS.to(device=codes.device, dtype=dtype)
    values = levels.index_select(0, codes.reshape(-1).int()).reshape(rows, -1, block)
    return (values * absmax.to(dtype)[..., None]).reshape(rows, cols)


def double_quantize(absmax: Tensor, block: int = DOUBLE_BLOCK) -> tuple[Tensor, Tensor, Tensor]:
    """(uint8 codes shaped like ``absmax``, float32 block maxima [ceil(n / block)], float32 step).

    The scales (finite, ≥ 0) in blocks of ``block`` (the last one may be shorter) on the log
    grid of the module docstring: code 0 for a zero scale, else 255 − round(log2(M / c) / h).
    """
    block = check_count(block, "block", fix="QLoRA uses 256")
    flat = absmax.detach().float().reshape(-1)
    check_finite(flat, "the block scales to quantize")
    if bool((flat < 0).any()):
        raise ValueError("block scales are absolute maxima, never negative; pass nf4_quantize's.")
    pad = -flat.numel() % block
    groups = F.pad(flat, (0, pad)).reshape(-1, block).double()
    maxima = groups.amax(-1)
    nonzero = groups > 0
    ratio = torch.where(  # log2(M / c) ≥ 0 of every non-zero scale; 0 for zeros and padding
        nonzero, maxima.clamp_min(1e-300).log2()[:, None] - groups.clamp_min(1e-300).log2(), 0.0
    )
    step = (ratio.amax() / (LOG_CODES - 1)).float()  # the widest block spans codes 1..255
    steps = ratio / step.double() if bool(step > 0) else torch.zeros_like(ratio)
    codes = (LOG_CODES - torch.round(steps)).clamp(1, LOG_CODES).masked_fill(~nonzero, 0)
    codes = codes.to(torch.uint8).reshape(-1)[: flat.numel()].reshape(absmax.shape)
    return codes, maxima.float(), step


def double_dequantize(
    codes: Tensor, maxima: Tensor, step: Tensor, block: int = DOUBLE_BLOCK
) -> Tensor:
    """The scales back from ``double_quantize``: M · 2^(−(255 − q) h), 0 for code 0; float32,
    shaped like ``codes``."""
    flat = codes.reshape(-1)
    if maxima.numel() != math.ceil(flat.numel() / block):
        raise ValueError(
            f"{flat.numel()} codes in blocks of {block} need {math.ceil(flat.numel() / block)} "
            f"block maxima, got {maxima.numel()}; pass the block double_quantize used."
        )
    per_code = maxima.double().repeat_interleave(block)[: flat.numel()]
    below = (LOG_CODES - flat.double()) * step.double()
    scales = torch.where(flat > 0, per_code * torch.exp2(-below), 0.0)
    return scales.float().reshape(codes.shape)


def bits_per_weight(block_size: int = 64, double: bool = True) -> float:
    """Storage per weight: 4 + 32 / block, or 4 + 8 / block + 32 / (block · 256) when double.

    The one step per tensor of double quantization is left out (it is 32 bits in all).
    """
    block = check_count(block_size, "block_size", fix="QLoRA uses 64")
    return 4 + (8 / block + 32 / (block * DOUBLE_BLOCK) if double else 32 / block)


def _block_scales(
    absmax: Tensor | None, codes: Tensor | None, maxima: Tensor | None, step: Tensor | None
) -> Tensor:
    """Plain ``absmax``, or the scales ``double_dequantize`` gives back when it is None."""
    if absmax is not None:
        return absmax
    assert codes is not None and maxima is not None and step is not None
    return double_dequantize(codes, maxima, step)


@dataclass
class NF4Tensor:
    """A weight in NF4: codes uint8 [rows, cols] and its block scales, plain or double-quantized.

    Plain: ``absmax`` float32 [rows, blocks]. Double: ``absmax_codes`` uint8 [rows, blocks],
    ``absmax_scales`` (the block maxima, float32) and ``absmax_step`` (``double_quantize``),
    ``absmax`` None.
    """

    codes: Tensor
    block_size: int
    absmax: Tensor | None = None
    absmax_codes: Tensor | None = None
    absmax_scales: Tensor | None = None
    absmax_step: Tensor | None = None

    def __post_init__(self) -> None:
        check_codes(self.codes)
        check_block(self.codes.shape[1], self.block_size)
        scales = self.absmax if self.absmax is not None else self.absmax_codes
        blocks = (self.codes.shape[0], self.codes.shape[1] // self.block_size)
        if scales is None or tuple(scales.shape) != blocks:
            raise ValueError(
                f"An NF4 weight {tuple(self.codes.shape)} in blocks of {self.block_size} needs "
                "one scale per block (absmax, or absmax_codes when double-quantized), got "
                f"{None if scales is None else tuple(scales.shape)}."
            )

    @classmethod
    def quantize(
        cls,
        w: Tensor,
        block_size: int = 64,
        double: bool = True,
        quantize_fn: QuantizeFn | None = None,
    ) -> NF4Tensor:
        """``w`` in NF4 (``quantize_fn`` replaces ``nf4_quantize`` when given)."""
        check_matrix(w)
        check_block(w.shape[1], block_size)
        codes, absmax = (quantize_fn or nf4_quantize)(w, block_size)
        if not double:
            return cls(codes, block_size, absmax=absmax.float())
        q, maxima, step = double_quantize(absmax)
        return cls(codes, block_size, absmax_codes=q, absmax_scales=maxima, absmax_step=step)

    @property
    def double(self) -> bool:
        return self.absmax is None

    def scales(self) -> Tensor:
        """The block scales [rows, blocks] (after the round trip when double-quantized)."""
        return _block_scales(self.absmax, self.absmax_codes, self.absmax_scales, self.absmax_step)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """ŵ [rows, cols] in ``dtype`` (the codes were checked when this tensor was made)."""
        return _scaled_levels(self.codes, self.scales(), self.block_size, dtype)

    def bits_per_weight(self) -> float:
        return bits_per_weight(self.block_size, self.double)


class NF4Linear(nn.Module):
    """y = x Ŵᵀ + b with Ŵ dequantized from frozen NF4 codes at every call (QLoRA's base)."""

    def __init__(self, weight: NF4Tensor, bias: Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.codes.shape
        self.block_size, self.double = weight.block_size, weight.double
        self.register_buffer("codes", weight.codes)
        for name in SCALE_FIELDS:
            self.register_buffer(name, getattr(weight, name))
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        block_size: int = 64,
        double: bool = True,
        quantize_fn: QuantizeFn | None = None,
    ) -> NF4Linear:
        """The NF4 version of ``linear`` (left unchanged); ``quantize_fn(w, block_size) ->
        (codes, absmax)`` replaces ``nf4_quantize`` when given."""
        nf4 = NF4Tensor.quantize(linear.weight.detach(), block_size, double, quantize_fn)
        return cls(nf4, linear.bias)

    def tensor(self) -> NF4Tensor:
        return NF4Tensor(self.codes, self.block_size, *(getattr(self, n) for n in SCALE_FIELDS))

    def dequantized(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """Ŵ [out, in] in ``dtype`` (the codes were checked when the layer was made)."""
        scales = _block_scales(*(getattr(self, n) for n in SCALE_FIELDS))
        return _scaled_levels(self.codes, scales, self.block_size, dtype)

    @property
    def weight(self) -> Tensor:
        """Ŵ [out, in], float32, dequantized anew (read-only: changing it changes nothing)."""
        return self.dequantized()

    def forward(self, x: Tensor) -> Tensor:
        device = x.device.type  # under autocast the product runs in its dtype: dequantize to it
        autocast = torch.is_autocast_enabled(device)
        dtype = torch.get_autocast_dtype(device) if autocast else x.dtype
        weight = self.dequantized(dtype)
        bias = None if self.bias is None else self.bias.to(weight.dtype)
        return F.linear(x, weight, bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"block_size={self.block_size}, double={self.double}"
        )


def nf4_vs_int4(w: Tensor, block_size: int = 64) -> dict[str, float]:
    """Mean squared error of NF4 and of symmetric absmax int4 RTN on the same blocks of ``w``.

    Both spend 4 bits a weight and one absmax scale per block; int4 rounds w / s to the integers
    -7..7 with s = absmax / 7. Returns ``nf4_mse``, ``int4_mse`` and ``ratio`` (nf4 / int4).
    """
    check_matrix(w)
    block = check_block(w.shape[1], block_size)
    w64 = w.detach().double()
    nf4 = nf4_dequantize(*nf4_quantize(w, block), block).double()
    int4 = fake_quantize(w.detach().float(), QuantSpec(bits=4, group_size=block)).double()
    nf4_mse = float((nf4 - w64).pow(2).mean())
    int4_mse = float((int4 - w64).pow(2).mean())
    return {"nf4_mse": nf4_mse, "int4_mse": int4_mse, "ratio": nf4_mse / int4_mse}
