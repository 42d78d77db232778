"""Benchmark: greedy decoding with float32, bfloat16, int8 and int4 weights, side by side.

``minisparse bench quant`` (or ``python -m minisparse.bench.quant``) builds the variants from
one model, decodes the same prompt with each in turn within every repeat (warm-up first, median
of repeats; ``minisparse.measure.timing``'s rules), and prints per variant: tokens/s and the
ratio to float32, the bytes a decode step streams and their ratio, the bandwidth roofline, and
whether the greedy tokens equal float32's.

Fewer bytes are an upper bound on the gain, not a prediction. To see where the rest goes it
then calls every linear layer once, in decode order, with one token (``linear_times``): the
linear layers' share of a step, the time of each layer shape in each format, and what is left
(attention over the KV cache, norms, RoPE, the Python loop), which the weights' format does not
touch.

Every variant decodes as torch modules (``generate(compiled=False)``), so that a step splits
into the swept linear layers and the rest; ``generate``'s default compiled step
(``minisparse.runtime``) runs float32, int8 and int4 faster still (``minisparse bench decode``,
notebook 00). Variants: ``fp32`` (the loaded model: torch's GEMV on ``nn.Linear`` weights),
``bf16`` (all weights and activations in bfloat16; torch's GEMV), ``int8`` (weight-only, one
scale per output channel, ``_weight_int8pack_mm``), ``int4`` (weight-only, groups of
``--group-size``, ``_weight_int4pack_mm_for_cpu``). The quantized ones keep float32 activations
between layers and convert to bfloat16 inside each linear layer, the kernels' input type.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..core.model import Transformer, check_count, use_output_major_weights
from ..measure.machine import machine, machine_bandwidth
from ..measure.timing import DECODE_PROMPT, interleaved_medians, paired_ratios, roofline_seconds
from ..quant.apply import QuantSpec, quantize_model, streamed_bytes
from ..quant.formats import WEIGHT_FORMATS, low_bit
from .decode import bench_decode_models
from .results import result, write_result

__all__ = [
    "PROMPT",
    "VARIANTS",
    "LinearTimes",
    "QuantSpeedRow",
    "add_arguments",
    "bench_quant",
    "check_arguments",
    "format_linear",
    "format_rows",
    "is_linear_layer",
    "linear_shapes",
    "linear_times",
    "main",
    "make_variants",
    "run",
]

VARIANTS = ("fp32", "bf16", *(n for n, f in WEIGHT_FORMATS.items() if f.bits is not None))
PROMPT = DECODE_PROMPT


def make_variants(
    model: Transformer,
    names: tuple[str, ...] = VARIANTS,
    group_size: int | None = 128,
    progress: bool = False,
) -> dict[str, Transformer]:
    """The models to compare, by name; ``fp32`` is ``model`` itself (not copied)."""
    unknown = set(names) - set(VARIANTS)
    if unknown:
        raise ValueError(f"Unknown variants {sorted(unknown)}; choose from {VARIANTS}.")
    variants: dict[str, Transformer] = {}
    for name in names:
        if name == "fp32":
            variants[name] = model
        elif name == "bf16":  # torch's bfloat16 GEMV reads output-major rows faster
            variants[name] = use_output_major_weights(copy.deepcopy(model)).to(torch.bfloat16)
        elif WEIGHT_FORMATS[name].act_int8:  # its blocks of 32 are what its C kernel reads
            variants[name] = low_bit(model, name)
        else:  # a weight format; ``group_size`` for those with groups (int4)
            fmt = WEIGHT_FORMATS[name]
            group = None if fmt.group_size is None else group_size
            variants[name] = quantize_model(
                model, bits=fmt.bits, group_size=group, packed=True, progress=progress
            )
    return variants


def linear_shapes(model: Transformer) -> Counter[str]:
    """How often a decode step calls each linear layer (by its path in layer 0), per token."""
    names = [n for n, m in model.layers[0].named_modules() if is_linear_layer(m)]
    calls = Counter({f"layers.0.{n}": model.config.n_layers for n in names})
    calls["lm_head"] = 1
    return calls


def is_linear_layer(module: nn.Module) -> bool:
    """A module that computes y = x W^T: nn.Linear or a packed int8/int4 layer."""
    return isinstance(module, nn.Linear) or hasattr(module, "out_features")


@dataclass
class LinearTimes:
    """Time in the linear layers of one decode step, measured by calling them all in order."""

    per_token: float  # seconds in the calls of every linear layer once (decode order), median
    per_call: dict[str, float]  # seconds of one call of each layer of layer 0's shapes


@torch.inference_mode()
def linear_times(
    variants: dict[str, Transformer], repeats: int = 20, warmup: int = 3
) -> dict[str, LinearTimes]:
    """Single-token calls of every linear layer of each variant, in decode order.

    Calling one small layer again and again would time it from the cache; sweeping through all
    layers, as a decode step does, makes each call read its weights from memory (a model of
    75-540 MB does not fit the CPU's caches). Each call is timed on its own, the variants'
    sweeps interleaved (``interleaved_medians``); a token's linear time is the sum of a
    sweep's calls.
    """
    calls = linear_shapes(next(iter(variants.values())))
    paths = [p.removeprefix("layers.0.") for p in calls if p != "lm_head"]
    record: dict[str, dict[str, list[float]]] = {n: {p: [] for p in calls} for n in variants}

    def sweep(name: str, model: Transformer) -> Callable[[], None]:
        x = {
            n: torch.randn(1, 1, n, dtype=model.dtype, device=model.device)
            for n in {model.get_submodule(p).in_features for p in calls}
        }
        order = [(f"layers.0.{p}", layer.get_submodule(p)) for layer in model.layers for p in paths]
        order.append(("lm_head", model.lm_head))

        def run() -> None:
            totals = dict.fromkeys(calls, 0.0)
            for path, module in order:
                t0 = time.perf_counter()
                module(x[module.in_features])
                totals[path] += time.perf_counter() - t0
            for path, t in totals.items():
                record[name][path].append(t)

        return run

    fns = {name: sweep(name, model) for name, model in variants.items()}
    interleaved_medians(fns, repeats=repeats, warmup=warmup)
    out = {}
    for name in variants:
        columns = zip(*record[name].values(), strict=True)
        sweeps = [dict(zip(record[name], ts, strict=True)) for ts in columns][warmup:]
        out[name] = LinearTimes(
            per_token=statistics.median(sum(s.values()) for s in sweeps),
            per_call={p: statistics.median(s[p] for s in sweeps) / calls[p] for p in calls},
        )
    return out


@dataclass
class QuantSpeedRow:
    """One variant's decode speed, bytes and where its time goes."""

    variant: str
    tok_s: float
    speedup: float  # tokens/s over float32's
    streamed_mb: float  # per decode step
    bytes_ratio: float  # float32's bytes over this variant's: the most fewer bytes can give
    roofline_tok_s: float  # streamed bytes at the measured read bandwidth
    step_ms: float
    linear_ms: float  # every linear layer once, swept in decode order
    other_ms: float  # the rest of the step
    same_tokens: bool  # the same greedy tokens as float32
    rounds: list[float] = field(default_factory=list)  # seconds per token, one per repeat

    def round_speedups(self, reference: QuantSpeedRow) -> list[float]:
        """Reference / own seconds per token, one per repeat: the variants decoded in turn
        within each repeat, so a pair shares the machine's state of that moment."""
        return paired_ratios(reference.rounds, self.rounds)


def bench_quant(
    model: Transformer,
    tokenizer: Any,
    prompt: Any = PROMPT,
    names: tuple[str, ...] = VARIANTS,
    group_size: int | None = 128,
    max_new_tokens: int = 64,
    repeats: int = 5,
    warmup: int = 1,
    linear_repeats: int = 20,
    progress: bool = True,
) -> tuple[list[QuantSpeedRow], dict[str, LinearTimes]]:
    """Decode speed of each variant against float32, and the linear layers' times behind it."""
    names = tuple(dict.fromkeys(("fp32", *names)))
    variants = make_variants(model, names, group_size)
    speeds = bench_decode_models(
        variants, tokenizer, prompt, max_new_tokens, repeats, warmup, progress, compiled=False
    )
    linear = linear_times(variants, repeats=linear_repeats)
    bandwidth = machine_bandwidth()  # measured once per machine, as every chapter prints it
    base_bytes = streamed_bytes(model)
    rows = []
    for name, variant in variants.items():
        nbytes = streamed_bytes(variant)
        step = 1.0 / speeds[name].tok_s
        rows.append(
            QuantSpeedRow(
                variant=name,
                tok_s=speeds[name].tok_s,
                speedup=speeds[name].tok_s / speeds["fp32"].tok_s,
                streamed_mb=nbytes / 1e6,
                bytes_ratio=base_bytes / nbytes,
                roofline_tok_s=1.0 / roofline_seconds(nbytes, bandwidth),
                step_ms=step * 1e3,
                linear_ms=linear[name].per_token * 1e3,
                other_ms=(step - linear[name].per_token) * 1e3,
                same_tokens=speeds[name].tokens == speeds["fp32"].tokens,
                rounds=list(speeds[name].rounds),
            )
        )
    return rows, linear


def format_rows(rows: list[QuantSpeedRow]) -> str:
    head = (
        f"{'variant':<8}{'tok/s':>7}{'vs fp32':>9}{'MB/token':>10}{'bytes':>7}{'roofline':>10}"
        f"{'step ms':>9}{'linear':>8}{'other':>7}  same tokens"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.variant:<8}{r.tok_s:>7.1f}{r.speedup:>8.2f}x{r.streamed_mb:>10.1f}"
            f"{r.bytes_ratio:>6.1f}x{r.roofline_tok_s:>10.0f}{r.step_ms:>9.1f}{r.linear_ms:>8.1f}"
            f"{r.other_ms:>7.1f}  {r.same_tokens}"
        )
    return "\n".join(lines)


