"""Quantization: fewer bits per weight, fewer bytes per token.

At batch 1 a decode step streams every weight once (chapter 00), so its time is about
bytes / bandwidth. Storing weights in 8 bits instead of 32 divides those bytes by 4, in 4 bits
by 8 — if the model still works, and if a kernel reads the low-bit weights directly.

**Uniform quantization.** A group of numbers x_1..x_g is stored as b-bit integer codes q_i and
one scale s (and, for the asymmetric form, one offset m):

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

**Activations** are quantized on the fly, per token (one scale per row of x) or per tensor.
Weight-and-activation quantization (W8A8) lets an int8 x int8 matmul do the work, but LLM
activations have a few channels with values 10-100x larger than the rest (Dettmers et al.,
2022), and they wreck the per-token grid. Three methods fix what plain round-to-nearest (RTN)
gets wrong; they live in their own modules and ``quantize_model`` runs them:

* **SmoothQuant** (Xiao et al., ICML 2023; ``minisparse.smoothing``): divide activation channel
  j by s_j = max|x_j|^α / max|W_:,j|^(1-α) and multiply weight column j by s_j. The product is
  unchanged, and the outliers migrate into the weights, which are easier to quantize.
* **AWQ** (Lin et al., MLSys 2024; ``minisparse.smoothing``): the same equivalent scaling, used
  for weight-only quantization: scaling up the columns that meet large activations protects the
  salient weights. s = mean|x|^α, with α picked by a grid search on the layer's output error,
  then a search of the clip ratio per group.
* **GPTQ** (Frantar et al., ICLR 2023; ``minisparse.gptq``): quantize W column by column and
  push each column's rounding error onto the columns not yet quantized, weighted by the inverse
  Hessian of the layer's squared output error, H = X^T X.

The scaling and the Hessian come from calibration text, layer by layer: each layer is measured
on the outputs of the layers before it *after* their quantization (as GPTQ and AWQ do).

**Execution.** ``quantize_model`` returns a model with fake-quantized weights (the dequantized
x̂ stored in float32, the reference for quality) or, with ``packed=True``, real low-bit layers
(``Int8Linear``, ``Int4Linear``) that keep only the codes and scales and call torch's CPU
kernels ``_weight_int8pack_mm`` and ``_weight_int4pack_mm_for_cpu``. Those kernels take
bfloat16 activations: with float32 activations the int8 one is several times slower than the
float32 matmul on the course's CPU, so the layers convert x to bfloat16 and back.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm

from .hooks import capture_inputs
from .model import Linear, Transformer, is_input_major
from .rope import rope_cos_sin

METHODS = ("rtn", "smoothquant", "awq", "gptq")
INT4_KERNEL_BLOCKS = (256, 128, 64, 32)  # group sizes the int4 CPU kernel accepts

# --------------------------------------------------------------------------------------------
# Tensors
# --------------------------------------------------------------------------------------------


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


def check_finite(x: Tensor, what: str) -> None:
    """Refuse NaN or inf values in ``x`` with one ValueError that says where they are."""
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        where = bad.nonzero()[0].tolist()
        raise ValueError(
            f"{what} holds {int(bad.sum())} NaN or inf value(s) (the first at index {where}); "
            "one of them would make its whole row or group NaN after quantization. Repair the "
            "weights first (reload the model, or torch.nan_to_num_ to zero them)."
        )


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


# --------------------------------------------------------------------------------------------
# Quantized layers
# --------------------------------------------------------------------------------------------


class ActQuantLinear(nn.Module):
    """A linear layer whose input is fake-quantized first (per token, or per tensor), for WxAy.

    y = linear(x̂) with x̂ = fake_quantize(x rows, ``spec``): what an integer matmul on quantized
    activations computes, up to the float32 accumulation.
    """

    def __init__(self, linear: nn.Module, spec: QuantSpec) -> None:
        super().__init__()
        self.linear, self.spec = linear, spec

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])  # NaN/inf activations stay NaN, as without quantization
        x_hat = ungrouped(fake_quantize_groups(grouped(flat, self.spec), self.spec), flat.shape)
        return self.linear(x_hat.to(x.dtype).view_as(x))


def target_device(fn: Callable[[Tensor], Tensor], current: torch.device) -> torch.device:
    """The device a ``Module._apply`` function sends tensors on ``current`` to (a probe's)."""
    return fn(torch.empty(0, device=current)).device


class PackedLinear(nn.Module):
    """Base of the low-bit layers: ``.to(dtype)`` leaves their codes and scales as they are.

    The kernels need their exact dtypes (int8/int32 codes, bfloat16 scales), so a cast of the
    model (``model.to(torch.bfloat16)``, ``model.double()``) changes only what the layer
    returns (it follows the input's dtype); a move to another device moves the buffers
    unchanged.
    """

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> PackedLinear:
        current = next(b.device for b in self._buffers.values() if b is not None)
        device = target_device(fn, current)
        self.check_device(device)
        for name, buffer in self._buffers.items():
            if buffer is not None:
                self._buffers[name] = buffer.to(device)
        self.fast = self.fast_on(device)
        return self

    def check_device(self, device: torch.device) -> None:
        """Raise when the layer cannot run on ``device``."""

    def fast_on(self, device: torch.device) -> bool:
        """Whether the CPU kernel serves this layer on ``device``."""
        return False


class Int8Linear(PackedLinear):
    """Weight-only int8 linear: codes q [out, in] and one symmetric scale per output channel.

    y = x (s q)^T + b. On a CPU it runs ``torch._weight_int8pack_mm`` on bfloat16 activations
    (the kernel reads int8 weights: a quarter of the float32 bytes) when the input size is a
    multiple of 16; otherwise, and off the CPU, it dequantizes W on the fly. Works for any
    number of rows (prefill and decode).
    """

    def __init__(self, qt: QuantizedTensor, bias: Tensor | None = None) -> None:
        super().__init__()
        spec = qt.spec
        if spec.bits != 8 or not spec.symmetric or spec.group_size is not None:
            raise ValueError(
                "The int8 kernel takes one symmetric scale per output channel: quantize with "
                "QuantSpec(bits=8, symmetric=True, group_size=None), or use Int4Linear for groups."
            )
        out_features, in_features = qt.shape
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("q", qt.q.contiguous())
        scale = qt.scale.expand(out_features, 1).reshape(-1).float().contiguous()
        self.register_buffer("scale", scale.to(torch.bfloat16))
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        self.fast = self.fast_on(self.q.device)

    def fast_on(self, device: torch.device) -> bool:
        return (  # the CPU kernel crashes on input sizes that are not multiples of 16
            device.type == "cpu"
            and hasattr(torch, "_weight_int8pack_mm")
            and self.in_features % 16 == 0
        )

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        """Round-to-nearest int8, one scale per output channel."""
        qt = quantize_tensor(linear.weight.detach().float(), QuantSpec(bits=8))
        return cls(qt, linear.bias)

    def dequantized(self) -> Tensor:
        """The weight the layer computes with, [out, in] float32 (scales rounded to bfloat16)."""
        return self.q.float() * self.scale.float()[:, None]

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, self.in_features)
        if self.fast and x.device.type == "cpu":
            y = torch._weight_int8pack_mm(flat.to(torch.bfloat16).contiguous(), self.q, self.scale)
        else:
            y = F.linear(flat, self.dequantized().to(x.dtype))
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fast={self.fast}"


