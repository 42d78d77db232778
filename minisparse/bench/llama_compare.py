"""minisparse beside llama.cpp: one prompt decoded by both, alternating within every repeat.

``llama_cpp_decode`` times llama.cpp (in its own process, ``minisparse.bench.llama_cpp``) and
our decode of the same prompt, with the bytes each step reads; ``print_llama_cpp_row`` is the
line ``minisparse bench decode`` prints, at the weight format asked (``--weights``) against the
GGUF file's own.
"""

from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..measure.timing import interleaved_decode

__all__ = ["LlamaCppResult", "llama_cpp_decode", "print_llama_cpp_row"]


@dataclass
class LlamaCppResult:
    """minisparse and llama.cpp decoding one prompt, alternating: speeds, bytes, tokens."""

    gguf: str
    ours_tok_s: float
    llama_cpp_tok_s: float
    ours_mb_per_token: float  # weight bytes one decode step reads
    llama_cpp_mb_per_token: float
    ours_tokens: list[int]
    llama_cpp_tokens: list[int]

    @property
    def ratio(self) -> float:
        return self.ours_tok_s / self.llama_cpp_tok_s

    @property
    def ratio_per_byte(self) -> float:
        """Ours / theirs in bytes streamed per second: the ratio with the bytes evened out."""
        ours = self.ours_tok_s * self.ours_mb_per_token
        return ours / (self.llama_cpp_tok_s * self.llama_cpp_mb_per_token)

    @property
    def same_tokens(self) -> bool:
        return self.ours_tokens == self.llama_cpp_tokens


def llama_cpp_decode(
    gguf: str | Path,
    prompt: str,
    ours: Callable[[], list[int]],
    ours_bytes: float,
    max_new_tokens: int = 64,
    repeats: int = 5,
    threads: int | None = None,
) -> LlamaCppResult | None:
    """Greedy decode speed of llama.cpp on a GGUF file beside ``ours`` (a function that decodes
    the same prompt and returns its new tokens; ``ours_bytes``: the bytes its step reads),
    alternating within every repeat, median of ``repeats`` after one warm-up each. None
    without ``llama-cpp-python``; ``LlamaCppDied`` when llama.cpp crashes (in its own process:
    ``minisparse.bench.llama_cpp``).

    Like ``bench_decode``, each run times the whole call, prompt included, per new token: a
    ratio from one run, not from two runs minutes apart on a machine whose speed drifts.
    """
    from .llama_cpp import LlamaCppChild, gguf_step_bytes

    if importlib.util.find_spec("llama_cpp") is None:
        return None
    threads = threads or torch.get_num_threads()
    with LlamaCppChild(gguf, threads, n_ctx=max(512, 4 * max_new_tokens)) as child:
        runs = {
            "llama.cpp": lambda: child.complete(prompt, max_new_tokens).tokens,
            "minisparse": ours,
        }
        speeds = interleaved_decode(runs, repeats, 1, progress=False)
    return LlamaCppResult(
        gguf=Path(gguf).name,
        ours_tok_s=speeds["minisparse"].tok_s,
        llama_cpp_tok_s=speeds["llama.cpp"].tok_s,
        ours_mb_per_token=ours_bytes / 1e6,
        llama_cpp_mb_per_token=gguf_step_bytes(gguf) / 1e6,
        ours_tokens=speeds["minisparse"].tokens,
        llama_cpp_tokens=speeds["llama.cpp"].tokens,
    )


def print_llama_cpp_row(
    args: argparse.Namespace, model: Any, tokenizer: Any
) -> LlamaCppResult | None:
    """llama.cpp on the model's GGUF file (``--gguf``, or the file ``--model`` names) beside
    our compiled decode of the same prompt at ``--weights``, alternating within each repeat,
    when llama-cpp-python is installed. A crash of llama.cpp prints why and returns None."""
    from ..io.loading import embedded_gguf_path
    from ..runtime.generate import generate
    from ..sparse.traffic import step_bytes
    from .llama_cpp import LlamaCppDied

    gguf = args.gguf or (Path(args.model) if args.model.endswith(".gguf") else None)
    if gguf is None and args.model == "smollm2-135m":
        gguf = embedded_gguf_path()
    if gguf is None:
        print("llama.cpp: no GGUF file for this model; give --gguf FILE.gguf to compare")
        return None
    if importlib.util.find_spec("llama_cpp") is None:
        print("llama.cpp: not installed (optional: pip install llama-cpp-python)")
        return None
    ours = model
    if args.weights != "fp32":
        from ..quant.formats import low_bit

        ours = low_bit(model, args.weights)  # the engine's int8 / int4 weights
    n = args.max_new_tokens
    try:
        r = llama_cpp_decode(
            gguf, args.prompt, lambda: generate(ours, tokenizer, args.prompt, max_new_tokens=n),
            step_bytes(ours), n, args.repeats,
        )  # fmt: skip
    except LlamaCppDied as err:
        print(f"llama.cpp: skipped, {err}", flush=True)
        return None
    assert r is not None
    print(
        f"\nside by side, alternating: minisparse compiled step ({args.weights} weights, "
        f"{r.ours_mb_per_token:.1f} MB/token) {r.ours_tok_s:6.1f} tok/s | llama.cpp ({gguf.name}, "
        f"{r.llama_cpp_mb_per_token:.1f} MB/token) {r.llama_cpp_tok_s:6.1f} tok/s | ours / "
        f"llama.cpp {r.ratio:.2f}x, per byte {r.ratio_per_byte:.2f}x | same tokens: "
        f"{r.same_tokens}",
        flush=True,
    )
    return r
