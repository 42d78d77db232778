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
(``$CC``, else ``cc``/``gcc``/``clang``; OpenMP across cores) into a per-user cache and loaded
with ctypes; they link the OpenMP runtime torch already loaded, so both share one thread pool.
Without a compiler the functions still work, through ``index_select`` + matmul, and say once
how to get the fast path. The fast loops take float32; other dtypes use the torch path.

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
from pathlib import Path

import torch
from torch import Tensor

from .reference import apply_activation, gather_gemv_ref
from .validate import check_ffn, check_gather, check_sparse_input

C_SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <omp.h>

/* Below this many weights a call stays on one thread: waking the others costs more. */
#define PARALLEL_MIN (1 << 20)

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

/* Row-sparse GEMV: y[b, i] = sum_k W[idx[i], k] x[b, k]. Chunks of rows go to threads. */
void gather_gemv_f32(const float* W, int64_t ldw, const float* x, int64_t B, int64_t K,
                     const int64_t* idx, int64_t n, float* y, int prefetch) {
    #pragma omp parallel for schedule(dynamic, 16) if (n * K >= PARALLEL_MIN)
    for (int64_t i = 0; i < n; i++) {
        const float* row = W + idx[i] * ldw;
        const float* next = (prefetch && i + 1 < n) ? W + idx[i + 1] * ldw : 0;
        for (int64_t b = 0; b < B; b++)  /* row i stays in L1/L2 across the batch */
            y[b * n + i] = dot_prefetch(row, x + b * K, K, b == 0 ? next : 0);
    }
}

/* Column-sparse GEMV: y[b, :] = sum_i v[b, i] Wt[idx[i], :] (y zeroed by the caller).
   Groups of GROUP active rows go to threads; each sums into its own buffer, then adds it to y. */
void scatter_gemv_f32(const float* Wt, int64_t ldw, const float* v, int64_t B, int64_t n,
                      const int64_t* idx, int64_t N, float* y, int prefetch) {
    #pragma omp parallel if (n * N >= PARALLEL_MIN)
    {
        float* part = (float*)calloc((size_t)(B * N), sizeof(float));
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
        #pragma omp critical
        for (int64_t c = 0; c < B * N; c++) y[c] += part[c];
        free(part);
    }
}
"""

HUGE_PAGE = 2 * 2**20
MADV_HUGEPAGE = 14


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


def _compile(compiler: str, out: Path) -> None:
    """Compile C_SOURCE to the shared library ``out`` (atomically: temp file, then rename)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src = Path(tmp) / "sparse_gemv.c"
        src.write_text(C_SOURCE)
        lib = Path(tmp) / out.name
        base = [*shlex.split(compiler), "-O3", "-fopenmp", "-shared", "-fPIC", str(src)]
        base += ["-o", str(lib)]
        last_error = ""
        for extra in (["-march=native"], []):  # -march=native is not known to every compiler
            proc = subprocess.run(base + extra, capture_output=True, text=True, check=False)
            if proc.returncode == 0:
                os.replace(lib, out)
                return
            last_error = proc.stderr.strip()
        raise RuntimeError(last_error)


@functools.lru_cache(maxsize=1)
def load_library() -> ctypes.CDLL | None:
    """The compiled fast kernels, or None (with a one-time warning naming the fix)."""
    if not sys.platform.startswith("linux") and sys.platform != "darwin":
        return None
    compiler = find_compiler()
    if compiler is None:
        warnings.warn(
            "No C compiler found, so minisparse's CPU sparse kernels fall back to index_select "
            "+ matmul, which is slower than dense. Install gcc or clang (or set CC) for the "
            "fast path.",
            stacklevel=3,
        )
        return None
    identity = C_SOURCE + compiler + sys.platform + cpu_identity()
    key = hashlib.sha256(identity.encode()).hexdigest()[:16]
    path = cache_dir() / f"sparse_gemv_{key}.so"
    try:
        if not path.exists():
            _compile(compiler, path)
        try:
            lib = ctypes.CDLL(str(path))
        except OSError:  # a damaged file (an interrupted copy, a full disk): build it again
            path.unlink(missing_ok=True)
            _compile(compiler, path)
            lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError) as err:
        warnings.warn(
            f"Compiling minisparse's CPU sparse kernels with {compiler!r} failed ({err}); "
            "falling back to index_select + matmul. Install an OpenMP-capable gcc or clang "
            "(or set CC) for the fast path.",
            stacklevel=3,
        )
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.gather_gemv_f32.argtypes = [ptr, i64, ptr, i64, i64, ptr, i64, ptr, ctypes.c_int]
    lib.scatter_gemv_f32.argtypes = [ptr, i64, ptr, i64, i64, ptr, i64, ptr, ctypes.c_int]
    return lib


