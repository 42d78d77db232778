"""Quantized linear layers: what runs on the codes of ``minisparse.quant.tensor``.

* ``ActQuantLinear`` fake-quantizes its input on the fly, per token (one scale per row of x) or
  per tensor, before a float matmul: what an int8 x int8 matmul computes for weight-and-
  activation quantization (W8A8), up to its float32 accumulation.
* ``Int8Linear`` and ``Int4Linear`` keep only the codes and scales of their weight and call
  torch's CPU kernels ``_weight_int8pack_mm`` and ``_weight_int4pack_mm_for_cpu``. Those kernels
  take bfloat16 activations: with float32 activations the int8 one is several times slower than
  the float32 matmul on the course's CPU, so the layers convert x to bfloat16 and back. Where a
  kernel does not apply (a shape it refuses, another device) they dequantize W on the fly.

``set_weight`` is the other way to install a quantized weight: its dequantized values x̂ written
into a plain float32 linear layer (fake quantization, the reference for quality).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core.model import is_input_major
from ..kernels.abi import FORMAT_CODES, Mat
from ..runtime.lowering import lowers, plain_f32
from .tensor import (
    QuantizedTensor,
    QuantSpec,
    fake_quantize_groups,
    grouped,
    quantize_tensor,
    ungrouped,
)

INT4_KERNEL_BLOCKS = (256, 128, 64, 32)  # group sizes the int4 CPU kernel accepts


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


def q4_blocks(codes: Tensor, scales_and_zeros: Tensor, block: int) -> Tensor:
    """The same 4-bit weights in the layout the compiled decode step reads, [out, in / 32, 20]
    uint8: per 32 weights of a row, the bfloat16 scale s and zero z of
    ŵ = (u - 8) s + z (4 bytes), then the 16 bytes of the codes u, byte q holding weight q in
    its low half and weight 16 + q in its high half (``minisparse/kernels/matvec.h``).

    ``codes`` [out, in] are the unsigned codes u in [0, 15]; ``scales_and_zeros`` [blocks, out,
    2] bfloat16 are the int4 kernel's, one pair per ``block`` inputs (a multiple of 32).
    """
    out, cols = codes.shape
    u = codes.to(torch.uint8).view(out, cols // 32, 2, 16)
    nibbles = u[:, :, 0] | (u[:, :, 1] << 4)  # [out, in / 32, 16]
    pairs = scales_and_zeros.transpose(0, 1).repeat_interleave(block // 32, dim=1)
    params = pairs.contiguous().view(torch.uint8)  # [out, in / 32, 4]: s, z as bfloat16 bytes
    return torch.cat([params, nibbles], dim=2).contiguous()


def q4_dequantize(blocks: Tensor) -> Tensor:
    """The float32 weight [out, in] of ``q4_blocks``: ŵ = (u - 8) s + z, exactly."""
    out, n_blocks, _ = blocks.shape
    params = blocks[:, :, :4].contiguous().view(torch.bfloat16).float()  # [out, in / 32, 2]
    packed = blocks[:, :, 4:]
    u = torch.stack([packed & 15, packed >> 4], dim=2).float()  # [out, in / 32, 2, 16]
    w = (u - 8) * params[:, :, 0, None, None] + params[:, :, 1, None, None]
    return w.reshape(out, n_blocks * 32)


class Int4Linear(PackedLinear):
    """Weight-only int4 linear from 4-bit codes with per-group (or per-channel) scales.

    On a CPU, when the shape allows (``int4_kernel_block``), the codes are packed two per byte
    by ``_convert_weight_to_int4pack_for_cpu`` and the product runs as
    ``_weight_int4pack_mm_for_cpu`` on bfloat16 activations. That kernel computes
    ŵ = (u - 8) * s + z for unsigned codes u in [0, 15]; our x̂ = s q + m becomes u = q + c
    (c = 8 for symmetric codes, 0 for asymmetric ones) and z = m + (8 - c) s. The kernel's
    packed layout is its own (tiled, an implementation detail of torch), so the layer also keeps
    the same codes and parameters in ``blocks`` (``q4_blocks``): what the compiled decode step
    reads, and what ``dequantized`` computes the weight from. A step reads one of the two
    copies (``duplicate_buffers``). Otherwise (no kernel) the layer keeps the codes (one byte
    each) and the group parameters, and dequantizes W on the fly.
    """

    duplicate_buffers = ("blocks",)  # the packed weights again, in a second layout
    #: True: multiply with activations rounded to int8 per 32 inputs (``q8_activations``), as
    #: the compiled step's integer dot products do (``int8_activations_``); False: float. The
    #: torch path then runs its usual product on the rounded activations (bfloat16 with the
    #: CPU kernel, as for int4), the compiled step exact integer sums scaled in float32.
    act_int8 = False

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
        self.register_buffer("blocks", q4_blocks(codes, self.scales_and_zeros, self.block))

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
        return q4_dequantize(self.blocks)

    def _kernel(self, flat: Tensor) -> Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            flat.to(torch.bfloat16).contiguous(), self.packed, self.block, self.scales_and_zeros
        )

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, self.in_features)
        if self.act_int8:  # the rounding the compiled step's integer dot products apply
            flat = q8_activations(flat).to(x.dtype)
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


def q8_activations(x: Tensor) -> Tensor:
    """x̂ = d q: each run of 32 values along the last axis rounded to int8 with its own scale
    d = max|x| / 127 (q = round(x / d), half to even; computed as x (1 / d) in float32, as
    the C step does). The reference of the compiled int4 x int8 product (``matvec.h``)."""
    if x.shape[-1] % 32:
        raise ValueError(f"int8 activations round runs of 32 inputs; got {x.shape[-1]} inputs.")
    blocks = x.float().reshape(*x.shape[:-1], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    return (torch.round(blocks * inv) * d).reshape(x.shape)


def int8_activations_(model: nn.Module) -> nn.Module:
    """Make every ``Int4Linear`` of ``model`` multiply with int8-rounded activations (in place;
    returns the model): llama.cpp's Q4 x Q8 arithmetic, integer dot products in the compiled
    step. An approximation of the float product: compare perplexities."""
    layers = [m for m in model.modules() if isinstance(m, Int4Linear)]
    if not layers:
        raise ValueError("The model has no Int4Linear layers; quantize it to int4 first.")
    for m in layers:
        if m.in_features % 32:
            raise ValueError(
                f"int8 activations need inputs in runs of 32; a layer has {m.in_features}."
            )
        m.act_int8 = True
    return model


def packed_linear(qt: QuantizedTensor, bias: Tensor | None) -> nn.Module:
    """``Int8Linear`` for 8-bit codes, ``Int4Linear`` for 4-bit ones."""
    return Int8Linear(qt, bias) if qt.spec.bits == 8 else Int4Linear(qt, bias)


def set_weight(linear: nn.Linear, weight: Tensor) -> None:
    """Replace ``linear``'s weight values, keeping its memory layout (input-major or not)."""
    w = weight.to(linear.weight.dtype)
    linear.weight.data = w.t().contiguous().t() if is_input_major(linear.weight) else w.contiguous()


