/* Matrix rows times vectors, for the decode step (runtime/step.c pastes this file in): the
   dot products of one weight row with one token's vector, with sixteen gathered rows, and with
   up to MAX_TOKENS token vectors at once, for each way a row can be stored. A weight is read
   once and turned into floats in registers; the arithmetic is float32 throughout. */

/* A weight matrix [rows, cols] as C reads it (Mat, abi.h), row-major, its format a code
   (Mat.format) that the functions below dispatch on with one switch; each format's kernels
   have their own header:
   - FMT_F32: float32 (scale NULL);
   - FMT_I8: weight-only int8 codes with one float32 scale per row, w_ij = scale_i * q_ij
     (chapter 09's Int8Linear): a quarter of the bytes (matvec_dense.h, beside float32);
   - FMT_Q4: 4-bit codes in blocks of 32 weights (Q4Block, chapter 09's Int4Linear), each with
     its own scale and zero point: an eighth of the bytes, plus a fifth of that for the block
     parameters; FMT_Q4_A8: the same blocks times activations rounded to int8 (matvec_q4.h);
   - FMT_NM_F32 / FMT_NM_I8: 2:4 sparse, the 2 kept values of every 4 inputs (float32, or int8
     codes with a row scale) and their 2-bit positions: about half the bytes (matvec_nm.h).
   With in_stride > 0, data is instead a transpose (FMT_F32 only), one row per *input*, rows
   in_stride floats apart: an input that is zero (a TEAL threshold cut it) costs no bytes, since
   its row is never read. Projections that share an input (q, k, v; gate, up) share one bundled
   row per input, [W_q^T | W_k^T | W_v^T]: one long burst instead of three short ones. */

#include "matvec_q4.h"
#include "matvec_dense.h"
#include "matvec_nm.h"

/* Whether rows of this format go through the register tiles (dot_tile_*) and row pairs. */
static inline int tiled_format(int64_t format) { return format == FMT_F32 || format == FMT_I8; }

/* Y[b * N + i] for rows i0 .. i0 + R - 1 of a float32 or int8 matrix M [N, K] (rows given by
   index): the tile of matvec_dense.h, times the int8 row scales. out is [R, B]. */
static inline void mdot_tile(Mat M, const int64_t* idx, int R, const float* X, int64_t B,
                             int64_t K, float* out) {
    if (M.format == FMT_F32) {
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

/* out[b] = M[i] . X[b] for B tokens, whatever the format. */
static inline void mdot_tokens(Mat M, int64_t i, const float* X, int64_t B, int64_t K,
                               float* out) {
    switch (M.format) {
        case FMT_NM_F32:
        case FMT_NM_I8: nm_dot_tokens(M, i, X, B, K, out); return;
        case FMT_Q4:
        case FMT_Q4_A8: dot_tokens_q4(q4_row(M, i, K), X, B, K, out); return;
        case FMT_I8:
            dot_tokens_i8((const int8_t*)M.data + i * K, X, B, K, out);
            for (int64_t b = 0; b < B; b++) out[b] *= M.scale[i];
            return;
        default: dot_tokens_f32((const float*)M.data + i * K, X, B, K, out); return;
    }
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
    if (A.format != C.format || !tiled_format(A.format)) {
        mdot_tokens(A, i, X, B, K, out0);
        mdot_tokens(C, i, X, B, K, out1);
    } else if (A.format == FMT_F32) {
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
    if (A.format != C.format || !tiled_format(A.format)) {
        for (int64_t p = 0; p < P; p++)
            mdot_tokens2(A, C, j + p, X, B, K, out0 + p * B, out1 + p * B);
        return;
    }
    float out[4 * MAX_TOKENS];
    const int R = (int)(2 * P);
    if (A.format == FMT_F32) {
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
    const int scaled = A.format == FMT_I8;
    for (int64_t p = 0; p < P; p++)
        for (int64_t b = 0; b < B; b++) {
            out0[p * B + b] = out[2 * p * B + b] * (scaled ? A.scale[j + p] : 1.0f);
            out1[p * B + b] = out[(2 * p + 1) * B + b] * (scaled ? C.scale[j + p] : 1.0f);
        }
}

/* M[i] . x for one token, whatever the format. */
static inline float mdot(Mat M, int64_t i, const float* x, int64_t K) {
    switch (M.format) {
        case FMT_NM_F32:
        case FMT_NM_I8: return nm_dot(M, i, x, K);
        case FMT_Q4:
        case FMT_Q4_A8: return dot_q4(q4_row(M, i, K), x, K / 32);
        case FMT_I8: return M.scale[i] * dot_i8((const int8_t*)M.data + i * K, x, K);
        default: return dot((const float*)M.data + i * K, x, K);
    }
}

/* y[q] = M_q[rows[q]] . x for GATHER rows, each from one of two matrices of the same kind
   (FMT_F32, or FMT_I8 scaled after the sum): the gate and up rows of the sparse MLP's active
   neurons, never 4-bit nor 2:4. */
static inline void mdot_gather(const Mat* const M[GATHER], const int64_t rows[GATHER], int64_t K,
                               const float* x, float* y) {
    if (M[0]->format == FMT_F32) {
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
