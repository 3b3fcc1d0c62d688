/* transformers' RMSNorm of bf16 rows, fp32 maths, optionally after a residual add: the norms of a
 * decode step for a bf16 engine copy on a CPU with AVX-512 (built and loaded by
 * `actloop/rollout/cpu_kernel.py`, called from `rollout/lean_decode.py`).
 *
 *   s = x (+ r, rounded to bf16 and written to sum when r is given)
 *   y = bf16(w * bf16(s * rsqrt(mean(s^2) + eps)))         per row of n values
 *
 * which is LlamaRMSNorm's `weight * (h.float() * rsqrt(h.float().pow(2).mean(-1) + eps)).to(bf16)`
 * (and the bf16 `x + r` before it) with its fp32 sum taken in another order. torch runs that as
 * 8 operators, 34 us per call for 8 rows of 576 on the 2-core Zen 4 box: 2 norms in each of 30
 * layers, 3.5 ms of a 28 ms decode step (docs/performance.md). Rows are few: one thread. */
#include <math.h>

#include "bf16.h"

/* one row of n: s = x (+ r, rounded to bf16 and written to sum when r is given), y = the norm of s;
 * returns rsqrt(mean(s^2) + eps) (the trainer's norm keeps it for the backward, rms_norm_train_bf16.c) */
static inline float rms_norm_row(const uint16_t *xi, const uint16_t *ri, uint16_t *sumi, const uint16_t *w,
                                 uint16_t *yi, int64_t n, float eps) {
    const uint16_t *si = ri ? sumi : xi; /* the row that is normalised */
    __m512 acc = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
        __mmask16 m = first_lanes(n - j);
        __m512 s = load_bf16(xi + j, m);
        if (ri) {
            s = round_bf16(_mm512_add_ps(s, load_bf16(ri + j, m)));
            store_bf16(sumi + j, s, m);
        }
        acc = _mm512_fmadd_ps(s, s, acc);
    }
    const float r = 1.0f / sqrtf(_mm512_reduce_add_ps(acc) / (float)n + eps);
    const __m512 inv = _mm512_set1_ps(r);
    for (int64_t j = 0; j < n; j += 16) {
        __mmask16 m = first_lanes(n - j);
        __m512 h = round_bf16(_mm512_mul_ps(load_bf16(si + j, m), inv));
        store_bf16(yi + j, _mm512_mul_ps(load_bf16(w + j, m), h), m);
    }
    return r;
}

void actloop_rms_norm_bf16(const uint16_t *x, const uint16_t *r, uint16_t *sum, const uint16_t *w, uint16_t *y,
                           int64_t rows, int64_t n, int64_t xs, int64_t rs, int64_t ss, int64_t ys, float eps) {
    for (int64_t i = 0; i < rows; i++)
        rms_norm_row(x + i * xs, r ? r + i * rs : NULL, r ? sum + i * ss : NULL, w, y + i * ys, n, eps);
}
