/* gptforge's compiled CPU kernels: dropout masks and their application (kernels/masks.py), a residual connection
 * with dropout (alone, or with the LayerNorm after it), a float32 + bf16 sum, RMSNorm (alone and after rotary),
 * LayerNorm into bf16 and relu(x)^2, forward and backward in one pass (kernels/norms.py, dropout.py, rotary.py,
 * activations.py), attention's causal softmax with dropout (kernels/attention.py), and a 16-bit transpose
 * (kernels/linear.py); kernels/native.py compiles this file
 * on first use and checks every function against torch's masks, torch's bits or float64 before using it. One
 * file, past the house's ~500 lines on purpose: one source is what native.py hashes, builds and caches, and the
 * kernels share its threading (IN_PARTS), its bf16 conversions and its AVX-512 helpers (FAST_ROWS).
 *
 * Dropout masks: keep[i] is lane i % 4 (16 bits, little-endian order) of word i / 4, read as a signed
 * 16-bit integer, compared with `threshold`; word j is SplitMix64's output for the state seed + (j + 1) * golden.
 * kernels/reference.py computes the same masks with torch operations (the reference and fallback); the loop
 * has no dependence between words, so the compiler vectorises it. */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* Threads: built with -fopenmp (kernels/native.py does where the compiler can and torch runs on libgomp), every
 * kernel splits its rows or elements across the OpenMP threads of the runtime torch itself runs on (the library
 * torch loaded answers to libgomp.so.1: one pool of threads, the ones torch's own operations use, never a second
 * one), as many as torch.get_num_threads() in the calling thread (omp_get_max_threads), fewer for small work
 * (MIN_PART_WORK elements a thread). Each part computes exactly what one thread computes for its rows: results do
 * not depend on the number of threads. Built without it, one thread. */
#define MIN_PART_WORK 32768

static inline int parts_for(int64_t work) {
#ifdef _OPENMP
    const int64_t most = omp_get_max_threads(), parts = work / MIN_PART_WORK;
    return (int)(parts < 1 ? 1 : parts < most ? parts : most);
#else
    (void)work;
    return 1;
#endif
}

/* this thread's share [*lo, *hi) of [first, last), bounds rounded to multiples of `align` (from first) */
static inline void part_bounds(int64_t first, int64_t last, int64_t align, int64_t *lo, int64_t *hi) {
#ifdef _OPENMP
    const int64_t k = omp_get_num_threads(), t = omp_get_thread_num(), units = (last - first + align - 1) / align;
    const int64_t a = first + units * t / k * align, b = first + units * (t + 1) / k * align;
#else
    const int64_t a = first, b = last;
#endif
    *lo = a < last ? a : last;
    *hi = b < last ? b : last;
}

/* BODY (which reads lo, hi) for the parts of [FIRST, LAST), one a thread */
#define IN_PARTS(FIRST, LAST, WORK, ALIGN, ...)                                                                    \
    do {                                                                                                           \
        const int64_t first_ = (FIRST), last_ = (LAST);                                                            \
        const int parts_ = parts_for(WORK);                                                                        \
        (void)parts_;                                                                                              \
        _Pragma("omp parallel num_threads(parts_) if (parts_ > 1)") {                                              \
            int64_t lo, hi;                                                                                        \
            part_bounds(first_, last_, (ALIGN), &lo, &hi);                                                         \
            __VA_ARGS__                                                                                            \
        }                                                                                                          \
    } while (0)

int gptforge_threads(void) { /* the threads a large kernel runs on here (1 without OpenMP) */
    return parts_for(INT64_MAX);
}

static inline uint64_t splitmix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

static inline void draw(uint8_t *restrict keep, int64_t start, int64_t n, uint64_t seed, int32_t threshold) {
    /* elements start .. start + n - 1 of the mask of seed into keep[0 .. n): from a word's first lane a word at a
     * time, then any others one by one */
    const uint64_t golden = 0x9e3779b97f4a7c15ULL;
    const int64_t words = start % 4 == 0 ? n / 4 : 0;
    for (int64_t j = 0; j < words; j++) {
        uint64_t w = splitmix64(seed + ((uint64_t)(start / 4 + j) + 1) * golden);
        keep[4 * j] = (int16_t)(uint16_t)w >= threshold;
        keep[4 * j + 1] = (int16_t)(uint16_t)(w >> 16) >= threshold;
        keep[4 * j + 2] = (int16_t)(uint16_t)(w >> 32) >= threshold;
        keep[4 * j + 3] = (int16_t)(uint16_t)(w >> 48) >= threshold;
    }
    for (int64_t j = 4 * words; j < n; j++) {
        uint64_t i = (uint64_t)(start + j);
        uint64_t w = splitmix64(seed + ((i >> 2) + 1) * golden);
        keep[j] = (int16_t)(uint16_t)(w >> (16 * (i & 3))) >= threshold;
    }
}

void gptforge_keep_mask(uint8_t *restrict keep, int64_t n, uint64_t seed, int32_t threshold) {
    IN_PARTS(0, n, n, 64, draw(keep + lo, lo, hi - lo, seed, threshold););
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

/* AVX-512 (F, BW, VL, DQ), where -march=native gives it: bf16 conversions, 32 mask elements at a time, and the
 * rows built on them (the residual dropout below, the causal softmax further down). Each does the portable loop's
 * operations in its order: the same bits (tests/test_native_simd.py). */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define FAST_ROWS 1
#include <immintrin.h>

static inline __m512 bf16x16_to_float(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline __m256i float16_to_bf16(__m512 f) { /* float_to_bf16 on 16 lanes */
    const __m512i u = _mm512_castps_si512(f);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
    return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0)));
}

