/* The C loops of the CPU fast path: a row gather and a row scatter at the bandwidth limit.

   Two loops cover every sparse GEMV of the course (minisparse/kernels/cpu.py calls them):

   * gather_gemv_f32, row sparsity: y[b, i] = W[idx[i]] . x[b]. Each active row is one dot
     product with four independent 16-wide vector accumulators. A gathered row is a short,
     isolated burst (16 KiB for K = 4096 fp32) that the hardware prefetcher needs a few misses to
     lock onto, and the gaps between active rows defeat it; so while it multiplies row i, the loop
     asks for row i + 1 (__builtin_prefetch) and the next burst is already in flight.
   * scatter_gemv_f32, column sparsity: y[b] = sum_i v[b, i] W_t[idx[i]]. The active rows are
     summed in groups of eight in registers before being added to y: eight streams in flight, and
     a rounding chain of n / 8 additions instead of n, which keeps it as accurate as the dense GEMV
     on a 30-layer model. The next group is prefetched while this one is summed.

   Both split their rows over OpenMP threads when a call reads at least 2^20 weights (below that,
   waking the threads costs more than it saves), with the thread count the caller passes
   (torch.get_num_threads()). Both check every index before they read a weight and report an
   allocation failure, as return codes (BAD_INDEX, NO_MEMORY) that Python turns into
   ValueError / MemoryError, so no input makes them read or write outside the tensors.

   The column-sparse loop, the index check and the thread rule are in sparse_rows.h, one copy
   for these loops and the int8 ones (cpu_int8.c); the return codes are in abi.h. */
#include <stdint.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#define THREAD_ID() omp_get_thread_num()
#else
#define THREAD_ID() 0
#endif

#include "abi.h"
#include "simd.h"
#include "sparse_rows.h"

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

AXPY_GROUP(axpy_group, float, load16, 0)
SCATTER_ROWS(scatter_rows, float, axpy_group)

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

/* Column-sparse GEMV: y[b, :] = sum_i v[b, i] Wt[idx[i], :] (y zeroed by the caller), groups
   of GROUP active rows summed in registers (sparse_rows.h). */
int scatter_gemv_f32(const float* Wt, int64_t n_rows, int64_t ldw, const float* v, int64_t B,
                     int64_t n, const int64_t* idx, int64_t N, float* y, int prefetch,
                     int num_threads) {
    if (bad_indices(idx, n, n_rows)) return BAD_INDEX;
    return scatter_rows(Wt, ldw, v, B, n, idx, N, y, prefetch, team(n * N, num_threads));
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
