/* gptforge's compiled CPU kernels: dropout masks and their application (model/masks.py), and RMSNorm forward and
 * backward in one pass over each row (model/layers.py); model/masks.py compiles this file on first use and checks
 * every function against torch before using it.
 *
 * Dropout masks: keep[i] is lane i % 4 (16 bits, little-endian order) of word i / 4, read as a signed
 * 16-bit integer, compared with `threshold`; word j is SplitMix64's output for the state seed + (j + 1) * golden.
 * model/masks.py computes the same masks with torch operations (its reference and fallback) and compiles this
 * file on first use; the loop has no dependence between words, so the compiler vectorises it. */
#include <math.h>
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

/* RMSNorm over rows of n: y = x r with r = 1 / sqrt(mean(x^2) + eps) per row (kept for backward), and its gradient
 * dx = g r + x c with c = -r^3 mean(g x). Each row is read once from memory (the second read hits the core's
 * cache), where torch's operations pass over the whole tensor four times forward and six backward. Sums are taken
 * in float32 in LANES partial sums (the compiler vectorises them), then in order: the same result on every run.
 * Values are rounded once into the output's type. Rows [first, last) of contiguous tensors; the names give the
 * types: _f32_bf16 reads float32 and writes bf16 (a block's norm under autocast), _back_bf16_f32 reads a bf16
 * gradient and a float32 x. */
#define RMS_LANES 16
#define LOAD_f32(p, i) ((p)[i])
#define LOAD_bf16(p, i) bf16_to_float((p)[i])
#define STORE_f32(p, i, v) ((p)[i] = (v))
#define STORE_bf16(p, i, v) ((p)[i] = float_to_bf16(v))
#define TYPE_f32 float
#define TYPE_bf16 uint16_t

/* 1 / sqrt(mean(x^2) + eps) of a row of n: the squares summed in RMS_LANES float32 partial sums, then in order */
#define RMS_INVERSE(T)                                                                                          \
    static inline float rms_inverse_##T(const TYPE_##T *x, int64_t n, float eps) {                              \
        float acc[RMS_LANES] = {0.0f};                                                                          \
        int64_t i = 0;                                                                                          \
        for (; i + RMS_LANES <= n; i += RMS_LANES)                                                              \
            for (int l = 0; l < RMS_LANES; l++) {                                                               \
                float v = LOAD_##T(x, i + l);                                                                   \
                acc[l] += v * v;                                                                                \
            }                                                                                                   \
        for (; i < n; i++) {                                                                                    \
            float v = LOAD_##T(x, i);                                                                           \
            acc[0] += v * v;                                                                                    \
        }                                                                                                       \
        float sum = 0.0f;                                                                                       \
        for (int l = 0; l < RMS_LANES; l++) sum += acc[l];                                                      \
        return 1.0f / sqrtf(sum / (float)n + eps);                                                              \
    }
RMS_INVERSE(f32)
RMS_INVERSE(bf16)

#define RMS_FORWARD(TX, TY)                                                                                     \
    void gptforge_rms_##TX##_##TY(const TYPE_##TX *x, TYPE_##TY *y, float *r, int64_t first, int64_t last,     \
                                  int64_t n, float eps) {                                                       \
        for (int64_t row = first; row < last; row++) {                                                          \
            const TYPE_##TX *xr = x + row * n;                                                                  \
            TYPE_##TY *yr = y + row * n;                                                                        \
            float rr = rms_inverse_##TX(xr, n, eps);                                                            \
            r[row] = rr;                                                                                        \
            for (int64_t i = 0; i < n; i++) STORE_##TY(yr, i, LOAD_##TX(xr, i) * rr);                           \
        }                                                                                                       \
    }

#define RMS_BACKWARD(TG, TX)                                                                                    \
    void gptforge_rms_back_##TG##_##TX(const TYPE_##TG *g, const TYPE_##TX *x, const float *r, TYPE_##TX *dx,  \
                                       int64_t first, int64_t last, int64_t n) {                                \
        for (int64_t row = first; row < last; row++) {                                                          \
            const TYPE_##TG *gr = g + row * n;                                                                  \
            const TYPE_##TX *xr = x + row * n;                                                                  \
            TYPE_##TX *dr = dx + row * n;                                                                       \
            float acc[RMS_LANES] = {0.0f};                                                                      \
            int64_t i = 0;                                                                                      \
            for (; i + RMS_LANES <= n; i += RMS_LANES)                                                          \
                for (int l = 0; l < RMS_LANES; l++) acc[l] += LOAD_##TG(gr, i + l) * LOAD_##TX(xr, i + l);      \
            for (; i < n; i++) acc[0] += LOAD_##TG(gr, i) * LOAD_##TX(xr, i);                                   \
            float dot = 0.0f;                                                                                   \
            for (int l = 0; l < RMS_LANES; l++) dot += acc[l];                                                  \
            float rr = r[row];                                                                                  \
            float c = -rr * rr * rr * (dot / (float)n);                                                         \
            for (i = 0; i < n; i++) STORE_##TX(dr, i, LOAD_##TG(gr, i) * rr + LOAD_##TX(xr, i) * c);            \
        }                                                                                                       \
    }