static inline __mmask32 draw32(uint64_t seed, uint64_t word, int32_t threshold) {
    /* the keep bits of mask elements 4 word .. 4 word + 31: 8 words, their 16-bit lanes compared in order */
    const uint64_t golden = 0x9e3779b97f4a7c15ULL;
    if (threshold > INT16_MAX) return 0;
    __m512i z = _mm512_add_epi64(_mm512_set1_epi64((long long)(seed + (word + 1) * golden)),
                                 _mm512_mullo_epi64(_mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0),
                                                    _mm512_set1_epi64((long long)golden)));
    const __m512i mix1 = _mm512_set1_epi64((long long)0xbf58476d1ce4e5b9ULL);
    const __m512i mix2 = _mm512_set1_epi64((long long)0x94d049bb133111ebULL);
    z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 30)), mix1);
    z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 27)), mix2);
    z = _mm512_xor_si512(z, _mm512_srli_epi64(z, 31));
    return _mm512_cmpge_epi16_mask(z, _mm512_set1_epi16((int16_t)threshold));
}

static inline __mmask32 live32(int64_t i, int64_t seen) { /* lanes i .. i + 31 below seen */
    return i + 32 <= seen ? (__mmask32)0xffffffffu : i >= seen ? 0 : (__mmask32)((1ull << (seen - i)) - 1);
}

#else
#define FAST_ROWS 0
#endif

void gptforge_masked_bf16(const uint16_t *x, const uint8_t *restrict keep, uint16_t *out, int64_t n, float scale) {
    IN_PARTS(0, n, n, 64,
             for (int64_t i = lo; i < hi; i++) out[i] = float_to_bf16(bf16_to_float(x[i]) * (float)keep[i] * scale););
}

void gptforge_masked_f32(const float *x, const uint8_t *restrict keep, float *out, int64_t n, float scale) {
    IN_PARTS(0, n, n, 64, for (int64_t i = lo; i < hi; i++) out[i] = x[i] * (float)keep[i] * scale;);
}

/* The bf16 residual dropout's whole 32-element chunks of [lo, hi) (lo a multiple of 4) with AVX-512, the portable
 * loop's operations in its order: it returns where the portable loop goes on (docs/lab/2026-11-27-amx.md); the
 * backward, one product a value, gained nothing this way. */
#if FAST_ROWS
static int64_t residual_fast_bf16(const float *x, const uint16_t *y, uint8_t *keep, float *out, int64_t lo,
                                  int64_t hi, uint64_t seed, int32_t threshold, float scale) {
    const __m512 one = _mm512_set1_ps(1.0f), s = _mm512_set1_ps(scale);
    int64_t i = lo;
    for (; i + 32 <= hi; i += 32) {
        const __mmask32 kept = draw32(seed, (uint64_t)i / 4, threshold);
        _mm256_storeu_si256((__m256i *)(keep + i), _mm256_maskz_set1_epi8(kept, 1));
        for (int64_t c = i; c < i + 32; c += 16) {
            const __m512 k = _mm512_maskz_mov_ps((__mmask16)(kept >> (c - i)), one);
            const __m512 yc = bf16x16_to_float(_mm256_loadu_si256((const __m256i *)(y + c)));
            const __m512 v = _mm512_mul_ps(_mm512_mul_ps(yc, k), s);
            _mm512_storeu_ps(out + c, _mm512_add_ps(_mm512_loadu_ps(x + c), bf16x16_to_float(float16_to_bf16(v))));
        }
    }
    return i;
}

#define RESIDUAL_FAST_bf16(...) residual_fast_bf16(__VA_ARGS__)
#else
#define RESIDUAL_FAST_bf16(x, y, keep, out, lo, ...) (lo)
#endif
#define RESIDUAL_FAST_f32(x, y, keep, out, lo, ...) (lo)

/* A residual connection with dropout on its branch, x + dropout(y) (x float32, y bf16 or float32): the mask of
 * `seed` drawn as gptforge_keep_mask draws it (elements [0, n): the same mask as keep_mask's), y's masked value
 * rounded as gptforge_masked_* round it, then added to x in float32: the bits of torch's x + apply_mask(y, keep,
 * scale) in one pass instead of two. Its backward for y, from the float32 gradient g of the sum: g rounded to y's
 * type (torch's conversion, before the mask's gradient), then masked and scaled as gptforge_masked_*; x's gradient
 * is g itself. */
#define RESIDUAL_DROPOUT(T)                                                                                        \
    /* elements [lo, hi): AVX-512 chunks from a mask word's first lane, the rest portable */                      \
    static inline void residual_range_##T(const float *x, const TYPE_##T *y, uint8_t *keep, float *out, int64_t lo, \
                                          int64_t hi, uint64_t seed, int32_t threshold, float scale) {            \
        const int64_t done = lo % 4 ? lo : RESIDUAL_FAST_##T(x, y, keep, out, lo, hi, seed, threshold, scale);    \
        draw(keep + done, done, hi - done, seed, threshold);                                                       \
        for (int64_t i = done; i < hi; i++) out[i] = x[i] + ROUND_##T(LOAD_##T(y, i) * (float)keep[i] * scale);    \
    }                                                                                                              \
    void gptforge_residual_dropout_##T(const float *x, const TYPE_##T *y, uint8_t *keep, float *out, int64_t n,    \
                                       uint64_t seed, int32_t threshold, float scale) {                           \
        IN_PARTS(0, n, n, 64, residual_range_##T(x, y, keep, out, lo, hi, seed, threshold, scale););               \
    }                                                                                                              \
    void gptforge_residual_dropout_back_##T(const float *g, const uint8_t *keep, TYPE_##T *dy, int64_t n,          \
                                            float scale) {                                                         \
        IN_PARTS(0, n, n, 64,                                                                                      \
                 for (int64_t i = lo; i < hi; i++) STORE_##T(dy, i, ROUND_##T(g[i]) * (float)keep[i] * scale););    \
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
#define ROUND_f32(v) (v) /* a float32 value rounded to the type, as a float */
#define ROUND_bf16(v) bf16_to_float(float_to_bf16(v))

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
        IN_PARTS(first, last, (last - first) * n, 1, for (int64_t row = lo; row < hi; row++) {                  \
            const TYPE_##TX *xr = x + row * n;                                                                  \
            TYPE_##TY *yr = y + row * n;                                                                        \
            float rr = rms_inverse_##TX(xr, n, eps);                                                            \
            r[row] = rr;                                                                                        \
            for (int64_t i = 0; i < n; i++) STORE_##TY(yr, i, LOAD_##TX(xr, i) * rr);                           \
        });                                                                                                     \
    }

#define RMS_BACKWARD(TG, TX)                                                                                    \
    void gptforge_rms_back_##TG##_##TX(const TYPE_##TG *g, const TYPE_##TX *x, const float *r, TYPE_##TX *dx,  \
                                       int64_t first, int64_t last, int64_t n) {                                \
        IN_PARTS(first, last, (last - first) * n, 1, for (int64_t row = lo; row < hi; row++) {                  \
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
        });                                                                                                     \
    }

