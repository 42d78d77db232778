"""Benchmark: the decode step compiled for each instruction-set target, side by side.

``minisparse bench isa`` compiles ``runtime/step.c`` for every target this CPU runs (the host's
own ``-march=native``, ``x86-64-v3`` = AVX2 + FMA, ``x86-64-v2`` = SSE4.2) and decodes the same
prompt greedily with each build, the builds alternating within every repeat (median of
repeats, warm-up first), for float32, int8 and 4-bit weights. Each row prints tokens/s, the
ratio to the native build, the weight bytes one step reads and the rate they stream at, and
whether the tokens are those of the native build. It is the check behind ``cpu_isa``'s
automatic choice: on every CPU the chosen build should be the fastest row, within noise.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..measure.machine import machine
from ..measure.timing import interleaved_decode
from ..quant.formats import WEIGHT_FORMATS
from .decode import PROMPT, check_decode_arguments
from .results import result, write_result

__all__ = ["IsaRow", "add_arguments", "bench_isa", "main", "run"]


@dataclass
class IsaRow:
    """One build's decode speed at one weight format, beside the native build's."""

    weights: str
    target: str
    tok_s: float
    vs_native: float
    mb_per_token: float  # weight bytes one decode step reads
    same_tokens_as_native: bool
    chosen: bool  # the build the library uses (cpu_isa's choice)

    @property
    def gb_s(self) -> float:
        """The rate the step's weights stream at."""
        return self.mb_per_token * self.tok_s / 1e3


def bench_isa(
    model: torch.nn.Module,
    prompt_ids: list[int],
    weights: tuple[str, ...] | None = None,
    max_new_tokens: int = 32,
    repeats: int = 5,
    progress: bool = True,
    variants: dict[str, torch.nn.Module] | None = None,
) -> list[IsaRow]:
    """Greedy decode tokens/s of every target's build of the decode step, per weight format
    (the native build first in each format); ``variants`` (name -> model, e.g. chapter 12's
    2:4 models) replaces the weight formats when given."""
    weights = tuple(WEIGHT_FORMATS) if weights is None else weights
    from ..kernels.cpu_build import build_choice, build_for, find_compiler, resolve_compiler
    from ..kernels.cpu_isa import available_targets
    from ..quant.formats import low_bit
    from ..runtime.step import SOURCE, declare_step_library
    from ..sparse.traffic import step_bytes
    from .sparse_steps import greedy_steps

    compiler = resolve_compiler(find_compiler() or "")
    choice = build_choice()
    if compiler is None or choice is None:
        raise RuntimeError("bench isa compiles the decode step: install gcc or clang (or set CC).")
    libs = {}
    for target in available_targets():
        try:
            libs[target] = build_for(compiler, SOURCE, target, declare_step_library)
        except (RuntimeError, OSError, AttributeError) as err:  # e.g. an older compiler
            if target == "native":
                raise
            print(f"{target}: not built ({str(err).splitlines()[0][:120]}); left out")
    rows = []
    if variants is None:
        variants = {kind: model if kind == "fp32" else low_bit(model, kind) for kind in weights}
    for kind, m in variants.items():
        runs, firsts = {}, {}
        for target, lib in libs.items():
            firsts[target], runs[target] = greedy_steps(m, prompt_ids, max_new_tokens, lib)
        speeds = interleaved_decode(runs, repeats, 1, progress)
        mb = step_bytes(m) / 1e6
        native = speeds["native"]
        for target, s in speeds.items():
            same = [firsts[target], *s.tokens] == [firsts["native"], *native.tokens]
            ratio = s.tok_s / native.tok_s
            rows.append(IsaRow(kind, target, s.tok_s, ratio, mb, same, target == choice.target))
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``minisparse bench isa``."""
    parser.add_argument("--model", default="smollm2-135m", help="short name, directory or .gguf")
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    formats = list(WEIGHT_FORMATS)
    parser.add_argument("--weights", nargs="+", choices=formats, default=formats)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")


def run(args: argparse.Namespace) -> int:
    """Print the table; 1 when a build's tokens differ from the native build's."""
    from ..core.sampling import encode_prompt
    from ..io.loading import load

    check_decode_arguments(args)
    about = machine()
    print(about.line(), flush=True)
    model, tokenizer = load(args.model, device="cpu")
    ids = encode_prompt(tokenizer, args.prompt)
    print(
        f"{args.max_new_tokens} greedy decode steps after a {len(ids)}-token prompt, batch 1, "
        f"{torch.get_num_threads()} threads, builds alternating, median of {args.repeats}"
    )
    rows = bench_isa(model, ids, tuple(args.weights), args.max_new_tokens, args.repeats)
    print(f"{'weights':7s} {'build':12s} {'tok/s':>7s} {'vs native':>9s} {'MB/token':>8s} "
          f"{'GB/s':>6s}  same tokens")  # fmt: skip
    for r in rows:
        mark = "  <- chosen" if r.chosen else ""
        print(
            f"{r.weights:7s} {r.target:12s} {r.tok_s:7.1f} {r.vs_native:8.2f}x "
            f"{r.mb_per_token:8.1f} {r.gb_s:6.1f}  {r.same_tokens_as_native}{mark}",
            flush=True,
        )
    write_result(args, result(args, about, rows=[asdict(r) | {"gb_s": r.gb_s} for r in rows]))
    return 0 if all(r.same_tokens_as_native for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m minisparse.bench.isa", description=__doc__.split("\n")[0]
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
