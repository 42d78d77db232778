"""Chapter 06's builds: a predictor's training loop and its recall-calibrated cutoff.

``train_predictor(predictor, x, y, epochs, batch_size, lr, pos_weight, seed)`` trains one layer's
predictor in place from its current weights on inputs x [tokens, d] and active sets y [tokens, n]
(bool) with the library's recipe (``predictors.fit``): a weighted binary cross-entropy

    loss = -mean_j [ w y_j log sigmoid(z_j) + (1 - y_j) log(1 - sigmoid(z_j)) ],  w = pos_weight

minimised by Adam with a one-cycle learning rate stepped after every batch, over ``epochs``
passes through the tokens in a seeded random order. The check runs the learner's loop and the
library's from the same start and compares the trained predictors' logits on the inputs
(1e-4 relative): the same data order and the same update sequence give the same weights up to
float rounding (a loss written out by hand instead of ``binary_cross_entropy_with_logits``
lands within 1e-6), while a missing weight, gradients left to accumulate, a schedule stepped per
epoch, a dropped last batch or a generator seeded again every epoch (one order for all) move
them far more. Cases: both predictor kinds, token counts that are not a multiple of the batch,
one short batch, no epoch at all, sets with no active unit.

``cutoff_for_recall(logits, active, recall)`` is the cutoff each layer's predictor gets on
held-out tokens (``predictors.recall_cutoff``): units pass when logit > c, and c is the highest
value that still lets a share ``recall`` of the active units through. Any c that lets exactly
the same units pass is right. Edge cases: no active unit (inf), recall 1 and k = 0 (just below
the smallest active logit), a single unit.

Both plug into the pipeline through ``PredictorConfig(train_loop=..., cutoff_rule=...)``: every
predictor the chapter sizes, cuts and runs end to end is trained and cut by them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ...predictors.lowrank import Predictor, fit, init_random, recall_cutoff
from ..grading import Exercise, close, draw_int, near, register

__all__: list[str] = []

Cases = list[tuple[Any, ...]]


@dataclass(frozen=True)
class _Start:
    """A predictor's shape and seeded start (what a case prints, where a module would print
    its layers)."""

    dim: int
    rank: int
    units: int
    kind: str
    seed: int

    def build(self) -> Predictor:
        return init_random(Predictor(self.dim, self.rank, self.units, self.kind), self.seed)

    def __repr__(self) -> str:
        return f"{self.kind} predictor d={self.dim} r={self.rank} n={self.units}"


def _train_cases(gen: torch.Generator) -> Cases:
    """(start, x, y, epochs, batch_size, lr, pos_weight, seed) per case."""
    out: Cases = []
    shapes = (  # tokens, dim, rank, units, kind, epochs, batch_size, pos_weight
        (37, 12, 3, 20, "lowrank", 3, 8, 2.0), (50, 9, 4, 17, "mlp", 2, 16, 3.0),
        (5, 6, 2, 7, "lowrank", 2, 16, 1.0), (64, 10, 5, 11, "lowrank", 1, 16, 2.0),
        (29, 8, 3, 13, "mlp", 0, 8, 2.0),
    )  # fmt: skip
    for tokens, dim, rank, units, kind, epochs, batch, weight in shapes:
        start = _Start(dim, rank, units, kind, draw_int(gen, 0, 1000))
        x = torch.randn(tokens, dim, generator=gen)
        rule = torch.randn(units, dim, generator=gen)
        y = x @ rule.T > 0.5  # a rule the predictor can learn, about 30 % active
        out.append((start, x, y, epochs, batch, 1e-2, weight, draw_int(gen, 0, 1000)))
    x = torch.randn(21, 8, generator=gen)  # nothing active: every logit is pushed down
    empty = torch.zeros(21, 6, dtype=torch.bool)
    out.append((_Start(8, 2, 6, "lowrank", draw_int(gen, 0, 1000)), x, empty, 2, 4, 1e-2, 2.0, 3))
    return out


def _train_run(impl: Any, args: tuple[Any, ...]) -> Any:
    """Train the case's start with ``impl``; the trained predictor's logits on the inputs."""
    start, x, *rest = args
    trained = impl(start.build(), x, *rest)
    if trained is None:
        return None  # an unfinished stub: grading says so
    with torch.no_grad():
        return trained(x).detach()


def _same_logits(a: Any, b: Any) -> bool:
    return close(a, b, 1e-4)


register(
    "train_predictor",
    Exercise(
        "06",
        "train_predictor(predictor, x [tokens, d], y bool [tokens, n], epochs, batch_size, lr, "
        "pos_weight, seed) -> the predictor, trained in place from its current weights: "
        "g = torch.Generator().manual_seed(seed) made once; per epoch the batches are "
        "torch.randperm(tokens, generator=g).split(batch_size) (the last may be short); loss = "
        "F.binary_cross_entropy_with_logits(predictor(x[idx]), y[idx].float(), "
        "pos_weight=torch.tensor(pos_weight)); torch.optim.Adam(lr=lr) with "
        "torch.optim.lr_scheduler.OneCycleLR(max_lr=lr, total_steps=epochs * "
        "ceil(tokens / batch_size)), both stepped after every batch; return it with "
        "predictor.eval().requires_grad_(False) (epochs = 0: unchanged)",
        fit,
        _train_cases,
        _same_logits,
        "one generator for the whole run (not one per epoch), every batch including the last "
        "short one, opt.zero_grad() before each backward (gradients add up otherwise), "
        "pos_weight on the active units, sched.step() after every opt.step() with total_steps "
        "counting batches, not epochs",
        run=_train_run,
        core=True,
    ),
)


def _cutoff_cases(gen: torch.Generator) -> Cases:
    out: Cases = []
    shapes = ((1, 1, 1.0), (4, 20, 0.9), (16, 64, 0.95), (8, 50, 0.5), (3, 9, 1.0), (30, 7, 0.99))
    for tokens, units, recall in shapes:
        logits = torch.randn(tokens, units, generator=gen) * 2
        # mostly the units with high logits are active, as for a trained predictor
        active = torch.rand(tokens, units, generator=gen) < torch.sigmoid(2 * logits)
        active.view(-1)[0] = True  # at least one active unit
        out.append((logits, active, recall))
    out.append((torch.randn(3, 10, generator=gen), torch.zeros(3, 10, dtype=torch.bool), 0.9))
    return out


def _same_units_pass(args: tuple[Any, ...], got: Any, expected: Any) -> bool:
    """Any cutoff (a number, not NaN) that lets exactly the same units through is right."""
    logits = args[0]
    try:
        got = float(got)
    except (TypeError, ValueError):
        return False
    return not math.isnan(got) and bool(((logits > got) == (logits > expected)).all())


register(
    "cutoff_for_recall",
    Exercise(
        "06",
        "cutoff_for_recall(logits [tokens, n], active bool [tokens, n], recall) -> float: the "
        "highest cutoff c such that `logits > c` lets through a share >= recall of the active "
        "units (k = int((1 - recall) * N) of the N active ones may be missed); math.inf when "
        "no unit is active",
        recall_cutoff,
        _cutoff_cases,
        near,  # replaced by ``accepts``: any c that lets the same units through passes
        "only the active units' logits count (logits[active]), not all of them; with "
        "k = int((1 - recall) * N) the k-th smallest of them is the cutoff (units equal to it "
        "are the misses); for k = 0 every active unit must pass, so go just below the smallest "
        "(min - 1e-6); nothing active: math.inf",
        accepts=_same_units_pass,
        core=True,
    ),
)
