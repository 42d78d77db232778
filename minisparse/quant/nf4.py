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

**Double quantization** quantizes those scales in turn: subtract their mean (one float per
tensor), cut them into blocks of 256 and store each as int8 with its own float32 absmax scale
(symmetric, round to nearest). The paper stores the second level as FP8; int8 is used here for
plainness, the same 8 bits. Cost: 4 + 8/64 + 32/(64 · 256) ≈ 4.127 bits a weight.

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
    if not isinstance(w, Tensor) or w.dim() != 2 or not w.is_floating_point():
        shape = tuple(w.shape) if isinstance(w, Tensor) else type(w).__name__
        raise ValueError(f"Expected a 2-D float weight [rows, cols], got {shape}.")
    check_finite(w, "the weight to quantize")


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
    rows, cols = codes.shape
    block = check_block(cols, block_size)
    if tuple(absmax.shape) != (rows, cols // block):
        raise ValueError(
            f"absmax must hold one scale per block, shape [{rows}, {cols // block}], got "
            f"{tuple(absmax.shape)}; pass the block_size the codes were made with."
        )
    levels = NF4_LEVELS.to(device=codes.device, dtype=dtype)
    values = levels.index_select(0, codes.reshape(-1).int()).reshape(rows, -1, block)
    return (values * absmax.to(dtype)[..., None]).reshape(rows, cols)


def double_quantize(absmax: Tensor, block: int = DOUBLE_BLOCK) -> tuple[Tensor, Tensor, Tensor]:
    """(int8 codes shaped like ``absmax``, float32 scales [ceil(n / block)], float32 mean).

    The scales minus their mean, in blocks of ``block`` (the last one may be shorter), each
    block stored as round(x / s) with s = max|x| / 127.
    """
    block = check_count(block, "block", fix="QLoRA uses 256")
    flat = absmax.detach().float().reshape(-1)
    mean = flat.mean()
    centred = flat - mean
    pad = -flat.numel() % block
    groups = F.pad(centred, (0, pad)).reshape(-1, block)
    scales = (groups.abs().amax(-1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    codes = torch.round(groups / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return codes.reshape(-1)[: flat.numel()].reshape(absmax.shape), scales, mean


def double_dequantize(
    codes: Tensor, scales: Tensor, mean: Tensor, block: int = DOUBLE_BLOCK
) -> Tensor:
    """The scales back from ``double_quantize``: codes · s + mean, float32, shaped like codes."""
    flat = codes.reshape(-1).float()
    if scales.numel() != math.ceil(flat.numel() / block):
        raise ValueError(
            f"{flat.numel()} codes in blocks of {block} need {math.ceil(flat.numel() / block)} "
            f"scales, got {scales.numel()}; pass the block double_quantize used."
        )
    per_code = scales.float().repeat_interleave(block)[: flat.numel()]
    return (flat * per_code + mean.float()).reshape(codes.shape)


def bits_per_weight(block_size: int = 64, double: bool = True) -> float:
    """Storage per weight: 4 + 32 / block, or 4 + 8 / block + 32 / (block · 256) when double.

    The one mean per tensor of double quantization is left out (it is 32 bits in all).
    """
    block = check_count(block_size, "block_size", fix="QLoRA uses 64")
    return 4 + (8 / block + 32 / (block * DOUBLE_BLOCK) if double else 32 / block)


@dataclass
class NF4Tensor:
    """A weight in NF4: codes uint8 [rows, cols] and its block scales, plain or double-quantized.

    Plain: ``absmax`` float32 [rows, blocks]. Double: ``absmax_codes`` int8 [rows, blocks],
    ``absmax_scales`` float32 and ``absmax_mean`` (``double_quantize``), ``absmax`` None.
    """

    codes: Tensor
    block_size: int
    absmax: Tensor | None = None
    absmax_codes: Tensor | None = None
    absmax_scales: Tensor | None = None
    absmax_mean: Tensor | None = None

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
        q, scales, mean = double_quantize(absmax)
        return cls(codes, block_size, absmax_codes=q, absmax_scales=scales, absmax_mean=mean)

    @property
    def double(self) -> bool:
        return self.absmax is None

    def scales(self) -> Tensor:
        """The block scales [rows, blocks] (after the round trip when double-quantized)."""
        if self.absmax is not None:
            return self.absmax
        assert self.absmax_codes is not None and self.absmax_scales is not None
        assert self.absmax_mean is not None
        return double_dequantize(self.absmax_codes, self.absmax_scales, self.absmax_mean)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        return nf4_dequantize(self.codes, self.scales(), self.block_size, dtype)

    def bits_per_weight(self) -> float:
        return bits_per_weight(self.block_size, self.double)


class NF4Linear(nn.Module):
    """y = x Ŵᵀ + b with Ŵ dequantized from frozen NF4 codes at every call (QLoRA's base)."""

    def __init__(self, weight: NF4Tensor, bias: Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.codes.shape
        self.block_size, self.double = weight.block_size, weight.double
        self.register_buffer("codes", weight.codes)
        for name in ("absmax", "absmax_codes", "absmax_scales", "absmax_mean"):
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
        names = ("absmax", "absmax_codes", "absmax_scales", "absmax_mean")
        return NF4Tensor(self.codes, self.block_size, *(getattr(self, n) for n in names))

    @property
    def weight(self) -> Tensor:
        """Ŵ [out, in], float32, dequantized anew (read-only: changing it changes nothing)."""
        return self.tensor().dequantize()

    def forward(self, x: Tensor) -> Tensor:
        device = x.device.type  # under autocast the product runs in its dtype: dequantize to it
        autocast = torch.is_autocast_enabled(device)
        dtype = torch.get_autocast_dtype(device) if autocast else x.dtype
        weight = self.tensor().dequantize(dtype)
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
