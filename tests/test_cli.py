"""The command line: info, generate, tour, bench decode, and clean errors."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os

import pytest

import minisparse
import minisparse.cli
import minisparse.io.loading
from conftest import IdTokenizer, save_tiny_hf, tiny_model
from minisparse.bench import bench_decode, median_time
from minisparse.cli import main
from minisparse.io.hf import to_hf
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
    monkeypatch.setattr(minisparse.io.loading, "load", lambda *a, **k: (model, IdTokenizer()))
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


FAKE_LLAMA_CPP = """
import os, signal


class Llama:
    def __init__(self, model_path, n_threads, n_ctx, verbose):
        self.crash = model_path.endswith("crash.gguf")

    def reset(self):
        pass

    def token_eos(self):
        return 0

    def tokenize(self, text):
        return list(text)

    def generate(self, tokens, top_k, temp):
        assert top_k == 1
        if self.crash:
            os.kill(os.getpid(), signal.SIGSEGV)
        yield from [7, 8, 9, 10, 11, 12, 13, 14, 15, 0]

    def detokenize(self, tokens):
        return bytes(96 + t for t in tokens)
"""


def fake_llama_cpp(tmp_path, monkeypatch):
    """A stand-in llama_cpp module, importable here and in the child process."""
    import sys

    (tmp_path / "llama_cpp.py").write_text(FAKE_LLAMA_CPP)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), *sys.path]))
    monkeypatch.delitem(sys.modules, "llama_cpp", raising=False)
    (tmp_path / "m.gguf").write_bytes(b"")
    from minisparse.bench import llama_cpp

    monkeypatch.setattr(llama_cpp, "gguf_step_bytes", lambda path: 2_000_000)


def test_llama_cpp_runs_in_a_child_process_beside_ours(tmp_path, monkeypatch):
    """The benchmark alternates ours with a llama.cpp child process and compares tokens."""
    from minisparse import bench

    fake_llama_cpp(tmp_path, monkeypatch)
    calls = []

    def ours():
        calls.append("ours")
        return [7, 8, 9]

    r = bench.llama_cpp_decode(tmp_path / "m.gguf", "hi", ours, 1e6, max_new_tokens=3, repeats=3)
    assert calls == ["ours"] * 4  # one warm-up and three timed runs
    assert r.llama_cpp_tokens == [7, 8, 9] and r.same_tokens  # cut at max_new_tokens
    assert r.ours_tok_s > 0 and r.llama_cpp_tok_s > 0
    assert r.llama_cpp_mb_per_token == 2.0 and r.ours_mb_per_token == 1.0
    assert r.ratio_per_byte == pytest.approx(r.ratio / 2)
    from minisparse.bench.llama_cpp import LlamaCppChild

    with LlamaCppChild(tmp_path / "m.gguf", threads=1) as child:  # stops at end-of-sequence
        assert child.complete("hello", 50).text == "ghijklmno"
        assert child.complete("again", 2).tokens == [7, 8]  # one child, many requests


def test_a_llama_cpp_crash_is_reported_and_ours_goes_on(tmp_path, monkeypatch, capsys):
    import argparse

    from minisparse.bench import decode
    from minisparse.bench.llama_cpp import REBUILD_HINT, LlamaCppDied

    fake_llama_cpp(tmp_path, monkeypatch)
    crash = tmp_path / "crash.gguf"
    crash.write_bytes(b"")
    with pytest.raises(LlamaCppDied, match=r"died with SIGSEGV on crash\.gguf; a native"):
        decode.llama_cpp_decode(crash, "hi", lambda: [1], 1.0, 3, repeats=1)
    model = tiny_model(seed=0)
    args = argparse.Namespace(
        gguf=crash, model="tiny", weights="fp32", max_new_tokens=3, repeats=1, prompt="hi"
    )
    assert decode.print_llama_cpp_row(args, model, IdTokenizer()) is None
    out = capsys.readouterr().out
    assert out.startswith("llama.cpp: skipped, llama.cpp died with SIGSEGV") and REBUILD_HINT in out
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert decode.llama_cpp_decode(crash, "hi", lambda: [1], 1.0) is None


def test_late_or_raw_errors_are_one_line_before_the_work(monkeypatch, capsys, tmp_path):
    """A bogus device, an empty --dtype, a budget too small to place a group: one line,
    exit 2, before any model is profiled or written."""
    import minisparse.offload.report as R

    monkeypatch.setattr(R, "profiles", lambda *a, **k: pytest.fail("profiled"))
    cases = [
        (["info", "--device", "bogus"], "is not a device torch knows"),
        (["export", str(tmp_path / "m.gguf"), "--format", "gguf", "--dtype", ""], "--dtype"),
        (["offload", "--budget", "1e-9"], "less than one group of 32 neurons"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and err.count("\n") == 1, err


def test_permission_errors_are_one_line_with_a_hint(monkeypatch, capsys):
    def denied(args):
        raise PermissionError(13, "Permission denied", "/root/out")

    monkeypatch.setattr(minisparse.cli, "cmd_info", denied)
    assert main(["info"]) == 2
    err = capsys.readouterr().err
    assert "Permission denied" in err and "check the path and its permissions" in err


def test_offload_json_has_no_nan():
    from minisparse.offload.report import finite_json

    report = {"a": float("nan"), "b": [1.0, float("inf")], "c": {"d": 2}}
    assert json.dumps(finite_json(report), allow_nan=False) == (
        '{"a": null, "b": [1.0, null], "c": {"d": 2}}'
    )


@pytest.mark.parametrize("option", ["--json", "--record"])
def test_a_results_file_that_cannot_be_written_is_refused_before_the_run(
    option, tmp_path, monkeypatch, capsys
):
    import minisparse.io.loading

    monkeypatch.setattr(minisparse.io.loading, "load", lambda *a, **k: pytest.fail("loaded"))
    blocked = tmp_path / "a_file"
    blocked.write_text("")
    assert main(["bench", "decode", option, str(blocked / "out.json")]) == 2
    assert f"{option} {blocked / 'out.json'}: cannot write" in capsys.readouterr().err


def test_a_recorded_run_replaces_the_one_of_its_cpu_kind_and_weights(tmp_path):
    from minisparse.bench.decode import record_run

    def run(cpu, isa, weights, tok_s):
        machine = {"cpu": cpu, "vector_isa": isa}
        return {"machine": machine, "weights": weights, "tok_s": tok_s}

    path = tmp_path / "runs.json"
    for r in [
        run("AMD EPYC", "AVX2", "int8", 1.0),
        run("AMD EPYC", "AVX2", "fp32", 2.0),
        run("Intel Xeon", "AVX-512", "fp32", 3.0),
        run("AMD EPYC", "AVX2", "fp32", 4.0),  # the same kind and weights: replaces 2.0
    ]:
        record_run(path, r)
    runs = json.loads(path.read_text())["runs"]
    assert [(r["machine"]["cpu"], r["weights"], r["tok_s"]) for r in runs] == [
        ("AMD EPYC", "fp32", 4.0),
        ("AMD EPYC", "int8", 1.0),
        ("Intel Xeon", "fp32", 3.0),
    ]
    assert not list(tmp_path.glob("*.tmp"))
