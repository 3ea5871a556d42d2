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

   The codes are never reordered: two blocks' 32 bytes are read as 16-bit words, and a word holds
   codes 2i (bits 0-3), 2i + 16 (4-7), 2i + 1 (8-11) and 2i + 17 (12-15) of its block. A mask and
   three shifts give four vectors of 16 codes (the low 128 bits from the first block, the high from
   the second), and x's int16 values are stored in the same order ("planes") when it is quantized,
   so the codes need no widening or shuffling. Per pair of blocks the four products are summed in
   int32 lanes, 4 lanes per block, converted once and scaled by [d0 scale0 x4, d1 scale1 x4]; the
   minimums' part (minimum . s) is a float dot product, 8 blocks at a time, into the same sums (a
   row's lanes are added up at the end: a second set of sums kept 4 more registers live and spilled
   at 4 rows). A block's codes are unpacked once for up to TILE rows of x. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 32
#define TILE 4
#define QMAX 32767.0f  /* x values in int16 */
#define PREFETCH 2048  /* bytes of codes read ahead: one core's own streams leave memory idle */

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Block b of a row of x (32 floats at v) -> int16 values (v * (1 / d), rounded to nearest even) at
   their place in the row's planes (xrow), its step d four times (d4) and its float sum (s).
   A block in a pair fills 8 of the 16 values of each of the pair's four planes; the last block of
   an odd count has four planes of 8 of its own. */
static inline void quantize_block(const float *v, int16_t *xrow, int64_t b, int64_t blocks, float *d4, float *s) {
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
    int32_t q[BLOCK];
    for (int i = 0; i < 4; i++)  /* cvtps rounds to nearest even (the default MXCSR mode) */
        _mm256_storeu_si256((__m256i *)(q + 8 * i), _mm256_cvtps_epi32(_mm256_mul_ps(x[i], inv)));
    const int paired = (b ^ 1) < blocks;  /* b's partner in its pair exists */
    int16_t *dst = paired ? xrow + (b >> 1) * 2 * BLOCK + (b & 1) * 8 : xrow + b * BLOCK;
    const int plane = paired ? 16 : 8;
    for (int i = 0; i < 8; i++) {
        dst[i] = (int16_t)q[2 * i];
        dst[plane + i] = (int16_t)q[2 * i + 16];
        dst[2 * plane + i] = (int16_t)q[2 * i + 1];
        dst[3 * plane + i] = (int16_t)q[2 * i + 17];
    }
    for (int i = 0; i < 4; i++)
        d4[i] = step;
    *s = hsum(sum);
}

/* Two float16 values -> [a, a, a, a, b, b, b, b] */
static inline __m256 two_halves(const uint16_t *h) {
    int32_t bits;
    memcpy(&bits, h, sizeof bits);
    const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128(bits));
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(f), _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
}

/* Rows r0 .. r0 + nr - 1 of x times pair p of weight row wq's blocks, scaled per block by `se`
   (the weights' scales, [a x4, b x4]) and x's steps, into acc. A macro, so that nr is a constant
   and the accumulators stay in registers. */
#define PAIR(p, se) do { \
        const __m256i packed = _mm256_loadu_si256((const __m256i *)(wq + (p) * BLOCK)); \
        _mm_prefetch((const char *)(wq + (p) * BLOCK + PREFETCH), _MM_HINT_T0); \
        const __m256i q0 = _mm256_and_si256(packed, low); \
        const __m256i q1 = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low); \
        const __m256i q2 = _mm256_and_si256(_mm256_srli_epi16(packed, 8), low); \
        const __m256i q3 = _mm256_srli_epi16(packed, 12); \
        for (int t = 0; t < nr; t++) { \
            const __m256i *xv = (const __m256i *)(xq + (r0 + t) * k + (p) * 2 * BLOCK); \
            /* each lane sums 8 products of at most 15 * 32767: below 2^24, exact in float */ \
            const __m256i dot = _mm256_add_epi32( \
                _mm256_add_epi32(_mm256_madd_epi16(q0, _mm256_loadu_si256(xv)), \
                                 _mm256_madd_epi16(q1, _mm256_loadu_si256(xv + 1))), \
                _mm256_add_epi32(_mm256_madd_epi16(q2, _mm256_loadu_si256(xv + 2)), \
                                 _mm256_madd_epi16(q3, _mm256_loadu_si256(xv + 3)))); \
            const __m256 steps = _mm256_loadu_ps(xd + ((r0 + t) * blocks + 2 * (p)) * 4); \
            acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(dot), steps), (se), acc[t]); \
        } \
    } while (0)