/* LayerNorm over rows of n, float32 in, bf16 out: a block's norm under bf16 autocast, whose output feeds only a
 * Linear that would round torch's float32 output to bf16 itself (kernels/norms.py, LayerNorm). Per row: the mean,
 * then the variance about it (both in RMS_LANES float32 partial sums, then in order; biased, as torch's), kept
 * with r = 1 / sqrt(var + eps) for backward; y = (x - mean) r w + b rounded once to bf16 (b may be NULL). The
 * backward reads the bf16 gradient g of y: dx = r (gw - mean(gw) - xhat mean(gw xhat)) in float32, gw = g w,
 * xhat = (x - mean) r, and the weight's and the bias's gradients dw = sum g xhat, db = sum g over the rows: each
 * LN_CHUNK rows' sums in their own row of `partial` (ceil(rows / LN_CHUNK) x 2 x n floats of scratch), then the
 * chunks' in order, so that no sum depends on the number of threads. One read of each row forward and one
 * backward (the second pass over a row hits the core's cache), where torch's operations pass over the whole
 * tensor, with the conversions to and from bf16 around them, four times each way. */
#define LN_CHUNK 128

/* one row of the forward: statistics into *mean, *rstd, the normalised row into yr */
static inline void layer_norm_row(const float *xr, const float *w, const float *b, uint16_t *yr, float *mean,
                                  float *rstd, int64_t n, float eps) {
    float acc[RMS_LANES] = {0.0f};
    int64_t i = 0;
    for (; i + RMS_LANES <= n; i += RMS_LANES)
        for (int l = 0; l < RMS_LANES; l++) acc[l] += xr[i + l];
    for (; i < n; i++) acc[0] += xr[i];
    float sum = 0.0f;
    for (int l = 0; l < RMS_LANES; l++) sum += acc[l];
    const float m = sum / (float)n;
    float sq[RMS_LANES] = {0.0f};
    for (i = 0; i + RMS_LANES <= n; i += RMS_LANES)
        for (int l = 0; l < RMS_LANES; l++) sq[l] += (xr[i + l] - m) * (xr[i + l] - m);
    for (; i < n; i++) sq[0] += (xr[i] - m) * (xr[i] - m);
    float var = 0.0f;
    for (int l = 0; l < RMS_LANES; l++) var += sq[l];
    const float r = 1.0f / sqrtf(var / (float)n + eps);
    *mean = m;
    *rstd = r;
    if (b != NULL)
        for (i = 0; i < n; i++) yr[i] = float_to_bf16((xr[i] - m) * r * w[i] + b[i]);
    else
        for (i = 0; i < n; i++) yr[i] = float_to_bf16((xr[i] - m) * r * w[i]);
}

void gptforge_layer_norm_f32_bf16(const float *x, const float *w, const float *b, uint16_t *y, float *mean,
                                  float *rstd, int64_t rows, int64_t n, float eps) {
    IN_PARTS(0, rows, rows * n, 1, for (int64_t row = lo; row < hi; row++) {
        layer_norm_row(x + row * n, w, b, y + row * n, mean + row, rstd + row, n, eps);
    });
}

/* one row of the backward: x's gradient into dr, the row's shares of the weight's and the bias's into pw, pb */
static inline void layer_norm_back_row(const uint16_t *gr, const float *xr, const float *w, float m, float r, float *dr,
                                       float *pw, float *pb, int64_t n) {
    float a[RMS_LANES] = {0.0f}, c[RMS_LANES] = {0.0f};
    int64_t i = 0;
    for (; i + RMS_LANES <= n; i += RMS_LANES)
        for (int l = 0; l < RMS_LANES; l++) {
            const float gw = bf16_to_float(gr[i + l]) * w[i + l];
            a[l] += gw;
            c[l] += gw * ((xr[i + l] - m) * r);
        }
    for (; i < n; i++) {
        const float gw = bf16_to_float(gr[i]) * w[i];
        a[0] += gw;
        c[0] += gw * ((xr[i] - m) * r);
    }
    float sa = 0.0f, sc = 0.0f;
    for (int l = 0; l < RMS_LANES; l++) {
        sa += a[l];
        sc += c[l];
    }
    const float ma = sa / (float)n, mc = sc / (float)n;
    for (i = 0; i < n; i++) {
        const float gv = bf16_to_float(gr[i]), xhat = (xr[i] - m) * r;
        dr[i] = r * (gv * w[i] - ma - xhat * mc);
        pw[i] += gv * xhat;
        pb[i] += gv;
    }
}

/* the weight's and the bias's gradients: each LN_CHUNK rows' sums, then the chunks' in order (any number of threads
 * gives the same sums) */
static void layer_norm_sums(const float *partial, float *dw, float *db, int64_t rows, int64_t n) {
    for (int64_t i = 0; i < n; i++) dw[i] = db[i] = 0.0f;
    for (int64_t chunk = 0; chunk * LN_CHUNK < rows; chunk++)
        for (int64_t i = 0; i < n; i++) {
            dw[i] += partial[chunk * 2 * n + i];
            db[i] += partial[chunk * 2 * n + n + i];
        }
}

/* this row's chunk of `partial` (zeroed at the chunk's first row) */
static inline float *layer_norm_partial(float *partial, int64_t row, int64_t n) {
    float *pw = partial + row / LN_CHUNK * 2 * n;
    if (row % LN_CHUNK == 0)
        for (int64_t i = 0; i < 2 * n; i++) pw[i] = 0.0f;
    return pw;
}

