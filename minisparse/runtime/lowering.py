"""Lowering: how the compiled decode step runs each torch module, one registry per role.

The C step (``step.c``) reads the plain structs of ``minisparse.kernels.abi``. This module
turns the modules of a block into those structs and knows only the core model's own types
(``core``: ``Linear``, ``MLP``, ``Attention``, ``RMSNorm``, the Identity/ReLU slots, the
SiLU/ReLU/GELU activations). A technique that the C step can run declares, next to its own
Python, how (``lowers(role, its_type)``), registered by its *exact* type: a subclass, which may
compute something else, is not lowered until it registers too. The roles:

* ``"linear"``: a projection -> ``Mat`` (or None): float32 here, int8/int4 in ``quant.layers``;
* ``"slot"``: what a projection's input goes through -> ``Slot``: Identity/ReLU here, a
  magnitude threshold (TEAL, chapter 03) in ``sparsity.thresholds``;
* ``"activation"``: an MLP's ``act`` -> (ACT code, threshold or -1): CATS in ``sparsity``;
* ``"mlp"``: a block's MLP half -> ``MlpLayer`` or ``SparseMlpLayer``: the dense ``MLP`` here,
  ``SparseMLP`` (chapter 07) in ``sparse.lowering``;
* ``"selector"``: a sparse MLP's neuron selector -> its predictor's C fields (chapter 06, in
  ``predictors.lowering``).

Anything unregistered (or hooked) lowers to None, and ``minisparse.runtime.Decoder`` runs that
half as torch. The structs point into the modules' own tensors: nothing is copied, and what a
struct needs is kept alive in the ``keep`` list the caller holds. One exception: float32
projections whose input goes through a magnitude threshold are copied once, transposed and
bundled per input ([in, q + k + v] or [in, gate + up], ``mats``), so that the C step reads one
contiguous row per non-zero input for all of them and skips the rows of the zeros.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..core.memory import empty_huge
from ..core.model import MLP, Attention, Block, KVCache, Linear, RMSNorm, Transformer
from ..kernels.abi import ACT_CODES, FORMAT_CODES, AttnLayer, Mat, MlpLayer, Slot

__all__ = [
    "ROLES",
    "activation_of",
    "attn_layer",
    "global_hooks",
    "hooked",
    "lowered_types",
    "lowers",
    "mats",
    "mlp_layer",
    "plain_f32",
    "ptr",
    "scatters_inputs",
    "selector_of",
    "slot_of",
    "to_mat",
]

ROLES = ("linear", "slot", "activation", "mlp", "selector")
_REGISTRY: dict[str, dict[type, Callable[..., Any]]] = {role: {} for role in ROLES}


def lowers(role: str, cls: type) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: the function lowers modules of exactly type ``cls`` in ``role``."""
    if role not in ROLES:
        raise ValueError(f"Unknown lowering role {role!r}; use one of {ROLES}.")

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        _REGISTRY[role][cls] = fn
        return fn

    return register


def lowered_types(role: str) -> list[type]:
    """The types the C step knows in ``role`` so far (techniques register when imported)."""
    return list(_REGISTRY[role])


def _lower(role: str, obj: Any, *args: Any) -> Any:
    fn = _REGISTRY[role].get(type(obj))
    if fn is None or (isinstance(obj, nn.Module) and hooked(obj)):
        return None
    return fn(obj, *args)


def ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def hooked(*modules: nn.Module) -> bool:
    return any(m._forward_hooks or m._forward_pre_hooks for m in modules)


def global_hooks() -> bool:
    from torch.nn.modules import module as torch_module

    return bool(torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks)


def plain_f32(*tensors: Tensor | None) -> bool:
    """All given tensors are contiguous float32 CPU tensors (None counts as fine)."""
    return all(
        t is None or (t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous())
        for t in tensors
    )


def slot_of(module: nn.Module) -> Slot | None:
    """An activation slot as the C step applies it, or None for anything it does not know."""
    return _lower("slot", module)


def activation_of(module: nn.Module) -> tuple[int, float] | None:
    """(ACT code, threshold or -1) for an MLP's ``act``, or None."""
    return _lower("activation", module)


def to_mat(lin: nn.Module, keep: list[Tensor]) -> Mat | None:
    """The C view of a projection, or None when the C step cannot read it."""
    return _lower("linear", lin, keep)


def selector_of(select: Any) -> tuple[Any, ...] | None:
    """A sparse MLP selector's C fields (rank, pu, pu_bias, pv, pv_bias, relu, cutoff), or
    None when the C step cannot run it."""
    return _lower("selector", select)


@lowers("slot", nn.Identity)
def _identity(module: nn.Module) -> Slot:
    return Slot(0, -1.0)


@lowers("slot", nn.ReLU)
def _relu_slot(module: nn.Module) -> Slot:
    return Slot(1, -1.0)


@lowers("activation", nn.SiLU)
def _silu(module: nn.Module) -> tuple[int, float]:
    return ACT_CODES["silu"], -1.0


