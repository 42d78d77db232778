"""Sparsity predictors: planted rules recovered, scores equal direct counts, round trips."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import tiny_model
from minisparse import predictors as P
from minisparse.core.hooks import capture_inputs, capture_outputs
from minisparse.relufy import relufy
from minisparse.sparse import MaskedMLP, SparseMLP, using_mlps


def planted(seed: int, n: int = 3000, dim: int = 32, units: int = 48, rank: int = 4):
    """Inputs x and sets y = (W x > 0) with W of rank ``rank``: a rule a predictor can learn."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(units, rank, generator=gen) @ torch.randn(rank, dim, generator=gen)
    x = torch.randn(n, dim, generator=gen)
    return w, x, x @ w.T > 0


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("kind", ["lowrank", "mlp"])
def test_training_recovers_a_planted_low_rank_rule(seed, kind):
    w, x, y = planted(seed)
    x_new = torch.randn(1000, 32, generator=torch.Generator().manual_seed(50 + seed))
    y_new = x_new @ w.T > 0  # the same rule on fresh inputs
    p = P.init_random(P.Predictor(32, 8, 48, kind), seed)
    P.fit(p, x, y, epochs=30, batch_size=128, lr=1e-2, pos_weight=1.0, seed=seed)
    s = P.confusion(P.predict_neurons(p, x_new), y_new)
    assert s.recall > 0.95 and s.precision > 0.95
    untrained = P.init_random(P.Predictor(32, 8, 48, kind), seed)
    assert P.confusion(P.predict_neurons(untrained, x_new), y_new).precision < 0.8


def test_compressed_gate_of_full_rank_is_the_rule_itself():
    w, x, y = planted(2)
    p = P.init_compressed_gate(P.Predictor(32, 4, 48), w, P.principal_directions(w, x))
    assert torch.allclose(p(x), x @ w.T, atol=1e-3)  # rank 4 keeps all of a rank-4 gate
    s = P.confusion(P.predict_neurons(p, x), y)
    assert s.recall > 0.999 and s.precision > 0.999
    smaller = P.init_compressed_gate(P.Predictor(32, 2, 48), w, P.principal_directions(w, x))
    assert P.confusion(P.predict_neurons(smaller, x), y).recall < 0.99


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_scores_equal_a_direct_count(seed):
    gen = torch.Generator().manual_seed(seed)
    predicted = torch.rand(40, 30, generator=gen) < 0.4
    actual = torch.rand(40, 30, generator=gen) < 0.3
    tp = fp = fn = 0
    for p_row, a_row in zip(predicted.tolist(), actual.tolist(), strict=True):
        for p, a in zip(p_row, a_row, strict=True):
            tp += p and a
            fp += p and not a
            fn += a and not p
    s = P.confusion(predicted, actual)
    assert s.recall == tp / (tp + fn)
    assert s.precision == tp / (tp + fp)
    assert s.predicted_sparsity == 1 - (tp + fp) / 1200
    assert s.true_sparsity == 1 - (tp + fn) / 1200


@pytest.mark.parametrize("recall", [0.5, 0.9, 0.95, 1.0])
def test_cutoff_reaches_the_recall_target(recall):
    _, x, y = planted(3)
    p = P.init_random(P.Predictor(32, 2, 48), 0)  # a poor predictor: the cutoff does the work
    P.calibrate_cutoff(p, x, y, recall)
    got = P.confusion(P.predict_neurons(p, x), y).recall
    assert recall <= got <= recall + 1e-3


@pytest.mark.parametrize("positives", [1, 3, 10, 19])
def test_cutoff_keeps_the_target_with_few_positives(positives):
    x = torch.randn(40, 32, generator=torch.Generator().manual_seed(positives))
    y = torch.zeros(40, 48, dtype=torch.bool)
    y.view(-1)[torch.randperm(40 * 48, generator=torch.Generator().manual_seed(1))[:positives]] = (
        True
    )
    p = P.calibrate_cutoff(P.init_random(P.Predictor(32, 4, 48), 0), x, y, 0.95)
    assert P.confusion(P.predict_neurons(p, x), y).recall >= 0.95


