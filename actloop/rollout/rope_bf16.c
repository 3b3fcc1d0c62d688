/* Rotary position embedding of bf16 heads, in place: the RoPE of a decode step for a bf16 engine
 * copy on a CPU with AVX-512 (built and loaded by `actloop/rollout/cpu_kernel.py`, called from
 * `rollout/lean_decode.py`).
 *
 *   x [B, T, H, D] (any strides in B, T, H; D contiguous), cos / sin [B, T, D] (D contiguous)
 *   x <- x * cos + rotate_half(x) * sin,  rotate_half(x) = (-x[D/2:], x[:D/2])
 *
 * each product and the sum rounded to bf16 as torch's bf16 operators round them, so the result is
 * transformers' `apply_rotary_pos_emb` bit for bit. torch spends ~10 operators per call on it. */
#include "bf16.h"

void actloop_rope_bf16(uint16_t *x, const uint16_t *cos, const uint16_t *sin, int64_t B, int64_t T, int64_t H,
                       int64_t D, int64_t xsb, int64_t xst, int64_t xsh, int64_t csb, int64_t cst) {
    const int64_t half = D / 2;
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < T; t++) {
            const uint16_t *c = cos + b * csb + t * cst, *s = sin + b * csb + t * cst;
            for (int64_t h = 0; h < H; h++) {
                uint16_t *p = x + b * xsb + t * xst + h * xsh;
                for (int64_t j = 0; j < half; j += 16) {
                    __mmask16 m = first_lanes(half - j);
                    __m512 x1 = load_bf16(p + j, m), x2 = load_bf16(p + half + j, m);
                    __m512 lo = _mm512_sub_ps(round_bf16(_mm512_mul_ps(x1, load_bf16(c + j, m))),
                                              round_bf16(_mm512_mul_ps(x2, load_bf16(s + j, m))));
                    __m512 hi = _mm512_add_ps(round_bf16(_mm512_mul_ps(x2, load_bf16(c + half + j, m))),
                                              round_bf16(_mm512_mul_ps(x1, load_bf16(s + half + j, m))));
                    store_bf16(p + j, lo, m);
                    store_bf16(p + half + j, hi, m);
                }
            }
        }
}
