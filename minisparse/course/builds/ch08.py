"""Chapter 08's build: PowerInfer's neuron placement as an integer program.

``solve_ilp(frequencies, neuron_bytes, budget, group_size, min_per_layer)`` returns one boolean
mask per layer (True: the neuron sits on the fast device). Each layer's neurons, sorted by falling
frequency, are cut into groups of ``group_size`` (the last may be shorter), one 0/1 variable a_g
per group, and one y_l per layer:

    maximise    sum_g F_g a_g                  F_g = the summed frequency of group g
    subject to  sum_g B_g a_g <= budget        B_g = len(g) x bytes of one neuron of its layer
                C y_l <= sum_{g in l} len(g) a_g <= n_l y_l
                a_g, y_l in {0, 1}

Several placements can be optimal, so the check does not compare masks. It accepts a placement
that is feasible (within the budget; every layer 0 or at least C hot neurons; whole groups only)
and whose objective is at least the library's optimum (``offload.solve_ilp``, HiGHS) to 1e-6
relative. The fresh random instances have layers of different bytes per neuron and of different
frequency scales, so that the answers a first attempt gives fail: the LP relaxation rounded
(fractional y_l make the minimum vacuous), the program without the budget row or without the
minimum, and the greedy sort by frequency (right only when every neuron costs the same and no
minimum binds). The chapter then places the real model's neurons with it: ``offload.place``,
``time_model.policy_speeds`` and ``report.offload_report`` take it as ``solver=``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ...offload.placement import neuron_groups, solve_ilp
from ..grading import Exercise, register

__all__ = ["Placed", "placed"]

Cases = list[tuple[Any, ...]]
TOLERANCE = 1e-6  # relative, on the objective


@dataclass(frozen=True)
class Placed:
    """What a placement achieves on one instance (what the check compares)."""

    objective: float  # summed frequency of the hot neurons
    bytes_used: int
    per_layer: tuple[int, ...]  # hot neurons per layer
    whole_groups: bool  # every group all hot or all cold
    problem: str = ""  # what is wrong with the form of the returned value, if anything

    def __repr__(self) -> str:
        if self.problem:
            return self.problem
        split = "" if self.whole_groups else ", splits a group"
        return (f"objective {self.objective:.9g}, {self.bytes_used} bytes, hot per layer "
                f"{list(self.per_layer)}{split}")  # fmt: skip


def placed(
    masks: Any, frequencies: Sequence[Tensor], neuron_bytes: Sequence[int], group_size: int
) -> Placed:
    """Measure the masks a solver returned on its instance (never raises)."""
    widths = [f.numel() for f in frequencies]
    if not isinstance(masks, (list, tuple)) or len(masks) != len(frequencies):
        return Placed(math.nan, 0, (), False, f"not a list of {len(widths)} masks: {masks!r:.60}")
    hot = [torch.as_tensor(m) if not isinstance(m, Tensor) else m for m in masks]
    if any(h.dtype != torch.bool or h.shape != (n,) for h, n in zip(hot, widths, strict=True)):
        return Placed(math.nan, 0, (), False, f"masks must be bool tensors of widths {widths}")
    counts = tuple(int(h.sum()) for h in hot)
    whole = all(
        bool(h[g].all() or not h[g].any())
        for f, h in zip(frequencies, hot, strict=True)
        for g in neuron_groups(f, group_size)
    )
    return Placed(
        objective=sum(float(f[h].sum()) for f, h in zip(frequencies, hot, strict=True)),
        bytes_used=sum(c * b for c, b in zip(counts, neuron_bytes, strict=True)),
        per_layer=counts,
        whole_groups=whole,
    )


def _ilp_cases(gen: torch.Generator) -> Cases:
    """(frequencies, neuron_bytes, budget, group_size, min_per_layer) per case."""
    out: Cases = []
    settings = (  # layers, width, group_size, min_per_layer, budget share
        (1, 5, 1, 0, 0.5), (2, 6, 1, 3, 0.35), (3, 12, 2, 4, 0.3), (4, 20, 3, 6, 0.25),
        (3, 9, 4, 0, 0.6), (3, 10, 1, 5, 0.2), (2, 7, 8, 0, 0.5), (2, 8, 1, 2, 0.01),
    )  # fmt: skip
    for layers, width, group_size, minimum, share in settings:
        scale = torch.rand(layers, generator=gen, dtype=torch.float64) * 0.8 + 0.2
        f = [torch.rand(width, generator=gen, dtype=torch.float64) ** 2 * s for s in scale]
        sizes = torch.randint(1, 7, (layers,), generator=gen).tolist()  # bytes per neuron
        total = width * sum(sizes)
        budget = max(int(share * total), minimum * min(sizes), 1)
        out.append((f, sizes, budget, group_size, minimum))
    return out


def _library_ilp(
    frequencies: list[Tensor],
    neuron_bytes: list[int],
    budget: int,
    group_size: int,
    min_per_layer: int,
) -> list[Tensor]:
    return solve_ilp(frequencies, neuron_bytes, budget, group_size, min_per_layer, 60.0)[0]


def _run(solver: Any, args: tuple[Any, ...]) -> Placed:
    f, sizes, _, group_size, _ = args
    return placed(solver(*args), f, sizes, group_size)


def _optimal(args: tuple[Any, ...], got: Placed, expected: Placed) -> bool:
    """Feasible, in whole groups, and as good as the library's optimum (to TOLERANCE)."""
    _, _, budget, _, minimum = args
    return (
        not got.problem
        and got.whole_groups
        and got.bytes_used <= budget
        and all(c == 0 or c >= minimum for c in got.per_layer)
        and got.objective >= expected.objective - TOLERANCE * abs(expected.objective)
    )


def _same(a: Placed, b: Placed) -> bool:
    return a == b


register(
    "solve_ilp",
    Exercise(
        "08",
        "solve_ilp(frequencies [per layer, float64 [n_l]], neuron_bytes [per layer int], budget, "
        "group_size, min_per_layer) -> one bool mask [n_l] per layer: PowerInfer's placement "
        "solved with scipy.optimize.milp, one 0/1 variable per group of group_size neurons "
        "(each layer sorted by falling frequency) and one per layer; maximise the hot "
        "frequency, within the budget in bytes, every layer with no hot neuron or at least "
        "min_per_layer of them",
        _library_ilp,
        _ilp_cases,
        _same,
        "milp minimises: give it -gain; integrality=np.ones(n) with Bounds(0, 1) (without it "
        "the relaxation's fractional y_l make the minimum vacuous); rows: bytes <= budget, "
        "sum of the layer's neurons - C y_l >= 0 and - n_l y_l <= 0; a group costs len(g) x "
        "the bytes of its layer's neurons (they differ between layers, so the most frequent "
        "neurons first is not optimal); several placements can be optimal, the objective counts",
        accepts=_optimal,
        run=_run,
        core=True,
    ),
)
