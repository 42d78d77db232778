"""Chapter 03's core builds: its plausible wrong answers (``WRONG``, rejected in test_exercises.py),
and the learner's statistics and calibration produce the thresholds the model then runs with."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import tiny_model
from minisparse import sparsity as S
from minisparse.course.plug import solution

SOLUTIONS = Path(__file__).resolve().parents[1] / "notebooks" / "solutions"
Stats = solution("site_stats", SOLUTIONS)
calibrate = solution("teal_calibration", SOLUTIONS)


class ZerosInTheLowestBin(Stats):
    """Exact zeros go into the bin below 1e-8 instead of being counted apart."""

    def update(self, x):
        super().update(x)
        self.hist[0] += self.zeros
        self.zeros = 0


class RowsFromTheFirstDimension(Stats):
    """Counts x.shape[0] rows of width entries: a [batch, seq, width] input is miscounted."""

    def update(self, x):
        entries = self.count
        super().update(x)
        self.count = entries + x.shape[0] * self.width


class NoInterpolation(Stats):
    """Returns the lower edge of the bin that holds the quantile."""

    def quantile(self, q):
        t = super().quantile(q)
        if t in (0.0, 1e-8, 1e4):
            return t
        k = int((torch.tensor(t).log10().item() + 8) * 100)
        return 10.0 ** (-8 + k / 100)


class EndsClampedIn(Stats):
    """Magnitudes beyond the histogram land in its first and last bins, not in their own."""

    def update(self, x):
        a = x.detach().reshape(-1, self.width).float().abs()
        nonzero = a[a > 0]
        self.count += a.numel()
        self.zeros += a.numel() - nonzero.numel()
        k = ((nonzero.log10() + 8) * 100).long().clamp(0, 1199)
        self.hist[1:-1] += torch.bincount(k, minlength=1200).double()


def _fresh(model, sites, SiteStats, shared=False):
    """One SiteStats per site and layer (or one per site that every layer shares)."""
    c = model.config
    widths = {"attn_in": c.dim, "mlp_in": c.dim, "mlp_act": c.ffn_dim, "down_in": c.ffn_dim}
    if shared:
        return {site: [SiteStats(widths[site])] * len(model.layers) for site in sites}
    return {site: [SiteStats(widths[site]) for _ in model.layers] for site in sites}


def _hooked(model, token_batches, sparsities, sites, stats, pre=False, remove=True):
    handles = []
    for site in sites:
        for layer, summary in zip(model.layers, stats[site], strict=True):
            module = getattr(*S.SLOTS[site](layer))
            if pre:
                hook = module.register_forward_pre_hook(lambda m, a, s=summary: s.update(a[0]))
            else:
                hook = module.register_forward_hook(lambda m, a, out, s=summary: s.update(out))
            handles.append(hook)
    with torch.no_grad():
        model(token_batches)
    for handle in handles if remove else ():
        handle.remove()
    return {s: {site: [x.quantile(s) for x in stats[site]] for site in sites} for s in sparsities}


def one_threshold_for_all_layers(model, token_batches, sparsities, sites, SiteStats):
    """One SiteStats per site, fed by every layer."""
    stats = _fresh(model, sites, SiteStats, shared=True)
    return _hooked(model, token_batches, sparsities, sites, stats)


def the_modules_input(model, token_batches, sparsities, sites, SiteStats):
    """Pre-hooks: each module's input, so mlp_act sees W_gate x before the SiLU."""
    stats = _fresh(model, sites, SiteStats)
    return _hooked(model, token_batches, sparsities, sites, stats, pre=True)


def the_kept_share(model, token_batches, sparsities, sites, SiteStats):
    """quantile(1 - s): the threshold below which the *kept* share lies."""
    got = calibrate(model, token_batches, [1 - s for s in sparsities], sites, SiteStats)
    return {s: got[1 - s] for s in sparsities}


def hooks_left_on(model, token_batches, sparsities, sites, SiteStats):
    """Right thresholds, but the hooks stay on the model (later passes keep feeding them)."""
    stats = _fresh(model, sites, SiteStats)
    return _hooked(model, token_batches, sparsities, sites, stats, remove=False)


WRONG = {
    "site_stats": [ZerosInTheLowestBin, RowsFromTheFirstDimension, NoInterpolation, EndsClampedIn],
    "teal_calibration": [
        one_threshold_for_all_layers,
        the_modules_input,
        the_kept_share,
        hooks_left_on,
    ],
}


def test_the_learners_statistics_read_the_quantiles_of_the_full_tensor():
    """Within two bins (a factor 10^0.02) of the exact quantile of everything streamed: the
    histogram knows which bin holds the q-th entry, not where in the bin it lies."""
    gen = torch.Generator().manual_seed(0)
    stats = Stats(16)
    parts = [torch.randn(3, 5, 16, generator=gen) * 10.0 ** float(i) for i in range(-2, 2)]
    for x in parts:
        stats.update(x)
    everything = torch.cat([x.reshape(-1) for x in parts]).abs().double()
    for q in (0.1, 0.5, 0.9):
        exact = float(torch.quantile(everything, q))
        assert abs(torch.tensor(stats.quantile(q) / exact).log10()) <= 0.02


def test_the_learners_calibration_sets_the_thresholds_the_model_runs_with():
    model = tiny_model(std=0.2)
    tokens = torch.randint(0, 97, (6, 12), generator=torch.Generator().manual_seed(1))
    mine = calibrate(model, tokens, (0.5,), ("down_in",), Stats)[0.5]
    library = S.calibrate_thresholds(model, tokens, 0.5, ("down_in",), progress=False)
    assert torch.allclose(torch.tensor(mine["down_in"]), torch.tensor(library["down_in"]))
    assert all(not m._forward_hooks for m in model.modules())  # the hooks came off
    with S.thresholds_applied(model, mine):
        zeros = S.measure(model, tokens.view(-1), seq_len=12)["zeros_down_in"]
    assert abs(zeros - 0.5) < 0.02  # the calibration text itself: half of down_in is now zero


def test_record_takes_the_learners_statistics_and_refuses_active_above_with_them():
    model = tiny_model()
    tokens = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(2))
    theirs = S.record(model, tokens, ("mlp_act",), progress=False, stats=Stats)
    ours = S.record(model, tokens, ("mlp_act",), progress=False)
    assert isinstance(theirs.sites["mlp_act"][0], Stats)
    assert theirs.quantiles("mlp_act", 0.3) == pytest.approx(ours.quantiles("mlp_act", 0.3))
    with pytest.raises(ValueError, match="active_above"):
        S.record(model, tokens, ("mlp_act",), active_above={"mlp_act": 0.1}, stats=Stats)
