"""Grouping a layer's neurons into experts: neurons that fire together share an expert.

MoEfication (Zhang et al. 2022) splits a dense FFN of n neurons into E experts of m = n / E
neurons each. Which neurons go together decides how well the split works: a token then computes
only the k experts its router picks, so an expert whose neurons fire on the same tokens is
either worth computing as a whole or worth skipping as a whole.

**Co-activation profiles.** On calibration tokens, the activity matrix A [tokens, n] holds
A_tj = 1 when neuron j is active on token t (|h_j| > t_l, the rule of ``predictors.records``).
Neuron j's profile is its column p_j = A[:, j]; the squared distance between two profiles,
||p_i - p_j||^2 = #{t : exactly one of i, j fires}, counts the tokens on which the two
neurons disagree, so close profiles are neurons that fire together.

**Balanced k-means.** Minimise sum_j ||p_j - c_{g(j)}||^2 over the centres c_1..c_E and the
assignment g, under the constraint that every group holds exactly m neurons:

    assignment:  min_g  sum_j D[j, g(j)]    s.t. |{j : g(j) = e}| = m for every e,
                 D[j, e] = ||p_j - c_e||^2;
    update:      c_e = mean of the profiles assigned to e.

The balanced assignment is a linear assignment problem: copy every centre into m slots, so the
cost matrix is [n, E m] = [n, n] (slot s belongs to centre s // m), and solve it exactly
(Jonker-Volgenant, ``scipy.optimize.linear_sum_assignment``). Alternating the two steps never
raises the objective; stop when the assignment no longer changes. The start picks E distinct
neurons' profiles as centres with a seeded generator, so the grouping is deterministic.

**Random grouping**, the baseline: a seeded random permutation of the neurons cut into E
consecutive groups of m.

An expert list is a LongTensor [E, m] of neuron indices, each neuron exactly once (a partition
of 0..n-1, ``check_experts``).

Reference: Zhang et al., "MoEfication: Transformer Feed-forward Layers are Mixtures of Experts"
(Findings of ACL 2022).
"""

from __future__ import annotations

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment
from torch import Tensor

from ..core.checks import check_count

__all__ = [
    "GROUPINGS",
    "balanced_assignment",
    "balanced_kmeans",
    "check_experts",
    "expert_size",
    "experts_from_labels",
    "group_neurons",
    "random_grouping",
]

GROUPINGS = ("coactivation", "random")


def expert_size(n_neurons: int, n_experts: int) -> int:
    """m = n / E, the neurons per expert; a ValueError when E is not a whole number that
    divides n."""
    n_experts = check_count(n_experts, "n_experts", fix="a divisor of the MLP's neurons, e.g. 32")
    if n_neurons % n_experts:
        raise ValueError(
            f"n_experts={n_experts} must be a positive divisor of the {n_neurons} neurons so that "
            "every expert has the same size; pick a divisor (e.g. 8, 16, 32 for 1536)."
        )
    return n_neurons // n_experts


def balanced_assignment(cost: Tensor, size: int) -> Tensor:
    """The groups g [n] minimising sum_j cost[j, g(j)] with exactly ``size`` points per group.

    ``cost`` [n, E] with n = E * size; solved exactly as a linear assignment of the n points to
    n slots, ``size`` slots per group.
    """
    n, groups = cost.shape
    if n != groups * size:
        raise ValueError(f"cost has {n} points for {groups} groups of {size}; need n = E * size.")
    slots = np.repeat(cost.detach().double().cpu().numpy(), size, axis=1)
    rows, cols = linear_sum_assignment(slots)
    labels = torch.empty(n, dtype=torch.long)
    labels[torch.from_numpy(rows)] = torch.from_numpy(cols // size)
    return labels


def balanced_kmeans(points: Tensor, n_groups: int, seed: int = 0, iterations: int = 3) -> Tensor:
    """Balanced k-means of ``points`` [n, f] into ``n_groups`` groups of n / n_groups: labels [n].

    Start from ``n_groups`` distinct points chosen with a seeded generator; alternate the exact
    balanced assignment and the centre update for at most ``iterations`` rounds or until the
    labels stop changing.
    """
    size = expert_size(points.shape[0], n_groups)
    x = points.double()
    gen = torch.Generator().manual_seed(seed)
    centres = x[torch.randperm(x.shape[0], generator=gen)[:n_groups]]
    labels = torch.full((x.shape[0],), -1, dtype=torch.long)
    for _ in range(max(1, iterations)):
        new = balanced_assignment(torch.cdist(x, centres).pow(2), size)
        if torch.equal(new, labels):
            break
        labels = new
        sums = torch.zeros_like(centres).index_add_(0, labels, x)
        centres = sums / size
    return labels


def experts_from_labels(labels: Tensor, n_groups: int) -> Tensor:
    """Expert lists [E, m] from balanced labels [n] (each group's neurons in increasing order)."""
    size = expert_size(labels.numel(), n_groups)
    counts = torch.bincount(labels, minlength=n_groups)
    if counts.numel() != n_groups or not bool((counts == size).all()):
        raise ValueError(f"Labels are not balanced: group sizes {counts.tolist()}, want {size}.")
    order = torch.sort(labels, stable=True).indices  # by group, then by neuron
    return order.view(n_groups, size)


def random_grouping(n_neurons: int, n_experts: int, seed: int = 0) -> Tensor:
    """The baseline: a seeded random permutation cut into E groups of n / E: [E, m]."""
    size = expert_size(n_neurons, n_experts)
    gen = torch.Generator().manual_seed(seed)
    groups = torch.randperm(n_neurons, generator=gen).view(n_experts, size)
    return groups.sort(dim=1).values


def group_neurons(
    active: Tensor,
    n_experts: int,
    grouping: str = "coactivation",
    seed: int = 0,
    iterations: int = 3,
) -> Tensor:
    """Experts [E, m] for one layer from its activity matrix ``active`` [tokens, n] (bool).

    ``grouping``: "coactivation" (balanced k-means on the neurons' activity columns) or "random"
    (the baseline, which ignores ``active`` apart from its width).
    """
    if grouping not in GROUPINGS:
        raise ValueError(f"Unknown grouping {grouping!r}; use one of {GROUPINGS}.")
    if active.dim() != 2:
        raise ValueError(f"active must be [tokens, neurons], got shape {tuple(active.shape)}.")
    n = active.shape[1]
    expert_size(n, n_experts)
    if grouping == "random":
        return random_grouping(n, n_experts, seed)
    labels = balanced_kmeans(active.T.float(), n_experts, seed, iterations)
    return experts_from_labels(labels, n_experts)


def check_experts(experts: Tensor, n_neurons: int) -> Tensor:
    """``experts`` [E, m] if it partitions 0..n_neurons-1 into equal groups, else a ValueError."""
    if experts.dim() != 2 or experts.dtype != torch.long:
        raise ValueError(
            f"experts must be a LongTensor [E, m], got {experts.dtype} {experts.shape}."
        )
    flat = experts.flatten().sort().values
    if flat.numel() != n_neurons or not torch.equal(flat, torch.arange(n_neurons)):
        raise ValueError(
            f"experts must hold each of the {n_neurons} neurons exactly once; build them with "
            "group_neurons or random_grouping."
        )
    return experts