def int4_kernel_block(group: int, cols: int, rows: int) -> int | None:
    """The block size for the int4 CPU kernel that represents groups of ``group`` exactly.

    The kernel needs out % 16 == 0 and blocks of 32/64/128/256 that divide the row; a block
    that divides the group length (and the row) carries the group's scale repeated. None when
    no block fits, or the kernel is missing.
    """
    if rows % 16 or not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return None
    for block in INT4_KERNEL_BLOCKS:
        if group % block == 0 and cols % block == 0:
            return block
    return None


class Int4Linear(PackedLinear):
    """Weight-only int4 linear from 4-bit codes with per-group (or per-channel) scales.

    On a CPU, when the shape allows (``int4_kernel_block``), the codes are packed two per byte
    by ``_convert_weight_to_int4pack_for_cpu`` and the product runs as
    ``_weight_int4pack_mm_for_cpu`` on bfloat16 activations. That kernel computes
    ŵ = (u - 8) * s + z for unsigned codes u in [0, 15]; our x̂ = s q + m becomes u = q + c
    (c = 8 for symmetric codes, 0 for asymmetric ones) and z = m + (8 - c) s. Otherwise the
    layer keeps the codes (one byte each) and the group parameters, and dequantizes W on the
    fly.
    """

    def __init__(self, qt: QuantizedTensor, bias: Tensor | None = None) -> None:
        super().__init__()
        spec = qt.spec
        if spec.bits != 4:
            raise ValueError(f"Int4Linear takes 4-bit codes, got {spec.bits} bits; use bits=4.")
        out_features, in_features = qt.shape
        self.in_features, self.out_features = in_features, out_features
        group = in_features if spec.per_tensor else spec.group_length(in_features)
        on_cpu = qt.q.device.type == "cpu"
        self.block = int4_kernel_block(group, in_features, out_features) if on_cpu else None
        self.fast = self.block is not None
        self.packed_for_cpu = self.fast  # the kernel's packed layout is the CPU's
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        if not self.fast:  # the codes and per-group parameters as they are
            self.spec = spec
            self.register_buffer("q", qt.q)
            self.register_buffer("scale", qt.scale.float())
            self.register_buffer("offset", None if qt.offset is None else qt.offset.float())
            return
        shift = 8 if spec.symmetric else 0
        codes = (qt.q.to(torch.int32) + shift).contiguous()
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1))
        starts = torch.arange(0, in_features, self.block, device=qt.q.device)
        scale = qt.columns(qt.scale)[:, starts].float()  # one per kernel block [out, blocks]
        offset = 0.0 if qt.offset is None else qt.columns(qt.offset)[:, starts].float()
        zero = offset + (8 - shift) * scale
        pairs = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()
        self.register_buffer("scales_and_zeros", pairs.to(torch.bfloat16))  # [blocks, out, 2]

    def check_device(self, device: torch.device) -> None:
        if self.packed_for_cpu and device.type != "cpu":
            raise ValueError(
                f"This int4 layer holds codes packed for the CPU kernel and cannot move to "
                f"{device}; quantize the model on {device.type} instead (quantize_model on a "
                "model already moved there)."
            )

    def fast_on(self, device: torch.device) -> bool:
        return self.packed_for_cpu and device.type == "cpu"

    def dequantized(self) -> Tensor:
        """The weight the layer computes with, [out, in] float32."""
        if not self.packed_for_cpu:
            return QuantizedTensor(self.q, self.scale, self.offset, self.spec).dequantize()
        eye = torch.eye(self.in_features, dtype=torch.bfloat16, device=self.packed.device)
        return self._kernel(eye).float().t()  # exact inputs, bfloat16 outputs

    def _kernel(self, flat: Tensor) -> Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            flat.to(torch.bfloat16).contiguous(), self.packed, self.block, self.scales_and_zeros
        )

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, self.in_features)
        if self.packed_for_cpu:
            y = self._kernel(flat)
        else:
            y = F.linear(flat, self.dequantized().to(x.dtype))
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"block={self.block}, fast={self.fast}"
        )


