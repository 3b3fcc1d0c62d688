/* fp32 maths on 16 or 8 lanes for the AVX-512 kernels (`decode_attention_bf16.c`, `decode_layers_bf16.c`,
 * `head_logprob_bf16.c`, `swiglu_train_bf16.c`). */
#ifndef ACTLOOP_SIMD_MATH_H
#define ACTLOOP_SIMD_MATH_H
#include <immintrin.h>

#include "bf16.h"

/* e^v for 16 lanes (Cephes' expf: range reduction by ln 2, degree-6 polynomial; ~1 ulp in fp32) */
static inline __m512 exp_ps(__m512 v) {
    v = _mm512_min_ps(_mm512_max_ps(v, _mm512_set1_ps(-88.3762626647949f)), _mm512_set1_ps(88.3762626647950f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 t = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), v);
    t = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), t);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(t, t), _mm512_add_ps(t, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* silu(v) = v / (1 + e^-v) in fp32, rounded to bf16: torch's bf16 SiLU, 16 lanes */
static inline __m512 silu_bf16(__m512 v) {
    return round_bf16(_mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.0f), exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), v)))));
}

/* the horizontal sums of a[0], ..., a[7] as the 8 lanes of one register, in order: a tree of 15 adds
 * over lane shuffles, where eight separate _mm512_reduce_add_ps take ~4x the instructions */
static inline __m256 reduce8(const __m512 *a) {
    /* r01 = a0's two 256-bit halves summed, then a1's; the same for the other pairs */
    __m512 r01 = _mm512_add_ps(_mm512_shuffle_f32x4(a[0], a[1], 0x44), _mm512_shuffle_f32x4(a[0], a[1], 0xEE));
    __m512 r23 = _mm512_add_ps(_mm512_shuffle_f32x4(a[2], a[3], 0x44), _mm512_shuffle_f32x4(a[2], a[3], 0xEE));
    __m512 r45 = _mm512_add_ps(_mm512_shuffle_f32x4(a[4], a[5], 0x44), _mm512_shuffle_f32x4(a[4], a[5], 0xEE));
    __m512 r67 = _mm512_add_ps(_mm512_shuffle_f32x4(a[6], a[7], 0x44), _mm512_shuffle_f32x4(a[6], a[7], 0xEE));
    /* 128-bit block j of q0: a_j's four partial sums; of q1: a_{j+4}'s */
    __m512 q0 = _mm512_add_ps(_mm512_shuffle_f32x4(r01, r23, 0x88), _mm512_shuffle_f32x4(r01, r23, 0xDD));
    __m512 q1 = _mm512_add_ps(_mm512_shuffle_f32x4(r45, r67, 0x88), _mm512_shuffle_f32x4(r45, r67, 0xDD));
    __m512 u = _mm512_add_ps(_mm512_shuffle_ps(q0, q1, 0x44), _mm512_shuffle_ps(q0, q1, 0xEE));
    __m512 v = _mm512_add_ps(u, _mm512_shuffle_ps(u, u, 0xB1)); /* block j: lane 0 = sum a_j, lane 2 = sum a_{j+4} */
    __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_castps512_ps256(_mm512_permutexvar_ps(idx, v));
}

#endif