@lowers("linear", Int8Linear)
def int8_mat(lin: Int8Linear, keep: list[Tensor]) -> Mat | None:
    """The compiled step reads int8 codes and widens them in registers, with float32 scales
    (the layer keeps bfloat16 ones for torch's kernel: a float32 copy is kept in ``keep``)."""
    q = lin.q
    if q.device.type != "cpu" or q.dtype != torch.int8 or not q.is_contiguous():
        return None
    if not plain_f32(lin.bias):
        return None
    scale = lin.scale.float().contiguous()
    keep.append(scale)
    return Mat(q.data_ptr(), scale.data_ptr(), 0, FORMAT_CODES["i8"])


@lowers("linear", Int4Linear)
def int4_mat(lin: Int4Linear, keep: list[Tensor]) -> Mat | None:
    """The compiled step reads the 4-bit blocks the CPU kernel's layout has, with float32 or
    int8-rounded activations (``act_int8``)."""
    if not lin.packed_for_cpu or lin.blocks.device.type != "cpu" or not plain_f32(lin.bias):
        return None
    return Mat(lin.blocks.data_ptr(), None, 0, FORMAT_CODES["q4_a8" if lin.act_int8 else "q4"])


__all__ = [
    "INT4_KERNEL_BLOCKS",
    "ActQuantLinear",
    "Int4Linear",
    "Int8Linear",
    "PackedLinear",
    "int4_kernel_block",
    "int8_activations_",
    "packed_linear",
    "q4_blocks",
    "q4_dequantize",
    "q8_activations",
    "set_weight",
    "target_device",
]
