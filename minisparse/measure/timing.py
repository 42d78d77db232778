"""The timing harness every benchmark uses: warm-up, interleaved variants, medians, bandwidth.

The benchmarks (``minisparse.bench``) and the library's own measurements
(``minisparse.measure.machine``, ``minisparse.offload.time_model``) all time through this module.

Rules every benchmark in the course follows:

* compare variants side by side in one run (the machine's state drifts between runs): a run is
  ``warmup + repeats`` *rounds*, and every round calls each variant once, in turn, so that
  machine noise hits them alike;
* warm up first (allocators, caches, lazy initialisation, ``torch.compile``): the first
  ``warmup`` rounds are not kept; then report the **median** of the repeats, which ignores the
  occasional descheduled run;
* a decode speed is the median of (seconds / new tokens) over the repeats, inverted to tokens/s;
* report ratios (to dense, to the ideal) rather than raw times, since ratios carry to other
  machines;
* on CUDA, synchronise before reading the clock: kernel launches are asynchronous.

``interleaved_times`` is the one loop that does this; ``interleaved_medians``, ``median_time``,
``per_token_rounds``, ``interleaved_per_token`` and ``interleaved_decode`` are views of its
result. A speedup between two variants is best taken pairwise, round by round
(``ModelSpeed.paired_speedup``): on a machine whose speed drifts, the two runs of one round
see the same machine.

The roofline at batch 1: a decode step reads every weight once, so its time is at least
``bytes_moved / bandwidth``. A kernel that skips a fraction s of the weights can at best take
``(1 - s)`` of the dense time.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

__all__ = [
    "DECODE_PROMPT",
    "ModelSpeed",
    "copy_bandwidth",
    "interleaved_decode",
    "interleaved_decode_steps",
    "interleaved_medians",
    "interleaved_per_token",
    "interleaved_times",
    "median_time",
    "paired_ratios",
    "per_token_rounds",
    "read_bandwidth",
    "roofline_seconds",
    "rounds_until_narrow",
    "synchronize",
]


#: The prompt every decode-speed measurement starts from (the benchmarks and chapter 08's check).
DECODE_PROMPT = "The Python language reference describes the syntax and"


def synchronize(device: torch.device | str | None = None) -> None:
    """Wait for queued CUDA work (a no-op on CPU)."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def interleaved_times(
    fns: dict[str, Callable[[], object]],
    repeats: int = 20,
    warmup: int = 3,
    device: torch.device | str | None = None,
    progress: bool = False,
    desc: str = "timing",
    rotate: bool = True,
) -> dict[str, list[float]]:
    """Seconds of every timed call of each function: ``repeats`` values per name.

    ``warmup + repeats`` rounds; each round calls every function once, and the first
    ``warmup`` rounds are dropped. With ``rotate``, round r starts at the r-th function of
    ``fns`` (the order is kept, cyclically), so that each function runs first, second, ... in
    turn: a machine can favour a position in the round (a cache another run warmed, a clock
    that ramps up), and rotating spreads that over all of them. Without it, every round runs
    in the order of ``fns``.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}.")
    if warmup < 0:
        raise ValueError(f"warmup must be at least 0, got {warmup}.")
    times: dict[str, list[float]] = {name: [] for name in fns}
    synchronize(device)
    names = list(fns)
    for r in tqdm(range(warmup + repeats), desc=desc, disable=not progress, leave=False):
        start = r % len(names) if rotate else 0
        for name in names[start:] + names[:start]:
            t0 = time.perf_counter()
            fns[name]()
            synchronize(device)
            if r >= warmup:
                times[name].append(time.perf_counter() - t0)
    return times


def interleaved_medians(
    fns: dict[str, Callable[[], object]],
    repeats: int = 20,
    warmup: int = 3,
    device: torch.device | str | None = None,
    progress: bool = False,
) -> dict[str, float]:
    """Median seconds of each function, timing them in turn within every repeat."""
    times = interleaved_times(fns, repeats, warmup, device, progress)
    return {name: statistics.median(ts) for name, ts in times.items()}


def median_time(
    fn: Callable[[], object],
    repeats: int = 20,
    warmup: int = 3,
    device: torch.device | str | None = None,
) -> float:
    """Median wall time of ``fn()`` in seconds, over ``repeats`` runs after ``warmup`` runs."""
    return interleaved_medians({"fn": fn}, repeats, warmup, device)["fn"]


def interleaved_per_token(
    runs: dict[str, Callable[[], int]],
    repeats: int = 5,
    warmup: int = 1,
    device: torch.device | str | None = None,
    progress: bool = False,
) -> dict[str, float]:
    """Median seconds per token of each run; a run returns how many tokens it produced.

    Each repeat's time is divided by that repeat's token count (at least 1), then the median is
    taken: seconds per token = median_r(t_r / n_r).
    """
    rounds = per_token_rounds(runs, repeats, warmup, device, progress)
    return {name: statistics.median(values) for name, values in rounds.items()}


def per_token_rounds(
    runs: dict[str, Callable[[], int]],
    repeats: int = 5,
    warmup: int = 1,
    device: torch.device | str | None = None,
    progress: bool = False,
) -> dict[str, list[float]]:
    """Seconds per token of each run in every kept round, t_r / n_r (``interleaved_times``)."""
    counts: dict[str, list[int]] = {name: [] for name in runs}

    def counted(name: str, run: Callable[[], int]) -> Callable[[], None]:
        def call() -> None:
            counts[name].append(max(1, run()))

        return call

    fns = {name: counted(name, run) for name, run in runs.items()}
    times = interleaved_times(fns, repeats, warmup, device, progress)
    return {
        name: [t / n for t, n in zip(times[name], counts[name][warmup:], strict=True)]
        for name in runs
    }


def paired_ratios(reference: Sequence[float], own: Sequence[float]) -> list[float]:
    """Reference / own time, round by round: the speedup of each round's back-to-back pair."""
    return [ref / mine for ref, mine in zip(reference, own, strict=True)]


