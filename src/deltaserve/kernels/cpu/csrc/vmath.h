/* Branch-free fp32 exp / sigmoid / tanh that the compiler vectorises inside `omp simd` loops
 * (no libm calls). exp: Cody-Waite reduction and a degree-6 polynomial, within ~2 ulp over
 * [-87, 88] (inputs are clamped to that range, so exp never returns inf or a subnormal);
 * sigmoid and tanh are built from exp(-|x|) in (0, 1], never from exp of a positive number;
 * tanh uses its Taylor series below |x| < 1/16, where 1 - exp(-2|x|) would cancel. */
#ifndef DELTASERVE_VMATH_H
#define DELTASERVE_VMATH_H
#include <stdint.h>
#include <string.h>

static inline float ds_exp(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float shift = 12582912.0f;                     /* 1.5 * 2^23: round-to-nearest trick */
    float n = (x * 1.44269504f + shift) - shift;
    float r = x - n * 0.693359375f;                      /* ln2 split into exact hi + lo */
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

static inline float ds_sigmoid(float x) {
    float e = ds_exp(-(x < 0.f ? -x : x));
    float s = 1.0f / (1.0f + e);
    return x >= 0.f ? s : e * s;
}

/* tanh(x) = *num / *den with den in [1, 2] (callers multiply fractions, divide once). */
static inline void ds_tanh_frac(float x, float *num, float *den) {
    float a = x < 0.f ? -x : x;
    float e = ds_exp(-2.0f * a);
    float a2 = a * a;
    float small = a * (1.0f + a2 * (-1.0f / 3 + a2 * (2.0f / 15 + a2 * (-17.0f / 315))));
    float n = a < 0.0625f ? small : 1.0f - e;
    *den = a < 0.0625f ? 1.0f : 1.0f + e;
    *num = x < 0.f ? -n : n;
}

/* sigmoid(x) = *num / *den with den in [1, 2]. */
static inline void ds_sigmoid_frac(float x, float *num, float *den) {
    float e = ds_exp(-(x < 0.f ? -x : x));
    *num = x >= 0.f ? 1.0f : e;
    *den = 1.0f + e;
}

/* softplus(x) = log(1 + exp(x)), x itself above 20 (torch's threshold): max(x, 0) + log1p(exp(-|x|)),
 * log1p(u) for u in (0, 1] as 2 atanh(s), s = u / (2 + u) in (0, 1/3], by its series to s^15. Within
 * ~3 ulp of log1p(exp(x)) for x >= -87; below, exp's clamp holds it at ~1.6e-38. */
static inline float ds_softplus(float x) {
    const float u = ds_exp(-(x < 0.f ? -x : x));
    const float s = u / (2.0f + u), t = s * s;
    float p = 1.0f / 15;
    p = p * t + 1.0f / 13;
    p = p * t + 1.0f / 11;
    p = p * t + 1.0f / 9;
    p = p * t + 1.0f / 7;
    p = p * t + 1.0f / 5;
    p = p * t + 1.0f / 3;
    p = p * t + 1.0f;
    const float l = 2.0f * s * p;
    return x > 20.f ? x : (x > 0.f ? x : 0.f) + l;
}

static inline float ds_tanh(float x) {
    float n, d;
    ds_tanh_frac(x, &n, &d);
    return n / d;
}

#endif
