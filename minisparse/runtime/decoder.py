"""Fast single-token decoding on a CPU: each half of a block is one compiled call.

A decode step at batch 1 reads every weight once and does two flops per weight, so its time
floor is ``bytes of weights / memory bandwidth``. Run as torch modules, a step of a 30-layer
model is also ~400 small operator calls (norms, views, rotations, a softmax, residual adds),
each paying Python and dispatch costs in the tens of microseconds, and each parallel region
waking its threads again: milliseconds per token before any weight is read.

``Decoder`` removes that overhead without changing the model. It reads the model's own weights
(``nn.Linear`` layout, no copies but the one below) and KV cache, and for every block runs

    x += Attn(in(RMSNorm(x)))      one call of ``attn_step``  (q/k/v, RoPE, cache write,
                                   softmax over the cache, o_proj, residual)
    x += MLP(in(RMSNorm(x)))       one call of ``mlp_step`` (dense) or ``sparse_mlp_step``
                                   (a ``SparseMLP``: threshold or predictor, active rows only,
                                   read once for all the tokens of a call)

in C (``minisparse/runtime/step.c``), each call one OpenMP parallel region whose threads
split the rows of every matrix between them. Scratch memory is allocated once per decoder.
A projection whose input passes a TEAL threshold is read input-major (a transposed copy made
once per decoder): the rows of the zeroed inputs are never read, so a share s of zero inputs
skips a share s of its bytes. Projections may be float32, weight-only int8 (chapter 09's
``Int8Linear``: the codes are widened to floats in registers, a quarter of the bytes) or int4
(``Int4Linear.blocks``: 32 weights in 20 bytes, unpacked in registers), and a ``SparseMLP``'s
rows float32 or int8.
``Decoder.forward`` takes up to ``MAX_TOKENS`` tokens at once and reads each weight once for
all of them: the verification pass of speculative decoding (chapter 10) costs little more than
one step.

Anything the C step does not know runs as torch, block half by block half, so the decoder
computes exactly what ``model(tokens, input_pos, cache)`` computes for every model the course
builds: a hook on a module (measurements), a LoRA or quantized projection, a non-static cache
(paged, sinks, H2O), an unknown activation. ``Decoder.plan`` says which halves run where.
Without a C compiler (``minisparse.kernels.cpu.fast_path_available()``) every half runs as torch.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..core.model import Block, RMSNorm, Transformer
from ..core.rope import rope_cos_sin
from ..kernels.abi import MAX_TOKENS, AttnLayer, MlpLayer, SparseMlpLayer
from .lowering import attn_layer, global_hooks, hooked, mlp_layer, plain_f32, to_mat
from .step import decode_library

__all__ = ["Clock", "Decoder", "Half"]


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

    def __init__(
        self, model: Transformer, cache: Sequence[object], lib: ctypes.CDLL | None = None
    ) -> None:
        if not Decoder.supports(model):
            raise ValueError(
                "Decoder runs float32 models on the CPU; use model(tokens, input_pos, cache) "
                "for other devices and dtypes."
            )
        self.model, self.cache = model, cache
        c = model.config
        lib = decode_library() if lib is None else lib  # another build: ``bench isa``
        self.lib = lib
        usable = lib is not None and not global_hooks() and not hooked(model)
        self.halves: list[Half] = []
        self.whole_layer: list[bool] = []  # layers that run as one torch Block call
        self._keep: list[Tensor] = []  # float32 copies of int8 scales the C views point to
        for i, layer in enumerate(model.layers):
            plain = usable and type(layer) is Block and not hooked(layer)
            self.whole_layer.append(not plain)
            attn = attn_layer(layer, cache[i], model, self._keep) if plain else None
            self.halves += [
                Half(i, "attn", attn),
                Half(i, "mlp", mlp_layer(layer, self._keep) if plain else None),
            ]
        head, norm = model.lm_head, model.norm
        head_mat = to_mat(head, self._keep) if usable else None
        self.c_head = (
            head_mat is not None
            and head.bias is None
            and type(norm) is RMSNorm
            and not hooked(norm)
            and plain_f32(norm.weight)
        )
        self._head_mat = head_mat if self.c_head else None
        self.threads = max(1, torch.get_num_threads())
        sizes = [c.dim]
        for h in self.halves:
            if isinstance(h.c, AttnLayer):
                shape = (c.dim, c.n_heads, c.n_kv_heads, c.head_dim, h.c.max_seq)
                sizes.append(lib.attn_scratch(*shape, self.threads))
            elif isinstance(h.c, MlpLayer):
                sizes.append(lib.mlp_scratch(h.c.dim, h.c.ffn, self.threads))
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
        tokens at about the cost of one step. A sparse MLP reads the rows of the neurons active
        for any of the B tokens once, as torch's ``SparseMLP`` does for several tokens.
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
        if ref is None:
            layer, x = self.model.layers[i], self.x[:n].view(1, n, -1)
            x += layer.mlp(layer.mlp_in_act(layer.mlp_norm(x)))
            return "torch"
        if sparse:
            mlp = self.model.layers[i].mlp
            count = self.lib.sparse_mlp_step(
                ref, self.x.data_ptr(), n, self.scratch.data_ptr(), self.threads
            )
            mlp.last_density, mlp.last_keep = count / half.c.ffn, None
            if n == 1:  # a decode step: what it read counts towards bytes per token (as torch)
                step = mlp.step_density
                mlp.step_density = [step[0] + mlp.last_density, step[1] + 1]
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
