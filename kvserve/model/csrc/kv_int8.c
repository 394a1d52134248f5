/*
 * The int8 KV cache (`--kv-cache-dtype int8`): half the bytes of bf16 per position, which is
 * what decode attention is bound by on a CPU (it reads every sequence's whole cache once per
 * layer and step).
 *
 * Each K or V row of one head at one position is stored as 8-bit integers with its own float32
 * scale (max |x| / 127, rounded to nearest). Layout of one layer: bytes [2][kv_heads][slots][head_dim]
 * and scales [2][kv_heads][slots], K then V, slots = num_blocks * block_size. K bytes are
 * stored biased (k + 128, an unsigned byte) so that scores are one VNNI instruction (unsigned
 * times signed bytes) against the query, which is quantized per head the same way:
 *
 *   q.k = q_scale * k_scale * (sum_d q8[d] * (k8[d] + 128) - 128 * sum_d q8[d])
 *
 * V bytes are plain signed. The softmax weights are made as 16-bit integers, so the weighted
 * sum of values is integer too (see "One arithmetic" below).
 */
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "kv_int8.h"

#define MAX_GROUP 16

static inline float quantize_vector(const float *x, int64_t n, int8_t *q, int bias) {
    const float top = abs_max(x, n);
    const float inverse = top > 0.f ? 127.f / top : 0.f;
    const int offset = bias ? 128 : 0;
    _Pragma("omp simd") for (int64_t i = 0; i < n; i++) q[i] =
        (int8_t)(uint8_t)((int)nearbyintf(x[i] * inverse) + offset);
    return top / 127.f;
}

/* Rotate q and k in place (half-rotation RoPE) and store k, v quantized. Arguments as
 * rope_store in layer_ops.c, plus `scales` ([2][kv_heads][num_slots] float32). */
#define DEFINE_ROPE_STORE_Q8(NAME, T, LOAD, ROTATE)                                                 \
    void NAME(T *qkv, const int64_t *positions, const float *cos_table, const float *sin_table,   \
              const int64_t *slots, int8_t *kv, float *scales, int64_t rows, int64_t heads,       \
              int64_t kv_heads, int64_t head_dim, int64_t num_slots, int num_threads) {           \
        const int64_t half = head_dim / 2, width = (heads + 2 * kv_heads) * head_dim;             \
        const int64_t head_stride = num_slots * head_dim;                                         \
        int8_t *k_cache = kv, *v_cache = kv + kv_heads * head_stride;                             \
        float *k_scales = scales, *v_scales = scales + kv_heads * num_slots;                      \
        _Pragma("omp parallel for if (rows >= 8) num_threads(num_threads)")                        \
        for (int64_t r = 0; r < rows; r++) {                                                      \
            T *row = qkv + r * width;                                                             \
            const float *c = cos_table + positions[r] * half, *s = sin_table + positions[r] * half; \
            ROTATE(row, c, s, heads + kv_heads, head_dim);                                        \
            const int64_t slot = slots[r];                                                        \
            float buffer[head_dim];                                                               \
            for (int64_t h = 0; h < kv_heads; h++) {                                              \
                const T *k = row + (heads + h) * head_dim, *v = k + kv_heads * head_dim;          \
                for (int64_t d = 0; d < head_dim; d++) buffer[d] = LOAD(k[d]);                    \
                k_scales[h * num_slots + slot] = quantize_vector(                                 \
                    buffer, head_dim, k_cache + h * head_stride + slot * head_dim, 1);            \
                for (int64_t d = 0; d < head_dim; d++) buffer[d] = LOAD(v[d]);                    \
                v_scales[h * num_slots + slot] = quantize_vector(                                 \
                    buffer, head_dim, v_cache + h * head_stride + slot * head_dim, 0);            \
            }                                                                                     \
        }                                                                                         \
    }

DEFINE_ROPE_STORE_Q8(kvserve_rope_store_q8_f32, float, float_identity, rotate_heads_f32)
DEFINE_ROPE_STORE_Q8(kvserve_rope_store_q8_bf16, uint16_t, bf16_to_float, rotate_heads_bf16)

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
int kvserve_kv_int8_available(void) { return 1; }

/*
 * One arithmetic for every query row, whether it is computed alone (a decode row, a chunk of one
 * row) or in a tile of prefill rows: each step below is defined per row and key, integer sums
 * are exact in any order, and every float sum runs in one fixed order set by position (spans of
 * Q8_SPAN keys, 16 interleaved partial sums in each), so a row's result depends on nothing but
 * its own query and its sequence's cache -- not on its batch mates, how its prompt was chunked,
 * or the block size.
 *
 *   q8, q_scale, q_bias   the query row times the softmax scale, quantized as quantize_vector
 *   s_j      = (sum_d q8[d] (k8_j[d] + 128) - q_bias) * (k_scale_j * q_scale)
 *   top      = max_j s_j over the row's keys j < length
 *   e_j      = 2^(s_j log2(e) - top log2(e))  (exp2_weights; e_j <= 1),  p_j = e_j * v_scale_j
 *   total    = q8_tree16 of each span's 16 partial sums (partial i: its keys j = i mod 16, in
 *              order), the spans' totals added in order
 *   w_j      = round(p_j * (32767 / M)),  M = the span's largest p_j (15 bits a span)
 *   sums[d]  = fma(float(sum_{j in span} w_j v8_j[d]), M / 32767, sums[d]), span after span
 *   out[d]   = sums[d] * (1 / max(total, 1e-30))
 *
 * (8-bit weights were tried: the many small weights beside a large one round to zero.)
 */
