"""Hot/cold offload: which neurons belong on the fast device (PowerInfer, Song et al. 2023).

When a model does not fit in GPU memory, part of it must stay in host RAM and be computed
there. Layer-wise offload (llama.cpp's ``-ngl``) moves whole layers; PowerInfer moves
*neurons*. In a ReLU model a neuron j of layer l fires with a frequency f_lj that is very
uneven: a few hot neurons fire for most tokens, most neurons rarely. Put the hot ones on the
fast device and the per-token work that stays on the slow device shrinks far more than the
bytes that stay there.

**Profile.** ``profile`` measures f_lj = P(|act(W_gate x)_j| > t_l) over calibration tokens
(t_l = 0 for a ReLU model, chapter 03's thresholds otherwise), with ``sparsity.record``'s
streaming counters.

**Place.** With a_lj = 1 when neuron j of layer l is on the fast device, b_l the bytes of one
neuron (its gate and up rows and its down column) and B the budget, PowerInfer's integer
program is

    maximise    sum_lj f_lj a_lj                       (activated work on the fast device)
    subject to  sum_lj b_l a_lj <= B                   (memory)
                C y_l <= sum_j a_lj <= n_l y_l          (a layer that uses the fast device
                a_lj, y_l in {0, 1}                      uses it for at least C neurons)

The second line is the communication constraint: every layer with a fast part pays a
synchronisation, which only pays off above C neurons; y_l is the layer's indicator and n_l its
width (the big-M bound). Neurons are grouped by ``group_size`` in order of frequency (one
variable a group) to keep the program small; ``scipy.optimize.milp`` (HiGHS) solves it.
``"greedy"`` takes neurons by frequency across all layers until the budget is full;
``"layerwise"`` takes the first k whole layers, as ``-ngl k`` does.

**Measure.** The fast device's *load* is its share of the activated-neuron work,
sum_hot f / sum_all f, read on held-out text: PowerInfer reports ~20 % for layer-wise and
~70 % for its placement at the same memory.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ..core.model import Transformer
from ..sparsity import per_layer, record

__all__ = [
    "POLICIES",
    "Placement",
    "Solver",
    "budget_for",
    "check_frequencies",
    "check_neuron_bytes",
    "check_placement_arguments",
    "fast_load",
    "feasible",
    "greedy",
    "layerwise",
    "load_placement",
    "neuron_bytes",
    "neuron_groups",
    "place",
    "profile",
    "save_placement",
    "solve_ilp",
    "top_overlap",
]

POLICIES = ("ilp", "greedy", "layerwise")

#: (frequencies, bytes per neuron per layer, budget, group_size, min_per_layer) -> hot masks
Solver = Callable[[list[Tensor], list[int], int, int, int], Sequence[Tensor]]


@dataclass
class Placement:
    """Which neurons sit on the fast device: ``hot[l][j]`` is True for neuron j of layer l."""

    hot: list[Tensor]
    bytes_used: int
    objective: float  # summed frequency of the hot neurons (of the frequencies it was made for)
    policy: str
    budget_bytes: int
    solve_seconds: float = 0.0
    optimal: bool = True  # False when the solver stopped at its time limit

    def hot_counts(self) -> list[int]:
        return [int(h.sum()) for h in self.hot]

    def load(self, frequencies: Sequence[Tensor]) -> float:
        """The fast device's share of activated-neuron work under ``frequencies``."""
        return fast_load(self, frequencies)

    def save(self, path: str | Path) -> Path:
        """This placement as a safetensors file (``save_placement``)."""
        return save_placement(self, path)


# --- the file beside an exported model -----------------------------------------------------


