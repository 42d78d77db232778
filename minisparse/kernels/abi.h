/* The interface the C files share with Python: constants and the structs a decode step reads.

   minisparse/kernels/abi.py declares the same names once for ctypes, and a test compares the
   layout below (abi_layout: sizeof and offsetof of every field, in the order abi.py lists
   them) with ctypes' own, so the two cannot drift apart silently. */
#ifndef MINISPARSE_ABI_H
#define MINISPARSE_ABI_H
#include <stddef.h>
#include <stdint.h>

/* The most tokens one decode call takes (a verification pass of speculative decoding). */
#define MAX_TOKENS 8

/* Rows summed in registers before they are added to the output (the sparse loops). */
#define GROUP 8

/* Return codes of the sparse loops: Python turns them into ValueError / MemoryError. */
#define OK 0
#define BAD_INDEX 1
#define NO_MEMORY 2

/* MLP activations. */
enum { ACT_SILU = 0, ACT_RELU = 1, ACT_GELU = 2 };

/* Mat.format: how a weight matrix stores its rows, one code per format (matvec.h dispatches on
   it): float32; int8 codes with a float32 scale per row; 4-bit blocks of 32 weights times
   float32 activations, or times activations rounded to int8 per block of 32 (dot_q4_q8); 2:4
   sparse rows of float32 values or of int8 codes with a scale per row. */
enum { FMT_F32 = 0, FMT_I8 = 1, FMT_Q4 = 2, FMT_Q4_A8 = 3, FMT_NM_F32 = 4, FMT_NM_I8 = 5 };

/* A weight matrix in the format ``format`` (scale: the int8 formats' row scales, else NULL).
   in_stride > 0: a float32 transpose, one row per input, rows in_stride floats apart, read
   only at non-zero inputs. The 2:4 formats: data holds the 2 kept values of every 4 inputs
   [rows, cols / 2], nm_pos their positions 0..3 within their group, 2 bits each, 4 to a byte
   [rows, ceil(cols / 8)], the first value in the lowest bits. */
typedef struct {
    const void* data;
    const float* scale;
    int64_t in_stride;
    int64_t format;
    const uint8_t* nm_pos;
} Mat;

/* What a projection's input goes through first: a ReLU and/or a magnitude threshold
   (|v| <= threshold -> 0; a negative threshold means none). Identity is {0, -1}. */
typedef struct {
    int32_t relu;
    float threshold;
} Slot;

typedef struct {
    int64_t dim, n_heads, n_kv_heads, head_dim, max_seq;
    float eps, rope_scale;
    const float *norm, *inv_freq;                /* [dim], [head_dim / 2] */
    Mat wq, wk, wv, wo;                          /* [out, in] row-major */
    const float *bq, *bk, *bv, *bo;              /* biases or NULL */
    float *k_cache, *v_cache;                    /* [n_kv_heads, max_seq, head_dim] */
    Slot in;                                     /* layers[i].attn_in_act */
} AttnLayer;

typedef struct {
    int64_t dim, ffn;
    float eps;
    const float* norm;
    Mat wg, wu, wd;                              /* [ffn, dim], [ffn, dim], [dim, ffn] */
    const float *bg, *bu, *bd;
    int32_t act;                                 /* ACT_* */
    float act_threshold;                         /* CATS threshold on act(gate), < 0: none */
    Slot in, down_in;                            /* mlp_in_act, mlp.down_in_act */
} MlpLayer;

typedef struct {
    int64_t dim, ffn, rank;
    float eps;
    const float* norm;
    Mat wg, wu, wd_t;                            /* [ffn, dim], [ffn, dim], [ffn, dim]; int8 */
                                                 /* wd_t: one scale per column (per output) */
    int32_t act;
    Slot in;
    float threshold;                             /* threshold mode: active = |act(gate)| > t */
    const float *pu, *pu_bias, *pv, *pv_bias;    /* predictor mode (pu != NULL): [rank, dim], */
    int32_t predictor_relu;                      /* [rank] or NULL, [ffn, rank], [ffn]       */
    float cutoff;                                /* active = logit > cutoff */
} SparseMlpLayer;

/* The layout as this compiler sees it, for the test against ctypes: per struct, its size and
   then the offset of each field, in abi.py's order; then the constants. Returns how many
   numbers it wrote (at most n). */
int64_t abi_layout(int64_t* out, int64_t n) {
    const int64_t v[] = {
        sizeof(Mat), offsetof(Mat, data), offsetof(Mat, scale), offsetof(Mat, in_stride),
        offsetof(Mat, format), offsetof(Mat, nm_pos),
        sizeof(Slot), offsetof(Slot, relu), offsetof(Slot, threshold),
        sizeof(AttnLayer), offsetof(AttnLayer, dim), offsetof(AttnLayer, n_heads),
        offsetof(AttnLayer, n_kv_heads), offsetof(AttnLayer, head_dim),
        offsetof(AttnLayer, max_seq), offsetof(AttnLayer, eps), offsetof(AttnLayer, rope_scale),
        offsetof(AttnLayer, norm), offsetof(AttnLayer, inv_freq), offsetof(AttnLayer, wq),
        offsetof(AttnLayer, wk), offsetof(AttnLayer, wv), offsetof(AttnLayer, wo),
        offsetof(AttnLayer, bq), offsetof(AttnLayer, bk), offsetof(AttnLayer, bv),
        offsetof(AttnLayer, bo), offsetof(AttnLayer, k_cache), offsetof(AttnLayer, v_cache),
        offsetof(AttnLayer, in),
        sizeof(MlpLayer), offsetof(MlpLayer, dim), offsetof(MlpLayer, ffn),
        offsetof(MlpLayer, eps), offsetof(MlpLayer, norm), offsetof(MlpLayer, wg),
        offsetof(MlpLayer, wu), offsetof(MlpLayer, wd), offsetof(MlpLayer, bg),
        offsetof(MlpLayer, bu), offsetof(MlpLayer, bd), offsetof(MlpLayer, act),
        offsetof(MlpLayer, act_threshold), offsetof(MlpLayer, in), offsetof(MlpLayer, down_in),
        sizeof(SparseMlpLayer), offsetof(SparseMlpLayer, dim), offsetof(SparseMlpLayer, ffn),
        offsetof(SparseMlpLayer, rank), offsetof(SparseMlpLayer, eps),
        offsetof(SparseMlpLayer, norm), offsetof(SparseMlpLayer, wg),
        offsetof(SparseMlpLayer, wu), offsetof(SparseMlpLayer, wd_t),
        offsetof(SparseMlpLayer, act), offsetof(SparseMlpLayer, in),
        offsetof(SparseMlpLayer, threshold), offsetof(SparseMlpLayer, pu),
        offsetof(SparseMlpLayer, pu_bias), offsetof(SparseMlpLayer, pv),
        offsetof(SparseMlpLayer, pv_bias), offsetof(SparseMlpLayer, predictor_relu),
        offsetof(SparseMlpLayer, cutoff),
        MAX_TOKENS, GROUP, OK, BAD_INDEX, NO_MEMORY, ACT_SILU, ACT_RELU, ACT_GELU,
        FMT_F32, FMT_I8, FMT_Q4, FMT_Q4_A8, FMT_NM_F32, FMT_NM_I8,
    };
    const int64_t count = (int64_t)(sizeof(v) / sizeof(v[0]));
    for (int64_t i = 0; i < count && i < n; i++) out[i] = v[i];
    return count;
}
#endif
