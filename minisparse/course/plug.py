"""``use``: grade the learner's code, then let the rest of the chapter run on it.

A chapter's core build is a stub the learner fills in, followed by one line:

    apply_rope = use("rope", my_apply_rope)

``use`` checks ``my_apply_rope`` as ``check`` does. When it passes, the returned ``Impl`` calls the
learner's function and every later cell that takes it (the model's attention, the quantizer, the
speculative loop) runs the learner's code; when it does not pass yet, or is still a stub, the
``Impl`` calls the library's own version, so the notebook still runs top to bottom. Either way
``impl.who`` says whose code ran, and the chapter prints it next to what it measured.

With the environment variable ``MINISPARSE_SOLUTIONS`` set to a folder (the course's own
``notebooks/solutions``), ``use`` takes the worked solution from ``<folder>/<name>.py`` in place of
the learner's function: the test suite runs every notebook this way, so the learner's path (their
code plugged into the real model) is executed end to end.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .grading import check, exercise

__all__ = ["SOLUTIONS_ENV", "Impl", "solution", "use"]

SOLUTIONS_ENV = "MINISPARSE_SOLUTIONS"

YOURS, SOLUTION, LIBRARY = "yours", "the worked solution", "the library's"


@dataclass(frozen=True)
class Impl:
    """The implementation a chapter runs for build ``name``: callable like the function itself."""

    name: str
    fn: Callable[..., Any]
    who: str  # "yours", "the worked solution" or "the library's"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    @property
    def learners(self) -> bool:
        """True when the learner's code (or the worked solution standing in for it) runs."""
        return self.who != LIBRARY

    def __str__(self) -> str:
        return f"{self.name}: {self.who}"


def solution(name: str, folder: str | Path) -> Callable[..., Any]:
    """The worked solution of exercise ``name``: the function its file in ``folder`` defines."""
    ex = exercise(name)
    path = Path(folder) / f"{name}.py"
    if not path.is_file():
        raise FileNotFoundError(
            f"No worked solution {path}; set {SOLUTIONS_ENV} to the course's notebooks/solutions "
            "folder, or unset it to run your own code."
        )
    spec = importlib.util.spec_from_file_location(f"solution_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except SyntaxError as err:
        raise ValueError(
            f"{path} is not valid Python (line {err.lineno}: {err.msg}); fix it, or unset "
            f"{SOLUTIONS_ENV} to run your own code."
        ) from None
    if not hasattr(module, ex.function):
        raise AttributeError(
            f"{path} must define {ex.function}, the function exercise {name!r} asks for."
        )
    return getattr(module, ex.function)


def use(name: str, fn: Callable[..., Any], trials: int = 3, seed: int | None = None) -> Impl:
    """Grade ``fn`` for build ``name`` and return what the chapter runs from here on.

    Yours when it passes (or the worked solution, under ``MINISPARSE_SOLUTIONS``), else the
    library's, with one line saying which."""
    ex = exercise(name)
    folder = os.environ.get(SOLUTIONS_ENV)
    who = YOURS
    if folder:  # one round: the unit tests check every worked solution on several seeds
        fn, who, trials = solution(name, folder), SOLUTION, 1
        print(f"{name}: {SOLUTIONS_ENV} is set, so the worked solution stands in for yours")
    if check(name, fn, trials=trials, seed=seed):
        print(f"{name}: from here on the chapter runs {ex.function} ({who})")
        return Impl(name, fn, who)
    print(f"{name}: until yours passes, the chapter runs {ex.function} ({LIBRARY})")
    return Impl(name, ex.reference, LIBRARY)
