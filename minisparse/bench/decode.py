"""Benchmark: greedy decode speed of variants side by side (minisparse, transformers, llama.cpp).

The variants: minisparse against transformers (``bench_decode``) and llama.cpp
(``llama_cpp_decode``), a model with dense against sparse MLPs (``bench_decode_sparse``,
chapter 07), or any set of minisparse models (``bench_decode_models``).

``minisparse bench decode`` (or ``python -m minisparse.bench.decode``) decodes one prompt with
minisparse's three decode paths (the default compiled step, torch modules with ``F.linear``,
torch modules with chapter 07's streaming GEMV), each against transformers' own ``generate`` on
the same checkpoint, and reports tokens/s, the ratio and whether the greedy tokens are the same;
then llama.cpp on the model's GGUF file when ``llama-cpp-python`` is installed.

Every speed here times the whole ``generate`` call, prompt included, per new token, with
``minisparse.measure.timing``'s rules: the variants alternate within each repeat, warm-up first,
the median over the repeats of seconds per token.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..commands.common import add_model_arguments
from ..core.model import check_count
from ..measure.machine import machine
from ..measure.timing import DECODE_PROMPT, ModelSpeed, interleaved_decode, paired_ratios
from ..quant.formats import WEIGHT_FORMATS
from .llama_compare import LlamaCppResult, llama_cpp_decode, print_llama_cpp_row
from .results import result, write_result

__all__ = [
    "PROMPT",
    "DecodeResult",
    "DecodeSpeed",
    "LlamaCppResult",
    "add_arguments",
    "bench_decode",
    "bench_decode_models",
    "bench_decode_sparse",
    "check_decode_arguments",
    "hf_greedy",
    "llama_cpp_decode",
    "main",
    "print_llama_cpp_row",
    "run",
]

PROMPT = DECODE_PROMPT


@dataclass
class DecodeResult:
    """Side-by-side greedy decode speed of minisparse and transformers on one prompt."""

    new_tokens: int
    minisparse_tok_s: float
    transformers_tok_s: float
    same_tokens: bool

    @property
    def speedup(self) -> float:
        return self.minisparse_tok_s / self.transformers_tok_s


def hf_greedy(
    hf_model: torch.nn.Module, ids: list[int], max_new_tokens: int, eos_ids: list[int]
) -> list[int]:
    """Greedy tokens from transformers' ``generate`` (the reference decode loop)."""
    x = torch.tensor([ids], device=next(hf_model.parameters()).device)
    out = hf_model.generate(
        x,
        attention_mask=torch.ones_like(x),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos_ids or None,
        pad_token_id=eos_ids[0] if eos_ids else 0,
    )
    return out[0, len(ids) :].tolist()


def bench_decode(
    model: torch.nn.Module,
    tokenizer: Any,
    hf_model: torch.nn.Module,
    prompt: str,
    max_new_tokens: int = 64,
    repeats: int = 5,
    warmup: int = 1,
    progress: bool = True,
    compiled: bool = True,
) -> DecodeResult:
    """Greedy decode tokens/s of minisparse vs transformers, interleaved, median of repeats.

    The two loops alternate within each repeat so that machine noise hits both alike.
    ``compiled`` picks minisparse's decode steps (``generate(compiled=...)``).
    """
    from ..core.sampling import encode_prompt, stop_ids
    from ..runtime.generate import generate

    ids = encode_prompt(tokenizer, prompt)
    eos = sorted(stop_ids(model, tokenizer))

    def theirs() -> list[int]:
        with torch.inference_mode():
            return hf_greedy(hf_model, ids, max_new_tokens, eos)

    runs = {
        "minisparse": lambda: generate(
            model, tokenizer, ids, max_new_tokens=max_new_tokens, compiled=compiled
        ),
        "transformers": theirs,
    }
    speeds = interleaved_decode(runs, repeats, warmup, progress)
    ours, hf = speeds["minisparse"], speeds["transformers"]
    return DecodeResult(
        new_tokens=len(ours.tokens),
        minisparse_tok_s=ours.tok_s,
        transformers_tok_s=hf.tok_s,
        same_tokens=ours.tokens == hf.tokens,
    )