def format_linear(linear: dict[str, LinearTimes], model: Transformer) -> str:
    """Microseconds per single-token call, by layer shape and format."""
    names = list(linear)
    head = f"{'layer (out x in)':<34}" + "".join(f"{n:>9}" for n in names)
    lines = [head + "   (us per call, all layers swept)", "-" * len(head)]
    for path in linear[names[0]].per_call:
        layer = model.get_submodule(path)
        label = f"{path.removeprefix('layers.0.')} ({layer.out_features}x{layer.in_features})"
        cells = "".join(f"{linear[n].per_call[path] * 1e6:>9.0f}" for n in names)
        lines.append(f"{label:<34}{cells}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="model to quantize (as for load)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--group-size", type=int, default=128, help="int4 group size")
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--linear-repeats", type=int, default=20, help="sweeps of the layers")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse bad settings before the model loads (one ValueError naming the option)."""
    if not args.prompt.strip():
        raise ValueError("--prompt is empty; give some text to decode after.")
    check_count(args.max_new_tokens, "--max-new-tokens")
    check_count(args.repeats, "--repeats", fix="the benchmark reports the median of the repeats")
    check_count(args.warmup, "--warmup", minimum=0)
    check_count(args.linear_repeats, "--linear-repeats")
    QuantSpec(bits=4, group_size=args.group_size)  # the same check the int4 layers make


def run(args: argparse.Namespace) -> int:
    from ..io.loading import load

    check_arguments(args)
    about = machine()
    print(about.line(), flush=True)
    model, tokenizer = load(args.model, device="cpu")
    print(
        f"prompt: {args.prompt!r}, {args.max_new_tokens} new tokens, greedy, batch 1, "
        f"{torch.get_num_threads()} threads, median of {args.repeats} after warm-up; "
        f"int4 in groups of {args.group_size}"
    )
    rows, linear = bench_quant(
        model,
        tokenizer,
        args.prompt,
        tuple(args.variants),
        args.group_size,
        args.max_new_tokens,
        args.repeats,
        args.warmup,
        args.linear_repeats,
    )
    print(format_rows(rows))
    print()
    print(format_linear(linear, model))
    per_call = {n: t.per_call for n, t in linear.items()}
    payload = result(args, about, threads=torch.get_num_threads(), rows=[asdict(r) for r in rows])
    write_result(args, payload | {"linear_seconds_per_call": per_call})
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m minisparse.bench.quant", description=__doc__.split("\n")[0]
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
