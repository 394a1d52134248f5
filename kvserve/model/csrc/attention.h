/*
 * The "attention" kernel family (paged_attention.c): paged attention over a cache in the model
 * dtype. Each returns 0, -1 for shapes it refuses, -2 when its working memory cannot be
 * allocated. `kvserve_paged_attention_*` take a sliding window (positions a row attends to,
 * 0: all) and a soft cap on the scores (0: none); `kvserve_paged_decode_*` are them with
 * neither (what the one-call layer drivers call).
 */
#ifndef KVSERVE_ATTENTION_H
#define KVSERVE_ATTENTION_H

#include <stdint.h>

int kvserve_paged_decode_f32(const float *q, int64_t q_row_stride, const float *kv,
                             const int64_t *block_tables, int64_t table_width,
                             const int64_t *row_tables, const int64_t *lengths, float *out,
                             int64_t out_row_stride, int64_t num_seqs, int64_t num_heads,
                             int64_t num_kv_heads, int64_t head_dim, int64_t num_blocks,
                             int64_t block_size, float scale, int num_threads);
int kvserve_paged_decode_bf16(const uint16_t *q, int64_t q_row_stride, const uint16_t *kv,
                              const int64_t *block_tables, int64_t table_width,
                              const int64_t *row_tables, const int64_t *lengths, uint16_t *out,
                              int64_t out_row_stride, int64_t num_seqs, int64_t num_heads,
                              int64_t num_kv_heads, int64_t head_dim, int64_t num_blocks,
                              int64_t block_size, float scale, int num_threads);

int kvserve_paged_attention_f32(const float *q, int64_t q_row_stride, const float *kv,
                                const int64_t *block_tables, int64_t table_width,
                                const int64_t *row_tables, const int64_t *lengths, float *out,
                                int64_t out_row_stride, int64_t num_seqs, int64_t num_heads,
                                int64_t num_kv_heads, int64_t head_dim, int64_t num_blocks,
                                int64_t block_size, float scale, int64_t window, float softcap,
                                int num_threads);
int kvserve_paged_attention_bf16(const uint16_t *q, int64_t q_row_stride, const uint16_t *kv,
                                 const int64_t *block_tables, int64_t table_width,
                                 const int64_t *row_tables, const int64_t *lengths, uint16_t *out,
                                 int64_t out_row_stride, int64_t num_seqs, int64_t num_heads,
                                 int64_t num_kv_heads, int64_t head_dim, int64_t num_blocks,
                                 int64_t block_size, float scale, int64_t window, float softcap,
                                 int num_threads);

#endif