def test_keep_largest_matches_sorting():
    gen = torch.Generator().manual_seed(4)
    scores = torch.rand(6, 20, generator=gen)
    counts = torch.tensor([0, 1, 5, 19, 20, 7])
    keep = P.keep_largest(scores, counts)
    for row, k in zip(range(6), counts.tolist(), strict=True):
        top = set(scores[row].argsort(descending=True)[:k].tolist())
        assert set(keep[row].nonzero().flatten().tolist()) == top


def relu_model(seed: int = 0):
    model = tiny_model(seed=seed, std=0.2, n_layers=3, dim=40, n_heads=4, head_dim=10, ffn_dim=70)
    return relufy(model, 1)


def windows(seed: int, n: int, seq: int = 32):
    return torch.randint(0, 97, (n, seq), generator=torch.Generator().manual_seed(seed))


CONFIG = P.PredictorConfig(ranks=(4, 8, 16, 32), epochs=1, head_sparsity=0.25, head_rank=8)


@pytest.fixture(scope="module")
def trained():
    model = relu_model()
    predictors = P.train_predictors(
        model, windows(1, 16), validation=windows(2, 4), config=CONFIG, progress=False
    )
    return model, predictors


def test_train_predictors_meets_the_target_and_sizes_by_the_ladder(trained):
    model, predictors = trained
    assert len(predictors.neurons) == 3 and predictors.head_keep == 3
    for tried, chosen in zip(predictors.history, predictors.ranks, strict=True):
        assert chosen in CONFIG.ranks
        by_rank = {t["rank"]: t for t in tried}
        assert chosen in by_rank
        for t in tried:  # every size meets the recall target on the validation tokens
            assert t["recall"] >= CONFIG.target_recall
        enough = {
            r
            for r, t in by_rank.items()
            if t["predicted_sparsity"] >= CONFIG.min_efficiency * t["true_sparsity"]
        }
        # the smallest enough rank tried, or the largest rank when none was enough
        assert chosen == (min(enough) if enough else CONFIG.ranks[-1])
    result = predictors.evaluate(model, windows(3, 4))
    assert len(result["recall"]) == 3 and 0.5 < result["mean_recall"] <= 1.0
    neuron_params = sum(p.num_parameters() for p in predictors.neurons)
    assert result["param_share"] == pytest.approx(neuron_params / (3 * 3 * 40 * 70))
    all_params = predictors.num_parameters() / (3 * 3 * 40 * 70)
    assert predictors.parameter_share(model, heads=True) == pytest.approx(all_params)


def test_evaluate_equals_direct_computation(trained):
    model, predictors = trained
    tokens = windows(5, 2)
    result = predictors.evaluate(model, tokens)
    records = P.record_layers(model, tokens, [0.0] * 3)
    for i, p in enumerate(predictors.neurons):
        with torch.no_grad():
            pred = p(records[i].mlp_in) > p.cutoff
        h_active = records[i].active
        tp = (pred & h_active).sum().item()
        assert result["recall"][i] == tp / h_active.sum().item()
        assert result["precision"][i] == tp / pred.sum().item()


def test_true_sets_reproduce_the_dense_relu_model(trained):
    model, predictors = trained
    tokens = windows(6, 2)
    with torch.no_grad():
        dense = model(tokens)
        with P.predicted_masks_applied(model, predictors, "true", heads=False):
            same = model(tokens)
        with P.predicted_masks_applied(model, predictors, "predicted", heads=False):
            predicted = model(tokens)
    assert torch.equal(same, dense)
    assert not torch.allclose(predicted, dense, atol=1e-4)


