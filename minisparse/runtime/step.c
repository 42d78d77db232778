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
   way a weight row is stored (float32, int8, 4-bit blocks), are in matvec.h. */
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
#include "matvec.h"


/* Mat, Slot, AttnLayer, MlpLayer, SparseMlpLayer, MAX_TOKENS, GROUP and the ACT_* codes are
   declared once, in abi.h (shared with minisparse/kernels/abi.py). */

static inline float slot(Slot s, float v) {
    if (s.relu && v < 0.0f) v = 0.0f;
    if (s.threshold >= 0.0f && fabsf(v) <= s.threshold) v = 0.0f;
    return v;
}

static inline float activate(int act, float v) {
    if (act == ACT_SILU) return v / (1.0f + expf(-v));
    if (act == ACT_RELU) return v > 0.0f ? v : 0.0f;
    return 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
}


/* The most inputs (times tokens) whose int8 rounding a thread keeps on its stack (16 KB);
   a wider 4-bit matrix with int8 activations falls back to float activations. */
#define Q8_MAX_INPUTS 16384

/* y = W x (+ b) over rows [0, N), split between the team's threads (called inside a parallel
   region by every thread; no barrier at the end). One row at a time: each thread reads its
   rows as one sequential stream. (Four rows at once, four interleaved streams per thread, was
   measured 2x slower on a 2-core AMD EPYC for the 576-wide rows of attention and the LM head:
   the hardware prefetcher follows one stream per thread far better than four.) */
static void gemv_rows(Mat W, const float* b, const float* x, float* y, int64_t N, int64_t K) {
    if (W.q4 == Q4_INT8_ACT && K <= Q8_MAX_INPUTS) {  /* each thread rounds x once, then rows */
        int8_t q[Q8_MAX_INPUTS];
        float d[Q8_MAX_INPUTS / 32], c[Q8_MAX_INPUTS / 32];
        quantize_q8(x, K, q, d, c);
        const Q8Act a = {K / 32, q, d, c};
        #pragma omp for schedule(static) nowait
        for (int64_t i = 0; i < N; i++) y[i] = dot_q4_q8(q4_row(W, i, K), a);
    } else {
        #pragma omp for schedule(static) nowait
        for (int64_t i = 0; i < N; i++) y[i] = mdot(W, i, x, K);
    }
    if (b) {
        #pragma omp barrier
        #pragma omp for schedule(static) nowait
        for (int64_t i = 0; i < N; i++) y[i] += b[i];
    }
}

/* Up to three projections that share their input, from one bundled input-major matrix Wt
   [K, S] (projection p: columns off_p .. off_p + N[p], off_p = N[0] + .. + N[p - 1]):
   Y_p[b] = W_p X[b] (+ bias_p) for B tokens. Only the rows of inputs that are non-zero for
   some token are read, so a share s of zero inputs skips a share s of the bytes (TEAL's column
   sparsity). The threads split the inputs: each reads whole rows (one long burst per input,
   which the memory system streams far better than pieces of rows) and sums them, GROUP at a
   time in registers, into its own partial [B, sum N] in ``parts``; then the partials are
   added. Every thread finds its own non-zero inputs: no index list is shared. Ends with a
   barrier (the partials are reused by the next call). */
static void scatter_gemm(const float* Wt, int64_t S, int n_proj, const int64_t* N, float* const* Y,
                      const float* const* bias, const float* X, int64_t B, int64_t K,
                      float* parts) {
    int64_t total = 0;
    for (int p = 0; p < n_proj; p++) total += N[p];
    const int64_t nt = THREADS(), t = THREAD_ID(), k1 = K * (t + 1) / nt;
    float* part = parts + t * B * total;
    for (int64_t i = 0; i < B * total; i++) part[i] = 0.0f;
    int64_t rows[GROUP], g = 0;
    for (int64_t k = K * t / nt; k <= k1; k++) {
        if (k < k1) {
            int any = 0;
            for (int64_t b = 0; b < B; b++) any |= X[b * K + k] != 0.0f;
            if (any) rows[g++] = k;
            if (g < GROUP) continue;
        }
        for (int64_t b = 0; b < B; b++) {
            float h[GROUP];
            for (int64_t r = 0; r < g; r++) h[r] = X[b * K + rows[r]];
            float* y = part + b * total;
            int64_t c = 0;
            for (; c + 16 <= total; c += 16) {
                v16 acc = load16(y + c);
                for (int64_t r = 0; r < g; r++) acc = smadd16(h[r], load16(Wt + rows[r] * S + c), acc);
                store16(y + c, acc);
            }
            for (; c < total; c++)
                for (int64_t r = 0; r < g; r++) y[c] += h[r] * Wt[rows[r] * S + c];
        }
        g = 0;
    }
    #pragma omp barrier
    #pragma omp for schedule(static)
    for (int64_t i = 0; i < B * total; i++) {
        int64_t b = i / total, c = i % total, p = 0;
        while (c >= N[p]) c -= N[p++];
        float sum = bias[p] ? bias[p][c] : 0.0f;
        for (int64_t q = 0; q < nt; q++) sum += parts[q * B * total + i];
        Y[p][b * N[p] + c] = sum;
    }
}

