"""Which instruction set the compiled kernels target: the host's own, or a portable x86 level.

``-march=native`` gives the compiler every instruction the CPU has *and* its tuning for that
core, and the tuning can lose. GCC 12 on an Intel Xeon with AVX-512 resolves ``native`` to
``rocketlake``, whose tuning prefers 256-bit vectors; it then kept the C code's generic
64-byte vectors in memory, and the decode step ran at 17 tokens/s where the same C built for
``x86-64-v3`` (AVX2 + FMA) ran at 45. ``simd.h`` now names the 512-bit registers, but a
build can always lose to another for reasons of its own, so nothing is taken on trust:

* ``chosen_target`` picks the build. On first use it compiles ``runtime/step.c`` for the host
  (``native``) and for ``x86-64-v3`` when the CPU has it, times the file's ``isa_probe``
  workload with each (the products of a decode step: float32 rows and columns, int8 and 4-bit
  rows, one and five tokens), the two alternating, median of repeats, and keeps the faster;
  ``native`` keeps its place unless the other is more than ``MARGIN`` faster. The choice and
  its timings are saved beside the libraries, under a key like theirs (source, compiler, CPU),
  so it is measured once per machine and compiler.
* ``MINISPARSE_MARCH`` (``native``, ``x86-64-v3``, ``x86-64-v2`` or ``auto``, the default)
  overrides it; ``minisparse bench isa`` times every target side by side on whole decode steps.

Off x86 (ARM, ...) the only target is ``native`` and nothing is measured.
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import statistics
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = [
    "ENV_VAR",
    "LEVEL_FLAGS",
    "MARGIN",
    "TARGETS",
    "Choice",
    "available_targets",
    "chosen_target",
    "declare_probe",
    "requested_target",
    "time_probe",
]

ENV_VAR = "MINISPARSE_MARCH"
TARGETS = ("native", "x86-64-v3", "x86-64-v2")
# The CPU flags (Linux /proc/cpuinfo names) each portable x86-64 level needs (the psABI's
# definitions; lzcnt is reported as abm). A CPU that lacks one never runs that build.
_V2 = ("cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3")
LEVEL_FLAGS = {
    "x86-64-v2": _V2,
    "x86-64-v3": (*_V2, "avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"),
}
MARGIN = 1.03  # another build must be 3 % faster than native to replace it (timing noise)
PROBE_ROWS, PROBE_REPS, ROUNDS = 2048, 8, 7


@dataclass(frozen=True)
class Choice:
    """The build the kernels use, and why: ``seconds`` per probe call of each target timed
    (empty when nothing was measured: an override, or a single target)."""

    target: str
    reason: str
    seconds: dict[str, float]

    def describe(self) -> str:
        """One line: the target and, when measured, how it compared."""
        if len(self.seconds) < 2:
            return f"-march={self.target} ({self.reason})"
        native = self.seconds.get("native")
        ratios = ", ".join(
            f"{t} {native / s:.2f}x" for t, s in self.seconds.items() if native and t != "native"
        )
        return f"-march={self.target} ({self.reason}; probe speed vs native: {ratios})"


def cpu_flags(cpuinfo: str) -> set[str]:
    """The feature flags of /proc/cpuinfo's first ``flags`` line."""
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def available_targets(cpuinfo: str | None = None, machine: str | None = None) -> tuple[str, ...]:
    """``native`` and the portable x86-64 levels this CPU runs, in ``TARGETS`` order
    (``cpuinfo``: the text of /proc/cpuinfo, read when None)."""
    if (machine or platform.machine()).lower() not in ("x86_64", "amd64"):
        return ("native",)
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    flags = cpu_flags(cpuinfo)
    return tuple(t for t in TARGETS if t == "native" or set(LEVEL_FLAGS[t]) <= flags)


def requested_target() -> str:
    """``MINISPARSE_MARCH`` checked: a target name, or ``auto`` (unset or empty)."""
    value = os.environ.get(ENV_VAR, "").strip() or "auto"
    if value not in ("auto", *TARGETS):
        raise ValueError(
            f"{ENV_VAR}={value!r} is not a build target; use one of auto, {', '.join(TARGETS)} "
            "(or unset it)."
        )
    return value


