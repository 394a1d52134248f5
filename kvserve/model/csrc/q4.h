/*
 * The "q4" kernel family (q4_gemm.c): products with weights kept in GGUF's Q4_0/Q4_1 blocks,
 * against activations in two-part int8 blocks of 32. kvserve_q4_available: 1 where it was
 * built with AVX512-VNNI, else 0.
 */
#ifndef KVSERVE_Q4_H
#define KVSERVE_Q4_H

#include <stdint.h>

int kvserve_q4_available(void);
void kvserve_q4_gemm(const int8_t *a, const float *scales, const float *sums, int64_t rows,
                     int64_t k, const uint8_t *packed, int64_t n, int asym, float *c,
                     int num_threads);
void kvserve_quantize_blocks_f32(const float *x, int64_t rows, int64_t width, int64_t row_stride,
                                 int8_t *q, float *scales, float *sums, int num_threads);
void kvserve_quantize_blocks_bf16(const uint16_t *x, int64_t rows, int64_t width,
                                  int64_t row_stride, int8_t *q, float *scales, float *sums,
                                  int num_threads);
void kvserve_add_rmsnorm_qb(float *x, const float *delta, const float *weight, int8_t *q,
                            float *scales, float *sums, int64_t rows, int64_t hidden, float eps,
                            int normalize, int num_threads);
void kvserve_silu_mul_qb(const float *gate_up, int8_t *q, float *scales, float *sums,
                         int64_t rows, int64_t width, int num_threads);
void kvserve_gelu_tanh_mul_qb(const float *gate_up, int8_t *q, float *scales, float *sums,
                              int64_t rows, int64_t width, int num_threads);

#endif