def packed_linear(qt: QuantizedTensor, bias: Tensor | None) -> nn.Module:
    """``Int8Linear`` for 8-bit codes, ``Int4Linear`` for 4-bit ones."""
    return Int8Linear(qt, bias) if qt.spec.bits == 8 else Int4Linear(qt, bias)


def set_weight(linear: nn.Linear, weight: Tensor) -> None:
    """Replace ``linear``'s weight values, keeping its memory layout (input-major or not)."""
    w = weight.to(linear.weight.dtype)
    linear.weight.data = w.t().contiguous().t() if is_input_major(linear.weight) else w.contiguous()


# --------------------------------------------------------------------------------------------
# Which linear layers read the same input (the unit of calibration)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LinearGroup:
    """Linear layers that read the same input, and the module whose output that input is.

    ``prev`` names the module that produces the input channel by channel, where per-channel
    scales can be folded: an RMSNorm (its weight) or a linear layer (its output rows). ``repeat``
    > 1 when each channel of ``prev`` feeds ``repeat`` input channels of the group (GQA: one
    value head serves several query heads, so o_proj's input repeats v_proj's channels per head).
    ``between`` names an optional activation slot between ``prev`` and the group, which must be
    an identity for a scale to fold through it.
    """

    name: str
    linears: tuple[str, ...]
    prev: str
    repeat: int = 1
    head_dim: int = 1
    between: tuple[str, ...] = ()


