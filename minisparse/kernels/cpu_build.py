"""Building the CPU fast path: find a C compiler, compile once into the cache, load with ctypes.

The sparse loops (``kernels/cpu.c``) and the other C files of this package (``kernels/cpu_int8.c``,
``runtime/step.c``) are compiled on first use with the system C compiler (``$CC``, else
``cc``/``gcc``/``clang``) into minisparse's cache and loaded with ctypes. Building takes a few
seconds; every later process finds the compiled file and loads it in milliseconds.

A compiled library is only valid for what built it, so its file name carries a key
(``library_key``): a hash of the source, the compiler's command, resolved path and
``--version``, the flags, the platform and the CPU model with its feature flags. A changed
compiler or machine never loads a stale library. Compiling writes into a private temporary
folder, renames the library into place and stamps it with its SHA-256 (``NAME.sha256``
beside it); a library is loaded only when it matches its stamp, so a damaged file (an
interrupted copy, a full disk, a truncation that would kill the process in the dynamic
loader) or one put there by something else is compiled again, never loaded. So is one that
lacks a symbol the package declares. Folders and libraries are the user's alone (0700).

The flags try OpenMP (``-fopenmp``) and the chosen vector instructions (``-march=native``,
or a portable x86-64 level when that was measured faster here: ``cpu_isa``) first; a compiler
without OpenMP (stock macOS clang) builds a single-threaded library instead, with a warning
naming the fix. Without a usable compiler ``load_library`` returns None, after
one warning, and every function of ``minisparse.kernels.cpu`` runs through torch.
"""

from __future__ import annotations

import _ctypes
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

import torch

from .cpu_isa import Choice, available_targets, chosen_target, declare_probe

__all__ = [
    "BASE_FLAGS",
    "FLAG_LADDER",
    "LOOPS",
    "LOOPS_SOURCE",
    "PROBE_SOURCE",
    "Compiler",
    "build_choice",
    "cache_dir",
    "cpu_identity",
    "declare_loops",
    "describe_build",
    "find_compiler",
    "flag_ladder",
    "library_key",
    "load_library",
    "load_source_library",
    "resolve_compiler",
    "source_text",
    "with_local_headers",
]


BASE_FLAGS = ("-O3", "-shared", "-fPIC")


def flag_ladder(target: str = "native") -> tuple[tuple[str, ...], ...]:
    """Flags tried in order: OpenMP and ``-march=target`` first; a compiler that knows neither
    flag (stock macOS clang has no -fopenmp) still builds a plain, single-threaded library. A
    portable level (``x86-64-v3``) is never dropped: a compiler that does not know it fails
    that build, rather than making a baseline one under its name."""
    march = f"-march={target}"
    if target != "native":
        return (("-fopenmp", march), (march,))
    return (("-fopenmp", march), ("-fopenmp",), (march,), ())


FLAG_LADDER = flag_ladder()


@dataclass(frozen=True)
class Compiler:
    """A C compiler as found: the command (``$CC`` may hold arguments), its resolved executable
    and its ``--version`` output, all three part of the compiled library's cache key."""

    command: tuple[str, ...]
    path: str
    version: str


def cache_dir() -> Path:
    """Where compiled kernels live: ``cpu_kernels`` in minisparse's cache directory."""
    from ..files.cache import cache_dir as minisparse_cache_dir

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


#: Where the package's C files and their headers are: the kernels, and the decode step.
C_FOLDERS = (Path(__file__).parent, Path(__file__).parents[1] / "runtime")


