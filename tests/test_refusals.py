"""Refusals of the newer surfaces, one table per surface: each row names a case, the call that
must be refused, and the message it must give. The cases are those a careless or adversarial
user met (a silent wrong result, a hang, a late or raw error); a new surface adds its table and
one parametrized test beside these.

Each table runs on tiny random models; every refusal that the library can make before any
model work is checked to come before it (the work is replaced by a function that fails).
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import re
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from conftest import IdTokenizer, tiny_model
from minisparse.cli import main
from minisparse.course import check
from minisparse.course import grading as R
from minisparse.course.plug import solution
from minisparse.io.export import export_gguf, export_hf
from minisparse.moe import group_neurons, moefy
from minisparse.peft import qlora_
from minisparse.peft.recover import (
    adapters_path,
    load_recovered,
    prune_24,
    pruning_masks,
    save_recovered,
)
from minisparse.pruning import prune, to_nm_
from minisparse.quant import quantize_model
from minisparse.quant.nf4 import NF4Tensor, double_quantize, nf4_dequantize, nf4_quantize
from minisparse.relufy.finetune import FinetuneConfig

TOKENS = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(11))
SOLUTIONS = Path(__file__).resolve().parents[1] / "notebooks" / "solutions"


@dataclass(frozen=True)
class Case:
    """One refusal: ``call()`` must raise ``error`` with a message matching ``match``."""

    id: str
    call: Callable[[], Any]
    match: str
    error: type[BaseException] = ValueError


def refused(case: Case) -> None:
    with pytest.raises(case.error, match=case.match):
        case.call()


def ids(cases: list[Case]) -> list[str]:
    return [c.id for c in cases]


def with_weight(model: torch.nn.Module, name: str, value: float) -> torch.nn.Module:
    """``model`` with the first entry of parameter ``name`` set to ``value``."""
    with torch.no_grad():
        model.get_parameter(name).view(-1)[0] = value
    return model


def nm_model() -> torch.nn.Module:
    return to_nm_(prune(tiny_model(), "magnitude", 0.5, "2:4"))


def nf4_model() -> torch.nn.Module:
    return qlora_(tiny_model(), rank=2, block_size=16)


# ---------------------------------------------------------------------------------------------
# Pruning, quantization and export: non-finite weights or activations, layers they cannot read
# ---------------------------------------------------------------------------------------------

PRUNING = [
    Case(
        "wanda-nan-weight",
        lambda: prune(
            with_weight(tiny_model(), "layers.1.mlp.up_proj.weight", float("nan")),
            "wanda",
            0.5,
            calibration=TOKENS,
        ),
        r"layers\.1\.mlp\.up_proj\.weight holds 1 NaN or inf value",
    ),
    Case(
        "magnitude-inf-weight",
        lambda: prune(
            with_weight(tiny_model(), "layers.0.attn.k_proj.weight", float("inf")), "magnitude", 0.5
        ),
        r"layers\.0\.attn\.k_proj\.weight holds 1 NaN or inf.*prune would choose from NaN",
    ),
    Case(
        "wanda-nan-activation",  # finite projections, an inf embedding row: NaN layer inputs
        lambda: prune(
            with_weight(tiny_model(), "embed.weight", float("inf")),
            "wanda",
            0.5,
            calibration=torch.zeros(1, 8, dtype=torch.long),
        ),
        r"the input of layers\.0\.attn\.q_proj holds .* NaN or inf",
    ),
    Case(
        "quantize-nan-weight",
        lambda: quantize_model(
            with_weight(tiny_model(), "layers.1.mlp.up_proj.weight", float("nan")), progress=False
        ),
        r"layers\.1\.mlp\.up_proj\.weight holds 1 NaN",
    ),
    Case(
        "prune-nm-layers",
        lambda: prune(nm_model(), "magnitude", 0.5),
        r"cannot prune layers\.0\.mlp\.gate_proj: it is a compact N:M layer .*before to_nm_",
    ),
    Case(
        "prune-nf4-layers",
        lambda: prune(nf4_model(), "magnitude", 0.5),
        r"cannot prune layers\.0\.attn\.q_proj: it is a LoRA layer; merge_lora",
    ),
    Case(
        "prune-superscript-pattern",
        lambda: prune(tiny_model(), "magnitude", 0.5, "²:4"),
        r"pattern must be 'unstructured' or 'n:m'.*got '²:4'",
    ),
    Case(
        "export-hf-nm-layers",
        lambda: export_hf(nm_model(), "/nonexistent-never/x"),
        r"cannot export layers\.0\.mlp\.gate_proj: it is a compact N:M layer",
    ),
    Case(
        "export-gguf-nf4-layers",
        lambda: export_gguf(nf4_model(), "/nonexistent-never/x.gguf"),
        r"cannot export layers\.0\.attn\.q_proj: it is a LoRA layer",
    ),
    Case(
        "export-to-proc",
        lambda: export_gguf(tiny_model(), "/proc/x.gguf"),
        r"cannot write /proc/x\.gguf: /proc does not take new files",
    ),
]


@pytest.mark.parametrize("case", PRUNING, ids=ids(PRUNING))
def test_pruning_quantization_and_export_refuse(case):
    refused(case)


def test_pruning_a_finite_model_still_works():
    """The reference for the table: the same calls on a finite float model do not refuse."""
    pruned = prune(tiny_model(), "wanda", 0.5, calibration=TOKENS)
    assert bool(torch.isfinite(pruned(TOKENS)).all())


# ---------------------------------------------------------------------------------------------
# NF4
# ---------------------------------------------------------------------------------------------

NF4 = [
    Case("empty-weight", lambda: nf4_quantize(torch.zeros(0, 64)), r"\(0, 64\) is empty"),
    Case(
        "code-out-of-range",
        lambda: nf4_dequantize(torch.full((2, 64), 200, dtype=torch.uint8), torch.ones(2, 1)),
        r"NF4 codes index 16 levels \(0\.\.15\), but one is 200",
    ),
    Case(
        "int64-codes",
        lambda: nf4_dequantize(torch.zeros(2, 64, dtype=torch.long), torch.ones(2, 1)),
        r"NF4 codes are a 2-D uint8 tensor",
    ),
    Case(
        "nan-weight",
        lambda: NF4Tensor.quantize(torch.full((2, 64), float("nan"))),
        r"the weight to quantize holds 128 NaN",
    ),
    Case(
        "negative-scales",
        lambda: double_quantize(torch.tensor([0.1, -0.2])),
        r"never negative",
    ),
    Case(
        "scales-of-another-shape",
        lambda: NF4Tensor(torch.zeros(2, 64, dtype=torch.uint8), 32, absmax=torch.ones(2, 1)),
        r"needs one scale per block .* got \(2, 1\)",
    ),
]


@pytest.mark.parametrize("case", NF4, ids=ids(NF4))
def test_nf4_refuses(case):
    refused(case)


@pytest.mark.parametrize("outlier", [10.0, 1000.0, 1e38, -3e38])
def test_nf4_double_quantization_of_an_outlier_keeps_signs_and_stays_finite(outlier):
    """The issue's case: 0.01 · N(0, 1) weights [64, 256] and one outlier; the linear int8
    second level made 135 of 256 scales negative at 10 and NaN weights at 1e38."""
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(0)) * 0.01
    w[7, 100] = outlier
    nf4 = NF4Tensor.quantize(w, 64)
    assert bool((nf4.scales() >= 0).all()) and bool(torch.isfinite(nf4.dequantize()).all())
    plain = NF4Tensor.quantize(w, 64, double=False).dequantize()
    assert torch.equal(torch.sign(nf4.dequantize()), torch.sign(plain))


# ---------------------------------------------------------------------------------------------
# PEFT: a recovery file must hold what its metadata promises, for this base
# ---------------------------------------------------------------------------------------------

RANK, BLOCK = 2, 16


@pytest.fixture(scope="module")
def recovered(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    """A recovery file written as ``recover`` writes it (tiny base, seed 3), and the QLoRA
    model it holds (the reference ``load_recovered`` must rebuild)."""
    root = tmp_path_factory.mktemp("recovered")
    base = tiny_model(seed=3)
    pruned = prune_24(base, TOKENS)
    model = qlora_(copy.deepcopy(pruned), rank=RANK, alpha=4.0, block_size=BLOCK)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".B"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    config = FinetuneConfig(trainable="lora", lora_rank=RANK, lora_alpha=4.0)
    settings = {"block_size": BLOCK, "seq_len": 24, "calib_windows": 2}
    save_recovered(adapters_path(root), adapters, pruning_masks(pruned), config, settings, model)
    return root, model


def rewritten(root: Path, target: Path, change: Callable[[dict, dict], None]) -> Path:
    """A copy of the recovery file under ``target`` after ``change(tensors, metadata)``."""
    path = adapters_path(root)
    tensors = load_file(str(path))
    with safe_open(str(path), "pt") as f:
        meta = dict(f.metadata())
    change(tensors, meta)
    out = adapters_path(target)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out), metadata=meta)
    return target


def drop_adapters(t: dict, m: dict) -> None:
    for k in [k for k in t if not k.startswith("mask/")]:
        del t[k]


def set_rank(t: dict, m: dict, rank: int) -> None:
    m["config"] = json.dumps({**json.loads(m["config"]), "lora_rank": rank})


def drop_mask(t: dict, m: dict) -> None:
    del t["mask/layers.1.mlp.down_proj.weight"]


def extra_mask(t: dict, m: dict) -> None:
    t["mask/layers.99.attn.q_proj.weight"] = t["mask/layers.0.attn.q_proj.weight"].clone()


def wrong_b(t: dict, m: dict) -> None:
    t["layers.0.attn.q_proj.B"] = torch.zeros(5, RANK)


# (id, change to the file, the base it is loaded on, the message)
PEFT: list[tuple[str, Callable[[dict, dict], None], Callable[[], Any], str]] = [
    ("every-adapter-removed", drop_adapters, lambda: tiny_model(seed=3),
     r"the adapters lack layers\.0\.attn\.q_proj\.A \(\d+ of \d+ tensors missing\)"),
    ("one-adapter-removed", lambda t, m: t.pop("layers.0.attn.k_proj.B"),
     lambda: tiny_model(seed=3), r"the adapters lack layers\.0\.attn\.k_proj\.B \(1 of"),
    ("b-of-the-wrong-shape", wrong_b, lambda: tiny_model(seed=3),
     r"adapter layers\.0\.attn\.q_proj\.B is torch\.float32 \[5, 2\], but this model at rank 2"),
    ("rank-8-metadata", lambda t, m: set_rank(t, m, 8), lambda: tiny_model(seed=3),
     r"q_proj\.A is torch\.float32 \[2, 48\], but this model at rank 8 .* needs .* \[8, 48\]"),
    ("mask-for-layer-99", extra_mask, lambda: tiny_model(seed=3),
     r"mask/layers\.99\.attn\.q_proj\.weight, a mask for a weight this model does not have"),
    ("mask-missing", drop_mask, lambda: tiny_model(seed=3),
     r"no mask for mask/layers\.1\.mlp\.down_proj\.weight"),
    ("another-architecture", lambda t, m: None, lambda: tiny_model(seed=3, ffn_dim=96),
     r"mask/layers\.0\.mlp\.gate_proj\.weight holds torch\.uint8 \[480\], not the 576 bytes"),
    ("another-layer-count", lambda t, m: None, lambda: tiny_model(seed=3, n_layers=1),
     r"mask/layers\.1\.\w+\.\w+\.weight, a mask for a weight this model does not have"),
    ("another-base", lambda t, m: None, lambda: tiny_model(seed=4),
     r"trained on another pruned base"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("change", "base", "match"), [c[1:] for c in PEFT], ids=[c[0] for c in PEFT]
)
def test_load_recovered_refuses(recovered, tmp_path, change, base, match):
    root, _ = recovered
    with pytest.raises(ValueError, match=match):
        load_recovered(base(), rewritten(root, tmp_path, change))


def test_load_recovered_rebuilds_the_saved_model(recovered):
    """The reference for the table: the untouched file gives the saved model's logits."""
    root, model = recovered
    loaded, settings = load_recovered(tiny_model(seed=3), root)
    assert settings["block_size"] == BLOCK
    torch.testing.assert_close(loaded(TOKENS), model(TOKENS), atol=0, rtol=0)