@lowers("activation", nn.ReLU)
def _relu(module: nn.Module) -> tuple[int, float]:
    return ACT_CODES["relu"], -1.0


@lowers("activation", nn.GELU)
def _gelu(module: nn.GELU) -> tuple[int, float] | None:
    return (ACT_CODES["gelu"], -1.0) if module.approximate == "none" else None


def _float32_linear(lin: nn.Linear, keep: list[Tensor]) -> Mat | None:
    if not plain_f32(lin.weight, lin.bias):
        return None
    return Mat(lin.weight.data_ptr(), None, 0, FORMAT_CODES["f32"])


lowers("linear", Linear)(_float32_linear)
lowers("linear", nn.Linear)(_float32_linear)


def scatters_inputs(slot: Slot, *lins: nn.Module) -> bool:
    """Read ``lins`` input-major: their input goes through a magnitude threshold (TEAL), which
    zeroes a share of the inputs, and their weights are float32."""
    return slot.threshold >= 0 and all(type(lin) in (Linear, nn.Linear) for lin in lins)


def mats(lins: Sequence[nn.Module], keep: list[Tensor], in_major: bool) -> list[Mat] | None:
    """The C views of projections that share one input, or None if one cannot be read.
    ``in_major``: one bundled transposed copy [in, sum of outs] made here once,
    [W_1^T | W_2^T | ...], so that C reads one contiguous row per non-zero input for all of
    them (and no row of a zero input)."""
    views = [to_mat(lin, keep) for lin in lins]
    if any(v is None for v in views):
        return None
    if not in_major:
        return views  # type: ignore[return-value]
    parts = [lin.weight.detach().t() for lin in lins]
    bundle = empty_huge((parts[0].shape[0], sum(t.shape[1] for t in parts)))  # 2 MB pages
    torch.cat(parts, dim=1, out=bundle)
    keep.append(bundle)
    offsets = [0]
    for lin in lins[:-1]:
        offsets.append(offsets[-1] + lin.weight.shape[0])
    step = bundle.element_size()
    f32 = FORMAT_CODES["f32"]
    return [Mat(bundle.data_ptr() + step * o, None, bundle.shape[1], f32) for o in offsets]


def attn_layer(
    layer: Block, cache: object, model: Transformer, keep: list[Tensor]
) -> AttnLayer | None:
    """The C description of a block's attention half, or None when torch must run it."""
    attn, c = layer.attn, model.config
    slot = slot_of(layer.attn_in_act)
    if (
        type(attn) is not Attention
        or type(layer.attn_norm) is not RMSNorm
        or hooked(attn, layer.attn_norm)
        or slot is None
        or type(cache) is not KVCache
        or cache.k.shape[0] != 1
        or not plain_f32(cache.k, cache.v, layer.attn_norm.weight, model.inv_freq)
    ):
        return None
    qkv = (attn.q_proj, attn.k_proj, attn.v_proj)
    views, out = mats(qkv, keep, scatters_inputs(slot, *qkv)), to_mat(attn.o_proj, keep)
    if views is None or out is None:
        return None
    return AttnLayer(
        c.dim,
        c.n_heads,
        c.n_kv_heads,
        c.head_dim,
        cache.max_seq_len,
        layer.attn_norm.eps,
        model.rope_scale,
        ptr(layer.attn_norm.weight),
        ptr(model.inv_freq),
        *views,
        out,
        *[ptr(p.bias) for p in (*qkv, attn.o_proj)],
        ptr(cache.k),
        ptr(cache.v),
        slot,
    )


def mlp_layer(layer: Block, keep: list[Tensor]) -> Any:
    """The C description of a block's MLP half (dense, or what a technique registered for its
    type), or None for torch."""
    norm = layer.mlp_norm
    slot = slot_of(layer.mlp_in_act)
    if type(norm) is not RMSNorm or hooked(norm) or slot is None or not plain_f32(norm.weight):
        return None
    return _lower("mlp", layer.mlp, norm, slot, keep)


@lowers("mlp", MLP)
def _dense_mlp(mlp: MLP, norm: RMSNorm, slot: Slot, keep: list[Tensor]) -> MlpLayer | None:
    act, down_in = activation_of(mlp.act), slot_of(mlp.down_in_act)
    if act is None or down_in is None:
        return None
    gate_up = (mlp.gate_proj, mlp.up_proj)
    views = mats(gate_up, keep, scatters_inputs(slot, *gate_up))
    down = mats([mlp.down_proj], keep, scatters_inputs(down_in, mlp.down_proj))
    if views is None or down is None:
        return None
    return MlpLayer(
        mlp.down_proj.out_features,
        mlp.gate_proj.out_features,
        norm.eps,
        ptr(norm.weight),
        *views,
        *down,
        *[ptr(p.bias) for p in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)],
        act[0],
        act[1],
        slot,
        down_in,
    )