#define Q8_SPAN 256 /* keys whose weighted sums stay within int32: 256 * 32767 * 127 < 2^31 */
#define Q8_SCALE 32767.f

/* The query row at `q + offset` (float32 or bf16) times `scale`, quantized as quantize_vector
 * does; q_bias = 128 * sum(q8) (the biased keys' offset). hd is 64 or 128. */
static inline void q8_query(const void *q, int bf16, int64_t offset, int64_t hd, float scale,
                            int8_t *q8, float *q_scale, float *q_bias) {
    __m512 x[8], largest = _mm512_setzero_ps();
    for (int64_t c = 0; c < hd / 16; c++) {
        x[c] = bf16 ? _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256(
                          (const __m256i *)((const uint16_t *)q + offset + 16 * c)))
                    : _mm512_loadu_ps((const float *)q + offset + 16 * c);
        x[c] = _mm512_mul_ps(x[c], _mm512_set1_ps(scale));
        largest = _mm512_max_ps(largest, _mm512_abs_ps(x[c]));
    }
    const float most = _mm512_reduce_max_ps(largest);
    const __m512 inverse = _mm512_set1_ps(most > 0.f ? 127.f / most : 0.f);
    __m512i sum = _mm512_setzero_si512();
    for (int64_t c = 0; c < hd / 16; c++) {
        const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(x[c], inverse));
        sum = _mm512_add_epi32(sum, v);
        _mm_storeu_si128((__m128i *)(q8 + 16 * c), _mm512_cvtepi32_epi8(v));
    }
    *q_scale = most / 127.f;
    *q_bias = 128.f * (float)_mm512_reduce_add_epi32(sum);
}

/* 2^t for 16 lanes, t <= 0 where `keep` (other lanes give 0): a degree-4 polynomial of the
 * fraction (relative error below 4e-6, far under the 15-bit weights it feeds), 2^n by scalef. */
static inline __m512 exp2_weights(__m512 t, __mmask16 keep) {
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(0.009676037097914925f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.05592203564726923f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24022107355829372f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.693121033991548f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0000000754953495f));
    return _mm512_maskz_scalef_ps(keep, p, n);
}

/* The sum of 16 partial sums in one fixed order (halves, quarters, ...), per lane. */
static inline __m512 q8_tree16(const __m512 a[16]) {
    __m512 t[8];
    for (int i = 0; i < 8; i++) t[i] = _mm512_add_ps(a[i], a[i + 8]);
    for (int i = 0; i < 4; i++) t[i] = _mm512_add_ps(t[i], t[i + 4]);
    for (int i = 0; i < 2; i++) t[i] = _mm512_add_ps(t[i], t[i + 2]);
    return _mm512_add_ps(t[0], t[1]);
}

/* The same order over the 16 lanes of one vector (the partial sums of a row, lane i = i mod
 * 16), by lane-wise adds of the same halves. */
static inline float q8_tree16_lanes(__m512 a) {
    float x[16];
    _mm512_storeu_ps(x, a);
    float t[8];
    for (int i = 0; i < 8; i++) t[i] = x[i] + x[i + 8];
    for (int i = 0; i < 4; i++) t[i] = t[i] + t[i + 4];
    for (int i = 0; i < 2; i++) t[i] = t[i] + t[i + 2];
    return t[0] + t[1];
}

/* A value row of zeros, for the missing second key of a sequence's last pair. */
static const int8_t q8_zeros[128] = {0};

/* Two value rows of 64 dimensions as 16-bit VNNI operands: out[c] holds, in its int32 lane
 * 4j + i, dimension 32 (c / 2) + 8j + 4 (c % 2) + i of rows r0 and r1 (low and high half). */
static inline void q8_interleave2(const int8_t *r0, const int8_t *r1, __m512i out[4]) {
    for (int h = 0; h < 2; h++) {
        const __m512i a = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(r0 + 32 * h)));
        const __m512i b = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(r1 + 32 * h)));
        out[2 * h] = _mm512_unpacklo_epi16(a, b);
        out[2 * h + 1] = _mm512_unpackhi_epi16(a, b);
    }
}

/* The dimension that lane 4j + i of chunk c holds (q8_interleave2's order, per 64 dims). */
static inline int64_t q8_dimension(int c, int j, int i) {
    return (c / 4) * 64 + 32 * ((c % 4) / 2) + 8 * j + 4 * (c % 2) + i;
}

/* slots[j] = the cache slot of key j < length (its table's block, the position in it), and
 * vs[j] its value scale. */
static inline void q8_slots(const int64_t *table, int64_t block_size, int64_t length,
                            const float *v_scales, int64_t *slots, float *vs) {
    for (int64_t first = 0, b = 0; first < length; first += block_size, b++)
        for (int64_t j = first; j < first + block_size && j < length; j++) {
            slots[j] = table[b] * block_size + (j - first);
            vs[j] = v_scales[slots[j]];
        }
}