/* Y[b] = W X[b] (+ bias) for B tokens (X [B, K], Y [B, N]): each weight is read once for all B,
   so a few tokens cost about what one costs while the weights, not the arithmetic, are the
   limit (speculative decoding's verification pass). No barrier at the end. An input-major
   matrix goes to scatter_gemm (its partial sums in ``parts``; it ends with a barrier). */
static void gemm_rows(Mat W, const float* bias, const float* X, float* Y, int64_t B, int64_t N,
                      int64_t K, float* parts) {
    if (W.in_stride) {
        scatter_gemm((const float*)W.data, W.in_stride, 1, &N, &Y, &bias, X, B, K, parts);
        return;
    }
    if (B == 1) {
        gemv_rows(W, bias, X, Y, N, K);
        return;
    }
    if (W.q4 == Q4_INT8_ACT && B * K <= Q8_MAX_INPUTS) {  /* as gemv_rows, B tokens a row */
        int8_t q[Q8_MAX_INPUTS];
        float d[Q8_MAX_INPUTS / 32], c[Q8_MAX_INPUTS / 32];
        Q8Act a[MAX_TOKENS];
        for (int64_t b = 0; b < B; b++) {
            quantize_q8(X + b * K, K, q + b * K, d + b * (K / 32), c + b * (K / 32));
            a[b] = (Q8Act){K / 32, q + b * K, d + b * (K / 32), c + b * (K / 32)};
        }
        #pragma omp for schedule(static) nowait
        for (int64_t i = 0; i < N; i++)
            for (int64_t b = 0; b < B; b++)
                Y[b * N + i] = dot_q4_q8(q4_row(W, i, K), a[b]) + (bias ? bias[i] : 0.0f);
        return;
    }
    if (W.q4 || W.nm_pos) {
        #pragma omp for schedule(static) nowait
        for (int64_t i = 0; i < N; i++) {
            float out[MAX_TOKENS];
            mdot_tokens(W, i, X, B, K, out);
            for (int64_t b = 0; b < B; b++) Y[b * N + i] = out[b] + (bias ? bias[i] : 0.0f);
        }
        return;
    }
    /* float32 or int8 rows: tiles of R consecutive rows (matvec.h's mdot_tile), each thread a
       contiguous run of tiles, the next tile prefetched while one is summed; the rows past
       the last whole tile one at a time */
    const int R = tile_rows(B);
    const int64_t tiles = N / R;
    #pragma omp for schedule(static) nowait
    for (int64_t t = 0; t <= tiles; t++) {
        const int64_t i0 = t * R, m = t < tiles ? R : N - i0;
        if (m == 0) continue;
        float out[4 * MAX_TOKENS];
        for (int64_t q0 = 0; q0 < m; q0 += m == R ? R : 1) {  /* a whole tile, or row by row */
            const int64_t idx[4] = {i0 + q0, i0 + q0 + 1, i0 + q0 + 2, i0 + q0 + 3};
            mdot_tile(W, idx, m == R ? R : 1, X, B, K, out + q0 * B);
        }
        for (int q = 0; q < m; q++)
            for (int64_t b = 0; b < B; b++)
                Y[b * N + i0 + q] = out[q * B + b] + (bias ? bias[i0 + q] : 0.0f);
    }
}

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
        const int q8 = L->wg.q4 == Q4_INT8_ACT && L->wu.q4 == Q4_INT8_ACT;
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

/* part += sum_r h[r] W[rows[r]] over g <= GROUP rows of W [*, D] (float32 or int8 codes, one
   function each), summed in registers: GROUP row streams in flight. (Prefetching the next
   group's rows in one burst before the sums, as an earlier version did, ran the down rows of
   SmolLM2 at ~18 GB/s on a 2-core AMD EPYC instead of ~34: the burst crowds out the loads.) */
