/* y = x @ w.T for 4-bit weights in blocks of 32 on an x86 CPU with AVX-512 (F, BW, VL), FMA and
   F16C: int4_cpu.c's contract, arithmetic and weight layout, four blocks an instruction.

   The weights are read as int4_cpu.c reads them (its comment says how a 16-bit word holds four
   codes), but 64 bytes at a time: four blocks, whose four vectors of 32 codes (each 128-bit lane
   one block's 8) meet x's int16 values in 512-bit products (vpmaddwd: 32 products, summed in
   pairs, per instruction; with AVX512-VNNI, vpdpwssd also adds them into the sums). x's values
   are stored in the order the codes come: a row's blocks go in groups, of four while four remain,
   then a pair, then one alone; plane i of a group of g blocks is 8 values of each of its blocks
   (block after block), values 2j of each block in plane 0, 2j + 16 in plane 1, 2j + 1 in plane 2
   and 2j + 17 in plane 3 (j = 0 .. 7). Per group of four, the four products are summed in int32
   lanes, 4 lanes per block, converted once and scaled by each block's weight scale and x step.
   The minimums' part (minimum . s) is a float dot product, 16 blocks at a time, into the same
   sums. A block's codes are unpacked once for up to TILE rows of x. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 32
#define TILE 8
#define QMAX 32767.0f  /* x values in int16 */
#define PREFETCH 2048  /* bytes of codes read ahead */

/* The group of blocks b belongs to in a row of `blocks` (its first block; its size in *size). */
static inline int64_t group_of(int64_t b, int64_t blocks, int *size) {
    const int64_t quads = blocks & ~(int64_t)3;
    if (b < quads) {
        *size = 4;
        return b & ~(int64_t)3;
    }
    if (b < (blocks & ~(int64_t)1)) {
        *size = 2;
        return quads;
    }
    *size = 1;
    return b;
}

/* Block b of a row of x (32 floats at v) -> int16 values (v * (1 / d), rounded to nearest even) at
   their place in the row's planes (xrow), its step d four times (d4) and its float sum (s). */
static inline void quantize_block(const float *v, int16_t *xrow, int64_t b, int64_t blocks, float *d4, float *s) {
    const __m512 x0 = _mm512_loadu_ps(v), x1 = _mm512_loadu_ps(v + 16);
    const float step = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1))) / QMAX;
    const __m512 inv = _mm512_set1_ps(step > 0.0f ? 1.0f / step : 0.0f);
    int32_t q[BLOCK];  /* cvtps rounds to nearest even (the default MXCSR mode) */
    _mm512_storeu_si512((__m512i *)q, _mm512_cvtps_epi32(_mm512_mul_ps(x0, inv)));
    _mm512_storeu_si512((__m512i *)(q + 16), _mm512_cvtps_epi32(_mm512_mul_ps(x1, inv)));
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
    *s = _mm512_reduce_add_ps(_mm512_add_ps(x0, x1));
}

/* sum += a . b in pairs of int16, into int32 lanes */
static inline __m512i dot_pairs(__m512i sum, __m512i a, __m512i b) {
#ifdef __AVX512VNNI__
    return _mm512_dpwssd_epi32(sum, a, b);
#else
    return _mm512_add_epi32(sum, _mm512_madd_epi16(a, b));
#endif
}

/* Rows r0 .. r0 + nr - 1 of x times the four blocks of weight row wq from block b, scaled per
   block by `se` (the weights' scales, 4 lanes each) and x's steps, into acc. A macro, so that nr
   is a constant and the accumulators stay in registers. */
