"""The CPU fast path: sparse GEMVs that run at the memory-bandwidth limit on a CPU.

Same three functions, same signatures and results as the Triton kernels (``gather_gemv``,
``sparse_input_gemv``, ``sparse_ffn``). At batch 1 a GEMV streams its weights once, so a
kernel that skips a fraction s of them can at best take (1 - s) of the dense time. Getting
there on a CPU takes three things, each one measured in the chapter's benchmark:

1. **No copy.** ``W.index_select(0, idx) @ x`` first copies the active rows to a new tensor
   (read n K, write n K, read n K again): several times slower than the fused loop below, and
   often slower than dense.
2. **Software prefetch.** A gathered row is a short, isolated burst (16 KiB for K = 4096 fp32).
   The hardware prefetcher needs a few misses to lock onto each new burst, and the gaps between
   active rows defeat it, so a plain loop loses up to half the bandwidth. While it multiplies
   row i, the kernel asks for row i + 1 (``__builtin_prefetch``), so the next burst is already
   in flight.
3. **Huge pages.** Random rows touch a new 4 KiB page every 4 KiB, and each page costs a TLB
   miss and a page walk that a dense stream amortises. Weights placed in 2 MiB transparent
   huge pages (``hugepage_copy``; Linux, ``madvise(MADV_HUGEPAGE)``) remove most of them.

The column-sparse loop also sums its rows in groups of eight in registers before adding them to
the output: more streams in flight, and a rounding chain of n / 8 additions instead of n, which
keeps it as accurate as the dense GEMV on a 30-layer model.

The loops are a few lines of C, compiled on first use with the system C compiler
(``$CC``, else ``cc``/``gcc``/``clang``) into minisparse's cache and loaded with ctypes. The
compiled file is keyed on the source, the compiler's resolved path and ``--version``, the flags
and the CPU, so a changed compiler or machine never loads a stale library. The flags try OpenMP
(``-fopenmp``) first; a compiler without it (stock macOS clang) builds a single-threaded
library instead. The parallel loops take their thread count from ``torch.get_num_threads()``
at every call, so ``torch.set_num_threads`` (and the CLI's ``--threads``) apply to them too.
Without a compiler every function still works, through torch (``index_select`` + matmul), and
says once how to get the fast path. The fast loops take float32; other dtypes use the torch path.

Every public function checks its arguments first (``validate``); the C loops check the indices
again before they read a weight and report allocation failures, so no input can make them read
or write outside the tensors (``ValueError`` or ``MemoryError`` instead).

Layouts are those of the Triton kernels: ``W`` [N, K] row-major for row sparsity, ``W_t`` [K, N]
(W transposed, contiguous) for column sparsity, so the sparse dimension is always the outer one.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
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
from torch import Tensor

from .reference import apply_activation, gather_gemv_ref
from .validate import (
    check_ffn,
    check_float32_cpu,
    check_gather,
    check_indices,
    check_matrix,
    check_same_device,
    check_sparse_input,
    check_tensor,
    check_threshold,
    check_vector,
)

C_SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#define THREAD_ID() omp_get_thread_num()
#else
#define THREAD_ID() 0
#endif

/* Below this many weights a call stays on one thread: waking the others costs more. */
#define PARALLEL_MIN (1 << 20)

/* Return codes: Python turns them into ValueError / MemoryError. */
#define OK 0
#define BAD_INDEX 1
#define NO_MEMORY 2

/* 16 floats in one vector register (AVX-512), or split over smaller ones elsewhere. */
typedef float v16 __attribute__((vector_size(64), aligned(4)));
static inline v16 load16(const float* p) { v16 v; __builtin_memcpy(&v, p, 64); return v; }
static inline void store16(float* p, v16 v) { __builtin_memcpy(p, &v, 64); }

/* row . x with four independent vector accumulators; while it reads row, it asks the memory
   system for the same 256 bytes of the next row to come (next may be 0). */
static float dot_prefetch(const float* row, const float* x, int64_t K, const float* next) {
    v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
        if (next)
            for (int q = 0; q < 64; q += 16) __builtin_prefetch(next + k + q, 0, 0);
        a0 += load16(row + k) * load16(x + k);
        a1 += load16(row + k + 16) * load16(x + k + 16);
        a2 += load16(row + k + 32) * load16(x + k + 32);
        a3 += load16(row + k + 48) * load16(x + k + 48);
    }
    v16 s = (a0 + a1) + (a2 + a3);
    float acc = 0.0f;
    for (int q = 0; q < 16; q++) acc += s[q];
    for (; k < K; k++) acc += row[k] * x[k];
    return acc;
}

/* y += sum_r a[r] * rows[r] over a group of g <= GROUP rows. The group is summed in registers
   first and added to y once: y sees n / GROUP additions instead of n (a shorter rounding chain,
   fewer passes over y) and g streams are in flight at once. next[0..ng) is the next group. */
#define GROUP 8
static void axpy_group(float* y, const float* a, const float* const* rows, int g,
                       const float* const* next, int ng, int64_t N) {
    int64_t c = 0;
    for (; c + 64 <= N; c += 64) {
        for (int r = 0; r < ng; r++)
            for (int q = 0; q < 64; q += 16) __builtin_prefetch(next[r] + c + q, 0, 0);
        v16 s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
        for (int r = 0; r < g; r++) {
            const float* row = rows[r] + c;
            s0 += a[r] * load16(row);
            s1 += a[r] * load16(row + 16);
            s2 += a[r] * load16(row + 32);
            s3 += a[r] * load16(row + 48);
        }
        store16(y + c, load16(y + c) + s0);
        store16(y + c + 16, load16(y + c + 16) + s1);
        store16(y + c + 32, load16(y + c + 32) + s2);
        store16(y + c + 48, load16(y + c + 48) + s3);
    }
    for (; c < N; c++) {
        float acc = 0.0f;
        for (int r = 0; r < g; r++) acc += a[r] * rows[r][c];
        y[c] += acc;
    }
}

/* 1 when an index lies outside [0, n_rows): checked before any weight is read. */
static int bad_indices(const int64_t* idx, int64_t n, int64_t n_rows) {
    for (int64_t i = 0; i < n; i++)
        if (idx[i] < 0 || idx[i] >= n_rows) return 1;
    return 0;
}

/* Threads for a call of `work` weights: one below PARALLEL_MIN, else the caller's count. */
static int team(int64_t work, int num_threads) {
#ifdef _OPENMP
    return work >= PARALLEL_MIN && num_threads > 1 ? num_threads : 1;
#else
    (void)work;
    (void)num_threads;
    return 1;
#endif
}

/* Row-sparse GEMV: y[b, i] = sum_k W[idx[i], k] x[b, k]. Chunks of rows go to threads. */
int gather_gemv_f32(const float* W, int64_t n_rows, int64_t ldw, const float* x, int64_t B,
                    int64_t K, const int64_t* idx, int64_t n, float* y, int prefetch,
                    int num_threads) {
    if (bad_indices(idx, n, n_rows)) return BAD_INDEX;
    #pragma omp parallel for schedule(dynamic, 16) num_threads(team(n * K, num_threads))
    for (int64_t i = 0; i < n; i++) {
        const float* row = W + idx[i] * ldw;
        const float* next = (prefetch && i + 1 < n) ? W + idx[i + 1] * ldw : 0;
        for (int64_t b = 0; b < B; b++)  /* row i stays in L1/L2 across the batch */
            y[b * n + i] = dot_prefetch(row, x + b * K, K, b == 0 ? next : 0);
    }
    return OK;
}

/* Column-sparse GEMV: y[b, :] = sum_i v[b, i] Wt[idx[i], :] (y zeroed by the caller).
   Groups of GROUP active rows go to threads; each sums into its own buffer, then adds it to y.
   One thread sums straight into y. */
int scatter_gemv_f32(const float* Wt, int64_t n_rows, int64_t ldw, const float* v, int64_t B,
                     int64_t n, const int64_t* idx, int64_t N, float* y, int prefetch,
                     int num_threads) {
    if (bad_indices(idx, n, n_rows)) return BAD_INDEX;
    int nt = team(n * N, num_threads);
    size_t size = (size_t)B * (size_t)N;
    float* parts = y;
    if (nt > 1) {
        parts = (float*)calloc((size_t)nt * size, sizeof(float));
        if (!parts) return NO_MEMORY;
    }
    #pragma omp parallel num_threads(nt)
    {
        float* part = parts + (size_t)THREAD_ID() * size;
        #pragma omp for schedule(dynamic, 2) nowait
        for (int64_t grp = 0; grp < (n + GROUP - 1) / GROUP; grp++) {
            int64_t i0 = grp * GROUP;
            int g = n - i0 < GROUP ? (int)(n - i0) : GROUP;
            int ng = prefetch ? (n - i0 - g < GROUP ? (int)(n - i0 - g) : GROUP) : 0;
            const float* rows[GROUP];
            const float* next[GROUP];
            float a[GROUP];
            for (int r = 0; r < g; r++) rows[r] = Wt + idx[i0 + r] * ldw;
            for (int r = 0; r < ng; r++) next[r] = Wt + idx[i0 + g + r] * ldw;
            for (int64_t b = 0; b < B; b++) {
                for (int r = 0; r < g; r++) a[r] = v[b * n + i0 + r];
                axpy_group(part + b * N, a, rows, g, next, b == 0 ? ng : 0, N);
            }
        }
        if (nt > 1) {
            #pragma omp critical
            for (size_t c = 0; c < size; c++) y[c] += part[c];
        }
    }
    if (nt > 1) free(parts);
    return OK;
}

/* The size of the team a parallel region asking for num_threads gets (1 without OpenMP). */
int team_size(int num_threads) {
#ifdef _OPENMP
    int size = 1;
    #pragma omp parallel num_threads(num_threads > 0 ? num_threads : 1)
    {
        #pragma omp single
        size = omp_get_num_threads();
    }
    return size;
#else
    (void)num_threads;
    return 1;
#endif
}

/* 1 when compiled with OpenMP. */
int built_with_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}
"""

