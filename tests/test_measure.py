"""The measurement protocol: one bandwidth per machine, intervals, and verdicts in words."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_model
from minisparse.io import eval as E
from minisparse.measure import machine as M
from minisparse.measure import timing
from minisparse.measure.compare import (
    MEETS,
    MISSES,
    SAME,
    UNDETERMINED,
    Interval,
    against_goal,
    median_interval,
    spread,
    verdict,
)
from minisparse.measure.timing import rounds_until_narrow


def test_the_bandwidth_is_measured_once_per_machine_and_then_read(tmp_path, monkeypatch):
    monkeypatch.setenv("MINISPARSE_CACHE", str(tmp_path))
    calls = []
    monkeypatch.setattr(timing, "read_bandwidth", lambda: calls.append(1) or 40.0 + len(calls))
    first = M.machine_bandwidth()
    assert first == 43.0 and len(calls) == 5  # the median of five reads: 41..45
    assert M.machine_bandwidth() == first and len(calls) == 5  # read from the cache
    assert M.machine().read_gbs == first and len(calls) == 5  # every chapter prints the same
    assert M.machine_bandwidth(fresh=True) == 48.0 and len(calls) == 10
    M._facts_path().write_text("{damaged")  # a damaged file is measured again, not trusted
    assert M.machine_bandwidth() == 53.0 and len(calls) == 15


def test_a_cache_that_cannot_be_written_leaves_a_warning_and_the_figure(tmp_path, monkeypatch):
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv("MINISPARSE_CACHE", str(blocked / "below"))  # a file where a folder goes
    monkeypatch.setattr(timing, "read_bandwidth", lambda: 30.0)
    with pytest.warns(UserWarning, match="Could not keep the measured bandwidth"):
        assert M.machine_bandwidth() == 30.0


def test_spread_and_verdict():
    fast, slow = spread([2.0, 2.2, 2.1]), spread([1.0, 1.3, 1.1])
    assert fast == Interval(2.1, 2.0, 2.2) and str(fast) == "2.10 (2.00-2.20)"
    assert verdict(fast, slow) == "faster" and verdict(slow, fast) == "slower"
    overlapping = spread([1.9, 2.05])
    assert verdict(fast, overlapping) == SAME == verdict(overlapping, fast)
    # perplexity: lower is better, with its own words
    assert verdict(slow, fast, higher_is_better=False, words=("better", "worse")) == "better"
    with pytest.raises(ValueError, match="at least one sample"):
        spread([])
    with pytest.raises(ValueError, match="low <= mid <= high"):
        Interval(1.0, 2.0, 3.0)


def test_window_nlls_match_the_cross_entropy_of_each_window():
    model = tiny_model(seed=3, std=0.2)
    ids = torch.randint(0, 97, (5 * 16,), generator=torch.Generator().manual_seed(1))
    got = E.window_nlls(model, ids, seq_len=16, batch_size=2, progress=False)
    with torch.no_grad():
        want = [
            F.cross_entropy(model(w[None])[0, :-1].double(), w[1:]).item() for w in ids.view(5, 16)
        ]
    assert got.dtype == torch.float64 and got.shape == (5,)
    assert torch.allclose(got, torch.tensor(want, dtype=torch.float64), rtol=1e-5)
    assert E.perplexity(model, ids, 16, progress=False) == pytest.approx(math.exp(sum(want) / 5))


def test_the_bootstrap_interval_against_a_loop():
    nll = torch.tensor([2.0, 2.6, 1.7, 2.2, 2.9, 2.4], dtype=torch.float64)
    got = E.bootstrap_perplexity(nll, rounds=500, seed=4)
    gen = torch.Generator().manual_seed(4)
    picks = torch.randint(0, 6, (500, 6), generator=gen)
    means = sorted(float(sum(nll[j] for j in row) / 6) for row in picks)
    q = torch.quantile(
        torch.tensor(means, dtype=torch.float64), torch.tensor([0.025, 0.975]).double()
    )
    assert got.mid == pytest.approx(math.exp(float(nll.mean())))
    assert got.low == pytest.approx(math.exp(float(q[0]))) and got.high == pytest.approx(
        math.exp(float(q[1]))
    )
    assert got.low < got.mid < got.high
    # identical windows leave no uncertainty; more windows of the same spread narrow it
    flat = E.bootstrap_perplexity(torch.full((8,), 2.0, dtype=torch.float64))
    assert flat.low == flat.mid == flat.high == pytest.approx(math.exp(2.0))
    wide = E.bootstrap_perplexity(nll, seed=1)
    narrow = E.bootstrap_perplexity(nll.repeat(16), seed=1)
    assert narrow.high - narrow.low < (wide.high - wide.low) / 2


def test_the_paired_ratio_tells_apart_what_separate_intervals_cannot():
    """Two models on the same windows: the windows' difficulty varies far more than the models
    differ, so their separate intervals overlap; the paired ratio sees the difference."""
    gen = torch.Generator().manual_seed(0)
    hard = torch.rand(12, generator=gen, dtype=torch.float64) * 2 + 1  # window difficulty
    worse = hard + 0.05 + 0.01 * torch.randn(12, generator=gen, dtype=torch.float64)
    a, b = E.bootstrap_perplexity(worse), E.bootstrap_perplexity(hard)
    assert verdict(a, b, higher_is_better=False) == SAME
    ratio = E.perplexity_ratio(worse, hard)
    assert ratio.mid == pytest.approx(math.exp(float((worse - hard).mean())))
    assert ratio.low > 1.0  # worse, measurably
    assert (
        verdict(ratio, Interval(1.0, 1.0, 1.0), higher_is_better=False, words=("better", "worse"))
        == "worse"
    )
    same = E.perplexity_ratio(hard, hard)
    assert same.low == same.mid == same.high == 1.0
    with pytest.raises(ValueError, match="same windows"):
        E.perplexity_ratio(hard, hard[:5])


def test_token_nlls_are_the_next_token_negative_log_likelihoods():
    from minisparse.io.eval import token_nlls

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 5, 7, generator=gen)
    tokens = torch.randint(0, 7, (2, 5), generator=gen)
    log_p = torch.log_softmax(logits.double(), dim=-1)
    expected = torch.stack(
        [torch.stack([-log_p[b, t, tokens[b, t + 1]] for t in range(4)]) for b in range(2)]
    )
    got = token_nlls(logits, tokens)
    assert got.shape == (2, 4)
    torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=1e-6)


def test_paired_ratios_divide_each_rounds_pair():
    from minisparse.measure.timing import paired_ratios

    assert paired_ratios([2.0, 3.0, 8.0], [1.0, 4.0, 2.0]) == [2.0, 0.75, 4.0]
    with pytest.raises(ValueError):
        paired_ratios([1.0], [1.0, 2.0])


def test_median_interval_covers_the_median_at_its_confidence():
    """The order-statistic interval against brute force: over many samples of a skewed law
    (exponential, median ln 2), the interval holds the true median at least 95 % of the time,
    and its ends are the binomial indices for n = 9 and 20 (tables: x_2..x_8, x_6..x_15)."""
    gen = torch.Generator().manual_seed(0)
    hits = 0
    for _ in range(2000):
        x = (-torch.rand(15, generator=gen).log()).tolist()
        iv = median_interval(x)
        hits += iv.low <= math.log(2) <= iv.high
    assert 0.95 <= hits / 2000 <= 0.99
    assert (median_interval(range(1, 10)).low, median_interval(range(1, 10)).high) == (2, 8)
    assert (median_interval(range(1, 21)).low, median_interval(range(1, 21)).high) == (6, 15)
    assert median_interval([3.0, 1.0]) == Interval(2.0, 1.0, 3.0)  # too few: the range
    with pytest.raises(ValueError, match="at least one"):
        median_interval([])


def test_a_goal_is_met_missed_or_undetermined_by_the_whole_interval():
    assert against_goal(Interval(1.5, 1.46, 1.6), 1.45) == MEETS
    assert against_goal(Interval(1.3, 1.2, 1.44), 1.45) == MISSES
    assert against_goal(Interval(1.5, 1.4, 1.6), 1.45) == UNDETERMINED
    assert Interval(2.0, 1.9, 2.3).half_width == pytest.approx(0.15)


def test_rounds_are_added_until_the_median_is_narrow():
    """Noisy rounds: more are run until the interval is within ±10 %; steady ones stop at
    the first batch; the cap holds."""
    gen = torch.Generator().manual_seed(1)
    calls = []

    def noisy(n):
        calls.append(n)
        return (1.3 + 0.3 * torch.randn(n, generator=gen)).tolist()

    ratios = rounds_until_narrow(noisy, first=5, most=41, width=0.1, step=4)
    assert calls[0] == 5 and all(c <= 4 for c in calls[1:]) and len(calls) > 1
    assert median_interval(ratios).half_width <= 0.1 or len(ratios) == 41
    assert median_interval(ratios[: -calls[-1]]).half_width > 0.1  # it stopped at the first
    assert rounds_until_narrow(lambda n: [1.0] * n, first=7) == [1.0] * 7
    wide = rounds_until_narrow(lambda n: [1.0, 5.0, 9.0][:n] * 1, first=3, most=9, step=3)
    assert len(wide) == 9  # never narrow: stops at the cap
    with pytest.raises(ValueError, match="first <= most"):
        rounds_until_narrow(noisy, first=9, most=3)