def test_predicted_masks_equal_the_sparse_kernel_path(trained):
    """One decode token: SparseMLP with the predictors' select == the masked dense MLPs."""
    model, predictors = trained
    x = torch.randn(1, 40, generator=torch.Generator().manual_seed(7))
    for i, layer in enumerate(model.layers):
        sparse = SparseMLP(layer.mlp, select=lambda v, i=i: predictors.select(i, v), backend="cpu")
        keep = P.predict_neurons(predictors.neurons[i], x)
        with torch.no_grad():
            assert torch.allclose(sparse(x), MaskedMLP(layer.mlp, keep=keep)(x), atol=1e-5)
    # the hooks of predicted_masks_applied against the kernels, for one decoded token
    token = windows(14, 1, seq=1)
    sparse = [
        SparseMLP(layer.mlp, select=lambda v, i=i: predictors.select(i, v), backend="cpu")
        for i, layer in enumerate(model.layers)
    ]
    with torch.no_grad():
        with P.predicted_masks_applied(model, predictors, "predicted", heads=False):
            hooked = model(token)
        with using_mlps(model, sparse):
            kernels = model(token)
    assert torch.allclose(hooked, kernels, atol=1e-5)
    quality = P.predicted_quality(model, predictors, windows(8, 4), heads=True)
    assert quality["true"]["density"] < 1 and quality["dense"]["agreement"] == 1.0
    assert set(quality) == {"dense", "true", "predicted", "oracle"}
    for mode in quality.values():  # one mean NLL per window, whose mean gives the perplexity
        assert len(mode["window_nll"]) == 4
        mean = sum(mode["window_nll"]) / 4
        assert math.exp(mean) == pytest.approx(mode["ppl"], rel=1e-6)


def test_save_load_round_trip(trained, tmp_path):
    model, predictors = trained
    path = predictors.save(tmp_path / "p.safetensors")
    loaded = P.Predictors.load(path, model)
    assert loaded.ranks == predictors.ranks and loaded.thresholds == predictors.thresholds
    assert loaded.kind == predictors.kind and loaded.lookahead == predictors.lookahead
    assert loaded.head_keep == predictors.head_keep and loaded.history == predictors.history
    x = torch.randn(5, 40, generator=torch.Generator().manual_seed(9))
    for a, b in zip(predictors.neurons, loaded.neurons, strict=True):
        assert torch.equal(a(x), b(x)) and torch.equal(a.cutoff, b.cutoff)
    for a, b in zip(predictors.heads, loaded.heads, strict=True):
        assert torch.equal(a(x), b(x))
    other = tiny_model(seed=0, std=0.2, n_layers=2, dim=40, n_heads=4, head_dim=10, ffn_dim=70)
    with pytest.raises(ValueError, match="not this one"):
        P.Predictors.load(path, other)
    mlps = torch.nn.ModuleList(P.init_random(P.Predictor(40, 4, 70, "mlp"), i) for i in range(3))
    ahead = P.Predictors(mlps, predictors.thresholds, "mlp", lookahead=True)
    with pytest.raises(ValueError, match="does not record the model"):  # made by hand
        P.Predictors.load(ahead.save(tmp_path / "ahead.safetensors"), model)
    ahead.made_for = P.model_fingerprint(model)
    again = P.Predictors.load(ahead.save(tmp_path / "ahead.safetensors"), model)
    assert again.kind == "mlp" and again.lookahead and again.heads is None
    assert all(torch.equal(a(x), b(x)) for a, b in zip(mlps, again.neurons, strict=True))


