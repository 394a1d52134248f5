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
 * V bytes are plain signed. Everything else (softmax, the weighted sum of values) is float32.
 */
#include <stdlib.h>
#include <string.h>

#include "common.h"

#define MAX_GROUP 16

static inline float quantize_vector(const float *x, int64_t n, int8_t *q, int bias) {
    float top = 0.f;
    _Pragma("omp simd reduction(max : top)") for (int64_t i = 0; i < n; i++) {
        const float a = fabsf(x[i]);
        top = a > top ? a : top;
    }
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

/* acc[g][0:64] += sum_o probs[g][o] * v_scales[o] * v[o][0:64] for up to 4 query heads (64-wide
 * rows), the accumulators held in registers for the whole block; each value row is converted
 * to float once. */
static inline __attribute__((always_inline)) void q8_values_fixed(
    const float *probs, int64_t stride, const int group, const int8_t *v, const float *v_scales,
    int64_t n, float *acc) {
    __m512 a[4][4];
    for (int g = 0; g < group; g++)
        for (int c = 0; c < 4; c++) a[g][c] = _mm512_loadu_ps(acc + g * 64 + c * 16);
    for (int64_t o = 0; o < n; o++) {
        __m512 row[4];
        for (int c = 0; c < 4; c++)
            row[c] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                _mm_loadu_si128((const __m128i *)(v + o * 64 + c * 16))));
        for (int g = 0; g < group; g++) {
            const __m512 p = _mm512_set1_ps(probs[g * stride + o] * v_scales[o]);
            for (int c = 0; c < 4; c++) a[g][c] = _mm512_fmadd_ps(p, row[c], a[g][c]);
        }
    }
    for (int g = 0; g < group; g++)
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(acc + g * 64 + c * 16, a[g][c]);
}

/* The group is a constant in each case, so the accumulators stay in registers. */
static inline void q8_block_values(const float *probs, int64_t stride, int64_t group,
                                   const int8_t *v, const float *v_scales, int64_t n,
                                   float *acc) {
    switch (group) {
    case 1: q8_values_fixed(probs, stride, 1, v, v_scales, n, acc); break;
    case 2: q8_values_fixed(probs, stride, 2, v, v_scales, n, acc); break;
    case 3: q8_values_fixed(probs, stride, 3, v, v_scales, n, acc); break;
    default: q8_values_fixed(probs, stride, 4, v, v_scales, n, acc); break;
    }
}

