"""Held-out perplexity against sparsity: static weight pruning beside dynamic activation sparsity.

One protocol for every configuration, so their perplexities compare:

* evaluation: the first ``EVAL_TOKENS`` tokens of the corpus' eval split, cut into windows of
  ``SEQ_LEN`` (``io.eval.window_nlls``), with a 95 % bootstrap interval over the windows
  (``io.eval.bootstrap_perplexity``);
* calibration: ``CALIB_SEQUENCES`` sequences of ``SEQ_LEN`` tokens of the *train* split. Wanda
  and SparseGPT calibrate on 128 sequences of 2048 tokens of C4; this is 1/64 of that, to run
  on a laptop CPU.

A configuration (``SweepConfig``) is a method, a pattern and a share s:

* ``dense``: the model as it is;
* ``magnitude``, ``wanda``, ``sparsegpt`` (``prune``, targets "all"): a share s of the weights
  of every projection of the blocks is zero, "unstructured" or "n:m" (s = 1 − n/m);
* ``teal`` (chapter 03, ``minisparse.sparsity``): per layer, the inputs of gate/up and of down
  below the magnitude t_l with P(|x| ≤ t_l) = s on the calibration text are zeroed, so a kernel
  skips a share s of the MLP's weights on average, chosen anew for every token (pattern
  "dynamic").

``sweep_rows`` measures a few configurations (a notebook calls it live); ``run_sweep`` measures
the whole grid (``sweep_grid``) and writes the JSON that ``minisparse prune --sweep`` saves
(``add_prune_command`` adds that command, ``run_prune_command`` runs it).
"""

from __future__ import annotations

import argparse
import json
import shlex
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from ..core.checks import check_count, check_output_path
from ..core.model import Transformer
from ..files.cache import atomic_write_text
from ..io.data import corpus, encode, token_batches
from ..io.eval import bootstrap_perplexity, window_nlls, windows
from ..measure.machine import cpu_name
from ..sparsity import SparsityStats, record, teal_model
from .masks import PATTERNS, check_sparsity, pattern_nm
from .prune import PRUNE_METHODS, prune
from .sparsegpt import check_target

__all__ = [
    "CALIB_SEQUENCES",
    "EVAL_TOKENS",
    "LITERATURE",
    "SEQ_LEN",
    "SWEEP_METHODS",
    "SWEEP_SHARES",
    "TEAL_MLP_SITES",
    "SweepConfig",
    "add_prune_arguments",
    "add_prune_command",
    "calibration_batches",
    "check_prune_command",
    "config_model",
    "eval_windows",
    "run_prune_command",
    "run_sweep",
    "sweep_grid",
    "sweep_rows",
]

SEQ_LEN = 256
EVAL_TOKENS = 2048
CALIB_SEQUENCES = 16
#: The unstructured shares of the grid (and TEAL's shares of skipped MLP work).
SWEEP_SHARES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7)
#: Every method a configuration may name.
SWEEP_METHODS = ("dense", *PRUNE_METHODS, "teal")
#: TEAL's sites in the MLP: the inputs of gate/up and of down.
TEAL_MLP_SITES = ("mlp_in", "down_in")

#: The Wanda paper's Table 3 (Sun et al. 2024): LLaMA-7B, WikiText perplexity, 50 % unstructured.
LITERATURE = {
    "source": "Sun et al. 2024, A Simple and Effective Pruning Approach for Large Language "
    "Models (Wanda), LLaMA-7B, WikiText, 50 % unstructured, 128 x 2048 C4 calibration tokens",
    "ppl": {"dense": 5.68, "magnitude": 17.29, "wanda": 7.26, "sparsegpt": 7.22},
}


@dataclass(frozen=True)
class SweepConfig:
    """One configuration: ``method`` in ``SWEEP_METHODS``, ``pattern`` ("unstructured", "n:m",
    "dense" or "dynamic" for TEAL) and the share ``sparsity`` of weights (or MLP work) skipped."""

    method: str
    pattern: str
    sparsity: float

    def __post_init__(self) -> None:
        if self.method not in SWEEP_METHODS:
            raise ValueError(f"Unknown method {self.method!r}; use one of {SWEEP_METHODS}.")
        if self.method == "dense":
            if (self.pattern, self.sparsity) != ("dense", 0):
                raise ValueError(
                    f"dense runs with pattern 'dense' and sparsity 0; got pattern "
                    f"{self.pattern!r}, sparsity {self.sparsity}."
                )
        elif self.method == "teal":
            if self.pattern != "dynamic":
                raise ValueError(f"teal runs with pattern 'dynamic'; got {self.pattern!r}.")
            check_sparsity(self.sparsity)
        else:
            nm = pattern_nm(self.pattern)
            check_target(self.sparsity, self.pattern, 1 if nm is None else nm[1])

    @property
    def label(self) -> str:
        return f"{self.method} {self.pattern} {self.sparsity:.0%}"