void gptforge_layer_norm_back_bf16_f32(const uint16_t *g, const float *x, const float *w, const float *mean,
                                       const float *rstd, float *dx, float *dw, float *db, float *partial,
                                       int64_t rows, int64_t n) {
    IN_PARTS(0, rows, rows * n, LN_CHUNK, for (int64_t row = lo; row < hi; row++) {
        float *pw = layer_norm_partial(partial, row, n);
        layer_norm_back_row(g + row * n, x + row * n, w, mean[row], rstd[row], dx + row * n, pw, pw + n, n);
    });
    layer_norm_sums(partial, dw, db, rows, n);
}

RESIDUAL_DROPOUT(f32)
RESIDUAL_DROPOUT(bf16)

/* A residual connection with dropout and the LayerNorm after it (x + dropout(attn(...)) then ln_2; + dropout(mlp(...))
 * then the next block's ln_1 or ln_f), x float32 and the branch y bf16: each row's sum s written and normalised into
 * h while it is in cache, rows split across threads (whole rows, so the mask's words as in one call). The bits of
 * gptforge_residual_dropout_bf16 then gptforge_layer_norm_f32_bf16, one pass over the rows instead of two. The
 * backward takes h's gradient gh and s's own gs (the next residual's, NULL where s has none): s's whole gradient, gs
 * plus the norm's (the sum autograd takes), is x's gradient, and masked as gptforge_residual_dropout_back_bf16
 * masks it, y's; the norm's weight and bias gradients as gptforge_layer_norm_back_bf16_f32's. Three passes of
 * torch and the kernels above (the norm's backward, autograd's sum, the mask's) in one. */
void gptforge_add_norm_bf16(const float *x, const uint16_t *y, uint8_t *keep, float *s, const float *w, const float *b,
                            uint16_t *h, float *mean, float *rstd, int64_t rows, int64_t n, uint64_t seed,
                            int32_t threshold, float scale, float eps) {
    IN_PARTS(0, rows, rows * n, 1, for (int64_t row = lo; row < hi; row++) {
        residual_range_bf16(x, y, keep, s, row * n, row * n + n, seed, threshold, scale);
        layer_norm_row(s + row * n, w, b, h + row * n, mean + row, rstd + row, n, eps);
    });
}

void gptforge_add_norm_back_bf16(const uint16_t *gh, const float *gs, const float *s, const float *w,
                                 const float *mean, const float *rstd, const uint8_t *keep, float *dx, uint16_t *dy,
                                 float *dw, float *db, float *partial, int64_t rows, int64_t n, float scale) {
    IN_PARTS(0, rows, rows * n, LN_CHUNK, for (int64_t row = lo; row < hi; row++) {
        const int64_t first = row * n;
        float *pw = layer_norm_partial(partial, row, n), *dr = dx + first;
        layer_norm_back_row(gh + first, s + first, w, mean[row], rstd[row], dr, pw, pw + n, n);
        if (gs != NULL)
            for (int64_t i = 0; i < n; i++) dr[i] += gs[first + i];
        for (int64_t i = 0; i < n; i++)
            dy[first + i] = float_to_bf16(ROUND_bf16(dr[i]) * (float)keep[first + i] * scale);
    });
    layer_norm_sums(partial, dw, db, rows, n);
}

/* A residual connection without dropout under autocast, x + y with the stream x float32 and the branch y bf16, in
 * one pass: torch's sum converts y into a float32 copy first. The same bits (y's value is exact in float32). */
void gptforge_add_bf16(const float *x, const uint16_t *y, float *out, int64_t n) {
    IN_PARTS(0, n, n, 64, for (int64_t i = lo; i < hi; i++) out[i] = x[i] + bf16_to_float(y[i]););
}

/* relu(x)^2, the MLP's activation in the modern recipe (model/gpt.py SquaredReLU), and its gradient, one pass each
 * way in x's type: h = r r with r = relu(x) (x < 0 ? 0 : x: -0 and NaN stay, as torch's relu leaves them), rounded
 * once; dx = 2 (g r), g r rounded to the type first. The bits of torch's `r * r` and `(g * r).mul_(2)`, which take
 * two passes each way and keep r; the backward recomputes r from x. */
#define RELU2(T)                                                                                                   \
    void gptforge_relu2_##T(const TYPE_##T *x, TYPE_##T *h, int64_t n) {                                          \
        IN_PARTS(0, n, n, 64, for (int64_t i = lo; i < hi; i++) {                                                 \
            const float v = LOAD_##T(x, i), r = v < 0.0f ? 0.0f : v;                                               \
            STORE_##T(h, i, r * r);                                                                                \
        });                                                                                                        \
    }                                                                                                              \
    void gptforge_relu2_back_##T(const TYPE_##T *g, const TYPE_##T *x, TYPE_##T *dx, int64_t n) {                 \
        IN_PARTS(0, n, n, 64, for (int64_t i = lo; i < hi; i++) {                                                 \
            const float v = LOAD_##T(x, i), r = v < 0.0f ? 0.0f : v;                                               \
            STORE_##T(dx, i, ROUND_##T(LOAD_##T(g, i) * r) * 2.0f);                                                \
        });                                                                                                        \
    }

RELU2(f32)
RELU2(bf16)

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
/* the next row's (batch, head, position), from the row before it (t starts one before a part's first row) */
#define NEXT_ROW(b, h, t, H, Tn)                                                                                   \
    if (++(t) == (Tn)) {                                                                                           \
        (t) = 0;                                                                                                   \
        if (++(h) == (H)) (h) = 0, (b)++;                                                                          \
    }
