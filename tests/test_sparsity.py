"""Sparsity recording, metrics and thresholds against direct computation on full tensors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import tiny_model
from minisparse import sparsity as S
from minisparse.core.hooks import capture_outputs
from minisparse.core.model import flops_per_token
from minisparse.io.eval import mean_nll, window_nlls
from minisparse.relufy import relufy


def tiny(seed: int = 0):
    return tiny_model(seed=seed, std=0.2, n_layers=3, dim=40, head_dim=10, ffn_dim=70)


def tokens(seed: int, shape=(4, 16)) -> torch.Tensor:
    return torch.randint(0, 97, shape, generator=torch.Generator().manual_seed(seed))


def full_site_tensors(model, toks) -> dict[str, list[torch.Tensor]]:
    """Every site's full activations, captured with plain hooks and computed with torch ops."""
    modules = {}
    for i, layer in enumerate(model.layers):
        for site, slot in S.SLOTS.items():
            owner, name = slot(layer)
            modules[f"{site}/{i}"] = getattr(owner, name)
    heads = []
    pre = [
        layer.attn.o_proj.register_forward_pre_hook(lambda _m, a: heads.append(a[0].detach()))
        for layer in model.layers
    ]
    try:
        with torch.no_grad(), capture_outputs(modules) as store:
            model(toks)
    finally:
        for h in pre:
            h.remove()
    out = {
        site: [
            store[f"{site}/{i}"][0].reshape(-1, store[f"{site}/{i}"][0].shape[-1]) for i in range(3)
        ]
        for site in S.SLOTS
    }
    n_heads = model.config.n_heads
    out["heads"] = [h.reshape(-1, n_heads, h.shape[-1] // n_heads).norm(dim=-1) for h in heads]
    return out


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_recorded_statistics_equal_direct_computation(stage):
    model = tiny() if stage == 0 else relufy(tiny(), stage)
    toks = tokens(1)
    active = {"mlp_act": [0.05, 0.1, 0.2], "heads": 0.3}
    stats = S.record(model, toks, batch_size=3, active_above=active, progress=False)
    full = full_site_tensors(model, toks)
    assert stats.tokens == toks.numel()
    for site in S.SITES:
        for layer, x in enumerate(full[site]):
            s = stats.sites[site][layer]
            a = x.abs().double()
            assert s.zero_fraction() == pytest.approx(float((a == 0).double().mean()), abs=1e-12)
            for t in (1e-3, 1e-2, 0.1, 1.0):  # decade edges: exact up to float32 log10 rounding
                expected = float((a <= t).double().mean())
                assert s.fraction_at_most(t) == pytest.approx(expected, abs=2e-3)
            limit = S.per_layer(active.get(site, 0.0), 3)[layer]
            assert torch.equal(s.active, (a > limit).sum(0).double())
            assert torch.allclose(s.mass, a.sum(0), rtol=1e-5)
    if stage:  # ReLU makes exact zeros; the MLP input (stage 2) too
        assert min(stats.zero_fraction("mlp_act")) > 0.2
        assert min(stats.zero_fraction("down_in")) == pytest.approx(
            min(stats.zero_fraction("mlp_act")), abs=1e-9
        )
    if stage == 2:
        assert min(stats.zero_fraction("attn_in")) > 0.2
    else:
        assert max(stats.zero_fraction("attn_in")) == 0.0


@pytest.mark.parametrize("stage", [0, 2])
def test_measure_counts_the_zeros_of_every_site_and_the_perplexity(stage):
    model = tiny() if stage == 0 else relufy(tiny(), stage)
    ids = tokens(3, (64,))
    got = S.measure(model, ids, seq_len=16)
    full = full_site_tensors(model, ids.view(4, 16))
    for site in S.SLOTS:
        direct = sum(float((x == 0).double().mean()) for x in full[site]) / 3
        assert got[f"zeros_{site}"] == pytest.approx(direct, abs=1e-12)
    assert got["ppl"] == pytest.approx(math.exp(mean_nll(model, ids, seq_len=16, progress=False)))
    assert (got["zeros_attn_in"] > 0.2) == (stage == 2)


def test_measure_with_nlls_gives_each_windows_nll_from_the_same_pass():
    model, ids = tiny(), tokens(4, (64,))
    got, nlls = S.measure_with_nlls(model, ids, seq_len=16)
    assert got == S.measure(model, ids, seq_len=16)
    assert torch.equal(nlls, window_nlls(model, ids, seq_len=16, progress=False))
    assert nlls.shape == (4,) and got["ppl"] == pytest.approx(math.exp(float(nlls.mean())))


def test_sites_see_what_the_projections_see():
    model, toks = relufy(tiny(), 2), tokens(2, (2, 8))
    full = full_site_tensors(model, toks)
    mlp = model.layers[1].mlp
    with torch.no_grad():
        act = torch.relu(full["mlp_in"][1] @ mlp.gate_proj.weight.T)
        down_in = act * (full["mlp_in"][1] @ mlp.up_proj.weight.T)
    assert torch.allclose(full["mlp_act"][1], act, atol=1e-6)
    assert torch.allclose(full["down_in"][1], down_in, atol=1e-6)
    assert (full["mlp_in"][1] >= 0).all()


@settings(max_examples=40)
@given(
    st.integers(0, 2**16),
    st.floats(0.05, 0.95),
    st.sampled_from(["normal", "lognormal", "with zeros"]),
)
def test_quantile_threshold_hits_target_on_fresh_data(seed, sparsity, kind):
    gen = torch.Generator().manual_seed(seed)

    def draw(n):
        x = torch.randn(n, 64, generator=gen)
        if kind == "lognormal":
            x = torch.exp(2 * x)
        if kind == "with zeros":
            x = torch.relu(x)
        return x

    s = S.SiteStats(64)
    s.update(draw(2000))
    t = s.quantile(sparsity)
    fresh = draw(2000).abs()
    zeros = float((fresh == 0).float().mean())
    expected = max(sparsity, 0.0)
    if sparsity <= zeros:  # the target lies inside the zeros: the threshold is 0
        assert t == 0.0
    else:
        assert float((fresh <= t).float().mean()) == pytest.approx(expected, abs=0.01)


def test_calibrated_thresholds_hit_target_on_held_out_tokens_and_are_reversible():
    model = tiny(3)
    toks = tokens(4)
    before = model(toks)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for site in ("attn_in", "mlp_in", "mlp_act", "down_in"):
        limits = S.calibrate_thresholds(
            model, tokens(5, (16, 16)), 0.6, sites=(site,), progress=False
        )
        with S.thresholds_applied(model, limits):
            stats = S.record(model, tokens(6, (16, 16)), sites=(site,), progress=False)
            assert isinstance(S.SLOTS[site](model.layers[0])[0], torch.nn.Module)
        for z in stats.zero_fraction(site):
            assert z == pytest.approx(0.6, abs=0.05)
    assert torch.equal(model(toks), before)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert not any(isinstance(m, S.MagnitudeThreshold) for m in model.modules())


def test_thresholds_from_one_recording_equal_calibrating_each_site_and_level():
    model = tiny(7)
    calib = tokens(8, (16, 16))
    all_sites = ("attn_in", "mlp_in", "mlp_act", "down_in")
    stats = S.record(model, calib, sites=all_sites, progress=False)
    for sparsity, sites in ((0.3, ("down_in",)), (0.7, ("attn_in", "mlp_in")), (0.5, all_sites)):
        expected = S.calibrate_thresholds(model, calib, sparsity, sites=sites, progress=False)
        assert S.thresholds_at(stats, sparsity, sites) == expected
    only_down = S.record(model, calib, sites=("down_in",), progress=False)
    with pytest.raises(ValueError, match="no site"):
        S.thresholds_at(only_down, 0.5, ("mlp_act",))


def test_thresholds_wrap_the_existing_activation():
    model = relufy(tiny(), 1)
    S.apply_thresholds(model, {"mlp_act": [0.1, 0.1, 0.1]})
    act = model.layers[0].mlp.act
    x = torch.tensor([-1.0, 0.05, 0.1, 0.3])
    assert torch.equal(act(x), torch.tensor([0.0, 0.0, 0.0, 0.3]))
    S.remove_thresholds(model)
    assert isinstance(model.layers[0].mlp.act, torch.nn.ReLU)


def test_lorenz_curve_and_top_share():
    p, carried = S.lorenz_curve(torch.ones(10))
    assert torch.allclose(carried, p)
    values = torch.tensor([0.0, 1.0, 0.0, 3.0])
    assert S.top_share(values, 0.25) == pytest.approx(0.75)
    assert S.top_share(values, 0.5) == pytest.approx(1.0)


def test_savings_count_the_whole_model_and_the_skipped_columns():
    model = relufy(tiny(), 2)
    stats = S.record(model, tokens(7), progress=False)
    rows = {r.name: r for r in S.savings(model, stats, context=16)}
    total = rows["total"]
    assert total.flops == flops_per_token(model.config, context=16)
    projections = [m for n, m in model.named_modules() if n.endswith("_proj")]
    weights = [m.weight for m in projections] + [model.lm_head.weight]
    assert total.bytes == sum(w.numel() * w.element_size() for w in weights)
    zeros = stats.zero_fraction("attn_in")
    q = model.layers[0].attn.q_proj.weight.numel()
    assert rows["q_proj"].skipped_flops == pytest.approx(2 * q * sum(zeros))
    down = stats.zero_fraction("down_in")
    assert rows["down_proj"].skipped_share == pytest.approx(sum(down) / 3)
    assert rows["lm_head"].skipped_flops == 0.0
    dense = {r.name: r for r in S.savings(tiny(), S.record(tiny(), tokens(7), progress=False))}
    assert dense["total"].skipped_flops == 0.0


def test_bad_input_is_a_clear_error():
    model = tiny()
    with pytest.raises(ValueError, match="sparsity"):
        S.calibrate_thresholds(model, tokens(0), 1.0)
    with pytest.raises(ValueError, match="Unknown"):
        S.record(model, tokens(0), sites=("nowhere",))
    with pytest.raises(ValueError, match="Unknown"):
        S.calibrate_thresholds(model, tokens(0), 0.5, sites=("heads",))
    with pytest.raises(ValueError, match="layers"):
        S.apply_thresholds(model, {"mlp_act": [0.1]})
    with pytest.raises(ValueError, match=">= 0"):
        S.MagnitudeThreshold(torch.nn.Identity(), -1.0)
    with pytest.raises(KeyError, match="not recorded"):
        S.record(model, tokens(0), sites=("mlp_act",), progress=False).zero_fraction("heads")


def test_histogram_covers_extreme_magnitudes():
    s = S.SiteStats(3)
    s.update(torch.tensor([[0.0, 1e-12, 1e6]]))
    assert s.zero_fraction() == pytest.approx(1 / 3)
    assert s.fraction_at_most(1e-9) == pytest.approx(2 / 3)
    assert s.fraction_at_most(1e5) == pytest.approx(2 / 3)
    assert s.quantile(0.99) == 10.0**S.LOG10_MAX
    assert math.isclose(s.fraction_at_most(1e7), 2 / 3)  # the overflow bin counts as above
