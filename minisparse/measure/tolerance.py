"""How far apart two correct float32 computations of the same math may be, from the arithmetic.

A check "ours equals the reference" compares two float32 computations that round differently:
another order of a sum, another ``sin``, a fused multiply-add or not, another vector width on
another CPU. Its bound must come from the rounding error of the computation, not from the
difference one machine happened to show (a bound of 1e-5 on RoPE held on AMD CPUs and failed
on an Intel one). Each function here gives the worst-case difference between two
implementations that are each correct to float32 rounding, so a check that uses it holds on
every CPU, while a real mistake (a wrong pairing, a missing scale, a wrong mask) is off by
orders of magnitude more. u = 2^-24 is float32's unit roundoff.

* A sum of n products (Higham, *Accuracy and Stability of Numerical Algorithms*, §3.1):
  |fl(Σ a_i b_i) - Σ a_i b_i| <= γ_n Σ |a_i b_i|, with γ_n = n u / (1 - n u) (``gamma``).
* RoPE rotates pairs by the angle a = p θ_i. The angle is rounded twice (θ_i, then the
  product): |δa| <= 2 a u. ``cos`` and ``sin`` are within 2 u of their true values at the
  rounded angle, and x_1 cos a - x_2 sin a adds three roundings. With |x_j| <= X:
  |error| <= X (√2 |δa| + 4 u) + 3 √2 u X <= X (2√2 a u + 9 u) (``rope_bound``).
* Softmax attention with d-dimensional heads over n keys: each score q·k / √d is off by at
  most ε = γ_{d+3} max_pairs Σ|q_i k_i| / √d (three more roundings: the 1/√d factor
  and its product, or the scale applied to q and to k); the softmax weights then move by at most 2 ε
  relative, and their exponentials, sum and (in the tiled form) rescalings add (2 n + 3) u
  relative; the output Σ p_j v_j adds γ_n. With |v| <= V:
  |error| <= V (2 ε + (2 n + 3) u + γ_n) (``attention_bound``).

Each bound is for one implementation against the exact value; two implementations differ by
at most twice it, which is what the functions return.
"""

from __future__ import annotations

import math

from torch import Tensor

__all__ = ["U32", "attention_bound", "gamma", "rope_bound"]

U32 = 2.0**-24  # float32 unit roundoff


def gamma(n: int, u: float = U32) -> float:
    """γ_n = n u / (1 - n u): the relative error bound of a sum of n terms."""
    if n * u >= 1:
        raise ValueError(f"gamma({n}) is unbounded at unit roundoff {u}: n u >= 1.")
    return n * u / (1 - n * u)


def rope_bound(x: Tensor, positions: Tensor, inv_freq: Tensor) -> float:
    """The most two correct float32 rotations of ``x`` at ``positions`` may differ by."""
    angle = float(positions.abs().max()) * float(inv_freq.abs().max())
    one = float(x.abs().max()) * (2 * math.sqrt(2) * angle * U32 + 9 * U32)
    return 2 * one


def attention_bound(q: Tensor, k: Tensor, v: Tensor) -> float:
    """The most two correct float32 softmax attentions of q [.., Hq, n_q, d] over k, v
    [.., Hk, n, d] may differ by (Hq a multiple of Hk: grouped heads; scores scaled by 1/√d;
    a mask only lowers it)."""
    d, n = q.shape[-1], k.shape[-2]
    group = q.shape[-3] // k.shape[-3]
    k_abs = k.abs().repeat_interleave(group, dim=-3)
    largest = float((q.abs() @ k_abs.transpose(-1, -2)).max())  # max over pairs of Σ |q_i k_i|
    score_error = gamma(d + 3) * largest / math.sqrt(d)
    one = float(v.abs().max()) * (2 * score_error + (2 * n + 3) * U32 + gamma(n))
    return 2 * one
