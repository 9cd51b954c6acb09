/* gptforge's dropout masks: keep[i] is lane i % 4 (16 bits, little-endian order) of word i / 4, read as a signed
 * 16-bit integer, compared with `threshold`; word j is SplitMix64's output for the state seed + (j + 1) * golden.
 * model/masks.py computes the same masks with torch operations (its reference and fallback) and compiles this
 * file on first use; the loop has no dependence between words, so the compiler vectorises it. */
#include <stdint.h>

static inline uint64_t splitmix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

void gptforge_keep_mask(uint8_t *restrict keep, int64_t n, uint64_t seed, int32_t threshold) {
    const uint64_t golden = 0x9e3779b97f4a7c15ULL;
    const int64_t words = n / 4;
    for (int64_t j = 0; j < words; j++) {
        uint64_t w = splitmix64(seed + (uint64_t)(j + 1) * golden);
        keep[4 * j] = (int16_t)(uint16_t)w >= threshold;
        keep[4 * j + 1] = (int16_t)(uint16_t)(w >> 16) >= threshold;
        keep[4 * j + 2] = (int16_t)(uint16_t)(w >> 32) >= threshold;
        keep[4 * j + 3] = (int16_t)(uint16_t)(w >> 48) >= threshold;
    }
    if (words * 4 < n) {
        uint64_t w = splitmix64(seed + (uint64_t)(words + 1) * golden);
        for (int64_t i = words * 4; i < n; i++, w >>= 16) keep[i] = (int16_t)(uint16_t)w >= threshold;
    }
}

/* A mask applied: out[i] = (x[i] * keep[i]) * scale, rounded as torch rounds `(x * as_ones(keep)).mul_(scale)`:
 * x * keep is exact (0 or x; NaN for a dropped infinity or NaN; signed zeros kept), then the product with the float
 * scale is rounded once to x's type (bf16: to nearest even, NaN as 0x7FC0 as torch's scalar conversion writes it;
 * its vectorised one writes 0xFFFF). One pass instead of torch's four (the mask's two conversions, two products);
 * out may be x. */
static inline float bf16_to_float(uint16_t h) {
    union { uint32_t u; float f; } v = {(uint32_t)h << 16};
    return v.f;
}

static inline uint16_t float_to_bf16(float f) {
    union { float f; uint32_t u; } v = {f};
    uint32_t rounded = (v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16;
    return (v.u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)0x7fc0u : (uint16_t)rounded;
}

void gptforge_masked_bf16(const uint16_t *x, const uint8_t *restrict keep, uint16_t *out, int64_t n, float scale) {
    for (int64_t i = 0; i < n; i++) out[i] = float_to_bf16(bf16_to_float(x[i]) * (float)keep[i] * scale);
}

void gptforge_masked_f32(const float *x, const uint8_t *restrict keep, float *out, int64_t n, float scale) {
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * (float)keep[i] * scale;
}
