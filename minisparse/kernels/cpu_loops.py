"""The C loops of the CPU fast path: a row gather and a row scatter at the bandwidth limit.

Two loops cover every sparse GEMV of the course (``minisparse.kernels.cpu`` calls them):

* ``gather_gemv_f32``, row sparsity: y[b, i] = W[idx[i]] . x[b]. Each active row is one dot
  product with four independent 16-wide vector accumulators. A gathered row is a short,
  isolated burst (16 KiB for K = 4096 fp32) that the hardware prefetcher needs a few misses to
  lock onto, and the gaps between active rows defeat it; so while it multiplies row i, the loop
  asks for row i + 1 (``__builtin_prefetch``) and the next burst is already in flight.
* ``scatter_gemv_f32``, column sparsity: y[b] = sum_i v[b, i] W_t[idx[i]]. The active rows are
  summed in groups of eight in registers before being added to y: eight streams in flight, and
  a rounding chain of n / 8 additions instead of n, which keeps it as accurate as the dense GEMV
  on a 30-layer model. The next group is prefetched while this one is summed.

Both split their rows over OpenMP threads when a call reads at least 2^20 weights (below that,
waking the threads costs more than it saves), with the thread count the caller passes
(``torch.get_num_threads()``). Both check every index before they read a weight and report an
allocation failure, as return codes (``BAD_INDEX``, ``NO_MEMORY``) that Python turns into
``ValueError`` / ``MemoryError``, so no input makes them read or write outside the tensors.

``C_SOURCE`` is compiled on first use (``minisparse.kernels.cpu_build``); ``declare_loops``
tells ctypes the argument and result types of its functions.
"""

from __future__ import annotations

import ctypes

__all__ = [
    "BAD_INDEX",
    "C_SOURCE",
    "NO_MEMORY",
    "declare_loops",
]


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

#include "simd.h"

/* row . x with four independent vector accumulators; while it reads row, it asks the memory
   system for the same 256 bytes of the next row to come (next may be 0). */
static float dot_prefetch(const float* row, const float* x, int64_t K, const float* next) {
    v16 a0 = zero16(), a1 = zero16(), a2 = zero16(), a3 = zero16();
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
        if (next)
            for (int q = 0; q < 64; q += 16) __builtin_prefetch(next + k + q, 0, 0);
        a0 = madd16(load16(row + k), load16(x + k), a0);
        a1 = madd16(load16(row + k + 16), load16(x + k + 16), a1);
        a2 = madd16(load16(row + k + 32), load16(x + k + 32), a2);
        a3 = madd16(load16(row + k + 48), load16(x + k + 48), a3);
    }
    float acc = hsum16(add16(add16(a0, a1), add16(a2, a3)));
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
        v16 s0 = zero16(), s1 = zero16(), s2 = zero16(), s3 = zero16();
        for (int r = 0; r < g; r++) {
            const float* row = rows[r] + c;
            s0 = smadd16(a[r], load16(row), s0);
            s1 = smadd16(a[r], load16(row + 16), s1);
            s2 = smadd16(a[r], load16(row + 32), s2);
            s3 = smadd16(a[r], load16(row + 48), s3);
        }
        store16(y + c, add16(load16(y + c), s0));
        store16(y + c + 16, add16(load16(y + c + 16), s1));
        store16(y + c + 32, add16(load16(y + c + 32), s2));
        store16(y + c + 48, add16(load16(y + c + 48), s3));
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

# Return codes of the loops (the #defines above).
BAD_INDEX, NO_MEMORY = 1, 2


def declare_loops(lib: ctypes.CDLL) -> None:
    """Argument and result types of the C functions (ctypes trusts them)."""
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    gemv_args = [ptr, i64, i64, ptr, i64, i64, ptr, i64, ptr, c_int, c_int]
    for fn in (lib.gather_gemv_f32, lib.scatter_gemv_f32):
        fn.argtypes, fn.restype = gemv_args, c_int
    lib.team_size.argtypes, lib.team_size.restype = [c_int], c_int
    lib.built_with_openmp.argtypes, lib.built_with_openmp.restype = [], c_int
