"""NF4 (minisparse.quant.nf4) against references written from the definition, in float64."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from minisparse.quant.nf4 import (
    NF4_LEVELS,
    NF4Linear,
    NF4Tensor,
    bits_per_weight,
    double_dequantize,
    double_quantize,
    nf4_dequantize,
    nf4_quantize,
    nf4_vs_int4,
)

# Table of the 16 NF4 values published with QLoRA (Dettmers et al. 2023, appendix E).
PUBLISHED = [
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
]


def weights(rows: int, cols: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=gen) * 0.05 + 0.001


def reference_nf4(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes by brute force (nearest of the 16 levels) and absmax per block, in float64."""
    rows, cols = w.shape
    blocks = w.double().reshape(rows, cols // block, block)
    absmax = blocks.abs().amax(-1)
    x = blocks / absmax[..., None]
    levels = torch.tensor(PUBLISHED, dtype=torch.float64)
    codes = (x[..., None] - levels).abs().argmin(-1).reshape(rows, cols)
    return codes, absmax


def test_levels_match_the_published_table():
    assert NF4_LEVELS.shape == (16,)
    assert torch.allclose(
        NF4_LEVELS.double(), torch.tensor(PUBLISHED, dtype=torch.float64), atol=1e-4, rtol=0
    )
    assert (
        (NF4_LEVELS > 0).sum() == 8 and (NF4_LEVELS < 0).sum() == 7 and (NF4_LEVELS == 0).sum() == 1
    )


@pytest.mark.parametrize(
    ("seed", "rows", "cols", "block"), [(0, 8, 128, 64), (1, 5, 96, 32), (2, 3, 48, 16)]
)
def test_quantize_and_dequantize_match_the_definition(seed, rows, cols, block):
    w = weights(rows, cols, seed)
    codes, absmax = nf4_quantize(w, block)
    ref_codes, ref_absmax = reference_nf4(w, block)
    assert codes.dtype == torch.uint8 and codes.shape == (rows, cols)
    assert absmax.dtype == torch.float32 and absmax.shape == (rows, cols // block)
    assert torch.equal(codes.long(), ref_codes)
    assert torch.equal(absmax, ref_absmax.float())
    w_hat = nf4_dequantize(codes, absmax, block)
    ref_hat = NF4_LEVELS.double()[ref_codes] * ref_absmax.repeat_interleave(block, 1)
    torch.testing.assert_close(w_hat.double(), ref_hat, atol=1e-7, rtol=1e-6)
    # the largest weight of each block comes back exactly (level ±1)
    blocks = w.reshape(rows, -1, block).abs().amax(-1)
    assert torch.equal(w_hat.reshape(rows, -1, block).abs().amax(-1), blocks)


def test_zero_blocks_and_zeros_stay_zero():
    w = weights(2, 64, 3)
    w[0, :32] = 0
    w[1, ::4] = 0
    codes, absmax = nf4_quantize(w, 32)
    w_hat = nf4_dequantize(codes, absmax, 32)
    assert absmax[0, 0] == 0 and bool((w_hat[w == 0] == 0).all())


def test_block_size_must_divide_the_rows():
    with pytest.raises(ValueError, match="does not divide"):
        nf4_quantize(weights(2, 96, 0), 64)
    with pytest.raises(ValueError, match="block_size"):
        nf4_quantize(weights(2, 96, 0), 0)
    with pytest.raises(ValueError, match="2-D"):
        nf4_quantize(torch.ones(4), 4)
    with pytest.raises(ValueError, match="NaN"):
        nf4_quantize(torch.full((2, 8), float("nan")), 4)


def reference_double(absmax: torch.Tensor, block: int) -> torch.Tensor:
    """The scales after the log-grid round trip, in float64 from the definition: per block its
    largest M, one step h = (widest log2(M / smallest non-zero)) / 254 for the whole tensor,
    ĉ = M · 2^(−round(log2(M / c) / h) h), zeros kept."""
    a = absmax.double()
    blocks = a.split(block)
    ratios = [torch.log2(g.max() / g[g > 0]) for g in blocks if bool((g > 0).any())]
    h = max(float(r.max()) for r in ratios) / 254 if ratios else 0.0
    out = []
    for g in blocks:
        m = g.max()
        r = torch.log2(m / g.clamp_min(1e-300))
        k = torch.round(r / h) if h > 0 else torch.zeros_like(r)
        out.append(torch.where(g > 0, m * torch.exp2(-k * h), 0.0))
    return torch.cat(out)


@pytest.mark.parametrize(
    ("seed", "n", "block", "outlier"),
    [(0, 1000, 256, None), (1, 300, 64, 10.0), (2, 5, 256, None), (3, 700, 256, 1e38)],
)
def test_double_quantization_matches_the_log_grid(seed, n, block, outlier):
    gen = torch.Generator().manual_seed(seed)
    absmax = torch.rand(n, generator=gen) * 0.1 + 0.02
    absmax[3] = 0.0  # an all-zero block of weights
    if outlier is not None:
        absmax[n // 2] = outlier
    codes, maxima, step = double_quantize(absmax, block)
    assert codes.dtype == torch.uint8 and codes.shape == absmax.shape and codes[3] == 0
    assert torch.equal(maxima, torch.stack([g.max() for g in absmax.split(block)]))
    back = double_dequantize(codes, maxima, step, block)
    ref = reference_double(absmax, block)
    assert back.shape == absmax.shape and bool((back >= 0).all()) and back[3] == 0
    torch.testing.assert_close(back.double(), ref, atol=0, rtol=1e-5)
    # never above the block's largest scale, and within half a step (a factor 2^(h/2)) of c
    bound = 2 ** (float(step) / 2) * (1 + 1e-6)
    kept = absmax > 0
    ratio = back[kept].double() / absmax[kept].double()
    assert bool((ratio <= bound).all()) and bool((ratio >= 1 / bound).all())


@settings(max_examples=40)
@given(
    row=st.integers(0, 63),
    col=st.integers(0, 255),
    outlier=st.sampled_from([10.0, 1000.0, 1e38, -1e38]),
    seed=st.integers(0, 2**16),
)
def test_double_quantization_holds_any_outlier(row, col, outlier, seed):
    """One outlier among small weights ([64, 256], 0.01 · N(0, 1)): double quantization keeps
    every sign and stays finite, and its error on the other blocks is plain NF4's plus at most
    half a log step of every scale (≤ 1.05 times plain NF4's for 10 and 1000, ≤ 2 for ±1e38)."""
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(seed)) * 0.01
    w[row, col] = outlier
    others = torch.ones_like(w, dtype=torch.bool)
    others[row, col // 64 * 64 : col // 64 * 64 + 64] = False  # the outlier's own NF4 block
    plain = NF4Tensor.quantize(w, 64, double=False).dequantize().double()
    double = NF4Tensor.quantize(w, 64, double=True)
    hat = double.dequantize().double()
    assert bool(torch.isfinite(hat).all())
    assert torch.equal(torch.sign(hat), torch.sign(plain))  # the same codes, positive scales
    assert float(hat[row, col]) == pytest.approx(float(plain[row, col]), rel=1e-6)  # a maximum
    w64 = w.double()[others]
    plain_err = float((plain[others] - w64).norm())
    double_err = float((hat[others] - w64).norm())
    half_step = 2 ** (float(double.absmax_step) / 2) - 1
    assert double_err <= plain_err + half_step * float(plain[others].norm()) * (1 + 1e-6)
    assert double_err <= (1.05 if abs(outlier) < 1e4 else 2.0) * plain_err


def test_bits_per_weight():
    assert bits_per_weight(64, double=False) == 4.5
    assert bits_per_weight(64, double=True) == pytest.approx(4 + 8 / 64 + 32 / (64 * 256))
    assert round(bits_per_weight(64), 3) == 4.127


@pytest.mark.parametrize("double", [False, True])
def test_nf4_linear_computes_with_the_dequantized_weight(double):
    torch.manual_seed(0)
    linear = nn.Linear(64, 12, bias=True)
    layer = NF4Linear.from_linear(linear, 32, double=double)
    codes, absmax = nf4_quantize(linear.weight.detach(), 32)
    if double:
        absmax = double_dequantize(*double_quantize(absmax))
    w_hat = nf4_dequantize(codes, absmax, 32).double()
    x = torch.randn(3, 5, 64)
    ref = x.double() @ w_hat.T + linear.bias.detach().double()
    torch.testing.assert_close(layer(x).double(), ref, atol=1e-5, rtol=1e-5)
    assert not any(True for _ in layer.parameters())  # frozen: codes and scales are buffers
    assert NF4Tensor.quantize(
        linear.weight.detach(), 32, double
    ).bits_per_weight() == bits_per_weight(32, double)


def test_quantize_fn_plugs_in_a_learners_quantizer():
    linear = nn.Linear(32, 4, bias=False)
    calls = []

    def mine(w, block):
        calls.append(block)
        return nf4_quantize(w, block)

    layer = NF4Linear.from_linear(linear, 16, double=False, quantize_fn=mine)
    assert calls == [16] and torch.equal(layer.codes, nf4_quantize(linear.weight.detach(), 16)[0])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_nf4_beats_int4_on_gaussian_weights(seed):
    w = weights(64, 256, seed)
    result = nf4_vs_int4(w, 64)
    int4 = w.double().reshape(64, -1, 64)
    s = int4.abs().amax(-1, keepdim=True) / 7
    ref_int4 = (
        ((torch.round(int4 / s).clamp(-7, 7) * s).reshape(64, 256) - w.double()).pow(2).mean()
    )
    assert result["int4_mse"] == pytest.approx(float(ref_int4), rel=1e-5)
    assert result["nf4_mse"] < result["int4_mse"]
    assert result["ratio"] == pytest.approx(result["nf4_mse"] / result["int4_mse"])
