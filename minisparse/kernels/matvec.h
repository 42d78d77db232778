/* Matrix rows times vectors, for the decode step (runtime/step.c pastes this file in): the
   dot products of one weight row with one token's vector, with sixteen gathered rows, and with
   up to MAX_TOKENS token vectors at once, for each way a row can be stored. A weight is read
   once and turned into floats in registers; the arithmetic is float32 throughout. */

/* A weight matrix [rows, cols] as C reads it. Row-major, one of:
   - float32 (scale == NULL, q4 == 0);
   - weight-only int8 codes with one float32 scale per row, w_ij = scale_i * q_ij (chapter 09's
     Int8Linear): a quarter of the bytes;
   - q4 != 0: 4-bit codes in blocks of 32 weights (Q4Block, chapter 09's Int4Linear), each with
     its own scale and zero point: an eighth of the bytes, plus a fifth of that for the
     block parameters;
   - nm_pos != NULL: 2:4 sparse, the 2 kept values of every 4 inputs (float32, or int8 codes
     with a row scale) and their 2-bit positions (below): about half the bytes.
   With in_stride > 0, data is instead a transpose (float32 only), one row per *input*, rows
   in_stride floats apart: an input that is zero (a TEAL threshold cut it) costs no bytes, since
   its row is never read. Projections that share an input (q, k, v; gate, up) share one bundled
   row per input, [W_q^T | W_k^T | W_v^T]: one long burst instead of three short ones. */
/* Mat itself is declared in abi.h. */

/* 32 consecutive weights of a row in 20 bytes: w = (u - 8) * scale + zero for the unsigned
   4-bit codes u, scale and zero stored as bfloat16 (the values torch's int4 kernel uses), the
   codes two per byte: byte q holds weight q in its low half and weight 16 + q in its high half,
   so one widening gives the first 16 weights and a shift the other 16. The block's parameters
   sit just before its codes: a row is one sequential stream. */
typedef struct {
    uint16_t scale, zero;
    uint8_t codes[16];
} Q4Block;

static inline float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    __builtin_memcpy(&f, &bits, 4);
    return f;
}

/* The 32 weights of a block as floats: lo = weights 0..15, hi = weights 16..31. */
static inline void q4_weights(const Q4Block* b, v16* lo, v16* hi) {
    const float s = bf16_to_float(b->scale), z = bf16_to_float(b->zero) - 8.0f * s;
    v16 u_lo, u_hi;
    load32_u4(b->codes, &u_lo, &u_hi);
    *lo = smadd16(s, u_lo, splat16(z));
    *hi = smadd16(s, u_hi, splat16(z));
}

/* row . x for a row of nb blocks (32 nb inputs). */
static inline float dot_q4(const Q4Block* row, const float* x, int64_t nb) {
    v16 s0 = zero16(), s1 = zero16();
    for (int64_t g = 0; g < nb; g++) {
        v16 lo, hi;
        q4_weights(row + g, &lo, &hi);
        s0 = madd16(lo, load16(x + 32 * g), s0);
        s1 = madd16(hi, load16(x + 32 * g + 16), s1);
    }
    return hsum16(add16(s0, s1));
}

/* 4-bit rows times int8 activations (Mat.q4 == Q4_INT8_ACT), the dot product llama.cpp's
   Q4 x Q8 kernels compute. Each block of 32 inputs x is rounded to q = round(x / d) with
   d = max|x| / 127 (int8, ``quantize_q8``), and with ŵ = (u - 8) s + z the block's share is

       Σ ŵ_i d q_i = s d Σ u_i q_i + (z - 8 s) d Σ q_i,

   so the inner sum Σ u_i q_i is integer arithmetic on bytes: one AVX-512 VNNI vpdpbusd (four
   unsigned-by-signed byte products summed into each 32-bit lane) per block, or AVX2's
   vpmaddubsw + vpmaddwd, and one float multiply-add per block instead of 32. The float path
   (Q4_FLOAT_ACT) widens every weight to a float and spends two multiply-adds on it: at 5 bytes
   a weight-pair that arithmetic, not the memory, set the speed. The result equals the float
   product of the dequantized weights with the rounded activations x̂ = d q (up to float32
   summation order); the rounding of x is the approximation, which the perplexity shows. */
typedef struct {
    int64_t nb;       /* blocks of 32 inputs */
    const int8_t* q;  /* [32 nb] */
    const float* d;   /* [nb] scales */
    const float* c;   /* [nb]: d Σ q of each block */
} Q8Act;

static inline void quantize_q8(const float* x, int64_t K, int8_t* q, float* d, float* c) {
    for (int64_t b = 0; b < K / 32; b++) {
        float m = 0.0f;
        for (int i = 0; i < 32; i++) m = fmaxf(m, fabsf(x[32 * b + i]));
        const float db = m / 127.0f, inv = db > 0.0f ? 1.0f / db : 0.0f;
        int sum = 0;
        for (int i = 0; i < 32; i++) {
            const int v = (int)nearbyintf(x[32 * b + i] * inv);
            q[32 * b + i] = (int8_t)v;
            sum += v;
        }
        d[b] = db;
        c[b] = db * (float)sum;
    }
}

