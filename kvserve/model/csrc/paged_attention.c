/*
 * Paged attention on the CPU, one query row at a time, reading K/V straight out of the paged
 * cache through the row's block table (no gather copy). A row attends to positions
 * 0 .. length-1 of its sequence: a decode row is one sequence's newest position; the rows of a
 * prefill chunk are several rows sharing one table (`row_tables` maps a row to its table) with
 * lengths start+1, start+2, ... so causality is just each row's length.
 *
 * Cache layout of one layer: [2][kv_heads][num_blocks][block_size][head_dim] (K then V), so the
 * positions of one head inside a block are contiguous. The `group` query heads that share a KV
 * head are handled together: each K/V row is read and converted once per (sequence, KV head).
 * Work is split over (sequence, KV head) pairs with OpenMP.
 *
 * Compiled at first use with the system C compiler (-O3 -march=native -fopenmp). libgomp is
 * resolved by soname, so the process's already-loaded OpenMP runtime (torch's) is the one used.
 */
#include <stdlib.h>
#include <string.h>

#include "common.h"

#define MAX_GROUP 16

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define HAVE_BF16_DOT 1

/* Scores of `group` bf16 query rows against `n` bf16 key rows of one block, with the CPU's
 * bf16 dot-product instruction: products are exact in float32 and summed in float32, as the
 * generic path does after converting, but without the conversion. HD is 64 or 128. */
static inline void bf16_block_scores(const void *q_rows, int64_t group, const void *keys,
                                     int64_t n, int hd, float scale, float *scores,
                                     int64_t stride) {
    const uint16_t *q = (const uint16_t *)q_rows, *k = (const uint16_t *)keys;
    for (int64_t o = 0; o < n; o++) {
        const uint16_t *row = k + o * hd;
        for (int64_t g = 0; g < group; g++) {
            __m512 acc = _mm512_setzero_ps();
            for (int d = 0; d < hd; d += 32)
                acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(row + d),
                                       (__m512bh)_mm512_loadu_si512(q + g * hd + d));
            scores[g * stride + o] = _mm512_reduce_add_ps(acc) * scale;
        }
    }
}

/* acc[g][0:64] += sum_o p[g][o] * v[o][0:64] for up to 4 query heads, the accumulators held in
 * registers for the whole block; each value row is converted to float once. Returns 0 when the
 * shape is not one it handles (the caller then takes the generic loop). */
static inline __attribute__((always_inline)) void bf16_values_fixed(
    const float *probs, const int group, const uint16_t *v, int64_t n, float *acc,
    int64_t stride) {
    __m512 a[4][4];
    for (int g = 0; g < group; g++)
        for (int c = 0; c < 4; c++) a[g][c] = _mm512_loadu_ps(acc + g * 64 + c * 16);
    for (int64_t o = 0; o < n; o++) {
        __m512 row[4];
        for (int c = 0; c < 4; c++)
            row[c] = _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256(
                (const __m256i *)(v + o * 64 + c * 16)));
        for (int g = 0; g < group; g++) {
            const __m512 p = _mm512_set1_ps(probs[g * stride + o]);
            for (int c = 0; c < 4; c++) a[g][c] = _mm512_fmadd_ps(p, row[c], a[g][c]);
        }
    }
    for (int g = 0; g < group; g++)
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(acc + g * 64 + c * 16, a[g][c]);
}

/* The group is a constant in each case, so the accumulators stay in registers. */
static inline int bf16_block_values(const float *probs, int64_t group, const void *values,
                                    int64_t n, int hd, float *acc, int64_t stride) {
    const uint16_t *v = (const uint16_t *)values;
    if (hd != 64) return 0;
    switch (group) {
    case 1: bf16_values_fixed(probs, 1, v, n, acc, stride); return 1;
    case 2: bf16_values_fixed(probs, 2, v, n, acc, stride); return 1;
    case 3: bf16_values_fixed(probs, 3, v, n, acc, stride); return 1;
    case 4: bf16_values_fixed(probs, 4, v, n, acc, stride); return 1;
    default: return 0;
    }
}
#else
#define HAVE_BF16_DOT 0
static inline int bf16_block_values(const float *probs, int64_t group, const void *values,
                                    int64_t n, int hd, float *acc, int64_t stride) {
    (void)probs, (void)group, (void)values, (void)n, (void)hd, (void)acc, (void)stride;
    return 0;
}
static inline void bf16_block_scores(const void *q_rows, int64_t group, const void *keys,
                                     int64_t n, int hd, float scale, float *scores,
                                     int64_t stride) {
    (void)q_rows, (void)group, (void)keys, (void)n, (void)hd, (void)scale, (void)scores,
        (void)stride;
}
#endif

