"""Calling two measurements different only when they are: intervals, and a verdict in words.

A speed measured over R rounds is a median with a spread (``spread``: the rounds' range); a
perplexity over W windows has a bootstrap interval over its windows
(``minisparse.io.eval.perplexity_interval``). Two results are different only when their
intervals do not overlap, and ``verdict`` says so in words ("faster", "slower", "no measurable
difference"), so a sentence built from it cannot claim more than the measurement shows.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["SAME", "Interval", "spread", "verdict"]

SAME = "no measurable difference"


@dataclass(frozen=True)
class Interval:
    """A measured value ``mid`` and the interval [low, high] it is known within."""

    mid: float
    low: float
    high: float

    def __post_init__(self) -> None:
        if not self.low <= self.mid <= self.high:
            raise ValueError(f"An interval needs low <= mid <= high, got {self}.")

    def overlaps(self, other: Interval) -> bool:
        return self.low <= other.high and other.low <= self.high

    def __str__(self) -> str:
        return f"{self.mid:.2f} ({self.low:.2f}-{self.high:.2f})"


def spread(samples: Sequence[float]) -> Interval:
    """The median of ``samples`` (one per round) within their range."""
    if not samples:
        raise ValueError("spread needs at least one sample.")
    return Interval(statistics.median(samples), min(samples), max(samples))


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
