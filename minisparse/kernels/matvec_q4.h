/* 4-bit rows (Mat.format FMT_Q4 and FMT_Q4_A8; chapter 09's Int4Linear), part of matvec.h:
   the block layout, the dot products of a row with float32 activations (one token, or up to
   MAX_TOKENS at once), and with activations rounded to int8 per block (integer arithmetic). */

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

/* 4-bit rows times int8 activations (Mat.format == FMT_Q4_A8), the dot product llama.cpp's
   Q4 x Q8 kernels compute. Each block of 32 inputs x is rounded to q = round(x / d) with
   d = max|x| / 127 (int8, ``quantize_q8``), and with ŵ = (u - 8) s + z the block's share is

       Σ ŵ_i d q_i = s d Σ u_i q_i + (z - 8 s) d Σ q_i,

   so the inner sum Σ u_i q_i is integer arithmetic on bytes: one AVX-512 VNNI vpdpbusd (four
   unsigned-by-signed byte products summed into each 32-bit lane) per block, or AVX2's
   vpmaddubsw + vpmaddwd, and one float multiply-add per block instead of 32. The float path
   (FMT_Q4) widens every weight to a float and spends two multiply-adds on it: at 5 bytes
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
