"""Random inputs for timing the sparse kernels: FFN weights in their layouts, and active sets.

A sparse FFN at batch 1 reads the rows (gate, up) and the transposed rows (down) of the active
neurons only. To time it fairly against dense, the active sets are drawn at random and rotated
between calls (``random_active_sets``), so that no kernel can keep "its" rows in the last-level
cache while dense streams everything. On the CPU the weights are placed in huge pages
(``minisparse.kernels.cpu.hugepage_copy``), as the C fast path expects.

Used by the sparse-FFN benchmark (``minisparse.bench.kernels``, chapter 07) and by the CPU
measurement of the hot/cold offload model (``offload.time_model.measure_cpu``, chapter 08).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["FFNWeights", "check_sparsity", "random_active_sets", "random_ffn"]


def check_sparsity(s: float) -> float:
    """Sparsity is the fraction of neurons skipped: a number in [0, 1)."""
    if not 0.0 <= s < 1.0:
        raise ValueError(
            f"sparsity must be in [0, 1) (the fraction of neurons skipped), got {s}; "
            "use 0 for dense and e.g. 0.9 to skip 90 %."
        )
    return float(s)


def random_active_sets(
    n: int, sparsity: float, count: int, seed: int = 0, device: str | torch.device = "cpu"
) -> list[Tensor]:
    """``count`` sorted random index sets, each keeping round((1 - s) n) of n neurons."""
    check_sparsity(sparsity)
    keep = round((1.0 - sparsity) * n)
    gen = torch.Generator().manual_seed(seed)
    return [torch.randperm(n, generator=gen)[:keep].sort().values.to(device) for _ in range(count)]


@dataclass
class FFNWeights:
    """A random gated FFN in the layouts the sparse kernels read."""

    W_gate: Tensor  # [ffn, dim]
    W_up: Tensor  # [ffn, dim]
    W_down: Tensor  # [dim, ffn]  (nn.Linear layout, for the dense baseline)
    W_down_t: Tensor  # [ffn, dim] (transposed: neuron j's down weights contiguous)


def random_ffn(
    dim: int,
    ffn: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> FFNWeights:
    """Seeded random FFN weights; on the CPU placed in huge pages (``hugepage_copy``)."""
    from .cpu import hugepage_copy

    gen = torch.Generator().manual_seed(seed)

    def make(*shape: int) -> Tensor:
        w = torch.randn(*shape, generator=gen).mul_(dim**-0.5).to(dtype)
        return hugepage_copy(w) if torch.device(device).type == "cpu" else w.to(device)

    W_gate, W_up, W_down = make(ffn, dim), make(ffn, dim), make(dim, ffn)
    W_down_t = W_down.T.contiguous()
    if torch.device(device).type == "cpu":
        W_down_t = hugepage_copy(W_down_t)
    return FFNWeights(W_gate, W_up, W_down, W_down_t)
