"""Benchmark: decode speed of 2:4 pruned models in the compiled step, beside their byte ceiling.

``minisparse bench nm-decode`` (or ``bench_nm_decode`` from a notebook) decodes one prompt with
each variant of one model, side by side (``timing.interleaved_decode_steps``: the variants in
turn within every round, warm-up first, the median of the rounds; the prompt's prefill taken
out), through the compiled decode step (``minisparse.runtime``):

* ``dense fp32``: the model as loaded;
* ``2:4 mlp fp32``: gate, up and down of every block as ``NMLinear`` (float32 kept values);
* ``2:4 all fp32``: the seven projections of every block as ``NMLinear``;
* ``2:4 mlp int8``: the MLP's kept values as int8 codes with a scale per row;
* ``dense int8``: weight-only int8 everywhere (chapter 09's ``Int8Linear``, also in C).

Speed does not depend on which weights are kept, so the pruned variants keep the 2 largest
|w| of every 4 inputs (``masks.nm_mask(w.abs(), 2, 4)``); their text is not the dense model's.
Each row shows the bytes a decode step reads (``quant.apply.streamed_bytes``), the ceiling
those bytes allow at the machine's measured read bandwidth
(``measure.machine.machine_bandwidth``; tokens/s ≤ bandwidth / bytes per token), the measured
tokens/s, its ratio to that ceiling and its speedup over dense float32.
"""

from __future__ import annotations

import argparse
import copy
import sys
from dataclasses import dataclass
from typing import Any

import torch

from ..core.model import Transformer, check_count
from ..measure.machine import machine, machine_bandwidth
from ..measure.timing import DECODE_PROMPT, interleaved_decode_steps, roofline_seconds
from ..pruning.masks import nm_mask
from ..pruning.nm_linear import NM_TARGETS, to_nm_
from ..quant.apply import quantize_model, streamed_bytes

__all__ = [
    "NM_VARIANTS",
    "PROMPT",
    "NMDecodeRow",
    "add_arguments",
    "bench_nm_decode",
    "format_nm_rows",
    "magnitude_2_4_",
    "main",
    "nm_variants",
    "run",
]

PROMPT = DECODE_PROMPT
NM_VARIANTS = ("dense fp32", "2:4 mlp fp32", "2:4 all fp32", "2:4 mlp int8", "dense int8")


def magnitude_2_4_(model: Transformer, targets: str = "mlp") -> Transformer:
    """Zero all but the 2 largest |w| of every 4 inputs in the ``targets`` projections (in
    place; ``NM_TARGETS``); returns ``model``."""
    with torch.no_grad():
        for layer in model.layers:
            for path in NM_TARGETS[targets]:
                w = layer.get_submodule(path).weight
                w.mul_(nm_mask(w.abs(), 2, 4))
    return model


def nm_variants(model: Transformer, names: tuple[str, ...] = NM_VARIANTS) -> dict[str, Transformer]:
    """The models to compare, by name; ``dense fp32`` is ``model`` itself (not copied)."""
    unknown = set(names) - set(NM_VARIANTS)
    if unknown:
        raise ValueError(f"Unknown variants {sorted(unknown)}; choose from {NM_VARIANTS}.")
    out: dict[str, Transformer] = {}
    for name in names:
        if name == "dense fp32":
            out[name] = model
        elif name == "dense int8":
            out[name] = quantize_model(model, bits=8, progress=False, packed=True)
        else:
            _, targets, values = name.split()
            pruned = magnitude_2_4_(copy.deepcopy(model), targets)
            out[name] = to_nm_(pruned, targets, int8=values == "int8")
    return out


@dataclass
class NMDecodeRow:
    """One variant's decode speed beside the ceiling its bytes allow."""

    variant: str
    streamed_mb: float  # weight bytes a decode step reads, per token
    ceiling_tok_s: float  # read bandwidth / bytes per token
    tok_s: float  # measured (median of the rounds, prefill excluded)
    of_ceiling: float  # tok_s / ceiling_tok_s
    speedup: float  # tok_s over dense float32's


def bench_nm_decode(
    model: Transformer,
    tokenizer: Any,
    prompt: Any = PROMPT,
    tokens: int = 16,
    repeats: int = 3,
    warmup: int = 1,
    names: tuple[str, ...] = NM_VARIANTS,
    progress: bool = False,
) -> list[NMDecodeRow]:
    """Decode tokens/s of each variant (``NM_VARIANTS``) against its byte ceiling, side by side."""
    from ..runtime.generate import generate

    check_count(tokens, "tokens", minimum=2, fix="one token is the prefill's; decode at least 2")
    check_count(repeats, "repeats", fix="the benchmark reports the median of the repeats")
    names = tuple(dict.fromkeys(("dense fp32", *names)))
    variants = nm_variants(model, names)
    runs = {
        name: (lambda n, m=m: generate(m, tokenizer, prompt, max_new_tokens=n, stop_at_eos=False))
        for name, m in variants.items()
    }
    speeds, _ = interleaved_decode_steps(runs, tokens, repeats, warmup, progress)
    bandwidth = machine_bandwidth()
    rows = []
    for name, variant in variants.items():
        nbytes = streamed_bytes(variant)
        ceiling = 1.0 / roofline_seconds(nbytes, bandwidth)
        rows.append(
            NMDecodeRow(
                variant=name,
                streamed_mb=nbytes / 1e6,
                ceiling_tok_s=ceiling,
                tok_s=speeds[name].tok_s,
                of_ceiling=speeds[name].tok_s / ceiling,
                speedup=speeds[name].tok_s / speeds["dense fp32"].tok_s,
            )
        )
    return rows


def format_nm_rows(rows: list[NMDecodeRow]) -> str:
    head = (
        f"{'variant':<14}{'MB/token':>10}{'ceiling':>9}{'tok/s':>8}{'of ceiling':>12}"
        f"{'vs dense':>10}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.variant:<14}{r.streamed_mb:>10.1f}{r.ceiling_tok_s:>9.0f}{r.tok_s:>8.1f}"
            f"{r.of_ceiling:>12.2f}{r.speedup:>9.2f}x"
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="model to prune (as for load)")
    parser.add_argument("--variants", nargs="+", default=list(NM_VARIANTS), choices=NM_VARIANTS)
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--tokens", type=int, default=16, help="new tokens per timed run")
    parser.add_argument("--repeats", type=int, default=3)


def run(args: argparse.Namespace) -> int:
    from ..io.loading import load

    if not args.prompt.strip():
        raise ValueError("--prompt is empty; give some text to decode after.")
    check_count(args.tokens, "--tokens", minimum=2, fix="one token is the prefill's")
    check_count(args.repeats, "--repeats", fix="the benchmark reports the median of the repeats")
    print(machine().line(), flush=True)
    model, tokenizer = load(args.model, device="cpu")
    print(
        f"prompt: {args.prompt!r}, {args.tokens} new tokens, greedy, batch 1, compiled step, "
        f"{torch.get_num_threads()} threads, median of {args.repeats} after warm-up, prefill "
        "excluded; 2:4 by magnitude"
    )
    rows = bench_nm_decode(model, tokenizer, args.prompt, args.tokens, args.repeats,
                           names=tuple(args.variants), progress=True)  # fmt: skip
    print(format_nm_rows(rows))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m minisparse.bench.pruned", description=__doc__.split("\n")[0]
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