/* Σ u_i q_i over one block: u the 32 codes (low halves of the 16 bytes, then high halves),
   q its 32 int8 activations. */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define Q8_LANES __m256i
static inline __m256i q4q8_block(const uint8_t* codes, const int8_t* q) {
    const __m128i m4 = _mm_set1_epi8(15), c = _mm_loadu_si128((const __m128i*)codes);
    const __m128i lo = _mm_and_si128(c, m4), hi = _mm_and_si128(_mm_srli_epi16(c, 4), m4);
    const __m256i u = _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, _mm256_loadu_si256((const __m256i*)q));
}
#elif defined(__AVX2__)
#define Q8_LANES __m256i
static inline __m256i q4q8_block(const uint8_t* codes, const int8_t* q) {
    const __m128i m4 = _mm_set1_epi8(15), c = _mm_loadu_si128((const __m128i*)codes);
    const __m128i lo = _mm_and_si128(c, m4), hi = _mm_and_si128(_mm_srli_epi16(c, 4), m4);
    const __m256i u = _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
    /* u <= 15 and |q| <= 127: a pair sums to at most 3810, no int16 saturation */
    const __m256i pairs = _mm256_maddubs_epi16(u, _mm256_loadu_si256((const __m256i*)q));
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}
#endif

/* row . x̂ for a row of nb blocks and activations a (quantize_q8). */
static inline float dot_q4_q8(const Q4Block* row, Q8Act a) {
    float corr = 0.0f;
#ifdef Q8_LANES
    __m256 acc = _mm256_setzero_ps();
    for (int64_t g = 0; g < a.nb; g++) {
        const float s = bf16_to_float(row[g].scale), z = bf16_to_float(row[g].zero);
        const __m256i p = q4q8_block(row[g].codes, a.q + 32 * g);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(s * a.d[g]), acc);
        corr += (z - 8.0f * s) * a.c[g];
    }
    v8 t = (v8)acc;
    return ((t[0] + t[4]) + (t[2] + t[6])) + ((t[1] + t[5]) + (t[3] + t[7])) + corr;
#else
    float total = 0.0f;
    for (int64_t g = 0; g < a.nb; g++) {
        const float s = bf16_to_float(row[g].scale), z = bf16_to_float(row[g].zero);
        int sum = 0;
        for (int i = 0; i < 16; i++) {
            sum += (row[g].codes[i] & 15) * a.q[32 * g + i];
            sum += (row[g].codes[i] >> 4) * a.q[32 * g + 16 + i];
        }
        total += s * a.d[g] * (float)sum;
        corr += (z - 8.0f * s) * a.c[g];
    }
    return total + corr;
#endif
}

/* out[b] = row . X[b] for B tokens (X [B, K], K = 32 nb): each block is unpacked once for all
   B tokens; B is a compile-time constant in each copy (see DOT_TOKENS). */
static inline __attribute__((always_inline)) void dot_tokens_q4_b(
    const Q4Block* row, const float* X, const int64_t B, int64_t K, float* out) {
    v16 acc[MAX_TOKENS];
    for (int64_t b = 0; b < B; b++) acc[b] = zero16();
    for (int64_t g = 0; g < K / 32; g++) {
        v16 lo, hi;
        q4_weights(row + g, &lo, &hi);
        for (int64_t b = 0; b < B; b++) {
            v16 two = madd16(lo, load16(X + b * K + 32 * g), mul16(hi, load16(X + b * K + 32 * g + 16)));
            acc[b] = add16(acc[b], two);
        }
    }
    for (int64_t b = 0; b < B; b++) out[b] = hsum16(acc[b]);
}

static inline void dot_tokens_q4(const Q4Block* row, const float* X, int64_t B, int64_t K,
                                 float* out) {
    switch (B) {
        case 1: dot_tokens_q4_b(row, X, 1, K, out); return;
        case 2: dot_tokens_q4_b(row, X, 2, K, out); return;
        case 3: dot_tokens_q4_b(row, X, 3, K, out); return;
        case 4: dot_tokens_q4_b(row, X, 4, K, out); return;
        case 5: dot_tokens_q4_b(row, X, 5, K, out); return;
        case 6: dot_tokens_q4_b(row, X, 6, K, out); return;
        case 7: dot_tokens_q4_b(row, X, 7, K, out); return;
        default: dot_tokens_q4_b(row, X, MAX_TOKENS, K, out); return;
    }
}

/* Row i of a 4-bit matrix with K inputs (K / 32 blocks per row). */
static inline const Q4Block* q4_row(Mat M, int64_t i, int64_t K) {
    return (const Q4Block*)M.data + i * (K / 32);
}

/* a . b with two vector accumulators; LOAD16 reads 16 of a's values as floats (float32 rows,
   or int8 codes widened in registers: one function each, the same loop). */
