/* One decode step of a Llama-family block in C: the compiled half of minisparse.decode.

   At batch 1 a decode step is a chain of matrix-vector products, each reading its weights once.
   Done with torch, every small operation (a norm, a rotation, a view, a softmax) is a separate
   dispatch, and a 30-layer model runs ~400 of them per token before a weight is read. Here each
   half of a block is one call and one parallel region:

     attn_step:   x += W_o attention(RoPE(W_q n), RoPE(W_k n), W_v n),   n = in(RMSNorm(x))
     mlp_step:    x += W_down down_in(act(W_gate n) * (W_up n)),         n = in(RMSNorm(x))
     sparse_mlp_step: the same MLP over the active neurons only (threshold or predictor)

   Matrices are nn.Linear's own layout, W [out, in] row-major, so a row is one contiguous
   stream and the threads split the rows between them (no reduction, no transposed copy at load
   time). The sparse step reads the down projection transposed, W_down_t [ffn, dim], so that an
   active neuron's down weights are one contiguous row too. Scratch memory is given by the
   caller and made once per decoder: nothing is allocated per token. */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#define THREAD_ID() omp_get_thread_num()
#define THREADS() omp_get_num_threads()
#else
#define THREAD_ID() 0
#define THREADS() 1
#endif

/* 16 floats in one vector register (AVX-512), or split over smaller ones elsewhere. */
typedef float v16 __attribute__((vector_size(64), aligned(4)));
static inline v16 load16(const float* p) { v16 v; __builtin_memcpy(&v, p, 64); return v; }
static inline float hsum(v16 v) {
    float s = 0.0f;
    for (int q = 0; q < 16; q++) s += v[q];
    return s;
}

/* What a projection's input goes through first: a ReLU and/or a magnitude threshold
   (|v| <= threshold -> 0; a negative threshold means none). Identity is {0, -1}. */
typedef struct {
    int32_t relu;
    float threshold;
} Slot;

enum { ACT_SILU = 0, ACT_RELU = 1, ACT_GELU = 2 };

typedef struct {
    int64_t dim, n_heads, n_kv_heads, head_dim, max_seq;
    float eps, rope_scale;
    const float *norm, *inv_freq;                /* [dim], [head_dim / 2] */
    const float *wq, *wk, *wv, *wo;              /* [out, in] row-major */
    const float *bq, *bk, *bv, *bo;              /* biases or NULL */
    float *k_cache, *v_cache;                    /* [n_kv_heads, max_seq, head_dim] */
    Slot in;                                     /* layers[i].attn_in_act */
} AttnLayer;

typedef struct {
    int64_t dim, ffn;
    float eps;
    const float* norm;
    const float *wg, *wu, *wd;                   /* [ffn, dim], [ffn, dim], [dim, ffn] */
    const float *bg, *bu, *bd;
    int32_t act;                                 /* ACT_* */
    float act_threshold;                         /* CATS threshold on act(gate), < 0: none */
    Slot in, down_in;                            /* mlp_in_act, mlp.down_in_act */
} MlpLayer;

typedef struct {
    int64_t dim, ffn, rank;
    float eps;
    const float* norm;
    const float *wg, *wu, *wd_t;                 /* [ffn, dim], [ffn, dim], [ffn, dim] */
    int32_t act;
    Slot in;
    float threshold;                             /* threshold mode: active = |act(gate)| > t */
    const float *pu, *pu_bias, *pv, *pv_bias;    /* predictor mode (pu != NULL): [rank, dim], */
    int32_t predictor_relu;                      /* [rank] or NULL, [ffn, rank], [ffn]       */
    float cutoff;                                /* active = logit > cutoff */
} SparseMlpLayer;

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

static inline float dot(const float* a, const float* b, int64_t n) {
    v16 s0 = {0}, s1 = {0};
    int64_t k = 0;
    for (; k + 32 <= n; k += 32) {
        s0 += load16(a + k) * load16(b + k);
        s1 += load16(a + k + 16) * load16(b + k + 16);
    }
    for (; k + 16 <= n; k += 16) s0 += load16(a + k) * load16(b + k);
    float s = hsum(s0 + s1);
    for (; k < n; k++) s += a[k] * b[k];
    return s;
}