#define ROPE_RMS(T)                                                                                                \
    void gptforge_rope_rms_##T(const TYPE_##T *x, TYPE_##T *y, float *r, const float *cos, const float *sin,       \
                               int64_t B, int64_t H, int64_t Tn, int64_t hs, int64_t sb, int64_t sh, int64_t st,    \
                               float eps) {                                                                        \
        const int64_t half = hs / 2;                                                                               \
        IN_PARTS(0, B * H * Tn, B * H * Tn * hs, 1, int64_t b = lo / (H * Tn), h = lo / Tn % H, t = lo % Tn - 1;  \
                 for (int64_t row = lo; row < hi; row++) {                                                         \
                    NEXT_ROW(b, h, t, H, Tn);                                                                      \
                    const TYPE_##T *xr = x + b * sb + h * sh + t * st;                                             \
                    TYPE_##T *yr = y + row * hs;                                                                   \
                    const float *cr = cos + t * half, *sr = sin + t * half;                                        \
                    const float rr = rms_inverse_##T(xr, hs, eps);                                                 \
                    r[row] = rr;                                                                                   \
                    for (int64_t i = 0; i < half; i++) {                                                           \
                        float a = LOAD_##T(xr, i), c = LOAD_##T(xr, i + half);                                     \
                        STORE_##T(yr, i, (a * cr[i] + c * sr[i]) * rr);                                            \
                        STORE_##T(yr, i + half, (c * cr[i] - a * sr[i]) * rr);                                     \
                    }                                                                                              \
                });                                                                                                \
    }                                                                                                              \
    void gptforge_rope_rms_back_##T(const TYPE_##T *g, const TYPE_##T *x, const float *r, const float *cos,        \
                                    const float *sin, TYPE_##T *dx, int64_t B, int64_t H, int64_t Tn, int64_t hs,   \
                                    int64_t sb, int64_t sh, int64_t st, int64_t db, int64_t dh, int64_t dt) {       \
        const int64_t half = hs / 2;                                                                               \
        IN_PARTS(0, B * H * Tn, B * H * Tn * hs, 1, float u[1024];                                                 \
                 int64_t b = lo / (H * Tn), h = lo / Tn % H, t = lo % Tn - 1;                                      \
                 for (int64_t row = lo; row < hi; row++) {                                                         \
                    NEXT_ROW(b, h, t, H, Tn);                                                                      \
                    const TYPE_##T *xr = x + b * sb + h * sh + t * st;                                             \
                    TYPE_##T *dr = dx + b * db + h * dh + t * dt;                                                  \
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
                });                                                                                                \
    }

ROPE_RMS(f32)
ROPE_RMS(bf16)

/* Causal softmax with dropout, for attention's query blocks in training (kernels/attention.py, CausalBlocks): rows
 * [first, last) of scores (n, cols), contiguous, in blocks of `rows` queries that are the last `rows` of `cols`
 * positions, so row i of a block sees keys 0 .. cols - rows + i (the others get probability 0, as softmax gives the
 * -inf of the causal rule). Per row, in float32: the maximum (on float_order's integers, which vectorise), e =
 * exp(s - max) in a row buffer with its sum in RMS_LANES partial sums, probs = e * (1 / sum) rounded once (probs
 * may be s: each row is read whole before it is written); the row's dropout mask drawn as gptforge_keep_mask draws
 * element row * cols + j of the mask of `seed` (the same mask as keep_mask's over the whole tensor), and att =
 * probs where kept, 0 elsewhere. One read of the scores and one write of each output, where torch's operations
 * take three passes (softmax, draw, the mask's application). The backward, in one pass over a row (torch's: two):
 * ds = probs (d' - sum(probs d')), d' = d where kept, 0 elsewhere; ds may be d. Callers split the rows across
 * threads (each with its own buffer e). */
static inline float exp_nonpositive(float x) {
    /* e^x for x <= 0 within ~2 float32 ulps, 0 below -87 (e^-87 ~ 1.6e-38): x = n ln2 + r with |r| <= ln2 / 2
     * (n rounded by adding and subtracting 1.5 * 2^23; ln2 in two parts), e^r by a degree-7 polynomial (Cephes'
     * coefficients), 2^n written into the exponent bits. Plain arithmetic: the compiler vectorises its loops. */
    const float big = 12582912.0f;
    const float n = (x * 1.44269504088896341f + big) - big;
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    const float y = ((((((1.9875691500e-4f * r + 1.3981999507e-3f) * r + 8.3334519073e-3f) * r + 4.1665795894e-2f) *
                            r + 1.6666665459e-1f) * r + 5.0000001201e-1f) * (r * r) + r) + 1.0f;
    union { uint32_t u; float f; } two_n;
    two_n.u = (uint32_t)((int32_t)n + 127) << 23;
    return x < -87.0f ? 0.0f : y * two_n.f;
}

/* a float's bits as an int32 that orders as the floats do (negative values' magnitude bits flipped), and back:
 * integer maxima vectorise where float ones (NaN's rules) do not */
static inline int32_t float_order(float f) {
    union { float f; int32_t i; } v = {f};
    return v.i ^ ((v.i >> 31) & 0x7fffffff);
}

static inline float order_float(int32_t k) {
    union { int32_t i; float f; } v = {k ^ ((k >> 31) & 0x7fffffff)};
    return v.f;
}

/* The bf16 causal softmax's rows with AVX-512 (F, BW, VL, DQ: where -march=native gives them), for rows whose
 * width is a multiple of 32 (attention's blocks): the same operations as the portable loops in the same order, so
 * the same bits (the load-time check covers such a width; tests/test_native_simd.py compares the library
 * built without AVX-512 bit for bit), in 512-bit registers that the compiler's own vectorisation of those loops
 * (256-bit, one draw at a time) does not reach: the maximum on bf16's ordered integers 32 at a time, reduced in
 * registers; e^x with scalef for the 2^n; 8 mask words at a time (draw32), their comparison giving the kept lanes
 * as a bit mask that both the mask bytes and att use; the dot product of the backward in 16 lanes
 * (docs/lab/2026-11-27-amx.md). */
#if FAST_ROWS
#define SOFTMAX_FAST_bf16(cols) ((cols) % 32 == 0)

