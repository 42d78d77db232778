"""Calling two measurements different only when they are: intervals, and a verdict in words.

A speed measured over R rounds is a median with a spread (``spread``: the rounds' range); a
perplexity over W windows has a bootstrap interval over its windows
(``minisparse.io.eval.perplexity_interval``). Two results are different only when their
intervals do not overlap, and ``verdict`` says so in words ("faster", "slower", "no measurable
difference"), so a sentence built from it cannot claim more than the measurement shows.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "MEETS",
    "MISSES",
    "SAME",
    "UNDETERMINED",
    "Interval",
    "against_goal",
    "median_interval",
    "spread",
    "verdict",
]

SAME = "no measurable difference"
MEETS, MISSES, UNDETERMINED = "meets", "misses", "undetermined"


@dataclass(frozen=True)
class Interval:
    """A measured value ``mid`` and the interval [low, high] it is known within."""

    mid: float
    low: float
    high: float

    def __post_init__(self) -> None:
        if not self.low <= self.mid <= self.high:
            raise ValueError(f"An interval needs low <= mid <= high, got {self}.")

    @property
    def half_width(self) -> float:
        """The larger distance from mid to an end, relative to mid (0.1: within ±10 %)."""
        return max(self.mid - self.low, self.high - self.mid) / abs(self.mid)

    def overlaps(self, other: Interval) -> bool:
        return self.low <= other.high and other.low <= self.high

    def __str__(self) -> str:
        return f"{self.mid:.2f} ({self.low:.2f}-{self.high:.2f})"


def spread(samples: Sequence[float]) -> Interval:
    """The median of ``samples`` (one per round) within their range."""
    if not samples:
        raise ValueError("spread needs at least one sample.")
    return Interval(statistics.median(samples), min(samples), max(samples))


def median_interval(samples: Sequence[float], confidence: float = 0.95) -> Interval:
    """The median of ``samples`` within a distribution-free ``confidence`` interval.

    The number B of samples below the true median is Binomial(n, 1/2) whatever the samples'
    law, so with the samples sorted, x_(j) < median < x_(n+1-j) holds with probability
    1 − 2 P(B <= j − 1). j is the largest index that keeps that at or above ``confidence``.
    With fewer than 6 samples even the range falls short of 95 % (its coverage is
    1 − 2^(1−n)), and the range is returned: say how many rounds a ratio rests on.
    """
    if not samples:
        raise ValueError("median_interval needs at least one sample.")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}.")
    x, n = sorted(samples), len(samples)
    tail, j = 0.0, 0  # tail = P(B <= j - 1) for the next j
    while j < n // 2:
        nxt = tail + math.comb(n, j) / 2**n
        if 1.0 - 2.0 * nxt < confidence:
            break
        tail, j = nxt, j + 1
    j = max(j, 1)
    return Interval(statistics.median(x), x[j - 1], x[n - j])


def against_goal(interval: Interval, goal: float) -> str:
    """``MEETS`` when the whole interval is at or above ``goal``, ``MISSES`` when it is all
    below, else ``UNDETERMINED``: a ratio whose interval straddles the goal proves neither."""
    if interval.low >= goal:
        return MEETS
    if interval.high < goal:
        return MISSES
    return UNDETERMINED


def verdict(
    a: Interval,
    b: Interval,
    higher_is_better: bool = True,
    words: tuple[str, str] = ("faster", "slower"),
) -> str:
    """How ``a`` compares with ``b``: ``words[0]`` when a is better and the intervals do not
    overlap, ``words[1]`` when it is worse, else "no measurable difference"."""
    if a.overlaps(b):
        return SAME
    better = a.mid > b.mid if higher_is_better else a.mid < b.mid
    return words[0] if better else words[1]
