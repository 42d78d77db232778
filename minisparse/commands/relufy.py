"""``minisparse relufy --stage 1 --steps 200``: ReLUfy the model and fine-tune it by distillation
(chapter 04), resuming from its last checkpoint; the report as JSON with ``--out``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from ..core.checks import check_count, check_output_path
from ..io.loading import resolve_device
from ..relufy.finetune import TRAINABLE
from .common import add_model_arguments

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--stage", type=int, default=1, choices=(1, 2))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--trainable", default="mlp", choices=TRAINABLE)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--kd-weight", type=float, default=0.9, help="weight of the KL term")
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--eval-tokens", type=int, default=8 * 256)
    parser.add_argument("--checkpoint-every", type=int, default=50)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    parser.add_argument(
        "--bf16",
        default="auto",
        choices=("auto", "on", "off"),
        help="bf16 autocast (auto: where the hardware has bf16 instructions)",
    )
    parser.add_argument("--fresh", action="store_true", help="ignore a checkpoint; start over")
    parser.add_argument("--save-dir", default=None, help="where results go (default: the cache)")
    parser.add_argument("--out", default=None, help="write the report as JSON here")


def run(args: argparse.Namespace) -> int:
    import json
    import shlex

    from ..io.loading import load
    from ..relufy.finetune import FinetuneConfig
    from ..relufy.recipe import EVAL_WINDOW, check_relufy_arguments, relufy_and_finetune, result_dir

    check_count(args.threads, "--threads", minimum=0, fix="0 keeps torch's default")
    check_relufy_arguments(args.stage, args.seq_len, args.eval_tokens, EVAL_WINDOW)
    if args.out:
        check_output_path(args.out, "--out")
    resolve_device(args.device)
    config = FinetuneConfig(
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        warmup=args.warmup,
        trainable=args.trainable,
        kd_weight=args.kd_weight,
        eval_every=args.eval_every,
        checkpoint_every=args.checkpoint_every,
        bf16={"auto": None, "on": True, "off": False}[args.bf16],
    )
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load(args.model, device=args.device)
    _, report = relufy_and_finetune(
        model,
        tokenizer,
        args.stage,
        config,
        seq_len=args.seq_len,
        eval_tokens=args.eval_tokens,
        root=Path(args.save_dir) if args.save_dir else None,
        resume=not args.fresh,
    )
    report["command"] = "minisparse " + shlex.join(args.argv)
    for name in ("dense", "swapped", "finetuned"):
        r = report[name]
        print(
            f"{name:10s} perplexity {r['ppl']:9.2f} | zeros: MLP activation "
            f"{r['zeros_mlp_act']:.1%}, down input {r['zeros_down_in']:.1%}, "
            f"attention input {r['zeros_attn_in']:.1%}, MLP input {r['zeros_mlp_in']:.1%}"
        )
    saved = result_dir(args.stage, args.trainable, Path(args.save_dir) if args.save_dir else None)
    print(f"saved in {saved}; {report['seconds']:.0f} s")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"report: {out}")
    return 0
