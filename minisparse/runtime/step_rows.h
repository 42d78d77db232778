/* Matrices times the tokens of one decode call, split between the threads of a parallel
   region (pasted into step.c): gemv_rows for one token, gemm_rows for B tokens (register tiles
   of matvec.h, or the rows one at a time for the formats without tiles), scatter_gemm for the
   input-major transposes TEAL reads only at non-zero inputs. */

/* The most inputs (times tokens) whose int8 rounding a thread keeps on its stack (16 KB);
   a wider 4-bit matrix with int8 activations falls back to float activations. */
#define Q8_MAX_INPUTS 16384

/* y = W x (+ b) over rows [0, N), split between the team's threads (called inside a parallel
   region by every thread; no barrier at the end). One row at a time: each thread reads its
   rows as one sequential stream. (Four rows at once, four interleaved streams per thread, was
   measured 2x slower on a 2-core AMD EPYC for the 576-wide rows of attention and the LM head:
   the hardware prefetcher follows one stream per thread far better than four.) */
static void gemv_rows(Mat W, const float* b, const float* x, float* y, int64_t N, int64_t K) {
    if (W.format == FMT_Q4_A8 && K <= Q8_MAX_INPUTS) {  /* each thread rounds x once, then rows */
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
    if (W.format == FMT_Q4_A8 && B * K <= Q8_MAX_INPUTS) {  /* as gemv_rows, B tokens a row */
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
    if (!tiled_format(W.format)) {
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