HUGE_PAGE = 2 * 2**20
MADV_HUGEPAGE = 14
BASE_FLAGS = ("-O3", "-shared", "-fPIC")
# Tried in order: OpenMP and the host's vector instructions first; a compiler that knows neither
# flag (stock macOS clang has no -fopenmp) still builds a plain, single-threaded library.
FLAG_LADDER = (("-fopenmp", "-march=native"), ("-fopenmp",), ("-march=native",), ())
BAD_INDEX, NO_MEMORY = 1, 2


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


def library_key(compiler: Compiler, source: str = C_SOURCE) -> str:
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


def _compile(compiler: Compiler, out: Path, source: str = C_SOURCE) -> None:
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


def _open(compiler: Compiler, path: Path, source: str = C_SOURCE) -> ctypes.CDLL:
    """The library at ``path``, compiled first when missing or damaged."""
    if not path.exists():
        _compile(compiler, path, source)
    try:
        return ctypes.CDLL(str(path))
    except OSError:  # a damaged file (an interrupted copy, a full disk): build it again
        path.unlink(missing_ok=True)
        _compile(compiler, path, source)
        return ctypes.CDLL(str(path))


def _declare(lib: ctypes.CDLL) -> None:
    """Argument and result types of the C functions (ctypes trusts them)."""
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    gemv_args = [ptr, i64, i64, ptr, i64, i64, ptr, i64, ptr, c_int, c_int]
    for fn in (lib.gather_gemv_f32, lib.scatter_gemv_f32):
        fn.argtypes, fn.restype = gemv_args, c_int
    lib.team_size.argtypes, lib.team_size.restype = [c_int], c_int
    lib.built_with_openmp.argtypes, lib.built_with_openmp.restype = [], c_int


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
        _declare(lib)
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
    source = (Path(__file__).parent / filename).read_text()
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


