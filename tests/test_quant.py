"""Quantization: round trips, equivalent scaling, GPTQ vs RTN, int8/int4 layers, errors."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import tiny_model
from minisparse.bench.quant import VARIANTS, bench_quant
from minisparse.cli import main
from minisparse.core.model import param_bytes
from minisparse.quant import (
    ActQuantLinear,
    Int4Linear,
    Int8Linear,
    QuantSpec,
    block_groups,
    fake_quantize,
    quantize_model,
    quantize_tensor,
    streamed_bytes,
)
from minisparse.quant.gptq import gptq_quantize, hessian, output_error
from minisparse.quant.smoothing import (
    awq_search,
    fold_scales,
    smooth_model,
    smoothquant_scales,
    to_prev_channels,
)
from minisparse.runtime.generate import generate

BF16_EPS = 2.0**-8  # unit roundoff of bfloat16 (8 bits of mantissa)


def random_matrix(rows: int, cols: int, seed: int, spread: float = 1.0) -> torch.Tensor:
    """Fresh normal values with a few channels `spread` times larger (no exact zeros)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen)
    x[:, torch.randperm(cols, generator=gen)[: max(1, cols // 10)]] *= spread
    return x


# --------------------------------------------------------------------------------------------
# Tensors
# --------------------------------------------------------------------------------------------


@st.composite
def specs_and_shapes(draw):
    rows, cols = draw(st.integers(1, 9)), draw(st.integers(1, 70))
    bits = draw(st.sampled_from([2, 3, 4, 8]))
    kind = draw(st.sampled_from(["tensor", "channel", "group"]))
    group = draw(st.integers(1, cols)) if kind == "group" else None
    spec = QuantSpec(bits, group, draw(st.booleans()), per_tensor=kind == "tensor")
    return spec, rows, cols, draw(st.integers(0, 2**16)), draw(st.sampled_from([1.0, 30.0]))


@settings(max_examples=150, deadline=None)
@given(specs_and_shapes())
def test_round_trip_error_is_at_most_half_a_step(case):
    spec, rows, cols, seed, spread = case
    x = random_matrix(rows, cols, seed, spread)
    qt = quantize_tensor(x, spec)
    assert qt.q.shape == x.shape and qt.q.dtype == (torch.int8 if spec.symmetric else torch.uint8)
    assert int(qt.q.min()) >= spec.qmin and int(qt.q.max()) <= spec.qmax
    step = qt.columns(qt.scale)
    err = (qt.dequantize() - x).abs()
    assert (err <= step / 2 + 1e-6 * x.abs().max()).all()
    # Grid points are fixed points: quantizing the dequantized values changes nothing.
    x_hat = qt.dequantize()
    torch.testing.assert_close(
        fake_quantize(x_hat, spec), x_hat, rtol=0, atol=1e-5 * float(step.max())
    )


def test_granularities_use_their_own_ranges():
    x = random_matrix(6, 10, seed=1, spread=50.0)
    per_tensor = quantize_tensor(x, QuantSpec(4, per_tensor=True))
    per_row = quantize_tensor(x, QuantSpec(4))
    grouped = quantize_tensor(x, QuantSpec(4, group_size=4))  # groups of 4, 4 and a short 2
    assert per_tensor.scale.shape == (1, 1) and per_row.scale.shape == (6, 1)
    assert grouped.scale.shape == (6, 3)
    torch.testing.assert_close(per_tensor.scale[0, 0], x.abs().max() / 7)
    # The short last group is quantized as if it stood alone.
    last = quantize_tensor(x[:, 8:], QuantSpec(4))
    torch.testing.assert_close(grouped.dequantize()[:, 8:], last.dequantize())
    # Finer granularity, smaller error.
    errors = [(q.dequantize() - x).pow(2).mean() for q in (per_tensor, per_row, grouped)]
    assert errors[0] > errors[1] > errors[2]


def test_asymmetric_grid_is_exact_on_its_own_levels():
    # Values s * q + m with q in 0..15 (llama.cpp's Q4_1 layout) come back exactly.
    gen = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 16, (8, 32), generator=gen).float()
    codes[:, 0], codes[:, 1] = 0, 15  # every row spans the whole grid
    s, m = torch.rand(8, 1, generator=gen) + 0.1, torch.randn(8, 1, generator=gen)
    x = s * codes + m
    torch.testing.assert_close(fake_quantize(x, QuantSpec(4, 32, symmetric=False)), x)


def test_clip_shrinks_the_range():
    x = random_matrix(4, 64, seed=3)
    full, clipped = quantize_tensor(x, QuantSpec(4)), quantize_tensor(x, QuantSpec(4), clip=0.5)
    torch.testing.assert_close(clipped.scale, full.scale * 0.5)
    assert (clipped.dequantize().abs() <= 0.5 * x.abs().amax(1, keepdim=True) + 1e-6).all()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bits": 1}, "from 2 to 8"),
        ({"bits": 16}, "from 2 to 8"),
        ({"bits": 4.5}, "whole number"),
        ({"bits": True}, "whole number"),
        ({"bits": 4, "group_size": 0}, "positive number of columns"),
        ({"bits": 4, "group_size": -128}, "positive number of columns"),
        ({"bits": 4, "group_size": 64.0}, "positive number of columns"),
        ({"bits": 4, "group_size": 64, "per_tensor": True}, "group_size=None"),
    ],
)
def test_bad_specs_raise_one_clear_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        QuantSpec(**kwargs)


