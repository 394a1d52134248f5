/*
 * The "kv_int8" kernel family (kv_int8.c): the int8 KV cache, written by RoPE + store and read
 * by paged attention. kvserve_kv_int8_available is 1 where the CPU has AVX512-VNNI (the
 * attention entries then run), else 0 (they refuse with -1).
 */
#ifndef KVSERVE_KV_INT8_H
#define KVSERVE_KV_INT8_H

#include <stdint.h>

int kvserve_kv_int8_available(void);
void kvserve_rope_store_q8_f32(float *qkv, const int64_t *positions, const float *cos_table,
                               const float *sin_table, const int64_t *slots, int8_t *kv,
                               float *scales, int64_t rows, int64_t heads, int64_t kv_heads,
                               int64_t head_dim, int64_t num_slots, int num_threads);
void kvserve_rope_store_q8_bf16(uint16_t *qkv, const int64_t *positions, const float *cos_table,
                                const float *sin_table, const int64_t *slots, int8_t *kv,
                                float *scales, int64_t rows, int64_t heads, int64_t kv_heads,
                                int64_t head_dim, int64_t num_slots, int num_threads);
int kvserve_paged_decode_q8_f32(const float *q, int64_t q_row_stride, const int8_t *kv,
                                const float *scales, const int64_t *block_tables,
                                int64_t table_width, const int64_t *row_tables,
                                const int64_t *lengths, float *out, int64_t out_row_stride,
                                int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                                int64_t head_dim, int64_t num_blocks, int64_t block_size,
                                float scale, int num_threads);
int kvserve_paged_decode_q8_bf16(const uint16_t *q, int64_t q_row_stride, const int8_t *kv,
                                 const float *scales, const int64_t *block_tables,
                                 int64_t table_width, const int64_t *row_tables,
                                 const int64_t *lengths, uint16_t *out, int64_t out_row_stride,
                                 int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                                 int64_t head_dim, int64_t num_blocks, int64_t block_size,
                                 float scale, int num_threads);

#endif