#define DOT(NAME, T, LOAD16)                                                  \
    static inline float NAME(const T* a, const float* b, int64_t n) {         \
        v16 s0 = zero16(), s1 = zero16();                                     \
        int64_t k = 0;                                                        \
        for (; k + 32 <= n; k += 32) {                                        \
            s0 = madd16(LOAD16(a + k), load16(b + k), s0);                    \
            s1 = madd16(LOAD16(a + k + 16), load16(b + k + 16), s1);          \
        }                                                                     \
        for (; k + 16 <= n; k += 16) s0 = madd16(LOAD16(a + k), load16(b + k), s0); \
        float s = hsum16(add16(s0, s1));                                      \
        for (; k < n; k++) s += (float)a[k] * b[k];                           \
        return s;                                                             \
    }

#if defined(__AVX512F__) && defined(__FMA__)
/* float32 rows stream through 8-float registers even with AVX-512: four chains of 256-bit
   loads and multiply-adds read a row faster than two chains of 512-bit ones on an AMD EPYC
   with AVX-512 (decode 1.08x, the x86-64-v3 build's speed; alternating, median of 9). The
   widening loads of int8 and 4-bit codes keep the 512-bit registers, which win there. */
static inline float dot(const float* a, const float* b, int64_t n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    int64_t k = 0;
    for (; k + 32 <= n; k += 32) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k + 8), _mm256_loadu_ps(b + k + 8), s1);
        s2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k + 16), _mm256_loadu_ps(b + k + 16), s2);
        s3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k + 24), _mm256_loadu_ps(b + k + 24), s3);
    }
    v8 t = (v8)_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3));
    float s = ((t[0] + t[4]) + (t[2] + t[6])) + ((t[1] + t[5]) + (t[3] + t[7]));
    for (; k < n; k++) s += a[k] * b[k];
    return s;
}
#else
DOT(dot, float, load16)
#endif
DOT(dot_i8, int8_t, load16_i8)

/* y[q] = row_q . x for GATHER rows of length K gathered by index: GATHER independent streams,
   x read once. A gathered row is a short burst (2.3 KB for SmolLM2's 576 floats) that starts
   with a cache miss; with sixteen in flight at once, the misses overlap and a 2-core AMD EPYC
   reads scattered rows at ~35 GB/s, against ~25 GB/s with four (the dense stream's rate is
   ~45). LOADV reads VT_WIDTH weights as floats (float32 rows or int8 codes, one function
   each); the accumulators are vt (simd.h), so that sixteen fit in registers with AVX2 too. */
#define GATHER 16
#define DOT_GATHER(NAME, T, LOADV)                                                           \
    static inline void NAME(const T* const r[GATHER], int64_t K, const float* x, float* y) { \
        vt acc[GATHER];                                                                      \
        for (int q = 0; q < GATHER; q++) acc[q] = vt_zero();                                 \
        int64_t k = 0;                                                                       \
        for (; k + VT_WIDTH <= K; k += VT_WIDTH) {                                           \
            vt xv = vt_load(x + k);                                                          \
            for (int q = 0; q < GATHER; q++) acc[q] = vt_madd(LOADV(r[q] + k), xv, acc[q]);  \
        }                                                                                    \
        for (int q = 0; q < GATHER; q++) {                                                   \
            float s = vt_hsum(acc[q]);                                                       \
            for (int64_t kk = k; kk < K; kk++) s += (float)r[q][kk] * x[kk];                 \
            y[q] = s;                                                                        \
        }                                                                                    \
    }

DOT_GATHER(dot_gather, float, vt_load)
DOT_GATHER(dot_gather_i8, int8_t, vt_load_i8)

/* out[b] = row . X[b] for B <= MAX_TOKENS token vectors X [B, K]: the row is read once and
   multiplied with every token's vector while it is in registers. LOADV reads VT_WIDTH weights
   as floats (float32 or int8 rows: one loop each, so neither pays for the other's branch). The
   body is compiled once per B (the switch passes a constant), so the token loops unroll and
   the B accumulators stay in registers; with B a variable they live in memory and every
   multiply-add also loads and stores one. A pass over 5 tokens is partly arithmetic-bound on
   a 2-core AMD EPYC, and this took it from 44.0 to 38.8 ms (same process, alternating). The
   accumulators are vt (simd.h): with AVX2 only, 16-float ones for 5 tokens and two rows need 20
   of its 16 registers, and 8-float ones took a 5-token pass of SmolLM2 from 27.8 to 24.3 ms
   and an 8-token one from 37.5 to 32.6 (AMD EPYC, AVX2, alternating). Two rows of one matrix
   at a time (each token's input loaded once per pair) measured slower. */
