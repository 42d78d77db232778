"""Fast single-token decoding on a CPU: each half of a block is one compiled call.

A decode step at batch 1 reads every weight once and does two flops per weight, so its time
floor is ``bytes of weights / memory bandwidth``. Run as torch modules, a step of a 30-layer
model is also ~400 small operator calls (norms, views, rotations, a softmax, residual adds),
each paying Python and dispatch costs in the tens of microseconds, and each parallel region
waking its threads again: milliseconds per token before any weight is read.

``Decoder`` removes that overhead without changing the model. It reads the model's own weights
(``nn.Linear`` layout, no copies) and KV cache, and for every block runs

    x += Attn(in(RMSNorm(x)))      one call of ``attn_step``  (q/k/v, RoPE, cache write,
                                   softmax over the cache, o_proj, residual)
    x += MLP(in(RMSNorm(x)))       one call of ``mlp_step`` (dense) or ``sparse_mlp_step``
                                   (a ``SparseMLP``: threshold or predictor, active rows only)

in C (``minisparse/kernels/decode_step.c``), each call one OpenMP parallel region whose threads
split the rows of every matrix between them. Scratch memory is allocated once per decoder.
Projections may be float32 or weight-only int8 (chapter 09's ``Int8Linear``: the codes are
widened to floats in registers, a quarter of the bytes). ``Decoder.forward`` takes up to
``MAX_TOKENS`` tokens at once and reads each weight once for all of them: the verification pass
of speculative decoding (chapter 10) costs little more than one step.

Anything the C step does not know runs as torch, block half by block half, so the decoder
computes exactly what ``model(tokens, input_pos, cache)`` computes for every model the course
builds: a hook on a module (measurements), a LoRA or quantized projection, a non-static cache
(paged, sinks, H2O), an unknown activation. ``Decoder.plan`` says which halves run where.
Without a C compiler (``minisparse.kernels.cpu.fast_path_available()``) every half runs as torch.
"""

from __future__ import annotations

import ctypes
import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .kernels.cpu import load_source_library
from .model import MLP, Attention, Block, KVCache, Linear, RMSNorm, Transformer
from .quant import Int8Linear
from .rope import rope_cos_sin
from .sparse_mlp import SparseMLP
from .sparsity import MagnitudeThreshold

ACT_CODES = {"silu": 0, "relu": 1, "gelu": 2}
MAX_TOKENS = 8  # as in decode_step.c: the most tokens one forward call takes


class Slot(ctypes.Structure):
    _fields_ = [("relu", ctypes.c_int32), ("threshold", ctypes.c_float)]


_f = ctypes.POINTER(ctypes.c_float)
_i64, _flt, _i32 = ctypes.c_int64, ctypes.c_float, ctypes.c_int32


class Mat(ctypes.Structure):
    """A weight matrix for C: float32 data (scale NULL), or int8 codes and float32 row scales."""

    _fields_ = [("data", ctypes.c_void_p), ("scale", ctypes.c_void_p)]


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
        *[(n, ctypes.c_void_p) for n in ("norm", "wg", "wu", "wd_t")],
        ("act", _i32),
        ("input", Slot),
        ("threshold", _flt),
        *[(n, ctypes.c_void_p) for n in ("pu", "pu_bias", "pv", "pv_bias")],
        ("predictor_relu", _i32),
        ("cutoff", _flt),
    ]


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.attn_scratch.argtypes, lib.attn_scratch.restype = [i64] * 5, i64
    lib.mlp_scratch.argtypes, lib.mlp_scratch.restype = [i64, i64], i64
    lib.sparse_mlp_scratch.argtypes = [i64, i64, i64, c_int]
    lib.sparse_mlp_scratch.restype = i64
    lib.attn_step.argtypes, lib.attn_step.restype = [p, p, i64, i64, p, c_int], c_int
    lib.mlp_step.argtypes, lib.mlp_step.restype = [p, p, i64, p, c_int], c_int
    lib.sparse_mlp_step.argtypes, lib.sparse_mlp_step.restype = [p, p, p, c_int], i64
    lib.lm_head_step.argtypes = [p, i64, p, ctypes.c_float, ctypes.POINTER(Mat), i64, i64, p, p]
    lib.lm_head_step.argtypes.append(c_int)
    lib.lm_head_step.restype = c_int