/* The value rows of key pairs [first_pair, end_pair) (keys 2m and 2m + 1 of the sequence, a key
 * at or past `length` as zeros) interleaved for q8_values_span: [pair][hd / 16][64 bytes]. */
static void q8_value_pairs(const int8_t *v_head, const int64_t *slots, int64_t hd,
                           int64_t length, int64_t first_pair, int64_t end_pair, int8_t *vt) {
    for (int64_t m = first_pair; m < end_pair; m++)
        for (int64_t half = 0; half < hd / 64; half++) {
            const int8_t *r0 = 2 * m < length ? v_head + slots[2 * m] * hd + half * 64 : q8_zeros;
            const int8_t *r1 =
                2 * m + 1 < length ? v_head + slots[2 * m + 1] * hd + half * 64 : q8_zeros;
            __m512i x[4];
            q8_interleave2(r0, r1, x);
            for (int c = 0; c < 4; c++)
                _mm512_storeu_si512(vt + ((m - first_pair) * (hd / 16) + half * 4 + c) * 64, x[c]);
        }
}

/* sums[r][:] = fma(float(acc[r][:]), scale[r * scale_stride], sums[r][:]) for N rows of HD / 16
 * integer accumulators (HD and N are constants): a span's integer sums into the float ones. */
static inline __attribute__((always_inline)) void q8_flush_span(
    const int HD, const int N, const __m512i *acc, const float *scale, int64_t scale_stride,
    float *sums) {
    for (int r = 0; r < N; r++)
        for (int c = 0; c < HD / 16; c++) {
            float *sum = sums + r * HD + c * 16;
            _mm512_storeu_ps(sum, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r * HD / 16 + c]),
                                                  _mm512_set1_ps(scale[r * scale_stride]),
                                                  _mm512_loadu_ps(sum)));
        }
}

/* sums[l][:] = fma(float(sum_m w[m][l] * v[m]), scale[l], sums[l][:]) for STEP query rows l over
 * `pairs` key pairs (at most Q8_SPAN / 2), the HD / 16 integer accumulators of each row in
 * registers (HD and STEP are constants; STEP * HD / 16 = 16). w[m] + l is row l's pair of
 * 16-bit weights at pair m (rows `stride` int32s apart per pair); sums in q8_interleave2's
 * dimension order. */
static inline __attribute__((always_inline)) void q8_values_span(
    const int HD, const int STEP, const uint32_t *w, int64_t stride, const int8_t *vt,
    int64_t pairs, const float *scale, float *sums) {
    __m512i acc[16];
    for (int i = 0; i < STEP * HD / 16; i++) acc[i] = _mm512_setzero_si512();
#pragma GCC unroll 16
    for (int64_t m = 0; m < pairs; m++) {
        __m512i rows[8];
        for (int c = 0; c < HD / 16; c++) rows[c] = _mm512_loadu_si512(vt + (m * (HD / 16) + c) * 64);
        for (int l = 0; l < STEP; l++) {
            const __m512i pair = _mm512_set1_epi32((int32_t)w[m * stride + l]);
            for (int c = 0; c < HD / 16; c++)
                acc[l * HD / 16 + c] = _mm512_dpwssd_epi32(acc[l * HD / 16 + c], pair, rows[c]);
        }
    }
    q8_flush_span(HD, STEP, acc, scale, 1, sums);
}

static inline void q8_values_span_hd(int64_t hd, const uint32_t *w, int64_t stride,
                                     const int8_t *vt, int64_t pairs, const float *scale,
                                     float *sums) {
    if (hd == 64)
        q8_values_span(64, 4, w, stride, vt, pairs, scale, sums);
    else
        q8_values_span(128, 2, w, stride, vt, pairs, scale, sums);
}

/* Row `sum` (in q8_interleave2's order) times `norm`, stored to `out` (float32 or bf16). */
static inline void q8_store_row(const float *sum, float norm, int64_t hd, void *out, int bf16,
                                int64_t offset) {
    for (int c = 0; c < hd / 16; c++)
        for (int j = 0; j < 4; j++)
            for (int i = 0; i < 4; i++) {
                const float o = sum[c * 16 + 4 * j + i] * norm;
                const int64_t d = offset + q8_dimension(c, j, i);
                if (bf16)
                    ((uint16_t *)out)[d] = float_to_bf16(o);
                else
                    ((float *)out)[d] = o;
            }
}

/* acc[g][:] for G query heads (G * HD / 16 <= 16 accumulators in registers; HD and G are
 * constants): sums[g][:] = fma(float(sum_m w_g[m] * v[m]), scale[g], sums[g][:]) over the key
 * pairs [first, end) of one span, the value rows of each pair interleaved in registers. w_g is
 * head g's weights as 16-bit integers by key (`stride` apart), so its pair m is one int32. */