def save_placement(placement: Placement, path: str | Path) -> Path:
    """``placement.hot`` as ``hot.{l}`` tensors of uint8 0/1 (1 = on the fast device), with
    the policy and budget as metadata: the file ``minisparse export`` ships beside a model."""
    from safetensors.torch import save_file

    tensors = {f"hot.{i}": h.to(torch.uint8).contiguous() for i, h in enumerate(placement.hot)}
    meta = {"policy": placement.policy, "budget_bytes": str(placement.budget_bytes)}
    save_file(tensors, str(path), metadata=meta)
    return Path(path)


def load_placement(path: str | Path) -> Placement:
    """The placement ``save_placement`` wrote (objective and bytes left at 0: not stored)."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        hot = [f.get_tensor(f"hot.{i}").bool() for i in range(len(list(f.keys())))]
    return Placement(hot, 0, 0.0, meta["policy"], int(meta["budget_bytes"]))


# --- checks ---------------------------------------------------------------------------------


def check_frequencies(frequencies: Sequence[Tensor]) -> list[Tensor]:
    """Per-layer 1-D tensors of finite values >= 0 (float64 copies), else a ValueError."""
    if isinstance(frequencies, Tensor) or len(frequencies) == 0:
        raise ValueError("frequencies must be a list with one 1-D tensor per layer.")
    out = []
    for i, f in enumerate(frequencies):
        f = torch.as_tensor(f, dtype=torch.float64)
        if f.dim() != 1 or f.numel() == 0:
            raise ValueError(
                f"frequencies[{i}] must be a non-empty 1-D tensor, got {tuple(f.shape)}."
            )
        if not bool(torch.isfinite(f).all()) or bool((f < 0).any()):
            raise ValueError(f"frequencies[{i}] holds negative or non-finite values.")
        out.append(f)
    return out


def check_neuron_bytes(neuron_bytes: int | Sequence[int], n_layers: int) -> list[int]:
    values = per_layer(neuron_bytes, n_layers)
    if any(v <= 0 or v != int(v) for v in values):
        raise ValueError(f"neuron_bytes must be positive whole numbers, got {neuron_bytes}.")
    return [int(v) for v in values]


def check_placement_arguments(
    widths: Sequence[int],
    sizes: Sequence[int],
    budget_bytes: float,
    policy: str,
    group_size: int,
    min_per_layer: int,
) -> int:
    """The budget as an int, or a ValueError that says which argument is wrong and the fix."""
    if policy not in POLICIES:
        raise ValueError(f"Unknown policy {policy!r}; choose one of {', '.join(POLICIES)}.")
    total = sum(n * b for n, b in zip(widths, sizes, strict=True))
    if not budget_bytes > 0:
        raise ValueError(f"budget_bytes must be > 0, got {budget_bytes}.")
    if budget_bytes > total:
        raise ValueError(
            f"budget_bytes {budget_bytes:,.0f} is beyond the model: all its FFN neurons take "
            f"{total:,} bytes. Give at most that (everything on the fast device)."
        )
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a whole number >= 1, got {group_size!r}.")
    if not isinstance(min_per_layer, int) or min_per_layer < 0:
        raise ValueError(f"min_per_layer must be a whole number >= 0, got {min_per_layer!r}.")
    for i, n in enumerate(widths):
        if min_per_layer > n:
            raise ValueError(
                f"min_per_layer={min_per_layer} is larger than layer {i} ({n} neurons); "
                f"use at most {min(widths)}."
            )
    return int(budget_bytes)


# --- profile --------------------------------------------------------------------------------


def profile(
    model: Transformer,
    token_batches: Tensor,
    thresholds: float | Sequence[float] = 0.0,
    batch_size: int = 4,
    progress: bool = True,
) -> list[Tensor]:
    """Per layer, each neuron's activation frequency P(|act(W_gate x)_j| > t_l) on the tokens."""
    stats = record(
        model,
        token_batches,
        sites=("mlp_act",),
        batch_size=batch_size,
        active_above={"mlp_act": thresholds},
        progress=progress,
    )
    return [s.frequency() for s in stats.layers("mlp_act")]


