"""Benchmark: the engine's configurations side by side, speed against quality (chapter 11).

    minisparse bench engine [--configs NAME ...] [--max-new-tokens 64] [--repeats 3] [--json FILE]

Every configuration of ``minisparse.engine`` in ``CONFIGS`` (plus chapter 04's ReLU model when
the cache holds it) decodes the same grounded chat prompt greedily to exactly
``--max-new-tokens`` tokens (no stop at end-of-turn, so every row decodes as many); the runs are
interleaved within each repeat by the one timing harness, once at 1 token and once at all of
them, so that the difference times the decode steps alone (the prefill is reported apart), and
reported as tokens/s and as a ratio to the dense model of the same rounds. Beside speed:
perplexity on held-out text (the engine's model; a speculative engine has its target's
perplexity, since it emits the target's tokens), the weight bytes it reads per emitted token
(``Engine.bytes_per_token``), the bytes of its parameters and buffers, whether its greedy tokens
equal dense decoding, and whether it is on the Pareto front (no other configuration is both
faster and better).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ..core.checks import check_count
from ..engine.compose import Engine, EngineConfig, build
from ..engine.pareto import pareto_front
from ..measure.compare import Interval
from ..measure.machine import machine
from ..measure.timing import interleaved_decode_steps
from .prompts import PROMPTS
from .results import result, write_result

__all__ = [
    "CONFIGS",
    "EngineRow",
    "add_arguments",
    "bench_engine",
    "engine_perplexity",
    "fastest",
    "not_apart",
    "pareto",
    "pareto_ties",
    "run",
    "speed_interval",
]

CONFIGS: dict[str, EngineConfig] = {
    "dense": EngineConfig(),
    "cats": EngineConfig(sparsity="cats"),
    "int8": EngineConfig(weights="int8"),
    "int4": EngineConfig(weights="int4"),
    "int4-a8": EngineConfig(weights="int4-a8"),  # int8-rounded activations: see its perplexity
    "lookup": EngineConfig(draft="prompt-lookup"),
    "int8+lookup": EngineConfig(weights="int8", draft="prompt-lookup"),
    "cats+lookup": EngineConfig(sparsity="cats", draft="prompt-lookup"),
    "cats+int8": EngineConfig(sparsity="cats", weights="int8"),
}
RELU_CONFIGS: dict[str, EngineConfig] = {
    "relu": EngineConfig(sparsity="relu"),
    "relu+lookup": EngineConfig(sparsity="relu", draft="prompt-lookup"),
    "relu+int8": EngineConfig(sparsity="relu", weights="int8"),
}


@dataclass
class EngineRow:
    name: str
    description: str
    tok_s: float  # decode steps only: (t(n tokens) - t(1 token)) / (n - 1), median of rounds
    ratio_to_dense: float  # median over rounds of dense's seconds per token / this row's
    ratio_range: tuple[float, float]  # the lowest and highest of those per-round ratios
    prefill_ms: float  # the prompt's prefill and the first token
    perplexity: float
    mb_per_token: float  # weight bytes read per emitted token (Engine.bytes_per_token)
    resident_mb: float
    same_tokens_as_dense: bool
    pareto: bool = False


def relu_model_cached() -> bool:
    from ..relufy.recipe import result_dir

    return (result_dir(1, "mlp") / "model.safetensors").exists()


def pareto(rows: list[EngineRow]) -> list[EngineRow]:
    """Mark the rows no other row beats on both speed and perplexity."""
    front = pareto_front([(r.tok_s, r.perplexity) for r in rows])
    for r, on_front in zip(rows, front, strict=True):
        r.pareto = on_front
    return rows


def speed_interval(row: EngineRow) -> Interval:
    """A row's speed against dense: the median of the rounds within their range."""
    return Interval(row.ratio_to_dense, *row.ratio_range)


def not_apart(rows: list[EngineRow], row: EngineRow) -> list[EngineRow]:
    """``row`` and every row whose speed range overlaps its own (``minisparse.measure.compare``):
    none of them is measurably faster or slower than ``row``."""
    return [r for r in rows if r is row or speed_interval(r).overlaps(speed_interval(row))]


def fastest(rows: list[EngineRow]) -> list[EngineRow]:
    """The fastest row by its median and every row not measurably slower than it, fastest
    first: one row when the run tells the fastest apart, several when it does not."""
    if not rows:
        raise ValueError("fastest needs at least one row; run bench_engine first.")
    best = max(rows, key=lambda r: r.ratio_to_dense)
    return sorted(not_apart(rows, best), key=lambda r: -r.ratio_to_dense)


def pareto_ties(rows: list[EngineRow]) -> list[tuple[EngineRow, EngineRow]]:
    """Pairs of Pareto rows (``pareto`` marks them from medians) whose speed ranges overlap:
    which of the two is faster is not measured, so the front's order between them is not."""
    front = [r for r in rows if r.pareto]
    return [
        (a, b)
        for i, a in enumerate(front)
        for b in front[i + 1 :]
        if speed_interval(a).overlaps(speed_interval(b))
    ]