static inline __attribute__((always_inline)) void q8_row_values(
    const int HD, const int G, const int16_t *w, int64_t stride, const int8_t *v_head,
    const int64_t *slots, int64_t length, int64_t first, int64_t end, const float *scale,
    int64_t scale_stride, float *sums) {
    __m512i acc[16];
    for (int i = 0; i < G * HD / 16; i++) acc[i] = _mm512_setzero_si512();
    for (int64_t m = first; m < end; m++) {
        const int8_t *r0 = v_head + slots[2 * m] * HD;
        const int8_t *r1 = 2 * m + 1 < length ? v_head + slots[2 * m + 1] * HD : q8_zeros;
        __m512i rows[8];
        for (int half = 0; half < HD / 64; half++)
            q8_interleave2(r0 + half * 64, r1 + half * 64, rows + 4 * half);
        for (int g = 0; g < G; g++) {
            const __m512i pair = _mm512_set1_epi32(((const int32_t *)(w + g * stride))[m]);
            for (int c = 0; c < HD / 16; c++)
                acc[g * HD / 16 + c] = _mm512_dpwssd_epi32(acc[g * HD / 16 + c], pair, rows[c]);
        }
    }
    q8_flush_span(HD, G, acc, scale, scale_stride, sums);
}

/* The G-head cases of q8_row_values, G a constant in each. */
static void q8_row_values_heads(int64_t hd, int64_t heads, const int16_t *w, int64_t stride,
                                const int8_t *v_head, const int64_t *slots, int64_t length,
                                int64_t first, int64_t end, const float *scale,
                                int64_t scale_stride, float *sums) {
#define Q8_ROW_VALUES(HD, G)                                                                       \
    q8_row_values(HD, G, w + g0 * stride, stride, v_head, slots, length, first, end,               \
                  scale + g0 * scale_stride, scale_stride, sums + g0 * HD)
    const int64_t most = hd == 64 ? 4 : 2;
    for (int64_t g0 = 0; g0 < heads; g0 += most) {
        const int64_t g = heads - g0 < most ? heads - g0 : most;
        if (hd == 64) {
            switch (g) {
            case 1: Q8_ROW_VALUES(64, 1); break;
            case 2: Q8_ROW_VALUES(64, 2); break;
            case 3: Q8_ROW_VALUES(64, 3); break;
            default: Q8_ROW_VALUES(64, 4); break;
            }
        } else if (g == 1) {
            Q8_ROW_VALUES(128, 1);
        } else {
            Q8_ROW_VALUES(128, 2);
        }
    }
#undef Q8_ROW_VALUES
}

/* Floats of work space a row task needs (q8_row_task's layout). */
static inline int64_t q8_row_floats(int64_t group, int64_t hd, int64_t length) {
    const int64_t spans = (length + Q8_SPAN - 1) / Q8_SPAN, padded = spans * Q8_SPAN;
    return group * length + 3 * length + Q8_SPAN + group * padded / 2 + group * spans +
           group * hd + 64;
}

/* One (sequence, KV head) task: the `group` query heads of one row (at q, out) over the row's
 * `length` positions, in the arithmetic above, 16 keys to a vector. */
