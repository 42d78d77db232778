"""Prepare the course's long artifacts in one go: ``minisparse prepare`` (or ``./run prepare``).

Two results take too long to make inside a notebook on a laptop CPU, so chapters load them
from the cache and fall back to a lighter model when they are missing (each notebook says
which one ran):

* the fine-tuned ReLU model of chapter 04 (``minisparse relufy --stage 1 --steps 200``), used
  by chapters 05, 06, 08 and 11;
* per-layer sparsity predictors for that model (``minisparse predictors``), used by chapter 11's
  engine and by ``minisparse bench engine``.

``prepare`` lists each artifact with its state and an estimate of its time, then makes the
missing ones in order, with a progress bar over the steps (each step shows its own bar). It is
safe to interrupt: the ReLU fine-tune resumes from its checkpoint, and a finished artifact is
never made twice. An artifact counts as done only when its file reads back (a damaged file is
listed as such and made again).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from ..files.cache import cache_dir

__all__ = ["ARTIFACTS", "Artifact", "add_arguments", "plan", "run"]


@dataclass(frozen=True)
class Artifact:
    """One long result: where it lands, the command that makes it, what uses it."""

    name: str
    path: Callable[[], Path]  # the file that holds it
    argv: tuple[str, ...]  # arguments of ``minisparse`` that make it
    minutes: float  # measured on 2 cores of a 2024 server CPU (AMD EPYC, AVX-512)
    used_by: str
    check: Callable[[Path], object]  # reads the file; raises ValueError when it is damaged

    def problem(self) -> str | None:
        """Why the artifact is not usable ("missing", or the damage found), or None."""
        path = self.path()
        if not path.exists():
            return "missing"
        try:
            self.check(path)
        except ValueError as err:
            return f"damaged ({err})"
        return None

    def done(self) -> bool:
        return self.problem() is None

    def command(self) -> str:
        return "minisparse " + " ".join(self.argv)


def _relu_model() -> Path:
    from ..relufy.recipe import result_dir

    return result_dir(1, "mlp") / "model.safetensors"


def _relu_predictors() -> Path:
    return cache_dir() / "predictors" / "smollm2-135m-relu-lowrank.safetensors"


def _read_relu_model(path: Path) -> object:
    from ..relufy.recipe import read_relufied

    return read_relufied(path)


def _read_predictors(path: Path) -> object:
    from ..predictors.collection import read_predictors_file

    return read_predictors_file(path)


def _recovered_adapters() -> Path:
    from ..peft.recover import adapters_path

    return adapters_path()


def _read_adapters(path: Path) -> object:
    from ..peft.recover import read_adapters

    return read_adapters(path)


ARTIFACTS = (
    Artifact(
        "ReLU model (chapter 04)",
        _relu_model,
        ("relufy", "--stage", "1", "--steps", "200"),
        31.0,
        "chapters 05, 06, 08, 11",
        _read_relu_model,
    ),
    Artifact(
        "ReLU model's predictors (chapter 06)",
        _relu_predictors,
        ("predictors",),
        3.0,
        "chapter 11, minisparse bench engine",
        _read_predictors,
    ),
    Artifact(
        "QLoRA adapters of the 2:4-pruned model (chapter 12)",
        _recovered_adapters,
        ("recover",),
        15.0,
        "chapter 12 (peft.load_recovered)",
        _read_adapters,
    ),
)


def plan(artifacts: tuple[Artifact, ...] = ARTIFACTS) -> str:
    """A table of the artifacts: done or to make, the time estimate, the command."""
    lines = [f"cache: {cache_dir()}"]
    for a in artifacts:
        problem = a.problem()
        state = (
            "done" if problem is None else f"{problem}: to make, ~{a.minutes:.0f} min on 2 cores"
        )
        lines.append(f"- {a.name}: {state}\n    `{a.command()}` (for {a.used_by})")
    missing = [a for a in artifacts if not a.done()]
    total = sum(a.minutes for a in missing)
    lines.append(f"{len(missing)} to make, about {total:.0f} min" if missing else "all done")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--list", action="store_true", help="only show what is done and what is missing"
    )


def run(args: argparse.Namespace) -> int:
    """Show the plan, then make every missing artifact in order (the ``prepare`` command)."""
    print(plan(), flush=True)
    missing = [a for a in ARTIFACTS if not a.done()]
    if args.list or not missing:
        return 0
    bar = tqdm(total=sum(a.minutes for a in missing), desc="prepare", unit="min", position=0)
    with bar:
        for a in missing:
            bar.set_postfix_str(a.name)
            a.path().unlink(missing_ok=True)  # a damaged file is made again, not resumed from
            start = time.perf_counter()
            status = subprocess.run([sys.executable, "-m", "minisparse", *a.argv]).returncode
            if status != 0 or not a.done():
                print(f"`{a.command()}` did not finish (status {status}); run it alone to see why.")
                return status or 1
            bar.update(a.minutes)
            bar.write(f"{a.name}: done in {(time.perf_counter() - start) / 60:.1f} min")
    return 0