def test_group_larger_than_the_row_names_the_fix():
    with pytest.raises(ValueError, match="at most 48"):
        quantize_tensor(torch.randn(4, 48), QuantSpec(4, group_size=64))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"method": "nf4"}, "Unknown method"),
        ({"bits": 16}, "from 2 to 8"),
        ({"bits": 4, "group_size": 0}, "positive number of columns"),
        ({"bits": 8, "act_bits": 1}, "act_bits must be"),
        ({"bits": 3, "packed": True}, "bits=8 or bits=4"),
        ({"bits": 8, "group_size": 16, "packed": True}, "one symmetric scale per output channel"),
        ({"bits": 8, "act_bits": 8, "packed": True}, "weight-only"),
        ({"method": "gptq", "bits": 4}, "needs calibration text"),
        ({"method": "awq", "bits": 4, "calib_batches": torch.zeros(8)}, "token ids"),
        ({"method": "smoothquant", "alpha": 1.5}, "alpha must be in"),
        ({"method": "awq", "bits": 4, "awq_grid": 0}, "awq_grid must be"),
        ({"method": "gptq", "bits": 4, "gptq_damp": 0.0}, "gptq_damp must be > 0"),
    ],
)
def test_bad_model_options_raise_one_clear_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        quantize_model(tiny_model(), progress=False, **kwargs)


def test_unknown_option_is_named():
    with pytest.raises(TypeError, match="Unknown options for rtn: \\['grup_size'\\]"):
        quantize_model(tiny_model(), grup_size=4)
    # each method has its own settings: another method's option is named as such
    with pytest.raises(TypeError, match="alpha \\(an option of smoothquant\\)"):
        quantize_model(tiny_model(), method="gptq", bits=4, alpha=0.5)
    with pytest.raises(TypeError, match="\\['alpha \\(an option of smoothquant\\)', 'grup'\\]"):
        quantize_model(tiny_model(), method="gptq", bits=4, alpha=0.5, grup=1)


def test_quantization_methods_come_from_one_registry():
    from minisparse.quant import QUANT_METHODS, QuantConfig

    assert list(QUANT_METHODS) == ["rtn", "gptq", "smoothquant", "awq"]
    assert [m.calibrated for m in QUANT_METHODS.values()] == [False, True, True, True]
    awq = QuantConfig.build("awq", bits=4, group_size=32, awq_grid=4)
    assert awq.options.awq_grid == 4 and awq.options.awq_clip and awq.calibrated
    assert QuantConfig.build("smoothquant").act_bits == 8  # W8A8: the method implies it


