"""A Llama-family decoder written from scratch, small enough to read in one sitting.

The model is the stack used by Llama 2/3, SmolLM2, TinyLlama and Mistral (without sliding
windows):

    h_0     = E[tokens]                                   token embedding
    a_l     = h_{l-1} + Attn_l(RMSNorm(h_{l-1}))          pre-norm attention + residual
    h_l     = a_l + MLP_l(RMSNorm(a_l))                   pre-norm gated MLP + residual
    logits  = RMSNorm(h_L) @ W_out^T                      W_out = E when embeddings are tied

Its shape is a ``ModelConfig`` (``minisparse.core.config``); its layers (RMSNorm, grouped-query
attention with RoPE, the gated MLP, the block, the static ``KVCache``) are in
``minisparse.core.layers``, and all of them can be imported from here too. This module stacks
them into the ``Transformer``, checks what it is given (token ids, caches), and chooses how the
weights lie in memory for fast batch-1 decoding on a CPU.

Every submodule is a plain attribute: ``model.layers[i].attn.{q,k,v,o}_proj``,
``model.layers[i].mlp.{gate,up,down}_proj``, ``model.layers[i].mlp.act``,
``model.layers[i].{attn_norm,mlp_norm}``, ``model.embed``, ``model.norm``, ``model.lm_head``.
Three more activation slots are identities in the model as trained and exist so that later
chapters can act on the inputs the projections see: ``layers[i].attn_in_act`` (after the attention
norm, before q/k/v), ``layers[i].mlp_in_act`` (after the MLP norm, before gate/up) and
``layers[i].mlp.down_in_act`` (before the down projection). Chapter 03 puts magnitude thresholds
there, chapter 04 a ReLU.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .checks import check_count
from .config import ACTIVATIONS, ModelConfig
from .layers import (
    MLP,
    Attention,
    Block,
    KVCache,
    Linear,
    RMSNorm,
    causal_mask,
    make_cache,
)
from .memory import to_huge_pages_
from .rope import apply_rope, rope_cos_sin, rope_inv_freq


class Transformer(nn.Module):
    """The full decoder: ``model(tokens [batch, seq], input_pos=None, cache=None) -> logits``.

    ``input_pos`` holds the absolute positions of ``tokens`` (default 0..seq-1). ``cache`` is a
    sequence of per-layer caches (``make_cache``), each with ``update(input_pos, k, v)``
    returning the keys/values to attend to (positions 0..end-1). A cache that also decides which
    keys a query sees, or weighs them (``minisparse.kvcache``: sinks, H2O), instead defines
    ``attend(q, k, v, input_pos) -> output`` [batch, heads, seq, head_dim] on rotated q and k.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # Building on the meta device (how loading makes an empty model) must run no meta op that
        # has a Python decomposition (normal_, arange): those import torch._dynamo, and triton.
        weight = nn.Parameter(torch.empty(config.vocab_size, config.dim))
        if not weight.is_meta:
            nn.init.normal_(weight)
        self.embed = nn.Embedding(config.vocab_size, config.dim, _weight=weight)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.lm_head = Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.register_buffer(
            "inv_freq",
            rope_inv_freq(config.head_dim, config.rope_theta).float().to(weight.device),
            persistent=False,
        )
        self.rope_scale = 1.0  # transformers' "attention_scaling" for scaled RoPE variants

    def __deepcopy__(self, memo: dict[int, Any]) -> Transformer:
        """``copy.deepcopy``, whose copy keeps its large CPU tensors in 2 MB pages, as ``load``
        gives them (``core.memory``): the copies the course decodes (quantized, thresholded,
        sparse) stream their weights as fast as the model they came from."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(self.__dict__, memo))
        return to_huge_pages_(new)

    def _apply(self, fn, recurse=True):
        """Move/cast like any module, but keep the RoPE frequencies in float32.

        ``model.to(torch.bfloat16)`` would otherwise round theta_i to 8 bits of mantissa, and
        the angle p * theta_i drifts by radians at long positions (transformers keeps them in
        float32 too).
        """
        inv_freq = self.inv_freq
        super()._apply(fn, recurse)
        self.inv_freq = inv_freq.to(device=self.inv_freq.device, dtype=torch.float32)
        return self

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def num_parameters(self) -> int:
        """Distinct parameters (a tied embedding counts once)."""
        return sum(p.numel() for p in self.parameters())

    def hidden_states(
        self,
        tokens: Tensor,
        input_pos: Tensor | None = None,
        cache: Sequence[KVCache] | None = None,
    ) -> Tensor:
        """The final-normed hidden states [batch, seq, dim], before the LM head."""
        check_tokens(tokens, self.config.vocab_size)
        if cache is not None:
            check_cache(cache, self.config.n_layers)
        if input_pos is not None and tuple(input_pos.shape) != (tokens.shape[1],):
            raise ValueError(
                f"input_pos must hold one position per token ({tokens.shape[1]}), got shape "
                f"{tuple(input_pos.shape)}; e.g. torch.arange(start, start + tokens.shape[1])."
            )
        if input_pos is None:
            if cache is not None:
                raise ValueError(
                    "A cache needs the positions of the tokens: pass input_pos, e.g. "
                    "torch.arange(start, start + tokens.shape[1])."
                )
            input_pos = torch.arange(tokens.shape[1], device=tokens.device)
        input_pos = input_pos.long()
        if int(input_pos.min()) < 0:
            raise ValueError("input_pos holds a negative position; positions start at 0.")
        x = self.embed(tokens)
        cos, sin = rope_cos_sin(self.inv_freq, input_pos, x.dtype)
        if self.rope_scale != 1.0:
            cos, sin = cos * self.rope_scale, sin * self.rope_scale
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, input_pos, None if cache is None else cache[i])
        return self.norm(x)

    def forward(
        self,
        tokens: Tensor,
        input_pos: Tensor | None = None,
        cache: Sequence[KVCache] | None = None,
    ) -> Tensor:
        return self.lm_head(self.hidden_states(tokens, input_pos, cache))

    def tie_weights(self) -> None:
        if self.config.tie_embeddings:
            self.lm_head.weight = self.embed.weight


def check_tokens(tokens: Tensor, vocab_size: int) -> None:
    """Refuse token ids the embedding cannot look up: wrong shape or dtype, < 0 or >= vocab."""
    if not isinstance(tokens, Tensor) or tokens.dim() != 2:
        shape = tuple(tokens.shape) if isinstance(tokens, Tensor) else type(tokens).__name__
        raise ValueError(
            f"tokens must be a tensor of shape [batch, seq], got {shape}; "
            "use tokens[None] for a single sequence."
        )
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise ValueError(f"tokens must be integer token ids (torch.long), got {tokens.dtype}.")
    if tokens.numel() == 0:
        raise ValueError("tokens is empty; pass at least one token id.")
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(
            f"Token id {bad} is outside the model's vocabulary (0 .. {vocab_size - 1}); encode "
            "the text with this model's tokenizer."
        )


def check_cache(cache: Sequence[Any], n_layers: int) -> None:
    """A KV cache must have one entry per layer (``make_cache`` / ``make_kv_cache`` build one)."""
    try:
        size = len(cache)
    except TypeError:
        raise ValueError(
            f"cache must be a sequence of per-layer caches, got {type(cache).__name__}; build "
            "one with minisparse.core.model.make_cache or minisparse.kvcache.make_kv_cache."
        ) from None
    if size != n_layers:
        raise ValueError(
            f"The cache has {size} layers but the model has {n_layers}; build it for this "
            "model: make_cache(model.config, ...) or make_kv_cache(kind, model.config, ...)."
        )


def use_input_major_weights_(model: nn.Module) -> nn.Module:
    """Re-store every ``nn.Linear`` weight W [out, in] as the transpose of a contiguous [in, out].

    The values, shapes and results are unchanged; only the memory order differs. A batch-1
    decode step computes y = x W^T for a single row x. With W row-major ([out, in] contiguous)
    this is a GEMV of dot products, one per output; with W^T contiguous it becomes a row-major
    x @ W^T that streams the weights in order while accumulating all outputs at once. On the
    course's CPU the second form moves weights from DRAM at a clearly higher bandwidth, so decoding
    is faster (``minisparse bench decode`` measures both). In place; returns ``model``.
    """
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear) and not is_input_major(module.weight):
                module.weight.data = module.weight.data.t().contiguous().t()
    if isinstance(model, Transformer):
        model.tie_weights()
    return model


def use_streaming_gemv_(model: nn.Module, enabled: bool = True) -> nn.Module:
    """Switch the streaming single-token GEMV of every ``Linear`` on (or off); in place.

    Turning it on also stores the weights input-major, the layout the streaming loop reads.
    Without a C compiler the loop is unavailable and ``F.linear`` is used, after one warning.
    """
    if enabled:
        from ..kernels.cpu import fast_path_available

        use_input_major_weights_(model)
        enabled = fast_path_available()
    for module in model.modules():
        if isinstance(module, Linear):
            module.streaming = enabled
    return model


def use_output_major_weights_(model: nn.Module) -> nn.Module:
    """Undo ``use_input_major_weights_``: contiguous [out, in] ``nn.Linear`` weights; in place."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.weight.data = module.weight.data.contiguous()
    if isinstance(model, Transformer):
        model.tie_weights()
    return model