/* a . b, asking the memory system for the row `next` (may be NULL) meanwhile: a gathered row is
   a short burst that the hardware prefetcher has not locked onto yet (chapter 07). */
static inline float dot_next(const float* a, const float* b, int64_t n, const float* next) {
    if (next)
        for (int64_t k = 0; k < n; k += 16) __builtin_prefetch(next + k, 0, 0);
    return dot(a, b, n);
}

/* y[i] = W[i] . x for four consecutive rows at once: four independent streams, x read once. */
static inline void dot4(const float* W, int64_t K, const float* x, float* y) {
    const float *r0 = W, *r1 = W + K, *r2 = W + 2 * K, *r3 = W + 3 * K;
    v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        v16 xv = load16(x + k);
        a0 += load16(r0 + k) * xv;
        a1 += load16(r1 + k) * xv;
        a2 += load16(r2 + k) * xv;
        a3 += load16(r3 + k) * xv;
    }
    float s0 = hsum(a0), s1 = hsum(a1), s2 = hsum(a2), s3 = hsum(a3);
    for (; k < K; k++) {
        s0 += r0[k] * x[k];
        s1 += r1[k] * x[k];
        s2 += r2[k] * x[k];
        s3 += r3[k] * x[k];
    }
    y[0] = s0, y[1] = s1, y[2] = s2, y[3] = s3;
}

/* y = W x (+ b) over rows [0, N), split between the team's threads (called inside a parallel
   region by every thread; no barrier at the end). */
