"""The command line: info, generate, tour, bench decode, and clean errors."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json

import pytest

import minisparse
import minisparse.cli
import minisparse.loading
from conftest import IdTokenizer, save_tiny_hf, tiny_model
from minisparse.bench import bench_decode, median_time
from minisparse.cli import main
from minisparse.hf import to_hf
from minisparse.relufy import load_relufied, relufied_stage


def test_info(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "30 layers" in out and "134.5 M parameters" in out and "cache:" in out


def test_generate_streams(capsys, embedded):
    model, tokenizer = embedded
    assert main(["generate", "The while statement", "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    expected = tokenizer.decode(
        minisparse.generate(model, tokenizer, "The while statement", max_new_tokens=6)
    )
    assert out.startswith("The while statement") and expected.strip() in out


def test_tour_runs_and_saves_a_figure(tmp_path, capsys):
    out = tmp_path / "tour.png"
    assert main(["tour", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert out.stat().st_size > 10_000
    assert "same top-1 token at 100% of positions" in text
    assert "exactly zero" in text


def test_bench_decode_on_a_local_checkpoint(tmp_path, capsys, embedded):
    save_tiny_hf(tmp_path, seed=41, vocab_size=49152)
    embedded[1].save_pretrained(tmp_path)
    code = main(
        [
            "bench",
            "decode",
            "--model",
            str(tmp_path),
            "--max-new-tokens",
            "8",
            "--repeats",
            "2",
            "--device",
            "cpu",
            "--json",
            str(tmp_path / "decode.json"),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0 and out.count("same tokens: True") == 3
    assert out.startswith("machine: ")
    report = json.loads((tmp_path / "decode.json").read_text())
    assert report["machine"]["threads"] >= 1 and len(report["rows"]) == 3


def test_relufy_command_fine_tunes_saves_and_reports(tmp_path, capsys, embedded):
    model_dir = save_tiny_hf(tmp_path / "model", seed=43, vocab_size=49152)
    embedded[1].save_pretrained(model_dir)
    args = ["relufy", "--model", str(model_dir), "--stage", "2", "--steps", "2"]
    args += ["--batch-size", "2", "--seq-len", "32", "--eval-tokens", "256", "--warmup", "1"]
    args += [
        "--device",
        "cpu",
        "--save-dir",
        str(tmp_path / "out"),
        "--out",
        str(tmp_path / "r.json"),
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["command"] == "minisparse " + " ".join(args)
    assert [h["step"] for h in report["history"]] == [1, 2]
    assert report["swapped"]["zeros_attn_in"] > 0.2 and report["dense"]["zeros_attn_in"] == 0.0
    assert "finetuned  perplexity" in out
    base, _ = minisparse.load(str(model_dir), device="cpu")
    relu, info = load_relufied(base, 2, "mlp", root=tmp_path / "out")
    assert info["trained"] == report["trained"] and relufied_stage(relu) == 2


def test_bench_decode_function_reports_identical_tokens():
    model = tiny_model(seed=42)
    hf = to_hf(model)

    class Tok:
        eos_token_id = None

    result = bench_decode(
        model, Tok(), hf, [3, 1, 4, 1, 5], max_new_tokens=12, repeats=2, progress=False
    )
    assert result.same_tokens and result.new_tokens == 12
    assert result.minisparse_tok_s > 0 and result.transformers_tok_s > 0


def test_median_time_counts_calls():
    calls = []
    median_time(lambda: calls.append(1), repeats=5, warmup=2)
    assert len(calls) == 7


def test_errors_are_one_line(capsys):
    assert main(["info", "--model", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: Unknown model") and err.count("\n") == 1


def test_predictors_command_trains_saves_and_reports(tmp_path, capsys, monkeypatch, embedded):
    monkeypatch.setenv("MINISPARSE_CACHE", str(tmp_path / "cache"))  # no fine-tuned ReLU model
    model_dir = save_tiny_hf(tmp_path / "model", seed=44, vocab_size=49152)
    embedded[1].save_pretrained(model_dir)
    out, report = tmp_path / "p.safetensors", tmp_path / "r.json"
    args = ["predictors", "--model", str(model_dir), "--device", "cpu", "--windows", "4"]
    args += [
        "--val-windows",
        "2",
        "--seq-len",
        "32",
        "--eval-tokens",
        "64",
        "--head-sparsity",
        "0.25",
    ]
    args += ["--out", str(out), "--report", str(report)]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "the embedded SiLU model" in text and "held-out: recall" in text
    scores = json.loads(report.read_text())
    base, _ = minisparse.load(str(model_dir), device="cpu")
    from minisparse.predictors import Predictors

    loaded = Predictors.load(out, base)
    assert loaded.ranks == scores["rank"] and len(loaded.ranks) == 2 and loaded.head_keep == 3
    assert 0.0 < scores["mean_recall"] <= 1.0


@pytest.fixture
def tiny_load(monkeypatch):
    """``load`` gives a tiny random model (context 96) and a number tokenizer."""
    model = tiny_model(seed=21)
    monkeypatch.setattr(minisparse.loading, "load", lambda *a, **k: (model, IdTokenizer()))
    return model


def test_generate_refuses_a_too_long_prompt_before_echoing_it(tiny_load, capsys):
    prompt = " ".join(["7"] * 90)
    assert main(["generate", prompt, "--max-new-tokens", "10"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "shorten the prompt" in captured.err


def test_generate_echoes_the_prompt_then_streams(tiny_load, capsys):
    assert main(["generate", "1 2 3", "--max-new-tokens", "4"]) == 0
    expected = minisparse.generate(tiny_load, IdTokenizer(), "1 2 3", max_new_tokens=4)
    assert capsys.readouterr().out == "1 2 3" + IdTokenizer().decode(expected) + "\n"


@pytest.mark.parametrize("error", [RuntimeError("boom"), TypeError("bug"), KeyError("k")])
def test_unexpected_errors_keep_their_traceback(monkeypatch, error):
    def broken(args):
        raise error

    monkeypatch.setattr(minisparse.cli, "cmd_info", broken)
    with pytest.raises(type(error)):
        main(["info"])


@pytest.mark.parametrize("argv", [["--debug", "generate", ""], ["generate", "", "--debug"]])
def test_debug_shows_the_traceback_of_user_errors(argv):
    with pytest.raises(ValueError, match="prompt is empty"):
        main(argv)


def test_llama_cpp_row_uses_the_optional_package_when_present(monkeypatch):
    """A stand-in for llama_cpp: the benchmark times its calls and counts its tokens."""
    import sys
    import types

    from minisparse import bench

    calls = []

    class FakeLlama:
        def __init__(self, model_path, n_threads, n_ctx, verbose):
            calls.append(("init", model_path, n_threads))

        def reset(self):
            calls.append(("reset",))

        def __call__(self, prompt, max_tokens, temperature, top_k):
            calls.append(("run", prompt, max_tokens, temperature, top_k))
            return {"usage": {"completion_tokens": max_tokens}}

    fake = types.ModuleType("llama_cpp")
    fake.Llama = FakeLlama
    fake.__spec__ = importlib.machinery.ModuleSpec("llama_cpp", None)
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    rate = bench.llama_cpp_decode("m.gguf", "hi", max_new_tokens=8, repeats=3, threads=2)
    assert rate is not None and rate > 0
    assert calls[0] == ("init", "m.gguf", 2)
    assert calls.count(("run", "hi", 8, 0.0, 1)) == 4  # one warm-up and three timed runs
    order = []

    def ours():
        order.append("ours")
        return 8

    fake.Llama.__call__ = lambda self, *a, **k: (
        order.append("llama") or {"usage": {"completion_tokens": 8}}
    )
    mine, theirs = bench.llama_cpp_decode("m.gguf", "hi", 8, repeats=3, alongside=ours)
    assert mine > 0 and theirs > 0
    assert order.count("ours") == order.count("llama") == 4  # alternating, warm-up included
    assert all(set(order[i : i + 2]) == {"ours", "llama"} for i in range(0, 8, 2))  # per round
    monkeypatch.delitem(sys.modules, "llama_cpp")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert bench.llama_cpp_decode("m.gguf", "hi") is None