/* One (sequence, KV head) task over the int8 cache; HD is 64 or 128. */
#define DEFINE_TASK_Q8(NAME, T, LOAD, STORE, HD)                                                    \
    static void NAME(const T *q, T *out, const uint8_t *k_head, const int8_t *v_head,             \
                     const float *k_scales, const float *v_scales, const int64_t *table,          \
                     int64_t length, int64_t group, int64_t block_size, float scale,              \
                     float *scores) {                                                             \
        int8_t q8[MAX_GROUP][HD] __attribute__((aligned(64)));                                    \
        float q_scale[MAX_GROUP], q_bias[MAX_GROUP], acc[MAX_GROUP][HD], row[HD];                 \
        for (int64_t g = 0; g < group; g++) {                                                     \
            for (int d = 0; d < HD; d++) row[d] = LOAD(q[g * HD + d]) * scale;                    \
            q_scale[g] = quantize_vector(row, HD, q8[g], 0);                                      \
            int sum = 0;                                                                          \
            for (int d = 0; d < HD; d++) sum += q8[g][d];                                         \
            q_bias[g] = 128.f * (float)sum;                                                       \
            memset(acc[g], 0, sizeof(acc[g]));                                                    \
        }                                                                                         \
        const int64_t num_used = (length + block_size - 1) / block_size;                          \
        for (int64_t b = 0; b < num_used; b++) {                                                  \
            const uint8_t *keys = k_head + table[b] * block_size * HD;                            \
            const float *ks = k_scales + table[b] * block_size;                                   \
            const int64_t n = length - b * block_size < block_size ? length - b * block_size      \
                                                                   : block_size;                  \
            for (int64_t o0 = 0; o0 < n; o0 += 16) {                                              \
                const int64_t m = n - o0 < 16 ? n - o0 : 16;                                      \
                const __mmask16 mask = m == 16 ? (__mmask16)0xffff : (__mmask16)((1u << m) - 1);  \
                const __m512 key_scales = _mm512_maskz_loadu_ps(mask, ks + o0);                   \
                for (int64_t g = 0; g < group; g++) {                                             \
                    __m512 partial[16];                                                           \
                    for (int64_t j = 0; j < 16; j++) {                                            \
                        __m512i dot = _mm512_setzero_si512();                                     \
                        if (j < m)                                                                \
                            for (int d = 0; d < HD; d += 64)                                      \
                                dot = _mm512_dpbusd_epi32(                                        \
                                    dot, _mm512_loadu_si512(keys + (o0 + j) * HD + d),            \
                                    _mm512_load_si512(&q8[g][d]));                                \
                        partial[j] = _mm512_cvtepi32_ps(dot);                                     \
                    }                                                                             \
                    const __m512 dots = _mm512_sub_ps(sum16(partial), _mm512_set1_ps(q_bias[g])); \
                    _mm512_mask_storeu_ps(                                                        \
                        scores + g * length + b * block_size + o0, mask,                          \
                        _mm512_mul_ps(_mm512_mul_ps(dots, key_scales), _mm512_set1_ps(q_scale[g]))); \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
        softmax_rows(scores, group, length);                                                      \
        for (int64_t b = 0; b < num_used; b++) {                                                  \
            const int8_t *values = v_head + table[b] * block_size * HD;                           \
            const float *vs = v_scales + table[b] * block_size;                                   \
            const int64_t n = length - b * block_size < block_size ? length - b * block_size      \
                                                                   : block_size;                  \
            if (HD == 64 && group <= 4) {                                                         \
                q8_block_values(scores + b * block_size, length, group, values, vs, n,           \
                                &acc[0][0]);                                                      \
                continue;                                                                         \
            }                                                                                     \
            for (int64_t o = 0; o < n; o++) {                                                     \
                const int8_t *v = values + o * HD;                                                \
                _Pragma("omp simd") for (int d = 0; d < HD; d++) row[d] = (float)v[d] * vs[o];    \
                for (int64_t g = 0; g < group; g++) {                                             \
                    const float p = scores[g * length + b * block_size + o];                      \
                    _Pragma("omp simd") for (int d = 0; d < HD; d++) acc[g][d] += p * row[d];     \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
        for (int64_t g = 0; g < group; g++)                                                       \
            for (int d = 0; d < HD; d++) out[g * HD + d] = STORE(acc[g][d]);                      \
    }

DEFINE_TASK_Q8(task_q8_f32_64, float, float_identity, float_identity, 64)
DEFINE_TASK_Q8(task_q8_f32_128, float, float_identity, float_identity, 128)
DEFINE_TASK_Q8(task_q8_bf16_64, uint16_t, bf16_to_float, float_to_bf16, 64)
DEFINE_TASK_Q8(task_q8_bf16_128, uint16_t, bf16_to_float, float_to_bf16, 128)

/* As kvserve_paged_decode_* in paged_attention.c, over the int8 cache and its scales. */
#define DEFINE_ENTRY_Q8(NAME, T, TASK64, TASK128)                                                   \
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
        _Pragma("omp parallel num_threads(num_threads)") {                                        \
            float *scores = NULL;                                                                 \
            int64_t capacity = 0;                                                                 \
            _Pragma("omp for schedule(dynamic, 4)") for (int64_t task = 0;                        \
                                                         task < num_seqs * num_kv_heads; task++) { \
                const int64_t seq = task / num_kv_heads, h = task % num_kv_heads;                 \
                const int64_t length = lengths[seq];                                              \
                if (group * length > capacity) {                                                  \
                    free(scores);                                                                 \
                    capacity = group * length * 2;                                                \
                    scores = (float *)malloc(sizeof(float) * capacity);                           \
                }                                                                                 \
                const T *qrow = q + seq * q_row_stride + h * group * head_dim;                    \
                T *orow = out + seq * out_row_stride + h * group * head_dim;                       \
                const int64_t *table =                                                            \
                    block_tables + (row_tables ? row_tables[seq] : seq) * table_width;            \
                if (head_dim == 64)                                                               \
                    TASK64(qrow, orow, k_base + h * head_stride, v_base + h * head_stride,        \
                           k_scales + h * slots, v_scales + h * slots, table, length, group,      \
                           block_size, scale, scores);                                            \
                else                                                                              \
                    TASK128(qrow, orow, k_base + h * head_stride, v_base + h * head_stride,       \
                            k_scales + h * slots, v_scales + h * slots, table, length, group,     \
                            block_size, scale, scores);                                           \
            }                                                                                     \
            free(scores);                                                                         \
        }                                                                                         \
        return 0;                                                                                 \
    }

DEFINE_ENTRY_Q8(kvserve_paged_decode_q8_f32, float, task_q8_f32_64, task_q8_f32_128)
DEFINE_ENTRY_Q8(kvserve_paged_decode_q8_bf16, uint16_t, task_q8_bf16_64, task_q8_bf16_128)
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
