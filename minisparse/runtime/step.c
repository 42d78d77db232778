/* One decode step of a Llama-family block in C: the compiled half of minisparse.runtime.Decoder.

   At batch 1 a decode step is a chain of matrix-vector products, each reading its weights once.
   Done with torch, every small operation (a norm, a rotation, a view, a softmax) is a separate
   dispatch, and a 30-layer model runs ~400 of them per token before a weight is read. Here each
   half of a block is one call and one parallel region:

     attn_step:   x += W_o attention(RoPE(W_q n), RoPE(W_k n), W_v n),   n = in(RMSNorm(x))
     mlp_step:    x += W_down down_in(act(W_gate n) * (W_up n)),         n = in(RMSNorm(x))
     sparse_mlp_step: the same MLP over the active neurons only (threshold or predictor),
                      float32 or int8 rows

   Matrices are nn.Linear's own layout, W [out, in] row-major, so a row is one contiguous
   stream and the threads split the rows between them (no reduction, no transposed copy at load
   time). The sparse step reads the down projection transposed, W_down_t [ffn, dim], so that an
   active neuron's down weights are one contiguous row too. Scratch memory is given by the
   caller and made once per decoder: nothing is allocated per token. The dot products, one per
   way a weight row is stored (float32, int8, 4-bit blocks, 2:4), are in matvec.h; the loops
   that split a matrix between threads in step_rows.h; the sparse MLP step in step_sparse.h. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#define THREAD_ID() omp_get_thread_num()
#define THREADS() omp_get_num_threads()
#else
#define THREAD_ID() 0
#define THREADS() 1
#endif

#include "abi.h"
#include "simd.h"
#include "activations.h"
#include "matvec.h"


/* Mat, Slot, AttnLayer, MlpLayer, SparseMlpLayer, MAX_TOKENS, GROUP and the ACT_* codes are
   declared once, in abi.h (shared with minisparse/kernels/abi.py). */

static inline float slot(Slot s, float v) {
    if (s.relu && v < 0.0f) v = 0.0f;
    if (s.threshold >= 0.0f && fabsf(v) <= s.threshold) v = 0.0f;
    return v;
}


#include "step_rows.h"

static void rmsnorm(const float* x, const float* w, float eps, int64_t n, float* out) {
    double ss = 0.0;  /* float64 sum of squares: as accurate as torch's float32 tree sum */
    for (int64_t i = 0; i < n; i++) ss += (double)x[i] * x[i];
    float r = 1.0f / sqrtf((float)(ss / n) + eps);
    for (int64_t i = 0; i < n; i++) out[i] = w[i] * (x[i] * r);
}

/* Rotate the pairs (v_i, v_{i + d/2}) of one head by the angles whose cos/sin are given. */
static void rope(float* v, const float* cs, const float* sn, int64_t d) {
    int64_t h = d / 2;
    for (int64_t i = 0; i < h; i++) {
        float a = v[i], b = v[i + h];
        v[i] = a * cs[i] - b * sn[i];
        v[i + h] = b * cs[i] + a * sn[i];
    }
}

/* Scratch floats attn_step needs for up to MAX_TOKENS tokens (allocated once by the caller),
   with the per-thread partial sums of input-major projections at the end. */
int64_t attn_scratch(int64_t dim, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim,
                     int64_t max_seq, int num_threads) {
    int64_t qkv = (n_heads + 2 * n_kv_heads) * head_dim, widest = qkv > dim ? qkv : dim;
    return MAX_TOKENS * (dim + (2 * n_heads + 2 * n_kv_heads) * head_dim + head_dim
                         + n_heads * max_seq + (int64_t)num_threads * widest);
}

/* x[b] += attention block of B <= MAX_TOKENS consecutive tokens at positions pos .. pos + B - 1
   (x [B, dim]): their keys/values go into the cache, and token b attends to positions
   0 .. pos + b (causal). Returns 1 when the positions do not fit in the cache or B is too big. */
