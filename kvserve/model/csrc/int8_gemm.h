/*
 * The "int8_gemm" kernel family (int8_gemm.c): int8 rows times packed int8 weights, exact int32.
 * kvserve_int8_gemm_available: 1 with AVX512-VNNI, 2 with AVX2, 0 when neither was built.
 * kvserve_int8_gemm_amx: the rows from which on it runs on AMX-INT8 (0: never).
 */
#ifndef KVSERVE_INT8_GEMM_H
#define KVSERVE_INT8_GEMM_H

#include <stdint.h>

int kvserve_int8_gemm_available(void);
int kvserve_int8_gemm_amx(void);
void kvserve_int8_gemm(const int8_t *a, int64_t rows, int64_t k, const int8_t *packed,
                       const int32_t *correction, int64_t n, int32_t *c, int num_threads);

#endif
