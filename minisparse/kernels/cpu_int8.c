/* Sparse GEMVs over int8 weights: the loops of minisparse.kernels.cpu_int8.

   Chapter 09 stores a weight W [out, in] as int8 codes q with one float32 scale per output
   channel, W[o, k] = s[o] q[o, k] (symmetric, per channel). Chapter 07's sparse loops read only
   the active rows of a float32 matrix. Here the two multiply: the active rows are read as int8
   codes (a quarter of the bytes), widened to floats in registers, and summed in float32.

     gather_gemv_i8   row sparsity (gate, up): y[b, i] = s[idx[i]] sum_k q[idx[i], k] x[b, k].
                      The scale belongs to the row, so it multiplies the finished dot product.
     scatter_gemv_i8  column sparsity (down, stored transposed as q_t [ffn, dim] so that an active
                      neuron's down weights are one contiguous row): y[b, c] =
                      s[c] sum_i v[b, i] q_t[idx[i], c]. The scale belongs to the output column
                      c, so it factors out of the sum over i and is applied once per column.
     sparse_ffn_i8    both, fused: h[b, i] = act(s_g[j] q_g[j] . x[b]) (s_u[j] q_u[j] . x[b])
                      for j = idx[i], then y[b] = s_d * sum_i h[b, i] q_d_t[j]. One call: one
                      parallel loop over the gate and up rows, then the scatter.

   The loops are those of the float32 path (cpu.c; the scatter, the index check and the
   thread rule are the same code, sparse_rows.h): the next active row is prefetched
   while this one is read, the scatter sums groups of eight rows in registers before adding
   them to y, rows are split over OpenMP threads above PARALLEL_MIN weights, and every index is
   checked before a weight is read (BAD_INDEX, NO_MEMORY as return codes). Two differences,
   both measured on one thread of an AMD EPYC (Zen 4) with 11008 x 4096 codes: the dot product
   reads two cache lines per iteration (with one, a row streamed at half the speed), and the
   prefetches ask for the outer cache levels (locality 1): a non-temporal prefetch (locality 0,
   the float32 loops' choice) made a dense scan twice as slow as no prefetch at all. */
#include <math.h>
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
#include "activations.h"
#include "sparse_rows.h"

/* sum_k q[k] x[k] over int8 codes with eight independent vector accumulators, two cache lines
   (128 codes) per iteration: with one line per iteration a single thread streams int8 rows at
   half the speed (fewer loads in flight). While it reads the row it asks for the same bytes of
   the next row (next may be 0). */
static float dot_i8(const int8_t* q, const float* x, int64_t K, const int8_t* next) {
    v16 a[8];
    for (int j = 0; j < 8; j++) a[j] = zero16();
    int64_t k = 0;
    for (; k + 128 <= K; k += 128) {
        if (next) {
            __builtin_prefetch(next + k, 0, 1);
            __builtin_prefetch(next + k + 64, 0, 1);
        }
        for (int j = 0; j < 8; j++) a[j] = madd16(load16_i8(q + k + 16 * j), load16(x + k + 16 * j), a[j]);
    }
    if (next)
        for (int64_t p = k; p < K; p += 64) __builtin_prefetch(next + p, 0, 1);
    for (; k + 16 <= K; k += 16) a[0] = madd16(load16_i8(q + k), load16(x + k), a[0]);
    float acc = hsum16(add16(add16(add16(a[0], a[1]), add16(a[2], a[3])),
                             add16(add16(a[4], a[5]), add16(a[6], a[7]))));
    for (; k < K; k++) acc += (float)q[k] * x[k];
    return acc;
}

AXPY_GROUP(axpy_group_i8, int8_t, load16_i8, 1)
SCATTER_ROWS(scatter_rows_i8, int8_t, axpy_group_i8)

