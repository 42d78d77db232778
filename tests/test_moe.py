"""MoEfication: balanced groupings, the router's choice, MoE MLPs against masked dense MLPs."""

from __future__ import annotations

import itertools

import pytest
import torch

from conftest import tiny_model
from minisparse import moe
from minisparse.core.model import MLP
from minisparse.predictors import Predictor, confusion, init_random


def dense_h(mlp: MLP, x: torch.Tensor) -> torch.Tensor:
    """h = act(W_gate x) * (W_up x) in float64."""
    g = x.double() @ mlp.gate_proj.weight.double().T
    return torch.nn.functional.silu(g) * (x.double() @ mlp.up_proj.weight.double().T)


def loop_mask(chosen: torch.Tensor, experts: torch.Tensor, n: int) -> torch.Tensor:
    keep = torch.zeros(chosen.shape[0], n, dtype=torch.bool)
    for t in range(chosen.shape[0]):
        for e in range(experts.shape[0]):
            if chosen[t, e]:
                for j in experts[e].tolist():
                    keep[t, j] = True
    return keep


def planted(seed: int, tokens: int = 400, groups: int = 8, size: int = 10, noise: float = 0.05):
    """An activity matrix whose neurons fire in planted groups (shuffled), two groups a token,
    with a share ``noise`` of entries flipped; returns it with the planted groups."""
    gen = torch.Generator().manual_seed(seed)
    n = groups * size
    perm = torch.randperm(n, generator=gen)
    truth = perm.view(groups, size)
    on = torch.rand(tokens, groups, generator=gen).argsort(1)[:, :2]
    active = torch.zeros(tokens, n, dtype=torch.bool)
    for t in range(tokens):
        for g in on[t].tolist():
            active[t, truth[g]] = True
    flips = torch.rand(tokens, n, generator=gen) < noise
    return active ^ flips, truth


def setup(seed: int, n_experts: int = 8, top_k: int = 3):
    model = tiny_model(seed, std=0.1)
    mlp = model.layers[0].mlp
    experts = moe.random_grouping(80, n_experts, seed)
    router = init_random(Predictor(48, 4, n_experts), seed)
    x = torch.randn(13, 48, generator=torch.Generator().manual_seed(100 + seed))
    return model, mlp, experts, router, x


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_moe_mlp_equals_the_dense_mlp_with_other_neurons_zeroed(seed):
    _, mlp, experts, router, x = setup(seed)
    layer = moe.MoEMLP(mlp, experts, router, top_k=3)
    y = layer(x)
    # the router's top 3 experts, found independently in float64
    logits = x.double() @ router.down.weight.double().T @ router.up.weight.double().T
    logits += router.up.bias.double()
    top = logits.argsort(1, descending=True)[:, :3]
    chosen = torch.zeros(13, 8, dtype=torch.bool).scatter_(1, top, True)
    assert torch.equal(layer.last_chosen, chosen)
    keep = loop_mask(chosen, experts, 80)
    reference = (dense_h(mlp, x) * keep) @ mlp.down_proj.weight.double().T
    assert torch.allclose(y.double(), reference, atol=1e-6, rtol=1e-5)
    # zeroing all neurons instead would differ: the test can fail
    assert not torch.allclose(y.double(), dense_h(mlp, x) @ mlp.down_proj.weight.double().T)


@pytest.mark.parametrize("seed", [0, 1])
def test_all_experts_is_the_dense_mlp(seed):
    _, mlp, experts, router, x = setup(seed)
    experts = moe.group_neurons(torch.rand(50, 80) < 0.4, 8, "coactivation", seed)
    y = moe.MoEMLP(mlp, experts, router, top_k=8)(x.view(1, 13, 48))
    reference = dense_h(mlp, x) @ mlp.down_proj.weight.double().T
    assert y.shape == (1, 13, 48)
    assert torch.allclose(y[0].double(), reference, atol=1e-6, rtol=1e-5)