@functools.lru_cache(maxsize=1)
def decode_library() -> ctypes.CDLL | None:
    """The compiled decode step, or None without a C compiler (one warning, from ``cpu``)."""
    return load_source_library("decode_step.c", _declare)


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _hooked(*modules: nn.Module) -> bool:
    return any(m._forward_hooks or m._forward_pre_hooks for m in modules)


def _global_hooks() -> bool:
    from torch.nn.modules import module as torch_module

    return bool(torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks)


def slot_of(module: nn.Module) -> Slot | None:
    """An activation slot as the C step applies it (Identity, ReLU, a magnitude threshold on
    either), or None for anything else."""
    if _hooked(module):
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
    if _hooked(module):
        return None
    threshold = -1.0
    if isinstance(module, MagnitudeThreshold):
        module, threshold = module.inner, module.threshold
        if _hooked(module):
            return None
    if type(module) is nn.SiLU:
        return ACT_CODES["silu"], threshold
    if type(module) is nn.ReLU:
        return ACT_CODES["relu"], threshold
    if type(module) is nn.GELU and module.approximate == "none":
        return ACT_CODES["gelu"], threshold
    return None


def _plain_f32(*tensors: Tensor | None) -> bool:
    """All given tensors are contiguous float32 CPU tensors (None counts as fine)."""
    return all(
        t is None or (t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous())
        for t in tensors
    )


def _linear_ok(lin: nn.Module) -> bool:
    """A projection the C step reads: a float32 ``nn.Linear``, or a weight-only ``Int8Linear``."""
    if _hooked(lin):
        return False
    if type(lin) in (Linear, nn.Linear):
        return _plain_f32(lin.weight, lin.bias)
    return (
        type(lin) is Int8Linear
        and lin.q.device.type == "cpu"
        and lin.q.dtype == torch.int8
        and lin.q.is_contiguous()
        and _plain_f32(lin.bias)
    )


def mat(lin: nn.Module, keep: list[Tensor]) -> Mat:
    """The C view of a projection accepted by ``_linear_ok``; ``keep`` holds what it points to."""
    if type(lin) is not Int8Linear:
        return Mat(lin.weight.data_ptr(), None)
    scale = lin.scale.float().contiguous()  # the layer keeps bfloat16 scales for torch's kernel
    keep.append(scale)
    return Mat(lin.q.data_ptr(), scale.data_ptr())


def attn_layer(
    layer: Block, cache: object, model: Transformer, keep: list[Tensor]
) -> AttnLayer | None:
    """The C description of a block's attention half, or None when torch must run it."""
    attn, c = layer.attn, model.config
    slot = slot_of(layer.attn_in_act)
    if (
        type(attn) is not Attention
        or type(layer.attn_norm) is not RMSNorm
        or _hooked(attn, layer.attn_norm)
        or slot is None
        or not all(_linear_ok(p) for p in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj))
        or type(cache) is not KVCache
        or cache.k.shape[0] != 1
        or not _plain_f32(cache.k, cache.v, layer.attn_norm.weight, model.inv_freq)
    ):
        return None
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
        *[mat(p, keep) for p in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)],
        *[_ptr(p.bias) for p in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)],
        _ptr(cache.k),
        _ptr(cache.v),
        slot,
    )


