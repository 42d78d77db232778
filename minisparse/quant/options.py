"""Each quantization method's own settings, with the papers' defaults and their checks.

``QuantConfig`` carries the settings every method shares (bits, groups, activations, packed
kernels) and, in ``options``, one of these: the method registers its class with its layer
function (``QuantMethod``), and ``QuantConfig.build`` routes each flat option to the method
that owns it.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    """AWQ's own settings: α searched on {0, 1/n, ..., (n-1)/n} (the paper: n = 20), and
    whether to search a clipping ratio per layer."""

    awq_grid: int = 20
    awq_clip: bool = True

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
    """GPTQ's own settings: the damping λ = damp · mean(diag H) (the paper: 0.01) and the
    columns updated together (128)."""

    gptq_damp: float = 0.01
    gptq_block: int = 128

    def __post_init__(self) -> None:
        if not self.gptq_damp > 0:
            raise ValueError(f"gptq_damp must be > 0 (GPTQ uses 0.01), got {self.gptq_damp}.")
        if (
            isinstance(self.gptq_block, bool)
            or not isinstance(self.gptq_block, int)
            or self.gptq_block < 1
        ):
            raise ValueError(f"gptq_block must be an integer >= 1, got {self.gptq_block!r}.")