int attn_step(const AttnLayer* L, float* x, int64_t B, int64_t pos, float* scratch,
              int num_threads) {
    const int64_t D = L->dim, H = L->n_heads, G = L->n_kv_heads, hd = L->head_dim;
    if (B < 1 || B > MAX_TOKENS || pos < 0 || pos + B > L->max_seq) return 1;
    const int64_t S = L->max_seq;
    float* n = scratch;               /* [B, D] */
    float* q = n + B * D;             /* [B, H * hd] */
    float* k = q + B * H * hd;        /* [B, G * hd] */
    float* v = k + B * G * hd;        /* [B, G * hd] */
    float* att = v + B * G * hd;      /* [B, H * hd] */
    float* cs = att + B * H * hd;     /* per token: cos [hd/2], then sin [hd/2] */
    float* scores = cs + B * hd;      /* [B, H, S] */
    float* parts = scores + B * H * S;  /* [threads, B, max((H + 2 G) hd, D)] */
    const float scale = 1.0f / sqrtf((float)hd);
    #pragma omp parallel num_threads(num_threads)
    {
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < B; b++) {
            rmsnorm(x + b * D, L->norm, L->eps, D, n + b * D);
            for (int64_t i = 0; i < D; i++) n[b * D + i] = slot(L->in, n[b * D + i]);
            for (int64_t i = 0; i < hd / 2; i++) {
                float angle = (float)(pos + b) * L->inv_freq[i];  /* float32, as rope_cos_sin */
                cs[b * hd + i] = cosf(angle) * L->rope_scale;
                cs[b * hd + hd / 2 + i] = sinf(angle) * L->rope_scale;
            }
        }
        if (L->wq.in_stride) {  /* TEAL: q, k, v from one bundled row per non-zero input */
            const int64_t N[3] = {H * hd, G * hd, G * hd};
            float* const Y[3] = {q, k, v};
            const float* const bias[3] = {L->bq, L->bk, L->bv};
            scatter_gemm((const float*)L->wq.data, L->wq.in_stride, 3, N, Y, bias, n, B, D, parts);
        } else {
            gemm_rows(L->wq, L->bq, n, q, B, H * hd, D, parts);
            gemm_rows(L->wk, L->bk, n, k, B, G * hd, D, parts);
            gemm_rows(L->wv, L->bv, n, v, B, G * hd, D, parts);
        }
        #pragma omp barrier
        #pragma omp for schedule(static)
        for (int64_t bh = 0; bh < B * (H + G); bh++) {
            int64_t b = bh / (H + G), h = bh % (H + G);
            const float *c = cs + b * hd, *sn = c + hd / 2;
            if (h < H) {
                rope(q + (b * H + h) * hd, c, sn, hd);
            } else {
                int64_t g = h - H;
                float* kg = k + (b * G + g) * hd;
                rope(kg, c, sn, hd);
                memcpy(L->k_cache + (g * S + pos + b) * hd, kg, hd * sizeof(float));
                memcpy(L->v_cache + (g * S + pos + b) * hd, v + (b * G + g) * hd,
                       hd * sizeof(float));
            }
        }
        /* softmax(q K^T / sqrt(d)) V per token and query head; head h reads key/value head
           h / (H / G) */
        #pragma omp for schedule(static)
        for (int64_t bh = 0; bh < B * H; bh++) {
            int64_t b = bh / H, h = bh % H, T = pos + b + 1;
            const float* qh = q + bh * hd;
            const float* K = L->k_cache + (h / (H / G)) * S * hd;
            const float* V = L->v_cache + (h / (H / G)) * S * hd;
            float* sc = scores + bh * S;
            float top = -INFINITY;
            for (int64_t t = 0; t < T; t++) {
                sc[t] = dot(qh, K + t * hd, hd) * scale;
                if (sc[t] > top) top = sc[t];
            }
            float total = 0.0f;
            for (int64_t t = 0; t < T; t++) total += (sc[t] = expf(sc[t] - top));
            float* o = att + bh * hd;
            for (int64_t i = 0; i < hd; i++) o[i] = 0.0f;
            for (int64_t t = 0; t < T; t++) {
                float p = sc[t] / total;
                const float* vt = V + t * hd;
                for (int64_t i = 0; i < hd; i++) o[i] += p * vt[i];
            }
        }
        gemm_rows(L->wo, L->bo, att, q, B, D, H * hd, parts);  /* q is free again: the output goes there */
        #pragma omp barrier
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < B * D; i++) x[i] += q[i];
    }
    return 0;
}

