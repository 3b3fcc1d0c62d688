/* y[M, N] = x[M, K] W[N, K]^T (+ b[N]) for few rows M, bf16 in and out with fp32 sums, row-major,
 * contiguous: the decode-step product of a bf16 engine copy on a CPU with AVX512-BF16 (AMD Zen 4,
 * Intel Cooper Lake / Sapphire Rapids and later), built and loaded by `actloop/rollout/cpu_kernel.py`.
 *
 * The shape of `small_linear.c` (the fp32 AVX2 kernel): each output column n is a dot product of W's
 * row n with up to 8 rows of x at once, so one load of 32 bf16 weights feeds 8 `vdpbf16ps` (each
 * 32 products summed pairwise into 16 fp32 lanes) and W streams from memory once per call. The fp32
 * sum is rounded to bf16 to nearest-even, as torch rounds a float. oneDNN's bf16 GEMM (torch's
 * F.linear) reaches ~8 GB/s of weights at 8 rows on the 2-core Zen 4 box; this kernel ~17 GB/s
 * (docs/performance.md). OpenMP splits the columns over torch's thread pool (libgomp, shared). */
#include "bf16.h"
#include "small_linear_rows.h"

#define PREFETCH 512  /* bf16 values ahead of the weight loads */

/* y[m0 .. m0 + MT, n] for one weight row n; MT is a constant at every call site (unrolled). */
static inline __attribute__((always_inline)) void column(const uint16_t *x, const uint16_t *w, const uint16_t *b,
                                                         uint16_t *y, int64_t N, int64_t K, int64_t m0, int64_t n,
                                                         const int MT) {
    __m512 acc[ROWS];
    const uint16_t *xr[ROWS];
    const uint16_t *wr = w + n * K;
    for (int i = 0; i < MT; i++) {
        acc[i] = _mm512_setzero_ps();
        xr[i] = x + (m0 + i) * K;
    }
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        _mm_prefetch((const char *)(wr + k + PREFETCH), _MM_HINT_T0);
        __m512bh wv = (__m512bh)_mm512_loadu_si512(wr + k);
        for (int i = 0; i < MT; i++)
            acc[i] = _mm512_dpbf16_ps(acc[i], wv, (__m512bh)_mm512_loadu_si512(xr[i] + k));
    }
    if (k < K) {  /* the tail: masked loads read zeros past K */
        __mmask32 tail = (__mmask32)((1ull << (K - k)) - 1);
        __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(tail, wr + k);
        for (int i = 0; i < MT; i++)
            acc[i] = _mm512_dpbf16_ps(acc[i], wv, (__m512bh)_mm512_maskz_loadu_epi16(tail, xr[i] + k));
    }
    for (int i = 0; i < MT; i++)
        y[(m0 + i) * N + n] = f32_to_bf16(_mm512_reduce_add_ps(acc[i]) + (b ? bf16_to_f32(b[n]) : 0.0f));
}

void actloop_small_linear_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *b, uint16_t *y, int64_t M,
                               int64_t N, int64_t K) {
    FOR_EACH_COLUMN_AND_ROW_PASS()
}