static void q8_row_task(const void *q, int bf16, void *out, const uint8_t *k_head,
                        const int8_t *v_head, const float *k_scales, const float *v_scales,
                        const int64_t *table, int64_t length, int64_t group, int64_t hd,
                        int64_t block_size, float scale, float *work) {
    const int64_t spans = (length + Q8_SPAN - 1) / Q8_SPAN, padded = spans * Q8_SPAN;
    float *scores = work;                       /* [group][length] */
    float *vs = scores + group * length;        /* [length] the keys' value scales */
    float *weights = vs + length;               /* [Q8_SPAN] one span's p */
    int16_t *w = (int16_t *)(weights + Q8_SPAN); /* [group][padded] 16-bit weights */
    float *span_scale = (float *)(w + group * padded); /* [group][spans] */
    float *sums = span_scale + group * spans;   /* [group][hd] */
    int64_t *slots = (int64_t *)(sums + group * hd); /* [length] */
    int8_t q8[MAX_GROUP][128] __attribute__((aligned(64)));
    float q_scale[MAX_GROUP], q_bias[MAX_GROUP], inverse[MAX_GROUP];
    for (int64_t g = 0; g < group; g++)
        q8_query(q, bf16, g * hd, hd, scale, q8[g], &q_scale[g], &q_bias[g]);
    q8_slots(table, block_size, length, v_scales, slots, vs);

    /* scores, 16 keys of a block at a time (one horizontal sum per key, by transposes) */
    const int64_t num_used = (length + block_size - 1) / block_size;
    for (int64_t b = 0; b < num_used; b++) {
        const uint8_t *keys = k_head + table[b] * block_size * hd;
        const float *ks = k_scales + table[b] * block_size;
        const int64_t n = length - b * block_size < block_size ? length - b * block_size
                                                               : block_size;
        for (int64_t o0 = 0; o0 < n; o0 += 16) {
            const int64_t m = n - o0 < 16 ? n - o0 : 16;
            const __mmask16 mask = m == 16 ? (__mmask16)0xffff : (__mmask16)((1u << m) - 1);
            const __m512 key_scales = _mm512_maskz_loadu_ps(mask, ks + o0);
            for (int64_t g = 0; g < group; g++) {
                __m512 partial[16];
                for (int64_t j = 0; j < 16; j++) {
                    __m512i dot = _mm512_setzero_si512();
                    if (j < m)
                        for (int64_t d = 0; d < hd; d += 64)
                            dot = _mm512_dpbusd_epi32(
                                dot, _mm512_loadu_si512(keys + (o0 + j) * hd + d),
                                _mm512_load_si512(&q8[g][d]));
                    partial[j] = _mm512_cvtepi32_ps(dot);
                }
                /* the partial sums are integers below 2^24: their float sums are exact */
                const __m512 dots = _mm512_sub_ps(sum16(partial), _mm512_set1_ps(q_bias[g]));
                _mm512_mask_storeu_ps(
                    scores + g * length + b * block_size + o0, mask,
                    _mm512_mul_ps(dots, _mm512_mul_ps(key_scales, _mm512_set1_ps(q_scale[g]))));
            }
        }
    }
    /* weights, span by span, 16 keys to a vector (lane i: the keys j = i mod 16) */
    const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
    for (int64_t g = 0; g < group; g++) {
        const float *s = scores + g * length;
        __m512 top16 = _mm512_set1_ps(-INFINITY);
        for (int64_t j = 0; j < length; j += 16) {
            const __mmask16 mask =
                length - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (length - j)) - 1);
            top16 = _mm512_mask_max_ps(top16, mask, top16, _mm512_maskz_loadu_ps(mask, s + j));
        }
        const __m512 offset = _mm512_mul_ps(_mm512_set1_ps(_mm512_reduce_max_ps(top16)),
                                            _mm512_set1_ps(-1.44269504088896341f));
        float total = 0.f;
        for (int64_t span = 0; span < length; span += Q8_SPAN) {
            const int64_t end = span + Q8_SPAN < length ? span + Q8_SPAN : length;
            __m512 partial = _mm512_setzero_ps(), largest = _mm512_setzero_ps();
            for (int64_t j = span; j < span + Q8_SPAN; j += 16) {
                const __mmask16 mask = j >= end         ? (__mmask16)0
                                       : end - j >= 16 ? (__mmask16)0xffff
                                                       : (__mmask16)((1u << (end - j)) - 1);
                const __m512 e = exp2_weights(
                    _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, s + j), log2e, offset), mask);
                partial = _mm512_add_ps(partial, e);
                const __m512 weight = _mm512_mul_ps(e, _mm512_maskz_loadu_ps(mask, vs + j));
                _mm512_storeu_ps(weights + (j - span), weight);
                largest = _mm512_max_ps(largest, weight);
            }
            total = total + q8_tree16_lanes(partial);
            const float most = _mm512_reduce_max_ps(largest);
            const __m512 to_int = _mm512_set1_ps(most > 0.f ? Q8_SCALE / most : 0.f);
            span_scale[g * spans + span / Q8_SPAN] = most / Q8_SCALE;
            for (int64_t j = 0; j < Q8_SPAN; j += 16)
                _mm256_storeu_si256(
                    (__m256i *)(w + g * padded + span + j),
                    _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(
                        _mm512_mul_ps(_mm512_loadu_ps(weights + j), to_int))));
        }
        inverse[g] = 1.f / (total > 1e-30f ? total : 1e-30f);
    }
    /* values, span by span */
    memset(sums, 0, sizeof(float) * group * hd);
    for (int64_t span = 0; span < spans; span++) {
        const int64_t first = span * Q8_SPAN / 2;
        const int64_t end = (span + 1) * Q8_SPAN / 2 < (length + 1) / 2 ? (span + 1) * Q8_SPAN / 2
                                                                         : (length + 1) / 2;
        q8_row_values_heads(hd, group, w, padded, v_head, slots, length, first, end,
                            span_scale + span, spans, sums);
    }
    for (int64_t g = 0; g < group; g++)
        q8_store_row(sums + g * hd, inverse[g], hd, out, bf16, g * hd);
}

#define TILE_ROWS 32

/* Scores of NV lane vectors (16 query rows each) against the n keys of one block (the first
 * at position `first`), four keys at a time, the accumulators (4 keys x NV vectors) in
 * registers (NV and QUADS are constants). Each lane's running maximum (`top`) is kept over the
 * keys its row sees (position below its limit). */
static inline __attribute__((always_inline)) void q8_scores_fixed(
    const int NV, const int32_t *qt, int64_t width, const int quads, const int32_t *keys,
    const float *key_scales, int64_t n, int64_t first, const int32_t *limits,
    const float *q_scale, const float *q_bias, float *st, float *top) {
    __m512 tops[4];
    for (int v = 0; v < NV; v++) tops[v] = _mm512_loadu_ps(top + v * 16);
    for (int64_t j = 0; j < n; j += 4) {
        /* a block's last keys: read the last valid key again, store only the valid ones */
        const int32_t *key[4];
        for (int k = 0; k < 4; k++) key[k] = keys + (j + k < n ? j + k : n - 1) * quads;
        __m512i acc[4][4];
        for (int k = 0; k < 4; k++)
            for (int v = 0; v < NV; v++) acc[k][v] = _mm512_setzero_si512();
#pragma GCC unroll 32
        for (int64_t p = 0; p < quads; p++) {
            __m512i lanes[4];
            for (int v = 0; v < NV; v++) lanes[v] = _mm512_loadu_si512(qt + p * width + v * 16);
            for (int k = 0; k < 4; k++) {
                const __m512i bytes = _mm512_set1_epi32(key[k][p]);
                for (int v = 0; v < NV; v++)
                    acc[k][v] = _mm512_dpbusd_epi32(acc[k][v], bytes, lanes[v]);
            }
        }
        for (int k = 0; k < 4 && j + k < n; k++) {
            const __m512 ks = _mm512_set1_ps(key_scales[j + k]);
            const __m512i index = _mm512_set1_epi32((int32_t)(first + j + k));
            for (int v = 0; v < NV; v++) {
                const __m512 dots = _mm512_sub_ps(_mm512_cvtepi32_ps(acc[k][v]),
                                                  _mm512_loadu_ps(q_bias + v * 16));
                const __m512 score =
                    _mm512_mul_ps(dots, _mm512_mul_ps(ks, _mm512_loadu_ps(q_scale + v * 16)));
                _mm512_storeu_ps(st + (j + k) * width + v * 16, score);
                const __mmask16 seen =
                    _mm512_cmpgt_epi32_mask(_mm512_loadu_si512(limits + v * 16), index);
                tops[v] = _mm512_mask_max_ps(tops[v], seen, tops[v], score);
            }
        }
    }
    for (int v = 0; v < NV; v++) _mm512_storeu_ps(top + v * 16, tops[v]);
}