static inline __m512 exp16(__m512 x) { /* exp_nonpositive on 16 lanes (no fused multiply-adds: neither has) */
    const __m512 big = _mm512_set1_ps(12582912.0f);
    const __m512 n = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), big), big);
    const __m512 r = _mm512_add_ps(_mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f))),
                                   _mm512_mul_ps(n, _mm512_set1_ps(2.12194440e-4f)));
    __m512 y = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(1.9875691500e-4f), r), _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_add_ps(_mm512_mul_ps(y, r), _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_add_ps(_mm512_mul_ps(y, r), _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_add_ps(_mm512_mul_ps(y, r), _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_add_ps(_mm512_mul_ps(y, r), _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(y, _mm512_mul_ps(r, r)), r), _mm512_set1_ps(1.0f));
    const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
    return _mm512_maskz_scalef_ps((__mmask16)~tiny, y, n); /* y 2^n: n is a whole number */
}

static void softmax_row_fast_bf16(const uint16_t *sr, uint16_t *pr, uint16_t *ar, uint8_t *kr, float *e, int64_t seen,
                                  int64_t cols, int64_t start, uint64_t seed, int32_t threshold) {
    const int64_t up = (seen + 15) / 16 * 16;
    __m512i most = _mm512_set1_epi16(INT16_MIN); /* float_order on bf16's 16 bits orders as on the float's 32 */
    for (int64_t i = 0; i < seen; i += 32) {
        const __mmask32 live = live32(i, seen);
        const __m512i v = _mm512_maskz_loadu_epi16(live, sr + i);
        const __m512i o = _mm512_xor_si512(v, _mm512_and_si512(_mm512_srai_epi16(v, 15), _mm512_set1_epi16(0x7fff)));
        most = _mm512_mask_max_epi16(most, live, most, o);
    }
    __m256i m16 = _mm256_max_epi16(_mm512_castsi512_si256(most), _mm512_extracti64x4_epi64(most, 1));
    __m128i m8 = _mm_max_epi16(_mm256_castsi256_si128(m16), _mm256_extracti128_si256(m16, 1));
    m8 = _mm_max_epi16(m8, _mm_srli_si128(m8, 8));
    m8 = _mm_max_epi16(m8, _mm_srli_si128(m8, 4));
    m8 = _mm_max_epi16(m8, _mm_srli_si128(m8, 2));
    const int16_t top = (int16_t)_mm_extract_epi16(m8, 0);
    const __m512 m = _mm512_set1_ps(bf16_to_float((uint16_t)(top ^ ((top >> 15) & 0x7fff))));
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < up; i += 16) {
        const __mmask16 live = (__mmask16)live32(i, seen);
        const __m512 s = bf16x16_to_float(_mm256_loadu_si256((const __m256i *)(sr + i)));
        const __m512 ex = exp16(_mm512_mask_blend_ps(live, _mm512_set1_ps(-INFINITY), _mm512_sub_ps(s, m)));
        _mm512_storeu_ps(e + i, ex);
        acc = _mm512_add_ps(acc, ex);
    }
    float lanes[16];
    _mm512_storeu_ps(lanes, acc);
    float sum = 0.0f;
    for (int l = 0; l < 16; l++) sum += lanes[l];
    const __m512 inverse = _mm512_set1_ps(1.0f / sum);
    const __m256i nan = _mm256_set1_epi16(0x7fc0);
    for (int64_t i = 0; i < cols; i += 32) {
        const __mmask32 kept = draw32(seed, (uint64_t)(start + i) / 4, threshold);
        _mm256_storeu_si256((__m256i *)(kr + i), _mm256_maskz_set1_epi8(kept, 1));
        for (int64_t c = i; c < i + 32; c += 16) {
            const __mmask16 k = (__mmask16)(kept >> (c - i));
            const __m256i p =
                c < up ? float16_to_bf16(_mm512_mul_ps(_mm512_loadu_ps(e + c), inverse)) : _mm256_setzero_si256();
            _mm256_storeu_si256((__m256i *)(pr + c), p);
            /* probs * keep: p where kept, 0 where not, but a dropped NaN stays NaN */
            const __mmask16 dropped_nan = (__mmask16)(~k & _mm256_cmpeq_epi16_mask(p, nan));
            const __m256i a = _mm256_mask_mov_epi16(_mm256_maskz_mov_epi16(k, p), dropped_nan, nan);
            _mm256_storeu_si256((__m256i *)(ar + c), a);
        }
    }
}

static void softmax_back_row_fast_bf16(const uint16_t *dr, const uint8_t *kr, const uint16_t *pr, uint16_t *out,
                                       int64_t seen, int64_t cols) {
    const __m512 one = _mm512_set1_ps(1.0f);
    __m512 acc = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= seen; i += 16) {
        const __m128i k = _mm_loadu_si128((const __m128i *)(kr + i));
        const __m512 d = _mm512_mul_ps(bf16x16_to_float(_mm256_loadu_si256((const __m256i *)(dr + i))),
                                       _mm512_maskz_mov_ps(_mm_test_epi8_mask(k, k), one));
        acc = _mm512_add_ps(acc, _mm512_mul_ps(bf16x16_to_float(_mm256_loadu_si256((const __m256i *)(pr + i))), d));
    }
    float lanes[16];
    _mm512_storeu_ps(lanes, acc);
    for (; i < seen; i++) lanes[0] += bf16_to_float(pr[i]) * (bf16_to_float(dr[i]) * (float)kr[i]);
    float dot = 0.0f;
    for (int l = 0; l < 16; l++) dot += lanes[l];
    const __m512 vdot = _mm512_set1_ps(dot);
    for (i = 0; i < cols; i += 16) {
        const __mmask16 live = (__mmask16)live32(i, seen);
        const __m128i k = _mm_loadu_si128((const __m128i *)(kr + i));
        const __m512 d = _mm512_mul_ps(bf16x16_to_float(_mm256_loadu_si256((const __m256i *)(dr + i))),
                                       _mm512_maskz_mov_ps(_mm_test_epi8_mask(k, k), one));
        const __m512 v = _mm512_mul_ps(bf16x16_to_float(_mm256_loadu_si256((const __m256i *)(pr + i))),
                                       _mm512_sub_ps(d, vdot));
        _mm256_storeu_si256((__m256i *)(out + i), _mm256_maskz_mov_epi16(live, float16_to_bf16(v)));
    }
}
#define SOFTMAX_FAST_ROW_bf16(...) softmax_row_fast_bf16(__VA_ARGS__)
#define SOFTMAX_FAST_BACK_ROW_bf16(...) softmax_back_row_fast_bf16(__VA_ARGS__)
#else
#define SOFTMAX_FAST_bf16(cols) 0
#define SOFTMAX_FAST_ROW_bf16(...) (void)0
#define SOFTMAX_FAST_BACK_ROW_bf16(...) (void)0
#endif
#define SOFTMAX_FAST_f32(cols) 0
#define SOFTMAX_FAST_ROW_f32(...) (void)0
#define SOFTMAX_FAST_BACK_ROW_f32(...) (void)0