def fast_path_available() -> bool:
    """True when the compiled kernels loaded."""
    return load_library() is not None


def fast_path_threads() -> int:
    """Threads the compiled loops use for a large call now: ``torch.get_num_threads()`` when
    they were built with OpenMP, else 1; 0 without the compiled library."""
    lib = load_library()
    return 0 if lib is None else lib.team_size(_threads())


def _threads() -> int:
    """The thread count torch uses now (``torch.set_num_threads``, the CLI's ``--threads``)."""
    return max(1, torch.get_num_threads())


def _raise_for(status: int, what: str, nbytes: int) -> None:
    """Turn a C return code into the Python exception it stands for."""
    if status == BAD_INDEX:
        raise ValueError(f"idx holds values outside the rows of {what}; drop them.")
    if status == NO_MEMORY:
        raise MemoryError(
            f"minisparse's {what} loop could not allocate {nbytes} bytes of per-thread sums; "
            "free memory or use fewer threads (torch.set_num_threads)."
        )
    if status:
        raise RuntimeError(f"minisparse's C loop failed with code {status}.")


def hugepage_copy(t: Tensor) -> Tensor:
    """A contiguous copy of t whose memory is 2 MiB aligned and advised as huge pages.

    On Linux with transparent huge pages in ``madvise`` or ``always`` mode the kernel backs the
    copy with 2 MiB pages, so a random row gather costs far fewer TLB misses. Elsewhere it is a
    plain aligned copy, which is harmless.
    """
    check_tensor("t", t)
    if t.device.type != "cpu":
        return t.contiguous()
    nbytes = t.numel() * t.element_size()
    pad = HUGE_PAGE // t.element_size()
    buf = torch.empty(t.numel() + pad, dtype=t.dtype)
    offset = (-buf.data_ptr() % HUGE_PAGE) // t.element_size()
    out = buf[offset : offset + t.numel()].view(t.shape)
    if sys.platform.startswith("linux") and nbytes >= HUGE_PAGE:
        libc = ctypes.CDLL(None, use_errno=True)
        length = (nbytes + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
        length = min(length, (buf.numel() - offset) * t.element_size() // HUGE_PAGE * HUGE_PAGE)
        libc.madvise(ctypes.c_void_p(out.data_ptr()), ctypes.c_size_t(length), MADV_HUGEPAGE)
    out.copy_(t)
    return out


def _use_fast(*tensors: Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors) and (
        load_library() is not None
    )


def _as_batch(x: Tensor) -> Tensor:
    return (x.reshape(1, -1) if x.dim() == 1 else x).contiguous()


def _row_major(W: Tensor) -> Tensor:
    """W itself when its rows are contiguous (any row stride), else a contiguous copy."""
    return W if W.stride(1) == 1 else W.contiguous()


def _gather(W: Tensor, x: Tensor, idx: Tensor, prefetch: bool) -> Tensor:
    """gather_rows_dot on checked float32 CPU inputs: the C loop, or torch without it."""
    lib = load_library()
    W, xb, idx = _row_major(W), _as_batch(x), idx.to(torch.int64).contiguous()
    if lib is None:
        return xb @ W.index_select(0, idx).T
    y = torch.empty(xb.shape[0], idx.numel(), dtype=torch.float32)
    if idx.numel() and xb.shape[0]:
        status = lib.gather_gemv_f32(
            W.data_ptr(),
            W.shape[0],
            W.stride(0),
            xb.data_ptr(),
            xb.shape[0],
            xb.shape[1],
            idx.data_ptr(),
            idx.numel(),
            y.data_ptr(),
            int(prefetch),
            _threads(),
        )
        _raise_for(status, "the row gather", 0)
    return y


def _scatter(W_t: Tensor, v: Tensor, idx: Tensor, prefetch: bool) -> Tensor:
    """scatter_rows_sum on checked float32 CPU inputs: the C loop, or torch without it."""
    lib = load_library()
    W_t, vb, idx = _row_major(W_t), _as_batch(v), idx.to(torch.int64).contiguous()
    if lib is None:
        return vb @ W_t.index_select(0, idx)
    y = torch.zeros(vb.shape[0], W_t.shape[1], dtype=torch.float32)
    if idx.numel() and y.numel():
        status = lib.scatter_gemv_f32(
            W_t.data_ptr(),
            W_t.shape[0],
            W_t.stride(0),
            vb.data_ptr(),
            vb.shape[0],
            idx.numel(),
            idx.data_ptr(),
            W_t.shape[1],
            y.data_ptr(),
            int(prefetch),
            _threads(),
        )
        _raise_for(status, "the row scatter", y.numel() * 4 * _threads())
    return y


def gather_rows_dot(W: Tensor, x: Tensor, idx: Tensor, prefetch: bool = True) -> Tensor:
    """y[b, i] = W[idx[i]] . x[b]: the compiled row-gather loop itself (chapter 07 times it).

    W [N, K] and x [K] or [B, K] float32 on the CPU, idx [n] integer rows in [0, N) (any order,
    repeats allowed); returns [B, n] float32 (B = 1 for a vector x). ``prefetch`` switches the
    software prefetch of the next row. Without the compiled library, torch computes the same.
    """
    check_gather(W, x, idx)
    check_float32_cpu(W=W, x=x)
    return _gather(W, x, idx, prefetch)


def scatter_rows_sum(W_t: Tensor, v: Tensor, idx: Tensor, prefetch: bool = True) -> Tensor:
    """y[b] = sum_i v[b, i] W_t[idx[i]]: the compiled row-scatter loop itself.

    W_t [K, N] float32 on the CPU, v [n] or [B, n] float32 (one value per entry of idx), idx [n]
    integer rows in [0, K) (any order; a repeated row is added once per entry); returns [B, N].
    """
    check_matrix("W_t", W_t)
    check_tensor("idx", idx)
    check_vector(v, idx.numel(), "the entries of idx (one value per active row)", name="v")
    check_indices(idx, W_t.shape[0], "W_t row")
    check_same_device(W_t, v, idx)
    check_float32_cpu(W_t=W_t, v=v)
    return _scatter(W_t, v, idx, prefetch)


@functools.lru_cache(maxsize=64)
def _all_rows(n: int) -> Tensor:
    return torch.arange(n, dtype=torch.int64)


def dense_gemv(W_t: Tensor, x: Tensor) -> Tensor:
    """Dense GEMV y = x @ W_t with the streaming loop: the column-sparse kernel at s = 0.

    W_t [K, N] (W transposed, contiguous), x [K] or [B, K], float32 on the CPU; returns [N] or
    [B, N]. The loop reads W_t's rows in memory order with software prefetch, which on the
    course's CPU streams weights faster than the BLAS GEMV does at batch 1 (chapter 07
    measures both); ``minisparse.model.Linear`` uses it for single-token decoding. Without the
    compiled library (``fast_path_available()``) torch computes the same.
    """
    check_matrix("W_t", W_t)
    check_vector(x, W_t.shape[0], f"W_t's {W_t.shape[0]} rows (W_t is W transposed, [in, out])")
    check_float32_cpu(W_t=W_t, x=x)
    return _unbatch(_scatter(W_t, x, _all_rows(W_t.shape[0]), True), x)


def _unbatch(y: Tensor, x: Tensor) -> Tensor:
    return y[0] if x.dim() == 1 else y


def gather_gemv(W: Tensor, x: Tensor, idx: Tensor) -> Tensor:
    """Row-sparse GEMV on the CPU: y = x @ W[idx].T, shape [n] or [B, n].

    W [N, K] row-major, x [K] or [B, K], idx [n] integer rows (the union for a batch; any
    order, repeats allowed).
    """
    check_gather(W, x, idx)
    if not _use_fast(W, x):
        return gather_gemv_ref(W, x, idx)
    return _unbatch(_gather(W, x, idx, True), x)


def active_inputs(
    x: Tensor, threshold: float | None = None, idx: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The active channel indices (the union over a batch) and x's values there, [B, n].

    With a threshold a row's entries with |x| <= threshold are zeroed (NaN counts as inactive),
    so each row keeps only its own channels even though the union is read.
    """
    check_tensor("x", x)
    check_threshold(threshold, idx)
    xb = _as_batch(x)
    if idx is not None:
        check_indices(idx, xb.shape[-1], "input channel")
        idx = idx.to(device=xb.device, dtype=torch.int64)
        return idx, xb[:, idx]
    keep = xb.abs() > threshold
    idx = keep.any(0).nonzero().flatten()
    return idx, torch.where(keep, xb, torch.zeros_like(xb))[:, idx]


def sparse_input_gemv(
    W_t: Tensor, x: Tensor, threshold: float | None = None, idx: Tensor | None = None
) -> Tensor:
    """Column-sparse GEMV on the CPU: y = (x * mask) @ W_t, reading only the active rows of W_t.

    W_t [K, N] (W transposed, contiguous), x [K] or [B, K]; exactly one of threshold / idx.
    """
    check_sparse_input(W_t, x, threshold, idx)
    active, values = active_inputs(x, threshold, idx)
    if _use_fast(W_t, x):
        y = _scatter(W_t, values, active, True)
    else:
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        y = (values.to(acc) @ W_t.index_select(0, active).to(acc)).to(x.dtype)
    return _unbatch(y, x)


def sparse_ffn(
    x: Tensor, W_gate: Tensor, W_up: Tensor, W_down_t: Tensor, idx: Tensor, act: str = "silu"
) -> Tensor:
    """Sparse gated FFN on the CPU over the neurons idx.

    y = sum_{j in idx} act(W_gate[j] . x) (W_up[j] . x) W_down_t[j, :]: two row gathers, the
    activation on the n active values, one row scatter. Layouts as in ``minisparse.kernels``.
    """
    check_ffn(x, W_gate, W_up, W_down_t, idx, act)
    if not _use_fast(x, W_gate, W_up, W_down_t):
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        rows = idx.long()
        xa = _as_batch(x).to(acc)
        h = apply_activation(xa @ W_gate[rows].to(acc).T, act) * (xa @ W_up[rows].to(acc).T)
        return _unbatch((h @ W_down_t[rows].to(acc)).to(x.dtype), x)
    h = apply_activation(_gather(W_gate, x, idx, True), act) * _gather(W_up, x, idx, True)
    return _unbatch(_scatter(W_down_t, h, idx, True), x)
