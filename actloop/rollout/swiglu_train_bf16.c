/* SiLU(gate) x up of bf16 activations, forward and backward, for the trainer's passes in bf16
 * (`rollout/fused_ops.py`), built and loaded by `actloop/rollout/cpu_kernel.py`.
 *
 *   forward:  s = bf16(silu(g)),  a = bf16(s u)
 *   backward: du = bf16(da s),  ds = bf16(da u),  dg = bf16(ds sig(g) (1 + g (1 - sig(g))))
 *
 * with torch's roundings: the forward is what `act_fn(gate) * up` of LlamaMLP computes in two bf16
 * operators (as `decode_layers_bf16.c`'s silu_mul), the backward what autograd computes through
 * them (mul's backward, then silu_backward in fp32), where torch keeps SiLU's output for the
 * backward besides gate and up and runs ~5 operators (docs/performance.md). n values, contiguous;
 * OpenMP splits them. */
#include "bf16.h"
#include "simd_math.h"

static inline __m512 sigmoid_ps(__m512 g) {
    return _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_add_ps(_mm512_set1_ps(1.0f), exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g))));
}

void actloop_swiglu_fwd_bf16(const uint16_t *g, const uint16_t *u, uint16_t *a, int64_t n) {
#pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < n; j += 16) {
        __mmask16 m = first_lanes(n - j);
        store_bf16(a + j, _mm512_mul_ps(silu_bf16(load_bf16(g + j, m)), load_bf16(u + j, m)), m);
    }
}

void actloop_swiglu_bwd_bf16(const uint16_t *g, const uint16_t *u, const uint16_t *da, uint16_t *dg, uint16_t *du,
                             int64_t n) {
#pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < n; j += 16) {
        __mmask16 m = first_lanes(n - j);
        __m512 gv = load_bf16(g + j, m), dav = load_bf16(da + j, m);
        if (du) store_bf16(du + j, _mm512_mul_ps(dav, silu_bf16(gv)), m);
        __m512 ds = round_bf16(_mm512_mul_ps(dav, load_bf16(u + j, m)));
        __m512 sig = sigmoid_ps(gv);
        /* torch's order: dy * sig * (1 + x * (1 - sig)), no fused multiply-add */
        __m512 d = _mm512_add_ps(_mm512_set1_ps(1.0f), _mm512_mul_ps(gv, _mm512_sub_ps(_mm512_set1_ps(1.0f), sig)));
        store_bf16(dg + j, _mm512_mul_ps(_mm512_mul_ps(ds, sig), d), m);
    }
}
