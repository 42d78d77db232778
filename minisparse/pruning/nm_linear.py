"""A compact N:M sparse linear layer: only the kept weights and their positions are stored.

A weight W [out, in] that satisfies n:m along its inputs (at most n non-zeros in every group of
m consecutive inputs, ``masks.nm_mask``) is stored as

* ``values`` [out, in · n / m]: the kept weights of each row, group by group, in input order
  (float32, or int8 codes q with one float32 scale per row: w = scale_i · q);
* ``positions`` [out, ⌈in · n / (m · per_byte)⌉] uint8: per kept weight its index 0..m-1 within
  its group, in b bits (b = 2 for m ≤ 4, 4 for m ≤ 16), packed per_byte = 8 / b to a byte,
  the first value in the lowest bits.

So W_ij = values_{i, n·g + r} when j = m·g + positions_{i, n·g + r}, and 0 elsewhere.

Bytes for 2:4 per dense weight, against the same layer stored densely (``nbytes``):

* float32 values: (2·4 + 2·2/8) / 4 = 8.5 / 16 = **0.53125** of the float32 layer
  (4 bytes of value and 2 bits of position per kept weight: 0.5 + 0.03125);
* int8 values: (2·1 + 2·2/8) / 4 = 2.5 / 4 = **0.625** of the int8 codes (0.5 + 0.125), plus
  the same per-row scale as the dense int8 layer.

With 2 of 4 weights left, a decode step that reads every weight once reads about half the bytes;
the positions add 1/16 of a float32 layer's bytes, a quarter of the int8 codes' bytes.
(NVIDIA's sparse tensor cores store 2:4 the same way, with 2-bit indices: Mishra et al. 2021,
"Accelerating Sparse Deep Neural Networks".)

``to_nm_(model, targets, int8)`` swaps a model's projections whose weights are n:m for the
compact layer; ``minisparse.pruning.lowering`` teaches the compiled decode step to read it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core.model import Linear
from ..quant.tensor import QuantSpec, quantize_tensor
from .masks import check_pattern, nm_mask

__all__ = [
    "NM_TARGETS",
    "NMLinear",
    "nm_pattern_of",
    "pack_positions",
    "position_bits",
    "to_nm_",
    "unpack_positions",
]

#: The projections ``to_nm_`` swaps, by ``targets``.
NM_TARGETS = {
    "mlp": ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
    "all": (
        "attn.q_proj",
        "attn.k_proj",
        "attn.v_proj",
        "attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    ),
}


def position_bits(m: int) -> int:
    """Bits per stored position for groups of m: the smallest of 1, 2, 4, 8 with 2^b ≥ m."""
    for bits in (1, 2, 4, 8):
        if m <= 1 << bits:
            return bits
    raise ValueError(f"groups of m = {m} inputs need more than 8 bits a position; use m ≤ 256.")


def pack_positions(positions: Tensor, bits: int) -> Tensor:
    """[rows, k] positions (each < 2^bits) packed 8 / bits to a byte, the first in the lowest
    bits: [rows, ⌈k · bits / 8⌉] uint8 (a short last byte is padded with zeros)."""
    per = 8 // bits
    rows, k = positions.shape
    padded = torch.zeros(rows, -(-k // per) * per, dtype=torch.int32, device=positions.device)
    padded[:, :k] = positions.to(torch.int32)
    shifts = torch.arange(per, device=positions.device, dtype=torch.int32) * bits
    return (padded.view(rows, -1, per) << shifts).sum(-1).to(torch.uint8)


def unpack_positions(packed: Tensor, bits: int, k: int) -> Tensor:
    """The first k positions of each row of ``pack_positions``' bytes, [rows, k] int64."""
    per = 8 // bits
    shifts = torch.arange(per, device=packed.device, dtype=torch.int32) * bits
    fields = (packed.to(torch.int32)[..., None] >> shifts) & ((1 << bits) - 1)
    return fields.reshape(packed.shape[0], -1)[:, :k].long()


def _kept_and_stray(weight: Tensor, n: int, m: int) -> tuple[Tensor, int]:
    """The n:m mask of |W| and how many groups hold a non-zero outside it."""
    keep = nm_mask(weight.abs(), n, m)
    stray = weight.masked_fill(keep, 0).reshape(-1, m).ne(0).any(-1)
    return keep, int(stray.sum())


def nm_pattern_of(weight: Tensor, n: int, m: int) -> Tensor:
    """The kept-weight mask of ``weight`` [out, in] under n:m (``nm_mask`` of |W|), after
    checking that every weight outside it is zero; otherwise a ValueError naming the fix."""
    check_pattern(f"{n}:{m}", weight.shape[-1], "the weight")
    keep, stray = _kept_and_stray(weight, n, m)
    if stray:
        raise ValueError(
            f"The weight is not {n}:{m} sparse: {stray} group(s) of {m} consecutive inputs hold "
            f"more than {n} non-zeros. Prune it first, e.g. "
            f'minisparse.pruning.prune(model, pattern="{n}:{m}"), or zero the weights outside '
            f"masks.nm_mask(weight.abs(), {n}, {m})."
        )
    return keep


