"""The engine composes the chapters: lossless settings decode exactly like the plain model."""

from __future__ import annotations

import pytest
import torch

from conftest import IdTokenizer, tiny_model
from minisparse import engine as E
from minisparse.kernels.cpu import fast_path_available
from minisparse.kvcache import make_kv_cache
from minisparse.offload.hybrid import HotColdMLP
from minisparse.quant import Int8Linear, quantize_model
from minisparse.runtime.decoder import Decoder
from minisparse.runtime.generate import generate
from minisparse.sparse import MaskedMLP, SparseMLP, using_mlps
from minisparse.sparse.weights import dequantized_mlp

TOK = IdTokenizer()
PROMPT = [5, 17, 3, 88, 41, 5, 17, 3, 2, 60, 9, 5, 17]  # repeats: prompt lookup finds matches
CALIB = torch.randint(0, 97, (4, 24), generator=torch.Generator().manual_seed(0))


def model():
    return tiny_model(seed=7, std=0.1)


def test_the_default_engine_is_the_dense_model():
    m = model()
    engine = E.build(m, TOK, E.EngineConfig())
    assert engine.model is m and engine.description == "the dense model"
    assert engine.generate(PROMPT, 12) == generate(m, TOK, PROMPT, 12)


@pytest.mark.parametrize("draft", ["prompt-lookup", "int8", "sparse", "early-exit"])
def test_speculative_engines_give_the_plain_greedy_tokens(draft):
    m = model()
    engine = E.build(m, TOK, E.EngineConfig(draft=draft, gamma=3), calibration=CALIB)
    assert engine.generate(PROMPT, 16) == generate(m, TOK, PROMPT, 16)


def test_int8_weights_with_a_prompt_lookup_draft_equal_the_quantized_model():
    m = model()
    engine = E.build(m, TOK, E.EngineConfig(weights="int8", draft="prompt-lookup"))
    reference = quantize_model(m, bits=8, packed=True, progress=False)
    assert engine.generate(PROMPT, 12) == generate(reference, TOK, PROMPT, 12)


@torch.inference_mode()
def test_sparse_kernels_and_the_hot_cold_split_compute_the_masked_model():
    m = model()
    cats = E.EngineConfig(sparsity="cats", share=0.5)
    kernels = E.build(m, TOK, cats, CALIB)
    masked = E.build(m, TOK, E.EngineConfig(sparsity="cats", sparse_kernels=False), CALIB)
    split = E.build(m, TOK, E.EngineConfig(sparsity="cats", offload_budget=0.3), CALIB)
    assert isinstance(kernels.model.layers[0].mlp, SparseMLP)
    assert isinstance(masked.model.layers[0].mlp, MaskedMLP)
    assert isinstance(split.model.layers[0].mlp, HotColdMLP) and split.placement is not None
    tokens = torch.tensor([PROMPT])
    reference = masked.model(tokens)
    assert (kernels.model(tokens) - reference).abs().max() < 1e-4
    assert (split.model(tokens) - reference).abs().max() < 1e-4
    assert (reference - m(tokens)).abs().max() > 1e-3  # the masks matter
    assert not isinstance(m.layers[0].mlp, SparseMLP)  # the base model is left alone


