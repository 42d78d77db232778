"""NF4 (minisparse.quant.nf4) against references written from the definition, in float64."""

from __future__ import annotations

import pytest
import torch
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


@pytest.mark.parametrize(("seed", "n", "block"), [(0, 1000, 256), (1, 300, 64), (2, 5, 256)])
def test_double_quantization_matches_int8_absmax_after_the_mean(seed, n, block):
    gen = torch.Generator().manual_seed(seed)
    absmax = torch.rand(n, generator=gen) * 0.1 + 0.02
    codes, scales, mean = double_quantize(absmax, block)
    a = absmax.double()
    ref_mean = a.mean()
    centred = a - ref_mean
    ref_scales = torch.stack([g.abs().max() / 127 for g in centred.split(block)])
    ref_codes = torch.cat(
        [torch.round(g / s) for g, s in zip(centred.split(block), ref_scales, strict=True)]
    )
    assert codes.dtype == torch.int8 and codes.shape == absmax.shape
    torch.testing.assert_close(mean.double(), ref_mean, atol=1e-8, rtol=0)
    torch.testing.assert_close(scales.double(), ref_scales, atol=1e-9, rtol=1e-6)
    assert (codes.long() - ref_codes.long()).abs().max() <= 1  # float32 vs float64 at a .5 tie
    back = double_dequantize(codes, scales, mean, block)
    assert back.shape == absmax.shape
    bound = ref_scales.repeat_interleave(block)[:n] / 2 + 1e-6
    assert bool(((back.double() - a).abs() <= bound).all())


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
