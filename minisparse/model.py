"""A Llama-family decoder written from scratch, small enough to read in one sitting.

The model is the stack used by Llama 2/3, SmolLM2, TinyLlama and Mistral (without sliding
windows):

    h_0     = E[tokens]                                   token embedding
    a_l     = h_{l-1} + Attn_l(RMSNorm(h_{l-1}))          pre-norm attention + residual
    h_l     = a_l + MLP_l(RMSNorm(a_l))                   pre-norm gated MLP + residual
    logits  = RMSNorm(h_L) @ W_out^T                      W_out = E when embeddings are tied

* RMSNorm(x) = x / sqrt(mean(x^2) + eps) * g   (Zhang & Sennrich, 2019).
* RoPE rotates each (x_i, x_{i + d/2}) pair of a query/key head by the angle p * theta_i with
  theta_i = base^(-2i/d), so q_m . k_n depends on m - n only (Su et al., 2021).
* Grouped-query attention: n_heads query heads share n_kv_heads key/value heads, each K/V head
  serving a group of n_heads / n_kv_heads query heads (Ainslie et al., 2023). n_kv_heads = n_heads
  is multi-head attention, n_kv_heads = 1 is multi-query attention.
* Gated MLP: MLP(x) = W_down (act(W_gate x) * (W_up x)), act = SiLU for SwiGLU
  (Shazeer, 2020). The activation is its own submodule (``mlp.act``) so later chapters can swap
  SiLU for ReLU, insert thresholds, or replace the whole MLP by a sparse one.

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

import operator
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .rope import apply_rope, rope_cos_sin, rope_inv_freq

ACTIVATIONS: dict[str, type[nn.Module]] = {
    "silu": nn.SiLU,
    "relu": nn.ReLU,
    "gelu": nn.GELU,
}


def check_count(value: object, name: str, minimum: int = 1, fix: str = "") -> int:
    """``value`` as an int after checking it is a whole number >= ``minimum`` (not a bool).

    Every count the library takes (tokens, layers, steps, block sizes, repeats) goes through
    here, so 0, -1, 2.5 or True give one ``ValueError`` that names the argument.
    """
    try:
        number = None if isinstance(value, bool) else operator.index(value)  # int, np.int64
    except TypeError:
        number = None
    if number is None or number < minimum:
        hint = f"; {fix}" if fix else ""
        raise ValueError(
            f"{name} must be at least {minimum} (a whole number {name} >= {minimum}), "
            f"got {value!r}{hint}."
        )
    return number


@dataclass
class ModelConfig:
    """Shape and hyper-parameters of a Llama-family decoder."""

    vocab_size: int = 49152
    dim: int = 576
    n_layers: int = 30
    n_heads: int = 9
    n_kv_heads: int = 3
    head_dim: int = 64
    ffn_dim: int = 1536
    rope_theta: float = 100000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    max_seq_len: int = 8192
    hidden_act: str = "silu"
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = 1
    eos_token_ids: list[int] = field(default_factory=lambda: [2])
    rope_scaling: dict[str, Any] | None = None  # transformers' RoPE variant (llama3, linear, ...)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim"):
            check_count(getattr(self, name), name)
        check_count(self.ffn_dim, "ffn_dim")
        check_count(self.max_seq_len, "max_seq_len")
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads}); "
                "choose n_kv_heads among the divisors of n_heads."
            )
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(
                f"Unknown activation {self.hidden_act!r}; use one of {sorted(ACTIVATIONS)}."
            )

    @property
    def group_size(self) -> int:
        """Query heads per key/value head."""
        return self.n_heads // self.n_kv_heads

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        return cls(**known)

    @classmethod
    def from_hf(cls, hf_config: Any) -> ModelConfig:
        """Read a transformers ``LlamaConfig`` (or a compatible one)."""
        n_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // n_heads
        rope = dict(
            getattr(hf_config, "rope_parameters", None)
            or getattr(hf_config, "rope_scaling", None)
            or {}
        )
        theta = rope.pop("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        scaled = rope.get("rope_type", rope.get("type", "default")) != "default"
        eos = hf_config.eos_token_id
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            vocab_size=hf_config.vocab_size,
            dim=hf_config.hidden_size,
            n_layers=hf_config.num_hidden_layers,
            n_heads=n_heads,
            n_kv_heads=getattr(hf_config, "num_key_value_heads", None) or n_heads,
            head_dim=head_dim,
            ffn_dim=hf_config.intermediate_size,
            rope_theta=float(theta),
            norm_eps=float(hf_config.rms_norm_eps),
            tie_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            max_seq_len=int(getattr(hf_config, "max_position_embeddings", 2048)),
            hidden_act=hf_config.hidden_act,
            attention_bias=bool(getattr(hf_config, "attention_bias", False)),
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
            bos_token_id=hf_config.bos_token_id,
            eos_token_ids=eos_ids,
            rope_scaling=rope if scaled else None,
        )


class RMSNorm(nn.Module):
    """RMSNorm(x) = x / sqrt(mean(x^2) + eps) * weight, computed in float32."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Linear(nn.Linear):
    """``nn.Linear`` with an optional streaming GEMV for single-token decoding on a CPU.

    With ``streaming`` on (``use_streaming_gemv``), a float32 CPU input holding one row, a weight
    stored input-major (``use_input_major_weights``) and no gradient needed, y = x W^T is
    computed by ``minisparse.kernels.cpu.dense_gemv``: a small C loop that reads W^T's rows in
    memory order with software prefetch (chapter 07 builds it). Every other case, prefill and
    training included, is plain ``F.linear``. The module is still an ``nn.Linear``: code that
    reads ``.weight`` or replaces it keeps working.
    """

    streaming: bool = False

    def forward(self, x: Tensor) -> Tensor:
        if self.streaming and self.can_stream(x):
            from .kernels.cpu import dense_gemv

            y = dense_gemv(self.weight.t(), x.reshape(1, -1)).view(*x.shape[:-1], -1)
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.weight, self.bias)

    def can_stream(self, x: Tensor) -> bool:
        w = self.weight
        return (
            x.numel() == self.in_features
            and x.device.type == "cpu"
            and x.dtype == w.dtype == torch.float32
            and w.t().is_contiguous()
            and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
        )