#define DOT_TOKENS(NAME, T, LOADV)                                                           \
    static inline __attribute__((always_inline)) void NAME##_b(                              \
        const T* row, const float* X, const int64_t B, int64_t K, float* out) {              \
        vt acc[MAX_TOKENS];                                                                  \
        for (int64_t b = 0; b < B; b++) acc[b] = vt_zero();                                  \
        int64_t k = 0;                                                                       \
        for (; k + VT_WIDTH <= K; k += VT_WIDTH) {                                           \
            vt w = LOADV(row + k);                                                           \
            for (int64_t b = 0; b < B; b++) acc[b] = vt_madd(w, vt_load(X + b * K + k), acc[b]); \
        }                                                                                    \
        for (int64_t b = 0; b < B; b++) {                                                    \
            float s = vt_hsum(acc[b]);                                                       \
            for (int64_t kk = k; kk < K; kk++) s += (float)row[kk] * X[b * K + kk];          \
            out[b] = s;                                                                      \
        }                                                                                    \
    }                                                                                        \
    static inline void NAME(const T* row, const float* X, int64_t B, int64_t K, float* out) { \
        switch (B) {                                                                         \
            case 1: NAME##_b(row, X, 1, K, out); return;                                     \
            case 2: NAME##_b(row, X, 2, K, out); return;                                     \
            case 3: NAME##_b(row, X, 3, K, out); return;                                     \
            case 4: NAME##_b(row, X, 4, K, out); return;                                     \
            case 5: NAME##_b(row, X, 5, K, out); return;                                     \
            case 6: NAME##_b(row, X, 6, K, out); return;                                     \
            case 7: NAME##_b(row, X, 7, K, out); return;                                     \
            default: NAME##_b(row, X, MAX_TOKENS, K, out); return;                           \
        }                                                                                    \
    }

DOT_TOKENS(dot_tokens_f32, float, vt_load)
DOT_TOKENS(dot_tokens_i8, int8_t, vt_load_i8)

/* The same for two rows that share the token vectors (gate row j and up row j): each 16
   inputs loaded per token feed two multiply-adds. Another 10 % off a 3- to 8-token pass on
   that machine. (For one token there is nothing to share, and two streams per thread were
   slower than one: gemv_rows.) */
#define DOT_TOKENS2(NAME, T, LOADV)                                                          \
    static inline __attribute__((always_inline)) void NAME##_b(                              \
        const T* r0, const T* r1, const float* X, const int64_t B, int64_t K, float* o0,     \
        float* o1) {                                                                         \
        vt a0[MAX_TOKENS], a1[MAX_TOKENS];                                                   \
        for (int64_t b = 0; b < B; b++) a0[b] = a1[b] = vt_zero();                           \
        int64_t k = 0;                                                                       \
        for (; k + VT_WIDTH <= K; k += VT_WIDTH) {                                           \
            vt w0 = LOADV(r0 + k), w1 = LOADV(r1 + k);                                       \
            for (int64_t b = 0; b < B; b++) {                                                \
                vt x = vt_load(X + b * K + k);                                               \
                a0[b] = vt_madd(w0, x, a0[b]);                                               \
                a1[b] = vt_madd(w1, x, a1[b]);                                               \
            }                                                                                \
        }                                                                                    \
        for (int64_t b = 0; b < B; b++) {                                                    \
            float s0 = vt_hsum(a0[b]), s1 = vt_hsum(a1[b]);                                  \
            for (int64_t kk = k; kk < K; kk++) {                                             \
                s0 += (float)r0[kk] * X[b * K + kk];                                         \
                s1 += (float)r1[kk] * X[b * K + kk];                                         \
            }                                                                                \
            o0[b] = s0;                                                                      \
            o1[b] = s1;                                                                      \
        }                                                                                    \
    }                                                                                        \
    static inline void NAME(const T* r0, const T* r1, const float* X, int64_t B, int64_t K,  \
                            float* o0, float* o1) {                                          \
        switch (B) {                                                                         \
            case 1: NAME##_b(r0, r1, X, 1, K, o0, o1); return;                               \
            case 2: NAME##_b(r0, r1, X, 2, K, o0, o1); return;                               \
            case 3: NAME##_b(r0, r1, X, 3, K, o0, o1); return;                               \
            case 4: NAME##_b(r0, r1, X, 4, K, o0, o1); return;                               \
            case 5: NAME##_b(r0, r1, X, 5, K, o0, o1); return;                               \
            case 6: NAME##_b(r0, r1, X, 6, K, o0, o1); return;                               \
            case 7: NAME##_b(r0, r1, X, 7, K, o0, o1); return;                               \
            default: NAME##_b(r0, r1, X, MAX_TOKENS, K, o0, o1); return;                     \
        }                                                                                    \
    }

DOT_TOKENS2(dot_tokens2_f32, float, vt_load)
DOT_TOKENS2(dot_tokens2_i8, int8_t, vt_load_i8)

/* out[r * B + b] = rows[r] . X[b] for R rows and B <= MAX_TOKENS tokens: a register tile of
   R x B accumulators, so that each 16 inputs of a token, loaded once, feed R multiply-adds and
   each 16 weights, widened once, feed B. A pass over B tokens does B times the arithmetic of a
   single-token step on the same bytes; at 5 tokens on a 2-core AMD EPYC that arithmetic takes
   about as long as the read, and the two only overlap when the memory is kept busy during the
   multiply-adds: every row read is also prefetched PREFETCH_AHEAD bytes further on (rows of a
   matrix are consecutive, so that is a later tile's rows), one cache line per line read, into
   the second-level cache (prefetch locality 2). Over SmolLM2's LM head [49152, 576] with 5
   tokens this took the pass from 1.4-1.9 to 0.95-1.08 single-token reads of the matrix, with
   8 tokens from 1.7-2.0 to 1.1 (2 threads, medians of 15, alternating). Prefetching into the
   first-level cache (locality 3) or non-temporally (0) kept 1.4-1.5: the lines evict the
   token vectors or arrive too late. R and B are compile-time constants in every copy
   (tile_rows below picks R for B), so the tile stays in registers: R B + R + 1 vectors, at
   most 29 of AVX-512's 32 and 15 of AVX2's 16. */