def block_groups(model: Transformer) -> list[LinearGroup]:
    """The four groups of a decoder layer, in the order AWQ visits them."""
    c = model.config
    return [
        LinearGroup(
            "qkv", ("attn.q_proj", "attn.k_proj", "attn.v_proj"), "attn_norm",
            between=("attn_in_act",),
        ),
        LinearGroup(
            "o", ("attn.o_proj",), "attn.v_proj", repeat=c.n_heads // c.n_kv_heads,
            head_dim=c.head_dim,
        ),
        LinearGroup(
            "gate_up", ("mlp.gate_proj", "mlp.up_proj"), "mlp_norm", between=("mlp_in_act",),
        ),
        LinearGroup("down", ("mlp.down_proj",), "mlp.up_proj", between=("mlp.down_in_act",)),
    ]  # fmt: skip


def untie_lm_head_(model: Transformer) -> Transformer:
    """Give ``model`` an LM head of its own, a copy of the tied embedding; in place, returns it.

    The embedding table keeps its values for the lookup; the config no longer ties them (so
    ``tie_weights`` cannot put the table back into the head).
    """
    if model.lm_head.weight is model.embed.weight:
        old = model.lm_head
        head = Linear(old.in_features, old.out_features, bias=False, device=old.weight.device)
        head.weight = nn.Parameter(old.weight.detach().clone(), requires_grad=False)
        set_weight(head, old.weight.detach())
        head.streaming = getattr(old, "streaming", False)
        model.lm_head = head
    model.config = dataclasses.replace(model.config, tie_embeddings=False)
    return model


untie_lm_head = untie_lm_head_  # the name before the in-place convention


# --------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class QuantConfig:
    """Everything ``quantize_model`` does (it builds one from its arguments and checks it)."""

    method: str = "rtn"
    bits: int = 8
    group_size: int | None = None
    symmetric: bool | None = None  # None: symmetric at 8 bits, asymmetric below
    act_bits: int | None = None  # W8A8: 8 (per-token, dynamic); None: weight-only
    act_per_tensor: bool = False
    lm_head: bool = True
    packed: bool = False
    alpha: float = 0.5  # SmoothQuant migration strength
    awq_grid: int = 20  # AWQ: alpha in {0, 1/n, ..., (n-1)/n}
    awq_clip: bool = True
    gptq_damp: float = 0.01  # GPTQ: lambda = damp * mean(diag H)
    gptq_block: int = 128

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"Unknown method {self.method!r}; use one of {METHODS}.")
        if self.method == "smoothquant" and self.act_bits is None:
            object.__setattr__(self, "act_bits", 8)
        if self.symmetric is None:
            object.__setattr__(self, "symmetric", self.bits == 8)
        QuantSpec(self.bits, self.group_size, bool(self.symmetric))  # checks bits, group_size
        if self.act_bits is not None:
            check_bits(self.act_bits, "act_bits")
        if self.packed:
            check_packable(self)
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1] (SmoothQuant uses 0.5), got {self.alpha}.")
        if self.awq_grid < 1 or self.gptq_block < 1:
            raise ValueError("awq_grid and gptq_block must be at least 1.")
        if self.gptq_damp <= 0:
            raise ValueError(f"gptq_damp must be > 0 (GPTQ uses 0.01), got {self.gptq_damp}.")

    @property
    def weight_spec(self) -> QuantSpec:
        return QuantSpec(bits=self.bits, group_size=self.group_size, symmetric=bool(self.symmetric))

    @property
    def act_spec(self) -> QuantSpec | None:
        if self.act_bits is None:
            return None
        return QuantSpec(bits=self.act_bits, symmetric=True, per_tensor=self.act_per_tensor)

    @property
    def calibrated(self) -> bool:
        return self.method != "rtn"

    def label(self) -> str:
        """A short name such as 'W4 g128 awq' or 'W8A8 smoothquant'."""
        w = f"W{self.bits}" + (f"A{self.act_bits}" if self.act_bits else "")
        g = "" if self.group_size is None else f" g{self.group_size}"
        return f"{w}{g} {self.method}"


def check_packable(config: QuantConfig) -> None:
    if config.bits not in (4, 8):
        raise ValueError(
            f"packed=True runs the int8 or int4 CPU kernels: use bits=8 or bits=4 (got "
            f"{config.bits}), or packed=False to fake-quantize at {config.bits} bits."
        )
    if config.act_bits is not None:
        raise ValueError(
            "packed=True is weight-only: drop act_bits, or use packed=False (fake quantization) "
            "for weight-and-activation quantization."
        )
    if config.bits == 8 and (config.group_size is not None or not config.symmetric):
        raise ValueError(
            "The int8 kernel takes one symmetric scale per output channel: use group_size=None "
            "and symmetric=True with bits=8, or bits=4 for grouped weights."
        )


