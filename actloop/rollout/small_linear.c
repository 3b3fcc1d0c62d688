/* y[M, N] = x[M, K] W[N, K]^T (+ b[N]) for few rows M, fp32, row-major, contiguous: the decode-step
 * product of `actloop/rollout/small_matmul.py`, built and loaded by `actloop/rollout/cpu_kernel.py`.
 *
 * Each output column n is a dot product of W's row n with up to 8 rows of x at once: one load of a
 * weight vector feeds 8 FMAs, so W streams from memory exactly once per call (x, a few KB, stays in
 * L1), and the next rows of W are prefetched ahead of the loads. OpenMP splits the columns over the
 * caller's threads; the library links libgomp, which resolves to the copy torch has already loaded,
 * so the kernel shares torch's thread pool and `torch.set_num_threads`. */
#include <immintrin.h>
#include <stdint.h>

#include "small_linear_rows.h"

#define PREFETCH 256 /* floats ahead of the weight loads */

static inline float hsum(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 sh = _mm_movehdup_ps(lo);
    __m128 s = _mm_add_ps(lo, sh);
    sh = _mm_movehl_ps(sh, s);
    return _mm_cvtss_f32(_mm_add_ss(s, sh));
}

/* y[m0 .. m0 + MT, n] for one weight row n; MT is a constant at every call site (unrolled). */
static inline __attribute__((always_inline)) void column(const float *x, const float *w, const float *b, float *y,
                                                         int64_t N, int64_t K, int64_t m0, int64_t n, const int MT) {
    __m256 acc[ROWS];
    const float *xr[ROWS];
    const float *wr = w + n * K;
    for (int i = 0; i < MT; i++) {
        acc[i] = _mm256_setzero_ps();
        xr[i] = x + (m0 + i) * K;
    }
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        _mm_prefetch((const char *)(wr + k + PREFETCH), _MM_HINT_T0);
        __m256 wv = _mm256_loadu_ps(wr + k);
        for (int i = 0; i < MT; i++) acc[i] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xr[i] + k), acc[i]);
    }
    for (int i = 0; i < MT; i++) {
        float s = hsum(acc[i]);
        for (int64_t j = k; j < K; j++) s += xr[i][j] * wr[j];
        y[(m0 + i) * N + n] = s + (b ? b[n] : 0.0f);
    }
}

void actloop_small_linear(const float *x, const float *w, const float *b, float *y, int64_t M, int64_t N, int64_t K) {
    FOR_EACH_COLUMN_AND_ROW_PASS()
}