def test_lookahead_predictors_read_the_previous_layer():
    model = relu_model(1)
    config = P.PredictorConfig(ranks=(8, 16), epochs=1, lookahead=True)
    predictors = P.train_predictors(
        model, windows(10, 8), validation=windows(11, 2), config=config, progress=False
    )
    records = P.record_layers(model, windows(12, 2), [0.0] * 3)
    assert predictors.neuron_input(records, 2) is records[1].mlp_in
    assert predictors.neuron_input(records, 0) is records[0].mlp_in
    with pytest.raises(ValueError, match="previous layer"):
        predictors.select(1, records[1].mlp_in)
    scores = predictors.score(model, records)
    for i, p in enumerate(predictors.neurons):  # the direct computation, one layer behind
        source = records[max(i - 1, 0)].mlp_in
        want = P.confusion(P.predict_neurons(p, source), records[i].active)
        assert scores["recall"][i] == want.recall and scores["precision"][i] == want.precision
    # in the masked model, layer 2's mask comes from layer 1's MLP input of the same pass
    mlps = {str(i): layer.mlp for i, layer in enumerate(model.layers)}
    outs = {str(i): layer.mlp.down_in_act for i, layer in enumerate(model.layers)}
    with torch.no_grad(), P.predicted_masks_applied(model, predictors):
        with capture_inputs(mlps) as seen, capture_outputs(outs) as h:
            model(windows(15, 2))
    x1, x2, h2 = (
        seen["1"][0].reshape(-1, 40),
        seen["2"][0].reshape(-1, 40),
        h["2"][0].reshape(-1, 70),
    )
    ahead, own = (P.predict_neurons(predictors.neurons[2], x) for x in (x1, x2))
    assert not torch.equal(ahead, own)
    assert (h2[~ahead] == 0).all() and (h2[ahead] != 0).any()


def test_mlp_cost_by_hand(trained):
    model, predictors = trained
    cost = P.mlp_cost(model, predictors, density=0.25)
    dense = 6 * 40 * 70 * 3
    per = 2 * sum(p.num_parameters() for p in predictors.neurons)
    assert cost["dense_flops"] == dense and cost["predictor_flops"] == per
    assert cost["skipped_share"] == pytest.approx(1 - (0.25 * dense + per) / dense)


def test_bad_input_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="Unknown predictor kind"):
        P.PredictorConfig(kind="tree")
    with pytest.raises(ValueError, match="increasing"):
        P.PredictorConfig(ranks=(32, 16))
    with pytest.raises(ValueError, match="not on the ladder"):
        P.PredictorConfig(ranks=(16, 32), start_rank=24)
    with pytest.raises(ValueError, match="epochs >= 1"):
        P.PredictorConfig(kind="mlp", epochs=0)
    with pytest.raises(FileNotFoundError, match="train_predictors"):
        P.Predictors.load(tmp_path / "missing.safetensors", relu_model())
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, tmp_path / "other.safetensors")
    with pytest.raises(ValueError, match="not a predictors file"):
        P.Predictors.load(tmp_path / "other.safetensors", relu_model())
    with pytest.raises(ValueError, match="thresholds"):
        P.train_predictors(relu_model(), windows(0, 4), thresholds=[0.0], progress=False)


def test_target_falls_back_to_thresholds_or_uses_the_relufied_model(tmp_path, monkeypatch):
    from minisparse.relufy import result_dir, save_relufied
    from minisparse.sparsity import calibrate_thresholds

    monkeypatch.setenv("MINISPARSE_CACHE", str(tmp_path))
    base = tiny_model(seed=3, std=0.2, n_layers=3, dim=40, n_heads=4, head_dim=10, ffn_dim=70)
    calib = windows(13, 4)
    target = P.prediction_target(base, calib, sparsity=0.4)
    want = calibrate_thresholds(base, calib, 0.4, ("down_in",), progress=False)["down_in"]
    assert target.model is base and target.thresholds == want
    assert "SiLU" in target.description
    relu = relufy(base, 1)
    with torch.no_grad():
        relu.layers[0].mlp.up_proj.weight.mul_(2.0)  # a "fine-tuned" weight
    info = {"trained": ["layers.0.mlp.up_proj.weight"], "config": {"steps": 7}}
    save_relufied(relu, result_dir(1, "mlp") / "model.safetensors", 1, info)
    target = P.prediction_target(base, calib)
    assert target.thresholds == [0.0] * 3 and "ReLU" in target.description
    assert torch.equal(target.model.layers[0].mlp.up_proj.weight, relu.layers[0].mlp.up_proj.weight)
