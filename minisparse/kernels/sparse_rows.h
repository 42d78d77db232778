/* What the two libraries of sparse GEMVs share: the float32 loops (cpu.c) and the int8
   ones (cpu_int8.c). The return codes, the rule for how many threads a call gets, the index
   check, and the column-sparse GEMV (a sum of active rows), written once for both element
   types. The source loaders paste this file in after simd.h. */

/* Below this many weights a call stays on one thread: waking the others costs more. */
#define PARALLEL_MIN (1 << 20)

/* The return codes (OK, BAD_INDEX, NO_MEMORY) and GROUP, the rows summed in registers before
   they are added to the output, are in abi.h. */
#include "abi.h"

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

/* y += sum_r a[r] rows[r] over a group of g <= GROUP rows of T (float32 weights or int8 codes;
   LOAD16 turns 16 of them into floats). The group is summed in registers first and added to y
   once: y sees n / GROUP additions instead of n (a shorter rounding chain, fewer passes over
   y), and g streams are in flight at once. While it reads 64 elements of each row, it asks
   the memory system for the same bytes of next[0..ng), the next group, with LOCALITY (the
   float32 loops use 0, non-temporal; the int8 loops 1, see cpu_int8.c). */
#define AXPY_GROUP(NAME, T, LOAD16, LOCALITY)                                                  \
    static void NAME(float* y, const float* a, const T* const* rows, int g,                    \
                     const T* const* next, int ng, int64_t N) {                                \
        int64_t c = 0;                                                                         \
        for (; c + 64 <= N; c += 64) {                                                         \
            for (int r = 0; r < ng; r++)                                                       \
                for (int q = 0; q < 64; q += 64 / (int)sizeof(T))                              \
                    __builtin_prefetch(next[r] + c + q, 0, LOCALITY);                          \
            v16 s0 = zero16(), s1 = zero16(), s2 = zero16(), s3 = zero16();                    \
            for (int r = 0; r < g; r++) {                                                      \
                const T* row = rows[r] + c;                                                    \
                s0 = smadd16(a[r], LOAD16(row), s0);                                           \
                s1 = smadd16(a[r], LOAD16(row + 16), s1);                                      \
                s2 = smadd16(a[r], LOAD16(row + 32), s2);                                      \
                s3 = smadd16(a[r], LOAD16(row + 48), s3);                                      \
            }                                                                                  \
            store16(y + c, add16(load16(y + c), s0));                                          \
            store16(y + c + 16, add16(load16(y + c + 16), s1));                                \
            store16(y + c + 32, add16(load16(y + c + 32), s2));                                \
            store16(y + c + 48, add16(load16(y + c + 48), s3));                                \
        }                                                                                      \
        for (int r = 0; r < ng; r++)                                                           \
            if (c < N) __builtin_prefetch(next[r] + c, 0, LOCALITY);                           \
        for (; c < N; c++) {                                                                   \
            float acc = 0.0f;                                                                  \
            for (int r = 0; r < g; r++) acc += a[r] * (float)rows[r][c];                       \
            y[c] += acc;                                                                       \
        }                                                                                      \
    }

/* Column-sparse GEMV over rows of T: y[b, :] += sum_i v[b, i] Wt[idx[i], :] (y zeroed by the
   caller; indices already checked). Groups of GROUP active rows go to the nt threads; each sums
   into its own buffer, then adds it to y (one thread sums straight into y). AXPY is the
   AXPY_GROUP for T. Called outside any parallel region; returns OK or NO_MEMORY. */
#define SCATTER_ROWS(NAME, T, AXPY)                                                            \
    static int NAME(const T* Wt, int64_t ldw, const float* v, int64_t B, int64_t n,            \
                    const int64_t* idx, int64_t N, float* y, int prefetch, int nt) {           \
        size_t size = (size_t)B * (size_t)N;                                                   \
        float* parts = y;                                                                      \
        if (nt > 1) {                                                                          \
            parts = (float*)calloc((size_t)nt * size, sizeof(float));                          \
            if (!parts) return NO_MEMORY;                                                      \
        }                                                                                      \
        _Pragma("omp parallel num_threads(nt)")                                                \
        {                                                                                      \
            float* part = parts + (size_t)THREAD_ID() * size;                                  \
            _Pragma("omp for schedule(dynamic, 2) nowait")                                     \
            for (int64_t grp = 0; grp < (n + GROUP - 1) / GROUP; grp++) {                      \
                int64_t i0 = grp * GROUP;                                                      \
                int g = n - i0 < GROUP ? (int)(n - i0) : GROUP;                                \
                int ng = prefetch ? (n - i0 - g < GROUP ? (int)(n - i0 - g) : GROUP) : 0;      \
                const T* rows[GROUP];                                                          \
                const T* next[GROUP];                                                          \
                float a[GROUP];                                                                \
                for (int r = 0; r < g; r++) rows[r] = Wt + idx[i0 + r] * ldw;                  \
                for (int r = 0; r < ng; r++) next[r] = Wt + idx[i0 + g + r] * ldw;             \
                for (int64_t b = 0; b < B; b++) {                                              \
                    for (int r = 0; r < g; r++) a[r] = v[b * n + i0 + r];                      \
                    AXPY(part + b * N, a, rows, g, next, b == 0 ? ng : 0, N);                  \
                }                                                                              \
            }                                                                                  \
            if (nt > 1) {                                                                      \
                _Pragma("omp critical")                                                        \
                for (size_t c = 0; c < size; c++) y[c] += part[c];                             \
            }                                                                                  \
        }                                                                                      \
        if (nt > 1) free(parts);                                                               \
        return OK;                                                                             \
    }