/* Rows r0 .. r0 + nr - 1 of x against weight row n: y[r][n] for each. */
static inline __attribute__((always_inline)) void dot_tile(
        const int16_t *xq, const float *xd, const float *xs, int64_t k, int64_t r0, const int nr,
        const uint8_t *qs, const uint16_t *scale, const uint16_t *minimum, int64_t n, int64_t out, float *y) {
    const int64_t blocks = k / BLOCK, pairs = blocks / 2, groups = blocks / 8;
    const uint8_t *wq = qs + n * (k / 2);
    const uint16_t *ws = scale + n * blocks, *wm = minimum + n * blocks;
    const __m256i low = _mm256_set1_epi16(0x0F);
    __m256 acc[TILE];  /* one per row; summed across lanes at the end, so any part may go in any lane */
    float rest[TILE];
    for (int t = 0; t < nr; t++) {
        acc[t] = _mm256_setzero_ps();
        rest[t] = 0.0f;
    }
    for (int64_t g = 0; g < groups; g++) {  /* 8 blocks: their scales and minimums in one load each */
        const __m256 s8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(ws + 8 * g)));
        PAIR(4 * g, _mm256_permutevar8x32_ps(s8, _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1)));
        PAIR(4 * g + 1, _mm256_permutevar8x32_ps(s8, _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3)));
        PAIR(4 * g + 2, _mm256_permutevar8x32_ps(s8, _mm256_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5)));
        PAIR(4 * g + 3, _mm256_permutevar8x32_ps(s8, _mm256_setr_epi32(6, 6, 6, 6, 7, 7, 7, 7)));
        const __m256 m8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wm + 8 * g)));
        for (int t = 0; t < nr; t++)
            acc[t] = _mm256_fmadd_ps(m8, _mm256_loadu_ps(xs + (r0 + t) * blocks + 8 * g), acc[t]);
    }
    for (int64_t p = 4 * groups; p < pairs; p++)
        PAIR(p, two_halves(ws + 2 * p));
    for (int64_t b = 8 * groups; b < blocks; b++) {
        const float mb = _cvtsh_ss(wm[b]);
        for (int t = 0; t < nr; t++)
            rest[t] += mb * xs[(r0 + t) * blocks + b];
    }
    if (blocks & 1) {  /* the last of an odd count of blocks, alone: planes of 8 */
        const int64_t b = blocks - 1;
        const __m128i packed = _mm_loadu_si128((const __m128i *)(wq + b * 16));
        const __m128i mask = _mm_set1_epi16(0x0F);
        const __m128i q0 = _mm_and_si128(packed, mask);
        const __m128i q1 = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);
        const __m128i q2 = _mm_and_si128(_mm_srli_epi16(packed, 8), mask);
        const __m128i q3 = _mm_srli_epi16(packed, 12);
        const float sb = _cvtsh_ss(ws[b]);
        for (int t = 0; t < nr; t++) {
            const __m128i *xv = (const __m128i *)(xq + (r0 + t) * k + b * BLOCK);
            __m128i dot = _mm_add_epi32(
                _mm_add_epi32(_mm_madd_epi16(q0, _mm_loadu_si128(xv)),
                              _mm_madd_epi16(q1, _mm_loadu_si128(xv + 1))),
                _mm_add_epi32(_mm_madd_epi16(q2, _mm_loadu_si128(xv + 2)),
                              _mm_madd_epi16(q3, _mm_loadu_si128(xv + 3))));
            dot = _mm_add_epi32(dot, _mm_shuffle_epi32(dot, 0x4E));
            dot = _mm_add_epi32(dot, _mm_shuffle_epi32(dot, 0xB1));
            rest[t] += sb * xd[((r0 + t) * blocks + b) * 4] * (float)_mm_cvtsi128_si32(dot);
        }
    }
    for (int t = 0; t < nr; t++)
        y[(r0 + t) * out + n] = hsum(acc[t]) + rest[t];
}

/* x [m, k] float32 (k a multiple of 32) times the weight [out, k] given as qs [out, k / 2] codes,
   scale and minimum [out, k / 32] float16: y [m, out] float32. threads: OpenMP threads to use. */
void int4_linear(const float *x, int64_t m, int64_t k, const uint8_t *qs, const uint16_t *scale,
                 const uint16_t *minimum, int64_t out, float *y, int threads) {
    const int64_t blocks = k / BLOCK;
    int16_t *xq = malloc(sizeof(int16_t) * (size_t)(m * k));
    float *xd = malloc(sizeof(float) * (size_t)(m * blocks * 4));  /* each block's step, 4 times */
    float *xs = malloc(sizeof(float) * (size_t)(m * blocks));
    #pragma omp parallel for num_threads(threads) schedule(static) if (m * k >= 65536)
    for (int64_t i = 0; i < m * blocks; i++)
        quantize_block(x + i * BLOCK, xq + (i / blocks) * k, i % blocks, blocks, xd + 4 * i, xs + i);
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