#define DOWN_GROUP(NAME, T, LOAD16)                                                            \
    static void NAME(const T* W, const int64_t* rows, int64_t g, const float* h, float* part, \
                     int64_t D) {                                                              \
        int64_t c = 0;                                                                         \
        for (; c + 16 <= D; c += 16) {                                                         \
            v16 s = zero16();                                                                  \
            for (int64_t r = 0; r < g; r++) s = smadd16(h[r], LOAD16(W + rows[r] * D + c), s); \
            store16(part + c, add16(load16(part + c), s));                                     \
        }                                                                                      \
        for (; c < D; c++) {                                                                   \
            float s = 0.0f;                                                                    \
            for (int64_t r = 0; r < g; r++) s += h[r] * (float)W[rows[r] * D + c];             \
            part[c] += s;                                                                      \
        }                                                                                      \
    }

DOWN_GROUP(down_group, float, load16)
DOWN_GROUP(down_group_i8, int8_t, load16_i8)

static void down_rows(Mat W, const int64_t* rows, int64_t g, const float* h, float* part,
                      int64_t D) {
    if (W.scale)
        down_group_i8((const int8_t*)W.data, rows, g, h, part, D);
    else
        down_group((const float*)W.data, rows, g, h, part, D);
}

/* Scratch floats sparse_mlp_step needs for up to MAX_TOKENS tokens: the indices (int64, two
   floats each), the norms, the gate values or logits, the predictor's bottleneck, the values,
   one partial output per thread. */
int64_t sparse_mlp_scratch(int64_t dim, int64_t ffn, int64_t rank, int num_threads) {
    return 2 * ffn + MAX_TOKENS * (dim + 2 * ffn + rank + (int64_t)num_threads * dim);
}

/* x[b] += the gated MLP of B <= MAX_TOKENS tokens over the active neurons only. Threshold mode
   (pu == NULL): the gate is dense, neuron j is active for token b when |act(g_bj)| > threshold;
   the up and down rows of the neurons active for any token are read once for all of them, and
   each token keeps its own neurons (h_bj = 0 where j is not active for b). Predictor mode:
   logits z = pv (pu n + pu_bias, ReLU'd for the MLP kind) + pv_bias, neuron j is active when
   z_bj > cutoff for some token b, and every token runs the union (as torch's SparseMLP does);
   gate, up and down read only those rows. Returns the number of neurons read (for
   reporting), or -1 on a bad argument. */
