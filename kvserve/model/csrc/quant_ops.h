/*
 * The "quant_ops" kernel family (quant_ops.c): the elementwise kernels of the int8 linear path
 * (SiLU and gelu-tanh gates, post-norms), the residual rotation and the top-k of logits rows.
 */
#ifndef KVSERVE_QUANT_OPS_H
#define KVSERVE_QUANT_OPS_H

#include <stdint.h>

void kvserve_quantize_rows_f32(const float *x, int64_t rows, int64_t width, int64_t row_stride,
                               int8_t *q, float *scales, int num_threads);
void kvserve_quantize_rows_bf16(const uint16_t *x, int64_t rows, int64_t width,
                                int64_t row_stride, int8_t *q, float *scales, int num_threads);
void kvserve_add_rmsnorm_q8(float *x, const int32_t *acc, const float *row_scales,
                            const float *col_scales, int8_t *q, float *scales, int64_t rows,
                            int64_t hidden, float eps, int num_threads);
void kvserve_silu_mul_q8(const int32_t *acc, const float *row_scales, const float *col_scales,
                         int8_t *q, float *scales, int64_t rows, int64_t width, int64_t block,
                         int num_threads);
void kvserve_gelu_tanh_mul_q8(const int32_t *acc, const float *row_scales,
                              const float *col_scales, int8_t *q, float *scales, int64_t rows,
                              int64_t width, int64_t block, int num_threads);
void kvserve_add_post_norm_q8(float *x, const int32_t *acc, const float *row_scales,
                              const float *col_scales, const float *weight, const float *signs,
                              int64_t rows, int64_t hidden, int64_t block, float eps,
                              int num_threads);
void kvserve_dequantize_f32(const int32_t *acc, const float *row_scales, const float *col_scales,
                            const float *bias, float *out, int64_t rows, int64_t cols,
                            int num_threads);
void kvserve_dequantize_bf16(const int32_t *acc, const float *row_scales,
                             const float *col_scales, const float *bias, uint16_t *out,
                             int64_t rows, int64_t cols, int num_threads);
void kvserve_rotate_rows(const float *x, const float *m, float *out, int64_t rows, int64_t n,
                         int num_threads);
void kvserve_topk_rows(const float *x, int64_t rows, int64_t n, int64_t k, int64_t *indices,
                       int num_threads);

#endif