@torch.inference_mode()
def test_cats_with_int8_weights_runs_sparse_int8_mlps_on_the_int8_models_codes():
    m = tiny_model(seed=7, std=0.3)  # larger weights: the greedy tokens vary
    engine = E.build(m, TOK, E.EngineConfig(sparsity="cats", weights="int8"), CALIB)
    int8 = quantize_model(m, bits=8, packed=True, progress=False)
    assert "sparse int8 kernels" in engine.description and "int8 weights" in engine.description
    assert isinstance(engine.model.layers[0].attn.q_proj, Int8Linear)  # the rest as chapter 09
    for layer, ref in zip(engine.model.layers, int8.layers, strict=True):
        assert isinstance(layer.mlp, SparseMLP) and layer.mlp.int8
        assert torch.equal(layer.mlp.Q_up, ref.mlp.up_proj.q)  # the int8 model's own codes
    tokens = torch.tensor([PROMPT[:6]])
    out = engine.model(tokens)
    masked = [
        MaskedMLP(dequantized_mlp(ref.mlp), keep=layer.mlp.last_keep)
        for layer, ref in zip(engine.model.layers, int8.layers, strict=True)
    ]
    with using_mlps(int8, masked):
        reference = int8(tokens)
    assert (out - reference).abs().max() <= 1e-4 * reference.abs().max()
    assert (out - int8(tokens)).abs().max() > 1e-3  # the masks matter
    ids = engine.generate(PROMPT, 10)
    assert len(ids) == 10 and len(set(ids)) > 1
    assert ids == generate(engine.model, TOK, PROMPT, 10, compiled=False)  # every step as torch
    fp32 = E.build(m, TOK, E.EngineConfig(sparsity="cats"), CALIB)
    assert engine.resident_bytes() < 0.5 * fp32.resident_bytes()


@pytest.mark.skipif(not fast_path_available(), reason="no C compiler: every half runs as torch")
@torch.inference_mode()
def test_the_compiled_decode_step_runs_sparse_int8_mlps_like_torch():
    """The C step's sparse MLP reads int8 codes too: same logits as its MLP halves in torch."""
    m = tiny_model(seed=7, std=0.3)
    model = E.build(m, TOK, E.EngineConfig(sparsity="cats", weights="int8"), CALIB).model
    tokens = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(2))
    caches = [make_kv_cache("static", model.config, 16) for _ in range(2)]
    for cache in caches:
        model(tokens[:, :6], torch.arange(6), cache)
    compiled, torch_mlps = Decoder(model, caches[0]), Decoder(model, caches[1])
    assert all(line.endswith(": C") for line in compiled.plan())
    for i in range(len(model.layers)):  # the MLP halves of the second one as torch modules
        torch_mlps._refs[2 * i + 1] = None
    several = tokens[0, 6:11].tolist()  # a verification pass: int8 rows read once for 5 tokens
    got, ref = compiled.forward(several, 6).clone(), torch_mlps.forward(several, 6)
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()
    for pos in range(6, 12):
        got = compiled.step(int(tokens[0, pos]), pos).clone()
        densities = [layer.mlp.last_density for layer in model.layers]
        ref = torch_mlps.step(int(tokens[0, pos]), pos)
        assert densities == [layer.mlp.last_density for layer in model.layers]  # same neurons
        assert all(d < 1 for d in densities)
        assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_relu_sparsity_with_int8_weights_builds(monkeypatch):
    """The ReLU model (chapter 04) is replaced by the tiny model: thresholds 0, int8 MLPs."""
    from minisparse.relufy import recipe

    m = tiny_model(seed=3, std=0.3, hidden_act="relu")
    monkeypatch.setattr(recipe, "load_relufied", lambda base, stage: (m, None))
    engine = E.build(m, TOK, E.EngineConfig(sparsity="relu", weights="int8"))
    mlps = [layer.mlp for layer in engine.model.layers]
    assert all(isinstance(p, SparseMLP) and p.int8 and p.threshold == 0.0 for p in mlps)
    assert len(engine.generate(PROMPT, 6)) == 6
    assert all(p.last_density < 1 for p in mlps)  # ReLU zeros are skipped