# ---------------------------------------------------------------------------------------------
# MoE: every argument checked before any recording or fitting
# ---------------------------------------------------------------------------------------------

MOE = [
    Case("top-k-above-experts", lambda: moefy(tiny_model(), 1, calibration=TOKENS),
         r"top_k must be between 1 and n_experts=1, got 8"),
    Case("experts-not-a-divisor", lambda: moefy(tiny_model(), 3, 1, calibration=TOKENS),
         r"n_experts=3 must be a positive divisor of the 80 neurons"),
    Case("float-top-k", lambda: moefy(tiny_model(), 4, 1.5, calibration=TOKENS),
         r"top_k must be"),
    Case("unknown-grouping", lambda: moefy(tiny_model(), 4, 2, TOKENS, grouping="kmeans"),
         r"Unknown grouping 'kmeans'"),
    Case("tokens-outside-the-vocabulary", lambda: moefy(tiny_model(), 4, 2, TOKENS + 97),
         r"vocab"),
    Case("no-calibration", lambda: moefy(tiny_model(), 4, 2), r"moefy needs calibration"),
    Case("float-experts", lambda: group_neurons(torch.ones(4, 8, dtype=torch.bool), 2.0),
         r"n_experts must be"),
]  # fmt: skip


@pytest.mark.parametrize("case", MOE, ids=ids(MOE))
def test_moe_refuses_before_any_work(case, monkeypatch):
    def no_work(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("moefy started recording before checking its arguments")

    monkeypatch.setattr("minisparse.moe.convert.record_layers", no_work)
    refused(case)


# ---------------------------------------------------------------------------------------------
# Grading: answers of the wrong kind, calls that hang or patch the comparison
# ---------------------------------------------------------------------------------------------


class GradeFailed(Exception):
    """``check`` said no; the message is what it printed."""


def graded(name: str, fn: Callable[..., Any], **options: Any) -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        ok = check(name, fn, seed=0, **options)
    if not ok:
        raise GradeFailed(out.getvalue())


def sink(*args: Any) -> Any:
    return solution("sink_visible", SOLUTIONS)(*args)


def rope(*args: Any) -> Any:
    return solution("rope", SOLUTIONS)(*args)


#: Set after every grading case: the loops below swallow the grader's stop, so only this ends
#: them (a notebook would restart its kernel); left running, the busy one would hold the GIL and
#: slow every later test of the session to a crawl.
RELEASE = threading.Event()


def swallows_every_exception(*args: Any) -> Any:
    while not RELEASE.is_set():
        try:
            time.sleep(0.05)
        except:  # noqa: E722 (the learner's bare except, which used to swallow the limit)
            pass


def busy_and_swallowing(*args: Any) -> Any:
    while not RELEASE.is_set():
        try:
            sum(range(50))
        except BaseException:
            continue


def patches_allclose(*args: Any) -> Any:
    torch.allclose = lambda *a, **k: True
    return rope(*args) * 2


def patches_tensor_eq(*args: Any) -> Any:
    torch.Tensor.__eq__ = lambda a, b: torch.ones((), dtype=torch.bool)
    return sink(*args)


GRADING = [
    Case("int-mask", lambda: graded("sink_visible", lambda *a: sink(*a).int()),
         r"the result has dtype torch\.int32, the reference's torch\.bool", GradeFailed),
    Case("float-mask", lambda: graded("sink_visible", lambda *a: sink(*a).float()),
         r"the result has dtype torch\.float32, the reference's torch\.bool", GradeFailed),
    Case("rope-float64", lambda: graded("rope", lambda *a: rope(*a).double()),
         r"dtype torch\.float64, the reference's torch\.float32", GradeFailed),
    Case("rope-list", lambda: graded("rope", lambda *a: rope(*a).tolist()),
         r"the result is a list, the reference's a torch\.Tensor", GradeFailed),
    Case("rope-numpy", lambda: graded("rope", lambda *a: np.asarray(rope(*a))),
         r"the result is a ndarray, the reference's a torch\.Tensor", GradeFailed),
    Case("rope-shape", lambda: graded("rope", lambda *a: rope(*a)[None]),
         r"the result has shape \[1, .*the reference's", GradeFailed),
    Case("sleeping-loop-swallows", lambda: graded("rope", swallows_every_exception),
         r"did not return within .* a thread the grader stopped waiting for", GradeFailed),
    Case("busy-loop-swallows", lambda: graded("rope", busy_and_swallowing),
         r"did not return within", GradeFailed),
    Case("patches-allclose", lambda: graded("rope", patches_allclose),
         r"your function replaced torch\.allclose, .* it is put back", GradeFailed),
    Case("patches-tensor-eq", lambda: graded("sink_visible", patches_tensor_eq),
         r"your function replaced Tensor\.__eq__", GradeFailed),
    Case("float-seed", lambda: check("rope", rope, seed=1.5), r"seed must be"),
]  # fmt: skip


@pytest.mark.parametrize("case", GRADING, ids=ids(GRADING))
def test_grading_is_not_fooled_and_does_not_hang(case, monkeypatch):
    monkeypatch.setattr(R, "TIME_LIMIT", 0.3)
    monkeypatch.setattr(R, "STOP_GRACE", 0.3)
    allclose, eq = torch.allclose, torch.Tensor.__eq__
    RELEASE.clear()
    try:
        refused(case)
    finally:  # end the learner threads the grader had to leave running
        RELEASE.set()
        for thread in threading.enumerate():
            if thread.name == "minisparse-learner":
                thread.join(5)
    assert not any(t.name == "minisparse-learner" for t in threading.enumerate())
    assert torch.allclose is allclose and torch.Tensor.__eq__ is eq  # nothing stays patched
    graded("rope", rope)  # the reference for the table: the worked solution still passes
    graded("sink_visible", sink)


def test_a_solution_file_with_a_syntax_error_is_one_clear_error(tmp_path):
    (tmp_path / "rope.py").write_text("def rope(x, cos, sin:\n    return x\n")
    with pytest.raises(ValueError, match=r"rope\.py is not valid Python \(line 1"):
        solution("rope", tmp_path)


def test_the_learners_call_keeps_the_callers_grad_mode():
    seen = []

    def spy(*args: Any) -> Any:
        seen.append(torch.is_grad_enabled())
        return rope(*args)

    with torch.no_grad():
        graded("rope", spy)
    graded("rope", spy)
    assert seen and set(seen[: len(seen) // 2]) == {False} and seen[-1] is True


# ---------------------------------------------------------------------------------------------
# CLI: argument errors in one line, before the model is loaded
# ---------------------------------------------------------------------------------------------

CLI = [
    ("recover-block-size-0", ["recover", "--block-size", "0"], r"--block-size must be"),
    ("recover-seq-len-1", ["recover", "--seq-len", "1"], r"--seq-len must be"),
    ("recover-eval-tokens", ["recover", "--eval-tokens", "10"], r"--eval-tokens must be"),
    ("prune-superscript", ["prune", "--pattern", "²:4"], r"pattern must be .*got '²:4'"),
    ("export-to-proc", ["export", "/proc/x.gguf", "--format", "gguf"],
     r"cannot write /proc/x\.gguf"),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "match"), [c[1:] for c in CLI], ids=[c[0] for c in CLI])
def test_cli_refuses_before_loading_the_model(argv, match, monkeypatch, capsys):
    def no_load(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the command loaded the model before checking its arguments")

    monkeypatch.setattr("minisparse.io.loading.load", no_load)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    assert re.search(match, err), err


def test_recover_checks_the_block_size_against_the_model_before_any_work(monkeypatch, capsys):
    """--block-size 7 needs the model's widths: refused right after loading, before the
    dense perplexity (the first work) starts."""

    def no_work(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("recover started its work before checking the block size")

    monkeypatch.setattr("minisparse.io.loading.load", lambda *a, **k: (tiny_model(), IdTokenizer()))
    monkeypatch.setattr(sys.modules["minisparse.peft.recover"], "perplexity_entry", no_work)
    assert main(["recover", "--block-size", "7"]) == 2
    assert "block_size 7 does not divide the rows (48 columns)" in capsys.readouterr().err