#define PREFETCH_AHEAD 16384
/* FN(rows, R, X, b, K, out) for the token count b = B, one compiled copy per b (R fixed). */
#define TILE_BY_TOKENS(FN, R)                                                                  \
    switch (B) {                                                                               \
        case 1: FN(rows, R, X, 1, K, out); return;                                             \
        case 2: FN(rows, R, X, 2, K, out); return;                                             \
        case 3: FN(rows, R, X, 3, K, out); return;                                             \
        case 4: FN(rows, R, X, 4, K, out); return;                                             \
        case 5: FN(rows, R, X, 5, K, out); return;                                             \
        case 6: FN(rows, R, X, 6, K, out); return;                                             \
        case 7: FN(rows, R, X, 7, K, out); return;                                             \
        default: FN(rows, R, X, MAX_TOKENS, K, out); return;                                   \
    }

#define DOT_TILE(NAME, T, LOADV)                                                               \
    static inline __attribute__((always_inline)) void NAME##_rb(                               \
        const T* const* rows, const int R, const float* X, const int64_t B, int64_t K,         \
        float* out) {                                                                          \
        vt acc[4][MAX_TOKENS];                                                                 \
        for (int r = 0; r < R; r++)                                                            \
            for (int64_t b = 0; b < B; b++) acc[r][b] = vt_zero();                             \
        const int64_t line = 64 / (int64_t)sizeof(T), ahead = PREFETCH_AHEAD / (int64_t)sizeof(T); \
        int64_t k = 0;                                                                         \
        for (; k + VT_WIDTH <= K; k += VT_WIDTH) {                                             \
            vt w[4];                                                                           \
            for (int r = 0; r < R; r++) w[r] = LOADV(rows[r] + k);                             \
            if (k % line == 0)                                                                 \
                for (int r = 0; r < R; r++) __builtin_prefetch(rows[r] + k + ahead, 0, 2);     \
            for (int64_t b = 0; b < B; b++) {                                                  \
                vt x = vt_load(X + b * K + k);                                                 \
                for (int r = 0; r < R; r++) acc[r][b] = vt_madd(w[r], x, acc[r][b]);           \
            }                                                                                  \
        }                                                                                      \
        for (int r = 0; r < R; r++)                                                            \
            for (int64_t b = 0; b < B; b++) {                                                  \
                float s = vt_hsum(acc[r][b]);                                                  \
                for (int64_t kk = k; kk < K; kk++) s += (float)rows[r][kk] * X[b * K + kk];    \
                out[r * B + b] = s;                                                            \
            }                                                                                  \
    }                                                                                          \
    static inline void NAME(const T* const* rows, int R, const float* X, int64_t B, int64_t K, \
                            float* out) {                                                      \
        if (R == 4) TILE_BY_TOKENS(NAME##_rb, 4)                                               \
        if (R == 2) TILE_BY_TOKENS(NAME##_rb, 2)                                               \
        TILE_BY_TOKENS(NAME##_rb, 1)                                                           \
    }

DOT_TILE(dot_tile_f32, float, vt_load)
DOT_TILE(dot_tile_i8, int8_t, vt_load_i8)

/* Rows per tile for B tokens: the most whose R x B accumulators fit in registers (above). */
static inline int tile_rows(int64_t B) {
#if VT_WIDTH == 16
    return B <= 6 ? 4 : 2;
#else
    return B <= 2 ? 4 : (B <= 6 ? 2 : 1);
#endif
}

/* Y[b * N + i] for rows i0 .. i0 + R - 1 of a float32 or int8 matrix M [N, K] (rows given by
   index): the tile above, times the int8 row
   scales. out is [R, B]. */
static inline void mdot_tile(Mat M, const int64_t* idx, int R, const float* X, int64_t B,
                             int64_t K, float* out) {
    if (!M.scale) {
        const float* r[4];
        for (int q = 0; q < R; q++) r[q] = (const float*)M.data + idx[q] * K;
        dot_tile_f32(r, R, X, B, K, out);
        return;
    }
    const int8_t* r[4];
    for (int q = 0; q < R; q++) r[q] = (const int8_t*)M.data + idx[q] * K;
    dot_tile_i8(r, R, X, B, K, out);
    for (int q = 0; q < R; q++)
        for (int64_t b = 0; b < B; b++) out[q * B + b] *= M.scale[idx[q]];
}

/* 2:4 sparse rows (Mat.nm_pos set; chapter 12's NMLinear): per 4 inputs, 2 kept values and
   their 2-bit positions in the group, 4 positions to a byte. A row of K inputs is K / 2 values
   and ceil(K / 8) bytes of positions. The kernels expand the values of 4 groups into the 16
   dense lanes of those inputs, zeros elsewhere, and multiply-add them with x as the float32
   and int8 rows do: the arithmetic is the dense one, the bytes read are about half. With
   AVX-512 one lane permutation (vpermps) takes each lane's value from the kept values, masked
   by a compare of the lane's index in its group with the unpacked positions; AVX2 does the
   same on 8 lanes (vpermps, blend); the generic build stores the 8 values into a zeroed
   16-float block. */

/* The input index of kept value j of a 2:4 row: 4 (j / 2) + its position. */
static inline int64_t nm_col(const uint8_t* pos, int64_t j) {
    return 4 * (j / 2) + ((pos[j / 4] >> (2 * (j % 4))) & 3);
}

static inline int64_t nm_pos_bytes(int64_t K) { return (K / 2 + 3) / 4; }

#if defined(__AVX512F__)
/* 16 dense weights from the 8 kept values in lanes 0..7 of v and their 16 position bits. */
static inline v16 nm_expand16(__m512 v, uint32_t bits) {
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i three = _mm512_set1_epi32(3);
    const __m512i first = _mm512_slli_epi32(_mm512_srli_epi32(lane, 2), 1);  /* 2 (lane / 4) */
    const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(1));
    const __m512i at = _mm512_and_si512(lane, three);                       /* lane % 4 */
    const __m512i b = _mm512_set1_epi32((int)bits);
    const __m512i p0 = _mm512_and_si512(_mm512_srlv_epi32(b, _mm512_slli_epi32(first, 1)), three);
    const __m512i p1 = _mm512_and_si512(_mm512_srlv_epi32(b, _mm512_slli_epi32(second, 1)), three);
    const __mmask16 k0 = _mm512_cmpeq_epi32_mask(p0, at), k1 = _mm512_cmpeq_epi32_mask(p1, at);
    return _mm512_maskz_permutexvar_ps(k0 | k1, _mm512_mask_blend_epi32(k0, second, first), v);
}
static inline uint32_t nm_bits16(const uint8_t* p) { return (uint32_t)p[0] | (uint32_t)p[1] << 8; }
static inline v16 nm16_f32(const float* v, const uint8_t* p) {
    return nm_expand16(_mm512_castps256_ps512(_mm256_loadu_ps(v)), nm_bits16(p));
}
static inline v16 nm16_i8(const int8_t* v, const uint8_t* p) {
    __m128i q = _mm_loadl_epi64((const __m128i*)v);
    return nm_expand16(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), nm_bits16(p));
}
#elif defined(__AVX2__)
/* 8 dense weights from the 4 kept values in lanes 0..3 of v and their 8 position bits. */
static inline __m256 nm_expand8(__m256 v, uint32_t bits) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i three = _mm256_set1_epi32(3);
    const __m256i first = _mm256_slli_epi32(_mm256_srli_epi32(lane, 2), 1);
    const __m256i second = _mm256_add_epi32(first, _mm256_set1_epi32(1));
    const __m256i at = _mm256_and_si256(lane, three);
    const __m256i b = _mm256_set1_epi32((int)bits);
    const __m256i p0 = _mm256_and_si256(_mm256_srlv_epi32(b, _mm256_slli_epi32(first, 1)), three);
    const __m256i p1 = _mm256_and_si256(_mm256_srlv_epi32(b, _mm256_slli_epi32(second, 1)), three);
    const __m256i k0 = _mm256_cmpeq_epi32(p0, at), k1 = _mm256_cmpeq_epi32(p1, at);
    const __m256 w = _mm256_permutevar8x32_ps(v, _mm256_blendv_epi8(second, first, k0));
    return _mm256_and_ps(w, _mm256_castsi256_ps(_mm256_or_si256(k0, k1)));
}
/* 16 dense weights from 8 kept values v (two halves of 4) and 2 position bytes. */
static inline v16 nm_halves(__m256 v, const uint8_t* p) {
    return (v16){nm_expand8(v, p[0]), nm_expand8(_mm256_permute2f128_ps(v, v, 1), p[1])};
}
static inline v16 nm16_f32(const float* v, const uint8_t* p) { return nm_halves(_mm256_loadu_ps(v), p); }
static inline v16 nm16_i8(const int8_t* v, const uint8_t* p) { return nm_halves(vt_load_i8(v), p); }
/* 8 dense weights (vt) from 4 kept values and 1 position byte. */
static inline vt nmvt_f32(const float* v, const uint8_t* p) {
    return nm_expand8(_mm256_castps128_ps256(_mm_loadu_ps(v)), p[0]);
}
static inline vt nmvt_i8(const int8_t* v, const uint8_t* p) {
    int32_t four;
    __builtin_memcpy(&four, v, 4);
    __m128 f = _mm_cvtepi32_ps(_mm_cvtepi8_epi32(_mm_cvtsi32_si128(four)));
    return nm_expand8(_mm256_castps128_ps256(f), p[0]);
}
#else
#define NM16(NAME, T)                                                                   \
    static inline v16 NAME(const T* v, const uint8_t* p) {                              \
        float w[16] = {0};                                                              \
        for (int j = 0; j < 8; j++) w[4 * (j / 2) + ((p[j / 4] >> (2 * (j % 4))) & 3)] = (float)v[j]; \
        return load16(w);                                                               \
    }
