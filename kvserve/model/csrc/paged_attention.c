/*
 * Paged decode attention on the CPU: one query row per sequence, reading K/V straight out of
 * the paged cache through each sequence's block table (no gather copy).
 *
 * Cache layout of one layer: [2][kv_heads][num_blocks][block_size][head_dim] (K then V), so the
 * positions of one head inside a block are contiguous. The `group` query heads that share a KV
 * head are handled together, so each K/V row is read once per (sequence, KV head).
 *
 * Compiled at first use with the system C compiler (-O3 -march=native -fopenmp). libgomp is
 * resolved by soname, so the process's already-loaded OpenMP runtime (torch's) is the one used.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_float(uint16_t h) {
    union { uint32_t u; float f; } x;
    x.u = (uint32_t)h << 16;
    return x.f;
}

static inline uint16_t float_to_bf16(float f) {
    union { uint32_t u; float f; } x;
    x.f = f;
    if ((x.u & 0x7f800000u) == 0x7f800000u && (x.u & 0x007fffffu)) return (uint16_t)((x.u >> 16) | 0x40);
    uint32_t rounding = 0x7fffu + ((x.u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)((x.u + rounding) >> 16);
}

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256

/* Shared body; LOAD converts one cache/query element to float, STORE writes one output. */
#define PAGED_DECODE_BODY(T, LOAD, STORE)                                                          \
    const int64_t group = num_heads / num_kv_heads;                                                 \
    const int64_t head_stride = num_blocks * block_size * head_dim; /* one KV head */              \
    const T *k_base = kv;                                                                           \
    const T *v_base = kv + num_kv_heads * head_stride;                                              \
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads(num_threads)")                      \
    for (int64_t task = 0; task < num_seqs * num_kv_heads; task++) {                                \
        const int64_t seq = task / num_kv_heads, kvh = task % num_kv_heads;                         \
        const int64_t length = lengths[seq];                                                        \
        const int64_t *table = block_tables + seq * table_width;                                    \
        float qf[MAX_GROUP][MAX_HEAD_DIM];                                                          \
        float acc[MAX_GROUP][MAX_HEAD_DIM];                                                         \
        float *scores = (float *)malloc(sizeof(float) * group * (length > 0 ? length : 1));         \
        const T *qrow = q + seq * q_row_stride + kvh * group * head_dim;                            \
        for (int64_t g = 0; g < group; g++)                                                         \
            for (int64_t d = 0; d < head_dim; d++) qf[g][d] = LOAD(qrow[g * head_dim + d]) * scale; \
        const T *k_head = k_base + kvh * head_stride;                                               \
        const T *v_head = v_base + kvh * head_stride;                                               \
        for (int64_t j = 0; j < length; j++) {                                                      \
            const T *krow = k_head + (table[j / block_size] * block_size + j % block_size) * head_dim; \
            for (int64_t g = 0; g < group; g++) {                                                   \
                float s = 0.f;                                                                      \
                _Pragma("omp simd reduction(+:s)")                                                  \
                for (int64_t d = 0; d < head_dim; d++) s += qf[g][d] * LOAD(krow[d]);              \
                scores[g * length + j] = s;                                                         \
            }                                                                                       \
        }                                                                                           \
        for (int64_t g = 0; g < group; g++) {                                                       \
            float *sg = scores + g * length;                                                        \
            float top = -INFINITY, total = 0.f;                                                     \
            for (int64_t j = 0; j < length; j++) top = sg[j] > top ? sg[j] : top;                   \
            for (int64_t j = 0; j < length; j++) { sg[j] = expf(sg[j] - top); total += sg[j]; }     \
            const float inv = total > 0.f ? 1.f / total : 0.f;                                      \
            for (int64_t j = 0; j < length; j++) sg[j] *= inv;                                      \
            memset(acc[g], 0, sizeof(float) * head_dim);                                            \
        }                                                                                           \
        for (int64_t j = 0; j < length; j++) {                                                      \
            const T *vrow = v_head + (table[j / block_size] * block_size + j % block_size) * head_dim; \
            for (int64_t g = 0; g < group; g++) {                                                   \
                const float p = scores[g * length + j];                                             \
                _Pragma("omp simd")                                                                 \
                for (int64_t d = 0; d < head_dim; d++) acc[g][d] += p * LOAD(vrow[d]);             \
            }                                                                                       \
        }                                                                                           \
        T *orow = out + seq * out_row_stride + kvh * group * head_dim;                              \
        for (int64_t g = 0; g < group; g++)                                                         \
            for (int64_t d = 0; d < head_dim; d++) orow[g * head_dim + d] = STORE(acc[g][d]);       \
        free(scores);                                                                               \
    }

#define IDENTITY(x) (x)

int kvserve_paged_decode_f32(const float *q, int64_t q_row_stride, const float *kv,
                             const int64_t *block_tables, int64_t table_width,
                             const int64_t *lengths, float *out, int64_t out_row_stride,
                             int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                             int64_t head_dim, int64_t num_blocks, int64_t block_size, float scale,
                             int num_threads) {
    if (num_heads / num_kv_heads > MAX_GROUP || head_dim > MAX_HEAD_DIM) return -1;
    PAGED_DECODE_BODY(float, IDENTITY, IDENTITY)
    return 0;
}

int kvserve_paged_decode_bf16(const uint16_t *q, int64_t q_row_stride, const uint16_t *kv,
                              const int64_t *block_tables, int64_t table_width,
                              const int64_t *lengths, uint16_t *out, int64_t out_row_stride,
                              int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                              int64_t head_dim, int64_t num_blocks, int64_t block_size, float scale,
                              int num_threads) {
    if (num_heads / num_kv_heads > MAX_GROUP || head_dim > MAX_HEAD_DIM) return -1;
    PAGED_DECODE_BODY(uint16_t, bf16_to_float, float_to_bf16)
    return 0;
}