def bench_decode_models(
    models: dict[str, torch.nn.Module],
    tokenizer: Any,
    prompt: Any,
    max_new_tokens: int = 64,
    repeats: int = 5,
    warmup: int = 1,
    progress: bool = True,
    compiled: bool = True,
) -> dict[str, ModelSpeed]:
    """Greedy decode tokens/s of several minisparse models on one prompt, side by side
    (``compiled``: ``generate``'s decode steps)."""
    from ..core.sampling import encode_prompt
    from ..runtime.generate import generate

    ids = encode_prompt(tokenizer, prompt)
    runs = {
        name: functools.partial(
            generate, m, tokenizer, ids, max_new_tokens=max_new_tokens, compiled=compiled
        )
        for name, m in models.items()
    }
    return interleaved_decode(runs, repeats, warmup, progress)


@dataclass
class DecodeSpeed:
    """Greedy decode speed of one model with dense and with sparse MLPs, side by side."""

    new_tokens: int
    dense_tok_s: float
    sparse_tok_s: float
    mean_density: float  # fraction of neurons the sparse MLPs read per decode step
    same_tokens: bool
    dense_rounds: list[float] = field(default_factory=list)  # seconds per token, one per round
    sparse_rounds: list[float] = field(default_factory=list)

    @property
    def speedup(self) -> float:
        return self.sparse_tok_s / self.dense_tok_s

    def round_speedups(self) -> list[float]:
        """Dense / sparse seconds per token, one value per round (the two ran back to back)."""
        return paired_ratios(self.dense_rounds, self.sparse_rounds)


