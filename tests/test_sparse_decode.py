"""``minisparse bench sparse-decode``: bytes per token, measured sparsity, the command line."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from torch import nn

import minisparse.io.loading
from conftest import tiny_model
from minisparse.bench import sparse_decode
from minisparse.bench.sparse_decode import default_method, mlp_inputs, set_density_
from minisparse.bench.sparse_steps import (
    bench_sparse_decode,
    predictor_bytes,
    site_zero_shares,
    sparse_perplexity,
    thresholded_step_bytes,
)
from minisparse.cli import main
from minisparse.core.model import make_cache
from minisparse.engine import sparse_model, step_bytes
from minisparse.io.eval import perplexity
from minisparse.measure.machine import machine
from minisparse.predictors import Predictors, model_fingerprint
from minisparse.predictors.lowrank import Predictor, init_random
from minisparse.sparsity import apply_thresholds_

PROMPT = [5, 17, 3, 88, 41, 9, 60, 2, 33, 71]


def relu_thresholded(seed: int = 0, **thresholds: float):
    """A tiny ReLU model and a copy with a threshold per layer at the sites given (an untied
    head: with E as the head, a tiny random model only repeats its last token)."""
    dense = tiny_model(seed=seed, hidden_act="relu", max_seq_len=300, tie_embeddings=False)
    sparse = apply_thresholds_(copy.deepcopy(dense), {s: [t, t] for s, t in thresholds.items()})
    return dense, sparse


def test_thresholded_step_bytes_is_a_hand_count():
    model = tiny_model()  # dim 48, q 48 x 48, k and v 24 x 48, ffn 80, vocab 97 (tied), 2 layers
    per_layer = 2 * 48 + 48 * 48 + 2 * 24 * 48 + 48 * 48 + 3 * 80 * 48
    dense = 4 * (97 * 48 + 48 + 2 * per_layer)
    assert step_bytes(model) == dense
    shares = {"attn_in": [0.5, 0.25], "mlp_in": [0.1, 0.0], "down_in": [0.2, 0.4]}
    qkv, gate_up, down = 48 * 48 + 2 * 24 * 48, 2 * 80 * 48, 48 * 80
    saved = 4 * (0.75 * qkv + 0.1 * gate_up + 0.6 * down)
    assert thresholded_step_bytes(model, shares) == pytest.approx(dense - saved, abs=1e-6)
    assert thresholded_step_bytes(model, {"down_in": [0.0, 0.0]}) == dense
    with pytest.raises(ValueError):  # one share per layer
        thresholded_step_bytes(model, {"mlp_in": [0.5]})


def test_predictor_bytes_counts_the_predictors_the_sparse_mlps_call():
    model = tiny_model(seed=1, hidden_act="relu")
    neurons = nn.ModuleList(Predictor(48, 4, 80) for _ in range(2))
    predictors = Predictors(neurons, [0.0, 0.0], "lowrank")
    sparse = sparse_model(model, None, predictors.select, kernels=True)
    # per layer: down 4 x 48 (no bias), up 80 x 4 + 80 bias, the cutoff; float32
    assert predictor_bytes(sparse) == 2 * 4 * (4 * 48 + 80 * 4 + 80 + 1)
    assert predictor_bytes(model) == 0


def test_site_zero_shares_count_the_zeros_each_threshold_outputs():
    _, sparse = relu_thresholded(seed=2, down_in=0.0, attn_in=1e9)
    tokens = [7, 8, 9, 10, 11, 12]
    shares = site_zero_shares(sparse, PROMPT, tokens)
    assert shares["attn_in"] == [1.0, 1.0] and shares["mlp_in"] == [0.0, 0.0]
    # independently: the zeros at the down projection's input in one forward over the sequence
    seen = []
    hooks = [
        layer.mlp.down_proj.register_forward_pre_hook(lambda _m, a: seen.append(a[0][0]))
        for layer in sparse.layers
    ]
    with torch.no_grad():
        sparse(torch.tensor([PROMPT + tokens]))
    for h in hooks:
        h.remove()
    expected = [float((x[len(PROMPT) :] == 0).float().mean()) for x in seen]
    assert shares["down_in"] == pytest.approx(expected)
    assert 0.2 < expected[0] < 0.8


def test_bench_reports_the_same_tokens_and_a_ceiling_above_one():
    dense, sparse = relu_thresholded(seed=3, down_in=0.0)  # exact: ReLU zeros stay zeros
    eval_ids = torch.randint(0, 97, (256,), generator=torch.Generator().manual_seed(0))
    r = bench_sparse_decode(
        dense, sparse, PROMPT, eval_ids, max_new_tokens=12, repeats=2, progress=False
    )
    assert r.same_tokens and r.new_tokens == 12 and r.ppl_dense == pytest.approx(r.ppl_sparse)
    assert 0 < r.ratio < float("inf")  # paired per round: tests/test_kernel_bench.py
    assert r.ceiling == pytest.approx(r.dense_mb_per_token / r.sparse_mb_per_token)
    saved = r.sparsity * 2 * 4 * 48 * 80  # the mean share of both layers' down inputs
    assert r.sparse_mb_per_token == pytest.approx((step_bytes(dense) - saved) / 1e6)
    assert r.ceiling > 1 and r.dense_mb_per_token == step_bytes(dense) / 1e6
    assert r.share_of_ceiling == pytest.approx(r.ratio / r.ceiling)
    assert list(r.site_sparsity) == ["down_in"] and r.sparsity == r.site_sparsity["down_in"] > 0.2
    assert r.rounds == 2 and r.ratio_low <= r.ratio <= r.ratio_high and r.read_gbs > 0
    assert r.sparse_gbs == pytest.approx(r.sparse_mb_per_token * r.sparse_tok_s / 1e3)
    assert r.share_interval().low == pytest.approx(r.ratio_low / r.ceiling)
    grown = bench_sparse_decode(
        dense, sparse, PROMPT, None, max_new_tokens=4, repeats=3, progress=False, most=9
    )  # more rounds only while the interval is wide, never past ``most``
    assert 3 <= grown.rounds <= 9
    assert grown.rounds == 9 or grown.interval().half_width <= 0.1
    other = relu_thresholded(seed=4, down_in=0.0)[0]
    r = bench_sparse_decode(
        dense, other, PROMPT, eval_ids, max_new_tokens=12, repeats=1, progress=False
    )
    assert not r.same_tokens and r.ceiling == 1.0 and r.sparsity == 0.0


def test_bench_counts_the_neurons_and_the_predictors_of_sparse_mlps():
    dense = relu_thresholded(seed=6, down_in=0.0)[0]
    predictors = Predictors(
        nn.ModuleList(Predictor(48, 4, 80) for _ in range(2)), [0.0, 0.0], "lowrank"
    )
    sparse = sparse_model(dense, None, predictors.select, kernels=True)
    eval_ids = torch.arange(256) % 97
    r = bench_sparse_decode(
        dense, sparse, PROMPT, eval_ids, max_new_tokens=8, repeats=1, progress=False
    )
    read = [m.step_density for layer in sparse.layers if (m := layer.mlp)]
    assert [n for _, n in read] == [16, 16]  # the decode steps of the warm-up and the repeat
    assert list(r.site_sparsity) == ["neurons"] and 0.05 < r.sparsity < 0.95
    assert r.sparsity == pytest.approx(1 - (read[0][0] + read[1][0]) / 32)
    assert r.sparse_mb_per_token == pytest.approx(
        (step_bytes(sparse) + predictor_bytes(sparse)) / 1e6
    )


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MINISPARSE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize("value", ["1.5", "0", "-0.2", "1"])
def test_cli_rejects_a_sparsity_outside_zero_one(value, capsys, empty_cache):
    assert main(["bench", "sparse-decode", "--method", "teal", "--sparsity", value]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --sparsity must lie in (0, 1)") and "--sparsity 0.5" in err


def test_cli_needs_the_prepared_relu_model_for_relu_predictors(capsys, empty_cache):
    assert default_method() == "teal"
    assert main(["bench", "sparse-decode", "--method", "relu-predictors"]) == 2
    err = capsys.readouterr().err
    assert "`minisparse prepare`" in err and err.count("\n") == 1
    assert main(["bench", "sparse-decode", "--sparsity", "0.3", "--method", "relu-predictors"]) == 2
    assert "--method teal" in capsys.readouterr().err
    for path in (
        empty_cache / "relufied" / "stage1-mlp" / "model.safetensors",
        empty_cache / "predictors" / "smollm2-135m-relu-lowrank.safetensors",
    ):
        path.parent.mkdir(parents=True)
        path.touch()
    assert default_method() == "relu-predictors"


class CharTokenizer:
    """One token per character: enough for the corpus windows and a chat prompt."""

    eos_token_id = None

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) % 97 for c in text]}

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        return self(messages[-1]["content"])["input_ids"]


def test_cli_json_prints_one_object_with_every_key(monkeypatch, capsys, empty_cache):
    model = tiny_model(seed=5, max_seq_len=512)
    monkeypatch.setattr(minisparse.io.loading, "load", lambda *a, **k: (model, CharTokenizer()))
    monkeypatch.setattr(sparse_decode, "machine", lambda: machine(measure_bandwidth=False))
    argv = ["bench", "sparse-decode", "--max-new-tokens", "6", "--repeats", "1", "--json"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    report = json.loads(out)
    keys = "dense_tok_s sparse_tok_s ratio ceiling ppl_dense ppl_sparse sparsity method machine "
    keys += "new_tokens dense_mb_per_token sparse_mb_per_token share_of_ceiling same_tokens"
    assert set(keys.split()) <= set(report) and err.startswith("machine: ")
    assert report["method"] == "teal" and report["new_tokens"] == 6
    assert 0.3 < report["sparsity"] < 0.7 and report["ceiling"] > 1
    assert set(report["site_sparsity"]) == {"attn_in", "mlp_in", "down_in"}
    assert main([*argv[:-1], "--prompt", "a short question"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("machine: ") and "ceiling" in out and "sparse " in out


def predictor_model(seed: int = 7):
    """A tiny ReLU model and its predictor-sparse copy (random predictors, cutoff at 0)."""
    dense = relu_thresholded(seed=seed, down_in=0.0)[0]
    neurons = nn.ModuleList(Predictor(48, 4, 80) for _ in range(2))
    for i, p in enumerate(neurons):
        init_random(p, seed + i)
    predictors = Predictors(neurons, [0.0, 0.0], "lowrank")
    predictors.made_for = model_fingerprint(dense)  # what load checks a saved file against
    return dense, sparse_model(dense, None, predictors.select, kernels=True), predictors


def test_sparse_perplexity_is_the_perplexity_of_decoding_token_by_token():
    """Each token with its own predicted neurons, as decode steps compute it; not the union a
    many-token forward of the sparse MLPs keeps."""
    dense, sparse, _ = predictor_model()
    ids = torch.randint(0, 97, (256,), generator=torch.Generator().manual_seed(1))
    cache = make_cache(sparse.config, 1, 256)
    nll = 0.0
    with torch.inference_mode():
        for i in range(255):  # one token per call: the sparse MLPs see one token at a time
            logits = sparse(ids[None, i : i + 1], torch.tensor([i]), cache)[0, -1]
            nll -= float(torch.log_softmax(logits.double(), -1)[ids[i + 1]])
        union = perplexity(sparse, ids, seq_len=256, progress=False)
    stepwise = math.exp(nll / 255)
    assert sparse_perplexity(dense, sparse, ids) == pytest.approx(stepwise, rel=1e-4)
    assert abs(union - stepwise) > 1e-5 * stepwise  # the union is another function
    thresholded = relu_thresholded(seed=2, down_in=0.05)[1]  # no predictors: its own forward
    assert sparse_perplexity(dense, thresholded, ids) == perplexity(
        thresholded, ids, progress=False
    )


def test_set_density_makes_the_share_of_predicted_neurons_one_minus_s():
    dense, _, predictors = predictor_model(seed=8)
    inputs = mlp_inputs(dense, torch.randint(0, 97, (1, 64), generator=torch.Generator()))
    assert [x.shape for x in inputs] == [torch.Size([64, 48])] * 2
    for s in (0.3, 0.8):
        set_density_(predictors, inputs, s)
        for p, x in zip(predictors.neurons, inputs, strict=True):
            with torch.inference_mode():
                active = float((p(x) > p.cutoff).float().mean())
            assert active == pytest.approx(1 - s, abs=2 / x.numel() + 1e-6)


def test_random_shape_bench_decodes_each_sparsity(monkeypatch):
    tiny = {"vocab_size": 97, "dim": 48, "n_heads": 4, "n_kv_heads": 2, "head_dim": 12,
            "ffn_dim": 80, "tie_embeddings": False}  # fmt: skip
    monkeypatch.setitem(sparse_decode.SHAPES, "tiny", tiny)
    monkeypatch.setattr(sparse_decode, "PREDICTOR_RANK", 8)
    model = sparse_decode.random_model("tiny", 3, seed=1)
    assert model.config.n_layers == 3 and model.config.dim == 48
    rows = sparse_decode.bench_random_shape("tiny", 1, (0.5, 0.9), 6, 1, progress=False)
    assert [math.isnan(r.ppl_dense) and math.isnan(r.ppl_sparse) for r in rows] == [True] * 2
    assert rows[0].sparsity < rows[1].sparsity and 0.6 < rows[1].sparsity < 1.0
    assert 1.0 < rows[0].ceiling < rows[1].ceiling
    assert rows[0].method == "random tiny x 1 layers, predictors"


def test_an_engine_with_predictors_reports_the_perplexity_of_its_decode_steps(tmp_path):
    """bench engine's perplexity of a predictor engine: every token with its own predicted
    neurons, on the model the predictors were made for (kept by build, not loaded again)."""
    from minisparse.bench.engine import engine_perplexity
    from minisparse.engine import EngineConfig, build

    dense, sparse, predictors = predictor_model(seed=11)
    path = predictors.save(tmp_path / "p.safetensors")
    gen = torch.Generator().manual_seed(12)
    calibration = torch.randint(0, 97, (2, 16), generator=gen)
    ids = torch.randint(0, 97, (256,), generator=gen)
    config = EngineConfig(sparsity="cats", predictors=str(path))
    engine = build(dense, None, config, calibration)
    assert engine.dense_model is dense
    got = engine_perplexity(engine, ids)
    assert got == pytest.approx(sparse_perplexity(dense, sparse, ids), rel=1e-6)
    with torch.inference_mode():
        union = perplexity(engine.model, ids, seq_len=256, progress=False)
    assert abs(got - union) > 1e-5 * got
    plain = build(dense, None, EngineConfig(sparsity="cats"), calibration)
    assert plain.dense_model is None
    assert engine_perplexity(plain, ids) == perplexity(plain.model, ids, progress=False)