static inline void q8_scores_tile(int64_t nv, const int32_t *qt, int64_t width, int64_t quads,
                                  const int32_t *keys, const float *key_scales, int64_t n,
                                  int64_t first, const int32_t *limits, const float *q_scale,
                                  const float *q_bias, float *st, float *top) {
#define Q8_SCORES(NV, QUADS)                                                                       \
    q8_scores_fixed(NV, qt, width, QUADS, keys, key_scales, n, first, limits, q_scale, q_bias,    \
                    st, top)
    /* the numbers of lane vectors and of dimension quads are constants in each case, so the
     * quad loop unrolls and the accumulators stay in registers */
    if (quads == 16) {
        switch (nv) {
        case 1: Q8_SCORES(1, 16); break;
        case 2: Q8_SCORES(2, 16); break;
        case 3: Q8_SCORES(3, 16); break;
        default: Q8_SCORES(4, 16); break;
        }
    } else {
        switch (nv) {
        case 1: Q8_SCORES(1, 32); break;
        case 2: Q8_SCORES(2, 32); break;
        case 3: Q8_SCORES(3, 32); break;
        default: Q8_SCORES(4, 32); break;
        }
    }
#undef Q8_SCORES
}

/* Floats of work space a tile needs (q8_tile_task's layout). */
static inline int64_t q8_tile_floats(int64_t rows, int64_t group, int64_t hd, int64_t longest) {
    const int64_t width = (rows * group + 15) / 16 * 16, pairs = (longest + 1) / 2;
    const int64_t spans = (longest + Q8_SPAN - 1) / Q8_SPAN;
    return (hd / 4 + 5) * width + longest + longest * width + pairs * width + spans * width +
           Q8_SPAN / 2 * hd + width * hd + 2 * longest + 64;
}

/*
 * Consecutive rows of one prefill chunk (one table, lengths growing by one), up to TILE_ROWS
 * of them, against one KV head, in the arithmetic of q8_row_task, with the tile's R * group
 * query rows laid out across vector lanes (lane l: row l / group, query head l % group): one
 * VNNI instruction scores 16 query rows on four dimensions of a key with no horizontal sums,
 * the weights of each lane are made down the lanes, and the value rows of a span are
 * interleaved once for every lane of the tile.
 */
