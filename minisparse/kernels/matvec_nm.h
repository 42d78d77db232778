/* 2:4 sparse rows (Mat.format FMT_NM_F32 and FMT_NM_I8, nm_pos set; chapter 12's NMLinear),
   part of matvec.h: per 4 inputs, 2 kept values and
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
    if (M.format == FMT_NM_F32) {
        dot_tokens_nm_f32((const float*)M.data + i * (K / 2), p, X, B, K, out);
        return;
    }
    dot_tokens_nm_i8((const int8_t*)M.data + i * (K / 2), p, X, B, K, out);
    for (int64_t b = 0; b < B; b++) out[b] *= M.scale[i];
}

static inline float nm_dot(Mat M, int64_t i, const float* x, int64_t K) {
    const uint8_t* p = M.nm_pos + i * nm_pos_bytes(K);
    if (M.format == FMT_NM_F32) return dot_nm_f32((const float*)M.data + i * (K / 2), p, x, K);
    return M.scale[i] * dot_nm_i8((const int8_t*)M.data + i * (K / 2), p, x, K);
}