int64_t sparse_mlp_step(const SparseMlpLayer* L, float* x, int64_t B, float* scratch,
                        int num_threads) {
    const int64_t D = L->dim, F = L->ffn, R = L->rank;
    if (B < 1 || B > MAX_TOKENS) return -1;
    int64_t* idx = (int64_t*)scratch;  /* first, so that it is 8-byte aligned */
    float* n = (float*)(idx + F);      /* [B, D] */
    float* a = n + B * D;              /* [B, F]: act(gate) (threshold mode) or logits */
    float* t = a + B * F;              /* [B, rank]: the predictor's bottleneck */
    float* hv = t + B * R;             /* [B, F]: values of the active neurons, in idx order */
    float* parts = hv + B * F;         /* [threads, B, D] */
    int64_t count = 0;
    const int predicted = L->pu != 0;
    #pragma omp parallel num_threads(num_threads)
    {
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < B; b++) {
            rmsnorm(x + b * D, L->norm, L->eps, D, n + b * D);
            for (int64_t i = 0; i < D; i++) n[b * D + i] = slot(L->in, n[b * D + i]);
        }
        if (predicted) {  /* z = pv act(pu n + pu_bias) + pv_bias */
            #pragma omp for schedule(static)
            for (int64_t r = 0; r < R; r++)
                for (int64_t b = 0; b < B; b++) {
                    float z = dot(L->pu + r * D, n + b * D, D) + (L->pu_bias ? L->pu_bias[r] : 0.0f);
                    t[b * R + r] = L->predictor_relu && z < 0.0f ? 0.0f : z;
                }
            #pragma omp for schedule(static)
            for (int64_t j = 0; j < F; j++)
                for (int64_t b = 0; b < B; b++)
                    a[b * F + j] = dot(L->pv + j * R, t + b * R, R) + L->pv_bias[j];
        } else if (B == 1 && L->wg.scale) {  /* int8 gate: the dense gate decides (gemv_rows) */
            gemv_rows(L->wg, 0, n, a, F, D);
            #pragma omp barrier
            #pragma omp for schedule(static)
            for (int64_t j = 0; j < F; j++) a[j] = activate(L->act, a[j]);
        } else if (B == 1) {  /* the dense float32 gate decides, one row at a time as in mlp_step */
            const float* wg = (const float*)L->wg.data;
            #pragma omp for schedule(static)
            for (int64_t j = 0; j < F; j++) a[j] = activate(L->act, dot(wg + j * D, n, D));
        } else {  /* several tokens: each gate row read once for all of them */
            #pragma omp for schedule(static)
            for (int64_t j = 0; j < F; j++) {
                float g[MAX_TOKENS];
                mdot_tokens(L->wg, j, n, B, D, g);
                for (int64_t b = 0; b < B; b++) a[b * F + j] = activate(L->act, g[b]);
            }
        }
        #pragma omp single
        {
            for (int64_t j = 0; j < F; j++) {
                int on = 0;
                for (int64_t b = 0; b < B; b++)
                    on |= predicted ? a[b * F + j] > L->cutoff : fabsf(a[b * F + j]) > L->threshold;
                if (on) idx[count++] = j;
            }
        }
        if (B == 1) {
            /* gate (predictor mode) and up rows of the active neurons, GATHER rows at a time
               (8 neurons' gate and up, or 16 neurons' up): GATHER row streams in flight. A
               short tail group repeats its last neuron. */
            const int64_t per = predicted ? GATHER / 2 : GATHER;
            #pragma omp for schedule(static)
            for (int64_t q = 0; q < (count + per - 1) / per; q++) {
                const int64_t i0 = q * per, m = count - i0 < per ? count - i0 : per;
                const Mat* M[GATHER];
                int64_t rows[GATHER];
                float y[GATHER];
                for (int64_t r = 0; r < GATHER; r++) {
                    rows[r] = idx[i0 + (r % per < m ? r % per : m - 1)];
                    M[r] = predicted && r < per ? &L->wg : &L->wu;
                }
                mdot_gather(M, rows, D, n, y);
                for (int64_t r = 0; r < m; r++)
                    hv[i0 + r] = (predicted ? activate(L->act, y[r]) : a[rows[r]]) *
                                 y[predicted ? per + r : r];
            }
        } else {  /* each active row read once for all B tokens */
            #pragma omp for schedule(static)
            for (int64_t i = 0; i < count; i++) {
                const int64_t j = idx[i];
                float g[MAX_TOKENS], u[MAX_TOKENS];
                if (predicted) {
                    mdot_tokens2(L->wg, L->wu, j, n, B, D, g, u);
                    for (int64_t b = 0; b < B; b++) hv[b * F + i] = activate(L->act, g[b]) * u[b];
                } else {
                    mdot_tokens(L->wu, j, n, B, D, u);
                    for (int64_t b = 0; b < B; b++) {
                        float ab = a[b * F + j];
                        hv[b * F + i] = fabsf(ab) > L->threshold ? ab * u[b] : 0.0f;
                    }
                }
            }
        }
        /* y[b] = sum_i hv[b, i] W_down_t[idx[i]]: groups of GROUP rows summed in registers, each
           thread into its own partial sums, then the partials added to x. The group's rows are
           read from memory for the first token and from cache for the others. Int8 rows: the
           codes are summed, and the per-output scale multiplies the total (it factors out).
           (Adding each group's down rows right after its gate and up rows, with no barrier
           between the stages, measured no faster.) */
        float* part = parts + (int64_t)THREAD_ID() * B * D;
        for (int64_t c = 0; c < B * D; c++) part[c] = 0.0f;
        #pragma omp for schedule(static)
        for (int64_t g0 = 0; g0 < count; g0 += GROUP) {
            int64_t g = count - g0 < GROUP ? count - g0 : GROUP;
            for (int64_t b = 0; b < B; b++)
                down_rows(L->wd_t, idx + g0, g, hv + b * F + g0, part + b * D, D);
        }
        int nt = THREADS();
        const float* sd = L->wd_t.scale;
        #pragma omp for schedule(static)
        for (int64_t c = 0; c < B * D; c++) {
            float s = 0.0f;
            for (int p = 0; p < nt; p++) s += parts[p * B * D + c];
            x[c] += sd ? sd[c % D] * s : s;
        }
    }
    return count;
}

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
        const Mat mf = {w, 0, 0, 0}, mt = {wt, 0, rows, 0}, m8 = {q8, scale, 0, 0}, m4 = {q4, 0, 0, 1};
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