static void q8_tile_task(const void *q, int bf16, int64_t q_row_stride, void *out,
                         int64_t out_row_stride, const uint8_t *k_head, const int8_t *v_head,
                         const float *k_scales, const float *v_scales, const int64_t *table,
                         const int64_t *lengths, int64_t rows, int64_t group, int64_t hd,
                         int64_t block_size, float scale, float *work) {
    const int64_t longest = lengths[rows - 1], quads = hd / 4, pairs = (longest + 1) / 2;
    const int64_t nq = rows * group, vectors = (nq + 15) / 16, width = vectors * 16;
    const int64_t spans = (longest + Q8_SPAN - 1) / Q8_SPAN;
    int32_t *qt = (int32_t *)work;                  /* [quads][width] */
    float *q_scale = (float *)(qt + quads * width); /* [width] */
    float *q_bias = q_scale + width;                /* [width] */
    float *top = q_bias + width;                    /* [width] */
    float *inverse = top + width;                   /* [width] */
    int32_t *limits = (int32_t *)(inverse + width); /* [width] */
    float *vs = (float *)(limits + width);          /* [longest] */
    float *st = vs + longest;                       /* [longest][width] scores, then p */
    uint32_t *wp = (uint32_t *)(st + longest * width); /* [pairs][width] */
    float *span_scale = (float *)(wp + pairs * width); /* [spans][width] */
    int8_t *vt = (int8_t *)(span_scale + spans * width); /* [Q8_SPAN / 2][hd / 16][64] */
    float *sums = (float *)(vt + Q8_SPAN / 2 * hd * 4); /* [width][hd] */
    int64_t *slots = (int64_t *)(sums + width * hd); /* [longest] */

    for (int64_t l = 0; l < width; l++) {
        int8_t q8[128] __attribute__((aligned(64))) = {0};
        top[l] = -INFINITY;
        if (l < nq) {
            q8_query(q, bf16, (l / group) * q_row_stride + (l % group) * hd, hd, scale, q8,
                     &q_scale[l], &q_bias[l]);
            limits[l] = (int32_t)lengths[l / group];
        } else {
            q_scale[l] = q_bias[l] = 0.f;
            limits[l] = 0;
        }
        for (int64_t p = 0; p < quads; p++) qt[p * width + l] = ((const int32_t *)q8)[p];
    }
    q8_slots(table, block_size, longest, v_scales, slots, vs);
    const int64_t num_used = (longest + block_size - 1) / block_size;
    for (int64_t b = 0; b < num_used; b++) {
        const int64_t first = b * block_size;
        const int64_t n = longest - first < block_size ? longest - first : block_size;
        const int32_t *keys = (const int32_t *)(k_head + table[b] * block_size * hd);
        for (int64_t v0 = 0; v0 < vectors; v0 += 4)
            q8_scores_tile(vectors - v0 < 4 ? vectors - v0 : 4, qt + v0 * 16, width, quads, keys,
                           k_scales + table[b] * block_size, n, first, limits + v0 * 16,
                           q_scale + v0 * 16, q_bias + v0 * 16, st + first * width + v0 * 16,
                           top + v0 * 16);
    }
    /* weights down each lane over its row's own positions, span by span */
    const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
    for (int64_t v = 0; v < vectors; v++) {
        const __m512i lane_limits = _mm512_loadu_si512(limits + v * 16);
        const __mmask16 used = _mm512_cmpgt_epi32_mask(lane_limits, _mm512_setzero_si512());
        const __m512 offset = _mm512_mul_ps(
            _mm512_mask_blend_ps(used, _mm512_setzero_ps(), _mm512_loadu_ps(top + v * 16)),
            _mm512_set1_ps(-1.44269504088896341f));
        __m512 total = _mm512_setzero_ps();
        for (int64_t span = 0; span < longest; span += Q8_SPAN) {
            const int64_t end = span + Q8_SPAN < longest ? span + Q8_SPAN : longest;
            __m512 parts[16], largest = _mm512_setzero_ps();
            for (int i = 0; i < 16; i++) parts[i] = _mm512_setzero_ps();
            for (int64_t j0 = span; j0 < end; j0 += 16)
                for (int i = 0; i < 16; i++) {
                    const int64_t j = j0 + i;
                    if (j >= end) break;
                    const __mmask16 seen =
                        _mm512_cmpgt_epi32_mask(lane_limits, _mm512_set1_epi32((int)j));
                    float *at = st + j * width + v * 16;
                    const __m512 e = exp2_weights(
                        _mm512_fmadd_ps(_mm512_loadu_ps(at), log2e, offset), seen);
                    parts[i] = _mm512_add_ps(parts[i], e);
                    const __m512 weight = _mm512_mul_ps(e, _mm512_set1_ps(vs[j]));
                    _mm512_storeu_ps(at, weight);
                    largest = _mm512_max_ps(largest, weight);
                }
            total = _mm512_add_ps(total, q8_tree16(parts));
            const __m512 to_int = _mm512_maskz_div_ps(
                _mm512_cmp_ps_mask(largest, _mm512_setzero_ps(), _CMP_GT_OQ),
                _mm512_set1_ps(Q8_SCALE), largest);
            _mm512_storeu_ps(span_scale + span / Q8_SPAN * width + v * 16,
                             _mm512_div_ps(largest, _mm512_set1_ps(Q8_SCALE)));
            for (int64_t j = span; j < end; j += 2) {
                __m512i packed = _mm512_cvtps_epi32(
                    _mm512_mul_ps(_mm512_loadu_ps(st + j * width + v * 16), to_int));
                if (j + 1 < end)
                    packed = _mm512_or_si512(
                        packed, _mm512_slli_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(
                                                      _mm512_loadu_ps(st + (j + 1) * width + v * 16),
                                                      to_int)),
                                                  16));
                _mm512_storeu_si512(wp + j / 2 * width + v * 16, packed);
            }
        }
        _mm512_storeu_ps(inverse + v * 16,
                         _mm512_div_ps(_mm512_set1_ps(1.f),
                                       _mm512_max_ps(total, _mm512_set1_ps(1e-30f))));
    }
    /* values: span after span (its value rows interleaved once, in L1 while every lane uses
     * them), `step` lanes at a time; a group whose rows all end before the span skips it (its
     * weights there are zero, and adding zero changes no sum) */
    const int64_t step = hd == 64 ? 4 : 2;
    memset(sums, 0, sizeof(float) * width * hd);
    for (int64_t first = 0; first < pairs; first += Q8_SPAN / 2) {
        const int64_t end = first + Q8_SPAN / 2 < pairs ? first + Q8_SPAN / 2 : pairs;
        const float *scales = span_scale + first / (Q8_SPAN / 2) * width;
        q8_value_pairs(v_head, slots, hd, longest, first, end, vt);
        for (int64_t l0 = 0; l0 < nq; l0 += step) {
            const int64_t last = (l0 + step < nq ? l0 + step : nq) - 1;
            if (lengths[last / group] <= 2 * first) continue;
            q8_values_span_hd(hd, wp + first * width + l0, width, vt, end - first, scales + l0,
                              sums + l0 * hd);
        }
    }
    for (int64_t l = 0; l < nq; l++)
        q8_store_row(sums + l * hd, inverse[l], hd, out, bf16,
                     (l / group) * out_row_stride + (l % group) * hd);
}

