"""``minisparse export OUT [--format hf|gguf]``: the model (chapter 04's ReLU model with
``--relu``) as a transformers checkpoint or a llama.cpp GGUF file, with a predictors file
beside it (``--predictors``). The writing is ``minisparse.io.export``'s; this module reads the
command's arguments, checks them before any work, loads what they name and calls it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..core.checks import check_output_path
from ..io.export import GGUF_DTYPES, export_gguf, export_hf, save_sidecars
from ..io.export_checks import check_export_folder, check_writable_folder
from ..io.loading import embedded_gguf_path, load

__all__ = ["add_arguments", "check_arguments", "run"]


def add_arguments(parser: Any) -> None:
    parser.add_argument("out", help="a directory (--format hf) or a .gguf file (--format gguf)")
    parser.add_argument("--format", default="hf", choices=("hf", "gguf"))
    parser.add_argument("--dtype", default=None, help=f"GGUF only: {', '.join(GGUF_DTYPES)}")
    parser.add_argument("--model", default="smollm2-135m", help="as for the other commands")
    parser.add_argument(
        "--relu", action="store_true", help="export chapter 04's fine-tuned ReLU model (stage 1)"
    )
    parser.add_argument("--predictors", default=None, help="a predictors file to ship beside")


def check_arguments(args: Any) -> None:
    if args.format == "hf" and args.dtype is not None:
        raise ValueError("--dtype applies to --format gguf only (hf keeps the model's dtype).")
    if args.format == "gguf":
        args.dtype = "f32" if args.dtype is None else args.dtype
        if args.dtype not in GGUF_DTYPES:
            raise ValueError(
                f"--dtype must be one of {', '.join(GGUF_DTYPES)}, got {args.dtype!r}."
            )
        if not args.out.endswith(".gguf"):
            raise ValueError(
                f"--format gguf writes one file: give a name ending in .gguf, not {args.out!r}."
            )
        if args.relu:
            raise ValueError(
                "llama.cpp's Llama graph has SiLU MLPs only: export --relu with --format hf."
            )
    out = Path(args.out).expanduser()
    if args.format == "hf":  # written as a folder beside OUT, then renamed: OUT's parent counts
        check_export_folder(out)
        check_output_path(out.parent / f"{out.name}.tmp", "OUT")
    else:
        check_output_path(out, "OUT")
    check_writable_folder(out)
    if args.predictors is not None and not Path(args.predictors).is_file():
        raise FileNotFoundError(
            f"No predictors file at {args.predictors}; train them with `minisparse predictors`."
        )


def run(args: Any) -> int:
    check_arguments(args)
    model, tokenizer = load(args.model, device="cpu")
    if args.relu:  # the technique packages load only when asked for (a quick CLI start)
        from ..relufy.recipe import load_relufied

        model, _ = load_relufied(model, 1)
    sidecars = {}
    if args.predictors is not None:  # read (and checked against the model) before any write
        from ..predictors import Predictors

        sidecars["predictors"] = Predictors.load(args.predictors, model)
    if args.format == "hf":
        out = export_hf(model, args.out, tokenizer, sidecars)
    else:
        source = embedded_gguf_path() if args.model == "smollm2-135m" else None
        source = Path(args.model) if args.model.endswith(".gguf") else source
        out = export_gguf(model, args.out, args.dtype, tokenizer_gguf=source)
        save_sidecars(out.parent, **sidecars, prefix=f"{out.stem}.")
    size = sum(p.stat().st_size for p in ([out] if out.is_file() else out.iterdir()))
    print(f"wrote {out} ({size / 1e6:.0f} MB)")
    return 0
