"""Chapter 03's core builds: the streaming statistic behind every threshold, and TEAL's calibration.

``SiteStats(width)`` summarises the activations one site of one layer sees, in constant memory
however much text passes: ``update(x)`` folds rows x [..., width] in, ``quantile(q)`` reads back
the magnitude t with P(|x| <= t) = q. Exact zeros are counted apart; every other |x| falls into a
histogram of log10|x| with 100 bins per decade from 1e-8 to 1e4, plus one bin below and one above:

    hist[0]      0 < |x| < 1e-8
    hist[1 + k]  10^(-8 + k/100) <= |x| < 10^(-8 + (k+1)/100),   k = 0 .. 1199
    hist[1201]   |x| >= 1e4

    quantile(q): target = q * count - zeros (count = every entry seen); 0.0 when target <= 0;
    i = the first bin whose cumulative count reaches target; 1e-8 for i = 0, 1e4 for i = 1201;
    else 10^(-8 + (i - 1 + (target - cum[i-1]) / hist[i]) / 100), log-linear inside the bin.

The check drives the class through scripts of batches (2-D and 3-D, empty, all zero, with
magnitudes beyond both ends of the histogram, signed) and compares the quantiles at the end, at
q from 0 to 0.999, with the library's ``sparsity.SiteStats`` (1e-6 relative, and 0.0 exactly
where the zeros cover q). The magnitudes are drawn away from the bin edges, so a log10 in
float32 or in float64 puts them in the same bin.

``calibrate(model, token_batches, sparsities, sites, SiteStats)`` is TEAL's calibration: a
forward hook on each site's module of each layer (``sparsity.SLOTS``) feeds one ``SiteStats``,
every batch runs through the model once, and each layer's threshold at sparsity s is its
s-quantile; the hooks come off again. It returns {s: {site: [t_l per layer]}}, what
``sparsity.apply_thresholds_`` installs. Checked against ``record`` + ``thresholds_at`` on tiny
random models in float64 (so running the batches one by one or all at once gives the same float32
magnitudes, hence the same histograms), with the library's ``SiteStats`` passed in; a hook left
on the model fails the check.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ...core.config import ModelConfig
from ...core.model import Transformer, init_weights_
from ...sparsity.stats import BINS_PER_DECADE, LOG10_MIN, SiteStats, record
from ...sparsity.thresholds import thresholds_at
from ..grading import Exercise, draw_int, register

__all__ = ["TinyModel"]

Cases = list[tuple[Any, ...]]


@dataclass(frozen=True, repr=False)
class TinyModel:
    """A small random Llama-family model, built from its seed when a check runs."""

    seed: int
    n_layers: int = 2
    dim: int = 24
    ffn_dim: int = 40
    float64: bool = False
    vocab_size: int = 61

    def build(self) -> Transformer:
        config = ModelConfig(
            vocab_size=self.vocab_size, dim=self.dim, n_layers=self.n_layers, n_heads=4,
            n_kv_heads=2, head_dim=self.dim // 4, ffn_dim=self.ffn_dim, max_seq_len=64,
            eos_token_ids=[],
        )  # fmt: skip
        model = init_weights_(Transformer(config), seed=self.seed, std=0.2).eval()
        return model.double() if self.float64 else model

    def tokens(self, gen: torch.Generator, rows: int, seq: int) -> Tensor:
        return torch.randint(0, self.vocab_size, (rows, seq), generator=gen)

    def __repr__(self) -> str:
        return f"TinyModel(seed={self.seed}, {self.n_layers} layers)"


# --- SiteStats ---------------------------------------------------------------------------------


def _away_from_edges(logs: Tensor, gen: torch.Generator) -> Tensor:
    """Move each log10 value inside its histogram bin, at least a tenth of a bin from the edges."""
    k = ((logs - LOG10_MIN) * BINS_PER_DECADE).floor()
    inside = 0.1 + 0.8 * torch.rand(logs.shape, generator=gen, dtype=torch.float64)
    return LOG10_MIN + (k + inside) / BINS_PER_DECADE


def _batch(
    gen: torch.Generator, shape: tuple[int, ...], zeros: float = 0.0, outside: float = 0.0
) -> Tensor:
    """Signed activations of ``shape``: log10|x| ~ N(-1.5, 1.2), a share ``zeros`` exactly 0
    and a share ``outside`` beyond the histogram (below 1e-8 or from 1e4 up)."""
    n = math.prod(shape)
    logs = (torch.randn(n, generator=gen, dtype=torch.float64) * 1.2 - 1.5).clamp(-7.5, 3.5)
    logs = _away_from_edges(logs, gen)
    roll = torch.rand(n, generator=gen, dtype=torch.float64)
    below = -11 + 2.7 * torch.rand(n, generator=gen, dtype=torch.float64)  # 1e-11 .. 5e-9
    above = 4.2 + 1.5 * torch.rand(n, generator=gen, dtype=torch.float64)  # 1.6e4 .. 5e5
    logs = torch.where(roll < outside / 2, below, logs)
    logs = torch.where((roll >= outside / 2) & (roll < outside), above, logs)
    sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0).double()
    x = sign * 10.0**logs
    x[torch.rand(n, generator=gen) < zeros] = 0.0
    return x.float().reshape(shape)


def _stats_cases(gen: torch.Generator) -> Cases:
    """(width, qs, batch, batch, ...) per case: a script of updates, then the quantiles at qs."""
    w = draw_int(gen, 3, 9)
    return [
        (1, (0.0, 0.5, 0.9), _batch(gen, (0, 1))),  # nothing seen yet
        (w, (0.1, 0.5, 0.9), _batch(gen, (4, w)), _batch(gen, (2, 3, w))),  # 3-D: [b, seq, w]
        (w, (0.2, 0.5, 0.7), _batch(gen, (6, w), zeros=1.0), _batch(gen, (3, 5, w))),
        (w, (0.3, 0.6), _batch(gen, (0, w)), _batch(gen, (5, w)), _batch(gen, (1, 0, w))),
        (64, (0.05, 0.5, 0.95, 0.999), _batch(gen, (2, 50, 64), zeros=0.2),
         _batch(gen, (1, 64), outside=0.5)),  # the top 0.1 % lies above the histogram
        (5, (0.1, 0.4, 0.999), _batch(gen, (7, 5), zeros=0.3, outside=1.0), _batch(gen, (3, 5))),
    ]  # fmt: skip


class Quantiles(dict):
    """q -> quantile(q), printed with 6 significant digits."""

    def __repr__(self) -> str:
        return "{" + ", ".join(f"q={q:g}: {_number(t)}" for q, t in self.items()) + "}"


def _number(value: Any) -> str:
    try:
        return f"{float(value):.6g}"
    except (TypeError, ValueError):
        return repr(value)[:20]


def _drive_stats(stats_class: Any, args: tuple[Any, ...]) -> Quantiles:
    """Make ``stats_class(width)``, feed it every batch, then read its quantiles at ``qs``."""
    width, qs, *batches = args
    stats = stats_class(width)
    for x in batches:
        stats.update(x)
    return Quantiles({q: stats.quantile(q) for q in qs})


def _same_numbers(got: Any, expected: Any) -> bool:
    """Nested lists (or dicts) of numbers, equal to 1e-6 relative; a 0 must be exactly 0."""
    if isinstance(expected, dict):
        return (
            isinstance(got, dict)
            and set(got) == set(expected)
            and all(_same_numbers(got[k], expected[k]) for k in expected)
        )
    if isinstance(expected, (list, tuple)):
        return (
            isinstance(got, (list, tuple))
            and len(got) == len(expected)
            and all(_same_numbers(g, e) for g, e in zip(got, expected, strict=True))
        )
    try:
        value = float(got)
    except (TypeError, ValueError):
        return False
    return math.isclose(value, float(expected), rel_tol=1e-6, abs_tol=0.0)


register(
    "site_stats",
    Exercise(
        "03",
        "SiteStats(width): a class whose update(x [..., width]) adds every |x| to a histogram "
        "(exact zeros counted apart; bins of log10|x|, 100 per decade from 1e-8 to 1e4, one bin "
        "below and one above) and whose quantile(q) returns the magnitude t with "
        "P(|x| <= t) = q, interpolated in log10 inside its bin",
        SiteStats,
        _stats_cases,
        _same_numbers,
        "count = all entries seen (x.reshape(-1, width): a [batch, seq, width] input has "
        "batch * seq rows), zeros apart; bin of |x| > 0: floor((log10|x| + 8) * 100), below "
        "1e-8 to bin 0, 1e4 and up to the last bin. quantile: target = q * count - zeros, 0.0 "
        "if <= 0; i = first bin with cumsum >= target (torch.searchsorted); 1e-8 for i = 0, 1e4 "
        "for the last; else 10 ** (-8 + (i - 1 + (target - cum[i-1]) / hist[i]) / 100); keep "
        "adding across calls of update",
        run=_drive_stats,
        core=True,
    ),
)


# --- calibrate ---------------------------------------------------------------------------------


class Calibration(NamedTuple):
    """What a calibration left behind: hooks still on the model, and its thresholds."""

    hooks_left: int
    thresholds: Any  # {s: {site: [t per layer]}}

    def __repr__(self) -> str:
        try:
            levels = "; ".join(
                f"s={s:g}: "
                + ", ".join(f"{site} [{', '.join(map(_number, ts))}]" for site, ts in by.items())
                for s, by in self.thresholds.items()
            )
        except (AttributeError, TypeError, ValueError):
            levels = repr(self.thresholds)
        return f"hooks left {self.hooks_left}; {levels}"


def _calibration_cases(gen: torch.Generator) -> Cases:
    """(tiny model, token batches, sparsities, sites, the library's SiteStats) per case."""
    all_sites = ("attn_in", "mlp_in", "mlp_act", "down_in")
    settings = (  # model, rows, seq, sparsities, sites
        (TinyModel(draw_int(gen, 0, 1000), float64=True), 3, 9, (0.5,), ("mlp_act", "down_in")),
        (TinyModel(draw_int(gen, 0, 1000), 3, 16, 36, True), 5, 7, (0.0, 0.25, 0.9), all_sites),
        (TinyModel(draw_int(gen, 0, 1000), 1, float64=True), 1, 2, (0.4,), ("mlp_act",)),
        (TinyModel(draw_int(gen, 0, 1000), float64=True), 6, 5, (0.7, 0.3), ("mlp_in", "mlp_act")),
    )
    return [
        (spec, spec.tokens(gen, rows, seq), sparsities, sites, SiteStats)
        for spec, rows, seq, sparsities, sites in settings
    ]


def _hooks(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def _run_calibration(calibrate: Any, args: tuple[Any, ...]) -> Calibration:
    spec, batches, sparsities, sites, stats_class = args
    model = spec.build()
    got = calibrate(model, batches, sparsities, sites, stats_class)
    return Calibration(_hooks(model), got)


def _library_calibration(
    model: Transformer, batches: Tensor, sparsities: Any, sites: Any, stats_class: Any
) -> dict[float, dict[str, list[float]]]:
    """``record`` once with ``stats_class``, then ``thresholds_at`` every sparsity."""
    stats = record(model, batches, sites, progress=False, stats=stats_class)
    return {s: thresholds_at(stats, s, sites) for s in sparsities}


def _same_calibration(got: Any, expected: Calibration) -> bool:
    return (
        isinstance(got, Calibration)
        and got.hooks_left == expected.hooks_left
        and _same_numbers(got.thresholds, expected.thresholds)
    )


register(
    "teal_calibration",
    Exercise(
        "03",
        "calibrate(model, token_batches [n, seq], sparsities, sites, SiteStats) -> "
        "{s: {site: [one threshold per layer]}}: a forward hook on each site's module of each "
        "layer feeds a SiteStats(width); after every batch has run through the model, layer "
        "l's threshold at sparsity s is its s-quantile; the hooks are removed",
        _library_calibration,
        _calibration_cases,
        _same_calibration,
        "one SiteStats per site AND per layer (width: config.dim for attn_in / mlp_in, "
        "config.ffn_dim for mlp_act / down_in); the site is the module's *output* "
        "(register_forward_hook, not a pre-hook: mlp.act's input is W_gate x, before SiLU); "
        "run every row of token_batches under torch.no_grad(); the threshold at s is "
        "quantile(s), not quantile(1 - s); remove every hook (handle.remove()) even if the "
        "model raises",
        run=_run_calibration,
        core=True,
    ),
)