#define QUAD(b, se) do { \
        const __m512i packed = _mm512_loadu_si512((const void *)(wq + (b) * (BLOCK / 2))); \
        _mm_prefetch((const char *)(wq + (b) * (BLOCK / 2) + PREFETCH), _MM_HINT_T0); \
        const __m512i q0 = _mm512_and_si512(packed, low); \
        const __m512i q1 = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low); \
        const __m512i q2 = _mm512_and_si512(_mm512_srli_epi16(packed, 8), low); \
        const __m512i q3 = _mm512_srli_epi16(packed, 12); \
        for (int t = 0; t < nr; t++) { \
            const __m512i *xv = (const __m512i *)(xq + (r0 + t) * k + (b) * BLOCK); \
            /* each lane sums 8 products of at most 15 * 32767: below 2^24, exact in float */ \
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

/* Rows r0 .. r0 + nr - 1 of x against weight row n: y[r][n] for each. */
static inline __attribute__((always_inline)) void dot_tile(
        const int16_t *xq, const float *xd, const float *xs, int64_t k, int64_t r0, const int nr,
        const uint8_t *qs, const uint16_t *scale, const uint16_t *minimum, int64_t n, int64_t out, float *y) {
    const int64_t blocks = k / BLOCK, quads = blocks & ~(int64_t)3, sixteens = blocks / 16;
    const uint8_t *wq = qs + n * (k / 2);
    const uint16_t *ws = scale + n * blocks, *wm = minimum + n * blocks;
    const __m512i low = _mm512_set1_epi16(0x0F);
    __m512 acc[TILE];  /* one per row; summed across lanes at the end, so any part may go in any lane */
    float rest[TILE];
    for (int t = 0; t < nr; t++) {
        acc[t] = _mm512_setzero_ps();
        rest[t] = 0.0f;
    }
    for (int64_t g = 0; g < sixteens; g++) {  /* 16 blocks: their scales and minimums in one load each */
        const int64_t b = 16 * g;
        const __m512 s16 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(ws + b)));
        QUAD(b, quad_scales(s16, 0));
        QUAD(b + 4, quad_scales(s16, 1));
        QUAD(b + 8, quad_scales(s16, 2));
        QUAD(b + 12, quad_scales(s16, 3));
        const __m512 m16 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(wm + b)));
        for (int t = 0; t < nr; t++)
            acc[t] = _mm512_fmadd_ps(m16, _mm512_loadu_ps(xs + (r0 + t) * blocks + b), acc[t]);
    }
    for (int64_t b = 16 * sixteens; b < quads; b += 4) {  /* the rest of the groups of four */
        int64_t bits;
        memcpy(&bits, ws + b, sizeof bits);
        QUAD(b, quad_scales(_mm512_cvtph_ps(_mm256_castsi128_si256(_mm_cvtsi64_si128(bits))), 0));
    }
    for (int64_t b = 16 * sixteens; b < blocks; b++) {
        const float mb = _cvtsh_ss(wm[b]);
        for (int t = 0; t < nr; t++)
            rest[t] += mb * xs[(r0 + t) * blocks + b];
    }
    if (blocks - quads >= 2) {  /* a pair: int4_cpu.c's 256-bit products, planes of 16 */
        const int64_t b = quads;
        const __m256i packed = _mm256_loadu_si256((const __m256i *)(wq + b * (BLOCK / 2)));
        const __m256i mask = _mm256_set1_epi16(0x0F);
        const __m256i q0 = _mm256_and_si256(packed, mask);
        const __m256i q1 = _mm256_and_si256(_mm256_srli_epi16(packed, 4), mask);
        const __m256i q2 = _mm256_and_si256(_mm256_srli_epi16(packed, 8), mask);
        const __m256i q3 = _mm256_srli_epi16(packed, 12);
        int32_t bits;
        memcpy(&bits, ws + b, sizeof bits);
        const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128(bits));
        const __m256 se = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(f), _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
        for (int t = 0; t < nr; t++) {
            const __m256i *xv = (const __m256i *)(xq + (r0 + t) * k + b * BLOCK);
            const __m256i dot = _mm256_add_epi32(
                _mm256_add_epi32(_mm256_madd_epi16(q0, _mm256_loadu_si256(xv)),
                                 _mm256_madd_epi16(q1, _mm256_loadu_si256(xv + 1))),
                _mm256_add_epi32(_mm256_madd_epi16(q2, _mm256_loadu_si256(xv + 2)),
                                 _mm256_madd_epi16(q3, _mm256_loadu_si256(xv + 3))));
            const __m256 steps = _mm256_loadu_ps(xd + ((r0 + t) * blocks + b) * 4);
            const __m256 part = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(dot), steps), se);
            acc[t] = _mm512_add_ps(acc[t], _mm512_zextps256_ps512(part));
        }
    }
    if (blocks & 1) {  /* the last of an odd count of blocks, alone: planes of 8 */
        const int64_t b = blocks - 1;
        const __m128i packed = _mm_loadu_si128((const __m128i *)(wq + b * (BLOCK / 2)));
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
        y[(r0 + t) * out + n] = _mm512_reduce_add_ps(acc[t]) + rest[t];
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
            case 7: dot_tile(xq, xd, xs, k, r, 7, qs, scale, minimum, n, out, y); break;
            case 6: dot_tile(xq, xd, xs, k, r, 6, qs, scale, minimum, n, out, y); break;
            case 5: dot_tile(xq, xd, xs, k, r, 5, qs, scale, minimum, n, out, y); break;
            case 4: dot_tile(xq, xd, xs, k, r, 4, qs, scale, minimum, n, out, y); break;
            case 3: dot_tile(xq, xd, xs, k, r, 3, qs, scale, minimum, n, out, y); break;
            case 2: dot_tile(xq, xd, xs, k, r, 2, qs, scale, minimum, n, out, y); break;
            case 1: dot_tile(xq, xd, xs, k, r, 1, qs, scale, minimum, n, out, y); break;
        }
    }
    free(xq);
    free(xd);
    free(xs);
}