NM16(nm16_f32, float)
NM16(nm16_i8, int8_t)
#endif
#if VT_WIDTH == 16
#define nmvt_f32 nm16_f32
#define nmvt_i8 nm16_i8
#endif

/* row . x for one 2:4 row (values v, positions p, K inputs); NM16 expands 16 inputs. */
#define DOT_NM(NAME, T, NM16)                                                          \
    static inline float NAME(const T* v, const uint8_t* p, const float* x, int64_t K) {  \
        v16 s0 = zero16(), s1 = zero16();                                              \
        int64_t k = 0;                                                                 \
        for (; k + 32 <= K; k += 32) {                                                 \
            s0 = madd16(NM16(v + k / 2, p + k / 8), load16(x + k), s0);                \
            s1 = madd16(NM16(v + k / 2 + 8, p + k / 8 + 2), load16(x + k + 16), s1);   \
        }                                                                              \
        for (; k + 16 <= K; k += 16) s0 = madd16(NM16(v + k / 2, p + k / 8), load16(x + k), s0); \
        float s = hsum16(add16(s0, s1));                                               \
        for (int64_t j = k / 2; j < K / 2; j++) s += (float)v[j] * x[nm_col(p, j)];    \
        return s;                                                                      \
    }

DOT_NM(dot_nm_f32, float, nm16_f32)
DOT_NM(dot_nm_i8, int8_t, nm16_i8)

