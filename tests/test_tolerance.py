"""The float32 error bounds (minisparse.measure.tolerance): they hold against float64 on fresh
random inputs, and the mistakes the checks that use them guard against break them."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from minisparse.core.rope import rope_inv_freq, rotate
from minisparse.measure.tolerance import U32, attention_bound, gamma, rope_bound


def test_gamma_is_the_sum_bound_and_refuses_huge_n():
    assert gamma(1) == pytest.approx(U32)
    assert gamma(1000) == pytest.approx(1000 * U32, rel=1e-4)
    with pytest.raises(ValueError, match="unbounded"):
        gamma(2**24)


@pytest.mark.parametrize("seed,high,theta", [(0, 128, 1e4), (1, 8192, 1e5), (2, 40000, 5e5)])
def test_rope_bound_holds_against_float64_and_a_shifted_position_breaks_it(seed, high, theta):
    gen = torch.Generator().manual_seed(seed)
    x = 3 * torch.randn(2, 5, 40, 64, generator=gen)
    positions = torch.randint(0, high, (40,), generator=gen)
    inv_freq = rope_inv_freq(64, theta)
    exact = rotate(x.double(), positions, rope_inv_freq(64, theta).double())
    ours = rotate(x, positions, inv_freq)
    bound = rope_bound(x, positions, inv_freq)
    assert (ours.double() - exact).abs().max() <= bound / 2  # one implementation: half of it
    wrong = rotate(x, positions + 1, inv_freq)  # off by one position
    assert (wrong.double() - exact).abs().max() > 10 * bound


@pytest.mark.parametrize("n,d,scale", [(13, 16, 1.0), (300, 64, 1.0), (77, 64, 4.0)])
def test_attention_bound_holds_against_float64_and_a_missing_scale_breaks_it(n, d, scale):
    gen = torch.Generator().manual_seed(n + d)
    q, k, v = (scale * torch.randn(1, 3, n, d, generator=gen) for _ in range(3))
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    ours = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    bound = attention_bound(q, k, v)
    assert (ours.double() - exact).abs().max() <= bound / 2
    unscaled = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0)
    assert (unscaled.double() - exact).abs().max() > 10 * bound
    assert bound < 1e-2 * float(v.abs().max())  # tight enough to mean something
    assert math.isfinite(bound)