def fast_path_available() -> bool:
    """True when the compiled kernels loaded."""
    return load_library() is not None


def hugepage_copy(t: Tensor) -> Tensor:
    """A contiguous copy of t whose memory is 2 MiB aligned and advised as huge pages.

    On Linux with transparent huge pages in ``madvise`` or ``always`` mode the kernel backs the
    copy with 2 MiB pages, so a random row gather costs far fewer TLB misses. Elsewhere it is a
    plain aligned copy, which is harmless.
    """
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


def gather_rows_dot(W: Tensor, x: Tensor, idx: Tensor, prefetch: bool = True) -> Tensor:
    """y[b, i] = W[idx[i]] . x[b] with the compiled loop (float32, CPU; no checks)."""
    lib = load_library()
    W, xb, idx = _row_major(W), _as_batch(x), idx.to(torch.int64).contiguous()
    y = torch.empty(xb.shape[0], idx.numel(), dtype=torch.float32)
    if idx.numel():
        lib.gather_gemv_f32(
            W.data_ptr(),
            W.stride(0),
            xb.data_ptr(),
            xb.shape[0],
            xb.shape[1],
            idx.data_ptr(),
            idx.numel(),
            y.data_ptr(),
            int(prefetch),
        )
    return y


def scatter_rows_sum(W_t: Tensor, v: Tensor, idx: Tensor, prefetch: bool = True) -> Tensor:
    """y[b] = sum_i v[b, i] W_t[idx[i]] with the compiled loop (float32, CPU; no checks)."""
    lib = load_library()
    W_t, vb, idx = _row_major(W_t), _as_batch(v), idx.to(torch.int64).contiguous()
    y = torch.zeros(vb.shape[0], W_t.shape[1], dtype=torch.float32)
    if idx.numel():
        lib.scatter_gemv_f32(
            W_t.data_ptr(),
            W_t.stride(0),
            vb.data_ptr(),
            vb.shape[0],
            idx.numel(),
            idx.data_ptr(),
            W_t.shape[1],
            y.data_ptr(),
            int(prefetch),
        )
    return y


@functools.lru_cache(maxsize=64)
def _all_rows(n: int) -> Tensor:
    return torch.arange(n, dtype=torch.int64)


def dense_gemv(W_t: Tensor, x: Tensor) -> Tensor:
    """Dense GEMV y = x @ W_t with the streaming loop: the column-sparse kernel at s = 0.

    W_t [K, N] contiguous (W transposed), x [K] or [1, K] float32 on the CPU; returns [N] or
    [1, N]. The loop reads W_t's rows in memory order with software prefetch, which on the
    course's CPU streams weights faster than the BLAS GEMV does at batch 1 (chapter 07
    measures both); ``minisparse.model.Linear`` uses it for single-token decoding.
    Needs the compiled library (``fast_path_available()``).
    """
    return _unbatch(scatter_rows_sum(W_t, x, _all_rows(W_t.shape[0])), x)


def _unbatch(y: Tensor, x: Tensor) -> Tensor:
    return y[0] if x.dim() == 1 else y


def gather_gemv(W: Tensor, x: Tensor, idx: Tensor) -> Tensor:
    """Row-sparse GEMV on the CPU: y = x @ W[idx].T, shape [n] or [B, n].

    W [N, K] row-major, x [K] or [B, K], idx [n] integer rows (the union for a batch).
    """
    check_gather(W, x, idx)
    if not _use_fast(W, x):
        return gather_gemv_ref(W, x, idx)
    return _unbatch(gather_rows_dot(W, x, idx), x)


def active_inputs(
    x: Tensor, threshold: float | None = None, idx: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The active channel indices (the union over a batch) and x's values there, [B, n].

    With a threshold a row's entries with |x| <= threshold are zeroed, so each row keeps only
    its own channels even though the union is read.
    """
    xb = _as_batch(x)
    if idx is not None:
        idx = idx.to(torch.int64)
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
        y = scatter_rows_sum(W_t, values, active)
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
    h = apply_activation(gather_rows_dot(W_gate, x, idx), act) * gather_rows_dot(W_up, x, idx)
    return _unbatch(scatter_rows_sum(W_down_t, h, idx), x)