def declare_probe(lib: ctypes.CDLL) -> None:
    """ctypes types of ``runtime/step.c``'s ``isa_probe(rows, reps, threads, &seconds) ->
    checksum``."""
    lib.isa_probe.argtypes = [
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int,
        ctypes.POINTER(ctypes.c_double),
    ]
    lib.isa_probe.restype = ctypes.c_double


def time_probe(
    libs: dict[str, ctypes.CDLL], threads: int, rounds: int | None = None
) -> dict[str, float]:
    """Median seconds of the ``isa_probe`` work per library (timed inside C, without its
    setup), the libraries alternating within each round (``ROUNDS`` by default), the order
    rotating from round to round, after one warm-up call each."""
    rounds = ROUNDS if rounds is None else rounds
    names = list(libs)
    seconds: dict[str, list[float]] = {name: [] for name in libs}
    for round_ in range(rounds + 1):
        start = round_ % len(names)
        for name in names[start:] + names[:start]:
            elapsed = ctypes.c_double(0.0)
            check = libs[name].isa_probe(PROBE_ROWS, PROBE_REPS, threads, ctypes.byref(elapsed))
            if check != check:  # NaN: the probe could not allocate its matrices
                raise MemoryError("isa_probe could not allocate its matrices")
            if round_:
                seconds[name].append(elapsed.value)
    return {name: statistics.median(s) for name, s in seconds.items()}


def _pick(seconds: dict[str, float]) -> Choice:
    """native unless another target is more than MARGIN faster; then the fastest."""
    best = min(seconds, key=seconds.__getitem__)
    if best != "native" and seconds["native"] > MARGIN * seconds[best]:
        return Choice(best, "measured faster than the native build", seconds)
    return Choice("native", "measured at least as fast as the others", seconds)


def _read(path: Path) -> Choice | None:
    """A saved choice, or None when missing or damaged (then it is measured again)."""
    try:
        data = json.loads(path.read_text())
        choice = Choice(str(data["target"]), str(data["reason"]), dict(data["seconds"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return choice if choice.target in TARGETS else None


def _write(path: Path, choice: Choice) -> None:
    """Save atomically; a failure (a read-only cache, a full disk) only costs a re-measure."""
    from ..files.cache import atomic_write_text

    try:
        atomic_write_text(path, json.dumps(asdict(choice)))
    except OSError:
        pass


def chosen_target(
    candidates: Sequence[str],
    build: Callable[[str], ctypes.CDLL],
    saved: Path,
    threads: int,
) -> Choice:
    """The target to compile every kernel for (see the module docstring).

    ``candidates``: what this CPU runs (``available_targets``); ``build(target)`` compiles and
    loads ``runtime/step.c`` for a target (cached like every library); ``saved``: the file that
    keeps the choice for this source, compiler and CPU.
    """
    requested = requested_target()
    if requested != "auto":
        if requested not in candidates:
            raise ValueError(
                f"{ENV_VAR}={requested} needs instructions this CPU lacks; it runs "
                f"{', '.join(candidates)}."
            )
        return Choice(requested, f"set by {ENV_VAR}", {})
    contenders = [t for t in candidates if t in ("native", "x86-64-v3")]
    if len(contenders) < 2:
        return Choice("native", "the only build for this CPU", {})
    if (choice := _read(saved)) is not None:
        return choice
    from ..files.cache import exclusive_lock

    # one process measures (two at once would disturb each other); the others wait, then read
    with exclusive_lock(saved.with_suffix(".lock")):
        if (choice := _read(saved)) is not None:
            return choice
        return _measure(contenders, build, saved, threads)


def _measure(
    contenders: Sequence[str], build: Callable[[str], ctypes.CDLL], saved: Path, threads: int
) -> Choice:
    """Build and time the contenders, save and return the choice (native when one fails)."""
    try:
        libs = {}
        for target in contenders:
            libs[target] = build(target)
            declare_probe(libs[target])
        choice = _pick(time_probe(libs, threads))
    except (OSError, RuntimeError, AttributeError, MemoryError, subprocess.SubprocessError) as err:
        return Choice("native", f"the other builds could not be timed: {err}", {})
    _write(saved, choice)
    return choice