def test_int4_weights_shrink_the_resident_bytes():
    m = tiny_model(seed=1, dim=64, ffn_dim=128, n_heads=4, n_kv_heads=2, head_dim=16)
    dense = E.build(m, TOK, E.EngineConfig())
    int4 = E.build(m, TOK, E.EngineConfig(weights="int4"))
    assert int4.resident_bytes() < 0.6 * dense.resident_bytes()
    assert "int4 weights" in int4.description


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"sparsity": "gelu"}, "sparsity must be one of"),
        ({"weights": "int2"}, "weights must be one of"),
        ({"draft": "medusa"}, "draft must be one of"),
        ({"gamma": 0}, "gamma must be"),
        ({"share": 1.0}, r"share must be in \[0, 1\)"),
        ({"predictors": "p.safetensors"}, "predictors acts on active MLP neurons"),
        ({"offload_budget": 0.3}, "offload_budget acts on active MLP neurons"),
        ({"sparsity": "cats", "offload_budget": 1.5}, r"offload_budget is a share in \(0, 1\]"),
        ({"sparsity": "cats", "weights": "int4"}, "int4 weights are not done"),
        ({"sparsity": "relu", "weights": "int4"}, "int4 weights are not done"),
        (
            {"sparsity": "cats", "weights": "int8", "offload_budget": 0.3},
            "hot/cold split .* places float32 neurons",
        ),
        ({"weights": "int8", "draft": "int8"}, "is the model itself"),
        ({"sparsity": "cats", "draft": "int8"}, "made from the target's dense MLPs"),
        ({"sparsity": "teal", "draft": "sparse"}, "made from the target's plain MLPs"),
        ({"sparsity": "cats", "draft": "sparse"}, "is the model itself"),
        ({"gamma": True}, "gamma must be"),
        ({"sparsity": "cats", "sparse_kernels": "no"}, "sparse_kernels is True or False"),
        ({"weights": "int4", "draft": "int8"}, "made from fp32 weights"),
        ({"weights": "int4", "draft": "sparse"}, "made from fp32 or int8 weights"),
    ],
)
def test_invalid_combinations_get_one_clear_error(config, message):
    with pytest.raises(ValueError, match=message):
        E.build(model(), TOK, E.EngineConfig(**config), CALIB)


def test_calibration_is_asked_for_when_needed():
    with pytest.raises(ValueError, match="pass calibration="):
        E.build(model(), TOK, E.EngineConfig(sparsity="cats"))


def test_bench_engine_times_every_configuration_against_dense():
    from minisparse.bench.engine import bench_engine

    configs = {
        "dense": E.EngineConfig(),
        "int8": E.EngineConfig(weights="int8"),
        "lookup": E.EngineConfig(draft="prompt-lookup"),
    }
    eval_ids = torch.randint(0, 97, (2 * 32,), generator=torch.Generator().manual_seed(1))
    rows = bench_engine(model(), TOK, configs, PROMPT, CALIB, eval_ids, 8, 1, False, seq_len=32)
    by_name = {r.name: r for r in rows}
    assert by_name["dense"].ratio_to_dense == 1.0 and by_name["dense"].same_tokens_as_dense
    assert by_name["lookup"].same_tokens_as_dense  # speculative decoding is lossless
    assert by_name["lookup"].perplexity == by_name["dense"].perplexity
    assert by_name["int8"].resident_mb < by_name["dense"].resident_mb
    assert all(r.prefill_ms > 0 for r in rows)  # measured (no speed is asserted: timing noise)
    assert all(r.ratio_range[0] <= r.ratio_to_dense <= r.ratio_range[1] for r in rows)
    assert any(r.pareto for r in rows)
    with pytest.raises(ValueError, match="must include 'dense'"):
        bench_engine(model(), TOK, {"int8": configs["int8"]}, PROMPT, CALIB, eval_ids)


def test_pareto_marks_the_rows_nothing_beats():
    from minisparse.bench.engine import EngineRow, pareto

    rows = pareto(
        [
            EngineRow("a", "", 10.0, 1.0, (1.0, 1.0), 5.0, 12.0, 50.0, 1.0, True),
            EngineRow("b", "", 20.0, 2.0, (2.0, 2.0), 5.0, 13.0, 50.0, 1.0, True),
            # c: slower and worse than b
            EngineRow("c", "", 15.0, 1.5, (1.5, 1.5), 5.0, 14.0, 50.0, 1.0, True),
        ]
    )
    assert [r.pareto for r in rows] == [True, True, False]


