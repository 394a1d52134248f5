/*
 * The "layer_ops" kernel family (layer_ops.c): fused elementwise work of a float layer.
 * `_f32` and `_bf16` name the model dtype (bf16 values are uint16_t).
 */
#ifndef KVSERVE_LAYER_OPS_H
#define KVSERVE_LAYER_OPS_H

#include <stdint.h>

void kvserve_add_rmsnorm_f32(float *x, const float *delta, const float *weight, float *out,
                             int64_t rows, int64_t hidden, float eps, int num_threads);
void kvserve_add_rmsnorm_bf16(float *x, const uint16_t *delta, const float *weight,
                              uint16_t *out, int64_t rows, int64_t hidden, float eps,
                              int num_threads);
void kvserve_silu_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t width,
                          int num_threads);
void kvserve_silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t width,
                           int num_threads);
void kvserve_gelu_tanh_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t width,
                               int num_threads);
void kvserve_gelu_tanh_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows,
                                int64_t width, int num_threads);
void kvserve_rope_store_f32(float *qkv, const int64_t *positions, const float *cos_table,
                            const float *sin_table, const int64_t *slots, float *kv, int64_t rows,
                            int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t num_slots,
                            int num_threads);
void kvserve_rope_store_bf16(uint16_t *qkv, const int64_t *positions, const float *cos_table,
                             const float *sin_table, const int64_t *slots, uint16_t *kv,
                             int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim,
                             int64_t num_slots, int num_threads);
void kvserve_qk_norm_f32(float *qkv, int64_t rows, int64_t width, int64_t num_heads,
                         int64_t head_dim, const float *weight, float eps, int num_threads);
void kvserve_qk_norm_bf16(uint16_t *qkv, int64_t rows, int64_t width, int64_t num_heads,
                          int64_t head_dim, const float *weight, float eps, int num_threads);
int kvserve_word_sums(int64_t count, const uint8_t *const *data, const int64_t *nbytes,
                      uint64_t *sums, int num_threads);

#endif