/* out[b] = row . X[b] for B <= MAX_TOKENS tokens and one 2:4 row: each group of inputs is
   expanded once for all B tokens (as DOT_TOKENS, one copy per constant B). */
#define DOT_TOKENS_NM(NAME, T, NMVT)                                                         \
    static inline __attribute__((always_inline)) void NAME##_b(                              \
        const T* v, const uint8_t* p, const float* X, const int64_t B, int64_t K, float* out) { \
        vt acc[MAX_TOKENS];                                                                  \
        for (int64_t b = 0; b < B; b++) acc[b] = vt_zero();                                  \
        int64_t k = 0;                                                                       \
        for (; k + VT_WIDTH <= K; k += VT_WIDTH) {                                           \
            vt w = NMVT(v + k / 2, p + k / 8);                                               \
            for (int64_t b = 0; b < B; b++) acc[b] = vt_madd(w, vt_load(X + b * K + k), acc[b]); \
        }                                                                                    \
        for (int64_t b = 0; b < B; b++) {                                                    \
            float s = vt_hsum(acc[b]);                                                       \
            for (int64_t j = k / 2; j < K / 2; j++) s += (float)v[j] * X[b * K + nm_col(p, j)]; \
            out[b] = s;                                                                      \
        }                                                                                    \
    }                                                                                        \
    static inline void NAME(const T* v, const uint8_t* p, const float* X, int64_t B, int64_t K, \
                            float* out) {                                                    \
        switch (B) {                                                                         \
            case 1: NAME##_b(v, p, X, 1, K, out); return;                                    \
            case 2: NAME##_b(v, p, X, 2, K, out); return;                                    \
            case 3: NAME##_b(v, p, X, 3, K, out); return;                                    \
            case 4: NAME##_b(v, p, X, 4, K, out); return;                                    \
            case 5: NAME##_b(v, p, X, 5, K, out); return;                                    \
            case 6: NAME##_b(v, p, X, 6, K, out); return;                                    \
            case 7: NAME##_b(v, p, X, 7, K, out); return;                                    \
            default: NAME##_b(v, p, X, MAX_TOKENS, K, out); return;                          \
        }                                                                                    \
    }

DOT_TOKENS_NM(dot_tokens_nm_f32, float, nmvt_f32)
DOT_TOKENS_NM(dot_tokens_nm_i8, int8_t, nmvt_i8)

/* M[i] . X[b] for a 2:4 matrix with K inputs (int8 values: times the row's scale). */
static inline void nm_dot_tokens(Mat M, int64_t i, const float* X, int64_t B, int64_t K,
                                 float* out) {
    const uint8_t* p = M.nm_pos + i * nm_pos_bytes(K);
    if (!M.scale) {
        dot_tokens_nm_f32((const float*)M.data + i * (K / 2), p, X, B, K, out);
        return;
    }
    dot_tokens_nm_i8((const int8_t*)M.data + i * (K / 2), p, X, B, K, out);
    for (int64_t b = 0; b < B; b++) out[b] *= M.scale[i];
}

static inline float nm_dot(Mat M, int64_t i, const float* x, int64_t K) {
    const uint8_t* p = M.nm_pos + i * nm_pos_bytes(K);
    if (!M.scale) return dot_nm_f32((const float*)M.data + i * (K / 2), p, x, K);
    return M.scale[i] * dot_nm_i8((const int8_t*)M.data + i * (K / 2), p, x, K);
}

