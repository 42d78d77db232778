"""Figures used by the notebooks and the CLI (matplotlib, labelled axes, one idea per figure)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from matplotlib.axes import Axes
from matplotlib.figure import Figure

__all__ = ["activation_histogram", "per_layer_bars"]


def activation_histogram(
    values: torch.Tensor, title: str, bins: int = 200, clip: float = 2.0
) -> Figure:
    """Histogram of activation values in [-clip, clip] on a log count axis."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 3.5), layout="constrained")
    ax = fig.add_subplot()
    data = values.flatten().float().clamp(-clip, clip).numpy()
    ax.hist(data, bins=bins, color="tab:blue")
    ax.set_yscale("log")
    ax.set_xlabel(f"activation value (clipped to ±{clip:g})")
    ax.set_ylabel("count (log scale)")
    ax.set_title(title)
    return fig


def per_layer_bars(ax: Axes, values: Sequence[float], ylabel: str, title: str) -> None:
    """One bar per layer."""
    ax.bar(np.arange(len(values)), values, color="tab:orange")
    ax.set_xlabel("layer")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
