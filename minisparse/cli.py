"""The ``minisparse`` command line: info, generate, tour and benchmarks.

minisparse info                          model shape, parameter count, cache, CPU build
minisparse generate "prompt" [--chat]    stream a continuation (or a chat answer)
minisparse tour                          the five-minute tour of the real model
minisparse bench NAME                    benchmarks side by side (decode, sparse-decode, isa,
                                         nm-decode, ...: `minisparse bench -h` lists them)
minisparse relufy --stage 1 --steps 200  ReLUfy and fine-tune by distillation (chapter 04)
minisparse predictors                    train sparsity predictors and save them (chapter 06)
minisparse prune [--sweep]               magnitude / Wanda / SparseGPT pruning (chapter 12)
minisparse recover                       QLoRA recovery of a 2:4-pruned model (chapter 12)
minisparse prepare                       make every long artifact above in one go, with progress
minisparse offload --budget 0.3          hot/cold neuron placement and modelled speed (chapter 08)
minisparse export OUT [--format hf|gguf]  a transformers checkpoint or a llama.cpp GGUF file

Every command checks its arguments before it loads a model. A mistake in them (or a model that
cannot be loaded) prints one line, "error: ...", that says what to change, and exits with
status 2; anything else is a bug and prints Python's full traceback. ``--debug`` shows the
traceback for every error.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import torch

from .core.checks import check_output_path
from .core.generate import check_messages, check_sampling, check_seed
from .core.model import check_count
from .course import prepare
from .io import export
from .io.loading import ModelLoadError, resolve_device
from .offload import report as offload_report
from .sparsity import check_sparsity

#: Errors that mean "the user asked for something that cannot work"; the message says the fix.
USER_ERRORS = (
    ModelLoadError,
    ValueError,
    FileNotFoundError,
    FileExistsError,
    IsADirectoryError,
    NotADirectoryError,
    PermissionError,
)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default="smollm2-135m",
        help="short name, local directory, .gguf file or Hugging Face id",
    )
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")


def cmd_info(args: argparse.Namespace) -> int:
    from .course.tour import describe
    from .io.loading import cache_dir, load
    from .kernels.cpu_build import describe_build

    resolve_device(args.device)
    model, _ = load(args.model, device=args.device)
    print(
        f"model:  {args.model}\nshape:  {describe(model)}\ndevice: {model.device}\n"
        f"cache:  {cache_dir()}\nCPU build: {describe_build()}"
    )
    return 0


def check_generate_arguments(args: argparse.Namespace) -> None:
    """``minisparse generate``'s options, before the model loads."""
    if not args.prompt.strip():
        raise ValueError('The prompt is empty; write some text, e.g. minisparse generate "Hello".')
    if args.chat:
        check_messages([{"role": "user", "content": args.prompt}])
    check_count(args.max_new_tokens, "--max-new-tokens")
    check_sampling(args.temperature, args.top_k, args.top_p)
    check_seed(args.seed)
    resolve_device(args.device)


def cmd_generate(args: argparse.Namespace) -> int:
    from .core.generate import check_length, check_prompt_ids, encode_prompt, generate
    from .io.loading import load

    check_generate_arguments(args)
    model, tokenizer = load(args.model, device=args.device)
    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    ids = encode_prompt(tokenizer, prompt)
    check_prompt_ids(ids, model.config.vocab_size)
    check_length(model, len(ids), args.max_new_tokens)  # refused before the prompt is echoed
    if not args.chat:
        print(args.prompt, end="", flush=True)
    generate(
        model,
        tokenizer,
        ids,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stream=True,
    )
    return 0


def cmd_tour(args: argparse.Namespace) -> int:
    import matplotlib

    matplotlib.use("Agg")  # before the tour's plotting modules import pyplot
    from .course.tour import figure_path, run_tour

    run_tour(out=check_output_path(figure_path(args.out), "--out"))
    return 0


def cmd_relufy(args: argparse.Namespace) -> int:
    import json
    import shlex

    from .io.loading import load
    from .relufy.finetune import FinetuneConfig
    from .relufy.recipe import EVAL_WINDOW, check_relufy_arguments, relufy_and_finetune, result_dir

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


def cmd_predictors(args: argparse.Namespace) -> int:
    import json

    from .io.data import corpus, encode, token_batches
    from .io.eval import windows
    from .io.loading import cache_dir, load
    from .predictors import PredictorConfig, prediction_target, train_predictors

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


#: Benchmarks: ``minisparse bench NAME`` calls ``minisparse.bench.<module>.run(args)`` after
#: ``minisparse.bench.<module>.add_arguments(parser)`` declared its options.
CHAPTER_BENCHMARKS = {
    "decode": ("decode", "greedy decode tokens/s: minisparse vs transformers"),
    "sparse-ffn": ("kernels", "sparse FFN kernels vs dense and the ideal (chapter 07)"),
    "quant": ("quant", "fp32 vs bf16 / int8 / int4 weight-only decode speed (chapter 09)"),
    "speculative": ("speculative", "plain vs speculative decoding per draft (chapter 10)"),
    "engine": ("engine", "the engine's configurations: speed, perplexity, memory (chapter 11)"),
    "sparse-decode": ("sparse_decode", "dense vs sparse decode speed and the bytes ceiling"),
    "isa": ("isa", "the decode step built for each instruction set (-march) side by side"),
    "nm-decode": ("pruned", "dense vs 2:4 sparse decode speed and the bytes ceiling (ch. 12)"),
}


