/* y = x @ w.T for 4-bit weights in blocks of 32 on an x86 CPU with AVX2, FMA and F16C
   (kernels/specserve_kernels/int4_cpu.py); built a second time with AVX-512 (F, BW, VL) where the CPU has it.

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
   at 4 rows). A block's codes are unpacked once for up to TILE rows of x.

   The AVX-512 build reads the codes the same way, 64 bytes at a time: four blocks, whose four
   vectors of 32 codes (each 128-bit lane one block's 8) meet x's values in 512-bit products, with
   AVX512-VNNI's vpdpwssd adding each product into the sums where the CPU has it. Its x values go
   in groups of four blocks while four remain (then a pair, then one alone): plane i of a group of
   g blocks holds 8 values of each of its blocks, block after block. Per group of four, the sums
   are converted once and scaled per block; the minimums' part is 16 blocks at a time; a tile is 8
   rows (32 vector registers). A row's last pair and last odd block take the AVX2 code. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 32
#ifdef __AVX512BW__
#define GROUP 4  /* blocks an instruction's codes come from */
#define TILE 8
typedef __m512 sums_t;
#else
#define GROUP 2
#define TILE 4
typedef __m256 sums_t;
#endif
#define QMAX 32767.0f  /* x values in int16 */
#define PREFETCH 2048  /* bytes of codes read ahead: one core's own streams leave memory idle */

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The group of x's blocks that block b belongs to in a row of `blocks`: its first block, and its
   size in *size (GROUP while GROUP remain, then a pair, then one). */
static inline int64_t group_of(int64_t b, int64_t blocks, int *size) {
    if (GROUP == 4 && b < (blocks & ~(int64_t)3)) {
        *size = 4;
        return b & ~(int64_t)3;
    }
    if (b < (blocks & ~(int64_t)1)) {
        *size = 2;
        return b & ~(int64_t)1;
    }
    *size = 1;
    return b;
}

/* Block b of a row of x (32 floats at v) -> int16 values (v * (1 / d), rounded to nearest even) at
   their place in the row's planes (xrow), its step d four times (d4) and its float sum (s).
   A block in a group of g fills 8 of the 8g values of each of the group's four planes. */
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
    int size;
    const int64_t first = group_of(b, blocks, &size);
    int16_t *dst = xrow + first * BLOCK + (b - first) * 8;
    const int plane = 8 * size;
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
   (the weights' scales, [a x4, b x4]) and x's steps, into sums (256 bits a row). A macro, so that
   nr is a constant and the accumulators stay in registers. */
#define PAIR(p, se, sums) do { \
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
            sums[t] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(dot), steps), (se), sums[t]); \
        } \
    } while (0)

#ifdef __AVX512BW__
/* sum += a . b in pairs of int16, into int32 lanes */
static inline __m512i dot_pairs(__m512i sum, __m512i a, __m512i b) {
#ifdef __AVX512VNNI__
    return _mm512_dpwssd_epi32(sum, a, b);
#else
    return _mm512_add_epi32(sum, _mm512_madd_epi16(a, b));
#endif
}

/* PAIR for the four blocks of weight row wq from block b (`se`: their scales, 4 lanes each),
   into acc (512 bits a row). */
#define QUAD(b, se) do { \
        const __m512i packed = _mm512_loadu_si512((const void *)(wq + (b) * (BLOCK / 2))); \
        _mm_prefetch((const char *)(wq + (b) * (BLOCK / 2) + PREFETCH), _MM_HINT_T0); \
        const __m512i q0 = _mm512_and_si512(packed, low4); \
        const __m512i q1 = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4); \
        const __m512i q2 = _mm512_and_si512(_mm512_srli_epi16(packed, 8), low4); \
        const __m512i q3 = _mm512_srli_epi16(packed, 12); \
        for (int t = 0; t < nr; t++) { \
            const __m512i *xv = (const __m512i *)(xq + (r0 + t) * k + (b) * BLOCK); \
            __m512i dot = _mm512_madd_epi16(q0, _mm512_loadu_si512(xv)); \
            dot = dot_pairs(dot, q1, _mm512_loadu_si512(xv + 1)); \
            dot = dot_pairs(dot, q2, _mm512_loadu_si512(xv + 2)); \
            dot = dot_pairs(dot, q3, _mm512_loadu_si512(xv + 3)); \
            const __m512 steps = _mm512_loadu_ps(xd + ((r0 + t) * blocks + (b)) * 4); \
            acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot), steps), (se), acc[t]); \
        } \
    } while (0)

/* [a x4, b x4, c x4, d x4] from the scales of blocks 4i .. 4i + 3 in s16 */
static inline __m512 quad_scales(__m512 s16, int i) {
    const __m512i index = _mm512_add_epi32(_mm512_set1_epi32(4 * i),
                                           _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3));
    return _mm512_permutexvar_ps(index, s16);
}
#endif

