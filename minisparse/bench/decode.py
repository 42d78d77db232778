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
``minisparse.timing``'s rules: the variants alternate within each repeat, warm-up first,
the median over the repeats of seconds per token.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ..machine import machine
from ..model import check_count
from ..timing import ModelSpeed, interleaved_decode, interleaved_per_token

__all__ = [
    "PROMPT",
    "DecodeResult",
    "DecodeSpeed",
    "add_arguments",
    "bench_decode",
    "bench_decode_models",
    "bench_decode_sparse",
    "hf_greedy",
    "llama_cpp_decode",
    "llama_cpp_run",
    "main",
    "print_llama_cpp_row",
    "run",
]

PROMPT = "The Python language reference describes the syntax and"


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
    from ..generate import encode_prompt, generate, stop_ids

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
    from ..generate import encode_prompt, generate

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

    @property
    def speedup(self) -> float:
        return self.sparse_tok_s / self.dense_tok_s


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
    from ..generate import generate
    from ..sparse_mlp import mean_density, swap_mlps

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
    )


def llama_cpp_run(
    gguf: str | Path, prompt: str, max_new_tokens: int, threads: int | None = None
) -> Callable[[], int] | None:
    """A function that decodes ``prompt`` greedily with llama.cpp on ``gguf`` (a fresh context
    each call) and returns how many tokens it made; None without ``llama-cpp-python``."""
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    from llama_cpp import Llama

    llm = Llama(
        model_path=str(gguf),
        n_threads=threads or torch.get_num_threads(),
        n_ctx=max(512, 4 * max_new_tokens),
        verbose=False,
    )

    def run() -> int:
        llm.reset()
        out = llm(prompt, max_tokens=max_new_tokens, temperature=0.0, top_k=1)
        return out["usage"]["completion_tokens"]

    return run


def llama_cpp_decode(
    gguf: str | Path,
    prompt: str,
    max_new_tokens: int = 64,
    repeats: int = 5,
    threads: int | None = None,
    alongside: Callable[[], int] | None = None,
) -> float | tuple[float, float] | None:
    """Greedy decode tokens/s of llama.cpp on the same GGUF file, or None without it.

    llama.cpp comes from the optional ``llama-cpp-python`` package (never needed by the tests).
    Like ``bench_decode``, each run times the whole call, prompt included, per new token; the
    median of ``repeats`` runs after one warm-up. With ``alongside`` (a decode function that
    returns its token count, such as minisparse's own ``generate`` on the same prompt) the two
    alternate within every repeat and the result is (its tok/s, llama.cpp's tok/s): a ratio
    from one run, not from two runs minutes apart on a machine whose speed drifts.
    """
    run = llama_cpp_run(gguf, prompt, max_new_tokens, threads)
    if run is None:
        return None
    runs = {"llama.cpp": run} | ({"alongside": alongside} if alongside is not None else {})
    seconds = interleaved_per_token(runs, repeats=repeats, warmup=1)
    if alongside is None:
        return 1.0 / seconds["llama.cpp"]
    return 1.0 / seconds["alongside"], 1.0 / seconds["llama.cpp"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``minisparse bench decode``."""
    parser.add_argument(
        "--model",
        default="smollm2-135m",
        help="short name, local directory, .gguf file or Hugging Face id",
    )
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--weights",
        choices=("fp32", "int8", "int4"),
        default="fp32",
        help="our weights in the llama.cpp comparison (int8: beside a q8_0 GGUF file; int4, "
        "groups of 32 with a scale and zero each: beside a Q4_1 file such as the shipped one)",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")


def run(args: argparse.Namespace) -> int:
    """minisparse's decode paths against transformers (and llama.cpp); 1 if tokens differ."""
    from ..loading import load, load_hf_reference, resolve_device
    from ..model import use_streaming_gemv

    if not args.prompt.strip():
        raise ValueError("--prompt is empty; give some text to decode after.")
    check_count(args.max_new_tokens, "--max-new-tokens")
    check_count(args.repeats, "--repeats", fix="the benchmark reports the median of the repeats")
    resolve_device(args.device)
    about = machine()
    print(about.line(), flush=True)
    model, tokenizer = load(args.model, device=args.device)
    print("loading transformers' own model for the same checkpoint ...", flush=True)
    hf_model, _ = load_hf_reference(args.model)
    hf_model = hf_model.to(model.device).eval()
    print(
        f"prompt: {args.prompt!r}, {args.max_new_tokens} new tokens, greedy, batch 1, "
        f"{torch.get_num_threads()} threads, median of {args.repeats} after warm-up"
    )
    variants = {  # name: (set the model up, compiled decode steps)
        "minisparse (default: compiled step)": (lambda m: m, True),
        "minisparse (torch modules, F.linear)": (lambda m: m, False),
        "minisparse (torch modules, streaming)": (use_streaming_gemv, False),
    }
    llama_cpp = print_llama_cpp_row(args, model, tokenizer)  # before the variants change model
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
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        settings = {k: v for k, v in vars(args).items() if k not in ("func", "json")}
        payload = {"machine": about.as_dict(), "settings": settings, "rows": rows}
        payload["weights"] = args.weights
        payload["minisparse_beside_llama_cpp_tok_s"] = llama_cpp[0] if llama_cpp else None
        payload["llama_cpp_tok_s"] = llama_cpp[1] if llama_cpp else None
        payload["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        payload["command"] = "minisparse " + " ".join(getattr(args, "argv", []))
        args.json.write_text(json.dumps(payload, indent=1))
        print(f"\nwrote {args.json}")
    return 0 if all(r["same_tokens"] for r in rows.values()) else 1


def print_llama_cpp_row(
    args: argparse.Namespace, model: Any, tokenizer: Any
) -> tuple[float, float] | None:
    """llama.cpp on the model's GGUF file beside our compiled decode of the same prompt (at
    ``--weights``), alternating within each repeat, when llama-cpp-python is installed:
    (ours tok/s, llama.cpp tok/s)."""
    from ..generate import generate
    from ..loading import embedded_gguf_path

    gguf = Path(args.model) if args.model.endswith(".gguf") else None
    if args.model == "smollm2-135m":
        gguf = embedded_gguf_path()
    if gguf is None:
        print("llama.cpp: no GGUF file for this model; give --model FILE.gguf to compare")
        return None
    if importlib.util.find_spec("llama_cpp") is None:
        print("llama.cpp: not installed (optional: pip install llama-cpp-python)")
        return None
    ours = model
    if args.weights != "fp32":
        from ..engine import low_bit

        ours = low_bit(model, args.weights)  # the engine's int8 / int4 weights
    n = args.max_new_tokens
    rates = llama_cpp_decode(
        gguf, args.prompt, n, args.repeats,
        alongside=lambda: len(generate(ours, tokenizer, args.prompt, max_new_tokens=n)),
    )  # fmt: skip
    mine, theirs = rates  # type: ignore[misc]
    print(
        f"\nside by side, alternating: minisparse compiled step ({args.weights} weights) "
        f"{mine:6.1f} tok/s | llama.cpp ({gguf.name}) {theirs:6.1f} tok/s | ours / llama.cpp "
        f"{mine / theirs:.2f}x"
    )
    return mine, theirs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m minisparse.bench.decode", description=__doc__.split("\n")[0]
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