DEBUG_HELP = "show the full traceback of every error (default: one line for known mistakes)"


def build_parser(with_chapter_benchmarks: bool = True) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="minisparse", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    # --debug after the command too; SUPPRESS leaves the top-level value alone when absent
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "info", help="model shape, parameter count, cache location, CPU build", parents=[common]
    )
    add_model_arguments(p)
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("generate", help="stream a continuation of a prompt", parents=[common])
    add_model_arguments(p)
    p.add_argument("prompt")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("tour", help="a five-minute tour of the real model", parents=[common])
    p.add_argument(
        "--out",
        default=None,
        help="where to save the figure (default: minisparse-tour.png in the cache folder)",
    )
    p.set_defaults(func=cmd_tour)

    p = sub.add_parser(
        "relufy", help="ReLUfy the model and fine-tune it by distillation", parents=[common]
    )
    add_model_arguments(p)
    p.add_argument("--stage", type=int, default=1, choices=(1, 2))
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--trainable", default="mlp", choices=("mlp", "all", "lora"))
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--kd-weight", type=float, default=0.9, help="weight of the KL term")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-tokens", type=int, default=8 * 256)
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    p.add_argument(
        "--bf16",
        default="auto",
        choices=("auto", "on", "off"),
        help="bf16 autocast (auto: where the hardware has bf16 instructions)",
    )
    p.add_argument("--fresh", action="store_true", help="ignore a checkpoint; start over")
    p.add_argument("--save-dir", default=None, help="where results go (default: the cache)")
    p.add_argument("--out", default=None, help="write the report as JSON here")
    p.set_defaults(func=cmd_relufy)
    importlib.import_module("minisparse.peft.recover").add_command(sub, common)
    p = sub.add_parser(
        "predictors", help="train per-layer sparsity predictors and save them", parents=[common]
    )
    add_model_arguments(p)
    p.add_argument("--kind", default="lowrank", choices=("lowrank", "mlp"))
    p.add_argument("--target-recall", type=float, default=0.95)
    p.add_argument("--windows", type=int, default=16, help="training windows of --seq-len tokens")
    p.add_argument("--val-windows", type=int, default=4, help="validation windows (cutoffs, sizes)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--eval-tokens", type=int, default=4 * 256)
    p.add_argument("--lookahead", action="store_true", help="predict from the previous layer")
    p.add_argument("--head-sparsity", type=float, default=0.0, help="> 0: head predictors too")
    p.add_argument(
        "--silu-sparsity",
        type=float,
        default=0.5,
        help="without a fine-tuned ReLU model: the SiLU model's threshold sparsity",
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    p.add_argument("--out", default=None, help="safetensors file (default: in the cache)")
    p.add_argument("--report", default=None, help="write the held-out scores as JSON here")
    p.set_defaults(func=cmd_predictors)

    p = sub.add_parser(
        "prepare",
        help="make the long artifacts (ReLU model, predictors) the later chapters load",
        parents=[common],
    )
    prepare.add_arguments(p)
    p.set_defaults(func=prepare.run)

    p = sub.add_parser(
        "offload", help="hot/cold neuron placement, load and modelled speed", parents=[common]
    )
    p.add_argument("--model", default="smollm2-135m", help="as for the other commands")
    offload_report.add_arguments(p)
    p.set_defaults(func=offload_report.run)
    importlib.import_module("minisparse.pruning.sweep").add_prune_command(sub, common)
    p = sub.add_parser(
        "export", help="write the model for transformers (hf) or llama.cpp (gguf)", parents=[common]
    )
    export.add_arguments(p)
    p.set_defaults(func=export.run)

    bench = sub.add_parser("bench", help="benchmarks", parents=[common])
    bench = bench.add_subparsers(dest="bench", required=True)
    if with_chapter_benchmarks:  # only when asked for: they import most of the library
        for name, (module_name, help_text) in CHAPTER_BENCHMARKS.items():
            module = importlib.import_module(f"minisparse.bench.{module_name}")
            p = bench.add_parser(name, help=help_text, parents=[common])
            module.add_arguments(p)
            p.set_defaults(func=module.run)
    return parser


#: Options that name a file a command writes its results to (a bool --json prints instead).
RESULT_FILE_OPTIONS = ("json", "record")


def check_result_files(args: argparse.Namespace) -> None:
    """A results file that cannot be written is an error before the run, not after it."""
    for name in RESULT_FILE_OPTIONS:
        value = getattr(args, name, None)
        if isinstance(value, (str, Path)):
            check_output_path(value, f"--{name}")


def main(argv: list[str] | None = None) -> int:
    """Run the command line; 0 on success, 2 for a user error (one line on stderr).

    Any other exception propagates with its full traceback: it is a bug to report.
    """
    words = sys.argv[1:] if argv is None else argv
    args = build_parser(with_chapter_benchmarks="bench" in words).parse_args(argv)
    args.argv = words
    try:
        check_result_files(args)
        return int(args.func(args) or 0)
    except USER_ERRORS as err:
        if args.debug:
            raise
        hint = "; check the path and its permissions" if isinstance(err, OSError) else ""
        print(f"error: {err}{hint}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