static void gemv_rows(const float* W, const float* b, const float* x, float* y, int64_t N,
                      int64_t K) {
    int64_t blocks = N / 4;
    #pragma omp for schedule(static) nowait
    for (int64_t i = 0; i < blocks; i++) dot4(W + 4 * i * K, K, x, y + 4 * i);
    #pragma omp for schedule(static) nowait
    for (int64_t i = 4 * blocks; i < N; i++) y[i] = dot(W + i * K, x, K);
    if (b) {
        #pragma omp barrier
        #pragma omp for schedule(static) nowait
        for (int64_t i = 0; i < N; i++) y[i] += b[i];
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

/* Scratch floats attn_step needs (the caller allocates them once). */
int64_t attn_scratch(int64_t dim, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim,
                     int64_t max_seq) {
    return dim + (n_heads + 2 * n_kv_heads) * head_dim + n_heads * head_dim + head_dim
           + n_heads * max_seq;
}

/* x += attention block of one token at position pos; writes its key/value into the cache. */
int attn_step(const AttnLayer* L, float* x, int64_t pos, float* scratch, int num_threads) {
    const int64_t D = L->dim, H = L->n_heads, G = L->n_kv_heads, hd = L->head_dim;
    if (pos < 0 || pos >= L->max_seq) return 1;
    float* n = scratch;
    float* q = n + D;
    float* k = q + H * hd;
    float* v = k + G * hd;
    float* att = v + G * hd;
    float* cs = att + H * hd;                     /* cos [hd/2], then sin [hd/2] */
    float* scores = cs + hd;
    const int64_t T = pos + 1;
    const float scale = 1.0f / sqrtf((float)hd);
    #pragma omp parallel num_threads(num_threads)
    {
        #pragma omp single
        {
            rmsnorm(x, L->norm, L->eps, D, n);
            for (int64_t i = 0; i < D; i++) n[i] = slot(L->in, n[i]);
            for (int64_t i = 0; i < hd / 2; i++) {
                float angle = (float)pos * L->inv_freq[i];   /* float32, as rope_cos_sin */
                cs[i] = cosf(angle) * L->rope_scale;
                cs[hd / 2 + i] = sinf(angle) * L->rope_scale;
            }
        }
        gemv_rows(L->wq, L->bq, n, q, H * hd, D);
        gemv_rows(L->wk, L->bk, n, k, G * hd, D);
        gemv_rows(L->wv, L->bv, n, v, G * hd, D);
        #pragma omp barrier
        #pragma omp for schedule(static)
        for (int64_t h = 0; h < H + G; h++) {
            if (h < H) {
                rope(q + h * hd, cs, cs + hd / 2, hd);
            } else {
                int64_t g = h - H;
                rope(k + g * hd, cs, cs + hd / 2, hd);
                memcpy(L->k_cache + (g * L->max_seq + pos) * hd, k + g * hd, hd * sizeof(float));
                memcpy(L->v_cache + (g * L->max_seq + pos) * hd, v + g * hd, hd * sizeof(float));
            }
        }
        /* softmax(q K^T / sqrt(d)) V per query head; head h reads key/value head h / (H / G) */
        #pragma omp for schedule(static)
        for (int64_t h = 0; h < H; h++) {
            const float* qh = q + h * hd;
            const float* K = L->k_cache + (h / (H / G)) * L->max_seq * hd;
            const float* V = L->v_cache + (h / (H / G)) * L->max_seq * hd;
            float* s = scores + h * L->max_seq;
            float top = -INFINITY;
            for (int64_t t = 0; t < T; t++) {
                s[t] = dot(qh, K + t * hd, hd) * scale;
                if (s[t] > top) top = s[t];
            }
            float total = 0.0f;
            for (int64_t t = 0; t < T; t++) total += (s[t] = expf(s[t] - top));
            float* o = att + h * hd;
            for (int64_t i = 0; i < hd; i++) o[i] = 0.0f;
            for (int64_t t = 0; t < T; t++) {
                float p = s[t] / total;
                const float* vt = V + t * hd;
                for (int64_t i = 0; i < hd; i++) o[i] += p * vt[i];
            }
        }
        gemv_rows(L->wo, L->bo, att, q, D, H * hd);  /* q is free again: the output goes there */
        #pragma omp barrier
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < D; i++) x[i] += q[i];
    }
    return 0;
}

int64_t mlp_scratch(int64_t dim, int64_t ffn) { return 2 * dim + ffn; }

/* x += gated MLP of one token (dense). */
int mlp_step(const MlpLayer* L, float* x, float* scratch, int num_threads) {
    const int64_t D = L->dim, F = L->ffn;
    float* n = scratch;
    float* y = n + D;
    float* h = y + D;
    #pragma omp parallel num_threads(num_threads)
    {
        #pragma omp single
        {
            rmsnorm(x, L->norm, L->eps, D, n);
            for (int64_t i = 0; i < D; i++) n[i] = slot(L->in, n[i]);
        }
        #pragma omp for schedule(static)
        for (int64_t j = 0; j < F; j++) {
            float g = dot(L->wg + j * D, n, D) + (L->bg ? L->bg[j] : 0.0f);
            float u = dot(L->wu + j * D, n, D) + (L->bu ? L->bu[j] : 0.0f);
            float a = activate(L->act, g);
            if (L->act_threshold >= 0.0f && fabsf(a) <= L->act_threshold) a = 0.0f;
            h[j] = slot(L->down_in, a * u);
        }
        gemv_rows(L->wd, L->bd, h, y, D, F);
        #pragma omp barrier
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < D; i++) x[i] += y[i];
    }
    return 0;
}

#define GROUP 8

/* Scratch floats sparse_mlp_step needs: the indices (int64, two floats each), the norm, the
   gate values or logits, the predictor's bottleneck, the values, one partial output per thread. */
int64_t sparse_mlp_scratch(int64_t dim, int64_t ffn, int64_t rank, int num_threads) {
    return dim + ffn + rank + 2 * ffn + ffn + (int64_t)num_threads * dim;
}

/* x += the gated MLP over the active neurons only. Threshold mode (pu == NULL): the gate is
   dense, neuron j is active when |act(g_j)| > threshold, and only its up row and down row are
   read. Predictor mode: logits z = pv (pu n + pu_bias, ReLU'd for the MLP kind) + pv_bias,
   neuron j is active when z_j > cutoff; then gate, up and down read only the active rows.
   Returns the number of active neurons (for reporting), or -1 on a bad argument. */