def test_moe_mlp_refuses_bad_input():
    _, mlp, experts, router, _ = setup(0)
    with pytest.raises(ValueError, match="top_k"):
        moe.MoEMLP(mlp, experts, router, top_k=9)
    with pytest.raises(ValueError, match="scores 8 experts"):
        moe.MoEMLP(mlp, moe.random_grouping(80, 4), router, top_k=2)
    with pytest.raises(ValueError, match="exactly once"):
        moe.MoEMLP(mlp, torch.zeros(8, 10, dtype=torch.long), router, top_k=2)
    with pytest.raises(ValueError, match="divisor"):
        moe.group_neurons(torch.rand(20, 80) < 0.5, 7)
    with pytest.raises(ValueError, match="Unknown grouping"):
        moe.group_neurons(torch.rand(20, 80) < 0.5, 8, "metis")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_balanced_assignment_is_the_best_balanced_one(seed):
    cost = torch.rand(6, 3, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    labels = moe.balanced_assignment(cost, 2)
    best = min(
        sum(float(cost[j, g]) for j, g in enumerate(p))
        for p in set(itertools.permutations([0, 0, 1, 1, 2, 2]))
    )
    assert torch.bincount(labels, minlength=3).tolist() == [2, 2, 2]
    assert sum(float(cost[j, g]) for j, g in enumerate(labels.tolist())) == pytest.approx(best)


@pytest.mark.parametrize("grouping", ["coactivation", "random"])
def test_groupings_are_balanced_partitions_and_deterministic(grouping):
    active = torch.rand(120, 80, generator=torch.Generator().manual_seed(3)) < 0.4
    a = moe.group_neurons(active, 8, grouping, seed=5)
    assert a.shape == (8, 10)
    assert sorted(a.flatten().tolist()) == list(range(80))
    assert torch.equal(a, moe.group_neurons(active, 8, grouping, seed=5))
    assert moe.check_experts(a, 80) is a


@pytest.mark.parametrize("seed", [0, 1])
def test_coactivation_beats_random_on_planted_groups(seed):
    active, truth = planted(seed)
    found = moe.group_neurons(active, 8, "coactivation", seed)
    assert {frozenset(g.tolist()) for g in found} == {frozenset(g.tolist()) for g in truth}
    recall = {
        name: confusion(moe.expert_mask(moe.oracle_experts(active, e, 2), e), active).recall
        for name, e in (("coactivation", found), ("random", moe.random_grouping(80, 8, seed + 100)))
    }
    assert recall["coactivation"] > 0.8 > 0.5 > recall["random"]


@pytest.mark.parametrize("seed", [0, 1])
def test_scores_and_masks_equal_a_direct_count(seed):
    gen = torch.Generator().manual_seed(seed)
    active = torch.rand(9, 80, generator=gen) < 0.3
    experts = moe.random_grouping(80, 8, seed)
    scores = moe.expert_scores(active, experts)
    for t in range(9):
        for e in range(8):
            assert scores[t, e] == pytest.approx(sum(active[t, j].item() for j in experts[e]) / 10)
    chosen = torch.rand(9, 8, generator=gen) < 0.5
    assert torch.equal(moe.expert_mask(chosen, experts), loop_mask(chosen, experts, 80))
    best = moe.oracle_experts(active, experts, 3)
    assert (best.sum(1) == 3).all()
    for t in range(9):  # every chosen expert holds at least as many active as any other
        assert scores[t][best[t]].min() >= scores[t][~best[t]].max()


def test_router_learns_a_planted_rule():
    gen = torch.Generator().manual_seed(7)
    directions = torch.randn(8, 16, generator=gen)
    truth = torch.arange(80).view(8, 10)

    def data(n: int):
        x = torch.randn(n, 16, generator=gen)
        on = (x @ directions.T).argsort(1, descending=True)[:, :2]  # the two planted groups
        active = torch.zeros(n, 80, dtype=torch.bool)
        for g in range(8):
            active[:, truth[g]] = (on == g).any(1, keepdim=True)
        return x, active

    x, active = data(3000)
    x_new, active_new = data(500)
    router = moe.train_router(x, active, truth, epochs=20, batch_size=1000, lr=3e-2)
    chosen = moe.route(router, x_new, 2)
    assert confusion(moe.expert_mask(chosen, truth), active_new).recall > 0.9
    untrained = init_random(Predictor(16, 8, 8), 0)
    assert (
        confusion(moe.expert_mask(moe.route(untrained, x_new, 2), truth), active_new).recall < 0.6
    )


@torch.no_grad()
def test_moefy_makes_a_copy_that_matches_the_masked_model():
    model = tiny_model(4, std=0.1)
    before = [layer.mlp.gate_proj.weight.clone() for layer in model.layers]
    tokens = torch.randint(0, 97, (4, 24), generator=torch.Generator().manual_seed(4))
    dense = model(tokens)
    full = moe.moefy(model, n_experts=8, top_k=8, calibration=tokens, epochs=2)
    assert all(isinstance(layer.mlp, moe.MoEMLP) for layer in full.layers)
    assert all(isinstance(layer.mlp, MLP) for layer in model.layers)
    after = [layer.mlp.gate_proj.weight for layer in model.layers]
    assert all(torch.equal(b, a) for b, a in zip(before, after, strict=True))
    assert torch.allclose(full(tokens), dense, atol=1e-5)
    # at k < E the copy computes what the dense model computes with the other experts zeroed
    sparse = moe.moefy(model, n_experts=8, top_k=2, calibration=tokens, epochs=2)
    layers = [moe.MoELayer(layer.mlp.experts, layer.mlp.router) for layer in sparse.layers]

    def choose(i, x, _h):
        return moe.expert_mask(moe.route(layers[i].router, x, 2), layers[i].experts)

    with moe.masks_chosen(model, choose):
        masked = model(tokens)
    assert torch.allclose(sparse(tokens), masked, atol=1e-5)
    assert not torch.allclose(masked, dense, atol=1e-3)
    with pytest.raises(ValueError, match="divisor"):
        moe.moefy(model, n_experts=7, calibration=tokens)
    with pytest.raises(ValueError, match="calibration"):
        moe.moefy(model, n_experts=8)


@torch.no_grad()
def test_recall_of_counts_the_kept_active_neurons():
    model = tiny_model(5, std=0.1)
    tokens = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(5))
    from minisparse.predictors import record_layers

    records = record_layers(model, tokens, [0.01, 0.02])
    gen = torch.Generator().manual_seed(6)
    masks = [torch.rand(32, 80, generator=gen) < 0.5 for _ in range(2)]
    kept = sum(int((m & r.active).sum()) for m, r in zip(masks, records, strict=True))
    total = sum(int(r.active.sum()) for r in records)
    assert moe.recall_of(model, records, lambda i, x, h: masks[i]) == pytest.approx(kept / total)
    # the oracle keeps every neuron with |h| above the threshold when k covers them
    exact = moe.recall_of(model, records, lambda i, x, h: h.abs() > [0.01, 0.02][i])
    assert exact == pytest.approx(1.0, abs=1e-2)


