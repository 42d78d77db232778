"""The layers of a Llama-family decoder: RMSNorm, attention, the gated MLP and the block.

One decoder layer (``Block``) is a pre-norm attention and a pre-norm MLP, each added back to
the residual stream:

    a = h + Attn(RMSNorm(h))          h' = a + MLP(RMSNorm(a))

* RMSNorm(x) = x / sqrt(mean(x^2) + eps) * g   (Zhang & Sennrich, 2019).
* RoPE rotates each (x_i, x_{i + d/2}) pair of a query/key head by the angle p * theta_i with
  theta_i = base^(-2i/d), so q_m . k_n depends on m - n only (Su et al., 2021).
* Grouped-query attention: n_heads query heads share n_kv_heads key/value heads, each K/V head
  serving a group of n_heads / n_kv_heads query heads (Ainslie et al., 2023). n_kv_heads = n_heads
  is multi-head attention, n_kv_heads = 1 is multi-query attention. Decoding keeps the rotated
  keys and values of earlier tokens in a ``KVCache`` (one per layer, ``make_cache``).
* Gated MLP: MLP(x) = W_down (act(W_gate x) * (W_up x)), act = SiLU for SwiGLU
  (Shazeer, 2020). The activation is its own submodule (``mlp.act``) so later chapters can swap
  SiLU for ReLU, insert thresholds, or replace the whole MLP by a sparse one.

Every projection is a ``Linear``: an ``nn.Linear`` that can compute a single-token y = x W^T
with the streaming CPU loop of chapter 07 (``minisparse.kernels.cpu.dense_gemv``).

Three activation slots are identities in the model as trained and exist so that later chapters
can act on the inputs the projections see: ``Block.attn_in_act`` (after the attention norm,
before q/k/v), ``Block.mlp_in_act`` (after the MLP norm, before gate/up) and
``MLP.down_in_act`` (before the down projection). Chapter 03 puts magnitude thresholds there,
chapter 04 a ReLU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .checks import check_count
from .config import ACTIVATIONS, ModelConfig
from .rope import apply_rope

__all__ = [
    "MLP",
    "Attention",
    "Block",
    "KVCache",
    "Linear",
    "RMSNorm",
    "causal_mask",
    "make_cache",
]


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
            from ..kernels.cpu import dense_gemv

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
        q, k = self.rotate(q, cos, sin), self.rotate(k, cos, sin)
        if cache is not None:
            attend = getattr(cache, "attend", None)
            if attend is not None:  # caches that choose or weigh the keys (chapter 02)
                out = attend(q, k, v, input_pos)
                return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))
            k, v = cache.update(input_pos, k, v)
        out = self.attend(q, k, v, input_pos)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))

    def rotate(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """RoPE on queries or keys [batch, heads, seq, head_dim]."""
        return apply_rope(x, cos, sin)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor) -> Tensor:
        """Causal GQA: q [b, H, t, d] at ``input_pos`` against k, v [b, G, n, d] (positions
        0 .. n - 1) -> [b, H, t, d]."""
        t, kv_len = q.shape[2], k.shape[2]
        gqa = self.n_kv_heads != self.n_heads
        if t == 1:  # one new token sees every cached key: no mask needed
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
        if kv_len == t:  # the keys are exactly these tokens (no cache, or a first chunk)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        mask = causal_mask(input_pos, kv_len)  # a chunk appended after earlier tokens
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


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
