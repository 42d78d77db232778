"""Benchmark: greedy decode speed of a dense model and its sparse version, against the ceiling.

    minisparse bench sparse-decode [--method relu-predictors|teal] [--sparsity 0.5] [--json]
    minisparse bench sparse-decode --shape llama2-7b --layers 2 [--sparsity 0.5 0.7 0.9]

``relu-predictors`` (the default once ``minisparse prepare`` made them): chapter 04's ReLU model
against itself with chapter 07's sparse MLPs choosing neurons by chapter 06's predictors.
``teal``: the base model against a copy with TEAL thresholds on the inputs of q/k/v
(``attn_in``), gate/up (``mlp_in``) and down (``down_in``), a share ``--sparsity`` of each zero
on calibration text. ``--shape``: a real model's widths with a few layers of random weights and
random low-rank predictors whose cutoffs make a share s of the neurons inactive per token, for
each s: how the kernels behave at the width of a 7B model (a row of 4096 floats, 16 KB, against
SmolLM2's 576), with the attention, norms and LM head of that width staying dense.

What is timed and the bytes ceiling: ``minisparse.bench.sparse_steps``. Perplexity is measured
as the sparse model decodes, every token with its own neurons (``sparse_perplexity``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shlex
import sys
import time
from dataclasses import asdict
from typing import Any

import torch
from torch import Tensor, nn

from ..core.checks import check_count
from ..core.config import ModelConfig
from ..core.hooks import capture_inputs
from ..core.model import Transformer, init_weights_
from ..core.sampling import encode_prompt
from ..course.prepare import _relu_predictors
from ..engine.compose import load_selector, sparse_model
from ..io.data import corpus, encode, token_batches
from ..measure.compare import against_goal
from ..measure.machine import machine
from ..predictors import Predictors
from ..predictors.lowrank import Predictor, init_random
from ..relufy.recipe import load_relufied
from ..sparsity import sparsity_method
from .engine import relu_model_cached
from .prompts import PROMPTS
from .sparse_steps import SparseDecodeResult, bench_sparse_decode

__all__ = [
    "SHAPES",
    "SHAPE_SPARSITIES",
    "add_arguments",
    "bench_random_shape",
    "default_method",
    "mlp_inputs",
    "random_model",
    "random_predictors",
    "run",
    "set_density_",
]

#: Widths of real models for ``--shape`` (random weights, ``--layers`` layers, untied head).
SHAPES = {
    "llama2-7b": {
        "vocab_size": 32000, "dim": 4096, "n_heads": 32, "n_kv_heads": 32, "head_dim": 128,
        "ffn_dim": 11008, "tie_embeddings": False,
    },
}  # fmt: skip
SHAPE_SPARSITIES = (0.5, 0.7, 0.9)
PREDICTOR_RANK = 1024  # DejaVu-sized for a 7B MLP: r (d + n) = 15.5 M weights, 11 % of 3 d n


def random_model(shape: str, layers: int, seed: int = 0) -> Transformer:
    """A model of ``shape``'s widths with ``layers`` layers of seeded random weights."""
    config = ModelConfig(**SHAPES[shape], n_layers=layers, max_seq_len=512)
    return init_weights_(Transformer(config), seed)


def random_predictors(model: Transformer, rank: int | None = None, seed: int = 0) -> Predictors:
    """One seeded random low-rank predictor per layer, rank ``PREDICTOR_RANK`` unless given
    (``set_density_`` places the cutoffs)."""
    rank = PREDICTOR_RANK if rank is None else rank
    c = model.config
    neurons = nn.ModuleList(
        init_random(Predictor(c.dim, rank, c.ffn_dim), seed + i) for i in range(c.n_layers)
    )
    return Predictors(neurons, [0.0] * c.n_layers, "lowrank")


@torch.inference_mode()
def mlp_inputs(model: Transformer, token_ids: Tensor) -> list[Tensor]:
    """Per layer, the MLP inputs [tokens, dim] of one forward pass over ``token_ids`` [1, T]."""
    mlps = {str(i): layer.mlp for i, layer in enumerate(model.layers)}
    with capture_inputs(mlps) as seen:
        model(token_ids)
    return [seen[name][0].flatten(0, -2) for name in mlps]


@torch.inference_mode()
def set_density_(predictors: Predictors, inputs: list[Tensor], sparsity: float) -> Predictors:
    """Per layer, the cutoff that leaves a share ``sparsity`` of the logits on ``inputs`` below
    it: over those tokens, 1 - sparsity of the neurons are predicted active. In place."""
    for predictor, x in zip(predictors.neurons, inputs, strict=True):
        predictor.cutoff.fill_(float(torch.quantile(predictor(x).flatten().float(), sparsity)))
    return predictors


