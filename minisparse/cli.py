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

from .commands import export, predictors, relufy
from .commands.common import add_model_arguments
from .core.checks import check_output_path
from .core.model import check_count
from .core.sampling import check_messages, check_sampling, check_seed
from .course import prepare
from .io.loading import ModelLoadError, resolve_device
from .offload import report as offload_report

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
    from .core.sampling import check_length, check_prompt_ids, encode_prompt
    from .io.loading import load
    from .runtime.generate import generate

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

    for name, module, help_text in (
        ("relufy", relufy, "ReLUfy the model and fine-tune it by distillation"),
        ("predictors", predictors, "train per-layer sparsity predictors and save them"),
    ):
        p = sub.add_parser(name, help=help_text, parents=[common])
        module.add_arguments(p)
        p.set_defaults(func=module.run)
    importlib.import_module("minisparse.peft.recover").add_command(sub, common)
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
