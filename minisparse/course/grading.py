"""Grading the learner's code: what an exercise is, the registry of all of them, and ``check``.

An ``Exercise`` names the library's own version of a function (the reference), a generator of
fresh random inputs with odd shapes and edge cases, how two answers are compared and a hint. A
*core build* (``core=True``) is the heart of a chapter: once the learner's version passes,
``minisparse.course.use`` plugs it into the rest of the chapter. Builds that are classes or
loops give a ``run`` that drives the learner's code through one case (a script of operations)
and returns what to compare, e.g. what every sequence of a paged cache reads back.

The learner's code runs on copies of the inputs, under a time limit, with what went wrong said in
the learner's terms (an error it raised, a ``None`` an unfinished stub returns, an input it
changed in place, a call that never ends), never as a traceback through the library."""

from __future__ import annotations

import builtins
import copy
import ctypes
import math
import operator
import random
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..core.checks import check_count
from .feedback import difference, kind_mismatch, script_step

__all__ = [
    "EXERCISES",
    "GUARDED",
    "TIME_LIMIT",
    "TOLERANCES",
    "Exercise",
    "check",
    "close",
    "describe",
    "draw_int",
    "equal",
    "exact",
    "loose",
    "near",
    "register",
    "run_learner",
    "short",
    "where_it_differs",
]

TIME_LIMIT = 60.0  # seconds one call of the learner's function may take


class _TooSlow(BaseException):
    """Not an Exception: a learner's own ``except Exception`` must not swallow the limit."""


#: How long ``_stop`` keeps raising _TooSlow into a late call's thread before giving up.
STOP_GRACE = 1.0


@dataclass
class _Outcome:
    """What the learner's call in its thread gave: a result or the exception it raised."""

    done: bool = False
    value: Any = None
    error: BaseException | None = None
    running: bool = False  # still running after the deadline and ``_stop``


def draw_int(gen: torch.Generator, lo: int, hi: int) -> int:
    """A whole number in [lo, hi) from ``gen``: the sizes of the random cases checks draw."""
    return int(torch.randint(lo, hi, (1,), generator=gen))


def _call_with_deadline(fn: Callable[[], Any], seconds: float) -> _Outcome:
    """``fn()`` in a daemon thread that the caller waits for at most ``seconds``.

    The caller's grad and inference modes (per thread in torch) are the thread's too. A call
    still running at the deadline comes back not ``done``, after ``_stop`` tried to end it:
    a loop that catches every exception (``except:``) cannot hold the caller, which only waits.
    """
    outcome = _Outcome()
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()

    def work() -> None:
        try:
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                outcome.value = fn()
            outcome.done = True
        except BaseException as err:  # handed to the caller, which says what it was
            outcome.error, outcome.done = err, True

    thread = threading.Thread(target=work, name="minisparse-learner", daemon=True)
    thread.start()
    try:
        thread.join(seconds)
    except BaseException:  # Ctrl-C (a notebook's stop button) ends the learner's call too
        _stop(thread)
        raise
    if thread.is_alive():
        outcome.running = not _stop(thread)
        outcome.done = False
    return outcome


def _stop(thread: threading.Thread) -> bool:
    """Raise _TooSlow in ``thread`` again and again (an ``except:`` inside a loop catches some,
    not the one that lands between two tries) for up to ``STOP_GRACE`` s; True if it ended."""
    ident = thread.ident
    deadline = time.monotonic() + STOP_GRACE
    while thread.is_alive() and ident is not None and time.monotonic() < deadline:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(
            ctypes.c_ulong(ident), ctypes.py_object(_TooSlow)
        )
        thread.join(0.005)
    return not thread.is_alive()


#: The functions answers are compared with, as they were when this module was imported: a
#: learner's function that replaces one of them fails, and the original is put back.
GUARDED: tuple[tuple[Any, str], ...] = (
    *((torch, n) for n in ("allclose", "equal", "isclose", "as_tensor", "tensor", "all", "any")),
    *((torch.testing, n) for n in ("assert_close",)),
    *((Tensor, n) for n in ("__eq__", "__ne__", "all", "any", "double", "float", "abs", "sum")),
    *((math, n) for n in ("isclose", "isfinite")),
    *((operator, n) for n in ("index", "eq")),
    *((builtins, n) for n in ("bool", "all", "any", "isinstance", "float", "int", "abs", "len")),
)
_ORIGINALS: dict[tuple[int, str], Any] = {(id(o), n): getattr(o, n) for o, n in GUARDED}