RMS_FORWARD(f32, f32)
RMS_FORWARD(f32, bf16)
RMS_FORWARD(bf16, bf16)
RMS_BACKWARD(f32, f32)
RMS_BACKWARD(bf16, f32)
RMS_BACKWARD(bf16, bf16)

/* Rotary embedding then RMSNorm, in one pass over each row (qk-norm after rotary, layers.rotary_rms_norm): row
 * (b, h, t) of x, hs values at x + b sb + h sh + t st, is rotated pairwise by its position's angles, (a, c) ->
 * (a cos + c sin, c cos - a sin) for a = x[i], c = x[i + hs/2], and scaled by r = 1 / sqrt(mean(x^2) + eps) (a
 * rotation keeps the sum of squares: r is taken from x), in float32, rounded once into y, contiguous (B, H, T, hs).
 * cos and sin: float32 (T, hs/2). The backward turns g back by the opposite angles, then RMSNorm's gradient:
 * dx = u r + x c, u = the turned g, c = -r^3 mean(u x), written at dx + b db + h dh + t dt. hs <= 1024. */
#define ROPE_RMS(T)                                                                                                \
    void gptforge_rope_rms_##T(const TYPE_##T *x, TYPE_##T *y, float *r, const float *cos, const float *sin,       \
                               int64_t B, int64_t H, int64_t Tn, int64_t hs, int64_t sb, int64_t sh, int64_t st,    \
                               float eps) {                                                                        \
        const int64_t half = hs / 2;                                                                               \
        for (int64_t b = 0; b < B; b++)                                                                            \
            for (int64_t h = 0; h < H; h++)                                                                        \
                for (int64_t t = 0; t < Tn; t++) {                                                                 \
                    const TYPE_##T *xr = x + b * sb + h * sh + t * st;                                             \
                    const int64_t row = (b * H + h) * Tn + t;                                                      \
                    TYPE_##T *yr = y + row * hs;                                                                   \
                    const float *cr = cos + t * half, *sr = sin + t * half;                                        \
                    const float rr = rms_inverse_##T(xr, hs, eps);                                                 \
                    r[row] = rr;                                                                                   \
                    for (int64_t i = 0; i < half; i++) {                                                           \
                        float a = LOAD_##T(xr, i), c = LOAD_##T(xr, i + half);                                     \
                        STORE_##T(yr, i, (a * cr[i] + c * sr[i]) * rr);                                            \
                        STORE_##T(yr, i + half, (c * cr[i] - a * sr[i]) * rr);                                     \
                    }                                                                                              \
                }                                                                                                  \
    }                                                                                                              \
    void gptforge_rope_rms_back_##T(const TYPE_##T *g, const TYPE_##T *x, const float *r, const float *cos,        \
                                    const float *sin, TYPE_##T *dx, int64_t B, int64_t H, int64_t Tn, int64_t hs,   \
                                    int64_t sb, int64_t sh, int64_t st, int64_t db, int64_t dh, int64_t dt) {       \
        const int64_t half = hs / 2;                                                                               \
        float u[1024];                                                                                             \
        for (int64_t b = 0; b < B; b++)                                                                            \
            for (int64_t h = 0; h < H; h++)                                                                        \
                for (int64_t t = 0; t < Tn; t++) {                                                                 \
                    const TYPE_##T *xr = x + b * sb + h * sh + t * st;                                             \
                    TYPE_##T *dr = dx + b * db + h * dh + t * dt;                                                  \
                    const int64_t row = (b * H + h) * Tn + t;                                                      \
                    const TYPE_##T *gr = g + row * hs;                                                             \
                    const float *cr = cos + t * half, *sr = sin + t * half;                                        \
                    for (int64_t i = 0; i < half; i++) {                                                           \
                        float p = LOAD_##T(gr, i), q = LOAD_##T(gr, i + half);                                     \
                        u[i] = p * cr[i] - q * sr[i];                                                              \
                        u[i + half] = q * cr[i] + p * sr[i];                                                       \
                    }                                                                                              \
                    float acc[RMS_LANES] = {0.0f};                                                                 \
                    int64_t i = 0;                                                                                 \
                    for (; i + RMS_LANES <= hs; i += RMS_LANES)                                                    \
                        for (int l = 0; l < RMS_LANES; l++) acc[l] += u[i + l] * LOAD_##T(xr, i + l);              \
                    for (; i < hs; i++) acc[0] += u[i] * LOAD_##T(xr, i);                                          \
                    float dot = 0.0f;                                                                              \
                    for (int l = 0; l < RMS_LANES; l++) dot += acc[l];                                             \
                    const float rr = r[row];                                                                       \
                    const float c = -rr * rr * rr * (dot / (float)hs);                                             \
                    for (i = 0; i < hs; i++) STORE_##T(dr, i, u[i] * rr + LOAD_##T(xr, i) * c);                    \
                }                                                                                                  \
    }

ROPE_RMS(f32)
ROPE_RMS(bf16)
