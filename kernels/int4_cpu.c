/* y = x @ w.T for 4-bit weights in blocks of 32 on an x86 CPU with AVX2, FMA and F16C
   (kernels/int4_cpu.py).

   A weight block is 32 codes q in [0, 15] with a float16 scale and minimum, w = q * scale + minimum
   (GGUF's Q4_1). Its 16 bytes hold code j in the low nibble of byte j and code j + 16 in the high
   nibble. Each block of 32 values of a row of x is quantized to int16 with its own step d (its
   absolute maximum / 32767, rounded to nearest even) and its float sum s kept, so that

       x . w over a block = scale * d * (q . xq) + minimum * s

   with q . xq an integer dot product (vpmaddwd: 16 products summed in pairs per instruction), as
   llama.cpp multiplies Q4_1 weights by quantized activations, but with 16-bit activations: int8
   ones (llama.cpp's Q8_1) cost the default model's greedy agreement with float32 0.994 -> 0.944.
   The work per weight no longer grows with a float conversion per row of x: a block's codes are
   unpacked once for up to TILE rows. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#define BLOCK 32
#define TILE 4
#define QMAX 32767.0f  /* x values in int16 */

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* One block of 32 floats -> 32 int16 (v * (1 / d), rounded to nearest even), d and the float sum. */
static inline void quantize_block(const float *v, int16_t *q, float *d, float *s) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 x[4], amax = _mm256_setzero_ps(), sum = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        x[i] = _mm256_loadu_ps(v + 8 * i);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, x[i]));
        sum = _mm256_add_ps(sum, x[i]);
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    const float step = _mm_cvtss_f32(m) / QMAX;
    const __m256 inv = _mm256_set1_ps(step > 0.0f ? 1.0f / step : 0.0f);
    for (int i = 0; i < 4; i += 2) {  /* cvtps rounds to nearest even (the default MXCSR mode) */
        const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(x[i], inv));
        const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(x[i + 1], inv));
        /* packs interleaves the 128-bit lanes (a0-3 b0-3 a4-7 b4-7); the permute restores the order */
        _mm256_storeu_si256((__m256i *)(q + 8 * i), _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8));
    }
    *d = step;
    *s = hsum(sum);
}

/* Rows r0 .. r0 + nr - 1 of x against weight row n: y[r][n] for each. nr is a constant where
   this is inlined, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void dot_tile(
        const int16_t *xq, const float *xd, const float *xs, int64_t k, int64_t r0, const int nr,
        const uint8_t *qs, const uint16_t *scale, const uint16_t *minimum, int64_t n, int64_t out, float *y) {
    const int64_t blocks = k / BLOCK;
    const uint8_t *wq = qs + n * (k / 2);
    const uint16_t *ws = scale + n * blocks, *wm = minimum + n * blocks;
    const __m128i low = _mm_set1_epi8(0x0F);
    __m256 acc[TILE];
    float extra[TILE];
    for (int t = 0; t < nr; t++) {
        acc[t] = _mm256_setzero_ps();
        extra[t] = 0.0f;
    }
    for (int64_t b = 0; b < blocks; b++) {
        const __m128i packed = _mm_loadu_si128((const __m128i *)(wq + b * 16));
        const __m256i q0 = _mm256_cvtepu8_epi16(_mm_and_si128(packed, low));  /* codes 0-15 */
        const __m256i q1 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(packed, 4), low));  /* 16-31 */
        const float step = _cvtsh_ss(ws[b]), minimum_b = _cvtsh_ss(wm[b]);
        for (int t = 0; t < nr; t++) {
            const int64_t xb = (r0 + t) * blocks + b;
            const __m256i *xv = (const __m256i *)(xq + xb * BLOCK);
            /* code x value pairs summed to int32: at most 2 * 15 * 32767 each, 32 * 15 * 32767 in
               all, below 2^24, so the conversion to float is exact */
            const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(q0, _mm256_loadu_si256(xv)),
                                                 _mm256_madd_epi16(q1, _mm256_loadu_si256(xv + 1)));
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(step * xd[xb]), acc[t]);
            extra[t] += minimum_b * xs[xb];
        }
    }
    for (int t = 0; t < nr; t++)
        y[(r0 + t) * out + n] = hsum(acc[t]) + extra[t];
}

/* x [m, k] float32 (k a multiple of 32) times the weight [out, k] given as qs [out, k / 2] codes,
   scale and minimum [out, k / 32] float16: y [m, out] float32. threads: OpenMP threads to use. */
void int4_linear(const float *x, int64_t m, int64_t k, const uint8_t *qs, const uint16_t *scale,
                 const uint16_t *minimum, int64_t out, float *y, int threads) {
    const int64_t blocks = k / BLOCK;
    int16_t *xq = malloc(sizeof(int16_t) * (size_t)(m * k));
    float *xd = malloc(sizeof(float) * (size_t)(m * blocks));
    float *xs = malloc(sizeof(float) * (size_t)(m * blocks));
    #pragma omp parallel for num_threads(threads) schedule(static) if (m * k >= 65536)
    for (int64_t i = 0; i < m * blocks; i++)
        quantize_block(x + i * BLOCK, xq + i * BLOCK, xd + i, xs + i);
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < out; n++) {
        int64_t r = 0;
        for (; r + TILE <= m; r += TILE)
            dot_tile(xq, xd, xs, k, r, TILE, qs, scale, minimum, n, out, y);
        switch (m - r) {
            case 3: dot_tile(xq, xd, xs, k, r, 3, qs, scale, minimum, n, out, y); break;
            case 2: dot_tile(xq, xd, xs, k, r, 2, qs, scale, minimum, n, out, y); break;
            case 1: dot_tile(xq, xd, xs, k, r, 1, qs, scale, minimum, n, out, y); break;
        }
    }
    free(xq);
    free(xd);
    free(xs);
}
