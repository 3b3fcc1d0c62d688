/* The softmax side of the trainer's lm_head log-probs (`train/numerics/logprobs.py`'s `ChunkedHeadLogprob`) for bf16
 * logits on a CPU with AVX-512, built and loaded by `actloop/rollout/cpu_kernel.py` (`head_logprob`,
 * `head_logprob_grad_`).
 *
 * Forward, per row n of the logits z [N, V] (bf16, the head's matmul output), with s = z / T in fp32:
 *   m = max_v s_v,  S = sum_v e^(s_v - m),  lse[n] = m + log S
 *   lp[n] = s[tgt[n]] - lse[n],  ent[n] = log S - sum_v e^(s_v - m) (s_v - m) / S   (-sum p log p)
 * Backward, in place over z: z[n, v] = bf16((onehot(tgt[n])_v - e^(s_v - lse[n])) * g[n] / T).
 *
 * What torch computes for these (`ChunkedHeadLogprob`'s fallback), without its [N, V] fp32 copies: the
 * fp32 logits, their exponentials and the bf16 copy of the gradient were three fresh ~90 / 90 / 45 MB
 * tensors for the benchmark's 450 rows of a 49k vocabulary, each paid in page faults
 * (docs/performance.md). OpenMP splits the rows. */
#include <math.h>

#include "bf16.h"
#include "simd_math.h"

void actloop_head_logprob_bf16(const uint16_t *z, const int64_t *tgt, float *lp, float *lse, float *ent, int64_t N,
                               int64_t V, float T) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint16_t *zr = z + n * V;
        const __m512 t = _mm512_set1_ps(T);
        __m512 vm = _mm512_set1_ps(-INFINITY);
        for (int64_t v = 0; v < V; v += 16) {
            __mmask16 k = first_lanes(V - v);
            vm = _mm512_mask_max_ps(vm, k, vm, _mm512_div_ps(load_bf16(zr + v, k), t));
        }
        const float m = _mm512_reduce_max_ps(vm);
        const __m512 mv = _mm512_set1_ps(m);
        __m512 sum = _mm512_setzero_ps(), wsum = _mm512_setzero_ps();
        for (int64_t v = 0; v < V; v += 16) {
            __mmask16 k = first_lanes(V - v);
            __m512 d = _mm512_sub_ps(_mm512_div_ps(load_bf16(zr + v, k), t), mv);
            __m512 e = _mm512_maskz_mov_ps(k, exp_ps(d));
            sum = _mm512_add_ps(sum, e);
            wsum = _mm512_fmadd_ps(e, _mm512_maskz_mov_ps(k, d), wsum);
        }
        const float S = _mm512_reduce_add_ps(sum), W = _mm512_reduce_add_ps(wsum);
        const float log_total = logf(S);
        lse[n] = m + log_total;
        lp[n] = (bf16_to_f32(zr[tgt[n]]) / T - m) - log_total;
        ent[n] = log_total - W / S;
    }
}

void actloop_head_logprob_grad_bf16(uint16_t *z, const int64_t *tgt, const float *lse, const float *g, int64_t N,
                                    int64_t V, float T) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        uint16_t *zr = z + n * V;
        const float c = g[n] / T;
        const float target = (1.0f - expf(bf16_to_f32(zr[tgt[n]]) / T - lse[n])) * c; /* read before it is written */
        const __m512 t = _mm512_set1_ps(T), l = _mm512_set1_ps(lse[n]), nc = _mm512_set1_ps(-c);
        for (int64_t v = 0; v < V; v += 16) {
            __mmask16 k = first_lanes(V - v);
            __m512 p = exp_ps(_mm512_sub_ps(_mm512_div_ps(load_bf16(zr + v, k), t), l));
            store_bf16(zr + v, _mm512_mul_ps(p, nc), k);
        }
        zr[tgt[n]] = f32_to_bf16(target);
    }
}
