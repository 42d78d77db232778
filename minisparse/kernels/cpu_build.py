"""Building the CPU fast path: find a C compiler, compile once into the cache, load with ctypes.

The loops of ``minisparse.kernels.cpu_loops`` (and other C files of this package, such as
``decode_step.c``) are compiled on first use with the system C compiler (``$CC``, else
``cc``/``gcc``/``clang``) into minisparse's cache and loaded with ctypes. Building takes a few
seconds; every later process finds the compiled file and loads it in milliseconds.

A compiled library is only valid for what built it, so its file name carries a key
(``library_key``): a hash of the source, the compiler's command, resolved path and
``--version``, the flags, the platform and the CPU model with its feature flags. A changed
compiler or machine never loads a stale library; a damaged file (an interrupted copy, a full
disk) is compiled again. Compiling writes to a temporary file and renames it into place.

The flags try OpenMP (``-fopenmp``) and the host's vector instructions (``-march=native``)
first; a compiler without OpenMP (stock macOS clang) builds a single-threaded library instead,
with a warning naming the fix. Without a usable compiler ``load_library`` returns None, after
one warning, and every function of ``minisparse.kernels.cpu`` runs through torch.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .cpu_loops import C_SOURCE, declare_loops

__all__ = [
    "BASE_FLAGS",
    "FLAG_LADDER",
    "Compiler",
    "cache_dir",
    "cpu_identity",
    "find_compiler",
    "library_key",
    "load_library",
    "load_source_library",
    "resolve_compiler",
    "with_local_headers",
]


BASE_FLAGS = ("-O3", "-shared", "-fPIC")
# Tried in order: OpenMP and the host's vector instructions first; a compiler that knows neither
# flag (stock macOS clang has no -fopenmp) still builds a plain, single-threaded library.
FLAG_LADDER = (("-fopenmp", "-march=native"), ("-fopenmp",), ("-march=native",), ())


@dataclass(frozen=True)
class Compiler:
    """A C compiler as found: the command (``$CC`` may hold arguments), its resolved executable
    and its ``--version`` output, all three part of the compiled library's cache key."""

    command: tuple[str, ...]
    path: str
    version: str


def cache_dir() -> Path:
    """Where compiled kernels live: ``cpu_kernels`` in minisparse's cache directory."""
    from ..cache import cache_dir as minisparse_cache_dir

    return minisparse_cache_dir() / "cpu_kernels"


def cpu_identity() -> str:
    """The CPU model and its feature flags: a library built with -march=native is only valid on
    the kind of CPU that built it, so this goes into the cache key."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine() + platform.processor()
    lines = [line for line in info.splitlines() if line.startswith(("model name", "flags"))]
    return platform.machine() + "".join(sorted(set(lines)))


def find_compiler() -> str | None:
    """$CC if set, else the first of cc, gcc, clang on PATH."""
    if os.environ.get("CC"):
        return os.environ["CC"]
    for name in ("cc", "gcc", "clang"):
        if shutil.which(name):
            return name
    return None


def resolve_compiler(spec: str) -> Compiler | None:
    """The compiler a command names, or None when it is not an executable that answers
    ``--version`` (a typo in $CC, a removed compiler)."""
    try:
        command = tuple(shlex.split(spec))
    except ValueError:
        return None
    found = shutil.which(command[0]) if command else None
    if found is None:
        return None
    path = os.path.realpath(found)
    try:
        proc = subprocess.run(
            [found, *command[1:], "--version"], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode != 0:
        return None
    return Compiler(command, path, (proc.stdout + proc.stderr).strip())


def with_local_headers(source: str, folder: Path | None = None) -> str:
    """``source`` with each ``#include "NAME.h"`` replaced by that header of this package.

    The libraries are compiled from one text in a temporary folder (and cached under a hash
    of that text), so a shared header is pasted in rather than found on an include path; its
    changes then change the cache key too.
    """
    folder = folder or Path(__file__).parent

    def paste(match: re.Match[str]) -> str:
        return (folder / match.group(1)).read_text()

    return re.sub(r'^#include "([\w.]+\.h)"$', paste, source, flags=re.MULTILINE)


# The sparse loops' text with simd.h pasted in: what is compiled and hashed.
LOOPS_SOURCE = with_local_headers(C_SOURCE)


def library_key(compiler: Compiler, source: str = LOOPS_SOURCE) -> str:
    """Hash of everything the compiled file depends on: source, compiler, flags, platform, CPU."""
    parts = [
        source,
        " ".join(compiler.command),
        compiler.path,
        compiler.version,
        repr(BASE_FLAGS),
        repr(FLAG_LADDER),
        sys.platform,
        cpu_identity(),
    ]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _compile(compiler: Compiler, out: Path, source: str = LOOPS_SOURCE) -> None:
    """Compile ``source`` to the shared library ``out`` with the first flags of FLAG_LADDER the
    compiler accepts (atomically: a temporary file, then a rename)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src = Path(tmp) / "source.c"
        src.write_text(source)
        lib = Path(tmp) / out.name
        base = [*compiler.command, *BASE_FLAGS, str(src), "-o", str(lib), "-lm"]
        last_error = ""
        for extra in FLAG_LADDER:
            proc = subprocess.run(
                base + list(extra), capture_output=True, text=True, check=False, timeout=300
            )
            if proc.returncode == 0:
                os.replace(lib, out)
                return
            last_error = proc.stderr.strip()
        raise RuntimeError(last_error)


