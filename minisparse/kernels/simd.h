/* Vector helpers shared by the package's C files (decode_step.c, sparse_int8.c). The source
   loader (cpu_build.load_source_library) pastes this file in place of a C file's include
   line for it, so each library is still compiled from one self-contained text. */
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

/* 16 floats in one vector register (AVX-512), or split over smaller ones elsewhere. */
typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef float v4 __attribute__((vector_size(16), aligned(4)));
static inline v16 load16(const float* p) { v16 v; __builtin_memcpy(&v, p, 64); return v; }

/* 16 int8 codes as 16 floats. A generic conversion compiles to 16 scalar ones, so x86 gets the
   sign-extend + convert instructions by name (two of each with AVX2 only). */
static inline v16 load16_i8(const int8_t* p) {
    v16 r;
#if defined(__AVX512F__)
    __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
    __builtin_memcpy(&r, &f, 64);
#elif defined(__AVX2__)
    __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
    __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8))));
    __builtin_memcpy(&r, &lo, 32);
    __builtin_memcpy((char*)&r + 32, &hi, 32);
#else
    for (int q = 0; q < 16; q++) r[q] = (float)p[q];
#endif
    return r;
}

/* 16 bytes of 4-bit codes as 32 floats: lo[q] = low half of byte q, hi[q] = its high half
   (the byte order of a Q4Block in matvec.h). */
static inline void load32_u4(const uint8_t* p, v16* lo, v16* hi) {
#if defined(__AVX512F__)
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
    __m512 l = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
    __m512 h = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
    __builtin_memcpy(lo, &l, 64);
    __builtin_memcpy(hi, &h, 64);
#elif defined(__AVX2__)
    const __m256i mask = _mm256_set1_epi32(15);
    for (int half = 0; half < 2; half++) {
        __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8 * half)));
        __m256 l = _mm256_cvtepi32_ps(_mm256_and_si256(b, mask));
        __m256 h = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
        __builtin_memcpy((char*)lo + 32 * half, &l, 32);
        __builtin_memcpy((char*)hi + 32 * half, &h, 32);
    }
#else
    for (int q = 0; q < 16; q++) {
        (*lo)[q] = (float)(p[q] & 15);
        (*hi)[q] = (float)(p[q] >> 4);
    }
#endif
}