def bench_decode_sparse(
    model: torch.nn.Module,
    tokenizer: object,
    prompt: str,
    sparse: list[torch.nn.Module],
    max_new_tokens: int = 32,
    repeats: int = 3,
    warmup: int = 1,
) -> DecodeSpeed:
    """Tokens/s of greedy decoding with the model's dense MLPs and with ``sparse`` MLPs.

    The two runs alternate within each repeat (median of repeats, after warm-up). Each run
    times the whole ``generate`` call, prompt included, per new token; the sparse run uses the
    sparse MLPs for the prompt too. ``mean_density`` is the fraction of neurons read at the last
    decode step of a run (mean over layers), averaged over the runs.
    """
    from ..runtime.generate import generate
    from ..sparse.swap import mean_density, swap_mlps

    dense = [layer.mlp for layer in model.layers]
    densities = []

    def decode_with(mlps: list[torch.nn.Module]) -> Callable[[], list[int]]:
        def run() -> list[int]:
            swap_mlps(model, mlps)
            with torch.inference_mode():
                out = generate(model, tokenizer, prompt, max_new_tokens=max_new_tokens)
            if mlps is sparse:
                densities.append(mean_density(sparse))
            return out

        return run

    runs = {"dense": decode_with(dense), "sparse": decode_with(sparse)}
    try:
        speeds = interleaved_decode(runs, repeats, warmup, progress=False)
    finally:
        swap_mlps(model, dense)
    return DecodeSpeed(
        new_tokens=len(speeds["dense"].tokens),
        dense_tok_s=speeds["dense"].tok_s,
        sparse_tok_s=speeds["sparse"].tok_s,
        mean_density=statistics.mean(densities),
        same_tokens=speeds["dense"].tokens == speeds["sparse"].tokens,
        dense_rounds=list(speeds["dense"].rounds),
        sparse_rounds=list(speeds["sparse"].rounds),
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``minisparse bench decode``."""
    add_model_arguments(parser)
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--weights",
        choices=tuple(WEIGHT_FORMATS),
        default="fp32",
        help="our weights in the llama.cpp comparison (int8: beside a q8_0 GGUF file; int4, "
        "groups of 32 with a scale and zero each: beside a Q4_1 file such as the shipped one)",
    )
    parser.add_argument(
        "--gguf",
        type=Path,
        default=None,
        help="the GGUF file llama.cpp decodes (default: the model's own file); make a "
        "like-for-like one with minisparse export OUT.gguf --format gguf --dtype f32|q8_0|q4_1",
    )
    parser.add_argument(
        "--no-transformers",
        action="store_true",
        help="only the llama.cpp comparison (skip the three rows against transformers)",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument(
        "--record",
        type=Path,
        default=None,
        help="also add the run to this file of runs (e.g. data/11_decode_vs_llama_cpp.json), "
        "in place of an earlier run on the same kind of CPU at the same --weights",
    )


def check_decode_arguments(args: argparse.Namespace) -> None:
    """--prompt, --max-new-tokens and --repeats checked before a model loads."""
    if not args.prompt.strip():
        raise ValueError("--prompt is empty; give some text to decode after.")
    check_count(args.max_new_tokens, "--max-new-tokens")
    check_count(args.repeats, "--repeats", fix="the benchmark reports the median of the repeats")


def run(args: argparse.Namespace) -> int:
    """minisparse's decode paths against transformers (and llama.cpp); 1 if tokens differ."""
    from ..io.loading import load, resolve_device

    check_decode_arguments(args)
    resolve_device(args.device)
    about = machine()
    print(about.line(), flush=True)
    model, tokenizer = load(args.model, device=args.device)
    print(
        f"prompt: {args.prompt!r}, {args.max_new_tokens} new tokens, greedy, batch 1, "
        f"{torch.get_num_threads()} threads, median of {args.repeats} after warm-up"
    )
    llama_cpp = print_llama_cpp_row(args, model, tokenizer)  # before the variants change model
    rows = {} if args.no_transformers else transformers_rows(args, model, tokenizer)
    compared = None
    if llama_cpp is not None:
        extra = {"ratio": llama_cpp.ratio, "ratio_per_byte": llama_cpp.ratio_per_byte}
        compared = asdict(llama_cpp) | extra | {"same": llama_cpp.same_tokens}
    payload = result(args, about, rows=rows, weights=args.weights, llama_cpp=compared)
    write_result(args, payload)
    if args.record is not None:
        record_run(args.record, payload)
        print(f"recorded the run in {args.record}")
    return 0 if all(r["same_tokens"] for r in rows.values()) else 1


def cpu_kind(run: dict[str, Any]) -> tuple[str, str]:
    """What makes two runs' machines the same kind: the CPU's name and its vector ISA."""
    return run["machine"]["cpu"], run["machine"]["vector_isa"]


def record_run(path: Path, payload: dict[str, Any]) -> None:
    """Add ``payload`` to the runs file at ``path`` (``{"about": ..., "runs": [...]}``) in place
    of a run on the same kind of CPU at the same weights; written atomically."""
    from ..files.cache import atomic_write_text

    data = json.loads(path.read_text()) if path.exists() else {"about": "", "runs": []}
    key = (cpu_kind(payload), payload["weights"])
    data["runs"] = [r for r in data["runs"] if (cpu_kind(r), r["weights"]) != key] + [payload]
    data["runs"].sort(key=lambda r: (cpu_kind(r), list(WEIGHT_FORMATS).index(r["weights"])))
    atomic_write_text(path, json.dumps(data, indent=1) + "\n")


def transformers_rows(
    args: argparse.Namespace, model: Any, tokenizer: Any
) -> dict[str, dict[str, Any]]:
    """minisparse's three decode paths, each beside transformers' ``generate``, printed."""
    from ..core.model import use_streaming_gemv
    from ..io.loading import load_hf_reference

    print("loading transformers' own model for the same checkpoint ...", flush=True)
    hf_model, _ = load_hf_reference(args.model)
    hf_model = hf_model.to(model.device).eval()
    variants = {  # name: (set the model up, compiled decode steps)
        "minisparse (default: compiled step)": (lambda m: m, True),
        "minisparse (torch modules, F.linear)": (lambda m: m, False),
        "minisparse (torch modules, streaming)": (use_streaming_gemv, False),
    }
    rows = {}
    for name, (setup, compiled) in variants.items():
        r = bench_decode(
            setup(model), tokenizer, hf_model, args.prompt, args.max_new_tokens, args.repeats,
            compiled=compiled,
        )  # fmt: skip
        rows[name] = asdict(r)
        print(
            f"{name:38s} {r.minisparse_tok_s:6.1f} tok/s | transformers "
            f"{r.transformers_tok_s:6.1f} tok/s | ratio {r.speedup:.2f}x | "
            f"same tokens: {r.same_tokens}",
            flush=True,
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m minisparse.bench.decode", description=__doc__.split("\n")[0]
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
