"""Benchmarking: timing done right, memory bandwidth, and the batch-1 roofline.

Rules every benchmark in the course follows:

* compare variants side by side in one run (the machine's state drifts between runs);
* warm up first (allocators, caches, lazy initialisation, ``torch.compile``), then report the
  **median** of repeats, which ignores the occasional descheduled run;
* report ratios (to dense, to the ideal) rather than raw times, since ratios carry to other
  machines;
* on CUDA, synchronise before reading the clock: kernel launches are asynchronous.

The roofline at batch 1: a decode step reads every weight once, so its time is at least
``bytes_moved / bandwidth``. A kernel that skips a fraction s of the weights can at best take
``(1 - s)`` of the dense time.
"""

from __future__ import annotations

import functools
import importlib.util
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm


def synchronize(device: torch.device | str | None = None) -> None:
    """Wait for queued CUDA work (a no-op on CPU)."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def median_time(
    fn: Callable[[], object],
    repeats: int = 20,
    warmup: int = 3,
    device: torch.device | str | None = None,
) -> float:
    """Median wall time of ``fn()`` in seconds, over ``repeats`` runs after ``warmup`` runs."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}.")
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def interleaved_medians(
    fns: dict[str, Callable[[], object]],
    repeats: int = 20,
    warmup: int = 3,
    device: torch.device | str | None = None,
    progress: bool = False,
) -> dict[str, float]:
    """Median seconds of each function, timing them in turn within every repeat."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}.")
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    synchronize(device)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in tqdm(range(repeats), desc="timing", disable=not progress, leave=False):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            synchronize(device)
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def copy_bandwidth(
    nbytes: int = 256 * 2**20,
    repeats: int = 10,
    device: torch.device | str | None = None,
) -> float:
    """Measured memory bandwidth in GB/s (1e9 bytes/s) of a large tensor copy.

    A copy reads ``nbytes`` and writes ``nbytes``, so it moves ``2 * nbytes`` per run.
    """
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    seconds = median_time(lambda: dst.copy_(src), repeats=repeats, warmup=2, device=device)
    return 2 * nbytes / seconds / 1e9


def read_bandwidth(
    nbytes: int = 256 * 2**20,
    repeats: int = 10,
    device: torch.device | str | None = None,
) -> float:
    """Measured read bandwidth in GB/s: a sum over a large tensor reads ``nbytes`` per run.

    This is the right reference for decoding, which streams weights and writes almost nothing.
    """
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    seconds = median_time(lambda: src.sum(), repeats=repeats, warmup=2, device=device)
    return nbytes / seconds / 1e9


def roofline_seconds(nbytes: int, bandwidth_gbs: float) -> float:
    """Lower bound on the time to stream ``nbytes`` at ``bandwidth_gbs`` GB/s."""
    return nbytes / (bandwidth_gbs * 1e9)


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
    from .generate import encode_prompt, generate, stop_ids

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


@dataclass
class ModelSpeed:
    """Greedy decode speed of one variant, and the tokens it produced."""

    tok_s: float
    tokens: list[int]


def interleaved_decode(
    runs: dict[str, Callable[[], list[int]]],
    repeats: int = 5,
    warmup: int = 1,
    progress: bool = True,
) -> dict[str, ModelSpeed]:
    """Tokens/s of decode functions (each returns its new tokens), timed in turn per repeat.

    ``interleaved_medians`` times every function once per repeat, so that machine noise hits
    them alike; a function's speed is its token count over its median time.
    """
    tokens: dict[str, list[int]] = {}

    def timed(name: str, run: Callable[[], list[int]]) -> Callable[[], None]:
        def call() -> None:
            tokens[name] = run()

        return call

    fns = {name: timed(name, run) for name, run in runs.items()}
    seconds = interleaved_medians(fns, repeats=repeats, warmup=warmup, progress=progress)
    return {name: ModelSpeed(len(tokens[name]) / seconds[name], tokens[name]) for name in runs}


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
    from .generate import encode_prompt, generate

    ids = encode_prompt(tokenizer, prompt)
    runs = {
        name: functools.partial(
            generate, m, tokenizer, ids, max_new_tokens=max_new_tokens, compiled=compiled
        )
        for name, m in models.items()
    }
    return interleaved_decode(runs, repeats, warmup, progress)


def llama_cpp_decode(
    gguf: str | Path,
    prompt: str,
    max_new_tokens: int = 64,
    repeats: int = 5,
    threads: int | None = None,
) -> float | None:
    """Greedy decode tokens/s of llama.cpp on the same GGUF file, or None without it.

    llama.cpp comes from the optional ``llama-cpp-python`` package (never needed by the tests).
    Like ``bench_decode``, each run times the whole call, prompt included, per new token; the
    median of ``repeats`` runs after one warm-up.
    """
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    from llama_cpp import Llama

    llm = Llama(
        model_path=str(gguf),
        n_threads=threads or torch.get_num_threads(),
        n_ctx=max(512, 4 * max_new_tokens),
        verbose=False,
    )
    per_token = []
    for i in range(1 + repeats):
        llm.reset()
        t0 = time.perf_counter()
        out = llm(prompt, max_tokens=max_new_tokens, temperature=0.0, top_k=1)
        elapsed = time.perf_counter() - t0
        if i > 0:
            per_token.append(elapsed / max(1, out["usage"]["completion_tokens"]))
    return 1.0 / statistics.median(per_token)
