/* transformers' RMSNorm of bf16 rows, forward and backward, for the trainer's passes in bf16
 * (`rollout/fused_ops.py`), built and loaded by `actloop/rollout/cpu_kernel.py`.
 *
 *   forward:  r = rsqrt(mean(x^2) + eps)  (fp32, per row, kept),  y = bf16(w * bf16(x r))
 *   backward: g = bf16(dy * w),  dx = bf16(r g - x r^3 mean(g x)),  dw = sum over rows of dy * bf16(x r)
 *
 * the forward is the decode norm's row (`rms_norm_bf16.c`'s `rms_norm_row`: LlamaRMSNorm's `weight *
 * (h.float() * rsqrt(h.float().pow(2).mean(-1) + eps)).to(bf16)`); the backward is what autograd computes through those
 * operators, in fp32 lanes, where torch runs ~8 operators each way and keeps two fp32 copies of
 * every normed activation for the backward (docs/performance.md). dw_scratch holds threads x n
 * floats (per-thread partial sums of dw). OpenMP splits the rows. */
#include <math.h>
#include <omp.h>
#include <string.h>

#include "bf16.h"
#include "rms_norm_bf16.c" /* rms_norm_row: the decode norm's maths, bit for bit */

void actloop_rms_norm_fwd_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, float *rstd, int64_t rows, int64_t n,
                               float eps) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < rows; i++) rstd[i] = rms_norm_row(x + i * n, NULL, NULL, w, y + i * n, n, eps);
}

/* dw may be NULL (a frozen weight); then dw_scratch is not read */
void actloop_rms_norm_bwd_bf16(const uint16_t *x, const uint16_t *w, const float *rstd, const uint16_t *dy,
                               uint16_t *dx, uint16_t *dw, float *dw_scratch, int64_t rows, int64_t n, int64_t threads) {
    if (dw) memset(dw_scratch, 0, sizeof(float) * threads * n);
#pragma omp parallel num_threads(threads)
    {
        float *part = dw ? dw_scratch + (int64_t)omp_get_thread_num() * n : NULL;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < rows; i++) {
            const uint16_t *xi = x + i * n, *gi = dy + i * n;
            const float r = rstd[i];
            const __m512 rv = _mm512_set1_ps(r);
            __m512 acc = _mm512_setzero_ps();
            for (int64_t j = 0; j < n; j += 16) {
                __mmask16 m = first_lanes(n - j);
                __m512 dyv = load_bf16(gi + j, m), xv = load_bf16(xi + j, m);
                __m512 g = round_bf16(_mm512_mul_ps(dyv, load_bf16(w + j, m)));
                acc = _mm512_fmadd_ps(g, xv, acc);
                if (part) {
                    __m512 h = round_bf16(_mm512_mul_ps(xv, rv));
                    _mm512_mask_storeu_ps(part + j, m,
                                          _mm512_fmadd_ps(dyv, h, _mm512_maskz_loadu_ps(m, part + j)));
                }
            }
            const __m512 c = _mm512_set1_ps(r * r * r * _mm512_reduce_add_ps(acc) / (float)n);
            for (int64_t j = 0; j < n; j += 16) {
                __mmask16 m = first_lanes(n - j);
                __m512 xv = load_bf16(xi + j, m);
                __m512 g = round_bf16(_mm512_mul_ps(load_bf16(gi + j, m), load_bf16(w + j, m)));
                store_bf16(dx + i * n + j, _mm512_fnmadd_ps(xv, c, _mm512_mul_ps(g, rv)), m);
            }
        }
    }
    if (dw)
        for (int64_t j = 0; j < n; j += 16) {
            __mmask16 m = first_lanes(n - j);
            __m512 s = _mm512_setzero_ps();
            for (int64_t t = 0; t < threads; t++) s = _mm512_add_ps(s, _mm512_maskz_loadu_ps(m, dw_scratch + t * n + j));
            store_bf16(dw + j, s, m);
        }
}
