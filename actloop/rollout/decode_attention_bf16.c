/* One query per row attending over a bf16 KV cache, fp32 sums: the attention of a decode step
 * for a bf16 engine copy on a CPU with AVX-512 and AVX512-BF16 (built and loaded by
 * `actloop/rollout/cpu_kernel.py`, called from `rollout/lean_decode.py`'s `attention` and from
 * `decode_layers_bf16.c`).
 *
 *   q [B, Hq, D], k / v [B, Hkv, L, D] (any strides in B, H, L; D contiguous), keep [B, L] (1 = a
 *   real key), out [B, Hq, D]; query head h reads kv head h / (Hq / Hkv) (grouped-query attention)
 *   out[b, h] = sum_j softmax_j(scale * q.k_j over kept j) v_j
 *
 * The scores of 8 keys at a time: `vdpbf16ps` multiplies the bf16 query and key in pairs into fp32
 * lanes (exact products, fp32 sums), and one tree (`reduce8`) turns the 8 keys' lanes into their 8
 * dot products; the softmax's exponentials 16 at a time (`exp_ps`). SmolLM2's 30 layers of a decode
 * step (8 rows, 9 heads, 150 keys) on the 2-core Zen 4 box: 2.3 ms, against 2.8 ms for the first
 * version (one key at a time, a horizontal sum and a scalar expf each) and 829 us a layer for
 * torch's bf16 flash kernel (docs/performance.md). `scratch` holds B * Hq * L floats (the scores).
 * OpenMP splits the (row, head) pairs. */
#include <math.h>

#include "bf16.h"
#include "simd_math.h"

#define MAXD 256 /* head_dim up to this; the caller checks */

/* the mask of the first n (<= 32) bf16 lanes of a 512-bit register */
static inline __mmask32 first_pairs(int64_t n) { return n >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << n) - 1); }

void actloop_decode_attention_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, const uint8_t *keep,
                                   uint16_t *out, float *scratch, int64_t B, int64_t Hq, int64_t Hkv, int64_t L,
                                   int64_t D, int64_t qsb, int64_t qsh, int64_t ksb, int64_t ksh, int64_t ksl,
                                   int64_t vsb, int64_t vsh, int64_t vsl, float scale) {
    const int64_t group = Hq / Hkv;
    const int64_t nd = (D + 31) / 32; /* 32-value chunks of a bf16 row (the dot products) */
    const int64_t nv = (D + 15) / 16; /* 16-value chunks of an fp32 row (the output) */
#pragma omp parallel for schedule(static)
    for (int64_t bh = 0; bh < B * Hq; bh++) {
        const int64_t b = bh / Hq, h = bh % Hq, g = h / group;
        const uint16_t *qp = q + b * qsb + h * qsh;
        const uint16_t *kp = k + b * ksb + g * ksh;
        const uint16_t *vp = v + b * vsb + g * vsh;
        const uint8_t *kr = keep + b * L;
        float *s = scratch + bh * L;
        __m512bh qb[MAXD / 32];
        for (int64_t c = 0; c < nd; c++) qb[c] = (__m512bh)_mm512_maskz_loadu_epi16(first_pairs(D - 32 * c), qp + 32 * c);
        /* scores, 8 keys at a time; a key not kept scores -inf */
        __m256 vmax = _mm256_set1_ps(-INFINITY);
        for (int64_t j0 = 0; j0 < L; j0 += 8) {
            const int n = L - j0 < 8 ? (int)(L - j0) : 8;
            __m512 acc[8];
            __mmask8 kept = 0;
            for (int i = 0; i < 8; i++) acc[i] = _mm512_setzero_ps();
            for (int i = 0; i < n; i++) {
                const uint16_t *kj = kp + (j0 + i) * ksl;
                for (int64_t c = 0; c < nd; c++)
                    acc[i] = _mm512_dpbf16_ps(acc[i], qb[c],
                                              (__m512bh)_mm512_maskz_loadu_epi16(first_pairs(D - 32 * c), kj + 32 * c));
                kept |= (__mmask8)((kr[j0 + i] != 0) << i);
            }
            __m256 sc = _mm256_mask_mov_ps(_mm256_set1_ps(-INFINITY), kept,
                                           _mm256_mul_ps(reduce8(acc), _mm256_set1_ps(scale)));
            _mm256_mask_storeu_ps(s + j0, (__mmask8)((1u << n) - 1), sc);
            vmax = _mm256_max_ps(vmax, sc);
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        const float mx = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
        __m512 o[MAXD / 16];
        for (int64_t c = 0; c < nv; c++) o[c] = _mm512_setzero_ps();
        float total = 0.0f;
        if (mx != -INFINITY) { /* a row with no kept key (padding only) gets zeros */
            __m512 sum = _mm512_setzero_ps();
            for (int64_t j = 0; j < L; j += 16) { /* p_j = e^(s_j - max), 0 for a key not kept */
                __mmask16 m = first_lanes(L - j);
                __m512 sv = _mm512_maskz_loadu_ps(m, s + j);
                __mmask16 live = _mm512_mask_cmp_ps_mask(m, sv, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
                __m512 p = _mm512_maskz_mov_ps(live, exp_ps(_mm512_sub_ps(sv, _mm512_set1_ps(mx))));
                _mm512_mask_storeu_ps(s + j, m, p);
                sum = _mm512_add_ps(sum, p);
            }
            total = _mm512_reduce_add_ps(sum);
            for (int64_t j = 0; j < L; j++) {
                if (!kr[j]) continue; /* never read: a padded slot may hold anything */
                const uint16_t *vj = vp + j * vsl;
                __m512 pv = _mm512_set1_ps(s[j]);
                for (int64_t c = 0; c < nv; c++)
                    o[c] = _mm512_fmadd_ps(pv, load_bf16(vj + 16 * c, first_lanes(D - 16 * c)), o[c]);
            }
        }
        float inv = total > 0.0f ? 1.0f / total : 0.0f;
        uint16_t *op = out + bh * D;
        for (int64_t c = 0; c < nv; c++) store_bf16(op + 16 * c, _mm512_mul_ps(o[c], _mm512_set1_ps(inv)),
                                                    first_lanes(D - 16 * c));
    }
}
