"""Hot/cold offload: placement against brute force and greedy, the executor against dense math,
and the time model against its formula computed by hand."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from conftest import tiny_model
from minisparse import offload as O
from minisparse.offload import hybrid as H
from minisparse.offload import time_model as T
from minisparse.sparse import MaskedMLP, swap_mlps_
from minisparse.sparsity import cats_thresholds

TOKENS = torch.randint(0, 97, (3, 16), generator=torch.Generator().manual_seed(0))


def random_instance(seed: int, layers: int = 3, width: int = 4) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.rand(width, generator=gen, dtype=torch.float64) for _ in range(layers)]


def brute_force(f, sizes, budget, min_per_layer, group_size=1) -> float:
    """Best objective over every choice of groups (groups in order of falling frequency)."""
    groups = [O.neuron_groups(x, group_size) for x in f]
    flat = [(layer, g) for layer, gs in enumerate(groups) for g in gs]
    best = 0.0
    for choice in itertools.product((False, True), repeat=len(flat)):
        counts = [0] * len(f)
        value = used = 0.0
        for take, (layer, g) in zip(choice, flat, strict=True):
            if take:
                counts[layer] += len(g)
                used += len(g) * sizes[layer]
                value += float(f[layer][g].sum())
        if used <= budget and all(c == 0 or c >= min_per_layer for c in counts):
            best = max(best, value)
    return best


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("group_size", [1, 2])
def test_ilp_equals_the_brute_force_optimum_and_is_feasible(seed, group_size):
    f = random_instance(seed)
    sizes = [3, 5, 4]
    budget = 7 + 3 * seed
    min_per_layer = 2
    p = O.place(f, sizes, budget, "ilp", group_size=group_size, min_per_layer=min_per_layer)
    assert p.bytes_used <= budget and O.feasible(p, min_per_layer)
    assert p.bytes_used == sum(c * b for c, b in zip(p.hot_counts(), sizes, strict=True))
    assert p.objective == pytest.approx(
        sum(float(x[h].sum()) for x, h in zip(f, p.hot, strict=True))
    )
    assert p.objective == pytest.approx(brute_force(f, sizes, budget, min_per_layer, group_size))


@pytest.mark.parametrize("seed", range(8))
def test_ilp_is_at_least_as_good_as_greedy_when_greedy_is_feasible(seed):
    f = random_instance(seed, layers=4, width=40)
    budget = O.budget_for(f, 10, 0.1 + 0.1 * seed)
    for min_per_layer in (0, 3):
        greedy = O.place(f, 10, budget, "greedy")
        ilp = O.place(f, 10, budget, "ilp", group_size=1, min_per_layer=min_per_layer)
        assert O.feasible(ilp, min_per_layer) and ilp.bytes_used <= budget
        if O.feasible(greedy, min_per_layer):
            assert ilp.objective >= greedy.objective - 1e-9


def test_the_per_layer_minimum_changes_the_answer():
    """One hot neuron per layer beats any layer's top two, until a minimum of 2 forbids it."""
    f = [torch.tensor([0.9, 0.1, 0.0]), torch.tensor([0.8, 0.05, 0.0])]
    free = O.place(f, 1, 2, "ilp", group_size=1)
    assert free.hot_counts() == [1, 1] and free.objective == pytest.approx(1.7)
    bound = O.place(f, 1, 2, "ilp", group_size=1, min_per_layer=2)
    assert bound.hot_counts() == [2, 0] and bound.objective == pytest.approx(1.0)


def test_greedy_takes_the_most_frequent_neurons_and_layerwise_whole_layers():
    f = [torch.tensor([0.1, 0.9, 0.2]), torch.tensor([0.8, 0.3, 0.05])]
    greedy = O.place(f, 2, 6, "greedy")
    assert [h.tolist() for h in greedy.hot] == [[False, True, False], [True, True, False]]
    layerwise = O.place(f, 2, 11, "layerwise")
    assert [h.tolist() for h in layerwise.hot] == [[True] * 3, [False] * 3]
    assert layerwise.bytes_used == 6 and layerwise.objective == pytest.approx(1.2)


def test_fast_load_is_the_share_of_activations_on_the_fast_device():
    f = [torch.tensor([0.5, 0.25]), torch.tensor([0.25, 0.0])]
    p = O.place(f, 1, 1, "greedy")
    assert p.load(f) == pytest.approx(0.5)
    assert O.fast_load(p, [torch.tensor([0.0, 1.0]), torch.tensor([1.0, 1.0])]) == 0.0