def with_local_headers(source: str, folder: Path | None = None) -> str:
    """``source`` with each ``#include "NAME.h"`` replaced by that header of this package.

    The libraries are compiled from one text in a temporary folder (and cached under a hash
    of that text), so a shared header is pasted in rather than found on an include path; its
    changes then change the cache key too. A header is looked for in ``folder`` (when given),
    then in the package's C folders, ``kernels/`` and ``runtime/`` (``C_FOLDERS``). A header
    that includes another (``sparse_rows.h`` includes ``abi.h``) has it pasted in turn, once:
    the first paste of a header wins, a later include of it is dropped (as an include guard
    would).
    """
    folders = ([folder] if folder is not None else []) + list(C_FOLDERS)
    pasted: set[str] = set()

    def paste(match: re.Match[str]) -> str:
        name = match.group(1)
        if name in pasted:
            return ""
        pasted.add(name)
        found = next((f / name for f in folders if (f / name).is_file()), None)
        if found is None:
            raise FileNotFoundError(f'#include "{name}": no such header in {folders}')
        return with_pasted(found.read_text())

    def with_pasted(text: str) -> str:
        return re.sub(r'^#include "([\w.]+\.h)"$', paste, text, flags=re.MULTILINE)

    return with_pasted(source)


def source_text(filename: str) -> str:
    """A C file of the package (``kernels/cpu.c``, ``runtime/step.c``: relative to the package)
    with its local headers pasted in: what is compiled and hashed."""
    return with_local_headers((Path(__file__).parents[1] / filename).read_text())


LOOPS = "kernels/cpu.c"  # the sparse loops, the default library
PROBE_SOURCE = "runtime/step.c"  # the decode step, whose isa_probe chooses the build
LOOPS_SOURCE = source_text(LOOPS)


def declare_loops(lib: ctypes.CDLL) -> None:
    """Argument and result types of ``cpu.c``'s functions (ctypes trusts them)."""
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    gemv_args = [ptr, i64, i64, ptr, i64, i64, ptr, i64, ptr, c_int, c_int]
    for fn in (lib.gather_gemv_f32, lib.scatter_gemv_f32):
        fn.argtypes, fn.restype = gemv_args, c_int
    lib.team_size.argtypes, lib.team_size.restype = [c_int], c_int
    lib.built_with_openmp.argtypes, lib.built_with_openmp.restype = [], c_int


def library_key(compiler: Compiler, source: str = LOOPS_SOURCE, target: str = "native") -> str:
    """Hash of everything the compiled file depends on: source, compiler, flags, platform, CPU."""
    parts = [
        source,
        " ".join(compiler.command),
        compiler.path,
        compiler.version,
        repr(BASE_FLAGS),
        repr(flag_ladder(target)),
        sys.platform,
        cpu_identity(),
    ]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _stamp(path: Path) -> Path:
    """The file beside a library that holds the hash of the library as its build wrote it."""
    return path.with_suffix(".sha256")


def _verified(path: Path) -> bool:
    """True when ``path`` is exactly what a finished build wrote (its hash matches the stamp).

    A truncated or replaced library is never handed to the dynamic loader: loading a truncated
    ELF file can kill the process with a bus error, and loading a foreign one runs its code.
    """
    try:
        return _stamp(path).read_text().strip() == _digest(path)
    except OSError:
        return False


def _compile(compiler: Compiler, out: Path, source: str, target: str) -> None:
    """Compile ``source`` to the shared library ``out`` with the first flags of
    ``flag_ladder(target)`` the compiler accepts: in a private temporary folder, then renamed
    into place (atomic) and stamped with its hash. The folder and the library are the user's
    alone (0700), whatever the umask."""
    out.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(out.parent, 0o700)  # the libraries' own folder: private even if made before
    from ..files.cache import sweep_temporaries

    sweep_temporaries(out.parent)  # what killed compiles left, once it is an hour old
    with tempfile.TemporaryDirectory(dir=out.parent, suffix=".tmp") as tmp:
        src = Path(tmp) / "source.c"
        src.write_text(source)
        lib = Path(tmp) / out.name
        base = [*compiler.command, *BASE_FLAGS, str(src), "-o", str(lib), "-lm"]
        last_error = ""
        for extra in flag_ladder(target):
            proc = subprocess.run(
                base + list(extra), capture_output=True, text=True, check=False, timeout=300
            )
            if proc.returncode == 0:
                os.chmod(lib, 0o700)
                stamp = Path(tmp) / "stamp"
                stamp.write_text(_digest(lib))
                os.chmod(stamp, 0o600)
                os.replace(lib, out)
                os.replace(stamp, _stamp(out))
                return
            last_error = proc.stderr.strip()
        raise RuntimeError(last_error)


