"""Running the learner's function for ``minisparse.course.exercises.check``: on copies of the
inputs, under a time limit, with what went wrong said in the learner's terms (an error it raised, a
``None`` an unfinished stub returns, an input it changed in place, a call that never ends)."""

from __future__ import annotations

import contextlib
import copy
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

__all__ = ["TIME_LIMIT", "describe", "run_learner", "short"]

TIME_LIMIT = 60.0  # seconds one call of the learner's function may take


class _TooSlow(BaseException):
    """Not an Exception: a learner's own ``except Exception`` must not swallow the limit."""


@contextlib.contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Raise _TooSlow in the calling code after ``seconds`` (a timer signal, in the main thread
    of a Unix process; elsewhere no limit is set). A timer already running (a test runner's
    own limit) is set again afterwards with the time it had left, or is left alone when it
    would fire first."""
    usable = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
    outer = signal.getitimer(signal.ITIMER_REAL)[0] if usable else 0.0
    if not usable or 0 < outer <= seconds:
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        raise _TooSlow

    previous = signal.signal(signal.SIGALRM, stop)
    start = time.monotonic()
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL if previous is None else previous)
        if outer > 0:
            signal.setitimer(signal.ITIMER_REAL, max(1e-3, outer - (time.monotonic() - start)))


def _unchanged(before: Tensor, after: Tensor) -> bool:
    """Same shape and values, NaN where there was NaN (inputs may hold non-finite values)."""
    if before.shape != after.shape or before.dtype != after.dtype:
        return False
    both_nan = torch.isnan(before) & torch.isnan(after) if before.is_floating_point() else False
    return bool(((before == after) | both_nan).all())


def run_learner(name: str, fn: Callable[..., Any], args: tuple[Any, ...]) -> tuple[bool, Any]:
    """(True, result) of the learner's call on copies of ``args``, or (False, None) after
    printing, in the learner's terms, why the call itself went wrong."""
    copies = [a.clone() if isinstance(a, Tensor) else copy.deepcopy(a) for a in args]
    try:
        with _time_limit(TIME_LIMIT):
            got = fn(*copies)
    except _TooSlow:
        print(f"{name}: your function did not return within {TIME_LIMIT:.0f} s on inputs "
              f"{describe(args)}; look for a loop that never ends.")  # fmt: skip
        return False, None
    except Exception as err:  # the learner's code: any error is theirs to see, in one line
        print(f"{name}: your function raised {type(err).__name__}: {err} on inputs "
              f"{describe(args)}")  # fmt: skip
        return False, None
    if got is None:
        print(f"{name}: your function returned None; write its body and `return` the result "
              "(a stub that only says `...` or `pass` returns None).")  # fmt: skip
        return False, None
    for i, (a, c) in enumerate(zip(args, copies, strict=True)):
        if isinstance(a, Tensor) and not _unchanged(a, c):
            shape = describe((a,))[1:-1]
            print(f"{name}: your function changed its input #{i + 1} ({shape}) in place; "
                  "compute on a copy (x.clone()) or with out-of-place operations.")  # fmt: skip
            return False, None
    return True, got


def describe(args: tuple[Any, ...]) -> str:
    parts = [f"tensor{tuple(a.shape)}" if isinstance(a, Tensor) else repr(a)[:40] for a in args]
    return "(" + ", ".join(parts) + ")"


def short(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"tensor{tuple(value.shape)} {value.flatten()[:4].tolist()}..."
    return repr(value)[:120]