def bench_engine(
    base: Any,
    tokenizer: Any,
    configs: dict[str, EngineConfig],
    prompt: Any,
    calibration: torch.Tensor,
    eval_ids: torch.Tensor,
    max_new_tokens: int = 64,
    repeats: int = 3,
    progress: bool = True,
    seq_len: int = 256,
    builder: Callable[..., Engine] = build,
) -> list[EngineRow]:
    """One row per configuration, timed side by side (``dense`` must be among them).

    ``builder(base, tokenizer, config, calibration)`` makes each engine (chapter 11's learner
    passes their own)."""
    if "dense" not in configs:
        raise ValueError("configs must include 'dense': every ratio is to the dense model.")
    engines = {name: builder(base, tokenizer, cfg, calibration) for name, cfg in configs.items()}
    runs = {
        name: (lambda n, e=e: e.generate(prompt, n, stop_at_eos=False))
        for name, e in engines.items()
    }
    speeds, prefill = interleaved_decode_steps(runs, max_new_tokens, repeats, progress=progress)
    dense = speeds["dense"]
    rows, scores = [], {}
    for name, e in engines.items():
        per_round = speeds[name].round_speedups(dense)  # how far noise moves the ratio
        model_config = dataclasses.replace(e.config, draft=None)  # a draft leaves the model as is
        if model_config not in scores:
            scores[model_config] = engine_perplexity(e, eval_ids, seq_len)
        ppl = scores[model_config]
        rows.append(
            EngineRow(
                name=name,
                description=e.description,
                tok_s=speeds[name].tok_s,
                ratio_to_dense=speeds[name].paired_speedup(dense),
                ratio_range=(min(per_round), max(per_round)),
                prefill_ms=1e3 * prefill[name],
                perplexity=ppl,
                mb_per_token=e.bytes_per_token() / 1e6,
                resident_mb=e.resident_bytes() / 1e6,
                same_tokens_as_dense=speeds[name].tokens == dense.tokens,
            )
        )
    return pareto(rows)


@torch.inference_mode()
def engine_perplexity(engine: Any, eval_ids: torch.Tensor, seq_len: int = 256) -> float:
    """Held-out perplexity of the tokens the engine emits (a speculative engine: its target's).

    With chapter 06's predictors each decoded token keeps its own predicted neurons; a pass over
    a whole window would keep their union, nearly dense. So the model the predictors were made
    for (``Engine.dense_model``) runs with each token's MLP masked to its own prediction
    (``sparse_perplexity``), as a decode step computes.
    """
    from ..io.eval import perplexity
    from .sparse_steps import sparse_perplexity

    if engine.dense_model is not None:
        return sparse_perplexity(engine.dense_model, engine.model, eval_ids)
    return perplexity(engine.model, eval_ids, seq_len=seq_len, progress=False)


def format_rows(rows: list[EngineRow]) -> str:
    head = (
        f"{'name':15s} {'prefill':>7s} {'tok/s':>7s} {'x dense':>8s} {'rounds':>9s} {'ppl':>7s} "
        f"{'MB/tok':>7s} "
        f"{'MB':>6s}  same  Pareto"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"{r.name:15s} {r.prefill_ms:5.0f}ms {r.tok_s:7.1f} {r.ratio_to_dense:8.2f} "
            f"{r.ratio_range[0]:4.2f}-{r.ratio_range[1]:4.2f} "
            f"{r.perplexity:7.2f} {r.mb_per_token:7.1f} {r.resident_mb:6.0f}  "
            f"{'yes ' if r.same_tokens_as_dense else 'no  '}  "
            f"{'*' if r.pareto else '':6s}  {r.description}"
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="as for the other commands")
    names = [*CONFIGS, *RELU_CONFIGS]
    parser.add_argument("--configs", nargs="+", default=None, choices=names)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")


def run(args: argparse.Namespace) -> int:
    from ..io.data import corpus, encode, token_batches
    from ..io.loading import load

    check_count(args.max_new_tokens, "--max-new-tokens")
    check_count(args.repeats, "--repeats", fix="the benchmark reports the median of the repeats")
    every = {**CONFIGS, **RELU_CONFIGS}
    names = args.configs or [*CONFIGS, *(RELU_CONFIGS if relu_model_cached() else [])]
    if any(n in RELU_CONFIGS for n in names) and not relu_model_cached():
        raise ValueError(
            "The relu configurations need chapter 04's fine-tuned ReLU model; make it with "
            "`minisparse relufy --stage 1 --steps 200` (about 30 minutes on 2 cores)."
        )
    chosen = {"dense": CONFIGS["dense"]} | {n: every[n] for n in names}
    about = machine()
    print(about.line(), flush=True)
    base, tokenizer = load(args.model, device="cpu")
    calibration = token_batches(tokenizer, corpus("pydoc", "calib"), 256, 4)
    eval_ids = encode(tokenizer, corpus("pydoc", "eval"))[: 4 * 256]
    prompt = [{"role": "user", "content": PROMPTS["grounded"][4]}]
    rows = bench_engine(
        base, tokenizer, chosen, prompt, calibration, eval_ids, args.max_new_tokens, args.repeats
    )
    print(format_rows(rows))
    write_result(args, result(args, about, rows=[asdict(r) for r in rows]))
    return 0
