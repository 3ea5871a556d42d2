/* Paged causal attention over a flat ragged batch on an x86 CPU with AVX2 and FMA, float32
   (kernels/specserve_kernels/paged_attention_cpu.py; the contract is kernels/specserve_kernels/paged_attention.py's).

   Request b has n_b = cu_seqlens[b + 1] - cu_seqlens[b] queries, the last n_b of its seq_lens[b]
   tokens; query i sits at position p = seq_lens[b] - n_b + i and attends to cached positions
   0 .. p, read through the request's block table. One work item is one query and one KV head:
   the G query heads that share the KV head read its keys and values while they are in cache.
   A head's scores (scaled q . k) are kept for all its keys, then exponentiated against their
   maximum and summed, and the values weighted by them: a softmax in two passes over the scores,
   one over the values. head_dim is a multiple of 16. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>


static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* e^x for x <= 0 (scores less their maximum), 8 at a time: x = k ln 2 + r with |r| <= ln 2 / 2,
   e^r by its degree-6 Taylor polynomial (relative error below 2e-7 on that range), 2^k from the
   exponent bits; below -87 (e^x under float's normal range) it is 0. */
static inline __m256 exp_nonpositive(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);  /* ln 2 in two parts */
    r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

/* Head h's scores (scaled q . k) against the keys 0 .. length - 1 at `scores`; returns their
   maximum. q's d values stay in registers (d a constant where inlined). */
static inline __attribute__((always_inline)) float head_scores(
        const float *q, const float *k_cache, const int32_t *table, int64_t length, const int64_t d, int64_t row,
        int64_t offset, int64_t block_size, int64_t pool_blocks, float scale, float *scores) {
    float maximum = -INFINITY;
    for (int64_t first = 0; first < length; first += block_size) {
        int64_t page = table[first / block_size];
        page = page < 0 ? 0 : (page >= pool_blocks ? pool_blocks - 1 : page);
        const float *key = k_cache + page * block_size * row + offset;
        const int64_t n = length - first < block_size ? length - first : block_size;
        for (int64_t j = 0; j < n; j++, key += row) {
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
            for (int64_t c = 0; c < d; c += 16) {
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + c), _mm256_loadu_ps(key + c), a0);
                a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + c + 8), _mm256_loadu_ps(key + c + 8), a1);
            }
            const float s = hsum(_mm256_add_ps(a0, a1)) * scale;
            scores[first + j] = s;
            maximum = s > maximum ? s : maximum;
        }
    }
    return maximum;
}

/* scores <- e^(scores - maximum); returns their sum. */
static inline float exponentiate(float *scores, int64_t length, float maximum) {
    const __m256 m = _mm256_set1_ps(maximum);
    __m256 sum = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= length; j += 8) {
        const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(scores + j), m));
        _mm256_storeu_ps(scores + j, e);
        sum = _mm256_add_ps(sum, e);
    }
    float total = hsum(sum);
    for (; j < length; j++) {
        scores[j] = expf(scores[j] - maximum);
        total += scores[j];
    }
    return total;
}

/* out (d) <- the values 0 .. length - 1 weighted by `weights`, times `norm`; the sums stay in
   registers for d of 64. */
static inline __attribute__((always_inline)) void weigh_values(
        const float *v_cache, const int32_t *table, int64_t length, const int64_t d, int64_t row, int64_t offset,
        int64_t block_size, int64_t pool_blocks, const float *weights, float norm, float *out) {
    for (int64_t c0 = 0; c0 < d; c0 += 64) {  /* 64 values at a time: 8 registers of sums */
        const int64_t width = d - c0 < 64 ? d - c0 : 64;
        __m256 acc[8];
        for (int i = 0; i < 8; i++)
            acc[i] = _mm256_setzero_ps();
        for (int64_t first = 0; first < length; first += block_size) {
            int64_t page = table[first / block_size];
            page = page < 0 ? 0 : (page >= pool_blocks ? pool_blocks - 1 : page);
            const float *value = v_cache + page * block_size * row + offset + c0;
            const int64_t n = length - first < block_size ? length - first : block_size;
            for (int64_t j = 0; j < n; j++, value += row) {
                const __m256 p = _mm256_set1_ps(weights[first + j]);
                for (int64_t i = 0; i < width / 8; i++)
                    acc[i] = _mm256_fmadd_ps(p, _mm256_loadu_ps(value + 8 * i), acc[i]);
            }
        }
        const __m256 scale = _mm256_set1_ps(norm);
        for (int64_t i = 0; i < width / 8; i++)
            _mm256_storeu_ps(out + c0 + 8 * i, _mm256_mul_ps(acc[i], scale));
    }
}