int64_t sparse_mlp_step(const SparseMlpLayer* L, float* x, float* scratch, int num_threads) {
    const int64_t D = L->dim, F = L->ffn, R = L->rank;
    int64_t* idx = (int64_t*)scratch;  /* first, so that it is 8-byte aligned */
    float* n = (float*)(idx + F);
    float* a = n + D;                  /* act(gate) of every neuron (threshold) or logits */
    float* t = a + F;                  /* predictor bottleneck [rank] */
    float* hv = t + R;                 /* values of the active neurons */
    float* parts = hv + F;             /* [threads, D] */
    int64_t count = 0;
    const int predicted = L->pu != 0;
    #pragma omp parallel num_threads(num_threads)
    {
        #pragma omp single
        {
            rmsnorm(x, L->norm, L->eps, D, n);
            for (int64_t i = 0; i < D; i++) n[i] = slot(L->in, n[i]);
        }
        if (predicted) {
            #pragma omp for schedule(static)
            for (int64_t r = 0; r < R; r++) {
                float z = dot(L->pu + r * D, n, D) + (L->pu_bias ? L->pu_bias[r] : 0.0f);
                t[r] = L->predictor_relu && z < 0.0f ? 0.0f : z;
            }
            #pragma omp for schedule(static)
            for (int64_t j = 0; j < F; j++) a[j] = dot(L->pv + j * R, t, R) + L->pv_bias[j];
        } else {
            #pragma omp for schedule(static)
            for (int64_t j = 0; j < F; j++) a[j] = activate(L->act, dot(L->wg + j * D, n, D));
        }
        #pragma omp single
        {
            for (int64_t j = 0; j < F; j++)
                if (predicted ? a[j] > L->cutoff : fabsf(a[j]) > L->threshold) idx[count++] = j;
        }
        #pragma omp for schedule(dynamic, 16)
        for (int64_t i = 0; i < count; i++) {
            int64_t j = idx[i];
            const float* next_up = i + 1 < count ? L->wu + idx[i + 1] * D : 0;
            float g = a[j];
            if (predicted) {
                const float* next_gate = i + 1 < count ? L->wg + idx[i + 1] * D : 0;
                g = activate(L->act, dot_next(L->wg + j * D, n, D, next_gate));
            }
            hv[i] = g * dot_next(L->wu + j * D, n, D, next_up);
        }
        /* y = sum_i hv[i] W_down_t[idx[i]]: groups of GROUP rows summed in registers, each
           thread into its own partial sum, then the partials added to x */
        float* part = parts + (int64_t)THREAD_ID() * D;
        for (int64_t c = 0; c < D; c++) part[c] = 0.0f;
        #pragma omp for schedule(dynamic, 2)
        for (int64_t g0 = 0; g0 < count; g0 += GROUP) {
            int64_t g = count - g0 < GROUP ? count - g0 : GROUP;
            for (int64_t r = g0 + GROUP; r < g0 + 2 * GROUP && r < count; r++)
                for (int64_t k = 0; k < D; k += 16) __builtin_prefetch(L->wd_t + idx[r] * D + k, 0, 0);
            int64_t c = 0;
            for (; c + 16 <= D; c += 16) {
                v16 s = {0};
                for (int64_t r = 0; r < g; r++) s += hv[g0 + r] * load16(L->wd_t + idx[g0 + r] * D + c);
                v16 old = load16(part + c);
                old += s;
                __builtin_memcpy(part + c, &old, 64);
            }
            for (; c < D; c++) {
                float s = 0.0f;
                for (int64_t r = 0; r < g; r++) s += hv[g0 + r] * L->wd_t[idx[g0 + r] * D + c];
                part[c] += s;
            }
        }
        int nt = THREADS();
        #pragma omp for schedule(static)
        for (int64_t c = 0; c < D; c++) {
            float s = 0.0f;
            for (int p = 0; p < nt; p++) s += parts[p * D + c];
            x[c] += s;
        }
    }
    return count;
}

/* logits = W_out RMSNorm(x) (the LM head; W_out [vocab, dim]). */
void lm_head_step(const float* x, const float* norm, float eps, const float* w_out,
                  int64_t vocab, int64_t dim, float* scratch, float* logits, int num_threads) {
    #pragma omp parallel num_threads(num_threads)
    {
        #pragma omp single
        rmsnorm(x, norm, eps, dim, scratch);
        gemv_rows(w_out, 0, scratch, logits, vocab, dim);
    }
}
