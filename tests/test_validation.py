"""Bad input gives one clear ValueError naming the argument, never a raw error from torch.

Table-driven: every case calls a public function (on tiny random models) or the command line
(through ``minisparse.cli.main``, with model loading made to fail, which proves that the
arguments are checked before anything is loaded) and asserts the exception type and message.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import minisparse.io.loading
from conftest import IdTokenizer, tiny_config, tiny_model
from minisparse import kvcache as K
from minisparse import predictors as P
from minisparse import quant as Q
from minisparse import sparsity as S
from minisparse import speculative as SP
from minisparse.bench import speculative as SB
from minisparse.cli import main
from minisparse.core.model import ModelConfig, make_cache
from minisparse.core.sampling import encode_prompt, next_token
from minisparse.course.tour import FIGURE_NAME, figure_path
from minisparse.relufy import finetune as F
from minisparse.relufy import relufy, relufy_and_finetune
from minisparse.runtime.generate import generate

MODEL = tiny_model(seed=3)  # vocab 97, 2 layers, context 96; no case changes it
TOK = IdTokenizer()


def gen(prompt: object = "1 2 3", **kw: object) -> Callable[[], object]:
    return lambda: generate(MODEL, TOK, prompt, **{"max_new_tokens": 2, **kw})


def spec(prompt: object = (1, 2, 3), **kw: object) -> Callable[[], object]:
    args = {"gamma": 2, "max_new_tokens": 2, **kw}
    return lambda: SP.speculative_generate(
        MODEL, None, list(prompt), SP.prompt_lookup_draft(), **args
    )


def nan_weight_model() -> torch.nn.Module:
    model = tiny_model(seed=4)
    with torch.no_grad():
        model.layers[1].mlp.up_proj.weight[3, 5] = math.nan
    return model


#: (what, call, message regex): each call must raise ValueError with that message.
FUNCTION_CASES: list[tuple[str, Callable[[], object], str]] = [
    ("token id >= vocab", gen([5, 97]), r"id 97 is outside the model's vocabulary \(0 .. 96\)"),
    ("negative token id", gen([-1, 4]), "id -1 is outside"),
    ("max_new_tokens 2.5", gen(max_new_tokens=2.5), "max_new_tokens must be at least 1"),
    ("max_new_tokens 0", gen(max_new_tokens=0), "max_new_tokens must be at least 1"),
    ("max_new_tokens True", gen(max_new_tokens=True), "max_new_tokens"),
    ("temperature nan", gen(temperature=math.nan), "temperature must be >= 0 and finite"),
    ("temperature inf", gen(temperature=math.inf), "temperature must be >= 0 and finite"),
    ("temperature -1", gen(temperature=-1.0), "temperature must be >= 0"),
    ("temperature text", gen(temperature="hot"), "temperature must be a number"),
    ("top_k 0", gen(temperature=1.0, top_k=0), "top_k must be at least 1"),
    ("top_k 2.5", gen(temperature=1.0, top_k=2.5), "top_k must be at least 1"),
    ("top_p 0", gen(temperature=1.0, top_p=0.0), r"top_p must be in \(0, 1\]"),
    ("top_p 1.5", gen(temperature=1.0, top_p=1.5), r"top_p must be in \(0, 1\]"),
    ("top_p nan", gen(temperature=1.0, top_p=math.nan), r"top_p must be in \(0, 1\]"),
    ("top_k with greedy", gen(top_k=5), "temperature 0 means greedy decoding"),
    ("top_p with greedy", gen(top_p=0.9), "temperature 0 means greedy decoding"),
    ("next_token top_k greedy", lambda: next_token(torch.zeros(5), 0.0, top_k=2), "greedy"),
    ("seed -1", gen(temperature=1.0, seed=-1), "seed must be at least 0"),
    ("seed 1.5", gen(temperature=1.0, seed=1.5), "seed must be at least 0"),
    ("empty text prompt", gen(""), "prompt is empty"),
    ("empty id prompt", gen([]), "prompt is empty"),
    ("empty chat message", gen([{"role": "user", "content": "  "}]), "message 0 .* is empty"),
    ("chat message without content", gen([{"role": "user"}]), "must have a string 'role'"),
    ("prompt too long", gen([1] * 95, max_new_tokens=5), "shorten the prompt"),
    ("paged block_size 0", gen(cache="paged", block_size=0), "block_size must be at least 1"),
    ("paged block_size 2.5", gen(cache="paged", block_size=2.5), "block_size must be at least 1"),
    ("sink window 0", gen(cache="sink", window=0), "window must be at least 1"),
    ("h2o budget 0", gen(cache="h2o", budget=0), "budget must be at least 1"),
    (
        "cache with 3 layers",
        gen(cache=make_cache(tiny_config(n_layers=3), 1, 16)),
        "cache has 3 layers but the model has 2",
    ),
    ("cache not a sequence", gen(cache=42), "cache must be a sequence"),
    (
        "forward with a wrong cache",
        lambda: MODEL(torch.tensor([[1, 2]]), torch.arange(2), [None]),
        "cache has 1 layers but the model has 2",
    ),
    ("forward id >= vocab", lambda: MODEL(torch.tensor([[1, 200]])), "id 200 is outside"),
    ("forward float ids", lambda: MODEL(torch.tensor([[1.0, 2.0]])), "integer token ids"),
    ("forward 1-D ids", lambda: MODEL(torch.tensor([1, 2])), r"shape \[batch, seq\]"),
    (
        "forward negative position",
        lambda: MODEL(torch.tensor([[1]]), torch.tensor([-1]), make_cache(MODEL.config, 1, 8)),
        "negative position",
    ),
    (
        "forward positions of another length",
        lambda: MODEL(torch.tensor([[1, 2]]), torch.arange(3), make_cache(MODEL.config, 1, 8)),
        "one position per token",
    ),
    ("make_cache max_seq_len 0", lambda: make_cache(MODEL.config, 1, 0), "max_seq_len must be"),
    ("make_kv_cache batch 0", lambda: K.make_kv_cache("static", MODEL.config, 8, 0), "batch"),
    ("BlockManager block_size 0", lambda: K.BlockManager(4, 0), "block_size must be at least 1"),
    (
        "simulate_waste block_size 0",
        lambda: K.simulate_waste(K.Trace([3], [2]), 16, block_size=0),
        "block_size must be at least 1",
    ),
    ("kv_cache_bytes 2.5 layers", lambda: K.kv_cache_bytes(2.5, 1, 8, 4), "n_layers must be"),
    ("random_trace 0 requests", lambda: K.random_trace(0, 8, 4), "n_requests must be"),
    ("config 0 layers", lambda: ModelConfig(n_layers=0), "n_layers must be at least 1"),
    ("config 1.5 dim", lambda: ModelConfig(dim=1.5), "dim must be at least 1"),
    ("speculative id >= vocab", spec((1, 300)), "id 300 is outside"),
    ("speculative gamma 2.5", spec(gamma=2.5), "gamma must be at least 1"),
    ("speculative temperature inf", spec(temperature=math.inf), "temperature must be >= 0"),
    ("speculative top_k greedy", spec(top_k=3), "greedy"),
    ("speculative max_new_tokens 2.5", spec(max_new_tokens=2.5), "max_new_tokens"),
    ("early exit 2.5 layers", lambda: SP.early_exit_draft(MODEL, 2.5), "n_layers must be"),
    ("early exit 0 layers", lambda: SP.early_exit_draft(MODEL, 0), "between 1 and"),
    (
        "bench early exit 0 is not the default",
        lambda: SB.make_drafts(MODEL, None, ("early-exit",), exit_layers=0),
        "n_layers must be between 1 and the model's 2 layers, got 0",
    ),
    (
        "bench repeats 0",
        lambda: SB.bench_speculative(MODEL, TOK, ["1 2"], {}, repeats=0, costs={}),
        "repeats must be at least 1",
    ),
    ("prompt lookup ngram 0", lambda: SP.prompt_lookup_draft(0), "ngram must be at least 1"),
    ("speedup nan cost", lambda: SP.expected_speedup(0.5, 2, math.nan), "cost_ratio"),
    ("finetune lr -1", lambda: F.FinetuneConfig(lr=-1.0), "lr must be a finite number > 0"),
    ("finetune lr nan", lambda: F.FinetuneConfig(lr=math.nan), "lr must be a finite number > 0"),
    ("finetune steps 2.5", lambda: F.FinetuneConfig(steps=2.5), "steps must be at least 1"),
    ("finetune warmup -1", lambda: F.FinetuneConfig(warmup=-1), "warmup must be at least 0"),
    ("finetune lora_rank 0", lambda: F.FinetuneConfig(lora_rank=0), "lora_rank must be"),
    ("finetune bf16 'yes'", lambda: F.FinetuneConfig(bf16="yes"), "bf16 must be"),
    (
        "finetune windows of 1 token",
        lambda: F.finetune_(
            relufy(MODEL, 1),
            MODEL,
            torch.zeros(4, 1, dtype=torch.long),
            F.FinetuneConfig(steps=1, bf16=False),
            progress=False,
        ),
        "seq >= 2",
    ),
    ("add_lora rank 0", lambda: F.add_lora_(tiny_model(), 0, 4.0), "rank must be at least 1"),
    (
        "relufy seq_len 0",
        lambda: relufy_and_finetune(MODEL, None, 1, F.FinetuneConfig(), seq_len=0),
        "seq_len must be at least 2",
    ),
    (
        "relufy seq_len beyond the context",
        lambda: relufy_and_finetune(MODEL, None, 1, F.FinetuneConfig(), seq_len=500),
        "exceeds the model's context",
    ),
    ("relufy stage 3", lambda: relufy(MODEL, 3), "stage must be 1"),
    (
        "threshold nan",
        lambda: S.apply_thresholds_(tiny_model(), {"mlp_act": math.nan}),
        "threshold must be a number >= 0",
    ),
    (
        "quantize a NaN weight",
        lambda: Q.quantize_model(nan_weight_model(), progress=False),
        r"layers\.1\.mlp\.up_proj\.weight holds 1 NaN or inf value\(s\) \(the first at index "
        r"\[3, 5\]\)",
    ),
    (
        "quantize_tensor with inf",
        lambda: Q.quantize_tensor(torch.tensor([[1.0, math.inf]])),
        "NaN or inf",
    ),
]


@pytest.mark.parametrize("case", FUNCTION_CASES, ids=[c[0] for c in FUNCTION_CASES])
def test_functions_refuse_bad_input_with_a_clear_value_error(case):
    _, call, message = case
    with pytest.raises(ValueError, match=message):
        call()


def test_a_refused_call_leaves_the_model_usable():
    with pytest.raises(ValueError):
        generate(MODEL, TOK, [5, 97])
    assert len(generate(MODEL, TOK, "5 6", max_new_tokens=3)) == 3


def test_an_empty_chat_message_is_refused_before_the_template():
    class NoTemplate(IdTokenizer):
        def apply_chat_template(self, *args, **kwargs):
            raise AssertionError("the template ran")

    with pytest.raises(ValueError, match="is empty"):
        encode_prompt(NoTemplate(), [{"role": "user", "content": ""}])


# --- predictor files ----------------------------------------------------------------------------


def relu_model(seed: int = 0) -> torch.nn.Module:
    return relufy(tiny_model(seed=seed), 1)


@pytest.fixture(scope="module")
def saved_predictors(tmp_path_factory) -> Path:
    windows = torch.randint(0, 97, (8, 16), generator=torch.Generator().manual_seed(0))
    config = P.PredictorConfig(ranks=(4, 8))
    predictors = P.train_predictors(relu_model(), windows, config=config, progress=False)
    return predictors.save(tmp_path_factory.mktemp("predictors") / "p.safetensors")


def test_predictors_load_for_the_model_they_were_trained_on(saved_predictors):
    loaded = P.Predictors.load(saved_predictors, relu_model())
    assert len(loaded.ranks) == 2 and loaded.made_for is not None
    loaded = P.Predictors.load(saved_predictors, relu_model().to(torch.bfloat16))
    assert len(loaded.ranks) == 2  # a cast is the same model


def rewrite(path: Path, out: Path, change: Callable[[dict], object]) -> Path:
    """A copy of a predictors file with its JSON description changed by ``change``."""
    with safe_open(str(path), "pt") as f:
        meta = json.loads(f.metadata()["predictors"])
    change(meta)
    save_file(load_file(str(path)), str(out), {"predictors": json.dumps(meta)})
    return out


def junk_file(path: Path, tmp: Path) -> Path:
    out = tmp / "junk.safetensors"
    out.write_bytes(b"\x00junk" * 40)
    return out


def damaged_description(path: Path, tmp: Path) -> Path:
    out = tmp / "damaged.safetensors"
    save_file({"x": torch.zeros(1)}, str(out), {"predictors": "{"})
    return out


def wrong_ranks(path: Path, tmp: Path) -> Path:
    return rewrite(path, tmp / "ranks.safetensors", lambda m: m.update(ranks=[3, 3]))


def missing_kind(path: Path, tmp: Path) -> Path:
    return rewrite(path, tmp / "kind.safetensors", lambda m: m.pop("kind"))


def same_file(path: Path, tmp: Path) -> Path:
    return path


def lookahead_as_text(path: Path, tmp: Path) -> Path:
    return rewrite(path, tmp / "ahead.safetensors", lambda m: m.update(lookahead="false"))


def made_for_as_text(path: Path, tmp: Path) -> Path:
    return rewrite(path, tmp / "made.safetensors", lambda m: m.update(made_for="relu"))


def nan_weights(path: Path, tmp: Path) -> Path:
    tensors = load_file(str(path))
    first = next(k for k in tensors if k.startswith("neurons.") and tensors[k].dim() == 2)
    tensors[first][0, 0] = float("nan")
    out = tmp / "nan.safetensors"
    with safe_open(str(path), "pt") as f:
        save_file(tensors, str(out), f.metadata())
    return out


#: (what, make the file from a good one, the model to load it for, message regex)
PREDICTOR_FILE_CASES: list[tuple[str, Callable[[Path, Path], Path], Callable[[], object], str]] = [
    ("another model of the same shape", same_file, lambda: relu_model(1), "another model"),
    ("the SiLU model", same_file, tiny_model, "trained on another model"),
    ("another shape", same_file, lambda: relufy(tiny_model(n_layers=3), 1), "model of shape"),
    ("junk bytes", junk_file, relu_model, "is not a readable safetensors file"),
    ("tensors that do not fit", wrong_ranks, relu_model, "does not match its own description"),
    ("a description without keys", missing_kind, relu_model, r"lacks \['kind'\]"),
    ("a damaged description", damaged_description, relu_model, "damaged predictors description"),
    ("lookahead as text", lookahead_as_text, relu_model, "lookahead='false'.*true/false"),
    ("made_for as text", made_for_as_text, relu_model, "made_for='relu'"),
    ("NaN weights", nan_weights, relu_model, "NaN or infinite values in neurons"),
]


@pytest.mark.parametrize("case", PREDICTOR_FILE_CASES, ids=[c[0] for c in PREDICTOR_FILE_CASES])
def test_predictor_files_for_another_model_are_refused(case, saved_predictors, tmp_path):
    _, make_file, make_model, message = case
    path = make_file(saved_predictors, tmp_path)
    with pytest.raises(ValueError, match=message):
        P.Predictors.load(path, make_model())


# --- the command line: checked before anything loads ------------------------------------------


@pytest.fixture
def no_loading(monkeypatch):
    """Make any model load fail loudly: a case that reaches it did not check first."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(minisparse.io.loading, "load", refuse)
    monkeypatch.setattr(minisparse.io.loading, "load_hf_reference", refuse)