def bench_random_shape(
    shape: str = "llama2-7b", layers: int = 2, sparsities: tuple[float, ...] = SHAPE_SPARSITIES,
    max_new_tokens: int = 16, repeats: int = 3, seed: int = 0, progress: bool = True,
) -> list[SparseDecodeResult]:  # fmt: skip
    """Dense vs predictor-sparse decoding of a random ``shape`` model, one result per sparsity.

    The prompt and the cutoffs' calibration tokens are seeded random ids; the same sparse model
    serves every sparsity (its predictors' cutoffs move). Perplexity is not measured (NaN).
    """
    dense = random_model(shape, layers, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    vocab = dense.config.vocab_size
    prompt = torch.randint(vocab, (16,), generator=gen).tolist()
    inputs = mlp_inputs(dense, torch.randint(vocab, (1, 128), generator=gen))
    predictors = random_predictors(dense, seed=seed)
    sparse = sparse_model(dense, None, predictors.select, kernels=True)
    results = []
    for s in sparsities:
        set_density_(predictors, inputs, s)
        results.append(
            bench_sparse_decode(
                dense, sparse, prompt, None, f"random {shape} x {layers} layers, predictors",
                max_new_tokens, repeats, progress,
            )
        )  # fmt: skip
    return results


#: What a sparse step should reach: this share of its byte ceiling (the bytes it skips).
CEILING_GOAL = 0.92


def _table(r: SparseDecodeResult) -> str:
    share = r.share_interval()
    return (
        f"{'model':8s} {'tok/s':>8s} {'MB/tok':>8s} {'GB/s':>6s} {'ppl':>8s}\n"
        f"{'dense':8s} {r.dense_tok_s:8.1f} {r.dense_mb_per_token:8.1f} {r.dense_gbs:6.1f} "
        f"{r.ppl_dense:8.2f}\n"
        f"{'sparse':8s} {r.sparse_tok_s:8.1f} {r.sparse_mb_per_token:8.1f} {r.sparse_gbs:6.1f} "
        f"{r.ppl_sparse:8.2f}\n"
        f"read bandwidth in this run {r.read_gbs:.1f} GB/s\n"
        f"ratio {r.interval()}x (sparse / dense: median of {r.rounds} paired rounds, 95 % "
        f"interval) | ceiling {r.ceiling:.2f}x (bytes dense / sparse) | {share.mid:.0%} of the "
        f"ceiling ({share.low:.0%}-{share.high:.0%}): {against_goal(share, CEILING_GOAL)} the "
        f"{CEILING_GOAL:.0%} goal | measured sparsity {r.sparsity:.1%} | same tokens: "
        f"{'yes' if r.same_tokens else 'no'}"
    )


def default_method() -> str:
    """``relu-predictors`` when the ReLU model and its predictors are cached, else ``teal``."""
    return "relu-predictors" if relu_model_cached() and _relu_predictors().exists() else "teal"


def _check_arguments(args: argparse.Namespace) -> str:
    """The method to run, after checking every option (before any model loads)."""
    check_count(args.max_new_tokens, "--max-new-tokens")
    check_count(args.repeats, "--repeats", fix="the benchmark reports the median of the repeats")
    most = getattr(args, "most_repeats", args.repeats)
    check_count(most, "--most-repeats", minimum=args.repeats,
                fix="at least --repeats: the rounds the ratio may grow to")  # fmt: skip
    check_count(args.layers, "--layers", fix="a random model needs at least one layer")
    if args.prompt is not None and not args.prompt.strip():
        raise ValueError("--prompt is empty; give some text to decode after, or leave it out.")
    for s in args.sparsity or ():
        if not 0.0 < s < 1.0:
            raise ValueError(f"--sparsity must lie in (0, 1), got {s}; try --sparsity 0.5")
    if args.shape is not None:
        if args.method is not None or args.prompt is not None:
            raise ValueError(
                "--shape decodes random weights with random predictors: drop --method and "
                "--prompt, or drop --shape to run the real model."
            )
        return "shape"
    method = args.method or default_method()
    if args.sparsity is not None and method != "teal":
        raise ValueError("--sparsity sets TEAL's thresholds: add --method teal, or drop it.")
    if args.sparsity is not None and len(args.sparsity) > 1:
        raise ValueError("--method teal takes one --sparsity (one set of thresholds per run).")
    if method == "relu-predictors" and default_method() != method:
        raise ValueError(
            "--method relu-predictors needs chapter 04's ReLU model and its predictors in the "
            "cache: make them with `minisparse prepare`, or use --method teal."
        )
    return method


def _make_models(method: str, base: Transformer, tokenizer: Any, calibration: Tensor,
                 sparsity: float) -> tuple[Transformer, Transformer]:  # fmt: skip
    """(dense, sparse) for ``method``; ``calibration`` and ``sparsity`` serve ``teal`` only."""
    if method == "relu-predictors":  # the ReLU model, loaded once, and its sparse version
        relu = load_relufied(base, 1)[0]
        select = load_selector(relu, str(_relu_predictors()))
        return relu, sparse_model(relu, None, select, kernels=True)
    return base, sparsity_method("teal").model(base, calibration, sparsity)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``minisparse bench sparse-decode``."""
    parser.add_argument(
        "--method", choices=("relu-predictors", "teal"), default=None,
        help="default: relu-predictors when `minisparse prepare` made them, else teal",
    )  # fmt: skip
    parser.add_argument(
        "--sparsity", type=float, nargs="+", default=None,
        help="teal: share of zeros at the inputs of every thresholded projection (default "
        "0.5); --shape: shares of inactive neurons (default 0.5 0.7 0.9)",
    )  # fmt: skip
    parser.add_argument(
        "--shape", choices=tuple(SHAPES), default=None,
        help="random weights of this model's widths instead of the real model",
    )  # fmt: skip
    parser.add_argument("--layers", type=int, default=2, help="--shape: layers (default 2)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default 64 (16)")
    parser.add_argument("--repeats", type=int, default=7, help="paired rounds first (7)")
    parser.add_argument(
        "--most-repeats", type=int, default=31,
        help="more rounds, up to this many, while the ratio's 95%% interval is wider than "
        "±10%% (default 31)",
    )  # fmt: skip
    parser.add_argument("--prompt", default=None, help="a user message (default: a grounded one)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def _real_model(args: argparse.Namespace, method: str) -> SparseDecodeResult:
    from ..io.loading import load  # looked up at each run: tests put a tiny model in its place

    sparsity = 0.5 if args.sparsity is None else args.sparsity[0]
    base, tokenizer = load("smollm2-135m", device="cpu")
    calibration = token_batches(tokenizer, corpus("pydoc", "calib"), 256, 4)
    eval_ids = encode(tokenizer, corpus("pydoc", "eval"))[: 4 * 256]
    text = PROMPTS["grounded"][4] if args.prompt is None else args.prompt
    prompt_ids = encode_prompt(tokenizer, [{"role": "user", "content": text}])
    dense, sparse = _make_models(method, base, tokenizer, calibration, sparsity)
    print(f"{method}: {len(prompt_ids)} prompt tokens, then {args.max_new_tokens} timed")
    return bench_sparse_decode(
        dense, sparse, prompt_ids, eval_ids, method, args.max_new_tokens, args.repeats,
        most=args.most_repeats,
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """Check the options, build both models, time them, print the table (or the JSON)."""
    if args.max_new_tokens is None:
        args.max_new_tokens = 16 if args.shape is not None else 64
    method = _check_arguments(args)
    out = sys.stdout  # with --json, everything else goes to stderr
    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
        about = machine()
        print(about.line(), flush=True)
        if method == "shape":
            print(f"random {args.shape}, {args.layers} layers, {args.max_new_tokens} timed tokens")
            sparsities = tuple(args.sparsity or SHAPE_SPARSITIES)
            results = bench_random_shape(
                args.shape, args.layers, sparsities, args.max_new_tokens, args.repeats
            )
        else:
            results = [_real_model(args, method)]
    rows = [_json_safe(asdict(r)) for r in results]
    body = rows[0] if method != "shape" else {"shape": args.shape, "layers": args.layers}
    if method == "shape":
        body["rows"] = rows
    body["machine"] = about.as_dict()
    body["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    body["command"] = "minisparse " + shlex.join(getattr(args, "argv", []))
    text = "\n".join(f"sparsity {r.sparsity:.0%}:\n{_table(r)}" for r in results)
    print(json.dumps(body) if args.json else (text if method == "shape" else _table(results[0])),
          file=out)  # fmt: skip
    return 0


def _json_safe(row: dict[str, Any]) -> dict[str, Any]:
    """NaN (no perplexity for random weights) as null: JSON has no NaN."""
    return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in row.items()}