def check_calibration(tokens: Tensor | None, method: str) -> Tensor:
    if tokens is None:
        raise ValueError(
            f"method {method!r} needs calibration text: pass calib_batches=token_batches("
            "tokenizer, corpus(split='calib'), 256, 8) (from minisparse.data)."
        )
    if tokens.dim() != 2 or tokens.dtype != torch.long:
        raise ValueError(
            f"calib_batches must be token ids [batch, seq] (torch.long), got "
            f"{tuple(tokens.shape)} {tokens.dtype}; use minisparse.data.token_batches."
        )
    return tokens


def quantize_model(
    model: Transformer,
    method: str = "rtn",
    bits: int = 8,
    group_size: int | None = None,
    calib_batches: Tensor | None = None,
    *,
    progress: bool = True,
    **options: object,
) -> Transformer:
    """A quantized copy of ``model`` (the input is left untouched).

    ``method``: ``"rtn"`` (round to nearest), ``"smoothquant"`` (W8A8 after smoothing),
    ``"awq"`` or ``"gptq"``; the last three need ``calib_batches`` [batch, seq] token ids.
    ``bits`` and ``group_size`` (None: one scale per output channel) set the weights' grid.
    Every linear layer of the decoder is quantized by ``method``; the LM head, the largest
    single matrix, is rounded to nearest in every method (the three papers leave it in 16 bits,
    and its 49k rows would dominate AWQ's search), or kept with ``lm_head=False``. A head tied
    to the embedding is untied first: the embedding table keeps its values for the lookup.
    Further ``options`` are the fields of ``QuantConfig``: ``symmetric``, ``act_bits`` (8 for
    W8A8, per-token; SmoothQuant's default), ``act_per_tensor``, ``packed`` (real int8/int4
    kernels instead of fake-quantized float32 weights), ``alpha``, ``awq_grid``, ``awq_clip``,
    ``gptq_damp``, ``gptq_block``. The copy carries its ``quant_config``. Weights holding NaN or
    inf are refused (a ValueError naming the layer): one would turn its whole row or group NaN.
    """
    unknown = set(options) - {f.name for f in dataclasses.fields(QuantConfig)}
    if unknown:
        raise TypeError(
            f"Unknown options {sorted(unknown)}; use fields of QuantConfig "
            f"({', '.join(f.name for f in dataclasses.fields(QuantConfig))})."
        )
    config = QuantConfig(method=method, bits=bits, group_size=group_size, **options)  # type: ignore[arg-type]
    tokens = check_calibration(calib_batches, method) if config.calibrated else None
    check_finite_weights(model)
    new = copy.deepcopy(model).eval()
    if config.lm_head:
        untie_lm_head_(new)
    with torch.no_grad():
        if tokens is None:
            quantize_rtn(new, config, progress)
        else:
            quantize_calibrated(new, config, tokens.to(new.device), progress)
    new.quant_config = config
    return new


def check_finite_weights(model: nn.Module) -> None:
    """Refuse a model whose linear or embedding weights hold NaN or inf, naming the first."""
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            check_finite(module.weight.detach(), f"{name}.weight")


def install(parent: nn.Module, name: str, qt: QuantizedTensor, config: QuantConfig) -> nn.Module:
    """Put the quantized weight ``qt`` in place of the linear layer ``parent.<name>``."""
    linear = parent.get_submodule(name)
    if config.packed:
        parent.set_submodule(name, packed_linear(qt, linear.bias))
    else:
        set_weight(linear, qt.dequantize())
        if config.act_spec is not None:
            parent.set_submodule(name, ActQuantLinear(linear, config.act_spec))
    return parent.get_submodule(name)


def quantize_rtn(model: Transformer, config: QuantConfig, progress: bool) -> None:
    """Round every linear layer's weight to the nearest grid point, independently."""
    spec = config.weight_spec
    for layer in tqdm(model.layers, desc=config.label(), disable=not progress):
        for group in block_groups(model):
            for name in group.linears:
                weight = layer.get_submodule(name).weight.detach().float()
                install(layer, name, quantize_tensor(weight, spec), config)
    if config.lm_head:
        quantize_head(model, config)


