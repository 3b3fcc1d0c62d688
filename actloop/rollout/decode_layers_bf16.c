/* Every decoder layer of one decode step (one new token per row), in one call: the loop of
 * `rollout/lean_decode.py`'s `lean_forward` for a bf16 engine copy on a CPU with AVX512-BF16, built
 * and loaded by `actloop/rollout/cpu_kernel.py` (`decode_layers`).
 *
 * Per layer, with x [B, H] the residual stream and r the previous layer's MLP output (none at layer 0):
 *
 *   x = x + r;  h = rms(x) * ln1                        rms_norm_bf16.c
 *   qkv = h Wqkv^T (+ b)                                small_linear_bf16.c   [B, (Hq + 2 Hkv) D]
 *   q, k = rope(q), rope(k)                             rope_bf16.c           in place
 *   K[:, :, L - 1], V[:, :, L - 1] = k, v               the cache's column for this token
 *   o = attention(q, K[:, :, :L], V[:, :, :L], keep)    decode_attention_bf16.c
 *   x = x + o Wo^T (+ b);  h = rms(x) * ln2
 *   g, u = h Wgu^T (+ b);  r = (silu(g) * u) Wd^T (+ b)
 *
 * The same functions the per-operator path calls (included below, so both compute the same bits),
 * minus ~12 Python calls, tensor allocations and ctypes crossings per layer: on SmolLM2-135M
 * (30 layers, 8 rows) those were ~7 of a ~24 ms decode step on the 2-core Zen 4 box
 * (docs/performance.md). silu(g) * u is rounded as torch's two bf16 operators round it.
 *
 * Tables, int64 per layer: w[10 * l ..] = ln1, Wqkv, bqkv, Wo, bo, ln2, Wgu, bgu, Wd, bd (addresses, 0 =
 * no bias); kv[8 * l ..] = K, V (addresses of the [B, Hkv, capacity, D] buffers), K's strides in B, H,
 * column, V's the same. cos / sin [B, D] (row stride cs), keep [B, L] (1 = a real key). x is updated in
 * place; r receives the last layer's MLP output (added by the caller with the final norm). */
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "decode_attention_bf16.c"
#include "rms_norm_bf16.c"
#include "rope_bf16.c"
#include "simd_math.h"
#include "small_linear_bf16.c"

/* out[b, :I] = bf16(bf16(silu(gu[b, :I])) * gu[b, I:2I]) for the [B, 2I] gate/up product */
static void silu_mul(const uint16_t *gu, uint16_t *out, int64_t B, int64_t I) {
    for (int64_t b = 0; b < B; b++) {
        const uint16_t *g = gu + b * 2 * I, *u = g + I;
        for (int64_t j = 0; j < I; j += 16) {
            __mmask16 m = first_lanes(I - j);
            __m512 gv = load_bf16(g + j, m);
            store_bf16(out + b * I + j, _mm512_mul_ps(silu_bf16(gv), load_bf16(u + j, m)), m);
        }
    }
}

static inline const uint16_t *ptr(int64_t a) { return (const uint16_t *)(intptr_t)a; }

/* 0 on success, 1 when the workspace could not be allocated (nothing written) */
int actloop_decode_layers_bf16(uint16_t *x, uint16_t *r, const int64_t *w, const int64_t *kv, const uint16_t *cos,
                               const uint16_t *sin, const uint8_t *keep, int64_t layers, int64_t B, int64_t H,
                               int64_t Hq, int64_t Hkv, int64_t D, int64_t I, int64_t L, int64_t cs, float eps,
                               float scale) {
    const int64_t nqkv = (Hq + 2 * Hkv) * D;
    uint16_t *h = malloc(sizeof(uint16_t) * B * H);
    uint16_t *qkv = malloc(sizeof(uint16_t) * B * nqkv), *att = malloc(sizeof(uint16_t) * B * Hq * D);
    uint16_t *o = malloc(sizeof(uint16_t) * B * H), *gu = malloc(sizeof(uint16_t) * B * 2 * I);
    uint16_t *act = malloc(sizeof(uint16_t) * B * I);
    float *scores = malloc(sizeof(float) * B * Hq * L);
    int failed = !(h && qkv && att && o && gu && act && scores);
    for (int64_t l = 0; l < layers && !failed; l++) {
        const int64_t *wl = w + 10 * l, *kl = kv + 8 * l;
        /* x + r written over x (each chunk is read before it is written) */
        actloop_rms_norm_bf16(x, l ? r : NULL, x, ptr(wl[0]), h, B, H, H, H, H, H, eps);
        actloop_small_linear_bf16(h, ptr(wl[1]), ptr(wl[2]), qkv, B, nqkv, H);
        actloop_rope_bf16(qkv, cos, sin, B, 1, Hq, D, nqkv, nqkv, D, cs, cs);
        actloop_rope_bf16(qkv + Hq * D, cos, sin, B, 1, Hkv, D, nqkv, nqkv, D, cs, cs);
        uint16_t *K = (uint16_t *)(intptr_t)kl[0], *V = (uint16_t *)(intptr_t)kl[1];
        for (int64_t b = 0; b < B; b++)
            for (int64_t g = 0; g < Hkv; g++) {
                memcpy(K + b * kl[2] + g * kl[3] + (L - 1) * kl[4], qkv + b * nqkv + (Hq + g) * D, sizeof(uint16_t) * D);
                memcpy(V + b * kl[5] + g * kl[6] + (L - 1) * kl[7], qkv + b * nqkv + (Hq + Hkv + g) * D,
                       sizeof(uint16_t) * D);
            }
        actloop_decode_attention_bf16(qkv, K, V, keep, att, scores, B, Hq, Hkv, L, D, nqkv, D, kl[2], kl[3], kl[4],
                                      kl[5], kl[6], kl[7], scale);
        actloop_small_linear_bf16(att, ptr(wl[3]), ptr(wl[4]), o, B, H, Hq * D);
        actloop_rms_norm_bf16(x, o, x, ptr(wl[5]), h, B, H, H, H, H, H, eps);
        actloop_small_linear_bf16(h, ptr(wl[6]), ptr(wl[7]), gu, B, 2 * I, H);
        silu_mul(gu, act, B, I);
        actloop_small_linear_bf16(act, ptr(wl[8]), ptr(wl[9]), r, B, H, I);
    }
    free(h), free(qkv), free(att), free(o), free(gu), free(act), free(scores);
    return failed;
}
