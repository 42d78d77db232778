/* Vector helpers shared by the package's C files (runtime/step.c, cpu_int8.c, the loops of
   cpu.c). The source loaders paste this file in place of a C file's include line for
   it, so each library is still compiled from one self-contained text.

   v16 is 16 floats, the unit every loop steps by. With AVX-512 (and on targets without AVX2)
   it is one GCC vector of 64 bytes. With AVX2 only, GCC keeps such a vector in memory when it
   is carried around a loop (every multiply-add stores and reloads it: a decode step twice as
   slow), so there v16 is two 8-float registers. Code does its arithmetic on v16 through the
   functions below (zero16, splat16, add16, mul16, madd16, smadd16, hsum16), never with operators, so that one
   text serves both; the same holds for vt below. */
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef float v4 __attribute__((vector_size(16), aligned(4)));

#if defined(__AVX2__) && !defined(__AVX512F__)
#define V16_HALVES 1
typedef struct {
    __m256 lo, hi;
} v16;
static inline v16 load16(const float* p) { return (v16){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline void store16(float* p, v16 v) {
    _mm256_storeu_ps(p, v.lo);
    _mm256_storeu_ps(p + 8, v.hi);
}
static inline v16 zero16(void) { return (v16){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline v16 splat16(float s) { return (v16){_mm256_set1_ps(s), _mm256_set1_ps(s)}; }
static inline v16 add16(v16 a, v16 b) { return (v16){a.lo + b.lo, a.hi + b.hi}; }
static inline v16 mul16(v16 a, v16 b) { return (v16){a.lo * b.lo, a.hi * b.hi}; }
/* a * b + c */
static inline v16 madd16(v16 a, v16 b, v16 c) { return (v16){a.lo * b.lo + c.lo, a.hi * b.hi + c.hi}; }
/* s * a + c for a scalar s */
static inline v16 smadd16(float s, v16 a, v16 c) {
    __m256 v = _mm256_set1_ps(s);
    return (v16){v * a.lo + c.lo, v * a.hi + c.hi};
}
static inline v8 halves_sum(v16 v) { return (v8)(v.lo + v.hi); }
#elif defined(__AVX512F__)
/* 64-byte registers by name: GCC's generic 64-byte vectors are kept in memory when a target's
   tuning prefers 256-bit vectors (-march=rocketlake, icelake, ...: a decode step 3.5x slower). */
typedef __m512 v16;
static inline v16 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline void store16(float* p, v16 v) { _mm512_storeu_ps(p, v); }
static inline v16 zero16(void) { return _mm512_setzero_ps(); }
static inline v16 splat16(float s) { return _mm512_set1_ps(s); }
static inline v16 add16(v16 a, v16 b) { return _mm512_add_ps(a, b); }
static inline v16 mul16(v16 a, v16 b) { return _mm512_mul_ps(a, b); }
static inline v16 madd16(v16 a, v16 b, v16 c) { return _mm512_fmadd_ps(a, b, c); }
static inline v16 smadd16(float s, v16 a, v16 c) { return _mm512_fmadd_ps(_mm512_set1_ps(s), a, c); }
static inline v8 halves_sum(v16 v) {
    return (v8)_mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
#else
typedef float v16 __attribute__((vector_size(64), aligned(4)));
static inline v16 load16(const float* p) { v16 v; __builtin_memcpy(&v, p, 64); return v; }
static inline void store16(float* p, v16 v) { __builtin_memcpy(p, &v, 64); }
static inline v16 zero16(void) { return (v16){0}; }
static inline v16 splat16(float s) { return (v16){0} + s; }
static inline v16 add16(v16 a, v16 b) { return a + b; }
static inline v16 mul16(v16 a, v16 b) { return a * b; }
static inline v16 madd16(v16 a, v16 b, v16 c) { return a * b + c; }
static inline v16 smadd16(float s, v16 a, v16 c) { return s * a + c; }
static inline v8 halves_sum(v16 v) {
    v8 lo, hi;
    __builtin_memcpy(&lo, &v, 32);
    __builtin_memcpy(&hi, (const char*)&v + 32, 32);
    return lo + hi;
}
#endif

/* vt: the vector of the loops that carry one accumulator per token or per gathered row (up to
   sixteen of them, see matvec.h). With AVX-512 it is v16: 32 registers hold sixteen. With AVX2
   only, sixteen accumulators of two registers each would not fit in its 16 registers and would
   live in memory, so there vt is 8 floats, one register. */
#ifdef V16_HALVES
#define VT_WIDTH 8
typedef __m256 vt;
static inline vt vt_load(const float* p) { return _mm256_loadu_ps(p); }
static inline vt vt_load_i8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
static inline vt vt_zero(void) { return _mm256_setzero_ps(); }
static inline vt vt_madd(vt a, vt b, vt c) { return a * b + c; }
static inline float vt_hsum(vt v) {
    v4 a, b;
    __builtin_memcpy(&a, &v, 16);
    __builtin_memcpy(&b, (const char*)&v + 16, 16);
    v4 s4 = a + b;
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}
#else
#define VT_WIDTH 16
typedef v16 vt;
#define vt_load load16
#define vt_load_i8 load16_i8
#define vt_zero zero16
#define vt_madd madd16
#define vt_hsum hsum16
#endif

/* The sum of the 16 lanes as a tree (halves added to halves): four vector adds instead of
   fifteen scalar ones, which matters when every row ends in one (B tokens: B per row). */
static inline float hsum16(v16 v) {
    v8 s8 = halves_sum(v);
    v4 a, b;
    __builtin_memcpy(&a, &s8, 16);
    __builtin_memcpy(&b, (const char*)&s8 + 16, 16);
    v4 s4 = a + b;
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

/* 16 int8 codes as 16 floats. A generic conversion compiles to 16 scalar ones, so x86 gets the
   sign-extend + convert instructions by name (two of each with AVX2 only). */
static inline v16 load16_i8(const int8_t* p) {
#if defined(__AVX512F__)
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
#elif defined(__AVX2__)
    return (v16){_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p))),
                 _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8))))};
#else
    v16 r;
    for (int q = 0; q < 16; q++) r[q] = (float)p[q];
    return r;
#endif
}

/* 16 bytes of 4-bit codes as 32 floats: lo[q] = low half of byte q, hi[q] = its high half
   (the byte order of a Q4Block in matvec.h). */
static inline void load32_u4(const uint8_t* p, v16* lo, v16* hi) {
#if defined(__AVX512F__)
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
    *lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
    *hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
#elif defined(__AVX2__)
    const __m256i mask = _mm256_set1_epi32(15);
    __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
    __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8)));
    *lo = (v16){_mm256_cvtepi32_ps(_mm256_and_si256(b0, mask)),
                _mm256_cvtepi32_ps(_mm256_and_si256(b1, mask))};
    *hi = (v16){_mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4)),
                _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4))};
#else
    for (int q = 0; q < 16; q++) {
        (*lo)[q] = (float)(p[q] & 15);
        (*hi)[q] = (float)(p[q] >> 4);
    }
#endif
}