def group_inputs(
    parent: nn.Module, groups: list[LinearGroup], run: Callable[[], object]
) -> dict[str, Tensor]:
    """Each group's input rows [tokens, in] while ``run()`` runs ``parent`` (forward pre-hooks)."""
    first = {g.name: parent.get_submodule(g.linears[0]) for g in groups}
    with capture_inputs(first) as store:
        run()
    return {name: torch.cat([x.reshape(-1, x.shape[-1]) for x in xs]) for name, xs in store.items()}


#: Quantizes one decoder layer: (layer, its groups, each group's input rows) -> codes by name.
LayerHandler = Callable[
    [nn.Module, list[LinearGroup], dict[str, Tensor]], dict[str, QuantizedTensor]
]


def calibrate_layers(
    model: Transformer,
    tokens: Tensor,
    handle_layer: LayerHandler,
    config: QuantConfig,
    progress: bool = True,
) -> None:
    """Run ``handle_layer`` on every layer in turn, on the hidden states of the layers before it.

    Layer l sees the calibration tokens as transformed by layers 0..l-1 *after* their
    quantization, so it can correct for their errors (GPTQ and AWQ do the same). The hidden
    states of all calibration tokens are kept at one layer boundary only.
    """
    positions = torch.arange(tokens.shape[1], device=tokens.device)
    x = model.embed(tokens)
    cos, sin = rope_cos_sin(model.inv_freq, positions, x.dtype)
    cos, sin = cos * model.rope_scale, sin * model.rope_scale
    groups = block_groups(model)
    for layer in tqdm(model.layers, desc=config.label(), disable=not progress):
        inputs = group_inputs(layer, groups, lambda: layer(x, cos, sin, positions, None))  # noqa: B023
        for name, qt in handle_layer(layer, groups, inputs).items():
            install(layer, name, qt, config)
        x = layer(x, cos, sin, positions, None)


def quantize_calibrated(
    model: Transformer, config: QuantConfig, tokens: Tensor, progress: bool
) -> None:
    """SmoothQuant, AWQ or GPTQ on the decoder layers, then the LM head rounded to nearest."""
    from . import gptq, smoothing  # they build on this module's tensors and layers

    method = {
        "smoothquant": smoothing.smoothquant_layer,
        "awq": smoothing.awq_layer,
        "gptq": gptq.gptq_layer,
    }[config.method]
    calibrate_layers(model, tokens, lambda *args: method(*args, config), config, progress)
    if config.lm_head:
        quantize_head(model, config)


def quantize_head(model: Transformer, config: QuantConfig) -> None:
    """Round the LM head to nearest (every method does: see ``quantize_model``)."""
    weight = model.lm_head.weight.detach().float()
    install(model, "lm_head", quantize_tensor(weight, config.weight_spec), config)


# --------------------------------------------------------------------------------------------
# Sizes
# --------------------------------------------------------------------------------------------


def streamed_bytes(model: nn.Module) -> int:
    """Bytes a batch-1 decode step reads: every weight, code, scale and norm once.

    An embedding table that is not also the LM head is left out: the lookup reads one row.
    """
    head = getattr(model, "lm_head", None)
    head_weight = getattr(head, "weight", None)
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        if isinstance(module, nn.Embedding) and module.weight is not head_weight:
            seen.add(module.weight.data_ptr())
            continue
        tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        persistent = {
            id(b) for n, b in module.named_buffers(recurse=False)
            if n not in module._non_persistent_buffers_set
        }  # fmt: skip
        for t in tensors:
            if isinstance(t, nn.Parameter) or id(t) in persistent:
                if t.data_ptr() not in seen:
                    seen.add(t.data_ptr())
                    total += t.numel() * t.element_size()
    return total


__all__ = [
    "METHODS",
    "ActQuantLinear",
    "Int4Linear",
    "Int8Linear",
    "LinearGroup",
    "QuantConfig",
    "QuantSpec",
    "QuantizedTensor",
    "block_groups",
    "calibrate_layers",
    "dequantize_tensor",
    "fake_quantize",
    "fake_quantize_groups",
    "quant_params",
    "quantize_model",
    "quantize_tensor",
    "round_to_grid",
    "streamed_bytes",
]
