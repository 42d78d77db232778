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

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
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
) -> DecodeResult:
    """Greedy decode tokens/s of minisparse vs transformers, interleaved, median of repeats.

    The two loops alternate within each repeat so that machine noise hits both alike.
    """
    from .generate import encode_prompt, generate, stop_ids

    ids = encode_prompt(tokenizer, prompt)
    eos = sorted(stop_ids(model, tokenizer))
    ours = theirs = []
    t_ours, t_theirs = [], []
    for i in tqdm(range(warmup + repeats), desc="decode bench", disable=not progress):
        t0 = time.perf_counter()
        ours = generate(model, tokenizer, ids, max_new_tokens=max_new_tokens)
        t1 = time.perf_counter()
        with torch.inference_mode():
            theirs = hf_greedy(hf_model, ids, max_new_tokens, eos)
        t2 = time.perf_counter()
        if i >= warmup:
            t_ours.append((t1 - t0) / len(ours))
            t_theirs.append((t2 - t1) / len(theirs))
    return DecodeResult(
        new_tokens=len(ours),
        minisparse_tok_s=1.0 / statistics.median(t_ours),
        transformers_tok_s=1.0 / statistics.median(t_theirs),
        same_tokens=ours == theirs,
    )