static inline void mdot_tokens(Mat M, int64_t i, const float* X, int64_t B, int64_t K,
                               float* out) {
    if (M.nm_pos) {
        nm_dot_tokens(M, i, X, B, K, out);
        return;
    }
    if (M.q4) {
        dot_tokens_q4(q4_row(M, i, K), X, B, K, out);
        return;
    }
    if (!M.scale) {
        dot_tokens_f32((const float*)M.data + i * K, X, B, K, out);
        return;
    }
    dot_tokens_i8((const int8_t*)M.data + i * K, X, B, K, out);
    for (int64_t b = 0; b < B; b++) out[b] *= M.scale[i];
}

/* Neurons j .. j + P - 1 (P = 1 or 2) of two matrices of the same kind read as one tile (gate
   and up: 2 P rows), out0[p * B + b] = A[j + p] . X[b], out1 likewise for C. Falls back to
   row pairs (mdot_tokens2) for 4-bit, 2:4 or mixed matrices. */
static inline void mdot_tile2(Mat A, Mat C, int64_t j, int64_t P, const float* X, int64_t B,
                              int64_t K, float* out0, float* out1);

/* out0[b] = A[i] . X[b] and out1[b] = C[i] . X[b] for B tokens: row i of two matrices of the
   same kind (gate and up) read together. */
static inline void mdot_tokens2(Mat A, Mat C, int64_t i, const float* X, int64_t B, int64_t K,
                                float* out0, float* out1) {
    if (A.q4 || C.q4 || A.nm_pos || C.nm_pos || !A.scale != !C.scale) {
        mdot_tokens(A, i, X, B, K, out0);
        mdot_tokens(C, i, X, B, K, out1);
    } else if (!A.scale) {
        dot_tokens2_f32((const float*)A.data + i * K, (const float*)C.data + i * K, X, B, K,
                        out0, out1);
    } else {
        dot_tokens2_i8((const int8_t*)A.data + i * K, (const int8_t*)C.data + i * K, X, B, K,
                       out0, out1);
        for (int64_t b = 0; b < B; b++) {
            out0[b] *= A.scale[i];
            out1[b] *= C.scale[i];
        }
    }
}

static inline void mdot_tile2(Mat A, Mat C, int64_t j, int64_t P, const float* X, int64_t B,
                              int64_t K, float* out0, float* out1) {
    if (A.q4 || C.q4 || A.nm_pos || C.nm_pos || !A.scale != !C.scale) {
        for (int64_t p = 0; p < P; p++)
            mdot_tokens2(A, C, j + p, X, B, K, out0 + p * B, out1 + p * B);
        return;
    }
    float out[4 * MAX_TOKENS];
    const int R = (int)(2 * P);
    if (!A.scale) {
        const float* a = (const float*)A.data + j * K;
        const float* c = (const float*)C.data + j * K;
        const float* r[4] = {a, c, a + K, c + K};
        dot_tile_f32(r, R, X, B, K, out);
    } else {
        const int8_t* a = (const int8_t*)A.data + j * K;
        const int8_t* c = (const int8_t*)C.data + j * K;
        const int8_t* r[4] = {a, c, a + K, c + K};
        dot_tile_i8(r, R, X, B, K, out);
    }
    for (int64_t p = 0; p < P; p++)
        for (int64_t b = 0; b < B; b++) {
            out0[p * B + b] = out[2 * p * B + b] * (A.scale ? A.scale[j + p] : 1.0f);
            out1[p * B + b] = out[(2 * p + 1) * B + b] * (C.scale ? C.scale[j + p] : 1.0f);
        }
}

/* M[i] . x for one token. */
static inline float mdot(Mat M, int64_t i, const float* x, int64_t K) {
    if (M.nm_pos) return nm_dot(M, i, x, K);
    if (M.q4) return dot_q4(q4_row(M, i, K), x, K / 32);
    if (!M.scale) return dot((const float*)M.data + i * K, x, K);
    return M.scale[i] * dot_i8((const int8_t*)M.data + i * K, x, K);
}

/* y[q] = M_q[rows[q]] . x for GATHER rows, each from one of two matrices of the same kind
   (float32, or int8 scaled after the sum): the gate and up rows of the sparse MLP's active
   neurons, never 4-bit nor 2:4. */
static inline void mdot_gather(const Mat* const M[GATHER], const int64_t rows[GATHER], int64_t K,
                               const float* x, float* y) {
    if (!M[0]->scale) {
        const float* r[GATHER];
        for (int q = 0; q < GATHER; q++) r[q] = (const float*)M[q]->data + rows[q] * K;
        dot_gather(r, K, x, y);
        return;
    }
    const int8_t* r[GATHER];
    for (int q = 0; q < GATHER; q++) r[q] = (const int8_t*)M[q]->data + rows[q] * K;
    dot_gather_i8(r, K, x, y);
    for (int q = 0; q < GATHER; q++) y[q] *= M[q]->scale[rows[q]];
}