def rounds_until_narrow(
    more: Callable[[int], list[float]],
    first: int = 7,
    most: int = 31,
    width: float = 0.10,
    step: int = 4,
) -> list[float]:
    """Paired per-round ratios, more rounds at a time, until their median is known to ±width.

    ``more(n)`` runs n further interleaved rounds and returns their ratios. After ``first``
    rounds, ``step`` more are added while the 95 % interval of the median
    (``compare.median_interval``) is wider than ``width`` of it on either side, up to ``most``
    rounds in all; the caller reports how many it took and the interval (which may still be
    wide at ``most``: then say so rather than claim a result).
    """
    from .compare import median_interval

    if not 1 <= first <= most:
        raise ValueError(f"Need 1 <= first <= most rounds, got first={first}, most={most}.")
    if step < 1 or not 0.0 < width < 1.0:
        raise ValueError(f"Need step >= 1 and 0 < width < 1, got step={step}, width={width}.")
    ratios = list(more(first))
    while len(ratios) < most and median_interval(ratios).half_width > width:
        ratios += more(min(step, most - len(ratios)))
    return ratios


@dataclass
class ModelSpeed:
    """Greedy decode speed of one variant, its tokens, and its seconds per token per round."""

    tok_s: float
    tokens: list[int]
    rounds: list[float] = field(default_factory=list)

    def round_speedups(self, reference: ModelSpeed) -> list[float]:
        """Reference / own seconds per token, one value per round."""
        return paired_ratios(reference.rounds, self.rounds)

    def paired_speedup(self, reference: ModelSpeed) -> float:
        """Median over rounds of reference / own seconds per token. The two ran back to back in
        each round, so a change of the machine's speed that spans a round cancels in the pair;
        a ratio of the two medians would keep it when the rounds of the two fall in different
        phases of a noisy machine."""
        return statistics.median(self.round_speedups(reference))


def interleaved_decode(
    runs: dict[str, Callable[[], list[int]]],
    repeats: int = 5,
    warmup: int = 1,
    progress: bool = True,
    device: torch.device | str | None = None,
) -> dict[str, ModelSpeed]:
    """Tokens/s of decode functions (each returns its new tokens), timed in turn per repeat.

    ``per_token_rounds`` times every function once per repeat, so that machine noise hits
    them alike; a function's speed is one over its median seconds per token, and its tokens are
    those of its last call.
    """
    tokens: dict[str, list[int]] = {}

    def kept(name: str, run: Callable[[], list[int]]) -> Callable[[], int]:
        def call() -> int:
            tokens[name] = run()
            return len(tokens[name])

        return call

    fns = {name: kept(name, run) for name, run in runs.items()}
    rounds = per_token_rounds(fns, repeats, warmup, device, progress)
    return {
        name: ModelSpeed(1.0 / statistics.median(rounds[name]), tokens[name], rounds[name])
        for name in runs
    }


def interleaved_decode_steps(
    runs: dict[str, Callable[[int], list[int]]],
    new_tokens: int,
    repeats: int = 5,
    warmup: int = 1,
    progress: bool = True,
) -> tuple[dict[str, ModelSpeed], dict[str, float]]:
    """Decode speed without the prompt's cost: (speeds, seconds of prefill + first token).

    ``run(n)`` generates exactly n tokens (no stop at end-of-sequence). In every round each
    run is timed at 1 token and at ``new_tokens``, one after the other; the round's seconds
    per decoded token are (t_n - t_1) / (n - 1), which removes the prefill, whatever its cost.
    Speeds are one over the median of those; the tokens are the last ``new_tokens`` run's.
    """
    if new_tokens < 2:
        raise ValueError(f"new_tokens must be at least 2 (one is the prefill's), got {new_tokens}.")
    tokens: dict[str, list[int]] = {}

    def timed(name: str, n: int) -> Callable[[], None]:
        def call() -> None:
            tokens[name] = runs[name](n)

        return call

    fns: dict[str, Callable[[], object]] = {}
    for name in runs:  # the 1-token run first: anything a run records is the long run's
        fns[f"{name} @1"] = timed(name, 1)
        fns[f"{name} @n"] = timed(name, new_tokens)
    # in order: each run's 1-token call right before its long one, which records last
    times = interleaved_times(
        fns, repeats, warmup, progress=progress, desc="decode steps", rotate=False
    )
    speeds, prefill = {}, {}
    for name in runs:
        one, many = times[f"{name} @1"], times[f"{name} @n"]
        rounds = [(t_n - t_1) / (new_tokens - 1) for t_n, t_1 in zip(many, one, strict=True)]
        speeds[name] = ModelSpeed(1.0 / statistics.median(rounds), tokens[name], rounds)
        prefill[name] = statistics.median(one)
    return speeds, prefill


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