def _open(
    compiler: Compiler, path: Path, source: str, target: str, declare: Callable[[ctypes.CDLL], None]
) -> ctypes.CDLL:
    """The library at ``path``, loaded and declared; compiled first when it is missing, does
    not match its stamp (truncated, replaced), or lacks a symbol ``declare`` needs."""
    if not _verified(path):
        _compile(compiler, path, source, target)
    lib = None
    try:
        lib = ctypes.CDLL(str(path))
        declare(lib)
        return lib
    except (OSError, AttributeError):  # a stamped file that still does not load: build again
        if lib is not None:  # else the loader would hand back the same library for this path
            _ctypes.dlclose(lib._handle)
        path.unlink(missing_ok=True)
        _compile(compiler, path, source, target)
        lib = ctypes.CDLL(str(path))
        declare(lib)
        return lib


def build_for(
    compiler: Compiler,
    filename: str,
    target: str,
    declare: Callable[[ctypes.CDLL], None] = lambda lib: None,
) -> ctypes.CDLL:
    """``filename`` compiled for ``target`` (cached under its key), loaded and declared."""
    source, stem = source_text(filename), Path(filename).stem
    key = library_key(compiler, source, target)
    return _open(compiler, cache_dir() / f"{stem}_{key}.so", source, target, declare)


def _usable_compiler() -> Compiler | None:
    spec = find_compiler()
    return None if spec is None else resolve_compiler(spec)


@functools.lru_cache(maxsize=1)
def build_choice() -> Choice | None:
    """The target every library of this process is compiled for (``cpu_isa.chosen_target``,
    measured once per machine and compiler, the choice saved in the cache); None without a
    usable compiler or off Linux and macOS."""
    if not sys.platform.startswith("linux") and sys.platform != "darwin":
        return None
    compiler = _usable_compiler()
    if compiler is None:
        return None
    targets = available_targets()
    saved = cache_dir() / f"march_{library_key(compiler, source_text(PROBE_SOURCE), 'auto')}.json"
    return chosen_target(
        targets,
        lambda t: build_for(compiler, PROBE_SOURCE, t, declare_probe),
        saved,
        torch.get_num_threads(),
    )


def describe_build() -> str:
    """One line on the compiled kernels: compiler and target, or why the torch path runs."""
    choice = build_choice()
    if choice is None:
        spec = find_compiler()
        why = "no C compiler found" if spec is None else f"the C compiler {spec!r} is not usable"
        return f"torch path ({why})"
    compiler = _usable_compiler()
    version = compiler.version.splitlines()[0] if compiler else "?"
    return f"C kernels: {version}, {choice.describe()}"


@functools.lru_cache(maxsize=1)
def load_library() -> ctypes.CDLL | None:
    """The compiled fast kernels, or None (with a one-time warning naming the fix)."""
    if not sys.platform.startswith("linux") and sys.platform != "darwin":
        return None
    spec = find_compiler()
    compiler = None if spec is None else resolve_compiler(spec)
    choice = None if compiler is None else build_choice()
    if compiler is None or choice is None:
        named = "No C compiler found" if spec is None else f"The C compiler {spec!r} is not usable"
        warnings.warn(
            f"{named}, so minisparse's CPU sparse kernels fall back to index_select + matmul, "
            "which is slower than dense. Install gcc or clang (or set CC) for the fast path.",
            stacklevel=3,
        )
        return None
    try:
        lib = build_for(compiler, LOOPS, choice.target, declare_loops)
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
    """Another C file of this package (e.g. ``runtime/step.c``), compiled like the sparse
    loops (same compiler, flags and cache key rules) and declared by ``declare``; None when the
    fast path is unavailable (after the one warning ``load_library`` gives)."""
    if load_library() is None:
        return None
    compiler, choice = resolve_compiler(find_compiler() or ""), build_choice()
    try:
        lib = build_for(compiler, filename, choice.target, declare)
    except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as err:
        warnings.warn(
            f"Compiling minisparse's {filename} with {compiler.path!r} failed ({err}); the "
            "torch path runs instead.",
            stacklevel=3,
        )
        return None
    return lib