@torch.inference_mode()
def test_bytes_per_token_follow_the_density_and_the_tokens_per_pass():
    from minisparse.quant import streamed_bytes
    from minisparse.sparse import SparseMLP, swap_mlps_

    model = tiny_model(seed=21)
    dense = E.step_bytes(model)
    assert dense == streamed_bytes(model)
    mlp_bytes = sum(p.numel() * 4 for p in model.layers[0].mlp.parameters())
    sparse = tiny_model(seed=21)
    swap_mlps_(sparse, [SparseMLP(layer.mlp, threshold=0.02) for layer in sparse.layers])
    tokens = torch.randint(0, sparse.config.vocab_size, (1, 17), generator=torch.Generator())
    sparse(tokens)
    densities = [float(layer.mlp.last_keep.float().mean()) for layer in sparse.layers]
    assert all(0.05 < d < 0.95 for d in densities)
    expected = dense - sum(mlp_bytes * (1 - (1 + 2 * d) / 3) for d in densities)
    assert E.step_bytes(sparse) == pytest.approx(expected, rel=1e-6)
    sparse(tokens[:, :1])  # one decode-like step: its own share of neurons now counts
    steps = [layer.mlp.last_density for layer in sparse.layers]
    assert [layer.mlp.step_density for layer in sparse.layers] == [[d, 1] for d in steps]
    expected = dense - sum(mlp_bytes * (1 - (1 + 2 * d) / 3) for d in steps)
    assert E.step_bytes(sparse) == pytest.approx(expected, rel=1e-6)
    # prompt lookup: one target pass per tokens_per_call emitted tokens, no draft weights
    engine = E.build(model, IdTokenizer(), E.EngineConfig(draft="prompt-lookup"))
    engine.generate("1 2 3 4 1 2 3 4 1 2 3", 12)
    assert engine.last_stats.tokens_per_call >= 1
    assert engine.bytes_per_token() == pytest.approx(dense / engine.last_stats.tokens_per_call)


def test_teal_is_an_engine_option_that_runs_the_thresholded_model():
    """TEAL (registered by chapter 03's package): the engine's model is the base with input
    thresholds at q/k/v, gate/up and down, calibrated to the share asked; it decodes as that
    model does, and the compiled step runs every half (it reads only the kept rows)."""
    from minisparse.sparsity import TEAL_SITES, apply_thresholds, calibrate_thresholds

    m = model()
    engine = E.build(m, TOK, E.EngineConfig(sparsity="teal", share=0.4), calibration=CALIB)
    limits = calibrate_thresholds(m, CALIB, 0.4, sites=TEAL_SITES, progress=False)
    reference = apply_thresholds(m, limits)
    assert "teal" in engine.description
    assert engine.generate(PROMPT, 10) == generate(reference, TOK, PROMPT, 10)
    if fast_path_available():
        decoder = Decoder(engine.model, make_kv_cache("static", m.config, 32))
        assert all(line.endswith(": C") for line in decoder.plan())
    with pytest.raises(ValueError, match="acts on active MLP neurons"):
        E.EngineConfig(sparsity="teal", offload_budget=0.5).check()
    int8 = E.build(m, TOK, E.EngineConfig(sparsity="teal", weights="int8"), calibration=CALIB)
    assert isinstance(int8.model.layers[0].attn.q_proj, Int8Linear)
    # TEAL keeps dense MLP modules (thresholds inside), so an int8 draft can be made of it: lossless
    config = E.EngineConfig(sparsity="teal", share=0.4, draft="int8", gamma=3)
    spec = E.build(m, TOK, config, calibration=CALIB)
    assert spec.generate(PROMPT, 10) == generate(reference, TOK, PROMPT, 10)