def neuron_bytes(model: Transformer, bytes_per_weight: int | None = None) -> int:
    """Bytes of one neuron's weights: its gate and up rows and its down column (3 x dim)."""
    w = model.layers[0].mlp.up_proj.weight
    return 3 * model.config.dim * (bytes_per_weight or w.element_size())


def top_overlap(a: Tensor, b: Tensor, share: float) -> float:
    """|top_a ∩ top_b| / k for the k = round(share n) most frequent neurons of a and of b."""
    k = max(1, round(share * a.numel()))
    top_a = set(a.argsort(descending=True, stable=True)[:k].tolist())
    top_b = set(b.argsort(descending=True, stable=True)[:k].tolist())
    return len(top_a & top_b) / k


# --- place ----------------------------------------------------------------------------------


def place(
    frequencies: Sequence[Tensor],
    neuron_bytes: int | Sequence[int],
    budget_bytes: float,
    policy: str = "ilp",
    group_size: int = 64,
    min_per_layer: int = 0,
    time_limit: float = 60.0,
    solver: Solver | None = None,
) -> Placement:
    """Choose the fast device's neurons under ``budget_bytes`` (see the module docstring).

    ``min_per_layer`` applies to ``"ilp"`` only (the greedy and layer-wise rules ignore it;
    ``feasible`` says whether their result meets it). ``solver`` stands in for ``solve_ilp``
    under ``"ilp"``: called as ``solver(frequencies, neuron_bytes, budget, group_size,
    min_per_layer)`` with float64 frequencies and one byte count per layer, it returns the
    boolean hot mask of each layer, taken as optimal (chapter 08's build plugs in here).
    """
    f = check_frequencies(frequencies)
    sizes = check_neuron_bytes(neuron_bytes, len(f))
    widths = [x.numel() for x in f]
    budget = check_placement_arguments(
        widths, sizes, budget_bytes, policy, group_size, min_per_layer
    )
    t0 = time.perf_counter()
    if policy == "greedy":
        hot, optimal = greedy(f, sizes, budget), True
    elif policy == "layerwise":
        hot, optimal = layerwise(widths, sizes, budget), True
    elif solver is None:
        hot, optimal = solve_ilp(f, sizes, budget, group_size, min_per_layer, time_limit)
    else:
        masks = solver(f, sizes, budget, group_size, min_per_layer)
        hot, optimal = [torch.as_tensor(h, dtype=torch.bool) for h in masks], True
    return Placement(
        hot=hot,
        bytes_used=sum(int(h.sum()) * b for h, b in zip(hot, sizes, strict=True)),
        objective=float(sum(x[h].sum() for x, h in zip(f, hot, strict=True))),
        policy=policy,
        budget_bytes=budget,
        solve_seconds=time.perf_counter() - t0,
        optimal=optimal,
    )


def greedy(f: list[Tensor], sizes: list[int], budget: int) -> list[Tensor]:
    """The most frequent neurons of all layers, in order, while they fit."""
    values = torch.cat(f)
    cost = torch.cat(
        [torch.full((x.numel(),), b, dtype=torch.float64) for x, b in zip(f, sizes, strict=True)]
    )
    order = values.argsort(descending=True, stable=True)
    chosen = torch.zeros(values.numel(), dtype=torch.bool)
    chosen[order[cost[order].cumsum(0) <= budget]] = True
    return list(chosen.split([x.numel() for x in f]))


def layerwise(widths: list[int], sizes: list[int], budget: int) -> list[Tensor]:
    """Whole layers from the first one on, while they fit (llama.cpp's ``-ngl``)."""
    hot, used = [], 0
    for n, b in zip(widths, sizes, strict=True):
        fits = used + n * b <= budget and (not hot or bool(hot[-1].all()))
        used += n * b if fits else 0
        hot.append(torch.full((n,), fits, dtype=torch.bool))
    return hot


