"""Export round trips: what transformers reads back from our HF checkpoints and GGUF files."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import tiny_model
from minisparse import sparsity as S
from minisparse.cli import main
from minisparse.io import export as E
from minisparse.offload import Placement, load_placement
from minisparse.offload.hybrid import apply
from minisparse.relufy import relufy
from minisparse.sparse import sparsify_

#: A tiny config whose rows are multiples of 32 (q8_0 blocks) and whose heads are grouped.
SHAPE = {"dim": 64, "ffn_dim": 96, "head_dim": 16, "n_heads": 4, "n_kv_heads": 2}
TOKENS = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(0))


def round_like_gguf(model, dtype):
    """The model with its matrices rounded as the file stores them (norms stay fp32)."""
    from gguf import GGMLQuantizationType, quants

    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2 and dtype == "f16":
                p.copy_(p.half().float())
            elif p.dim() == 2 and dtype in ("q8_0", "q4_1"):
                kind = getattr(GGMLQuantizationType, dtype.upper())
                p.copy_(torch.from_numpy(quants.dequantize(quants.quantize(p.numpy(), kind), kind)))
    return model


def hf_logits(directory, tokens, **kwargs):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, **kwargs).eval()
    with torch.inference_mode():
        return hf(tokens).logits


@pytest.mark.parametrize("stage", [0, 1])
def test_hf_export_loads_in_transformers_with_the_same_logits(tmp_path, stage):
    model = tiny_model(seed=2, std=0.1, **SHAPE)
    model = relufy(model, 1) if stage else model
    E.export_hf(model, tmp_path)
    with torch.inference_mode():
        ours = model(TOKENS)
    assert (hf_logits(tmp_path, TOKENS) - ours).abs().max() < 1e-4
    if stage:
        import json

        assert json.loads((tmp_path / "config.json").read_text())["hidden_act"] == "relu"


@pytest.mark.parametrize("dtype", ["f32", "f16", "q8_0", "q4_1"])
def test_gguf_export_reads_back_through_transformers_gguf_loader(tmp_path, dtype):
    model = tiny_model(seed=3, std=0.1, **SHAPE)
    E.export_gguf(model, tmp_path / "m.gguf", dtype)
    theirs = hf_logits(tmp_path, TOKENS, gguf_file="m.gguf")
    with torch.inference_mode():
        ours = round_like_gguf(model, dtype)(TOKENS)
    assert (theirs - ours).abs().max() < 1e-4


def test_the_rope_permutation_is_what_makes_the_gguf_file_right(tmp_path, monkeypatch):
    """Without the per-head row permutation of W_q and W_k the logits come back wrong."""
    model = tiny_model(seed=3, std=0.1, **SHAPE)
    monkeypatch.setattr(E, "permute_for_gguf", lambda w, n_heads: w)
    E.export_gguf(model, tmp_path / "m.gguf", "f32")
    with torch.inference_mode():
        ours = model(TOKENS)
    assert (hf_logits(tmp_path, TOKENS, gguf_file="m.gguf") - ours).abs().max() > 1e-3


def test_the_embedded_model_round_trips_through_hf_and_q8_0_gguf(embedded, tmp_path):
    from minisparse.io.loading import embedded_gguf_path

    model, tokenizer = embedded
    ids = torch.tensor([tokenizer("The KV cache stores the keys and values")["input_ids"]])
    with torch.inference_mode():
        ours = model(ids)
    E.export_hf(model, tmp_path / "hf", tokenizer)
    assert (hf_logits(tmp_path / "hf", ids) - ours).abs().max() < 1e-4
    E.export_gguf(model, tmp_path / "m.gguf", "q8_0", tokenizer_gguf=embedded_gguf_path())
    theirs = hf_logits(tmp_path, ids, gguf_file="m.gguf")
    with torch.inference_mode():
        rounded = round_like_gguf(copy.deepcopy(model), "q8_0")(ids)
    assert (theirs - rounded).abs().max() < 1e-3  # exactly the q8_0 weights, fp32 sums
    assert (theirs.argmax(-1) == ours.argmax(-1)).float().mean() > 0.8
    from transformers import AutoTokenizer

    reread = AutoTokenizer.from_pretrained(tmp_path, gguf_file="m.gguf")
    assert reread("The KV cache")["input_ids"] == tokenizer("The KV cache")["input_ids"]


def thresholded():
    return S.apply_thresholds_(tiny_model(**SHAPE), {"mlp_act": [0.01, 0.01]})


def sparse():
    model = tiny_model(**SHAPE)
    sparsify_(model, thresholds=0.01)
    return model


def split():
    hot = [torch.arange(96) < 48] * 2
    return apply(tiny_model(**SHAPE), Placement(hot, 0, 0.0, "by hand", 1), thresholds=0.0)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (thresholded, "transformers' Llama cannot express"),
        (lambda: relufy(tiny_model(**SHAPE), 2), "transformers' Llama cannot express"),
        (sparse, "export the dense model"),
        (split, "export the dense model"),
    ],
)
def test_models_that_llama_cannot_express_are_refused(tmp_path, make, message):
    with pytest.raises(ValueError, match=message):
        E.export_hf(make(), tmp_path)
    with pytest.raises(ValueError, match=message):
        E.export_gguf(make(), tmp_path / "m.gguf")


def test_gguf_refuses_what_llama_cpp_cannot_run(tmp_path):
    with pytest.raises(ValueError, match="SiLU MLPs only"):
        E.export_gguf(relufy(tiny_model(**SHAPE), 1), tmp_path / "m.gguf")
    with pytest.raises(ValueError, match="multiples of 32"):
        E.export_gguf(tiny_model(), tmp_path / "m.gguf", "q8_0")
    with pytest.raises(ValueError, match="Unknown GGUF dtype"):
        E.export_gguf(tiny_model(), tmp_path / "m.gguf", "q4_0")


def test_a_placement_round_trips_through_its_file(tmp_path):
    gen = torch.Generator().manual_seed(0)
    hot = [torch.rand(96, generator=gen) > 0.5 for _ in range(3)]
    Placement(hot, 10, 1.0, "ilp", 1234).save(tmp_path / "p.safetensors")
    back = load_placement(tmp_path / "p.safetensors")
    assert all(torch.equal(a, b) for a, b in zip(back.hot, hot, strict=True))
    assert back.policy == "ilp" and back.budget_bytes == 1234


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["export", "d", "--dtype", "f16"], "--dtype applies to --format gguf only"),
        (["export", "m.gguf", "--format", "gguf", "--dtype", "q4"], "--dtype must be one of"),
        (["export", "out_dir", "--format", "gguf"], "ending in .gguf"),
        (["export", "m.gguf", "--format", "gguf", "--relu"], "SiLU MLPs only"),
        (["export", "d", "--predictors", "missing.safetensors"], "No predictors file"),
        (["export", "busy"], "was not made by minisparse export"),
        (["export", "checkpoint"], "was not made by minisparse export"),
        (["export", "busy/file.txt"], "is a file"),
        (["export", "busy/file.txt/m.gguf", "--format", "gguf"], "cannot write"),
    ],
)
def test_export_command_checks_its_arguments_before_loading(
    argv, message, monkeypatch, capsys, tmp_path
):
    import minisparse.io.loading

    monkeypatch.chdir(tmp_path)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "file.txt").write_text("a user's file")
    (tmp_path / "checkpoint").mkdir()  # a downloaded model: config.json, but not an export
    (tmp_path / "checkpoint" / "config.json").write_text("{}")
    monkeypatch.setattr(minisparse.io.loading, "load", lambda *a, **k: pytest.fail("loaded"))
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert (tmp_path / "busy" / "file.txt").read_text() == "a user's file"
    assert (tmp_path / "checkpoint" / "config.json").read_text() == "{}"


def test_an_interrupted_gguf_export_leaves_the_good_file(tmp_path, monkeypatch):
    import gguf

    model, out = tiny_model(seed=3, std=0.1, **SHAPE), tmp_path / "m.gguf"
    E.export_gguf(model, out, "f32")
    good = out.read_bytes()

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt  # Ctrl-C while the tensors are written

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        E.export_gguf(tiny_model(seed=4, std=0.1, **SHAPE), out, "f32")
    assert out.read_bytes() == good
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]  # no temporary left


def test_an_hf_export_replaces_its_folder_whole_and_survives_an_interruption(tmp_path, monkeypatch):
    import os

    import transformers

    model, out = tiny_model(seed=3, std=0.1, **SHAPE), tmp_path / "export"
    old_mask = os.umask(0o022)
    try:
        E.export_hf(model, out)
        E.export_gguf(model, tmp_path / "m.gguf", "f32")
    finally:
        os.umask(old_mask)
    assert out.stat().st_mode & 0o777 == 0o755  # readable by others, as a plain write gives
    assert (out / "config.json").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "m.gguf").stat().st_mode & 0o777 == 0o644
    (tmp_path / "m.gguf").unlink()
    (out / "predictors.safetensors").write_text("stale, from an earlier export")
    E.export_hf(model, out)
    assert not (out / "predictors.safetensors").exists()  # the new export alone
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", interrupted)
    with pytest.raises(KeyboardInterrupt):
        E.export_hf(tiny_model(seed=4, std=0.1, **SHAPE), out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_gguf_sidecars_are_named_after_their_file(tmp_path):
    hot = [torch.ones(96, dtype=torch.bool) for _ in range(3)]
    written = E.save_sidecars(tmp_path, placement=Placement(hot, 10, 1.0, "ilp", 1), prefix="m.")
    assert [p.name for p in written] == ["m.placement.safetensors"]
    assert load_placement(written[0]).policy == "ilp"


def test_a_gguf_file_is_its_own_reference_for_the_benchmarks(monkeypatch):
    """``load_hf_reference`` reads a .gguf path (so `bench decode --model m.gguf` works)."""
    from pathlib import Path

    import minisparse.io.loading as L

    seen = []
    monkeypatch.setattr(L, "hf_from_gguf", lambda path: seen.append(path) or ("hf", "tok"))
    assert L.load_hf_reference("~/models/m.gguf") == ("hf", "tok")
    assert seen == [Path("~/models/m.gguf").expanduser()]


@pytest.mark.parametrize("dtype", ["f32", "q8_0", "q4_1"])
def test_llama_cpp_reads_the_bytes_the_file_holds_per_step(tmp_path, dtype):
    """gguf_step_bytes: every tensor once (the tied embedding is the LM head, read whole); at
    f32 that is exactly the bytes our own float32 step streams."""
    import gguf

    from minisparse.bench.llama_cpp import gguf_step_bytes
    from minisparse.engine import step_bytes

    model = tiny_model(seed=5, std=0.1, **SHAPE)
    path = E.export_gguf(model, tmp_path / "m.gguf", dtype)
    tensors = gguf.GGUFReader(str(path)).tensors
    assert gguf_step_bytes(path) == sum(int(t.n_bytes) for t in tensors)
    if dtype == "f32":
        assert gguf_step_bytes(path) == step_bytes(model)
    else:  # 8.5 or 5 bits per weight of the matrices, float32 norms
        per_weight = {"q8_0": 34 / 32, "q4_1": 20 / 32}[dtype]
        matrices = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2)
        norms = sum(p.numel() for p in model.parameters() if p.dim() == 1)
        assert gguf_step_bytes(path) == matrices * per_weight + 4 * norms
