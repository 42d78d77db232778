/* float32 and int8 rows (Mat.format FMT_F32 and FMT_I8; chapter 09's Int8Linear), part of
   matvec.h: one row times one token, sixteen gathered rows times one token (the sparse MLP),
   one row times up to MAX_TOKENS tokens, and register tiles of rows times tokens (a
   verification pass). Each kernel is written once as a macro over the row's element type; the
   LOAD functions of simd.h widen int8 codes to floats in registers. */

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
