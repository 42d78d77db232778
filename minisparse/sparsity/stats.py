"""Measuring activation sparsity: streaming statistics of the activations at five sites.

A projection y = W x reads every column of W, but column j only matters when x_j != 0: a
kernel that skips the zero inputs (chapter 07) reads a fraction (1 - s) of W, where s is the
share of zeros in x. This module measures s where it matters, at five *sites* of every layer:

    attn_in   the normed input of q/k/v          (layers[i].attn_in_act output)
    mlp_in    the normed input of gate/up        (layers[i].mlp_in_act output)
    mlp_act   a = act(W_gate x)                  (layers[i].mlp.act output)
    down_in   h = a * (W_up x), input of down    (layers[i].mlp.down_in_act output)
    heads     per-head L2 norm of the attention output, input of o_proj

``record`` streams a model over token batches and keeps, per site and layer, only summaries
(``SiteStats``): the count of exact zeros, a histogram of log10|x| (100 bins per decade from
1e-8 to 1e4, so any fraction below a magnitude and any magnitude quantile can be read back), and
per feature (neuron, channel or head) how often it was active and its total |x|. Memory does
not grow with the number of tokens.

From those summaries:

* the fraction of zeros, or of |x| <= t, per layer: what a sparse kernel may skip;
* the magnitude quantile t with P(|x| <= t) = q, read off the cumulative histogram and
  interpolated in log10 inside its bin (what ``thresholds`` calibrates with);
* per-neuron activation frequency f_j = P(|x_j| > t); sorted, it follows a power law in the
  rank for ReLU models, and its Lorenz curve L(p) = share of all activations carried by the
  top p of the neurons shows how few "hot" neurons do most of the work (PowerInfer).

Reference: Song et al., "PowerInfer: Fast Large Language Model Serving with a Consumer-grade
GPU" (2023), for hot and cold neurons and their power-law frequencies.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from ..core.hooks import capture_outputs
from ..core.model import Transformer
from ..io.eval import window_nlls

SITES = ("attn_in", "mlp_in", "mlp_act", "down_in", "heads")
#: Sites with a module slot in every layer: (owner, attribute) of the module whose output it is.
SLOTS: dict[str, Callable[[nn.Module], tuple[nn.Module, str]]] = {
    "attn_in": lambda layer: (layer, "attn_in_act"),
    "mlp_in": lambda layer: (layer, "mlp_in_act"),
    "mlp_act": lambda layer: (layer.mlp, "act"),
    "down_in": lambda layer: (layer.mlp, "down_in_act"),
}
LOG10_MIN, LOG10_MAX, BINS_PER_DECADE = -8, 4, 100
N_BINS = (LOG10_MAX - LOG10_MIN) * BINS_PER_DECADE


def check_sites(sites: Sequence[str], allowed: Sequence[str] = SITES) -> tuple[str, ...]:
    unknown = [s for s in sites if s not in allowed]
    if unknown or not sites:
        raise ValueError(f"Unknown or no sites {unknown or list(sites)}; use some of {allowed}.")
    return tuple(sites)


def check_sparsity(sparsity: float) -> float:
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"sparsity must be in [0, 1), got {sparsity}.")
    return float(sparsity)


@dataclass
class SiteStats:
    """Streaming summary of one site in one layer: |x| for ``tokens`` rows of ``width`` features.

    ``hist[0]`` counts nonzero |x| < 1e-8, ``hist[1 + k]`` counts
    10^(-8 + k/100) <= |x| < 10^(-8 + (k+1)/100), ``hist[-1]`` counts |x| >= 1e4; exact zeros
    are counted apart in ``zeros``. ``active[j]`` counts the rows where |x_j| > ``active_above``,
    ``mass[j]`` sums |x_j|.
    """

    width: int
    active_above: float = 0.0
    tokens: int = 0
    zeros: int = 0
    hist: Tensor = field(default_factory=lambda: torch.zeros(N_BINS + 2, dtype=torch.float64))
    active: Tensor | None = None
    mass: Tensor | None = None

    def __post_init__(self) -> None:
        if self.active is None:
            self.active = torch.zeros(self.width, dtype=torch.float64)
        if self.mass is None:
            self.mass = torch.zeros(self.width, dtype=torch.float64)

    def update(self, x: Tensor) -> None:
        """Add rows x [tokens, width]."""
        a = x.detach().reshape(-1, self.width).float().abs()
        nonzero = a[a > 0]
        self.tokens += a.shape[0]
        self.zeros += a.numel() - nonzero.numel()
        logs = nonzero.log10()
        self.hist[0] += float((logs < LOG10_MIN).sum())
        self.hist[-1] += float((logs >= LOG10_MAX).sum())
        inside = logs[(logs >= LOG10_MIN) & (logs < LOG10_MAX)]
        idx = ((inside - LOG10_MIN) * BINS_PER_DECADE).long().clamp_(0, N_BINS - 1)
        self.hist[1:-1] += torch.bincount(idx, minlength=N_BINS).double().cpu()
        self.active += (a > self.active_above).sum(0).double().cpu()
        self.mass += a.sum(0).double().cpu()

    @property
    def count(self) -> int:
        return self.tokens * self.width

    def zero_fraction(self) -> float:
        """Share of entries exactly zero."""
        return self.zeros / max(self.count, 1)

    def fraction_at_most(self, magnitude: float) -> float:
        """Share of entries with |x| <= magnitude (exact at bin edges, log-interpolated inside).

        Entries of the overflow bin (|x| >= 1e4) count as above any magnitude.
        """
        if magnitude <= 0:
            return self.zero_fraction()
        pos = (math.log10(magnitude) - LOG10_MIN) * BINS_PER_DECADE
        if pos < 0:
            below = float(self.hist[0])
        elif pos >= N_BINS:
            below = float(self.hist[:-1].sum())
        else:
            k = int(pos)
            below = float(self.hist[: k + 1].sum()) + (pos - k) * float(self.hist[k + 1])
        return (self.zeros + below) / max(self.count, 1)

    def quantile(self, q: float) -> float:
        """The magnitude t with P(|x| <= t) = q, interpolated in log10 within its bin."""
        target = q * self.count - self.zeros
        if target <= 0:
            return 0.0
        cum = torch.cumsum(self.hist, 0)
        i = int(torch.searchsorted(cum, torch.tensor(target, dtype=torch.float64)))
        if i == 0:  # below the histogram's range: as good as zero
            return 10.0**LOG10_MIN
        if i >= N_BINS + 1:
            return 10.0**LOG10_MAX
        before = float(cum[i - 1])
        within = (target - before) / max(float(self.hist[i]), 1.0)
        return 10.0 ** (LOG10_MIN + (i - 1 + within) / BINS_PER_DECADE)

    def frequency(self) -> Tensor:
        """Per feature, the share of rows where it was active (|x_j| > active_above)."""
        return self.active / max(self.tokens, 1)


def lorenz_curve(values: Tensor) -> tuple[Tensor, Tensor]:
    """(p, L(p)): share of features (largest first) and the share of the total they carry."""
    v = values.double().flatten().sort(descending=True).values
    p = torch.arange(v.numel() + 1, dtype=torch.float64) / v.numel()
    carried = torch.cat([torch.zeros(1, dtype=torch.float64), v.cumsum(0)])
    return p, carried / carried[-1].clamp_min(1e-300)


def top_share(values: Tensor, share: float) -> float:
    """Share of the total carried by the top ``share`` of features (a point of the Lorenz curve)."""
    p, carried = lorenz_curve(values)
    return float(carried[round(share * (p.numel() - 1))])


@dataclass
class SparsityStats:
    """``record``'s result: ``sites[site][layer]`` is a ``SiteStats``."""

    sites: dict[str, list[SiteStats]]

    def layers(self, site: str) -> list[SiteStats]:
        if site not in self.sites:
            raise KeyError(f"Site {site!r} was not recorded; recorded: {list(self.sites)}.")
        return self.sites[site]

    @property
    def tokens(self) -> int:
        first = next(iter(self.sites.values()))
        return first[0].tokens

    def zero_fraction(self, site: str) -> list[float]:
        """Per layer, the share of exact zeros."""
        return [s.zero_fraction() for s in self.layers(site)]

    def fraction_at_most(self, site: str, magnitude: float | Sequence[float]) -> list[float]:
        """Per layer, the share of |x| <= magnitude (one number, or one per layer)."""
        stats = self.layers(site)
        limits = per_layer(magnitude, len(stats))
        return [s.fraction_at_most(t) for s, t in zip(stats, limits, strict=True)]

    def skippable_down_rows(self, magnitude: float | Sequence[float] = 0.0) -> list[float]:
        """Per layer, the share of W_down^T's rows a column-sparse kernel may skip (|h_j| <= t)."""
        return self.fraction_at_most("down_in", magnitude)

    def mean(self, values: Sequence[float]) -> float:
        return sum(values) / len(values)

    def frequency(self, site: str, layer: int | None = None) -> Tensor:
        """Per-feature activation frequency of one layer, or of all layers concatenated."""
        stats = self.layers(site)
        chosen = stats if layer is None else [stats[layer]]
        return torch.cat([s.frequency() for s in chosen])

    def lorenz(self, site: str, layer: int | None = None) -> tuple[Tensor, Tensor]:
        """Lorenz curve of activation counts (``lorenz_curve`` of ``frequency``)."""
        return lorenz_curve(self.frequency(site, layer))

    def quantiles(self, site: str, q: float) -> list[float]:
        """Per layer, the magnitude below which a share ``q`` of |x| lies."""
        return [s.quantile(q) for s in self.layers(site)]


