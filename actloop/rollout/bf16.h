/* bf16 <-> fp32 for the bf16 kernels (`small_linear_bf16.c`, `decode_attention_bf16.c`, `rms_norm_bf16.c`,
 * `rope_bf16.c`): scalar and 16-lane AVX-512 forms, rounding to nearest even as c10::BFloat16 does
 * (a NaN becomes 0x7FC0), so a kernel's bf16 result is torch's for the same fp32 value. */
#ifndef ACTLOOP_BF16_H
#define ACTLOOP_BF16_H
#include <immintrin.h>
#include <stdint.h>

static inline float bf16_to_f32(uint16_t v) {
    union { uint32_t u; float f; } c = {(uint32_t)v << 16};
    return c.f;
}

static inline uint16_t f32_to_bf16(float s) {
    union { float f; uint32_t u; } c = {s};
    if (s != s) return 0x7FC0;
    return (uint16_t)((c.u + 0x7FFF + ((c.u >> 16) & 1)) >> 16);
}

/* the lanes of m of p (16 bf16) as floats, 0 elsewhere */
static inline __m512 load_bf16(const uint16_t *p, __mmask16 m) {
    __m256i h = _mm256_maskz_loadu_epi16(m, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* v rounded to bf16, nearest even, as 16 lanes of fp32 (the value a bf16 tensor would hold) */
static inline __m512 round_bf16(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_and_si512(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))),
                                 _mm512_set1_epi32((int)0xFFFF0000u));
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_mask_mov_ps(_mm512_castsi512_ps(r), nan, _mm512_castsi512_ps(_mm512_set1_epi32(0x7FC00000)));
}

/* the lanes of m of v, rounded to bf16, into p */
static inline void store_bf16(uint16_t *p, __m512 v, __mmask16 m) {
    __m512i r = _mm512_srli_epi32(_mm512_castps_si512(round_bf16(v)), 16);
    _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(r));
}

/* the mask of the first n (<= 16) lanes */
static inline __mmask16 first_lanes(int64_t n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1); }

#endif
