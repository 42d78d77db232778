"""How positions enter attention: rotary embeddings (RoPE), context extension, and ALiBi.

**RoPE** (Su et al., 2021, "RoFormer"). Split a head vector x in R^d into d/2 pairs
(x_i, x_{i+d/2}) and rotate pair i of the token at position p by the angle p * theta_i, with

    theta_i = base^(-2i/d),    i = 0 .. d/2 - 1.

Queries and keys are rotated, values are not. Since a rotation R(a) satisfies
R(a)^T R(b) = R(b - a), the score of a query at m and a key at n is

    (R(m theta) q) . (R(n theta) k) = q . R((n - m) theta) k,

a function of the offset n - m only: attention sees relative positions although each token is
rotated by its absolute one. Pair 0 turns by one radian per token (fine, local detail); the last
pair turns very slowly (a wavelength of about 2 pi base tokens: coarse, long range).

**Context extension.** A model trained on contexts up to T has seen offsets < T only. To run it
on s * T tokens:

* *position interpolation* (Chen et al., 2023) divides every position by s, i.e. every
  frequency: theta_i' = theta_i / s. All offsets land back in the trained range, at the price of
  packing neighbouring tokens s times closer (short fine-tuning recovers that).
* *NTK-aware scaling* ("bloc97", 2023) raises the base instead: base' = base * s^(d / (d - 2)),
  so theta_i' = theta_i * s^(-2i / (d - 2)). The fastest pair (i = 0) is untouched and the
  slowest (i = d/2 - 1) is divided by exactly s: local detail keeps its resolution while the long
  wavelengths stretch to cover the longer context; it works better without fine-tuning.

**ALiBi** (Press et al., 2022, "Train Short, Test Long"). No rotation at all: head h adds a
linear penalty to its scores, score(m, n) += -m_h * (m - n) for n <= m, with slopes forming a
geometric sequence. For a power of two n_heads: m_h = 2^(-8h / n_heads), h = 1 .. n_heads. For
other head counts the paper takes the slopes of the next lower power of two, n', and adds every
other slope of 2 n' until there are n_heads of them.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn


def rope_inv_freq(head_dim: int, theta: float) -> Tensor:
    """theta_i = theta^(-2i/d) for i = 0 .. d/2 - 1 (the standard RoPE frequencies), float64.

    Always computed on the CPU (a few numbers; also under a ``torch.device`` context).
    """
    if head_dim % 2 != 0 or head_dim < 2:
        raise ValueError(f"RoPE needs an even head_dim >= 2, got {head_dim}.")
    return 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim)
    )


def rope_cos_sin(inv_freq: Tensor, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and sin of the angles p * theta_i, shaped [seq, head_dim] (each half repeated)."""
    angles = positions.to(torch.float32)[:, None] * inv_freq.to(torch.float32)[None, :]
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs (x_i, x_{i+d/2}) of ``x`` [batch, heads, seq, d] by the given angles.

    (x_1, x_2) -> (x_1 cos - x_2 sin, x_2 cos + x_1 sin), the "rotate half" layout used by
    transformers' Llama (the GGUF loader converts llama.cpp's interleaved layout to this one).
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos + rotated * sin


def rotate(x: Tensor, positions: Tensor, inv_freq: Tensor) -> Tensor:
    """RoPE as one standalone function: ``x`` [..., seq, d] rotated to ``positions`` [seq]."""
    cos, sin = rope_cos_sin(inv_freq, positions, x.dtype)
    return apply_rope(x, cos, sin)


def interpolated_inv_freq(inv_freq: Tensor, factor: float) -> Tensor:
    """Position interpolation: theta_i / s, i.e. position p is read as p / s."""
    check_factor(factor)
    return inv_freq / factor


def ntk_inv_freq(head_dim: int, theta: float, factor: float) -> Tensor:
    """NTK-aware scaling: the frequencies of base * s^(d / (d - 2))."""
    check_factor(factor)
    return rope_inv_freq(head_dim, theta * factor ** (head_dim / (head_dim - 2)))


def check_factor(factor: float) -> None:
    if not factor >= 1.0:
        raise ValueError(
            f"A context-extension factor must be >= 1 (new length / trained length), got {factor}."
        )


@contextmanager
def rope_frequencies(model: nn.Module, inv_freq: Tensor) -> Iterator[nn.Module]:
    """Run ``model`` (a ``Transformer``) with other RoPE frequencies inside a ``with`` block."""
    old = model.inv_freq
    if inv_freq.shape != old.shape:
        raise ValueError(
            f"inv_freq must have shape {tuple(old.shape)} (head_dim / 2 values), "
            f"got {tuple(inv_freq.shape)}."
        )
    model.inv_freq = inv_freq.to(old.device, old.dtype)
    try:
        yield model
    finally:
        model.inv_freq = old


def alibi_slopes(n_heads: int) -> Tensor:
    """ALiBi's per-head slopes m_h (float64), following the paper's rule for any head count."""
    if n_heads < 1:
        raise ValueError(f"n_heads must be at least 1, got {n_heads}.")
    lower = 2 ** math.floor(math.log2(n_heads))
    slopes = geometric_slopes(lower)
    if lower < n_heads:
        slopes = torch.cat([slopes, geometric_slopes(2 * lower)[0::2][: n_heads - lower]])
    return slopes


def geometric_slopes(n: int) -> Tensor:
    """2^(-8h/n) for h = 1 .. n."""
    return 2.0 ** (-8.0 * torch.arange(1, n + 1, dtype=torch.float64) / n)


def alibi_bias(n_heads: int, q_len: int, k_len: int | None = None) -> Tensor:
    """The additive bias [n_heads, q_len, k_len]: -m_h * (i - j), queries aligned to the end.

    Query i sits at position (k_len - q_len + i), so a decode step (q_len = 1) is the last row
    of the full matrix. Future keys (j > i) get a bias of 0 here: combine with a causal mask.
    """
    k_len = q_len if k_len is None else k_len
    if q_len > k_len:
        raise ValueError(f"q_len ({q_len}) cannot exceed k_len ({k_len}): queries are keys too.")
    q_pos = torch.arange(k_len - q_len, k_len, dtype=torch.float64)
    distance = (q_pos[:, None] - torch.arange(k_len, dtype=torch.float64)[None, :]).clamp(min=0)
    return -alibi_slopes(n_heads)[:, None, None] * distance


__all__ = [
    "alibi_bias",
    "alibi_slopes",
    "apply_rope",
    "interpolated_inv_freq",
    "ntk_inv_freq",
    "rope_cos_sin",
    "rope_frequencies",
    "rope_inv_freq",
    "rotate",
]