def per_layer(values: float | Sequence[float], n_layers: int) -> list[float]:
    """One value per layer from a scalar or a sequence (checked)."""
    if isinstance(values, (int, float)):
        return [float(values)] * n_layers
    values = [float(v) for v in values]
    if len(values) != n_layers:
        raise ValueError(f"Got {len(values)} values for {n_layers} layers.")
    return values


def site_width(model: Transformer, site: str) -> int:
    c = model.config
    return {"attn_in": c.dim, "mlp_in": c.dim, "mlp_act": c.ffn_dim, "down_in": c.ffn_dim}.get(
        site, c.n_heads
    )


def head_norms(x: Tensor, n_heads: int) -> Tensor:
    """Per-head L2 norms of an attention output x [..., n_heads * head_dim]: [rows, n_heads]."""
    return x.reshape(-1, n_heads, x.shape[-1] // n_heads).norm(dim=-1)


def attach(layer: nn.Module, site: str, target: SiteStats, n_heads: int):
    """Hook that feeds ``target`` with what ``site`` of ``layer`` sees; returns the handle."""
    if site == "heads":

        def pre_hook(_module: nn.Module, args: tuple) -> None:
            target.update(head_norms(args[0].detach(), n_heads))

        return layer.attn.o_proj.register_forward_pre_hook(pre_hook)

    def hook(_module: nn.Module, _args: tuple, out: Tensor) -> None:
        target.update(out)

    owner, name = SLOTS[site](layer)
    return getattr(owner, name).register_forward_hook(hook)


#: Makes the summary of one site in one layer from its width: ``SiteStats`` or anything with
#: ``update(x)`` and ``quantile(q)`` (enough for ``SparsityStats.quantiles`` and ``thresholds_at``).
MakeStats = Callable[[int], SiteStats]


@contextlib.contextmanager
def recording(
    model: Transformer,
    sites: Sequence[str] = SITES,
    active_above: Mapping[str, float | Sequence[float]] | None = None,
    stats: MakeStats | None = None,
) -> Iterator[SparsityStats]:
    """Update a ``SparsityStats`` with every forward pass of ``model`` run inside the block.

    ``active_above[site]``: the magnitude (one, or one per layer) above which a feature counts
    as active for ``frequency``; default 0 (nonzero). ``stats(width)`` makes each summary in
    place of ``SiteStats`` (chapter 03 passes the class the learner wrote); it takes no
    ``active_above``.
    """
    sites = check_sites(sites)
    n = len(model.layers)
    if stats is not None and active_above:
        raise ValueError(
            "active_above sets SiteStats' activity threshold; a summary made by `stats` has "
            "none. Leave one of the two out."
        )
    limits = {s: per_layer((active_above or {}).get(s, 0.0), n) for s in sites}

    def make(site: str, layer: int) -> SiteStats:
        width = site_width(model, site)
        if stats is None:
            return SiteStats(width, active_above=limits[site][layer])
        return stats(width)

    recorded = SparsityStats({s: [make(s, i) for i in range(n)] for s in sites})
    handles = [
        attach(layer, site, recorded.sites[site][i], model.config.n_heads)
        for i, layer in enumerate(model.layers)
        for site in sites
    ]
    try:
        yield recorded
    finally:
        for handle in handles:
            handle.remove()


@torch.inference_mode()
def record(
    model: Transformer,
    token_batches: Tensor,
    sites: Sequence[str] = SITES,
    batch_size: int = 4,
    active_above: Mapping[str, float | Sequence[float]] | None = None,
    progress: bool = True,
    stats: MakeStats | None = None,
) -> SparsityStats:
    """Run ``token_batches`` [n, seq] through ``model``; summarise the activations at ``sites``.

    ``stats(width)`` makes each site's summary in place of ``SiteStats`` (see ``recording``).
    """
    device = next(model.parameters()).device
    with recording(model, sites, active_above, stats) as recorded:
        chunks = token_batches.split(batch_size)
        for chunk in tqdm(chunks, desc="recording", disable=not progress, leave=False):
            model(chunk.to(device))
    return recorded


def measure(model: Transformer, eval_ids: torch.Tensor, seq_len: int = 256) -> dict[str, float]:
    """Held-out perplexity and the share of exact zeros at each site, in one pass.

    The zeros at a site are the mean over layers of each layer's share (as
    ``SparsityStats.zero_fraction``); only the counts are kept, not ``record``'s histograms.
    """
    return measure_with_nlls(model, eval_ids, seq_len)[0]


def measure_with_nlls(
    model: Transformer, eval_ids: torch.Tensor, seq_len: int = 256
) -> tuple[dict[str, float], Tensor]:
    """``measure``'s numbers and, from the same pass, each window's mean NLL (``window_nlls``):
    what a paired comparison with another model on the same windows needs."""
    n = len(model.layers)
    slots = {f"{site}.{i}": getattr(*SLOTS[site](layer)) for site in SLOTS
             for i, layer in enumerate(model.layers)}  # fmt: skip
    with capture_outputs(slots, reduce=zero_count) as counts:
        nlls = window_nlls(model, eval_ids, seq_len=seq_len, progress=False)

    def share(key: str) -> float:
        zeros, entries = torch.stack(counts[key]).sum(0).tolist()
        return zeros / max(entries, 1)

    zeros = {f"zeros_{site}": sum(share(f"{site}.{i}") for i in range(n)) / n for site in SLOTS}
    return {"ppl": math.exp(float(nlls.mean())), **zeros}, nlls


def zero_count(x: Tensor) -> Tensor:
    """[exact zeros, entries] of x, as float64 (exact for counts below 2**53)."""
    return torch.tensor([float((x == 0).sum()), float(x.numel())], dtype=torch.float64)


__all__ = [
    "BINS_PER_DECADE",
    "LOG10_MAX",
    "LOG10_MIN",
    "N_BINS",
    "SITES",
    "SLOTS",
    "SiteStats",
    "SparsityStats",
    "attach",
    "check_sites",
    "check_sparsity",
    "head_norms",
    "lorenz_curve",
    "measure",
    "measure_with_nlls",
    "per_layer",
    "record",
    "recording",
    "site_width",
    "top_share",
    "zero_count",
]
