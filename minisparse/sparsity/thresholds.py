"""Training-free activation sparsity: zero every activation below a calibrated magnitude.

Sparsity that a model does not have can be created without training. On calibration text pick,
per site and layer l, the magnitude t_l with

    P(|x| <= t_l) = s,

the s-quantile of |x| (read from ``stats``' histograms), and at inference replace x by

    x · 1[|x| > t_l],

so a share s of the entries is exactly zero and a sparse kernel may skip their weights. Small
activations contribute little to W x, so the error grows slowly with s: TEAL reports 40-50 %
model-wide sparsity with little degradation on Llama-2, Llama-3 and Mistral models.

Where to threshold. TEAL thresholds the projections' inputs (``attn_in``, ``mlp_in``,
``down_in``); CATS thresholds the SiLU output (``mlp_act``), which also makes ``down_in``
sparse, since h = act(W_gate x) * (W_up x).

``calibrate_thresholds`` returns the t_l (``thresholds_at`` from statistics already recorded),
``apply_thresholds_`` installs them as ``MagnitudeThreshold`` modules in the model's site slots
(in place: the trailing underscore), ``remove_thresholds_`` takes them out again, and
``thresholds_applied`` does both around a ``with`` block.

References: Liu et al., "Training-Free Activation Sparsity in Large Language Models" (TEAL,
2024); Lee et al., "CATS: Contextually-Aware Thresholding for Sparsity in Large Language Models"
(2024).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence

from torch import Tensor, nn

from ..core.model import Transformer
from ..kernels.abi import Slot
from ..runtime.lowering import activation_of, lowers, slot_of
from .stats import (
    SLOTS,
    SparsityStats,
    check_sites,
    check_sparsity,
    per_layer,
    record,
)

#: Per site, one threshold per layer.
Thresholds = dict[str, list[float]]


def calibrate_thresholds(
    model: Transformer,
    token_batches: Tensor,
    sparsity: float,
    sites: Sequence[str] = ("down_in",),
    batch_size: int = 4,
    progress: bool = True,
) -> Thresholds:
    """Per site and layer, the magnitude t_l with P(|x| <= t_l) = ``sparsity`` on the batches.

    TEAL's recipe: the ``sparsity``-quantile of |x| from the recorded histogram. Sites must have
    a module slot (``attn_in``, ``mlp_in``, ``mlp_act``, ``down_in``). Each site is calibrated
    on the model as given (thresholds at other sites are not active during calibration unless
    already applied).
    """
    sparsity = check_sparsity(sparsity)
    sites = check_sites(sites, tuple(SLOTS))
    stats = record(model, token_batches, sites, batch_size=batch_size, progress=progress)
    return thresholds_at(stats, sparsity, sites)


def cats_thresholds(model: Transformer, tokens: Tensor, sparsity: float) -> list[float]:
    """CATS (Lee et al. 2024): per layer, the t_l with P(|act(W_gate x)| <= t_l) = ``sparsity``.

    ``calibrate_thresholds`` at the ``mlp_act`` site, one threshold per layer: with them a share
    ``sparsity`` of the neurons is skipped on average (what ``minisparse.sparse`` acts on).
    """
    return calibrate_thresholds(model, tokens, sparsity, sites=("mlp_act",), progress=False)[
        "mlp_act"
    ]


def thresholds_at(stats: SparsityStats, sparsity: float, sites: Sequence[str]) -> Thresholds:
    """The thresholds ``calibrate_thresholds`` returns, from statistics already recorded.

    One ``record`` over the calibration text serves every target sparsity and every site it
    holds: each threshold is a quantile of the same histograms.
    """
    sparsity = check_sparsity(sparsity)
    sites = check_sites(sites, tuple(SLOTS))
    missing = [site for site in sites if site not in stats.sites]
    if missing:
        raise ValueError(
            f"These statistics hold no site {missing}; record them with "
            f"record(model, batches, sites={tuple(sites)!r})."
        )
    return {site: stats.quantiles(site, sparsity) for site in sites}


class MagnitudeThreshold(nn.Module):
    """Zero the outputs of ``inner`` with |y| <= threshold: y * 1[|y| > t].

    The threshold is a Python float (exact in any dtype); it travels in the ``state_dict`` as
    the module's extra state, so a saved and reloaded model keeps it.
    """

    def __init__(self, inner: nn.Module, threshold: float) -> None:
        super().__init__()
        self.inner = inner
        self.threshold = check_threshold(threshold)

    def forward(self, x: Tensor) -> Tensor:
        y = self.inner(x)
        return y.masked_fill(y.abs() <= self.threshold, 0.0)

    def get_extra_state(self) -> dict[str, float]:
        return {"threshold": self.threshold}

    def set_extra_state(self, state: dict[str, float]) -> None:
        self.threshold = check_threshold(state["threshold"])

    def extra_repr(self) -> str:
        return f"threshold={self.threshold:.4g}"


@lowers("slot", MagnitudeThreshold)
def threshold_slot(module: MagnitudeThreshold) -> Slot | None:
    """The compiled step applies a threshold on an Identity or ReLU slot itself (TEAL): the
    ReLU flag of the inner slot and this threshold. A threshold on a threshold stays in torch."""
    inner = slot_of(module.inner)
    if inner is None or inner.threshold >= 0:
        return None
    return Slot(inner.relu, module.threshold)


@lowers("activation", MagnitudeThreshold)
def threshold_activation(module: MagnitudeThreshold) -> tuple[int, float] | None:
    """A threshold on an MLP's activation (CATS: |act(W_gate x)| <= t -> 0): the activation's
    code and this threshold."""
    inner = activation_of(module.inner)
    if inner is None or inner[1] >= 0:
        return None
    return inner[0], module.threshold


def check_threshold(threshold: object) -> float:
    """A magnitude threshold as a float, after checking it is a finite number >= 0."""
    try:
        value = math.nan if isinstance(threshold, bool) else float(threshold)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        value = math.nan
    if not 0 <= value < math.inf:  # False for NaN
        raise ValueError(f"A threshold must be a number >= 0, got {threshold!r}.")
    return value


def apply_thresholds_(model: Transformer, thresholds: Mapping[str, Sequence[float]]) -> Transformer:
    """Install per-layer ``MagnitudeThreshold`` modules at the sites given; in place, returns it.

    Each wraps the module already in the slot (e.g. SiLU, or a ReLU from chapter 04), so the
    threshold acts on that module's output. ``remove_thresholds_`` undoes it. Every site and
    threshold is checked before the model is touched.
    """
    check_sites(list(thresholds), tuple(SLOTS))
    n = len(model.layers)
    checked = {
        site: [check_threshold(t) for t in per_layer(values, n)]
        for site, values in thresholds.items()
    }
    for site, values in checked.items():
        for layer, t in zip(model.layers, values, strict=True):
            owner, name = SLOTS[site](layer)
            setattr(owner, name, MagnitudeThreshold(getattr(owner, name), t))
    return model


def remove_thresholds_(model: Transformer) -> Transformer:
    """Take every ``MagnitudeThreshold`` out of the model's site slots; in place, returns it."""
    for layer in model.layers:
        for slot in SLOTS.values():
            owner, name = slot(layer)
            while isinstance(module := getattr(owner, name), MagnitudeThreshold):
                setattr(owner, name, module.inner)
    return model


# The names before the in-place convention (a trailing underscore), kept for existing code.
apply_thresholds = apply_thresholds_
remove_thresholds = remove_thresholds_


@contextlib.contextmanager
def thresholds_applied(
    model: Transformer, thresholds: Mapping[str, Sequence[float]]
) -> Iterator[Transformer]:
    """Run a block with ``thresholds`` installed in ``model``, then remove them."""
    apply_thresholds_(model, thresholds)
    try:
        yield model
    finally:
        remove_thresholds_(model)


__all__ = [
    "MagnitudeThreshold",
    "Thresholds",
    "apply_thresholds",
    "apply_thresholds_",
    "calibrate_thresholds",
    "cats_thresholds",
    "check_threshold",
    "remove_thresholds",
    "remove_thresholds_",
    "thresholds_applied",
    "thresholds_at",
]