/* Row-sparse GEMV over int8 rows: y[b, i] = scale[idx[i]] sum_k Q[idx[i], k] x[b, k]. */
int gather_gemv_i8(const int8_t* Q, int64_t n_rows, int64_t ldq, const float* scale,
                   const float* x, int64_t B, int64_t K, const int64_t* idx, int64_t n, float* y,
                   int prefetch, int num_threads) {
    if (bad_indices(idx, n, n_rows)) return BAD_INDEX;
    #pragma omp parallel for schedule(dynamic, 16) num_threads(team(n * K, num_threads))
    for (int64_t i = 0; i < n; i++) {
        const int8_t* row = Q + idx[i] * ldq;
        const int8_t* next = (prefetch && i + 1 < n) ? Q + idx[i + 1] * ldq : 0;
        float s = scale[idx[i]];
        for (int64_t b = 0; b < B; b++)  /* the row stays in L1 across the batch */
            y[b * n + i] = s * dot_i8(row, x + b * K, K, b == 0 ? next : 0);
    }
    return OK;
}

/* sum_i v[b, i] Qt[idx[i], :] into y (zeroed by the caller; sparse_rows.h), then y *= scale
   column by column. */
static int scatter_i8(const int8_t* Qt, int64_t ldq, const float* scale, const float* v,
                      int64_t B, int64_t n, const int64_t* idx, int64_t N, float* y,
                      int prefetch, int nt) {
    int status = scatter_rows_i8(Qt, ldq, v, B, n, idx, N, y, prefetch, nt);
    if (status != OK) return status;
    for (int64_t b = 0; b < B; b++)
        for (int64_t c = 0; c < N; c++) y[b * N + c] *= scale[c];
    return OK;
}

/* Column-sparse GEMV over int8 rows of W transposed: y[b, c] = scale[c] sum_i v[b, i]
   Qt[idx[i], c] (y zeroed by the caller; scale holds one value per output column). */
int scatter_gemv_i8(const int8_t* Qt, int64_t n_rows, int64_t ldq, const float* scale,
                    const float* v, int64_t B, int64_t n, const int64_t* idx, int64_t N, float* y,
                    int prefetch, int num_threads) {
    if (bad_indices(idx, n, n_rows)) return BAD_INDEX;
    return scatter_i8(Qt, ldq, scale, v, B, n, idx, N, y, prefetch, team(n * N, num_threads));
}

/* The sparse gated FFN over int8 weights, neurons idx: gate and up rows Qg, Qu [ffn, dim] with
   per-neuron scales sg, su; down rows Qd_t [ffn, dim] (down_proj transposed) with per-output
   scales sd [dim]. y [B, dim] is zeroed by the caller. */
int sparse_ffn_i8(const int8_t* Qg, const float* sg, const int8_t* Qu, const float* su,
                  const int8_t* Qd_t, const float* sd, int64_t ffn, int64_t dim, const float* x,
                  int64_t B, const int64_t* idx, int64_t n, int act, float* y, int prefetch,
                  int num_threads) {
    if (bad_indices(idx, n, ffn)) return BAD_INDEX;
    float* h = (float*)malloc(((size_t)B * (size_t)n + 1) * sizeof(float));
    if (!h) return NO_MEMORY;
    #pragma omp parallel for schedule(dynamic, 16) num_threads(team(2 * n * dim, num_threads))
    for (int64_t i = 0; i < n; i++) {
        int64_t j = idx[i];
        int ahead = prefetch && i + 1 < n;
        const int8_t* next_g = ahead ? Qg + idx[i + 1] * dim : 0;
        const int8_t* next_u = ahead ? Qu + idx[i + 1] * dim : 0;
        for (int64_t b = 0; b < B; b++) {
            const float* xb = x + b * dim;
            float g = sg[j] * dot_i8(Qg + j * dim, xb, dim, b == 0 ? next_g : 0);
            float u = su[j] * dot_i8(Qu + j * dim, xb, dim, b == 0 ? next_u : 0);
            h[b * n + i] = activate(act, g) * u;
        }
    }
    int status = scatter_i8(Qd_t, dim, sd, h, B, n, idx, dim, y, prefetch,
                            team(n * dim, num_threads));
    free(h);
    return status;
}