def test_top_overlap_counts_shared_hot_neurons():
    a = torch.tensor([0.9, 0.8, 0.1, 0.0])
    assert O.top_overlap(a, a, 0.5) == 1.0
    assert O.top_overlap(a, torch.tensor([0.0, 0.8, 0.9, 0.1]), 0.5) == 0.5


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"budget_bytes": 0}, "budget_bytes must be > 0"),
        ({"budget_bytes": 10**9}, "beyond the model"),
        ({"neuron_bytes": [4, 4, 4]}, "Got 3 values for 2 layers"),
        ({"min_per_layer": 5}, "larger than layer 0"),
        ({"min_per_layer": 3, "budget_bytes": 8}, "infeasible for any layer"),
        ({"policy": "random"}, "Unknown policy"),
        ({"group_size": 0}, "group_size must be"),
        ({"frequencies": [torch.ones(4), torch.ones(3, 1)]}, r"frequencies\[1\] must be"),
        ({"frequencies": [torch.ones(4), -torch.ones(4)]}, "negative or non-finite"),
    ],
)
def test_place_refuses_bad_input(kwargs, message):
    args = {"frequencies": [torch.ones(4), torch.ones(4)], "neuron_bytes": 4, "budget_bytes": 16}
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        O.place(**args)


# --- the executor -------------------------------------------------------------------------


def split_model(seed: int = 0, select=None):
    model = tiny_model(seed=seed)
    thresholds = cats_thresholds(model, TOKENS, 0.5)
    f = O.profile(model, TOKENS, thresholds, progress=False)
    placement = O.place(f, O.neuron_bytes(model), O.budget_for(f, O.neuron_bytes(model), 0.4))
    hybrid = H.apply(model, placement, None if select else thresholds, select)
    return model, hybrid, placement, f


@torch.inference_mode()
def test_split_mlps_give_the_unsplit_models_logits_for_the_same_masks():
    model, hybrid, placement, _ = split_model()
    assert 0 < sum(placement.hot_counts()) < 2 * 80
    out = hybrid(TOKENS)
    masks = [layer.mlp.keep() for layer in hybrid.layers]
    assert all(0.2 < m.float().mean() < 0.8 for m in masks)
    reference = copy.deepcopy(model)
    swap_mlps_(
        reference,
        [MaskedMLP(layer.mlp, keep=m) for layer, m in zip(reference.layers, masks, strict=True)],
    )
    assert (out - reference(TOKENS)).abs().max() < 1e-4
    assert (out - model(TOKENS)).abs().max() > 1e-3  # the masks do change the result


@torch.inference_mode()
def test_split_with_a_selector_matches_the_masked_mlp():
    gen = torch.Generator().manual_seed(1)
    chosen = [torch.randperm(80, generator=gen)[:30] for _ in range(2)]

    def select(layer, x):
        return chosen[layer]

    model, hybrid, _, _ = split_model(select=select)
    reference = copy.deepcopy(model)
    swap_mlps_(
        reference,
        [
            MaskedMLP(layer.mlp, select=lambda x, i=i: chosen[i])
            for i, layer in enumerate(reference.layers)
        ],
    )
    assert (hybrid(TOKENS) - reference(TOKENS)).abs().max() < 1e-4


@torch.inference_mode()
def test_executed_fast_load_equals_the_placements_load_on_the_same_tokens():
    _, hybrid, placement, f = split_model()
    hybrid(TOKENS)
    assert H.executed_load(hybrid) == pytest.approx(placement.load(f), abs=1e-3)


def test_apply_leaves_its_argument_unchanged_and_checks_the_placement():
    model, hybrid, placement, _ = split_model()
    assert hybrid is not model and not isinstance(model.layers[0].mlp, H.HotColdMLP)
    with pytest.raises(ValueError, match="exactly one of"):
        H.apply(model, placement)
    short = O.Placement(placement.hot[:1], 0, 0.0, "ilp", 1)
    with pytest.raises(ValueError, match="1 layers, the model 2"):
        H.apply(model, short, thresholds=0.0)


# --- the time model -------------------------------------------------------------------------

CPU = T.Processor("cpu", bandwidth_gbs=20.0, call_us=30.0)
GPU = T.GPU(T.Processor("gpu", 800.0, 5.0, memory_gb=24), link_gbs=25.0, link_us=10.0, spec="")
SHAPE = T.ModelShape(
    "s", dim=8, ffn=4, layers=2, attn_params=100, head_params=50, bytes_per_weight=2
)