int gptforge_fast_rows(void) { /* 1 where the AVX-512 paths are built in */
    return FAST_ROWS;
}

#define CAUSAL_SOFTMAX(T)                                                                                          \
    void gptforge_causal_softmax_##T(const TYPE_##T *s, TYPE_##T *probs, TYPE_##T *att, uint8_t *keep,             \
                                     int64_t first, int64_t last, int64_t rows, int64_t cols, uint64_t seed,       \
                                     int32_t threshold, int32_t *failed) {                                         \
        IN_PARTS(first, last, (last - first) * cols, 1, float *e = malloc(sizeof(float) * (size_t)cols);           \
        if (e == NULL) { *failed = 1; lo = hi; }                                                                   \
        for (int64_t row = lo; row < hi; row++) {                                                                 \
            const int64_t seen = cols - rows + row % rows + 1;                                                     \
            const TYPE_##T *sr = s + row * cols;                                                                   \
            TYPE_##T *pr = probs + row * cols;                                                                     \
            if (SOFTMAX_FAST_##T(cols)) {                                                                          \
                SOFTMAX_FAST_ROW_##T(sr, pr, att + row * cols, keep + row * cols, e, seen, cols, row * cols, seed,  \
                                     threshold);                                                                   \
                continue;                                                                                          \
            }                                                                                                      \
            /* [0, vec): whole RMS_LANES chunks up to seen rounded up (lanes past seen masked), then one by one */    \
            const int64_t whole = cols - cols % RMS_LANES, up = (seen + RMS_LANES - 1) / RMS_LANES * RMS_LANES;    \
            const int64_t vec = up < whole ? up : whole;                                                           \
            int32_t most[RMS_LANES];                                                                               \
            float acc[RMS_LANES] = {0.0f};                                                                         \
            for (int l = 0; l < RMS_LANES; l++) most[l] = INT32_MIN;                                               \
            int64_t i;                                                                                             \
            for (i = 0; i + RMS_LANES <= seen; i += RMS_LANES)                                                     \
                for (int l = 0; l < RMS_LANES; l++) {                                                              \
                    int32_t v = float_order(LOAD_##T(sr, i + l));                                                  \
                    most[l] = v > most[l] ? v : most[l];                                                           \
                }                                                                                                  \
            if (i < vec)                                                                                           \
                for (int l = 0; l < RMS_LANES; l++) {                                                              \
                    int32_t v = float_order(LOAD_##T(sr, i + l));                                                  \
                    most[l] = i + l < seen && v > most[l] ? v : most[l];                                           \
                }                                                                                                  \
            i = i < vec ? vec : i;                                                                                 \
            for (; i < seen; i++) {                                                                                \
                int32_t v = float_order(LOAD_##T(sr, i));                                                          \
                most[0] = v > most[0] ? v : most[0];                                                               \
            }                                                                                                      \
            int32_t top = most[0];                                                                                 \
            for (int l = 1; l < RMS_LANES; l++) top = most[l] > top ? most[l] : top;                               \
            const float m = order_float(top);                                                                      \
            for (i = 0; i + RMS_LANES <= seen; i += RMS_LANES)                                                     \
                for (int l = 0; l < RMS_LANES; l++) {                                                              \
                    e[i + l] = exp_nonpositive(LOAD_##T(sr, i + l) - m);                                           \
                    acc[l] += e[i + l];                                                                            \
                }                                                                                                  \
            if (i < vec)                                                                                           \
                for (int l = 0; l < RMS_LANES; l++) {                                                              \
                    float v = LOAD_##T(sr, i + l) - m;                                                             \
                    e[i + l] = exp_nonpositive(i + l < seen ? v : -INFINITY);                                      \
                    acc[l] += e[i + l];                                                                            \
                }                                                                                                  \
            i = i < vec ? vec : i;                                                                                 \
            for (; i < seen; i++) {                                                                                \
                e[i] = exp_nonpositive(LOAD_##T(sr, i) - m);                                                       \
                acc[0] += e[i];                                                                                    \
            }                                                                                                      \
            float sum = 0.0f;                                                                                      \
            for (int l = 0; l < RMS_LANES; l++) sum += acc[l];                                                     \
            const float inverse = 1.0f / sum;                                                                      \
            const int64_t filled = vec > seen ? vec : seen; /* e is 0 from seen on */                              \
            for (i = 0; i < filled; i++) STORE_##T(pr, i, e[i] * inverse);                                        \
            for (; i < cols; i++) STORE_##T(pr, i, 0.0f);                                                         \
            uint8_t *kr = keep + row * cols;                                                                       \
            TYPE_##T *ar = att + row * cols;                                                                       \
            draw(kr, row * cols, cols, seed, threshold);                                                       \
            for (i = 0; i < cols; i++) STORE_##T(ar, i, LOAD_##T(pr, i) * (float)kr[i]);                          \
        } free(e););                                                                                               \
    }                                                                                                              \
    void gptforge_causal_softmax_back_##T(const TYPE_##T *d, const uint8_t *keep, const TYPE_##T *probs,           \
                                          TYPE_##T *ds, int64_t first, int64_t last, int64_t rows, int64_t cols) { \
        IN_PARTS(first, last, (last - first) * cols, 1, for (int64_t row = lo; row < hi; row++) {                  \
            const int64_t seen = cols - rows + row % rows + 1;                                                     \
            const TYPE_##T *dr = d + row * cols, *pr = probs + row * cols;                                         \
            const uint8_t *kr = keep + row * cols;                                                                 \
            TYPE_##T *out = ds + row * cols;                                                                       \
            if (SOFTMAX_FAST_##T(cols)) {                                                                          \
                SOFTMAX_FAST_BACK_ROW_##T(dr, kr, pr, out, seen, cols);                                            \
                continue;                                                                                          \
            }                                                                                                      \
            float acc[RMS_LANES] = {0.0f};                                                                         \
            int64_t i = 0;                                                                                         \
            for (; i + RMS_LANES <= seen; i += RMS_LANES)                                                          \
                for (int l = 0; l < RMS_LANES; l++)                                                                \
                    acc[l] += LOAD_##T(pr, i + l) * (LOAD_##T(dr, i + l) * (float)kr[i + l]);                      \
            for (; i < seen; i++) acc[0] += LOAD_##T(pr, i) * (LOAD_##T(dr, i) * (float)kr[i]);                    \
            float dot = 0.0f;                                                                                      \
            for (int l = 0; l < RMS_LANES; l++) dot += acc[l];                                                     \
            for (i = 0; i < seen; i++) STORE_##T(out, i, LOAD_##T(pr, i) * (LOAD_##T(dr, i) * (float)kr[i] - dot)); \
            for (i = seen; i < cols; i++) STORE_##T(out, i, 0.0f);                                                 \
        });                                                                                                        \
    }

CAUSAL_SOFTMAX(f32)
CAUSAL_SOFTMAX(bf16)

/* A 16-bit matrix transposed: dst (cols, rows) = src (rows, cols)^T, both contiguous, the rows split across
 * threads in multiples of 32 (kernels/linear.py: the weight's gradient of a layer whose output is narrow is the
 * product of the output's gradient transposed and the input, which oneDNN computes at twice the rate from a
 * contiguous transposed copy). With AVX-512 (FAST_ROWS) 32 x 32 tiles, a row of 32 per register, in five rounds
 * of two-register permutes (round s pairs rows h = 16 >> s apart and swaps their h-wide blocks); elsewhere the
 * same tiles element by element. A copy: the same values either way. */
#if FAST_ROWS
#define PICK_LO(j, h) (((j) & (h)) ? 32 + (j) - (h) : (j)) /* round h's lanes from the first row of a pair */
#define PICK_HI(j, h) (((j) & (h)) ? 32 + (j) : (j) + (h))   /* and from the second */
#define PICKS(P, h)                                                                                                \
    {P(0, h),  P(1, h),  P(2, h),  P(3, h),  P(4, h),  P(5, h),  P(6, h),  P(7, h),  P(8, h),  P(9, h),  P(10, h), \
     P(11, h), P(12, h), P(13, h), P(14, h), P(15, h), P(16, h), P(17, h), P(18, h), P(19, h), P(20, h), P(21, h), \
     P(22, h), P(23, h), P(24, h), P(25, h), P(26, h), P(27, h), P(28, h), P(29, h), P(30, h), P(31, h)}
static const uint16_t TILE_LO[5][32] = {PICKS(PICK_LO, 16), PICKS(PICK_LO, 8), PICKS(PICK_LO, 4), PICKS(PICK_LO, 2),
                                        PICKS(PICK_LO, 1)};
static const uint16_t TILE_HI[5][32] = {PICKS(PICK_HI, 16), PICKS(PICK_HI, 8), PICKS(PICK_HI, 4), PICKS(PICK_HI, 2),
                                        PICKS(PICK_HI, 1)};

static inline void transpose_tile(const uint16_t *src, uint16_t *dst, int64_t rows, int64_t cols) {
    __m512i t[32]; /* fully unrolled, the tile stays in the 32 registers */
#pragma GCC unroll 32
    for (int i = 0; i < 32; i++) t[i] = _mm512_loadu_si512(src + i * cols);
#pragma GCC unroll 5
    for (int s = 0; s < 5; s++) {
        const int h = 16 >> s;
        const __m512i l = _mm512_loadu_si512(TILE_LO[s]), u = _mm512_loadu_si512(TILE_HI[s]);
#pragma GCC unroll 32
        for (int i = 0; i < 32; i++) {
            if (i & h) continue;
            const __m512i a = _mm512_permutex2var_epi16(t[i], l, t[i + h]);
            const __m512i b = _mm512_permutex2var_epi16(t[i], u, t[i + h]);
            t[i] = a;
            t[i + h] = b;
        }
    }
#pragma GCC unroll 32
    for (int i = 0; i < 32; i++) _mm512_storeu_si512(dst + i * rows, t[i]);
}
#else
static inline void transpose_tile(const uint16_t *src, uint16_t *dst, int64_t rows, int64_t cols) {
    for (int i = 0; i < 32; i++)
        for (int j = 0; j < 32; j++) dst[j * rows + i] = src[i * cols + j];
}
#endif

void gptforge_transpose16(const uint16_t *src, uint16_t *dst, int64_t rows, int64_t cols) {
    IN_PARTS(0, rows, rows * cols, 32, {
        const int64_t whole = lo + (hi - lo) / 32 * 32, wide = cols / 32 * 32;
        for (int64_t band = lo; band < whole; band += 256) /* 8 tiles down, then across: dst's rows written on */
            for (int64_t c = 0; c < wide; c += 32)
                for (int64_t r = band; r < whole && r < band + 256; r += 32)
                    transpose_tile(src + r * cols + c, dst + c * rows + r, rows, cols);
        for (int64_t r = lo; r < hi; r++) /* the last columns, and the part's last rows */
            for (int64_t c = r < whole ? wide : 0; c < cols; c++) dst[c * rows + r] = src[r * cols + c];
    });
}