class KVCache(nn.Module):
    """Static, preallocated key/value cache for one attention layer.

    Buffers ``k``/``v`` have shape [batch, n_kv_heads, max_seq_len, head_dim] and are allocated
    once; ``update`` writes the new keys/values at ``input_pos`` and returns the cache up to the
    last written position, so decoding allocates no new cache memory per step.
    """

    def __init__(
        self,
        batch: int,
        n_kv_heads: int,
        max_seq_len: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        shape = (batch, n_kv_heads, max_seq_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.max_seq_len = max_seq_len

    def update(self, input_pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store k, v [batch, kv_heads, seq, head_dim] at ``input_pos`` [seq]; return k, v[:end]."""
        end = int(input_pos[-1]) + 1
        if end > self.max_seq_len:
            raise ValueError(
                f"Position {end - 1} does not fit in a KV cache of {self.max_seq_len} tokens; "
                "create the cache with a larger max_seq_len or shorten the prompt."
            )
        start = int(input_pos[0])
        if end - start == k.shape[2]:  # contiguous positions: a slice copy
            self.k[:, :, start:end] = k
            self.v[:, :, start:end] = v
        else:
            self.k.index_copy_(2, input_pos, k)
            self.v.index_copy_(2, input_pos, v)
        return self.k[:, :, :end], self.v[:, :, :end]


def make_cache(
    config: ModelConfig,
    batch: int = 1,
    max_seq_len: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> nn.ModuleList:
    """One static ``KVCache`` per layer, to pass as ``model(tokens, input_pos, cache=...)``."""
    check_count(batch, "batch")
    length = config.max_seq_len if max_seq_len is None else check_count(max_seq_len, "max_seq_len")
    return nn.ModuleList(
        KVCache(batch, config.n_kv_heads, length, config.head_dim, dtype, device)
        for _ in range(config.n_layers)
    )


def causal_mask(q_pos: Tensor, kv_len: int) -> Tensor:
    """Boolean [q, kv] mask: query at position p sees keys at positions 0..p."""
    kv_pos = torch.arange(kv_len, device=q_pos.device)
    return kv_pos[None, :] <= q_pos[:, None]


class Attention(nn.Module):
    """Grouped-query self-attention with RoPE: softmax(q k^T / sqrt(d) + mask) v."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c = config
        self.n_heads, self.n_kv_heads, self.head_dim = c.n_heads, c.n_kv_heads, c.head_dim
        bias = c.attention_bias
        self.q_proj = Linear(c.dim, c.n_heads * c.head_dim, bias=bias)
        self.k_proj = Linear(c.dim, c.n_kv_heads * c.head_dim, bias=bias)
        self.v_proj = Linear(c.dim, c.n_kv_heads * c.head_dim, bias=bias)
        self.o_proj = Linear(c.n_heads * c.head_dim, c.dim, bias=bias)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        input_pos: Tensor,
        cache: KVCache | None = None,
    ) -> Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            attend = getattr(cache, "attend", None)
            if attend is not None:  # caches that choose or weigh the keys (chapter 02)
                out = attend(q, k, v, input_pos)
                return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))
            k, v = cache.update(input_pos, k, v)
        kv_len = k.shape[2]
        gqa = self.n_kv_heads != self.n_heads
        if t == 1:  # one new token sees every cached key: no mask needed
            out = F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
        elif kv_len == t:  # the keys are exactly these tokens (no cache, or a first chunk)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:  # a chunk appended after earlier tokens
            mask = causal_mask(input_pos, kv_len)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))


class MLP(nn.Module):
    """Gated MLP: down_proj(act(gate_proj(x)) * up_proj(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c = config
        self.gate_proj = Linear(c.dim, c.ffn_dim, bias=c.mlp_bias)
        self.up_proj = Linear(c.dim, c.ffn_dim, bias=c.mlp_bias)
        self.down_proj = Linear(c.ffn_dim, c.dim, bias=c.mlp_bias)
        self.act = ACTIVATIONS[c.hidden_act]()
        self.down_in_act: nn.Module = nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.down_in_act(self.act(self.gate_proj(x)) * self.up_proj(x)))


class Block(nn.Module):
    """One decoder layer: pre-norm attention and pre-norm MLP, each with a residual."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.dim, config.norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.dim, config.norm_eps)
        self.mlp = MLP(config)
        self.attn_in_act: nn.Module = nn.Identity()
        self.mlp_in_act: nn.Module = nn.Identity()

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, input_pos: Tensor, cache: KVCache | None
    ) -> Tensor:
        x = x + self.attn(self.attn_in_act(self.attn_norm(x)), cos, sin, input_pos, cache)
        return x + self.mlp(self.mlp_in_act(self.mlp_norm(x)))


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
            "one with minisparse.model.make_cache or minisparse.kvcache.make_kv_cache."
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
        from .kernels.cpu import fast_path_available

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