def _restore_guarded() -> list[str]:
    """Put back every guarded function a call replaced; their names (empty when none was)."""
    replaced = []
    for owner, name in GUARDED:
        original = _ORIGINALS[(id(owner), name)]
        if getattr(owner, name) is not original:
            setattr(owner, name, original)
            replaced.append(f"{getattr(owner, '__name__', type(owner).__name__)}.{name}")
    return replaced


def _unchanged(before: Tensor, after: Tensor) -> bool:
    """Same shape and values, NaN where there was NaN (inputs may hold non-finite values)."""
    if before.shape != after.shape or before.dtype != after.dtype:
        return False
    both_nan = torch.isnan(before) & torch.isnan(after) if before.is_floating_point() else False
    return bool(((before == after) | both_nan).all())


def run_learner(name: str, fn: Callable[..., Any], args: tuple[Any, ...]) -> tuple[bool, Any]:
    """(True, result) of the learner's call on copies of ``args``, or (False, None) after
    printing, in the learner's terms, why the call itself went wrong.

    The call runs in a thread the grader waits for at most ``TIME_LIMIT`` s (and then tries to
    stop), so no loop of the learner's can hang the check; a call that replaced one of the
    ``GUARDED`` comparison functions fails, and the original is put back."""
    copies = [a.clone() if isinstance(a, Tensor) else copy.deepcopy(a) for a in args]
    outcome = _call_with_deadline(lambda: fn(*copies), TIME_LIMIT)
    replaced = _restore_guarded()
    err = outcome.error
    if replaced:
        print(f"{name}: your function replaced {', '.join(replaced)}, which the grader compares "
              "answers with; it is put back. Compute the answer without patching torch or "
              "Python's functions.")  # fmt: skip
        return False, None
    if not outcome.done or isinstance(err, _TooSlow):
        print(f"{name}: your function did not return within {TIME_LIMIT:.0f} s on inputs "
              f"{describe(args)} (it ran in a thread the grader stopped waiting for); look "
              "for a loop that never ends."
              + (" It is still running in the background, catching the exception that stops "
                 "it: restart the kernel to end it." if outcome.running else ""))  # fmt: skip
        return False, None
    if isinstance(err, NotImplementedError):
        print(f"{name}: not written yet ({err or 'NotImplementedError'}).")
        return False, None
    if isinstance(err, (KeyboardInterrupt, SystemExit)):
        raise err
    if err is not None:  # the learner's code: any error is theirs to see, in one line
        print(f"{name}: your function raised {type(err).__name__}: {err} on inputs "
              f"{describe(args)}")  # fmt: skip
        return False, None
    got = outcome.value
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


