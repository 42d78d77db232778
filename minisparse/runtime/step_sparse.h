/* The sparse MLP step (pasted into step.c; chapter 07's SparseMLP): only the active neurons'
   gate, up and down rows are read, found by a threshold on the dense gate or by a low-rank
   predictor; the down rows are added into per-thread partial sums in groups of GROUP. */

/* part += sum_r h[r] W[rows[r]] over g <= GROUP rows of W [*, D] (float32 or int8 codes, one
   function each), summed in registers: GROUP row streams in flight. (Prefetching the next
   group's rows in one burst before the sums, as an earlier version did, ran the down rows of
   SmolLM2 at ~18 GB/s on a 2-core AMD EPYC instead of ~34: the burst crowds out the loads.) */
#define DOWN_GROUP(NAME, T, LOAD16)                                                            \
    static void NAME(const T* W, const int64_t* rows, int64_t g, const float* h, float* part, \
                     int64_t D) {                                                              \
        int64_t c = 0;                                                                         \
        for (; c + 16 <= D; c += 16) {                                                         \
            v16 s = zero16();                                                                  \
            for (int64_t r = 0; r < g; r++) s = smadd16(h[r], LOAD16(W + rows[r] * D + c), s); \
            store16(part + c, add16(load16(part + c), s));                                     \
        }                                                                                      \
        for (; c < D; c++) {                                                                   \
            float s = 0.0f;                                                                    \
            for (int64_t r = 0; r < g; r++) s += h[r] * (float)W[rows[r] * D + c];             \
            part[c] += s;                                                                      \
        }                                                                                      \
    }

DOWN_GROUP(down_group, float, load16)
DOWN_GROUP(down_group_i8, int8_t, load16_i8)

static void down_rows(Mat W, const int64_t* rows, int64_t g, const float* h, float* part,
                      int64_t D) {
    if (W.format == FMT_I8)
        down_group_i8((const int8_t*)W.data, rows, g, h, part, D);
    else
        down_group((const float*)W.data, rows, g, h, part, D);
}

/* Scratch floats sparse_mlp_step needs for up to MAX_TOKENS tokens: the indices (int64, two
   floats each), the norms, the gate values or logits, the predictor's bottleneck, the values,
   one partial output per thread. */
int64_t sparse_mlp_scratch(int64_t dim, int64_t ffn, int64_t rank, int num_threads) {
    return 2 * ffn + MAX_TOKENS * (dim + 2 * ffn + rank + (int64_t)num_threads * dim);
}

/* x[b] += the gated MLP of B <= MAX_TOKENS tokens over the active neurons only. Threshold mode
   (pu == NULL): the gate is dense, neuron j is active for token b when |act(g_bj)| > threshold;
   the up and down rows of the neurons active for any token are read once for all of them, and
   each token keeps its own neurons (h_bj = 0 where j is not active for b). Predictor mode:
   logits z = pv (pu n + pu_bias, ReLU'd for the MLP kind) + pv_bias, neuron j is active when
   z_bj > cutoff for some token b, and every token runs the union (as torch's SparseMLP does);
   gate, up and down read only those rows. Returns the number of neurons read (for
   reporting), or -1 on a bad argument. */