def _open(compiler: Compiler, path: Path, source: str = LOOPS_SOURCE) -> ctypes.CDLL:
    """The library at ``path``, compiled first when missing or damaged."""
    if not path.exists():
        _compile(compiler, path, source)
    try:
        return ctypes.CDLL(str(path))
    except OSError:  # a damaged file (an interrupted copy, a full disk): build it again
        path.unlink(missing_ok=True)
        _compile(compiler, path, source)
        return ctypes.CDLL(str(path))


@functools.lru_cache(maxsize=1)
def load_library() -> ctypes.CDLL | None:
    """The compiled fast kernels, or None (with a one-time warning naming the fix)."""
    if not sys.platform.startswith("linux") and sys.platform != "darwin":
        return None
    spec = find_compiler()
    compiler = None if spec is None else resolve_compiler(spec)
    if compiler is None:
        named = "No C compiler found" if spec is None else f"The C compiler {spec!r} is not usable"
        warnings.warn(
            f"{named}, so minisparse's CPU sparse kernels fall back to index_select + matmul, "
            "which is slower than dense. Install gcc or clang (or set CC) for the fast path.",
            stacklevel=3,
        )
        return None
    try:
        lib = _open(compiler, cache_dir() / f"sparse_gemv_{library_key(compiler)}.so")
        declare_loops(lib)
    except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as err:
        warnings.warn(
            f"Compiling minisparse's CPU sparse kernels with {compiler.path!r} failed ({err}); "
            "falling back to index_select + matmul. Install gcc or clang (or set CC) for the "
            "fast path.",
            stacklevel=3,
        )
        return None
    if not lib.built_with_openmp():
        warnings.warn(
            f"{compiler.path!r} has no OpenMP (-fopenmp), so minisparse's CPU sparse kernels run "
            "on one core. Install an OpenMP-capable gcc or clang (macOS: brew install libomp "
            "llvm, then CC=$(brew --prefix llvm)/bin/clang) for the parallel fast path.",
            stacklevel=3,
        )
    return lib


def load_source_library(
    filename: str, declare: Callable[[ctypes.CDLL], None]
) -> ctypes.CDLL | None:
    """Another C file of this package (e.g. ``decode_step.c``), compiled like the sparse
    loops (same compiler, flags and cache key rules) and declared by ``declare``; None when the
    fast path is unavailable (after the one warning ``load_library`` gives)."""
    if load_library() is None:
        return None
    compiler = resolve_compiler(find_compiler() or "")
    source = with_local_headers((Path(__file__).parent / filename).read_text())
    key = library_key(compiler, source)
    try:
        lib = _open(compiler, cache_dir() / f"{Path(filename).stem}_{key}.so", source)
        declare(lib)
    except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as err:
        warnings.warn(
            f"Compiling minisparse's {filename} with {compiler.path!r} failed ({err}); the "
            "torch path runs instead.",
            stacklevel=3,
        )
        return None
    return lib
