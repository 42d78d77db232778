"""The C decode step's view of a model: one ctypes description per block half.

``minisparse/kernels/decode_step.c`` reads plain structs: a matrix is a pointer with its row
count and element type (float32; int8 codes with one float32 scale per row, per column for
a sparse MLP's transposed down projection, whose scales are per output; or 4-bit blocks of 32
weights with their own scale and zero), an activation slot is a kind (identity, ReLU,
magnitude threshold) and a threshold, and a block half is the pointers of its norm, projections
and biases. This module builds those structs from the torch modules the course uses
(``Linear``, ``Int8Linear``, ``Int4Linear``, ``MLP``, ``SparseMLP`` with a threshold or a
chapter 06 predictor), and returns None for anything the C step does not know, so that
``minisparse.decode.Decoder`` runs that half as torch instead. The structs point into the
modules' own tensors: nothing is copied, and the tensors a struct needs are kept alive in the
``keep`` list the caller holds. One exception: float32 projections whose input goes through a
magnitude threshold (TEAL, chapter 03) are copied once, transposed and bundled per input
([in, q + k + v] or [in, gate + up], ``mats``), so that the C step reads one contiguous row per
non-zero input for all of them and skips the rows of the zeros.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from .kernels.cpu import load_source_library
from .model import MLP, Attention, Block, KVCache, Linear, RMSNorm, Transformer
from .quant import Int4Linear, Int8Linear
from .sparse_mlp import SparseMLP
from .sparsity import MagnitudeThreshold

__all__ = [
    "ACT_CODES",
    "MAX_TOKENS",
    "AttnLayer",
    "Mat",
    "MlpLayer",
    "Slot",
    "SparseMlpLayer",
    "activation_of",
    "attn_layer",
    "declare_step_library",
    "decode_library",
    "global_hooks",
    "hooked",
    "linear_ok",
    "mat",
    "mats",
    "mlp_layer",
    "plain_f32",
    "predictor_of",
    "skips_zeros",
    "slot_of",
    "sparse_mlp_layer",
]

ACT_CODES = {"silu": 0, "relu": 1, "gelu": 2}
MAX_TOKENS = 8  # as in decode_step.c: the most tokens one forward call takes


class Slot(ctypes.Structure):
    _fields_ = [("relu", ctypes.c_int32), ("threshold", ctypes.c_float)]


_f = ctypes.POINTER(ctypes.c_float)
_i64, _flt, _i32 = ctypes.c_int64, ctypes.c_float, ctypes.c_int32


class Mat(ctypes.Structure):
    """A weight matrix for C: float32 data (scale NULL), int8 codes and float32 row scales, or
    (``q4`` = 1) an ``Int4Linear``'s 4-bit blocks; ``in_stride`` > 0: a float32 transpose, one
    row per input, rows ``in_stride`` floats apart (bundled with the other projections of the
    same input), read only at non-zero inputs."""

    _fields_ = [
        ("data", ctypes.c_void_p),
        ("scale", ctypes.c_void_p),
        ("in_stride", _i64),
        ("q4", _i64),
    ]


class AttnLayer(ctypes.Structure):
    _fields_ = [
        *[(n, _i64) for n in ("dim", "n_heads", "n_kv_heads", "head_dim", "max_seq")],
        ("eps", _flt),
        ("rope_scale", _flt),
        *[(n, ctypes.c_void_p) for n in ("norm", "inv_freq")],
        *[(n, Mat) for n in ("wq", "wk", "wv", "wo")],
        *[(n, ctypes.c_void_p) for n in ("bq", "bk", "bv", "bo", "k_cache", "v_cache")],
        ("input", Slot),
    ]


class MlpLayer(ctypes.Structure):
    _fields_ = [
        ("dim", _i64),
        ("ffn", _i64),
        ("eps", _flt),
        ("norm", ctypes.c_void_p),
        *[(n, Mat) for n in ("wg", "wu", "wd")],
        *[(n, ctypes.c_void_p) for n in ("bg", "bu", "bd")],
        ("act", _i32),
        ("act_threshold", _flt),
        ("input", Slot),
        ("down_in", Slot),
    ]


class SparseMlpLayer(ctypes.Structure):
    _fields_ = [
        ("dim", _i64),
        ("ffn", _i64),
        ("rank", _i64),
        ("eps", _flt),
        ("norm", ctypes.c_void_p),
        *[(n, Mat) for n in ("wg", "wu", "wd_t")],  # wd_t's int8 scales: one per output
        ("act", _i32),
        ("input", Slot),
        ("threshold", _flt),
        *[(n, ctypes.c_void_p) for n in ("pu", "pu_bias", "pv", "pv_bias")],
        ("predictor_relu", _i32),
        ("cutoff", _flt),
    ]


def declare_step_library(lib: ctypes.CDLL) -> None:
    p, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.attn_scratch.argtypes, lib.attn_scratch.restype = [i64] * 5 + [c_int], i64
    lib.mlp_scratch.argtypes, lib.mlp_scratch.restype = [i64, i64, c_int], i64
    lib.sparse_mlp_scratch.argtypes = [i64, i64, i64, c_int]
    lib.sparse_mlp_scratch.restype = i64
    lib.attn_step.argtypes, lib.attn_step.restype = [p, p, i64, i64, p, c_int], c_int
    lib.mlp_step.argtypes, lib.mlp_step.restype = [p, p, i64, p, c_int], c_int
    lib.sparse_mlp_step.argtypes, lib.sparse_mlp_step.restype = [p, p, i64, p, c_int], i64
    lib.lm_head_step.argtypes = [p, i64, p, ctypes.c_float, ctypes.POINTER(Mat), i64, i64, p, p]
    lib.lm_head_step.argtypes.append(c_int)
    lib.lm_head_step.restype = c_int


@functools.lru_cache(maxsize=1)
def decode_library() -> ctypes.CDLL | None:
    """The compiled decode step, or None without a C compiler (one warning, from ``cpu``)."""
    return load_source_library("decode_step.c", declare_step_library)


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def hooked(*modules: nn.Module) -> bool:
    return any(m._forward_hooks or m._forward_pre_hooks for m in modules)


def global_hooks() -> bool:
    from torch.nn.modules import module as torch_module

    return bool(torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks)


def slot_of(module: nn.Module) -> Slot | None:
    """An activation slot as the C step applies it (Identity, ReLU, a magnitude threshold on
    either), or None for anything else."""
    if hooked(module):
        return None
    if isinstance(module, MagnitudeThreshold):
        inner = slot_of(module.inner)
        if inner is None or inner.threshold >= 0:
            return None
        return Slot(inner.relu, module.threshold)
    if type(module) is nn.Identity:
        return Slot(0, -1.0)
    if type(module) is nn.ReLU:
        return Slot(1, -1.0)
    return None


def activation_of(module: nn.Module) -> tuple[int, float] | None:
    """(ACT code, threshold or -1) for an MLP's ``act``: SiLU/ReLU/exact GELU, optionally inside a
    ``MagnitudeThreshold`` (CATS on the gate); None for anything else."""
    if hooked(module):
        return None
    threshold = -1.0
    if isinstance(module, MagnitudeThreshold):
        module, threshold = module.inner, module.threshold
        if hooked(module):
            return None
    if type(module) is nn.SiLU:
        return ACT_CODES["silu"], threshold
    if type(module) is nn.ReLU:
        return ACT_CODES["relu"], threshold
    if type(module) is nn.GELU and module.approximate == "none":
        return ACT_CODES["gelu"], threshold
    return None


def plain_f32(*tensors: Tensor | None) -> bool:
    """All given tensors are contiguous float32 CPU tensors (None counts as fine)."""
    return all(
        t is None or (t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous())
        for t in tensors
    )


def linear_ok(lin: nn.Module) -> bool:
    """A projection the C step reads: a float32 ``nn.Linear``, or a weight-only ``Int8Linear``
    or ``Int4Linear`` (the latter when it holds 4-bit blocks: it had the CPU kernel)."""
    if hooked(lin):
        return False
    if type(lin) in (Linear, nn.Linear):
        return plain_f32(lin.weight, lin.bias)
    if type(lin) is Int4Linear:
        return lin.packed_for_cpu and lin.blocks.device.type == "cpu" and plain_f32(lin.bias)
    return (
        type(lin) is Int8Linear
        and lin.q.device.type == "cpu"
        and lin.q.dtype == torch.int8
        and lin.q.is_contiguous()
        and plain_f32(lin.bias)
    )


def mat(lin: nn.Module, keep: list[Tensor]) -> Mat:
    """The C view of a projection accepted by ``linear_ok``; ``keep`` holds what it points to."""
    if type(lin) is Int4Linear:
        return Mat(lin.blocks.data_ptr(), None, 0, 1)
    if type(lin) is not Int8Linear:
        return Mat(lin.weight.data_ptr(), None, 0)
    scale = lin.scale.float().contiguous()  # the layer keeps bfloat16 scales for torch's kernel
    keep.append(scale)
    return Mat(lin.q.data_ptr(), scale.data_ptr(), 0)


def skips_zeros(slot: Slot, *lins: nn.Module) -> bool:
    """Read ``lins`` input-major: their input goes through a magnitude threshold (TEAL), which
    zeroes a share of the inputs, and their weights are float32."""
    return slot.threshold >= 0 and all(type(lin) in (Linear, nn.Linear) for lin in lins)


def mats(lins: Sequence[nn.Module], keep: list[Tensor], in_major: bool) -> list[Mat]:
    """The C views of projections that share one input. ``in_major``: one bundled transposed
    copy [in, sum of outs] made here once, [W_1^T | W_2^T | ...], so that C reads one contiguous
    row per non-zero input for all of them (and no row of a zero input)."""
    if not in_major:
        return [mat(lin, keep) for lin in lins]
    bundle = torch.cat([lin.weight.detach().t() for lin in lins], dim=1).contiguous()
    keep.append(bundle)
    offsets = [0]
    for lin in lins[:-1]:
        offsets.append(offsets[-1] + lin.weight.shape[0])
    step = bundle.element_size()
    return [Mat(bundle.data_ptr() + step * o, None, bundle.shape[1]) for o in offsets]


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
        or not all(linear_ok(p) for p in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj))
        or type(cache) is not KVCache
        or cache.k.shape[0] != 1
        or not plain_f32(cache.k, cache.v, layer.attn_norm.weight, model.inv_freq)
    ):
        return None
    qkv = (attn.q_proj, attn.k_proj, attn.v_proj)
    return AttnLayer(
        c.dim,
        c.n_heads,
        c.n_kv_heads,
        c.head_dim,
        cache.max_seq_len,
        layer.attn_norm.eps,
        model.rope_scale,
        _ptr(layer.attn_norm.weight),
        _ptr(model.inv_freq),
        *mats(qkv, keep, skips_zeros(slot, *qkv)),
        mat(attn.o_proj, keep),
        *[_ptr(p.bias) for p in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)],
        _ptr(cache.k),
        _ptr(cache.v),
        slot,
    )


def mlp_layer(layer: Block, keep: list[Tensor]) -> MlpLayer | SparseMlpLayer | None:
    """The C description of a block's MLP half (dense or sparse), or None for torch."""
    mlp, norm = layer.mlp, layer.mlp_norm
    slot = slot_of(layer.mlp_in_act)
    if type(norm) is not RMSNorm or hooked(norm, mlp) or slot is None or not plain_f32(norm.weight):
        return None
    if type(mlp) is SparseMLP:
        return sparse_mlp_layer(mlp, norm, slot)
    if type(mlp) is not MLP:
        return None
    act, down_in = activation_of(mlp.act), slot_of(mlp.down_in_act)
    projections = (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    if act is None or down_in is None or not all(linear_ok(p) for p in projections):
        return None
    gate_up = (mlp.gate_proj, mlp.up_proj)
    return MlpLayer(
        mlp.down_proj.out_features,
        mlp.gate_proj.out_features,
        norm.eps,
        _ptr(norm.weight),
        *mats(gate_up, keep, skips_zeros(slot, *gate_up)),
        *mats([mlp.down_proj], keep, skips_zeros(down_in, mlp.down_proj)),
        *[_ptr(p.bias) for p in projections],
        act[0],
        act[1],
        slot,
        down_in,
    )


def predictor_of(mlp: SparseMLP) -> nn.Module | None:
    """The ``Predictor`` behind a SparseMLP's ``select`` when it is ``Predictors.select`` of
    one layer (what ``sparsify(model, select=predictors.select)`` makes), else None."""
    from .predictors import Predictor, Predictors

    select = mlp.select
    if not isinstance(select, functools.partial) or len(select.args) != 1 or select.keywords:
        return None
    owner = getattr(select.func, "__self__", None)
    if not isinstance(owner, Predictors) or select.func.__func__ is not Predictors.select:
        return None
    if owner.lookahead:
        return None
    predictor = owner.neurons[select.args[0]]
    if type(predictor) is not Predictor or hooked(predictor, predictor.down, predictor.up):
        return None
    return predictor


def sparse_weights(mlp: SparseMLP) -> list[Mat] | None:
    """The C views of a SparseMLP's gate, up and down_t: float32 rows, or int8 codes with
    float32 scales (per neuron for gate and up, per output channel for down_t); None when the
    buffers are not in a layout the C step reads."""
    if not mlp.int8:
        weights = (mlp.W_gate, mlp.W_up, mlp.W_down_t)
        return [Mat(w.data_ptr(), None, 0) for w in weights] if plain_f32(*weights) else None
    codes, scales = (mlp.Q_gate, mlp.Q_up, mlp.Q_down_t), (mlp.s_gate, mlp.s_up, mlp.s_down)
    if not all(
        q.device.type == "cpu" and q.dtype == torch.int8 and q.is_contiguous() for q in codes
    ) or not plain_f32(*scales):
        return None
    return [Mat(q.data_ptr(), s.data_ptr(), 0) for q, s in zip(codes, scales, strict=True)]


def sparse_mlp_layer(mlp: SparseMLP, norm: RMSNorm, slot: Slot) -> SparseMlpLayer | None:
    act = activation_of(mlp.act)
    weights = sparse_weights(mlp)
    if act is None or act[1] >= 0 or weights is None:
        return None
    ffn, dim = (mlp.Q_down_t if mlp.int8 else mlp.W_down_t).shape
    common = (dim, ffn)
    if mlp.threshold is not None:
        return SparseMlpLayer(
            *common, 0, norm.eps, _ptr(norm.weight), *weights,
            act[0], slot, mlp.threshold, None, None, None, None, 0, 0.0,
        )  # fmt: skip
    predictor = predictor_of(mlp)
    if predictor is None:
        return None
    down, up = predictor.down, predictor.up
    if not plain_f32(down.weight, down.bias, up.weight, up.bias) or up.bias is None:
        return None
    return SparseMlpLayer(
        *common, predictor.rank, norm.eps, _ptr(norm.weight), *weights,
        act[0], slot, 0.0, _ptr(down.weight), _ptr(down.bias), _ptr(up.weight), _ptr(up.bias),
        int(predictor.kind == "mlp"), float(predictor.cutoff),
    )  # fmt: skip