CLI_CASES: list[tuple[list[str], str]] = [
    (["generate", ""], "prompt is empty"),
    (["generate", "   ", "--chat"], "prompt is empty"),
    (["generate", "hi", "--top-k", "5"], "temperature 0 means greedy"),
    (["generate", "hi", "--top-p", "0.5"], "temperature 0 means greedy"),
    (["generate", "hi", "--temperature", "0.7", "--top-k", "0"], "top_k must be at least 1"),
    (["generate", "hi", "--temperature", "0.7", "--top-p", "2"], r"top_p must be in \(0, 1\]"),
    (["generate", "hi", "--temperature", "nan"], "temperature must be >= 0 and finite"),
    (["generate", "hi", "--temperature", "inf"], "temperature must be >= 0 and finite"),
    (["generate", "hi", "--temperature", "-1"], "temperature must be >= 0"),
    (["generate", "hi", "--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
    (["generate", "hi", "--temperature", "1", "--seed", "-3"], "seed must be at least 0"),
    (["relufy", "--seq-len", "0"], "seq_len must be at least 2"),
    (["relufy", "--lr", "-1"], "lr must be a finite number > 0"),
    (["relufy", "--steps", "0"], "steps must be at least 1"),
    (["relufy", "--eval-tokens", "100"], "eval_tokens must be at least 256"),
    (["relufy", "--kd-weight", "2"], r"kd_weight must be in \[0, 1\]"),
    (["relufy", "--threads", "-2"], "--threads must be at least 0"),
    (["predictors", "--windows", "0"], "--windows must be at least 1"),
    (["predictors", "--seq-len", "1"], "--seq-len must be at least 2"),
    (["predictors", "--eval-tokens", "10"], "--eval-tokens must be at least 256"),
    (["predictors", "--silu-sparsity", "1"], r"sparsity must be in \[0, 1\)"),
    (["predictors", "--target-recall", "0"], r"target_recall must be in \(0, 1\]"),
    (["bench", "decode", "--repeats", "0"], "--repeats must be at least 1"),
    (["bench", "decode", "--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
    (["bench", "decode", "--prompt", ""], "--prompt is empty"),
    (["bench", "speculative", "--exit-layers", "0"], "--exit-layers must be at least 1"),
    (["bench", "speculative", "--repeats", "0"], "repeats must be at least 1"),
    (["bench", "speculative", "--gamma", "0"], "gamma must be at least 1"),
    (["bench", "speculative", "--sparsity", "1.5"], r"sparsity must be in \[0, 1\)"),
    (["bench", "quant", "--repeats", "0"], "--repeats must be at least 1"),
    (["bench", "quant", "--group-size", "0"], "group_size must be a positive number"),
    (["bench", "quant", "--prompt", " "], "--prompt is empty"),
    (["bench", "quant", "--linear-repeats", "0"], "--linear-repeats must be at least 1"),
    (["bench", "sparse-ffn", "--repeats", "0"], "repeats must be at least 1"),
    (["bench", "engine", "--repeats", "0"], "--repeats must be at least 1"),
    (["bench", "engine", "--configs", "relu"], "need chapter 04's fine-tuned ReLU model"),
    (["offload", "--budget", "0"], r"--budget is a share of the FFN bytes in \(0, 1\]"),
    (["offload", "--budget", "1.5"], r"--budget is a share of the FFN bytes in \(0, 1\]"),
    (["offload", "--gpu", "h100"], "Unknown GPU 'h100'; choose one of rtx4090"),
    (["offload", "--min-per-layer", "-1"], "--min-per-layer must be >= 0"),
    (["offload", "--group-size", "0"], "--group-size must be at least 1"),
]
if not torch.cuda.is_available():
    CLI_CASES.append((["info", "--device", "cuda"], "sees no CUDA GPU"))


@pytest.mark.parametrize("case", CLI_CASES, ids=[" ".join(c[0]) for c in CLI_CASES])
def test_cli_refuses_bad_arguments_before_loading(case, no_loading, capsys):
    argv, message = case
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # nothing echoed before the error
    assert captured.err.startswith("error: ") and captured.err.count("\n") == 1
    assert re.search(message, captured.err), captured.err


def test_tour_refuses_a_directory_as_its_figure(no_loading, tmp_path, capsys):
    assert main(["tour", "--out", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err


def test_tour_figure_goes_to_the_cache_unless_asked(monkeypatch, tmp_path):
    monkeypatch.setenv("MINISPARSE_CACHE", str(tmp_path / "cache"))
    assert figure_path() == tmp_path / "cache" / FIGURE_NAME
    assert figure_path("elsewhere/tour.png") == Path("elsewhere/tour.png")