def sweep_grid(shares: Sequence[float] = SWEEP_SHARES) -> list[SweepConfig]:
    """Dense; each pruning method at every share of ``shares`` and at 2:4 and 4:8; TEAL at
    every share."""
    grid = [SweepConfig("dense", "dense", 0.0)]
    for method in PRUNE_METHODS:
        grid += [SweepConfig(method, "unstructured", s) for s in shares]
        for pattern in PATTERNS:
            nm = pattern_nm(pattern)
            if nm is not None:
                grid.append(SweepConfig(method, pattern, 1 - nm[0] / nm[1]))
    grid += [SweepConfig("teal", "dynamic", s) for s in shares]
    return grid


def eval_windows(tokenizer: Any, text: str | None = None) -> Tensor:
    """The protocol's held-out windows [EVAL_TOKENS // SEQ_LEN, SEQ_LEN] (eval split)."""
    ids = encode(tokenizer, corpus(split="eval") if text is None else text)
    return windows(ids[:EVAL_TOKENS], SEQ_LEN)


def calibration_batches(tokenizer: Any) -> Tensor:
    """The protocol's calibration text: [CALIB_SEQUENCES, SEQ_LEN] token ids of the train split."""
    return token_batches(tokenizer, corpus(split="train"), SEQ_LEN, CALIB_SEQUENCES)


def config_model(
    model: Transformer,
    config: SweepConfig,
    calibration: Tensor,
    teal_stats: SparsityStats | None = None,
) -> Transformer:
    """The model a configuration runs: ``model`` itself (dense), a pruned copy, or a copy with
    TEAL's thresholds (from ``teal_stats``, recorded on the calibration text when None)."""
    if config.method == "dense":
        return model
    if config.method == "teal":
        return teal_model(model, calibration, config.sparsity, TEAL_MLP_SITES, teal_stats)
    return prune(model, config.method, config.sparsity, config.pattern, calibration)