def feasible(placement: Placement, min_per_layer: int) -> bool:
    """Every layer has no hot neuron or at least ``min_per_layer`` of them."""
    return all(c == 0 or c >= min_per_layer for c in placement.hot_counts())


def neuron_groups(f: Tensor, group_size: int) -> list[Tensor]:
    """The layer's neuron indices in order of falling frequency, cut into groups."""
    return list(f.argsort(descending=True, stable=True).split(group_size))


def solve_ilp(
    f: list[Tensor],
    sizes: list[int],
    budget: int,
    group_size: int,
    min_per_layer: int,
    time_limit: float,
) -> tuple[list[Tensor], bool]:
    """PowerInfer's program over neuron groups, solved by HiGHS through ``scipy``'s ``milp``."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    groups = [neuron_groups(x, group_size) for x in f]
    n_x = sum(len(g) for g in groups)
    n_vars = n_x + len(f)  # one a per group, then one y per layer
    gain = np.zeros(n_vars)
    weight = np.zeros(n_vars)  # bytes of each variable
    rows_min = np.zeros((len(f), n_vars))  # sum a (in neurons) - C y >= 0
    rows_max = np.zeros((len(f), n_vars))  # sum a (in groups) - G y <= 0
    k = 0
    for layer, (x, layer_groups) in enumerate(zip(f, groups, strict=True)):
        for g in layer_groups:
            gain[k] = float(x[g].sum())
            weight[k] = len(g) * sizes[layer]
            rows_min[layer, k] = len(g)
            rows_max[layer, k] = 1
            k += 1
        rows_min[layer, n_x + layer] = -min_per_layer
        rows_max[layer, n_x + layer] = -len(layer_groups)
    smallest = min(min_per_layer * b for b in sizes)
    if min_per_layer > 0 and smallest > budget:
        raise ValueError(
            f"The program is infeasible for any layer: min_per_layer={min_per_layer} neurons "
            f"need {smallest:,} bytes, more than budget_bytes={budget:,}. Lower min_per_layer "
            "or raise the budget."
        )
    constraints = [
        LinearConstraint(weight[None, :], -np.inf, budget),
        LinearConstraint(rows_min, 0, np.inf),
        LinearConstraint(rows_max, -np.inf, 0),
    ]
    result = milp(
        -gain,
        constraints=constraints,
        integrality=np.ones(n_vars),
        bounds=Bounds(0, 1),
        options={"time_limit": time_limit},
    )
    if result.x is None:
        raise RuntimeError(f"HiGHS found no solution: {result.message}")
    chosen = result.x[:n_x] > 0.5
    hot, k = [], 0
    for x, layer_groups in zip(f, groups, strict=True):
        mask = torch.zeros(x.numel(), dtype=torch.bool)
        for g in layer_groups:
            mask[g] = bool(chosen[k])
            k += 1
        hot.append(mask)
    return hot, result.status == 0


# --- measure --------------------------------------------------------------------------------


def fast_load(placement: Placement, frequencies: Sequence[Tensor]) -> float:
    """sum over hot neurons of f / sum over all neurons of f ("GPU neuron load")."""
    f = check_frequencies(frequencies)
    if [x.numel() for x in f] != [h.numel() for h in placement.hot]:
        raise ValueError("frequencies and placement describe layers of different widths.")
    total = sum(float(x.sum()) for x in f)
    hot = sum(float(x[h].sum()) for x, h in zip(f, placement.hot, strict=True))
    return hot / total if total > 0 else math.nan


def budget_for(
    frequencies: Sequence[Tensor], neuron_bytes: int | Sequence[int], share: float
) -> int:
    """``share`` of all FFN bytes (a budget as a fraction of the model's FFNs)."""
    sizes = check_neuron_bytes(neuron_bytes, len(frequencies))
    return int(share * sum(len(f) * b for f, b in zip(frequencies, sizes, strict=True)))