# --------------------------------------------------------------------------------------------
# Equivalent scaling (SmoothQuant, AWQ) before any rounding
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])  # MHA, GQA, MQA: o_proj's scales are shared
def test_folding_scales_leaves_a_layer_unchanged(n_kv_heads):
    model = tiny_model(seed=5, std=0.1, n_kv_heads=n_kv_heads).double()
    layer = model.layers[0]
    smoothed = copy.deepcopy(layer)
    gen = torch.Generator().manual_seed(0)
    for group in block_groups(model):
        prev = smoothed.get_submodule(group.prev)
        channels = prev.weight.shape[0]
        fold_scales(
            smoothed, group, torch.rand(channels, generator=gen, dtype=torch.float64) * 4 + 0.1
        )
    x = torch.randn(2, 9, 48, generator=gen, dtype=torch.float64)
    pos = torch.arange(9)
    from minisparse.core.rope import rope_cos_sin

    cos, sin = rope_cos_sin(model.inv_freq, pos, x.dtype)
    with torch.no_grad():
        want, got = layer(x, cos, sin, pos, None), smoothed(x, cos, sin, pos, None)
    assert not torch.equal(smoothed.attn.o_proj.weight, layer.attn.o_proj.weight)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("method", ["smoothquant", "awq"])
def test_smoothing_alone_leaves_the_model_unchanged(method):
    model = tiny_model(seed=6, std=0.1)
    with torch.no_grad():  # outlier channels in the norms, as in real LLMs
        for layer in model.layers:
            layer.attn_norm.weight[[3, 17]] *= 25
            layer.mlp_norm.weight[[5]] *= 25
    model = model.double()
    tokens = torch.randint(0, 97, (3, 20), generator=torch.Generator().manual_seed(1))
    smoothed = smooth_model(model, tokens, method, progress=False, bits=4, group_size=16)
    assert not torch.equal(smoothed.layers[0].attn_norm.weight, model.layers[0].attn_norm.weight)
    with torch.no_grad():
        torch.testing.assert_close(smoothed(tokens), model(tokens), rtol=0, atol=1e-5)


def test_smoothquant_flattens_the_activation_outliers():
    x = random_matrix(256, 64, seed=7, spread=40.0)
    w = random_matrix(32, 64, seed=8)
    group = block_groups(tiny_model())[0]
    s = smoothquant_scales(x, [w], group, alpha=0.5)
    ratio = lambda v: float(v.abs().amax(0).max() / v.abs().amax(0).median())  # noqa: E731
    assert ratio(x / s) < ratio(x) / 4
    torch.testing.assert_close((x / s) @ (w * s).T, x @ w.T, rtol=1e-4, atol=1e-4)


def test_awq_search_starts_from_round_to_nearest():
    # alpha = 0 gives s = 1: the first loss of the grid is plain RTN's output error.
    x, w = random_matrix(128, 64, seed=9, spread=20.0), random_matrix(48, 64, seed=10)
    group = block_groups(tiny_model())[0]
    spec = QuantSpec(4, 16, symmetric=False)
    search = awq_search(x, [w], group, spec, n_grid=10)
    rtn = (x @ fake_quantize(w, spec).T - x @ w.T).pow(2).mean()
    assert search.losses[0] == pytest.approx(float(rtn), rel=1e-5)
    assert min(search.losses) < search.losses[0]  # salient channels: scaling helps
    assert search.best_alpha > 0


def test_scales_cannot_fold_through_a_threshold():
    model = tiny_model()
    model.layers[0].attn_in_act = torch.nn.ReLU()
    group = block_groups(model)[0]
    with pytest.raises(ValueError, match="quantize the model first"):
        fold_scales(model.layers[0], group, torch.ones(48))


def test_gqa_statistics_reduce_over_the_query_heads_of_a_value_head():
    model = tiny_model(n_heads=4, n_kv_heads=2)  # head_dim 12: o_proj input 48, v_proj out 24
    group = block_groups(model)[1]
    v = torch.arange(48.0)
    assert to_prev_channels(group, v).tolist() == [*range(12, 24), *range(36, 48)]


# --------------------------------------------------------------------------------------------
# GPTQ
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec",
    [
        QuantSpec(4, 16, symmetric=False),
        QuantSpec(3, None, symmetric=True),
        QuantSpec(4, 24, symmetric=True),  # a short last group (56 = 2 x 24 + 8)
        QuantSpec(4, per_tensor=True),
        QuantSpec(8),
    ],
)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gptq_output_error_is_at_most_rtn(spec, seed):
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(56, 56, generator=gen) / 56**0.5 + torch.eye(56)
    x = torch.randn(400, 56, generator=gen) @ mix  # correlated inputs, as in a real layer
    w = torch.randn(40, 56, generator=gen)
    qt = gptq_quantize(w, hessian(x), spec, damp=0.01, block_size=16)
    rtn = output_error(x, w, fake_quantize(w, spec))
    gptq = output_error(x, w, qt.dequantize())
    assert gptq <= rtn
    assert int(qt.q.min()) >= spec.qmin and int(qt.q.max()) <= spec.qmax