int64_t sparse_mlp_step(const SparseMlpLayer* L, float* x, int64_t B, float* scratch,
                        int num_threads) {
    const int64_t D = L->dim, F = L->ffn, R = L->rank;
    if (B < 1 || B > MAX_TOKENS) return -1;
    int64_t* idx = (int64_t*)scratch;  /* first, so that it is 8-byte aligned */
    float* n = (float*)(idx + F);      /* [B, D] */
    float* a = n + B * D;              /* [B, F]: act(gate) (threshold mode) or logits */
    float* t = a + B * F;              /* [B, rank]: the predictor's bottleneck */
    float* hv = t + B * R;             /* [B, F]: values of the active neurons, in idx order */
    float* parts = hv + B * F;         /* [threads, B, D] */
    int64_t count = 0;
    const int predicted = L->pu != 0;
    #pragma omp parallel num_threads(num_threads)
    {
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < B; b++) {
            rmsnorm(x + b * D, L->norm, L->eps, D, n + b * D);
            for (int64_t i = 0; i < D; i++) n[b * D + i] = slot(L->in, n[b * D + i]);
        }
        if (predicted) {  /* z = pv act(pu n + pu_bias) + pv_bias */
            #pragma omp for schedule(static)
            for (int64_t r = 0; r < R; r++)
                for (int64_t b = 0; b < B; b++) {
                    float z = dot(L->pu + r * D, n + b * D, D) + (L->pu_bias ? L->pu_bias[r] : 0.0f);
                    t[b * R + r] = L->predictor_relu && z < 0.0f ? 0.0f : z;
                }
            #pragma omp for schedule(static)
            for (int64_t j = 0; j < F; j++)
                for (int64_t b = 0; b < B; b++)
                    a[b * F + j] = dot(L->pv + j * R, t + b * R, R) + L->pv_bias[j];
        } else if (B == 1 && L->wg.format == FMT_I8) {  /* int8: the dense gate decides */
            gemv_rows(L->wg, 0, n, a, F, D);
            #pragma omp barrier
            #pragma omp for schedule(static)
            for (int64_t j = 0; j < F; j++) a[j] = activate(L->act, a[j]);
        } else if (B == 1) {  /* the dense float32 gate decides, one row at a time as in mlp_step */
            const float* wg = (const float*)L->wg.data;
            #pragma omp for schedule(static)
            for (int64_t j = 0; j < F; j++) a[j] = activate(L->act, dot(wg + j * D, n, D));
        } else {  /* several tokens: each gate row read once for all of them */
            #pragma omp for schedule(static)
            for (int64_t j = 0; j < F; j++) {
                float g[MAX_TOKENS];
                mdot_tokens(L->wg, j, n, B, D, g);
                for (int64_t b = 0; b < B; b++) a[b * F + j] = activate(L->act, g[b]);
            }
        }
        #pragma omp single
        {
            for (int64_t j = 0; j < F; j++) {
                int on = 0;
                for (int64_t b = 0; b < B; b++)
                    on |= predicted ? a[b * F + j] > L->cutoff : fabsf(a[b * F + j]) > L->threshold;
                if (on) idx[count++] = j;
            }
        }
        if (B == 1) {
            /* gate (predictor mode) and up rows of the active neurons, GATHER rows at a time
               (8 neurons' gate and up, or 16 neurons' up): GATHER row streams in flight. A
               short tail group repeats its last neuron. */
            const int64_t per = predicted ? GATHER / 2 : GATHER;
            #pragma omp for schedule(static)
            for (int64_t q = 0; q < (count + per - 1) / per; q++) {
                const int64_t i0 = q * per, m = count - i0 < per ? count - i0 : per;
                const Mat* M[GATHER];
                int64_t rows[GATHER];
                float y[GATHER];
                for (int64_t r = 0; r < GATHER; r++) {
                    rows[r] = idx[i0 + (r % per < m ? r % per : m - 1)];
                    M[r] = predicted && r < per ? &L->wg : &L->wu;
                }
                mdot_gather(M, rows, D, n, y);
                for (int64_t r = 0; r < m; r++)
                    hv[i0 + r] = (predicted ? activate(L->act, y[r]) : a[rows[r]]) *
                                 y[predicted ? per + r : r];
            }
        } else {  /* each active row read once for all B tokens */
            #pragma omp for schedule(static)
            for (int64_t i = 0; i < count; i++) {
                const int64_t j = idx[i];
                float g[MAX_TOKENS], u[MAX_TOKENS];
                if (predicted) {
                    mdot_tokens2(L->wg, L->wu, j, n, B, D, g, u);
                    for (int64_t b = 0; b < B; b++) hv[b * F + i] = activate(L->act, g[b]) * u[b];
                } else {
                    mdot_tokens(L->wu, j, n, B, D, u);
                    for (int64_t b = 0; b < B; b++) {
                        float ab = a[b * F + j];
                        hv[b * F + i] = fabsf(ab) > L->threshold ? ab * u[b] : 0.0f;
                    }
                }
            }
        }
        /* y[b] = sum_i hv[b, i] W_down_t[idx[i]]: groups of GROUP rows summed in registers, each
           thread into its own partial sums, then the partials added to x. The group's rows are
           read from memory for the first token and from cache for the others. Int8 rows: the
           codes are summed, and the per-output scale multiplies the total (it factors out).
           (Adding each group's down rows right after its gate and up rows, with no barrier
           between the stages, measured no faster.) */
        float* part = parts + (int64_t)THREAD_ID() * B * D;
        for (int64_t c = 0; c < B * D; c++) part[c] = 0.0f;
        #pragma omp for schedule(static)
        for (int64_t g0 = 0; g0 < count; g0 += GROUP) {
            int64_t g = count - g0 < GROUP ? count - g0 : GROUP;
            for (int64_t b = 0; b < B; b++)
                down_rows(L->wd_t, idx + g0, g, hv + b * F + g0, part + b * D, D);
        }
        int nt = THREADS();
        const float* sd = L->wd_t.scale;
        #pragma omp for schedule(static)
        for (int64_t c = 0; c < B * D; c++) {
            float s = 0.0f;
            for (int p = 0; p < nt; p++) s += parts[p * B * D + c];
            x[c] += sd ? sd[c % D] * s : s;
        }
    }
    return count;
}