/* Scratch floats mlp_step needs: norm, output, values, gate and up (input-major), partials. */
int64_t mlp_scratch(int64_t dim, int64_t ffn, int num_threads) {
    return MAX_TOKENS * (2 * dim + 3 * ffn + (int64_t)num_threads * (2 * ffn > dim ? 2 * ffn : dim));
}

/* x[b] += gated MLP of B <= MAX_TOKENS tokens (dense). Returns 1 when B is out of range. */
int mlp_step(const MlpLayer* L, float* x, int64_t B, float* scratch, int num_threads) {
    const int64_t D = L->dim, F = L->ffn;
    if (B < 1 || B > MAX_TOKENS) return 1;
    float* n = scratch;      /* [B, D] */
    float* y = n + B * D;    /* [B, D] */
    float* h = y + B * D;    /* [B, F] */
    float* gu = h + B * F;   /* [2, B, F]: gate and up, when read input-major or int8-rounded */
    float* parts = gu + 2 * B * F;  /* [threads, B, max(2 F, D)] */
    #pragma omp parallel num_threads(num_threads)
    {
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < B; b++) {
            rmsnorm(x + b * D, L->norm, L->eps, D, n + b * D);
            for (int64_t i = 0; i < D; i++) n[b * D + i] = slot(L->in, n[b * D + i]);
        }
        const int q8 = L->wg.format == FMT_Q4_A8 && L->wu.format == FMT_Q4_A8;
        if (L->wg.in_stride || q8) {  /* gate and up into gu first, then the values */
            if (L->wg.in_stride) {  /* TEAL: gate and up from one bundled row per non-zero input */
                const int64_t N[2] = {F, F};
                float* const Y[2] = {gu, gu + B * F};
                const float* const bias[2] = {L->bg, L->bu};
                scatter_gemm((const float*)L->wg.data, L->wg.in_stride, 2, N, Y, bias, n, B, D, parts);
            } else {  /* int8 activations: two products, each rounding n once per thread */
                gemm_rows(L->wg, L->bg, n, gu, B, F, D, parts);
                gemm_rows(L->wu, L->bu, n, gu + B * F, B, F, D, parts);
                #pragma omp barrier
            }
            #pragma omp for schedule(static)
            for (int64_t j = 0; j < F; j++)
                for (int64_t b = 0; b < B; b++) {
                    float a = activate(L->act, gu[b * F + j]);
                    if (L->act_threshold >= 0.0f && fabsf(a) <= L->act_threshold) a = 0.0f;
                    h[b * F + j] = slot(L->down_in, a * gu[(B + b) * F + j]);
                }
        } else {
            /* neurons P at a time: with several tokens, gate and up rows of P neurons form one
               register tile (P = 2 when four rows fit, else 1) */
            const int64_t P = B > 1 && tile_rows(B) == 4 && F % 2 == 0 ? 2 : 1;
            #pragma omp for schedule(static)
            for (int64_t j0 = 0; j0 < F; j0 += P) {
                float g[2 * MAX_TOKENS], u[2 * MAX_TOKENS];
                if (B == 1) {
                    g[0] = mdot(L->wg, j0, n, D);
                    u[0] = mdot(L->wu, j0, n, D);
                } else {
                    mdot_tile2(L->wg, L->wu, j0, P, n, B, D, g, u);
                }
                for (int64_t j = j0; j < j0 + P; j++)
                    for (int64_t b = 0; b < B; b++) {
                        const int64_t at = (j - j0) * B + b;
                        float a = activate(L->act, g[at] + (L->bg ? L->bg[j] : 0.0f));
                        if (L->act_threshold >= 0.0f && fabsf(a) <= L->act_threshold) a = 0.0f;
                        h[b * F + j] = slot(L->down_in, a * (u[at] + (L->bu ? L->bu[j] : 0.0f)));
                    }
            }
        }
        gemm_rows(L->wd, L->bd, h, y, B, D, F, parts);
        #pragma omp barrier
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < B * D; i++) x[i] += y[i];
    }
    return 0;
}

#include "step_sparse.h"

