"""Chapter 08's core build: each check rejects the plausible wrong programs, and the learner's
program places the neurons that the hybrid executor and the time model then use."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.optimize import Bounds, LinearConstraint, milp

from conftest import tiny_model
from minisparse import offload as O
from minisparse.course.builds.ch08 import placed
from minisparse.course.plug import solution
from minisparse.offload import hybrid as H
from minisparse.offload import time_model as T
from minisparse.sparsity import cats_thresholds

SOLUTIONS = Path(__file__).resolve().parents[1] / "notebooks" / "solutions"
solve = solution("solve_ilp", SOLUTIONS)


def program(f, sizes, budget, group_size, minimum, integral=True, budget_row=True, floor=True):
    """The placement program with one of its parts left out, as a first attempt might."""
    groups = [x.argsort(descending=True, stable=True).split(group_size) for x in f]
    n_groups = sum(len(g) for g in groups)
    n = n_groups + len(f)
    gain, cost = np.zeros(n), np.zeros(n)
    at_least, at_most = np.zeros((len(f), n)), np.zeros((len(f), n))
    k = 0
    for layer, (x, gs) in enumerate(zip(f, groups, strict=True)):
        for g in gs:
            gain[k], cost[k] = float(x[g].sum()), len(g) * sizes[layer]
            at_least[layer, k] = at_most[layer, k] = len(g)
            k += 1
        at_least[layer, n_groups + layer] = -minimum
        at_most[layer, n_groups + layer] = -len(x)
    rows = [LinearConstraint(at_most, -np.inf, 0)]
    rows += [LinearConstraint(cost[None, :], -np.inf, budget)] if budget_row else []
    rows += [LinearConstraint(at_least, 0, np.inf)] if floor else []
    result = milp(
        -gain, constraints=rows, integrality=np.full(n, int(integral)), bounds=Bounds(0, 1)
    )
    chosen, hot, k = result.x[:n_groups] > 0.5, [], 0
    for x, gs in zip(f, groups, strict=True):
        mask = torch.zeros(len(x), dtype=torch.bool)
        for g in gs:
            mask[g] = bool(chosen[k])
            k += 1
        hot.append(mask)
    return hot


def relaxed(f, sizes, budget, group_size, minimum):
    """The LP relaxation (no integrality), rounded at 0.5."""
    return program(f, sizes, budget, group_size, minimum, integral=False)


def no_budget(f, sizes, budget, group_size, minimum):
    return program(f, sizes, budget, group_size, minimum, budget_row=False)


def no_minimum(f, sizes, budget, group_size, minimum):
    return program(f, sizes, budget, group_size, minimum, floor=False)


def greedy_groups(f, sizes, budget, group_size, minimum):
    """The most frequent groups of all layers first, while they fit."""
    groups = [
        (float(x[g].sum()), layer, g)
        for layer, x in enumerate(f)
        for g in x.argsort(descending=True, stable=True).split(group_size)
    ]
    hot, used = [torch.zeros(len(x), dtype=torch.bool) for x in f], 0
    for _, layer, g in sorted(groups, key=lambda item: -item[0]):
        if used + len(g) * sizes[layer] > budget:
            break
        hot[layer][g] = True
        used += len(g) * sizes[layer]
    return hot


WRONG = {"solve_ilp": [relaxed, no_budget, no_minimum, greedy_groups]}


def test_any_optimal_placement_passes_and_the_form_is_checked(capsys):
    """Ties make several placements optimal: the check compares objectives, not masks."""
    f = [torch.tensor([0.5, 0.5, 0.1], dtype=torch.float64)]
    args = (f, [1], 1, 1, 0)
    from minisparse.course.builds import ch08

    first = placed([torch.tensor([True, False, False])], f, [1], 1)
    second = placed([torch.tensor([False, True, False])], f, [1], 1)
    assert ch08._optimal(args, first, second) and ch08._optimal(args, second, first)
    assert placed([[1, 0, 0]], f, [1], 1).problem  # ints, not bools
    assert placed(torch.zeros(3, dtype=torch.bool), f, [1], 1).problem  # not a list
    split = placed([torch.tensor([True, False, False])], f, [1], 2)
    assert not split.whole_groups and not ch08._optimal((*args[:3], 2, 0), split, split)


def test_the_learners_program_places_the_neurons_the_executor_and_time_model_use():
    model = tiny_model(seed=0)
    tokens = torch.randint(0, 97, (3, 16), generator=torch.Generator().manual_seed(0))
    thresholds = cats_thresholds(model, tokens, 0.5)
    f = O.profile(model, tokens, thresholds, progress=False)
    nb = O.neuron_bytes(model)
    budget = O.budget_for(f, nb, 0.4)
    calls = []

    def counted(*args):
        calls.append(args[2])
        return solve(*args)

    theirs = O.place(f, nb, budget, "ilp", group_size=4, min_per_layer=8, solver=counted)
    library = O.place(f, nb, budget, "ilp", group_size=4, min_per_layer=8)
    assert calls == [budget] and theirs.policy == "ilp"
    assert theirs.objective == pytest.approx(library.objective, rel=1e-6)
    assert theirs.bytes_used <= budget and O.feasible(theirs, 8)
    hybrid = H.apply(model, theirs, thresholds)
    with torch.inference_mode():
        hybrid(tokens[:1])
    assert 0 < H.executed_load(hybrid) <= 1
    shape = T.shape_of(model)
    cpu = T.Processor("cpu", 20.0, 5.0)
    speeds = T.policy_speeds(shape, f, cpu, T.GPUS["rtx4090"], budget, group_size=4, solver=counted)
    assert len(calls) == 2 and speeds["hot/cold ILP"]["tok_s"] > 0
