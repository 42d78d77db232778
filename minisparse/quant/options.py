"""Each quantization method's own settings, with the papers' defaults and their checks.

``QuantConfig`` carries the settings every method shares (bits, groups, activations, packed
kernels) and, in ``options``, one of these: the method registers its class with its layer
function (``QuantMethod``), and ``QuantConfig.build`` routes each flat option to the method
that owns it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["AWQOptions", "GPTQOptions", "SmoothQuantOptions"]


@dataclass(frozen=True)
class SmoothQuantOptions:
    """SmoothQuant's own setting: the migration strength α (the paper uses 0.5)."""

    alpha: float = 0.5

    def __post_init__(self) -> None:
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1] (SmoothQuant uses 0.5), got {self.alpha}.")


@dataclass(frozen=True)
class AWQOptions:
    """AWQ's own settings: α searched on {0, 1/n, ..., (n-1)/n} (the paper: n = 20), whether
    to search a clipping ratio per layer, and the search itself (None: ``smoothing.awq_search``;
    a function with its signature, e.g. the course's learner's version)."""

    awq_grid: int = 20
    awq_clip: bool = True
    awq_search_fn: Callable[..., Any] | None = None

    def __post_init__(self) -> None:
        if (
            isinstance(self.awq_grid, bool)
            or not isinstance(self.awq_grid, int)
            or self.awq_grid < 1
        ):
            raise ValueError(
                f"awq_grid must be an integer >= 1 (AWQ uses 20), got {self.awq_grid!r}."
            )


@dataclass(frozen=True)
class GPTQOptions:
    """GPTQ's own settings: the damping λ = damp · mean(diag H) (the paper: 0.01), the
    columns updated together (128), and the quantizer of one matrix (None: ``gptq_quantize``
    on ``hessian(x)``; else ``gptq_fn(w, x, spec, damp) -> QuantizedTensor`` from the
    calibration inputs x, e.g. the course's learner's version)."""

    gptq_damp: float = 0.01
    gptq_block: int = 128
    gptq_fn: Callable[..., Any] | None = None

    def __post_init__(self) -> None:
        if not self.gptq_damp > 0:
            raise ValueError(f"gptq_damp must be > 0 (GPTQ uses 0.01), got {self.gptq_damp}.")
        if (
            isinstance(self.gptq_block, bool)
            or not isinstance(self.gptq_block, int)
            or self.gptq_block < 1
        ):
            raise ValueError(f"gptq_block must be an integer >= 1, got {self.gptq_block!r}.")