def test_compare_rows_on_a_tiny_model():
    model = tiny_model(6, std=0.1)
    gen = torch.Generator().manual_seed(6)
    calibration = torch.randint(0, 97, (4, 32), generator=gen)
    evaluation = torch.randint(0, 97, (3, 32), generator=gen)
    rows = moe.compare_with_predictors(
        model, calibration, evaluation, (0.25, 0.5), 8, (4,), epochs=2, progress=False
    )
    methods = ["oracle", "moe coactivation", "moe random", "predictor r=4"]
    assert [r.method for r in rows] == ["dense"] + methods * 2
    dense = rows[0]
    assert dense.recall == 1.0 and dense.mlp_bytes == 3 * 48 * 80 * 2 * 4
    for rho in (0.25, 0.5):
        at = {r.method: r for r in rows if r.density == rho}
        assert all(at["oracle"].recall >= r.recall for r in at.values())
        for r in at.values():
            assert r.mlp_bytes == round(rho * dense.mlp_bytes) + r.selector_bytes
            assert r.ppl.low <= r.ppl.mid <= r.ppl.high
        assert at["moe random"].selector_bytes == 2 * (8 * 48 + 8 * 8 + 8) * 4  # rank-8 routers
        assert at["predictor r=4"].selector_bytes == 2 * (4 * 48 + 4 * 80 + 80) * 4
    with pytest.raises(ValueError, match="multiple of 1/n_experts"):
        moe.compare_with_predictors(model, calibration, evaluation, (0.3,), 8, progress=False)
