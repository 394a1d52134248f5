/*
 * Declarations of the typed kernels the one-call layer drivers (forward_int8.c, forward_q4.c)
 * share: RoPE with the cache write, and paged decode attention, over a cache in the model dtype
 * or in int8. `_f32` and `_bf16` name the model dtype.
 */
#ifndef KVSERVE_KERNELS_H
#define KVSERVE_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#define KVSERVE_DECLARE_ATTENTION(T, SUFFIX)                                                       \
    void kvserve_rope_store_##SUFFIX(T *qkv, const int64_t *positions, const float *cos_table,    \
                                     const float *sin_table, const int64_t *slots, T *kv,         \
                                     int64_t rows, int64_t heads, int64_t kv_heads,               \
                                     int64_t head_dim, int64_t num_slots, int num_threads);       \
    void kvserve_rope_store_q8_##SUFFIX(T *qkv, const int64_t *positions,                        \
                                        const float *cos_table, const float *sin_table,           \
                                        const int64_t *slots, int8_t *kv, float *scales,          \
                                        int64_t rows, int64_t heads, int64_t kv_heads,            \
                                        int64_t head_dim, int64_t num_slots, int num_threads);    \
    int kvserve_paged_decode_##SUFFIX(                                                            \
        const T *q, int64_t q_row_stride, const T *kv, const int64_t *block_tables,               \
        int64_t table_width, const int64_t *row_tables, const int64_t *lengths, T *out,           \
        int64_t out_row_stride, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,        \
        int64_t head_dim, int64_t num_blocks, int64_t block_size, float scale, int num_threads);  \
    int kvserve_paged_decode_q8_##SUFFIX(                                                         \
        const T *q, int64_t q_row_stride, const int8_t *kv, const float *scales,                  \
        const int64_t *block_tables, int64_t table_width, const int64_t *row_tables,              \
        const int64_t *lengths, T *out, int64_t out_row_stride, int64_t num_seqs,                 \
        int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t num_blocks,            \
        int64_t block_size, float scale, int num_threads);

KVSERVE_DECLARE_ATTENTION(float, f32)
KVSERVE_DECLARE_ATTENTION(uint16_t, bf16)

/* RoPE on q and k of `qkv` ([rows][q + 2 kv], in place), k and v written into the cache (in the
 * model dtype, or int8 with its scales when kv_scales is given), then attention of each row's
 * q over its positions into attn ([rows][q]). Returns the attention kernel's status. */
#define KVSERVE_DEFINE_STORE_AND_ATTEND(T, SUFFIX)                                                 \
    static inline int kvserve_store_and_attend_##SUFFIX(                                          \
        T *qkv, T *attn, void *kv, float *kv_scales, int64_t rows, int64_t heads,                 \
        int64_t kv_heads, int64_t hd, const int64_t *positions, const float *cos,                 \
        const float *sin, const int64_t *slots, const int64_t *tables, int64_t table_width,       \
        const int64_t *row_tables, const int64_t *lengths, int64_t num_blocks,                    \
        int64_t block_size, float scale, int nt) {                                                \
        const int64_t width = (heads + 2 * kv_heads) * hd, q_size = heads * hd;                   \
        const int64_t slots_n = num_blocks * block_size;                                          \
        int status;                                                                               \
        if (kv_scales) {                                                                          \
            kvserve_rope_store_q8_##SUFFIX(qkv, positions, cos, sin, slots, (int8_t *)kv,         \
                                           kv_scales, rows, heads, kv_heads, hd, slots_n, nt);    \
            status = kvserve_paged_decode_q8_##SUFFIX(                                            \
                qkv, width, (const int8_t *)kv, kv_scales, tables, table_width, row_tables,       \
                lengths, attn, q_size, rows, heads, kv_heads, hd, num_blocks, block_size, scale,  \
                nt);                                                                              \
        } else {                                                                                  \
            kvserve_rope_store_##SUFFIX(qkv, positions, cos, sin, slots, (T *)kv, rows, heads,    \
                                        kv_heads, hd, slots_n, nt);                               \
            status = kvserve_paged_decode_##SUFFIX(qkv, width, (const T *)kv, tables,             \
                                                   table_width, row_tables, lengths, attn,        \
                                                   q_size, rows, heads, kv_heads, hd,             \
                                                   num_blocks, block_size, scale, nt);            \
        }                                                                                         \
        return status;                                                                            \
    }

KVSERVE_DEFINE_STORE_AND_ATTEND(float, f32)
KVSERVE_DEFINE_STORE_AND_ATTEND(uint16_t, bf16)

#endif