def test_gptq_leaves_its_input_untouched():
    # An input-major weight (how minisparse stores them): its transpose is contiguous memory.
    w = random_matrix(32, 24, seed=12).t().contiguous().t()
    before = w.clone()
    gptq_quantize(w, hessian(torch.randn(64, 24)), QuantSpec(4, 8, symmetric=False))
    assert torch.equal(w, before)


def test_gptq_on_uncorrelated_inputs_of_one_column_is_rtn():
    # With a diagonal Hessian no other column can absorb the error: GPTQ = RTN exactly.
    x = torch.randn(100, 32, generator=torch.Generator().manual_seed(4))
    w = random_matrix(8, 32, seed=5)
    spec = QuantSpec(4, 8, symmetric=False)
    h = torch.diag(torch.rand(32, generator=torch.Generator().manual_seed(6)) + 0.5)
    torch.testing.assert_close(gptq_quantize(w, h, spec).dequantize(), fake_quantize(w, spec))
    assert output_error(x, w, w) == 0.0


# --------------------------------------------------------------------------------------------
# Quantized layers
# --------------------------------------------------------------------------------------------


def bf16_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Error bound of a product with bfloat16 inputs, weights and output: a few roundings of
    sum |x||w| per output."""
    return 4 * BF16_EPS * (x.abs() @ w.abs().T) + 1e-6


@pytest.mark.parametrize(
    ("out_f", "in_f", "fast"), [(77, 64, True), (96, 576, True), (37, 53, False)]
)
def test_int8_linear_equals_fake_quant(out_f, in_f, fast):
    gen = torch.Generator().manual_seed(out_f)
    linear = torch.nn.Linear(in_f, out_f)
    with torch.no_grad():
        linear.weight.copy_(random_matrix(out_f, in_f, seed=out_f, spread=10.0))
    layer = Int8Linear.from_linear(linear)
    assert layer.fast == fast  # the CPU kernel needs input sizes that are multiples of 16
    w_hat = fake_quantize(linear.weight.detach(), QuantSpec(8))
    for rows in (1, 5):  # decode and prefill
        x = torch.randn(rows, in_f, generator=gen)
        want = F.linear(x, w_hat, linear.bias.detach())
        assert ((layer(x) - want).abs() <= bf16_bound(x, w_hat)).all()
    assert layer(torch.randn(2, 3, in_f)).shape == (2, 3, out_f)


@pytest.mark.parametrize(
    ("spec", "out_f", "in_f"),
    [
        (QuantSpec(4, 32, symmetric=False), 32, 128),
        (QuantSpec(4, 64, symmetric=True), 48, 192),
        (QuantSpec(4, 128, symmetric=False), 16, 192),  # short last group: kernel blocks of 64
        (QuantSpec(4, None, symmetric=False), 16, 96),  # per channel: blocks of 32
    ],
)
def test_int4_linear_equals_fake_quant(spec, out_f, in_f):
    w = random_matrix(out_f, in_f, seed=in_f, spread=10.0)
    qt = quantize_tensor(w, spec)
    layer = Int4Linear(qt)
    assert layer.fast == hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
    w_hat = qt.dequantize()
    gen = torch.Generator().manual_seed(0)
    for rows in (1, 7):
        x = torch.randn(rows, in_f, generator=gen)
        # bfloat16 activations, scales and offsets: a few roundings of sum |x| (|s q| + |m|)
        bound = bf16_bound(x, w_hat) + 4 * BF16_EPS * (x.abs() @ qt.columns(qt.scale).T) * 8
        assert ((layer(x) - x @ w_hat.T).abs() <= bound).all()


@pytest.mark.parametrize("spec, cols", [(QuantSpec(4, 32, symmetric=False), 128),
                                        (QuantSpec(4, 128, symmetric=True), 192)])  # fmt: skip
def test_int4_blocks_hold_the_weights_of_the_kernels_packed_codes(spec, cols):
    """The decode step's 4-bit blocks and torch's packed int4 layout hold the same weights: the
    kernel applied to the identity (bfloat16 outputs) gives ``dequantized`` to within one
    bfloat16 rounding, and both are the fake-quantized weight up to the bfloat16 parameters."""
    if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        pytest.skip("this torch has no int4 CPU kernel")
    w = random_matrix(32, cols, seed=5, spread=10.0)
    qt = quantize_tensor(w, spec)
    layer = Int4Linear(qt)
    assert layer.blocks.shape == (32, cols // 32, 20) and layer.blocks.dtype == torch.uint8
    w_hat = layer.dequantized()
    eye = torch.eye(cols, dtype=torch.bfloat16)
    kernel = layer._kernel(eye).float().t()
    assert ((kernel - w_hat).abs() <= BF16_EPS * w_hat.abs()).all()
    step = qt.columns(qt.scale).abs()  # |s| per weight: bfloat16 s and z move w_hat by ~8 s eps
    assert ((w_hat - qt.dequantize()).abs() <= 16 * BF16_EPS * (step * 8 + w.abs())).all()


def test_int4_linear_without_the_kernel_dequantizes_exactly():
    w = random_matrix(13, 40, seed=11)  # 13 rows: not a multiple of 16, no kernel
    qt = quantize_tensor(w, QuantSpec(4, 8, symmetric=False))
    layer = Int4Linear(qt, bias=torch.ones(13))
    assert not layer.fast
    x = torch.randn(3, 40)
    torch.testing.assert_close(layer(x), x @ qt.dequantize().T + 1, rtol=1e-6, atol=1e-6)


def test_activation_quantization_is_per_token():
    linear = torch.nn.Linear(16, 4, bias=False)
    layer = ActQuantLinear(linear, QuantSpec(8))
    x = torch.randn(2, 3, 16)
    x[0, 0] *= 1000  # one loud token does not coarsen the others' grids
    want = linear(torch.stack([fake_quantize(row, QuantSpec(8)) for row in x]))
    torch.testing.assert_close(layer(x), want)


# --------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "options"),
    [
        ("rtn", {"bits": 4, "group_size": 16}),
        ("smoothquant", {"bits": 8}),
        ("awq", {"bits": 4, "group_size": 16, "awq_grid": 4}),
        ("gptq", {"bits": 4, "group_size": 16}),
    ],
)
def test_quantize_model_returns_a_new_model(method, options):
    model = tiny_model(seed=7, std=0.1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tokens = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(2))
    quantized = quantize_model(model, method, calib_batches=tokens, progress=False, **options)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert model.lm_head.weight is model.embed.weight  # still tied
    head = getattr(quantized.lm_head, "linear", quantized.lm_head)  # W8A8: inside ActQuantLinear
    assert head.weight is not quantized.embed.weight
    torch.testing.assert_close(quantized.embed.weight, model.embed.weight, rtol=0, atol=0)
    assert quantized.quant_config.method == method
    with torch.no_grad():
        ref, out = model(tokens), quantized(tokens)
    assert 0 < (out - ref).abs().max() < 0.5 * ref.abs().max()


def test_calibrated_methods_beat_round_to_nearest_on_a_model():
    model = tiny_model(seed=8, std=0.1)
    with torch.no_grad():
        for layer in model.layers:
            layer.mlp_norm.weight[[2, 9]] *= 20
    gen = torch.Generator().manual_seed(3)
    calib, test = (
        torch.randint(0, 97, (8, 32), generator=gen),
        torch.randint(0, 97, (4, 32), generator=gen),
    )
    with torch.no_grad():
        ref = model.hidden_states(test)

        def error(method: str, **options) -> float:
            q = quantize_model(
                model, method, 3, 16, calib, progress=False, lm_head=False, **options
            )
            return float((q.hidden_states(test) - ref).pow(2).mean())

        rtn = error("rtn")
        assert error("gptq") < rtn
        assert error("awq", awq_grid=10) < rtn


def test_packed_model_decodes_like_its_prefill():
    model = tiny_model(seed=9, std=0.1, dim=64, ffn_dim=128, n_heads=4, head_dim=16)
    for options in ({"bits": 8}, {"bits": 4, "group_size": 32}):
        packed = quantize_model(model, packed=True, progress=False, **options)
        kinds = {type(m) for m in packed.modules()}
        assert (Int8Linear if options["bits"] == 8 else Int4Linear) in kinds
        prompt = [3, 1, 4, 1, 5, 9, 2, 6]
        cached = generate(packed, None, prompt, max_new_tokens=12)
        uncached = generate(packed, None, prompt, max_new_tokens=12, use_cache=False)
        assert cached == uncached


def test_streamed_bytes_count_codes_and_scales():
    model = tiny_model()
    assert streamed_bytes(model) == param_bytes(model)  # fp32, the table is the LM head
    packed = quantize_model(model, bits=8, packed=True, progress=False)
    linear_weights = sum(m.q.numel() for m in packed.modules() if isinstance(m, Int8Linear))
    scales = sum(m.scale.numel() * 2 for m in packed.modules() if isinstance(m, Int8Linear))
    norms = sum(p.numel() * 4 for n, p in packed.named_parameters() if "norm" in n)
    assert streamed_bytes(packed) == linear_weights + scales + norms  # the table is a lookup


def test_quant_bench_on_a_tiny_model():
    model = tiny_model(seed=10, dim=64, ffn_dim=128, n_heads=4, head_dim=16)
    rows, linear = bench_quant(
        model, None, [3, 1, 4, 1, 5], group_size=32, max_new_tokens=6, repeats=1, warmup=0,
        linear_repeats=2, progress=False,
    )  # fmt: skip
    assert [r.variant for r in rows] == list(VARIANTS)
    assert rows[0].speedup == 1.0 and rows[0].same_tokens and rows[0].bytes_ratio == 1.0
    assert rows[1].bytes_ratio == pytest.approx(2.0) and rows[2].bytes_ratio > 2.5
    assert rows[3].bytes_ratio > rows[2].bytes_ratio
    assert all(r.tok_s > 0 and r.linear_ms > 0 for r in rows)
    assert all(len(r.rounds) == 1 and r.tok_s == pytest.approx(1 / r.rounds[0]) for r in rows)
    assert rows[2].round_speedups(rows[0]) == pytest.approx([rows[0].rounds[0] / rows[2].rounds[0]])
    paths = {f"layers.0.{p}" for p in ("attn.q_proj", "attn.o_proj", "mlp.down_proj")}
    assert paths < set(linear["int4"].per_call) and "lm_head" in linear["int4"].per_call


# --------------------------------------------------------------------------------------------
# The real model
# --------------------------------------------------------------------------------------------


def test_real_model_layers_sit_on_a_4_bit_grid(embedded):
    # The embedded checkpoint was stored as llama.cpp Q4_1 (4-bit, blocks of 32, min + scale):
    # asymmetric 4-bit RTN in groups of 32 gives its weights back, groups of 128 do not.
    model, _ = embedded
    w = model.layers[3].mlp.down_proj.weight.detach()
    exact = fake_quantize(w, QuantSpec(4, 32, symmetric=False))
    assert (exact - w).abs().max() <= 1e-6 * w.abs().max()
    coarse = fake_quantize(w, QuantSpec(4, 128, symmetric=False))
    assert (coarse - w).abs().max() > 1e-2 * w.abs().max()


def test_real_model_int8_is_close_and_input_untouched(embedded):
    model, tokenizer = embedded
    head = model.lm_head.weight[:1000].clone()
    packed = quantize_model(model, bits=8, packed=True, progress=False)
    assert (
        torch.equal(model.lm_head.weight[:1000], head)
        and model.lm_head.weight is model.embed.weight
    )
    tokens = torch.tensor([tokenizer("The for statement is used to iterate")["input_ids"]])
    with torch.no_grad():
        ref, out = model(tokens)[0], packed(tokens)[0]
    assert (ref.argmax(-1) == out.argmax(-1)).float().mean() >= 0.85
    assert float((out - ref).abs().max()) < 0.1 * float(ref.abs().max())
    assert streamed_bytes(packed) < 0.3 * streamed_bytes(model)


def test_bench_quant_command(tmp_path, capsys, embedded):
    out = tmp_path / "quant.json"
    argv = ["bench", "quant", "--variants", "int8", "--max-new-tokens", "3", "--repeats", "1"]
    argv += ["--warmup", "0", "--linear-repeats", "1", "--json", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "fp32" in text and "int8" in text and "lm_head (49152x576)" in text
    data = __import__("json").loads(out.read_text())
    assert [r["variant"] for r in data["rows"]] == ["fp32", "int8"]
    assert text.startswith("machine: ") and data["machine"]["cores"] >= 1