/* As kvserve_paged_decode_* in paged_attention.c, over the int8 cache and its scales: runs of
 * consecutive rows of one prefill chunk (same table, lengths growing by one) are worked on as
 * tiles, other rows one at a time, in one arithmetic. Returns 0, -1 for shapes it refuses, -2
 * when its working memory cannot be allocated. */
#define DEFINE_ENTRY_Q8(NAME, T, BF16)                                                              \
    int NAME(const T *q, int64_t q_row_stride, const int8_t *kv, const float *scales,             \
             const int64_t *block_tables, int64_t table_width, const int64_t *row_tables,         \
             const int64_t *lengths, T *out, int64_t out_row_stride, int64_t num_seqs,            \
             int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t num_blocks,       \
             int64_t block_size, float scale, int num_threads) {                                  \
        const int64_t group = num_heads / num_kv_heads;                                           \
        if (group > MAX_GROUP || (head_dim != 64 && head_dim != 128)) return -1;                  \
        const int64_t slots = num_blocks * block_size, head_stride = slots * head_dim;            \
        const uint8_t *k_base = (const uint8_t *)kv;                                              \
        const int8_t *v_base = kv + num_kv_heads * head_stride;                                   \
        const float *k_scales = scales, *v_scales = scales + num_kv_heads * slots;                \
        int64_t *tiles = (int64_t *)malloc(sizeof(int64_t) * (num_seqs + 1));                     \
        if (!tiles) return -2;                                                                    \
        const int64_t num_tiles = cut_tiles(row_tables, lengths, num_seqs, TILE_ROWS, tiles);     \
        int failed = 0;                                                                           \
        _Pragma("omp parallel num_threads(num_threads)") {                                        \
            float *work = NULL;                                                                   \
            int64_t capacity = 0;                                                                 \
            _Pragma("omp for schedule(dynamic, 1)") for (int64_t task = 0;                        \
                                                         task < num_tiles * num_kv_heads;         \
                                                         task++) {                                \
                /* longest tiles first: they are the last rows of a chunk */                      \
                const int64_t tile = num_tiles - 1 - task / num_kv_heads, h = task % num_kv_heads; \
                const int64_t first = tiles[tile], rows = tiles[tile + 1] - first;                \
                const int64_t longest = lengths[first + rows - 1];                                \
                const int64_t need = rows > 1 ? q8_tile_floats(rows, group, head_dim, longest)    \
                                              : q8_row_floats(group, head_dim, longest);          \
                if (need > capacity) {                                                            \
                    free(work);                                                                   \
                    capacity = need * 2;                                                          \
                    work = (float *)aligned_alloc(64, (sizeof(float) * capacity + 63) / 64 * 64); \
                    if (!work) {                                                                  \
                        capacity = 0;                                                             \
                        _Pragma("omp atomic write") failed = 1;                                   \
                        continue;                                                                 \
                    }                                                                             \
                }                                                                                 \
                const T *qrow = q + first * q_row_stride + h * group * head_dim;                  \
                T *orow = out + first * out_row_stride + h * group * head_dim;                    \
                const int64_t *table =                                                            \
                    block_tables + (row_tables ? row_tables[first] : first) * table_width;        \
                const uint8_t *k_head = k_base + h * head_stride;                                 \
                const int8_t *v_head = v_base + h * head_stride;                                  \
                if (rows > 1)                                                                     \
                    q8_tile_task(qrow, BF16, q_row_stride, orow, out_row_stride, k_head, v_head,  \
                                 k_scales + h * slots, v_scales + h * slots, table,               \
                                 lengths + first, rows, group, head_dim, block_size, scale,       \
                                 work);                                                           \
                else                                                                              \
                    q8_row_task(qrow, BF16, orow, k_head, v_head, k_scales + h * slots,           \
                                v_scales + h * slots, table, longest, group, head_dim,            \
                                block_size, scale, work);                                         \
            }                                                                                     \
            free(work);                                                                           \
        }                                                                                         \
        free(tiles);                                                                              \
        return failed ? -2 : 0;                                                                   \
    }

DEFINE_ENTRY_Q8(kvserve_paged_decode_q8_f32, float, 0)
DEFINE_ENTRY_Q8(kvserve_paged_decode_q8_bf16, uint16_t, 1)
#else
int kvserve_kv_int8_available(void) { return 0; }

#define DEFINE_ENTRY_STUB(NAME, T)                                                                  \
    int NAME(const T *q, int64_t q_row_stride, const int8_t *kv, const float *scales,             \
             const int64_t *block_tables, int64_t table_width, const int64_t *row_tables,         \
             const int64_t *lengths, T *out, int64_t out_row_stride, int64_t num_seqs,            \
             int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t num_blocks,       \
             int64_t block_size, float scale, int num_threads) {                                  \
        return -1;                                                                                \
    }
DEFINE_ENTRY_STUB(kvserve_paged_decode_q8_f32, float)
DEFINE_ENTRY_STUB(kvserve_paged_decode_q8_bf16, uint16_t)
#endif