def sweep_rows(
    model: Transformer,
    tokenizer: Any,
    configs: Sequence[SweepConfig | tuple[str, str, float]],
    *,
    calibration: Tensor | None = None,
    eval_ids: Tensor | None = None,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Per configuration, {method, pattern, sparsity, ppl, lo, hi}: the held-out perplexity and
    its 95 % bootstrap interval under the protocol (``eval_windows``, ``calibration_batches``
    unless given). ``configs`` are ``SweepConfig`` or (method, pattern, sparsity) tuples."""
    configs = [c if isinstance(c, SweepConfig) else SweepConfig(*c) for c in configs]
    held_out = eval_windows(tokenizer) if eval_ids is None else windows(eval_ids, SEQ_LEN)
    needs_text = any(c.method != "dense" for c in configs)
    if calibration is None and needs_text:
        calibration = calibration_batches(tokenizer)
    stats = None
    if any(c.method == "teal" for c in configs):
        assert calibration is not None
        stats = record(model, calibration, TEAL_MLP_SITES, progress=False)
    rows = []
    bar = tqdm(configs, desc="pruning sweep", disable=not progress)
    for config in bar:
        bar.set_postfix_str(config.label)
        run = config_model(model, config, calibration, stats)  # type: ignore[arg-type]
        interval = bootstrap_perplexity(window_nlls(run, held_out, SEQ_LEN, progress=False))
        rows.append({**asdict(config), "ppl": interval.mid, "lo": interval.low,
                     "hi": interval.high})  # fmt: skip
    return rows


def run_sweep(
    model: Transformer,
    tokenizer: Any,
    out: str | Path | None = None,
    command: str = "",
    model_name: str = "smollm2-135m",
    configs: Sequence[SweepConfig] | None = None,
    *,
    calibration: Tensor | None = None,
    eval_ids: Tensor | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """``sweep_rows`` on ``configs`` (default ``sweep_grid()``), as the report
    {machine, command, protocol, literature, rows}; written to ``out`` atomically when given."""
    grid = sweep_grid() if configs is None else configs
    rows = sweep_rows(model, tokenizer, grid, calibration=calibration, eval_ids=eval_ids,
                      progress=progress)  # fmt: skip
    report = {
        "machine": cpu_name(),
        "command": command,
        "protocol": {
            "model": model_name,
            "eval": f"corpus eval split, first {EVAL_TOKENS} tokens, windows of {SEQ_LEN}; "
            "ppl with a 95 % bootstrap interval [lo, hi] over the windows",
            "calibration": f"{CALIB_SEQUENCES} sequences x {SEQ_LEN} tokens of the train split "
            "(the Wanda and SparseGPT papers use 128 x 2048 tokens of C4)",
            "pruning": "targets all (q, k, v, o, gate, up, down of every block), sequential "
            "block-by-block calibration; embedding and LM head dense; sparsity = share of "
            "zero weights per row",
            "teal": f"dynamic activation sparsity: thresholds at {list(TEAL_MLP_SITES)}, "
            "sparsity = share of MLP weight columns skipped per token (attention dense)",
        },
        "literature": LITERATURE,
        "rows": rows,
    }
    if out is not None:
        atomic_write_text(Path(out), json.dumps(report, indent=1) + "\n")
    return report


# --------------------------------------------------------------------------------------------
# minisparse prune
# --------------------------------------------------------------------------------------------


def add_prune_command(commands: Any, parent: argparse.ArgumentParser) -> None:
    """Add ``minisparse prune`` to the command line's subcommands ``commands``."""
    parser = commands.add_parser(
        "prune",
        help="prune the weights (magnitude, Wanda, SparseGPT): perplexity against dense; "
        "--sweep: the whole grid",
        parents=[parent],
    )
    add_prune_arguments(parser)
    parser.set_defaults(func=run_prune_command)


def add_prune_arguments(parser: argparse.ArgumentParser) -> None:
    """``minisparse prune``'s options."""
    parser.add_argument("--model", default="smollm2-135m", help="as for the other commands")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument("--method", default=None, choices=PRUNE_METHODS, help="default: wanda")
    parser.add_argument("--pattern", default=None, help="unstructured (default), 2:4, 4:8, n:m")
    parser.add_argument("--sparsity", type=float, default=None, help="default 0.5 (n:m: 1 - n/m)")
    parser.add_argument("--sweep", action="store_true", help="every configuration of the grid")
    parser.add_argument(
        "--shares", default=None, help="with --sweep: the grid's shares, e.g. 0.3,0.5,0.7"
    )
    parser.add_argument("--out", default=None, help="with --sweep: write the report (JSON) here")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")


def check_prune_command(args: argparse.Namespace) -> list[SweepConfig]:
    """The configurations asked for (dense and one, or the grid), checked before any model
    loads."""
    check_count(args.threads, "--threads", minimum=0, fix="0 keeps torch's default")
    if args.shares is not None and not args.sweep:
        raise ValueError("--shares sets the grid of --sweep; add --sweep.")
    if args.out:
        if not args.sweep:
            raise ValueError("--out is where --sweep writes its report; add --sweep.")
        check_output_path(args.out, "--out")
    chosen = [f"--{k}" for k in ("method", "pattern", "sparsity") if getattr(args, k) is not None]
    if args.sweep:
        if chosen:
            raise ValueError(f"--sweep runs the whole grid; leave out {', '.join(chosen)}.")
        if args.shares is None:
            return sweep_grid()
        try:
            shares = [float(share) for share in args.shares.split(",")]
        except ValueError:
            raise ValueError(
                f"--shares is a list such as 0.3,0.5,0.7; got {args.shares!r}."
            ) from None
        return sweep_grid(shares)
    pattern = args.pattern or "unstructured"
    nm = pattern_nm(pattern)
    sparsity = args.sparsity
    if sparsity is None:
        sparsity = 0.5 if nm is None else 1 - nm[0] / nm[1]
    return [
        SweepConfig("dense", "dense", 0.0),
        SweepConfig(args.method or "wanda", pattern, sparsity),
    ]


def run_prune_command(args: argparse.Namespace) -> int:
    """``minisparse prune``: dense and one pruned configuration, or the whole grid (--sweep)."""
    from ..io.loading import load, resolve_device

    configs = check_prune_command(args)
    resolve_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load(args.model, device=args.device)
    if args.sweep:
        command = "minisparse " + shlex.join(getattr(args, "argv", []))
        rows = run_sweep(model, tokenizer, args.out, command, args.model, configs)["rows"]
    else:
        rows = sweep_rows(model, tokenizer, configs)
    for row in rows:
        print(
            f"{row['method']:10s} {row['pattern']:12s} {row['sparsity']:4.0%}   perplexity "
            f"{row['ppl']:8.2f}  ({row['lo']:.2f} - {row['hi']:.2f})"
        )
    if args.out:
        print(f"report: {args.out}")
    return 0