/* Rows r0 .. r0 + nr - 1 of x against weight row n: y[r][n] for each. */
static inline __attribute__((always_inline)) void dot_tile(
        const int16_t *xq, const float *xd, const float *xs, int64_t k, int64_t r0, const int nr,
        const uint8_t *qs, const uint16_t *scale, const uint16_t *minimum, int64_t n, int64_t out, float *y) {
    const int64_t blocks = k / BLOCK;
    const uint8_t *wq = qs + n * (k / 2);
    const uint16_t *ws = scale + n * blocks, *wm = minimum + n * blocks;
    const __m256i low = _mm256_set1_epi16(0x0F);
    sums_t acc[TILE];  /* one per row; summed across lanes at the end, so any part may go in any lane */
    float rest[TILE];
    for (int t = 0; t < nr; t++) {
        acc[t] = (sums_t){0};
        rest[t] = 0.0f;
    }
#ifdef __AVX512BW__
    const __m512i low4 = _mm512_set1_epi16(0x0F);
    const int64_t quads = blocks & ~(int64_t)3, minimums = blocks & ~(int64_t)15;
    for (int64_t b = 0; b < minimums; b += 16) {  /* 16 blocks: their scales and minimums in one load each */
        const __m512 s16 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(ws + b)));
        QUAD(b, quad_scales(s16, 0));
        QUAD(b + 4, quad_scales(s16, 1));
        QUAD(b + 8, quad_scales(s16, 2));
        QUAD(b + 12, quad_scales(s16, 3));
        const __m512 m16 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(wm + b)));
        for (int t = 0; t < nr; t++)
            acc[t] = _mm512_fmadd_ps(m16, _mm512_loadu_ps(xs + (r0 + t) * blocks + b), acc[t]);
    }
    for (int64_t b = minimums; b < quads; b += 4) {
        int64_t bits;
        memcpy(&bits, ws + b, sizeof bits);
        QUAD(b, quad_scales(_mm512_cvtph_ps(_mm256_castsi128_si256(_mm_cvtsi64_si128(bits))), 0));
    }
    if (blocks - quads >= 2) {  /* a last pair */
        __m256 pair[TILE];
        for (int t = 0; t < nr; t++)
            pair[t] = _mm256_setzero_ps();
        PAIR(quads / 2, two_halves(ws + quads), pair);
        for (int t = 0; t < nr; t++)
            acc[t] = _mm512_add_ps(acc[t], _mm512_zextps256_ps512(pair[t]));
    }
#else
    const int64_t pairs = blocks / 2, minimums = blocks & ~(int64_t)7;
    for (int64_t b = 0; b < minimums; b += 8) {  /* 8 blocks: their scales and minimums in one load each */
        const __m256 s8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(ws + b)));
        PAIR(b / 2, _mm256_permutevar8x32_ps(s8, _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1)), acc);
        PAIR(b / 2 + 1, _mm256_permutevar8x32_ps(s8, _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3)), acc);
        PAIR(b / 2 + 2, _mm256_permutevar8x32_ps(s8, _mm256_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5)), acc);
        PAIR(b / 2 + 3, _mm256_permutevar8x32_ps(s8, _mm256_setr_epi32(6, 6, 6, 6, 7, 7, 7, 7)), acc);
        const __m256 m8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wm + b)));
        for (int t = 0; t < nr; t++)
            acc[t] = _mm256_fmadd_ps(m8, _mm256_loadu_ps(xs + (r0 + t) * blocks + b), acc[t]);
    }
    for (int64_t p = minimums / 2; p < pairs; p++)
        PAIR(p, two_halves(ws + 2 * p), acc);
#endif
    for (int64_t b = minimums; b < blocks; b++) {  /* the minimums' part of the blocks left */
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
#ifdef __AVX512BW__
        y[(r0 + t) * out + n] = _mm512_reduce_add_ps(acc[t]) + rest[t];
#else
        y[(r0 + t) * out + n] = hsum(acc[t]) + rest[t];
#endif
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
#if TILE == 8
            case 7: dot_tile(xq, xd, xs, k, r, 7, qs, scale, minimum, n, out, y); break;
            case 6: dot_tile(xq, xd, xs, k, r, 6, qs, scale, minimum, n, out, y); break;
            case 5: dot_tile(xq, xd, xs, k, r, 5, qs, scale, minimum, n, out, y); break;
            case 4: dot_tile(xq, xd, xs, k, r, 4, qs, scale, minimum, n, out, y); break;
#endif
            case 3: dot_tile(xq, xd, xs, k, r, 3, qs, scale, minimum, n, out, y); break;
            case 2: dot_tile(xq, xd, xs, k, r, 2, qs, scale, minimum, n, out, y); break;
            case 1: dot_tile(xq, xd, xs, k, r, 1, qs, scale, minimum, n, out, y); break;
        }
    }
    free(xq);
    free(xd);
    free(xs);
}