class NMLinear(nn.Module):
    """y = x Wᵀ + b for an n:m sparse W held as kept values and packed positions (module doc).

    Built from a linear layer whose weight already satisfies n:m along its inputs. ``int8``:
    the kept values as symmetric int8 codes with one float32 scale per row (round to nearest,
    the row's largest |value| at ±127). ``forward`` computes with ``dense_weight()``, the
    dense [out, in] weight (dequantized for int8): in torch it equals the masked dense layer;
    the compiled decode step reads the compact buffers (``minisparse.pruning.lowering``).
    """

    def __init__(self, linear: nn.Module, n: int = 2, m: int = 4, int8: bool = False) -> None:
        super().__init__()
        weight = linear.weight.detach()
        if weight.dim() != 2:
            raise ValueError(f"NMLinear needs a 2-D weight [out, in]; got {list(weight.shape)}.")
        out_features, in_features = weight.shape
        keep = nm_pattern_of(weight, n, m)
        self.in_features, self.out_features = in_features, out_features
        self.n, self.m, self.int8 = n, m, int8
        self.bits = position_bits(m)
        kept = in_features // m * n
        values = weight.float()[keep].view(out_features, kept)
        group_pos = torch.arange(m, device=weight.device).expand(out_features, in_features // m, m)
        positions = group_pos.reshape(out_features, in_features)[keep].view(out_features, kept)
        self.register_buffer("positions", pack_positions(positions, self.bits).contiguous())
        if int8:
            qt = quantize_tensor(values, QuantSpec(bits=8))
            self.register_buffer("values", qt.q.contiguous())
            self.register_buffer("scale", qt.scale.reshape(-1).float().contiguous())
        else:
            self.register_buffer("values", values.contiguous())
            self.register_buffer("scale", None)
        bias = linear.bias
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    @property
    def kept(self) -> int:
        """Kept weights per row: in · n / m."""
        return self.in_features // self.m * self.n

    def kept_values(self) -> Tensor:
        """The kept weights [out, in · n / m] as float32 (scale · q for int8)."""
        if self.scale is None:
            return self.values.float()
        return self.values.float() * self.scale[:, None]

    def columns(self) -> Tensor:
        """The input index of every kept weight, [out, in · n / m] int64."""
        pos = unpack_positions(self.positions, self.bits, self.kept)
        group = torch.arange(self.kept, device=pos.device) // self.n
        return group * self.m + pos

    def dense_weight(self) -> Tensor:
        """The weight the layer computes with, [out, in] float32, zeros where pruned."""
        w = torch.zeros(self.out_features, self.in_features, device=self.values.device)
        return w.scatter_(1, self.columns(), self.kept_values())

    def nbytes(self) -> int:
        """Bytes of the stored weight: values, packed positions and scales (not the bias)."""
        tensors = [self.values, self.positions] + ([] if self.scale is None else [self.scale])
        return sum(t.numel() * t.element_size() for t in tensors)

    def forward(self, x: Tensor) -> Tensor:
        w = self.dense_weight().to(x.dtype)
        return F.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"pattern={self.n}:{self.m}, int8={self.int8}"
        )


def _is_nm(weight: Tensor, n: int, m: int) -> bool:
    w = weight.detach()
    return w.dim() == 2 and w.shape[1] % m == 0 and _kept_and_stray(w, n, m)[1] == 0


def to_nm_(
    model: nn.Module, targets: str = "mlp", int8: bool = False, n: int = 2, m: int = 4
) -> nn.Module:
    """Swap the model's eligible projections for ``NMLinear`` in place; returns ``model``.

    ``targets``: "mlp" (gate, up, down of every block) or "all" (also q, k, v, o). Eligible: a
    plain linear layer (``nn.Linear`` or the core ``Linear``) whose weight is n:m along its
    inputs; the others stay as they are. A ValueError if no layer was eligible, naming the fix.
    """
    if targets not in NM_TARGETS:
        raise ValueError(f"targets must be one of {sorted(NM_TARGETS)}; got {targets!r}.")
    swapped = 0
    for layer in getattr(model, "layers", []):
        for path in NM_TARGETS[targets]:
            owner_path, _, name = path.rpartition(".")
            owner = layer.get_submodule(owner_path) if hasattr(layer, owner_path) else None
            lin = getattr(owner, name, None)
            if type(lin) not in (nn.Linear, Linear) or not _is_nm(lin.weight, n, m):
                continue
            setattr(owner, name, NMLinear(lin, n, m, int8))
            swapped += 1
    if not swapped:
        raise ValueError(
            f"No {targets} projection of the model holds {n}:{m} sparse weights; prune first, "
            f'e.g. minisparse.pruning.prune(model, pattern="{n}:{m}").'
        )
    return model
