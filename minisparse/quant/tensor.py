"""Uniform quantization of one tensor: integer codes on a grid, and the way back.

A group of numbers x_1..x_g is stored as b-bit integer codes q_i and one scale s (and, for the
asymmetric form, one offset m):

    symmetric    s = max|x| / Q,                 q = clamp(round(x / s), -Q, Q),  Q = 2^(b-1) - 1
                 x̂ = s q
    asymmetric   s = (max x - min x) / (2^b - 1),  q = clamp(round((x - m) / s), 0, 2^b - 1),
                 m = min x,   x̂ = s q + m

Every x in the group's range is rounded to the nearest grid point, so |x - x̂| <= s / 2: the
error is set by the range of the group, and one large value (an outlier) coarsens the grid of
all the others. The asymmetric form spends its 2^b levels on [min, max] (llama.cpp's Q4_1 and
torch's int4 CPU kernel store it this way, with a float offset); the symmetric one wastes half
of them when the values are one-signed, but needs no offset. A ``clip`` ratio r < 1 shrinks the
range to r times itself: values outside are clamped, those inside get a finer grid (AWQ's clip
search picks r).

**Granularity** (``QuantSpec``): one (s, m) per tensor, per output channel (a row of W [out,
in]) or per group of g consecutive inputs of a row. Smaller groups follow their own values'
range at a cost of 16 bits per scale (and offset): 4-bit weights in groups of 128 with fp16
scale and offset take 4 + 32/128 = 4.25 bits. When g does not divide the row, the last group is
shorter (SmolLM2's rows of 576 = 4 × 128 + 64).

This module is the bottom of the quantization stack: plain tensors in, codes and scales out
(``QuantizedTensor``), and ``fake_quantize`` for the values after a round trip. The layers that
run on the codes are in ``minisparse.quant.layers``, the methods that choose them in
``minisparse.quant.gptq`` and ``minisparse.quant.smoothing``, and
``minisparse.quant.quantize_model`` puts it all together.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..core.plain import check_finite


@dataclass(frozen=True)
class QuantSpec:
    """How a 2-D tensor [rows, cols] is quantized.

    ``group_size=None`` gives one scale per row (per output channel of a weight, per token of an
    activation); ``group_size=g`` one per g consecutive columns of a row; ``per_tensor=True``
    one for the whole tensor.
    """

    bits: int = 8
    group_size: int | None = None
    symmetric: bool = True
    per_tensor: bool = False

    def __post_init__(self) -> None:
        check_bits(self.bits, "bits")
        if self.group_size is not None and (
            isinstance(self.group_size, bool)
            or not isinstance(self.group_size, int)
            or self.group_size < 1
        ):
            raise ValueError(
                f"group_size must be a positive number of columns (e.g. 128) or None for one "
                f"scale per row, got {self.group_size!r}."
            )
        if self.per_tensor and self.group_size is not None:
            raise ValueError("per_tensor=True uses one scale for everything: set group_size=None.")

    @property
    def granularity(self) -> str:
        if self.per_tensor:
            return "tensor"
        return "channel" if self.group_size is None else f"group {self.group_size}"

    @property
    def qmin(self) -> int:
        return -(2 ** (self.bits - 1) - 1) if self.symmetric else 0

    @property
    def qmax(self) -> int:
        return 2 ** (self.bits - 1) - 1 if self.symmetric else 2**self.bits - 1

    def group_length(self, cols: int) -> int:
        """Columns per group for rows of ``cols`` columns (the whole row unless grouped)."""
        if self.group_size is None:
            return cols
        if self.group_size > cols:
            raise ValueError(
                f"group_size {self.group_size} is larger than the rows ({cols} columns); use a "
                f"group size of at most {cols}, or group_size=None for one scale per row."
            )
        return self.group_size

    def bits_per_weight(self, cols: int, scale_bits: int = 16) -> float:
        """Storage per value, scales (and offsets) included, for rows of ``cols`` columns."""
        groups = 1 if self.per_tensor else math.ceil(cols / self.group_length(cols))
        per_group = scale_bits * (1 if self.symmetric else 2)
        return self.bits + (0.0 if self.per_tensor else per_group * groups / cols)


def check_bits(bits: object, name: str) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 2 <= bits <= 8:
        raise ValueError(
            f"{name} must be a whole number of bits from 2 to 8 (8 for int8, 4 for int4), "
            f"got {bits!r}."
        )
    return bits


@dataclass
class QuantizedTensor:
    """Integer codes ``q`` [rows, cols] with per-group ``scale`` (and ``offset``) [rows, groups].

    x̂ = scale * q + offset, each group's parameters repeated over its columns. Per channel the
    parameters are [rows, 1], per tensor [1, 1].
    """

    q: Tensor
    scale: Tensor
    offset: Tensor | None
    spec: QuantSpec

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def columns(self, params: Tensor) -> Tensor:
        """Per-group parameters [rows, groups] spread over the columns: [rows, cols]."""
        cols = self.q.shape[1]
        if self.spec.per_tensor or self.spec.group_size is None:
            return params.expand(self.q.shape[0], cols)
        return params.repeat_interleave(self.spec.group_size, dim=1)[:, :cols]

    def rows(self, start: int, end: int) -> QuantizedTensor:
        """Rows start..end-1 (a per-row or per-group quantization splits by rows exactly)."""
        if self.spec.per_tensor:
            raise ValueError("A per-tensor quantization shares one scale: it has no row slices.")
        offset = None if self.offset is None else self.offset[start:end]
        return QuantizedTensor(self.q[start:end], self.scale[start:end], offset, self.spec)

    def dequantize(self) -> Tensor:
        x = self.q.to(self.scale.dtype) * self.columns(self.scale)
        return x if self.offset is None else x + self.columns(self.offset)

    def storage_bits(self, scale_bits: int = 16) -> int:
        """Bits to store the codes and the (16-bit) scales and offsets."""
        n_params = self.scale.numel() * (1 if self.offset is None else 2)
        return self.spec.bits * self.q.numel() + scale_bits * n_params


def grouped(x: Tensor, spec: QuantSpec) -> Tensor:
    """``x`` [rows, cols] as [rows, groups, group length] (per tensor: [1, 1, rows * cols]).

    A short last group is padded by repeating its last column, which leaves its min and max
    (and so its scale) unchanged; ``ungrouped`` drops the padding again.
    """
    if x.dim() != 2:
        raise ValueError(f"Expected a 2-D tensor [rows, cols], got shape {tuple(x.shape)}.")
    if spec.per_tensor:
        return x.reshape(1, 1, -1)
    rows, cols = x.shape
    g = spec.group_length(cols)
    pad = -cols % g
    if pad:
        x = torch.cat([x, x[:, -1:].expand(rows, pad)], dim=1)
    return x.reshape(rows, -1, g)


def ungrouped(x: Tensor, shape: torch.Size | tuple[int, int]) -> Tensor:
    """Inverse of ``grouped``: back to [rows, cols], padding dropped."""
    rows, cols = shape
    return x.reshape(rows, -1)[:, :cols]


def quant_params(
    groups: Tensor, spec: QuantSpec, clip: Tensor | float = 1.0
) -> tuple[Tensor, Tensor | None]:
    """Scale (and offset) [rows, groups] of ``groups`` [rows, groups, g].

    ``clip`` (one ratio, or one per group) limits the range to c = clip * max|x| (AWQ's clip).
    Symmetric: s = c / Q. Asymmetric: the range [max(min x, -c), min(max x, c)], s = its width
    / (2^b - 1), m = its lower end. A zero range gets a tiny scale, so an all-equal group is
    stored exactly.
    """
    tiny = torch.finfo(groups.dtype).tiny / torch.finfo(groups.dtype).eps
    if spec.symmetric:
        scale = groups.abs().amax(-1) * clip / spec.qmax
        return scale.clamp_min(tiny), None
    lo, hi = groups.amin(-1), groups.amax(-1)
    if not (isinstance(clip, float) and clip == 1.0):
        limit = torch.maximum(-lo, hi) * clip
        lo, hi = torch.maximum(lo, -limit), torch.minimum(hi, limit)
    return ((hi - lo) / spec.qmax).clamp_min(tiny), lo


def round_to_grid(x: Tensor, scale: Tensor, offset: Tensor | None, spec: QuantSpec) -> Tensor:
    """Integer codes of ``x`` on the grid (``scale``, ``offset`` broadcast against ``x``)."""
    shifted = x if offset is None else x - offset
    return torch.round(shifted / scale).clamp(spec.qmin, spec.qmax)


def code_dtype(spec: QuantSpec) -> torch.dtype:
    return torch.int8 if spec.symmetric else torch.uint8


def quantize_tensor(
    x: Tensor, spec: QuantSpec = QuantSpec(), clip: Tensor | float = 1.0
) -> QuantizedTensor:
    """Round-to-nearest quantization of ``x`` [rows, cols] (see the module docstring).

    ``clip`` is one ratio, or one per group [rows, groups] (AWQ's clip search). NaN or inf in
    ``x`` is refused: it would make its whole group's scale, and so every value of the group,
    NaN.
    """
    check_finite(x, "the tensor to quantize")
    groups = grouped(x, spec)
    scale, offset = quant_params(groups, spec, clip)
    q = round_to_grid(groups, scale[..., None], None if offset is None else offset[..., None], spec)
    q = ungrouped(q, x.shape).to(code_dtype(spec))
    return QuantizedTensor(q=q, scale=scale, offset=offset, spec=spec)


def fake_quantize_groups(groups: Tensor, spec: QuantSpec, clip: Tensor | float = 1.0) -> Tensor:
    """Round trip of grouped values [rows, groups, g] through the grid, kept grouped."""
    scale, offset = quant_params(groups, spec, clip)
    offset = None if offset is None else offset[..., None]
    x_hat = round_to_grid(groups, scale[..., None], offset, spec) * scale[..., None]
    return x_hat if offset is None else x_hat + offset


def dequantize_tensor(qt: QuantizedTensor) -> Tensor:
    """x̂ = scale * q + offset, in the dtype of the scales."""
    return qt.dequantize()


def fake_quantize(x: Tensor, spec: QuantSpec, clip: Tensor | float = 1.0) -> Tensor:
    """dequantize(quantize(x)): the values ``x`` takes after a round trip through b bits."""
    return quantize_tensor(x, spec, clip).dequantize().to(x.dtype)


__all__ = [
    "QuantSpec",
    "QuantizedTensor",
    "check_bits",
    "code_dtype",
    "dequantize_tensor",
    "fake_quantize",
    "fake_quantize_groups",
    "grouped",
    "quant_params",
    "quantize_tensor",
    "round_to_grid",
    "ungrouped",
]