/* One (sequence, KV head) task, head_dim fixed at compile time so the inner loops vectorize. */
#define DEFINE_TASK(NAME, T, LOAD, STORE, HD, BF16_DOT)                                             \
    static void NAME(const T *q, T *out, const T *k_head, const T *v_head, const int64_t *table,   \
                     int64_t length, int64_t group, int64_t block_size, float scale,              \
                     float *scores) {                                                             \
        float qf[MAX_GROUP][HD], acc[MAX_GROUP][HD], row[HD];                                     \
        for (int64_t g = 0; g < group; g++) {                                                     \
            for (int d = 0; d < HD; d++) qf[g][d] = LOAD(q[g * HD + d]) * scale;                  \
            memset(acc[g], 0, sizeof(acc[g]));                                                    \
        }                                                                                         \
        const int64_t num_used = (length + block_size - 1) / block_size;                          \
        for (int64_t b = 0; b < num_used; b++) {                                                  \
            const T *base = k_head + table[b] * block_size * HD;                                  \
            const int64_t n = length - b * block_size < block_size ? length - b * block_size      \
                                                                   : block_size;                  \
            if (BF16_DOT) {                                                                       \
                bf16_block_scores(q, group, base, n, HD, scale, scores + b * block_size, length); \
                continue;                                                                         \
            }                                                                                     \
            for (int64_t o = 0; o < n; o++) {                                                     \
                const T *k = base + o * HD;                                                       \
                _Pragma("omp simd") for (int d = 0; d < HD; d++) row[d] = LOAD(k[d]);             \
                for (int64_t g = 0; g < group; g++) {                                             \
                    float s = 0.f;                                                                \
                    _Pragma("omp simd reduction(+ : s)") for (int d = 0; d < HD; d++) s +=        \
                        qf[g][d] * row[d];                                                        \
                    scores[g * length + b * block_size + o] = s;                                  \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
        for (int64_t g = 0; g < group; g++) {                                                     \
            float *s = scores + g * length, top = -INFINITY, total = 0.f;                         \
            _Pragma("omp simd reduction(max : top)") for (int64_t j = 0; j < length; j++) top =   \
                s[j] > top ? s[j] : top;                                                          \
            _Pragma("omp simd reduction(+ : total)") for (int64_t j = 0; j < length; j++) {       \
                s[j] = exp_approx(s[j] - top);                                                   \
                total += s[j];                                                                    \
            }                                                                                     \
            const float inv = 1.f / total;                                                        \
            _Pragma("omp simd") for (int64_t j = 0; j < length; j++) s[j] *= inv;                 \
        }                                                                                         \
        for (int64_t b = 0; b < num_used; b++) {                                                  \
            const T *base = v_head + table[b] * block_size * HD;                                  \
            const int64_t n = length - b * block_size < block_size ? length - b * block_size      \
                                                                   : block_size;                  \
            if (BF16_DOT && bf16_block_values(scores + b * block_size, group, base, n, HD,         \
                                              &acc[0][0], length))                                \
                continue;                                                                         \
            for (int64_t o = 0; o < n; o++) {                                                     \
                const T *v = base + o * HD;                                                       \
                _Pragma("omp simd") for (int d = 0; d < HD; d++) row[d] = LOAD(v[d]);             \
                for (int64_t g = 0; g < group; g++) {                                             \
                    const float p = scores[g * length + b * block_size + o];                      \
                    _Pragma("omp simd") for (int d = 0; d < HD; d++) acc[g][d] += p * row[d];     \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
        for (int64_t g = 0; g < group; g++)                                                       \
            for (int d = 0; d < HD; d++) out[g * HD + d] = STORE(acc[g][d]);                      \
    }

DEFINE_TASK(task_f32_64, float, float_identity, float_identity, 64, 0)
DEFINE_TASK(task_f32_128, float, float_identity, float_identity, 128, 0)
DEFINE_TASK(task_bf16_64, uint16_t, bf16_to_float, float_to_bf16, 64, HAVE_BF16_DOT)
DEFINE_TASK(task_bf16_128, uint16_t, bf16_to_float, float_to_bf16, 128, HAVE_BF16_DOT)

#define DEFINE_ENTRY(NAME, T, TASK64, TASK128)                                                      \
    int NAME(const T *q, int64_t q_row_stride, const T *kv, const int64_t *block_tables,          \
             int64_t table_width, const int64_t *row_tables, const int64_t *lengths, T *out,      \
             int64_t out_row_stride,                                                              \
             int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,         \
             int64_t num_blocks, int64_t block_size, float scale, int num_threads) {              \
        const int64_t group = num_heads / num_kv_heads;                                           \
        if (group > MAX_GROUP || (head_dim != 64 && head_dim != 128)) return -1;                  \
        const int64_t head_stride = num_blocks * block_size * head_dim;                           \
        const T *k_base = kv, *v_base = kv + num_kv_heads * head_stride;                          \
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
                    TASK64(qrow, orow, k_base + h * head_stride, v_base + h * head_stride, table, \
                           length, group, block_size, scale, scores);                             \
                else                                                                              \
                    TASK128(qrow, orow, k_base + h * head_stride, v_base + h * head_stride,       \
                            table, length, group, block_size, scale, scores);                     \
            }                                                                                     \
            free(scores);                                                                         \
        }                                                                                         \
        return 0;                                                                                 \
    }

DEFINE_ENTRY(kvserve_paged_decode_f32, float, task_f32_64, task_f32_128)
DEFINE_ENTRY(kvserve_paged_decode_bf16, uint16_t, task_bf16_64, task_bf16_128)
