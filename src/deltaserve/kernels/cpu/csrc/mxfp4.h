/* MXFP4 decoding shared by the GEMV and AMX kernels (layout: spec/model.md §16, packed [N, K/2]
 * uint8 with the LOW nibble the EARLIER element, scales [N, K/32] uint8 E8M0 = 2^(s-127)). */
#ifndef DELTASERVE_MXFP4_H
#define DELTASERVE_MXFP4_H
#include <stdint.h>
#include "ds_abi.h"
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#endif

/* ds_scaled_lut[s][c] = bf16(E2M1[c & 15] * 2^(s-127)), exact; filled by ds_init(). */
extern uint16_t ds_scaled_lut[256][32];

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
/* 16 packed bytes -> the 32 nibbles in element order (low nibble of byte i is element 2i): byte i
 * widened to dword i, then (d | d << 12) & 0x000F000F puts its low nibble in word 2i and its high
 * nibble in word 2i + 1 (one shuffle instead of a widen and a duplicate). */
static inline __m512i nibbles_in_order(const uint8_t *p) {
    const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm512_ternarylogic_epi32(d, _mm512_slli_epi32(d, 12), _mm512_set1_epi32(0x000F000F), 0xA8);
}

/* The 32 bf16 weights of one group (16 packed bytes, one scale). */
static inline __m512i mxfp4_group(const uint8_t *p, uint8_t s) {
    return _mm512_permutexvar_epi16(nibbles_in_order(p), _mm512_loadu_si512((const void *)ds_scaled_lut[s]));
}
#endif

#endif
