"""The Pareto front of engine configurations: the ones no other beats on speed and quality."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["pareto_front"]


def pareto_front(points: Sequence[tuple[float, float]]) -> list[bool]:
    """For (tokens/s, perplexity) points: True where no other point is at least as fast and at
    most as perplexed, and strictly better in one of the two (a point measured twice keeps both
    copies on the front)."""
    return [
        not any(
            s2 >= s and p2 <= p and (s2 > s or p2 < p)
            for j, (s2, p2) in enumerate(points)
            if j != i
        )
        for i, (s, p) in enumerate(points)
    ]