/* logits[b] = W_out RMSNorm(x[b]) for B <= MAX_TOKENS tokens (the LM head; W_out [vocab, dim],
   logits [B, vocab]). Returns 1 when B is out of range. */
int lm_head_step(const float* x, int64_t B, const float* norm, float eps, const Mat* w_out,
                 int64_t vocab, int64_t dim, float* scratch, float* logits, int num_threads) {
    if (B < 1 || B > MAX_TOKENS) return 1;
    #pragma omp parallel num_threads(num_threads)
    {
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < B; b++) rmsnorm(x + b * dim, norm, eps, dim, scratch + b * dim);
        gemm_rows(*w_out, 0, scratch, logits, B, vocab, dim, 0);  /* never input-major */
    }
    return 0;
}

/* The fixed workload that chooses between builds of this file (minisparse.kernels.cpu_isa):
   products of a [rows, 576] matrix stored each way a decode step reads one (float32 rows,
   float32 input-major, int8 rows, 4-bit blocks) with 1 and 5 tokens, `reps` times, on fixed
   synthetic values. The products alone are timed (a monotonic clock; the allocation and the
   filling are not): their seconds go to *seconds. Returns a checksum, so that no compiler
   drops the work, or NaN when the memory cannot be allocated. */
double isa_probe(int64_t rows, int64_t reps, int num_threads, double* seconds) {
    const int64_t K = 576, B = 5, nb = K / 32;
    float* w = malloc(rows * K * sizeof(float));
    float* wt = malloc(K * rows * sizeof(float));
    int8_t* q8 = malloc(rows * K);
    float* scale = malloc(rows * sizeof(float));
    Q4Block* q4 = malloc(rows * nb * sizeof(Q4Block));
    float* X = malloc(B * K * sizeof(float));
    float* Y = malloc(B * rows * sizeof(float));
    float* parts = malloc((int64_t)num_threads * B * rows * sizeof(float));
    double check = NAN;
    if (w && wt && q8 && scale && q4 && X && Y && parts) {
        uint32_t r = 12345u;  /* a linear congruential generator: the same values every run */
        for (int64_t i = 0; i < rows * K; i++) {
            r = r * 1664525u + 1013904223u;
            w[i] = (float)(r >> 8) / 16777216.0f - 0.5f;
            wt[(i % K) * rows + i / K] = w[i];
            q8[i] = (int8_t)(r >> 24);
        }
        for (int64_t i = 0; i < rows; i++) scale[i] = 0.01f;
        for (int64_t i = 0; i < rows * nb; i++) {
            q4[i].scale = 0x3c24;  /* 0.01 and 0.5 in bfloat16 */
            q4[i].zero = 0x3f00;
            for (int q = 0; q < 16; q++) q4[i].codes[q] = (uint8_t)(w[(i * 16 + q) % (rows * K)] * 255.0f + 128.0f);
        }
        for (int64_t i = 0; i < B * K; i++) X[i] = w[i];
        const Mat mf = {w, 0, 0, FMT_F32}, mt = {wt, 0, rows, FMT_F32};
        const Mat m8 = {q8, scale, 0, FMT_I8}, m4 = {q4, 0, 0, FMT_Q4};
        check = 0.0;
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        for (int64_t rep = 0; rep < reps; rep++) {
            #pragma omp parallel num_threads(num_threads)
            {
                gemm_rows(mf, 0, X, Y, 1, rows, K, parts);
                #pragma omp barrier
                gemm_rows(mf, 0, X, Y, B, rows, K, parts);
                #pragma omp barrier
                gemm_rows(mt, 0, X, Y, 1, rows, K, parts);  /* ends with a barrier */
                gemm_rows(m8, 0, X, Y, 1, rows, K, parts);
                #pragma omp barrier
                gemm_rows(m8, 0, X, Y, B, rows, K, parts);
                #pragma omp barrier
                gemm_rows(m4, 0, X, Y, 1, rows, K, parts);
                #pragma omp barrier
                gemm_rows(m4, 0, X, Y, B, rows, K, parts);
            }
            check += Y[rep % (B * rows)];
        }
        clock_gettime(CLOCK_MONOTONIC, &t1);
        *seconds = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    }
    free(w); free(wt); free(q8); free(scale); free(q4); free(X); free(Y); free(parts);
    return check;
}
