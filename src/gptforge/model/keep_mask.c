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
