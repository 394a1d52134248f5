/*
 * The "f32_gemm" kernel family (f32_gemm.c): the float32 row product for few rows.
 * kvserve_f32_gemm_available: 1 where it was built with AVX2 and FMA, else 0.
 */
#ifndef KVSERVE_F32_GEMM_H
#define KVSERVE_F32_GEMM_H

#include <stdint.h>

int kvserve_f32_gemm_available(void);
void kvserve_f32_gemm(const float *x, int64_t rows, int64_t k, const float *w, int64_t n,
                      const float *bias, float *out, int num_threads);

#endif