def test_hybrid_step_follows_its_formula():
    f = [torch.tensor([1.0, 0.5, 0.5, 0.0]), torch.tensor([0.25, 0.25, 0.0, 0.0])]
    hot = [torch.tensor([True, False, False, False]), torch.zeros(4, dtype=torch.bool)]
    nb = 3 * 8 * 2
    link = 2 * (10e-6 + 16 / 25e9)
    layer0 = 200 / 800e9 + 5e-6 + max(nb / 800e9 + 5e-6, nb / 20e9 + 30e-6 + link)
    layer1 = 200 / 800e9 + 5e-6 + (0.5 * nb / 20e9 + 30e-6 + link)
    expected = 100 / 800e9 + 5e-6 + layer0 + layer1
    assert T.hybrid_step(SHAPE, f, hot, CPU, GPU) == pytest.approx(expected)
    cpu_only = (2.5 * nb + 2 * 200 + 100) / 20e9 + 4 * 30e-6
    assert T.cpu_step(SHAPE, f, CPU) == pytest.approx(cpu_only)


def test_a_larger_batch_reads_the_union_of_its_tokens_neurons():
    f = torch.tensor([0.5, 0.1])
    assert T.active(f, 2).tolist() == pytest.approx([0.75, 0.19])
    assert T.active(f, 1).tolist() == pytest.approx([0.5, 0.1])


def test_resample_keeps_the_curve_and_stretches_it():
    f = [
        torch.linspace(1, 0, 5, dtype=torch.float64),
        torch.linspace(0.5, 0, 5, dtype=torch.float64),
    ]
    same = T.resample(f, 2, 5)
    assert all(torch.allclose(a, b) for a, b in zip(same, f, strict=True))
    big = T.resample(f, 3, 50)
    assert len(big) == 3 and big[0].numel() == 50
    assert float(big[0].mean()) == pytest.approx(0.5, abs=0.01)
    assert bool((big[2] <= 0.5).all()) and bool((big[0].diff() <= 0).all())


def test_layerwise_offload_puts_as_many_whole_layers_as_fit_on_the_gpu():
    shape = T.SHAPES["llama-13b"]  # 26 GB of fp16 weights: does not fit on 24 GB
    assert not T.fits_on_gpu(shape, T.GPUS["rtx4090"])
    per_layer = shape.attn_params * 2 + shape.ffn * shape.neuron_bytes
    room = 24e9 - T.RESERVE_GB * 1e9 - shape.head_params * 2
    k = int(room // per_layer)
    gpu, cpu = T.GPUS["rtx4090"], CPU
    expected = gpu.device.seconds(shape.head_params * 2) + gpu.device.seconds(k * per_layer, 2 * k)
    expected += cpu.seconds((40 - k) * per_layer, 2 * (40 - k)) + 10e-6
    assert T.layerwise_dense_step(shape, cpu, gpu) == pytest.approx(expected)


def test_policy_speeds_rank_hot_cold_above_layerwise_on_a_skewed_model():
    """At a realistic width bytes dominate: hot/cold wins. At a tiny one the fixed costs do."""
    gen = torch.Generator().manual_seed(0)
    f = [torch.rand(1024, generator=gen, dtype=torch.float64) ** 6 for _ in range(4)]
    shape = T.ModelShape("m", 4096, 1024, 4, attn_params=4 * 4096**2, head_params=1000 * 4096)
    budget = int(0.3 * shape.ffn_bytes)
    rows = T.policy_speeds(shape, f, CPU, GPU, budget_bytes=budget, group_size=8)
    assert rows["hot/cold greedy"]["fast_load"] > 2 * rows["layer-wise FFNs (sparse)"]["fast_load"]
    assert rows["hot/cold ILP"]["tok_s"] > 1.2 * rows["layer-wise FFNs (sparse)"]["tok_s"]
    assert "all GPU" not in rows  # 30 % of the neurons: the model does not fit
    full = T.policy_speeds(shape, f, CPU, GPU, budget_bytes=shape.ffn_bytes, group_size=8)
    assert full["all GPU"]["tok_s"] >= rows["hot/cold ILP"]["tok_s"]
    assert rows["hot/cold ILP"]["tok_s"] > rows["all CPU (sparse)"]["tok_s"]
    tiny = T.ModelShape("t", 256, 64, 4, attn_params=4 * 256**2, head_params=1000 * 256)
    small_f = [x[:64] for x in f]
    rows = T.policy_speeds(tiny, small_f, CPU, GPU, int(0.3 * tiny.ffn_bytes), group_size=1)
    assert rows["hot/cold ILP"]["fast_load"] >= rows["hot/cold greedy"]["fast_load"] - 1e-9
    assert rows["hot/cold ILP"]["tok_s"] < rows["layer-wise FFNs (sparse)"]["tok_s"]


def test_unknown_gpu_is_refused():
    with pytest.raises(ValueError, match="choose one of rtx4090"):
        T.check_gpu("h100")