def test_the_engine_and_the_benches_list_the_registries():
    from minisparse.bench import quant as QB
    from minisparse.bench import speculative as SB
    from minisparse.quant import WEIGHT_FORMATS
    from minisparse.sparsity import SPARSITY_METHODS
    from minisparse.speculative import DRAFTS

    assert {"relu", "cats", "teal"} <= set(SPARSITY_METHODS)
    assert E.choices() == {
        "sparsity": ("none", *SPARSITY_METHODS),
        "weights": tuple(WEIGHT_FORMATS),
        "draft": (None, *DRAFTS),
    }
    assert set(DRAFTS) == {"prompt-lookup", "int8", "sparse", "early-exit"}
    parser = __import__("argparse").ArgumentParser()
    SB.add_arguments(parser)
    assert parser.parse_args([]).drafts == list(DRAFTS)
    assert set(QB.VARIANTS) == {"fp32", "bf16", *(n for n in WEIGHT_FORMATS if n != "fp32")}


def test_a_registered_method_and_draft_are_engine_options_at_once():
    """Adding a method is one registration: the engine accepts it, checks it by what it
    declares (this one does not choose neurons), and builds with it."""
    from minisparse.sparsity import SPARSITY_METHODS, SparsityMethod, register_sparsity
    from minisparse.speculative import DRAFTS, DraftKind, register_draft
    from minisparse.speculative.drafts import early_exit_draft

    halved = []

    def halve(base, calibration, share):
        halved.append(share)
        return base

    register_sparsity(SparsityMethod("half", "--", "a test method", False, halve))
    register_draft(DraftKind("one-layer", "one layer", lambda t, c: early_exit_draft(t, 1)))
    try:
        with pytest.raises(ValueError, match="acts on active MLP neurons"):
            E.EngineConfig(sparsity="half", predictors="p.safetensors").check()
        with pytest.raises(ValueError, match="registered already"):
            register_sparsity(SparsityMethod("half", "--", "again", False, halve))
        m = model()
        engine = E.build(m, TOK, E.EngineConfig(sparsity="half", share=0.3, draft="one-layer"))
        assert halved == [0.3] and "half" in engine.description
        assert engine.generate(PROMPT, 8) == generate(m, TOK, PROMPT, 8)
    finally:
        SPARSITY_METHODS.pop("half", None)
        DRAFTS.pop("one-layer", None)


def test_fastest_and_pareto_ties_follow_the_speed_ranges():
    from minisparse.bench.engine import EngineRow, fastest, not_apart, pareto, pareto_ties

    rows = pareto(
        [
            EngineRow("dense", "", 10.0, 1.0, (1.0, 1.0), 5.0, 12.0, 50.0, 1.0, True),
            EngineRow("int8", "", 36.0, 3.6, (3.4, 3.85), 5.0, 12.1, 50.0, 1.0, True),
            # int4: faster by its median, worse, and its range overlaps int8's
            EngineRow("int4", "", 39.0, 3.9, (3.8, 3.9), 5.0, 13.0, 50.0, 1.0, True),
            EngineRow("cats", "", 11.0, 1.1, (1.05, 1.15), 5.0, 16.0, 50.0, 1.0, True),
        ]
    )
    assert [r.name for r in fastest(rows)] == ["int4", "int8"]
    assert [r.name for r in not_apart(rows, rows[3])] == ["cats"]
    assert [(a.name, b.name) for a, b in pareto_ties(rows)] == [("int8", "int4")]
    rows[1].ratio_range = (3.4, 3.7)  # now measurably slower than int4
    assert [r.name for r in fastest(rows)] == ["int4"] and pareto_ties(rows) == []
    with pytest.raises(ValueError, match="at least one row"):
        fastest([])


def test_the_engine_names_the_int4_block_size():
    engine = E.build(model(), TOK, E.EngineConfig(weights="int4"), CALIB)
    assert "int4 weights, blocks of 32" in engine.description