def _call(fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    return fn(*args)


@dataclass(frozen=True)
class Exercise:
    """One graded exercise or core build: the task, the library's reference, fresh cases, how
    answers compare (``same``, or ``accepts`` where several are right) and a hint; ``run``
    drives a class or a loop through one case; ``core`` marks a chapter's core build."""

    chapter: str
    task: str  # what to write: the signature and its meaning, starting with the function's name
    reference: Callable[..., Any]
    cases: Callable[[torch.Generator], list[tuple[Any, ...]]]  # fresh inputs for one trial
    same: Callable[[Any, Any], bool]
    hint: str
    #: (inputs, got, expected) -> right?, for exercises where more than one answer is right;
    #: it replaces ``same`` when given
    accepts: Callable[[tuple[Any, ...], Any, Any], bool] | None = None
    #: (implementation, inputs) -> what is compared; a plain call unless the build is a class
    #: or a loop that a script of operations drives
    run: Callable[[Callable[..., Any], tuple[Any, ...]], Any] = _call
    #: the heart of a chapter, which ``use`` plugs into the rest of the chapter
    core: bool = False

    @property
    def function(self) -> str:
        """The name the learner's function (and its worked solution) has: the task's first word."""
        found = re.match(r"\s*([A-Za-z_]\w*)", self.task)
        if found is None:
            raise ValueError(f"The task {self.task!r} must start with the function's name.")
        return found.group(1)


EXERCISES: dict[str, Exercise] = {}


def register(name: str, exercise: Exercise) -> Exercise:
    """Add an exercise under ``name`` (each chapter's module registers its own)."""
    if name in EXERCISES:
        raise ValueError(f"An exercise named {name!r} exists already (chapter "
                         f"{EXERCISES[name].chapter}); choose another name.")  # fmt: skip
    EXERCISES[name] = exercise
    return exercise


def close(a: Any, b: Any, tol: float = 1e-5) -> bool:
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    return a.shape == b.shape and bool(torch.allclose(a.double(), b.double(), atol=tol, rtol=tol))


def loose(a: Any, b: Any) -> bool:
    """``close`` for float32 sums whose order may differ (matrix products, softmax)."""
    return close(a, b, 1e-4)


def equal(a: Any, b: Any) -> bool:
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    return a.shape == b.shape and bool((a == b).all())


def exact(a: Any, b: Any) -> bool:
    """Whole numbers, equal: a count of bytes is an int, not 0.9 of one or the string "42"."""
    if isinstance(a, bool) or isinstance(a, str):
        return False
    try:
        return operator.index(a) == operator.index(b)
    except TypeError:
        return isinstance(a, float) and a.is_integer() and int(a) == operator.index(b)


def near(a: Any, b: Any) -> bool:
    """Numbers (or tuples of numbers) equal to 1e-9 relative."""
    a, b = (tuple(v) if isinstance(v, (tuple, list)) else (v,) for v in (a, b))
    return len(a) == len(b) and all(
        math.isclose(float(x), float(y), rel_tol=1e-9, abs_tol=1e-12)
        for x, y in zip(a, b, strict=True)
    )


def keeps_top(scores: Tensor, got: Any, k: int | Tensor) -> bool:
    """A bool mask of ``scores``' shape that keeps k per row (last axis) and drops no score
    above a kept one: any top-k set is right where scores tie (1e-5 of the row's largest as
    slack, float64 scores)."""
    if not isinstance(got, Tensor) or got.dtype != torch.bool or got.shape != scores.shape:
        return False
    if not bool((got.sum(-1) == k).all()):
        return False
    kept = torch.where(got, scores, torch.inf).amin(-1)
    dropped = torch.where(got, -torch.inf, scores).amax(-1)
    slack = 1e-5 * scores.abs().amax(-1) + 1e-12
    return bool((kept >= dropped - slack).all())


#: The tolerance of each comparison above, to say where an answer differs beyond it.
TOLERANCES: dict[Callable[[Any, Any], bool], float] = {
    close: 1e-5,
    loose: 1e-4,
    equal: 0.0,
    exact: 0.0,
    near: 1e-9,
}


def where_it_differs(ex: Exercise, args: tuple[Any, ...], got: Any, expected: Any) -> str:
    """The lines a failed check prints about the answer: where it first differs from the
    reference (``feedback.difference``; for a script, the step), else both answers' start.
    Where several answers are right (``accepts``) only the reference's is one of them, so
    both are shown as they are."""
    if ex.accepts is None:  # a comparison of the build's own: beyond float noise, else any
        tol = TOLERANCES.get(ex.same)
        found = difference(got, expected, 1e-5 if tol is None else tol)
        found = difference(got, expected) if found is None and tol is None else found
        if found is not None:
            step = script_step(found, args, expected)
            return (f"  {step}\n" if step else "") + f"  {found}"
    return f"  expected {short(expected)}\n  got      {short(got)}"


def exercise(name: str) -> Exercise:
    """The registered exercise ``name``, or one error that lists them all (importing
    ``minisparse.course`` registers every chapter's exercises and builds)."""
    if name not in EXERCISES:
        raise ValueError(f"Unknown exercise {name!r}; choose one of {', '.join(EXERCISES)}.")
    return EXERCISES[name]


def check(name: str, fn: Callable[..., Any], trials: int = 3, seed: int | None = None) -> bool:
    """Compare ``fn`` with the library's version of exercise ``name``; print the verdict.

    ``fn`` runs on copies of fresh random inputs, at most ``TIME_LIMIT`` seconds a call; an
    error it raises, a ``None`` it returns (an unfinished stub) or an input it changes in place
    fails the check with a message saying so.
    """
    ex = exercise(name)
    check_count(trials, "trials", fix="each trial checks the function on fresh random inputs")
    if seed is not None:
        check_count(seed, "seed", minimum=0, fix="a whole number such as 0, or None for a new one")
    gen = torch.Generator().manual_seed(random.randrange(2**31) if seed is None else seed)
    for _ in range(trials):
        for args in ex.cases(gen):
            expected = ex.run(ex.reference, args)
            ran, got = run_learner(name, lambda *copies: ex.run(fn, copies), args)
            if not ran:
                return False
            differs = kind_mismatch(got, expected)
            if differs:
                print(f"{name}: mismatch on inputs {describe(args)}: {differs}; return exactly "
                      "what the reference returns (convert with .to(dtype), torch.as_tensor, "
                      f"...).\n  hint: {ex.hint}")  # fmt: skip
                return False
            ok = ex.accepts(args, got, expected) if ex.accepts else ex.same(got, expected)
            if not ok:
                print(f"{name}: mismatch on inputs {describe(args)}")
                print(f"{where_it_differs(ex, args, got, expected)}\n  hint: {ex.hint}")
                return False
    print(f"{name}: correct on {trials} rounds of fresh random inputs (chapter {ex.chapter})")
    return True