def mlp_layer(layer: Block, keep: list[Tensor]) -> MlpLayer | SparseMlpLayer | None:
    """The C description of a block's MLP half (dense or sparse), or None for torch."""
    mlp, norm = layer.mlp, layer.mlp_norm
    slot = slot_of(layer.mlp_in_act)
    if (
        type(norm) is not RMSNorm
        or _hooked(norm, mlp)
        or slot is None
        or not _plain_f32(norm.weight)
    ):
        return None
    if type(mlp) is SparseMLP:
        return sparse_mlp_layer(mlp, norm, slot)
    if type(mlp) is not MLP:
        return None
    act, down_in = activation_of(mlp.act), slot_of(mlp.down_in_act)
    projections = (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    if act is None or down_in is None or not all(_linear_ok(p) for p in projections):
        return None
    return MlpLayer(
        mlp.down_proj.out_features,
        mlp.gate_proj.out_features,
        norm.eps,
        _ptr(norm.weight),
        *[mat(p, keep) for p in projections],
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
    if type(predictor) is not Predictor or _hooked(predictor, predictor.down, predictor.up):
        return None
    return predictor


def sparse_mlp_layer(mlp: SparseMLP, norm: RMSNorm, slot: Slot) -> SparseMlpLayer | None:
    act = activation_of(mlp.act)
    if act is None or act[1] >= 0 or not _plain_f32(mlp.W_gate, mlp.W_up, mlp.W_down_t):
        return None
    dim, ffn = mlp.W_down_t.shape[1], mlp.W_down_t.shape[0]
    common = (dim, ffn)
    if mlp.threshold is not None:
        return SparseMlpLayer(
            *common, 0, norm.eps, _ptr(norm.weight),
            _ptr(mlp.W_gate), _ptr(mlp.W_up), _ptr(mlp.W_down_t),
            act[0], slot, mlp.threshold, None, None, None, None, 0, 0.0,
        )  # fmt: skip
    predictor = predictor_of(mlp)
    if predictor is None:
        return None
    down, up = predictor.down, predictor.up
    if not _plain_f32(down.weight, down.bias, up.weight, up.bias) or up.bias is None:
        return None
    return SparseMlpLayer(
        *common, predictor.rank, norm.eps, _ptr(norm.weight),
        _ptr(mlp.W_gate), _ptr(mlp.W_up), _ptr(mlp.W_down_t),
        act[0], slot, 0.0, _ptr(down.weight), _ptr(down.bias), _ptr(up.weight), _ptr(up.bias),
        int(predictor.kind == "mlp"), float(predictor.cutoff),
    )  # fmt: skip


@dataclass
class Half:
    """One half of one block: the C description, or None when torch runs it."""

    layer: int
    part: str  # "attn" or "mlp"
    c: ctypes.Structure | None

    @property
    def where(self) -> str:
        return "C" if self.c is not None else "torch"


class Decoder:
    """Decode steps of ``model`` (one token, or a few at once) with the per-layer compiled calls.

    ``cache`` is the per-layer KV cache the prompt was prefilled into (``make_cache``); the
    decoder writes each new token's keys and values there too. ``step(token, pos)`` returns the
    logits of the next token [vocab] in a buffer that the next step overwrites. Build it after
    the model is in its final state (sparsified, quantized, hooked): the plan is made once.
    """

    def __init__(self, model: Transformer, cache: Sequence[object]) -> None:
        if not Decoder.supports(model):
            raise ValueError(
                "Decoder runs float32 models on the CPU; use model(tokens, input_pos, cache) "
                "for other devices and dtypes."
            )
        self.model, self.cache = model, cache
        c = model.config
        lib = decode_library()
        self.lib = lib
        usable = lib is not None and not _global_hooks() and not _hooked(model)
        self.halves: list[Half] = []
        self.whole_layer: list[bool] = []  # layers that run as one torch Block call
        self._keep: list[Tensor] = []  # float32 copies of int8 scales the C views point to
        for i, layer in enumerate(model.layers):
            plain = usable and type(layer) is Block and not _hooked(layer)
            self.whole_layer.append(not plain)
            attn = attn_layer(layer, cache[i], model, self._keep) if plain else None
            self.halves += [
                Half(i, "attn", attn),
                Half(i, "mlp", mlp_layer(layer, self._keep) if plain else None),
            ]
        head, norm = model.lm_head, model.norm
        self.c_head = (
            usable
            and _linear_ok(head)
            and head.bias is None
            and type(norm) is RMSNorm
            and not _hooked(norm)
            and _plain_f32(norm.weight)
        )
        self._head_mat = mat(head, self._keep) if self.c_head else None
        self.threads = max(1, torch.get_num_threads())
        sizes = [c.dim]
        for h in self.halves:
            if isinstance(h.c, AttnLayer):
                sizes.append(
                    lib.attn_scratch(c.dim, c.n_heads, c.n_kv_heads, c.head_dim, h.c.max_seq)
                )
            elif isinstance(h.c, MlpLayer):
                sizes.append(lib.mlp_scratch(h.c.dim, h.c.ffn))
            elif isinstance(h.c, SparseMlpLayer):
                sizes.append(lib.sparse_mlp_scratch(h.c.dim, h.c.ffn, h.c.rank, self.threads))
        with torch.inference_mode(False):  # normal tensors: usable inside and outside it
            self.scratch = torch.empty(max(sizes) + MAX_TOKENS * c.dim, dtype=torch.float32)
            self.x = torch.empty(MAX_TOKENS, c.dim, dtype=torch.float32)
            self.logits = torch.empty(MAX_TOKENS, c.vocab_size, dtype=torch.float32)
        self._refs = [None if h.c is None else ctypes.byref(h.c) for h in self.halves]
        self.all_torch = not self.c_head and all(ref is None for ref in self._refs)
        self._rope: tuple[Tensor, Tensor, Tensor] | None = None

    @staticmethod
    def supports(model: Transformer) -> bool:
        """True for a float32 model on the CPU (the decoder's buffers are float32)."""
        return model.device.type == "cpu" and model.dtype == torch.float32

    def plan(self) -> list[str]:
        """Where each half runs, e.g. ['0.attn: C', '0.mlp: torch', ...]."""
        return [f"{h.layer}.{h.part}: {h.where}" for h in self.halves]

    def step(self, token: int, pos: int, times: dict[str, float] | None = None) -> Tensor:
        """Logits [vocab] for ``token`` at position ``pos`` (0-based), cache updated.

        ``times``, when given, accumulates the seconds spent in each part of the step
        ("embedding", "attention", "mlp", "sparse mlp", "torch", "lm head").
        """
        return self.forward([token], pos, times)[0]

    @torch.no_grad()
    def forward(
        self, tokens: Sequence[int], pos: int, times: dict[str, float] | None = None
    ) -> Tensor:
        """Logits [B, vocab] for B <= ``MAX_TOKENS`` consecutive tokens at positions pos ..
        pos + B - 1 (each sees the cache and the tokens before it), cache updated.

        Each weight is read once for all B tokens: speculative decoding verifies gamma drafted
        tokens at about the cost of one step. A sparse MLP runs as C for one token (the
        active sets of several tokens differ) and as torch for more.
        """
        n = len(tokens)
        if not 1 <= n <= MAX_TOKENS:
            raise ValueError(
                f"Decoder.forward takes 1 to {MAX_TOKENS} tokens, got {n}; run longer chunks "
                "through model(tokens, input_pos, cache)."
            )
        vocab = self.model.config.vocab_size
        if any(not 0 <= int(t) < vocab for t in tokens):
            raise ValueError(
                f"Token ids must lie in 0 .. {vocab - 1} (the model's vocabulary), got "
                f"{list(tokens)}; encode the text with this model's tokenizer."
            )
        if pos < 0:
            raise ValueError(f"pos must be at least 0 (positions start at 0), got {pos}.")
        clock = Clock(times)
        ids = torch.tensor(list(tokens))
        if self.all_torch:  # nothing for C to do: the model's own forward, without our loop
            positions = torch.arange(pos, pos + n)
            self.logits[:n].copy_(self.model(ids[None], positions, self.cache)[0])
            clock("torch")
            return self.logits[:n]
        self._rope = None
        torch.index_select(self.model.embed.weight, 0, ids, out=self.x[:n])
        clock("embedding")
        for i in range(len(self.model.layers)):
            if self.whole_layer[i]:
                self._torch_layer(i, n, pos)
                clock("torch")
                continue
            clock(self._attention(i, n, pos))
            clock(self._mlp(i, n, pos))
        clock(self._head(n))
        return self.logits[:n]

    def _torch_layer(self, i: int, n: int, pos: int) -> None:
        x = self.x[:n].view(1, n, -1)
        out = self.model.layers[i](x, *self._cos_sin(n, pos), self.cache[i])
        self.x[:n].copy_(out[0])

    def _attention(self, i: int, n: int, pos: int) -> str:
        if self._refs[2 * i] is None:
            layer, x = self.model.layers[i], self.x[:n].view(1, n, -1)
            x += layer.attn(
                layer.attn_in_act(layer.attn_norm(x)), *self._cos_sin(n, pos), self.cache[i]
            )
            return "torch"
        ptrs = (self.x.data_ptr(), n, pos, self.scratch.data_ptr(), self.threads)
        if self.lib.attn_step(self._refs[2 * i], *ptrs):
            raise ValueError(
                f"Positions {pos}..{pos + n - 1} do not fit in the KV cache of layer {i}."
            )
        return "attention"

    def _mlp(self, i: int, n: int, pos: int) -> str:
        half, ref = self.halves[2 * i + 1], self._refs[2 * i + 1]
        sparse = isinstance(half.c, SparseMlpLayer)
        if ref is None or (sparse and n > 1):
            layer, x = self.model.layers[i], self.x[:n].view(1, n, -1)
            x += layer.mlp(layer.mlp_in_act(layer.mlp_norm(x)))
            return "torch"
        if sparse:
            mlp = self.model.layers[i].mlp
            count = self.lib.sparse_mlp_step(
                ref, self.x.data_ptr(), self.scratch.data_ptr(), self.threads
            )
            mlp.last_density, mlp.last_keep = count / half.c.ffn, None
            return "sparse mlp"
        self.lib.mlp_step(ref, self.x.data_ptr(), n, self.scratch.data_ptr(), self.threads)
        return "mlp"

    def _head(self, n: int) -> str:
        model, x, logits = self.model, self.x, self.logits
        if not self.c_head:
            logits[:n].copy_(model.lm_head(model.norm(x[:n].view(1, n, -1)))[0])
            return "torch"
        self.lib.lm_head_step(
            x.data_ptr(), n, model.norm.weight.data_ptr(), model.norm.eps,
            ctypes.byref(self._head_mat), logits.shape[1], x.shape[1],
            self.scratch.data_ptr(), logits.data_ptr(), self.threads,
        )  # fmt: skip
        return "lm head"

    def _cos_sin(self, n: int, pos: int) -> tuple[Tensor, Tensor, Tensor]:
        """(cos, sin, input_pos) of positions pos .. pos + n - 1 for the halves torch runs, as
        ``Transformer.hidden_states`` makes them."""
        if self._rope is None:  # made once per forward call, when a torch half needs it
            model, positions = self.model, torch.arange(pos, pos + n)
            cos, sin = rope_cos_sin(model.inv_freq, positions, torch.float32)
            if model.rope_scale != 1.0:
                cos, sin = cos * model.rope_scale, sin * model.rope_scale
            self._rope = (cos, sin, positions)
        return self._rope


class Clock:
    """Adds the time since the last call to ``times[name]`` (does nothing when times is None)."""

    def __init__(self, times: dict[str, float] | None) -> None:
        self.times = times
        self.last = time.perf_counter() if times is not None else 0.0

    def __call__(self, name: str) -> None:
        if self.times is not None:
            now = time.perf_counter()
            self.times[name] = self.times.get(name, 0.0) + now - self.last
            self.last = now