/* One query's G heads (q: G x d, contiguous) against KV head g of the keys 0 .. length - 1 of a
   request (its block table `table`): out (G x d). scores: room for `length` floats. Inlined where
   it is called, so that a constant d (64) unrolls its loops. */
static inline __attribute__((always_inline)) void attend(
        const float *q, const float *k_cache, const float *v_cache, const int32_t *table, int64_t length,
        int64_t group, const int64_t d, int64_t kv_heads, int64_t g, int64_t block_size, int64_t pool_blocks,
        float scale, float *scores, float *out) {
    const int64_t row = kv_heads * d;  /* floats from one slot to the next */
    for (int64_t h = 0; h < group; h++) {
        const float maximum = head_scores(q + h * d, k_cache, table, length, d, row, g * d, block_size, pool_blocks,
                                          scale, scores);
        const float total = exponentiate(scores, length, maximum);
        weigh_values(v_cache, table, length, d, row, g * d, block_size, pool_blocks, scores, 1.0f / total,
                     out + h * d);
    }
}

/* q [tokens, heads, d] and out alike; k_cache, v_cache [pool_blocks, block_size, kv_heads, d];
   cu_seqlens [batch + 1], seq_lens [batch], block_tables [batch, max_blocks] int32. d a multiple
   of 16 and heads a multiple of kv_heads (kernels/specserve_kernels/paged_attention_cpu.py checks). */
void paged_attention(const float *q, const float *k_cache, const float *v_cache, const int32_t *cu_seqlens,
                     const int32_t *seq_lens, const int32_t *block_tables, int64_t batch, int64_t max_blocks,
                     int64_t heads, int64_t kv_heads, int64_t d, int64_t block_size, int64_t pool_blocks,
                     float scale, float *out, int threads) {
    const int64_t tokens = cu_seqlens[batch], group = heads / kv_heads;
    int32_t *request = malloc(sizeof(int32_t) * (size_t)(tokens > 0 ? tokens : 1));
    int64_t longest = 1;
    for (int64_t b = 0; b < batch; b++) {
        for (int64_t t = cu_seqlens[b]; t < cu_seqlens[b + 1]; t++)
            request[t] = (int32_t)b;
        longest = seq_lens[b] > longest ? seq_lens[b] : longest;
    }
    #pragma omp parallel num_threads(threads) if (tokens * kv_heads * longest >= 4096)
    {
        float *scores = malloc(sizeof(float) * (size_t)longest);
        #pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < tokens * kv_heads; item++) {
            const int64_t t = item / kv_heads, g = item % kv_heads, b = request[t];
            const int64_t length = seq_lens[b] - (cu_seqlens[b + 1] - t) + 1;  /* keys 0 .. its position */
            const float *qg = q + (t * heads + g * group) * d;
            const int32_t *table = block_tables + b * max_blocks;
            float *og = out + (t * heads + g * group) * d;
            if (d == 64)
                attend(qg, k_cache, v_cache, table, length, group, 64, kv_heads, g, block_size, pool_blocks, scale,
                       scores, og);
            else
                attend(qg, k_cache, v_cache, table, length, group, d, kv_heads, g, block_size, pool_blocks, scale,
                       scores, og);
        }
        free(scores);
    }
    free(request);
}