def is_input_major(weight: Tensor) -> bool:
    """True when ``weight`` [out, in] is the transpose of a contiguous [in, out] tensor."""
    return weight.dim() == 2 and weight.t().is_contiguous() and weight.shape[0] > 1


def init_weights_(model: Transformer, seed: int = 0, std: float = 0.02) -> Transformer:
    """Fill a model with seeded random weights, in place (for unit tests and shape experiments)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(std * torch.randn(p.shape, generator=gen))
    return model


# The names before the in-place convention (a trailing underscore), kept for existing code.
use_input_major_weights = use_input_major_weights_
use_streaming_gemv = use_streaming_gemv_
use_output_major_weights = use_output_major_weights_
init_weights = init_weights_


def param_bytes(model: nn.Module) -> int:
    """Bytes of distinct parameters: what a batch-1 decode step streams from memory."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def flops_per_token(config: ModelConfig, context: int = 0) -> int:
    """Approximate forward FLOPs per token: 2 * matmul parameters + attention over ``context``."""
    c = config
    attn = c.dim * c.head_dim * (2 * c.n_heads + 2 * c.n_kv_heads)
    mlp = 3 * c.dim * c.ffn_dim
    per_layer = 2 * (attn + mlp) + 4 * c.n_heads * c.head_dim * context
    return c.n_layers * per_layer + 2 * c.dim * c.vocab_size


__all__ = [
    "ACTIVATIONS",
    "MLP",
    "Attention",
    "Block",
    "KVCache",
    "Linear",
    "ModelConfig",
    "RMSNorm",
    "Transformer",
    "apply_rope",
    "causal_mask",
    "check_cache",
    "check_count",
    "check_tokens",
    "flops_per_token",
    "init_weights",
    "init_weights_",
    "make_cache",
    "param_bytes",
    "rope_cos_sin",
    "rope_inv_freq",
    "use_input_major_weights",
    "use_input_major_weights_",
    "use_output_major_weights",
    "use_output_major_weights_",
    "use_streaming_gemv",
    "use_streaming_gemv_",
]
