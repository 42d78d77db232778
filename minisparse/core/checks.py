"""Argument checks: one clear ``ValueError`` that names the argument, before any work is done.

The library takes many small numbers from notebooks, the CLI and tests: counts of tokens,
layers, steps or repeats; scales and learning rates; weights that mix two terms. Each kind is
checked by one function here, so ``0``, ``-1``, ``2.5``, ``True`` or ``nan`` give the same
message wherever they are passed:

* a count is a whole number n >= minimum (``check_count``),
* a scale is a finite number x > 0 (``check_positive``),
* a fraction is a number 0 <= x <= 1 (``check_fraction``),
* an output path is a file that can be written (``check_output_path``).

A bool is never a number here, although Python counts ``True`` as 1.
"""

from __future__ import annotations

import math
import operator
import os
from pathlib import Path

__all__ = [
    "check_count",
    "check_fraction",
    "check_output_path",
    "check_positive",
]


def check_count(value: object, name: str, minimum: int = 1, fix: str = "") -> int:
    """``value`` as an int after checking it is a whole number >= ``minimum`` (not a bool).

    Every count the library takes (tokens, layers, steps, block sizes, repeats) goes through
    here, so 0, -1, 2.5 or True give one ``ValueError`` that names the argument.
    """
    try:
        number = None if isinstance(value, bool) else operator.index(value)  # int, np.int64
    except TypeError:
        number = None
    if number is None or number < minimum:
        hint = f"; {fix}" if fix else ""
        raise ValueError(
            f"{name} must be at least {minimum} (a whole number {name} >= {minimum}), "
            f"got {value!r}{hint}."
        )
    return number


def check_positive(value: float, name: str, example: str) -> float:
    """A finite number > 0 (a learning rate, a scale), else a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number > 0 (e.g. {example}), got {value!r}.")
    if not 0 < value < math.inf:  # False for NaN
        raise ValueError(f"{name} must be a finite number > 0 (e.g. {example}), got {value}.")
    return float(value)


def check_fraction(value: float, name: str) -> float:
    """A number in [0, 1], else a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ValueError(f"{name} must be in [0, 1], got {value!r}.")
    return float(value)


def check_output_path(path: str | Path, option: str) -> Path:
    """A file we will write: not a directory, in a folder that exists or can be made, writable."""
    out = Path(path).expanduser()
    if out.is_dir():
        raise ValueError(f"{option} {out} is a directory; give a file name, e.g. {out / 'x'}.")
    folder = out.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        raise ValueError(f"{option} {out}: cannot write in {folder}; choose another place.")
    return out
