"""Chapter 06's core builds: its plausible wrong answers (``WRONG``, rejected in test_exercises.py),
and the learner's training loop and cutoff are what trains and cuts every predictor of the
pipeline."""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

from conftest import tiny_model
from minisparse import predictors as P
from minisparse.course.plug import solution

SOLUTIONS = Path(__file__).resolve().parents[1] / "notebooks" / "solutions"
train = solution("train_predictor", SOLUTIONS)
cutoff = solution("cutoff_for_recall", SOLUTIONS)


def loop(
    predictor, x, y, epochs, batch_size, lr, pos_weight, seed, *, weighted=True, zero_grad=True,
    per_epoch_schedule=False, keep_last=True, one_generator=True,
):  # fmt: skip
    """The training loop with one of its details changed (the keyword arguments)."""
    if epochs == 0:
        return predictor.eval().requires_grad_(False)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(predictor.parameters(), lr=lr)
    batches = math.ceil(x.shape[0] / batch_size) if keep_last else x.shape[0] // batch_size
    steps = epochs * (1 if per_epoch_schedule else max(batches, 1))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps)
    weight = torch.tensor(pos_weight if weighted else 1.0)
    predictor.train().requires_grad_(True)
    with torch.enable_grad():
        for _ in range(epochs):
            if not one_generator:
                gen = torch.Generator().manual_seed(seed)
            for idx in torch.randperm(x.shape[0], generator=gen).split(batch_size)[:batches]:
                loss = F.binary_cross_entropy_with_logits(
                    predictor(x[idx]), y[idx].float(), pos_weight=weight
                )
                if zero_grad:
                    opt.zero_grad()
                loss.backward()
                opt.step()
                if not per_epoch_schedule:
                    sched.step()
            if per_epoch_schedule:
                sched.step()
    return predictor.eval().requires_grad_(False)


def mistake(**changed):
    return lambda *args: loop(*args, **changed)


def all_logits_quantile(logits, active, recall):
    """The (1 - recall) quantile of every logit, active or not."""
    return float(torch.quantile(logits.flatten(), 1 - recall))


def rounded_k(logits, active, recall):
    """round((1 - recall) N) misses allowed instead of int(...): one miss too many at times."""
    positives = logits[active].sort().values
    if positives.numel() == 0:
        return math.inf
    k = round((1 - recall) * positives.numel())
    return float(positives[k - 1]) if k else float(positives[0]) - 1e-6


def min_itself(logits, active, recall):
    """For k = 0 the smallest active logit itself: that unit fails logit > cutoff."""
    positives = logits[active].sort().values
    if positives.numel() == 0:
        return math.inf
    k = int((1 - recall) * positives.numel())
    return float(positives[k - 1]) if k else float(positives[0])


WRONG = {
    "train_predictor": [
        mistake(weighted=False),
        mistake(zero_grad=False),
        mistake(per_epoch_schedule=True),
        mistake(keep_last=False),
        mistake(one_generator=False),
    ],
    "cutoff_for_recall": [all_logits_quantile, rounded_k, min_itself],
}


def recorded(seed: int = 0):
    model = tiny_model(seed=seed, std=0.2)
    gen = torch.Generator().manual_seed(10 + seed)
    windows = torch.randint(0, model.config.vocab_size, (6, 24), generator=gen)
    thresholds = [0.05] * model.config.n_layers
    train_records = P.record_layers(model, windows[:4], thresholds)
    val_records = P.record_layers(model, windows[4:], thresholds)
    return model, train_records, val_records, thresholds


def test_the_learners_loop_and_cutoff_train_and_cut_every_predictor():
    model, tr, val, thresholds = recorded()
    calls = {"train": 0, "cutoff": 0}

    def counted_train(*args):
        calls["train"] += 1
        return train(*args)

    def counted_cutoff(*args):
        calls["cutoff"] += 1
        return cutoff(*args)

    base = {"init": "random", "epochs": 2, "ranks": (4, 8), "head_sparsity": 0.25}
    mine_config = P.PredictorConfig(**base, train_loop=counted_train, cutoff_rule=counted_cutoff)
    mine = P.fit_predictors(model, tr, val, thresholds, mine_config, progress=False)
    library = P.fit_predictors(model, tr, val, thresholds, P.PredictorConfig(**base), False)
    tried = sum(len(h) for h in mine.history)
    assert calls == {"train": tried + model.config.n_layers, "cutoff": tried}  # + head predictors
    assert mine.ranks == library.ranks
    x = val[0].mlp_in
    for a, b in zip(mine.neurons, library.neurons, strict=True):
        assert torch.allclose(a(x), b(x), atol=1e-5) and float(a.cutoff) == float(b.cutoff)
    assert all(not p.training for p in mine.heads)


def test_a_different_loop_gives_the_pipeline_other_predictors():
    model, tr, val, thresholds = recorded(1)
    config = {"init": "random", "epochs": 2, "ranks": (8,)}
    wrong = P.PredictorConfig(**config, train_loop=mistake(weighted=False))
    other = P.fit_predictors(model, tr, val, thresholds, wrong, progress=False)
    library = P.fit_predictors(model, tr, val, thresholds, P.PredictorConfig(**config), False)
    x = val[0].mlp_in
    assert not torch.allclose(other.neurons[0](x), library.neurons[0](x), atol=1e-3)


def test_the_cutoff_rule_sets_the_recall_the_pipeline_reaches():
    _, tr, val, _ = recorded(2)
    p = P.build_predictor(8, None, None, tr[0].mlp_in, tr[0].active, val[0].mlp_in,
                          val[0].active, P.PredictorConfig(init="random"))[0]  # fmt: skip
    for recall in (0.5, 0.9, 1.0):
        P.calibrate_cutoff(p, val[0].mlp_in, val[0].active, recall, cutoff)
        mine = float(p.cutoff)
        P.calibrate_cutoff(p, val[0].mlp_in, val[0].active, recall)
        assert mine == float(p.cutoff)
        assert P.confusion(P.predict_neurons(p, val[0].mlp_in), val[0].active).recall >= recall
