"""``minisparse predictors``: train per-layer sparsity predictors (chapter 06) on the fine-tuned
ReLU model if there is one (else on SiLU thresholds), score them on held-out text, save them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from ..core.checks import check_count, check_output_path
from ..io.loading import resolve_device
from ..predictors.lowrank import KINDS
from ..sparsity import check_sparsity
from .common import add_model_arguments

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--kind", default="lowrank", choices=KINDS)
    parser.add_argument("--target-recall", type=float, default=0.95)
    parser.add_argument(
        "--windows", type=int, default=16, help="training windows of --seq-len tokens"
    )
    parser.add_argument(
        "--val-windows", type=int, default=4, help="validation windows (cutoffs, sizes)"
    )
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--eval-tokens", type=int, default=4 * 256)
    parser.add_argument("--lookahead", action="store_true", help="predict from the previous layer")
    parser.add_argument("--head-sparsity", type=float, default=0.0, help="> 0: head predictors too")
    parser.add_argument(
        "--silu-sparsity",
        type=float,
        default=0.5,
        help="without a fine-tuned ReLU model: the SiLU model's threshold sparsity",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    parser.add_argument("--out", default=None, help="safetensors file (default: in the cache)")
    parser.add_argument("--report", default=None, help="write the held-out scores as JSON here")


def run(args: argparse.Namespace) -> int:
    import json

    from ..io.data import corpus, encode, token_batches
    from ..io.eval import windows
    from ..io.loading import cache_dir, load
    from ..predictors import PredictorConfig, prediction_target, train_predictors

    check_count(args.threads, "--threads", minimum=0, fix="0 keeps torch's default")
    check_count(args.windows, "--windows")
    check_count(args.val_windows, "--val-windows")
    check_count(args.seq_len, "--seq-len", minimum=2)
    check_count(args.eval_tokens, "--eval-tokens", minimum=args.seq_len, fix="one --seq-len window")
    check_sparsity(args.silu_sparsity)
    config = PredictorConfig(
        kind=args.kind,
        target_recall=args.target_recall,
        lookahead=args.lookahead,
        head_sparsity=args.head_sparsity,
    )
    for option in (args.out, args.report):
        if option:
            check_output_path(option, "--out/--report")
    resolve_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    base, tokenizer = load(args.model, device=args.device)
    calibration = token_batches(tokenizer, corpus(split="calib"), args.seq_len, args.val_windows)
    target = prediction_target(base, calibration, sparsity=args.silu_sparsity)
    print(f"model: {target.description}", flush=True)
    train = token_batches(tokenizer, corpus(split="train"), args.seq_len, args.windows)
    predictors = train_predictors(
        target.model, train, thresholds=target.thresholds, validation=calibration, config=config
    )
    held_out = windows(encode(tokenizer, corpus(split="eval"))[: args.eval_tokens], args.seq_len)
    scores = predictors.evaluate(target.model, held_out)
    print(f"ranks per layer: {predictors.ranks}")
    print(
        f"held-out: recall {scores['mean_recall']:.1%}, precision {scores['mean_precision']:.1%}, "
        f"neurons skipped {scores['mean_predicted_sparsity']:.1%} "
        f"(true {scores['mean_true_sparsity']:.1%}); "
        f"{predictors.parameter_share(target.model):.1%} of the MLP parameters"
    )
    made_for = "relu" if not any(target.thresholds) else "silu"
    name = f"{Path(args.model).name}-{made_for}-{args.kind}.safetensors"
    default = cache_dir() / "predictors" / name
    out = Path(args.out) if args.out else default
    predictors.save(out)
    print(f"saved: {out}")
    if args.report:
        settings = {k: v for k, v in vars(config).items() if not callable(v)}  # not the loop
        report = {"model": target.description, "config": settings, **scores}
        Path(args.report).write_text(json.dumps(report, indent=1) + "\n")
    return 0
