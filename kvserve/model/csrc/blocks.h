/*
 * Products with weights kept in GGUF's block formats (blocks_gemm.c): every exported symbol of
 * the family, with its full prototype. kvserve/model/kernel_build.py declares the same
 * signatures to ctypes and kvserve/model/kernels.py checks every argument before a call.
 *
 * Formats are named by their GGML type ids (ggml.h's enum ggml_type). A weight [n][k] is packed
 * into panels of KVSERVE_BLOCKS_PANEL output columns, each a run of records (one record per
 * block of the format: 32 inputs, or 256 for the K-quants) laid out for the kernel:
 * [ceil(n / 16)][k / block][record bytes]. Activations come as blocks of 32 int8 values with a
 * float32 scale and the integer sums of each half (16 values).
 */
#ifndef KVSERVE_BLOCKS_H
#define KVSERVE_BLOCKS_H

#include <stdint.h>

enum {
    KVSERVE_BLOCKS_Q4_0 = 2,
    KVSERVE_BLOCKS_Q4_1 = 3,
    KVSERVE_BLOCKS_Q5_0 = 6,
    KVSERVE_BLOCKS_Q5_1 = 7,
    KVSERVE_BLOCKS_Q8_0 = 8,
    KVSERVE_BLOCKS_Q4_K = 12,
    KVSERVE_BLOCKS_Q5_K = 13,
    KVSERVE_BLOCKS_Q6_K = 14,
};

#define KVSERVE_BLOCKS_PANEL 16 /* output columns per packed panel */
#define KVSERVE_BLOCKS_ACT 32   /* activation values per scale */

/* One packed weight of a product; several with the same inputs make a fused product whose
 * output columns are the parts' columns side by side. */
typedef struct {
    const uint8_t *packed; /* [ceil(n / 16)][k / block][record bytes] */
    const float *bias;     /* [n] or NULL */
    int64_t n;             /* output columns */
    int64_t format;        /* a KVSERVE_BLOCKS_* id */
} kvserve_blocks_weight;

/* The instructions the product was built with: 3 AVX512-VNNI, 2 AVX-VNNI, 1 AVX2, 0 none (then
 * kvserve_blocks_gemm does nothing and returns -2; the packing and quantizers still work). */
int kvserve_blocks_isa(void);

/* The rows from which on kvserve_blocks_gemm takes the K-quant parts of 8-bit products on the
 * AMX-INT8 tile unit (the same float32 results, bit for bit), 0 when it does not: built with
 * AMX-INT8 (kernel_build adds it where the CPU has it), the kernel grants the tile state, and the
 * environment variable KVSERVE_AMX is not "0" (read once per process: KVSERVE_AMX=0 keeps every
 * product on the vector tiles). */
int kvserve_blocks_amx(void);

/* The rows from which on kvserve_blocks_gemm takes the K-quant parts of 8-bit products record
 * by record, each record expanded once for all the rows (the AVX2 build without VNNI, and the
 * AVX512 one where the AMX-INT8 tile unit does not run; the same float32 results, bit for bit),
 * 0 where it does not. */
int kvserve_blocks_many_rows(void);

/* Inputs per block (32 or 256), bytes per GGUF block, bytes per packed record of 16 columns;
 * 0 for a format the family does not know. */
int64_t kvserve_blocks_block_values(int64_t format);
int64_t kvserve_blocks_gguf_bytes(int64_t format);
int64_t kvserve_blocks_record_bytes(int64_t format);

/* GGUF rows raw [n][k / block * gguf bytes] (row c: output column c) into the packed layout
 * packed [ceil(n / 16)][k / block][record bytes]; columns past n are zero. 0, or -1 for an
 * unknown format or a k that is not whole blocks. */
int kvserve_blocks_pack(int64_t format, const uint8_t *raw, int64_t n, int64_t k, uint8_t *packed,
                        int num_threads);

/* The packed weight back as float32 out [n][k], exactly as ggml dequantizes the blocks. 0 or
 * -1 as kvserve_blocks_pack. */
int kvserve_blocks_unpack(int64_t format, const uint8_t *packed, int64_t n, int64_t k, float *out,
                          int num_threads);

/* Rows x [rows][k] float32 (k a multiple of 32) as GGUF Q4_0 rows raw [rows][k / 32 * 18], with
 * ggml's reference rounding; 0, or -1 for a k that is not whole blocks. */
int kvserve_blocks_quantize_q4_0(const float *x, int64_t rows, int64_t k, uint8_t *raw,
                                 int num_threads);

/* Rows x [rows][k] (row stride row_stride elements, k a multiple of 32) as activation blocks:
 * q [rows][k] int8 in -127..127, scales [rows][k / 32], sums [rows][k / 16] (the sums of the
 * integer values over each 16). Value j of a block is q[j] * scale, or, when rest is not NULL
 * (the finer form, 12 bits), (16 q[j] + rest[j]) * scale with rest [rows][k] in -8..8. In the
 * 8-bit form a k of whole 256s gets one scale per 256 values (llama.cpp's Q8_K), written for
 * each of their 8 blocks of 32: the K-quants' product takes them so. */
void kvserve_blocks_quantize_f32(const float *x, int64_t rows, int64_t k, int64_t row_stride,
                                 int8_t *q, int8_t *rest, float *scales, int32_t *sums,
                                 int num_threads);
void kvserve_blocks_quantize_bf16(const uint16_t *x, int64_t rows, int64_t k, int64_t row_stride,
                                  int8_t *q, int8_t *rest, float *scales, int32_t *sums,
                                  int num_threads);

/* x [rows][hidden] += delta (when not NULL); then, when q is not NULL, the activation blocks of
 * rmsnorm(x) * weight (x * (1 / sqrt(mean(x^2) + eps)) * weight, as kvserve_add_rmsnorm_f32). */
void kvserve_blocks_add_rmsnorm(float *x, const float *delta, const float *weight, int64_t rows,
                                int64_t hidden, float eps, int8_t *q, int8_t *rest, float *scales,
                                int32_t *sums, int num_threads);

/* The activation blocks of silu(gate) * up from gate_up [rows][2 * width] (gate columns first). */
void kvserve_blocks_silu_mul(const float *gate_up, int64_t rows, int64_t width, int8_t *q,
                             int8_t *rest, float *scales, int32_t *sums, int num_threads);

/* out[r][c] = sum_j w[c][j] a[r][j] (+ bias[c]) for the activation blocks of `rows` rows of k
 * values (rest NULL for the 8-bit form) and the parts' packed weights (each of k inputs), part p
 * writing the columns after those of parts 0..p-1 in rows of ldc floats. 0; -1 for an unknown
 * format or a k that is not whole blocks of a part's format; -2 when the product was not built
 * (kvserve_blocks_isa 0); -3 for K-quant parts and 8-bit activations whose scales are not one
 * per 256 values. */
int kvserve_blocks_gemm(const int8_t *q, const int8_t *rest, const float *scales,
                        const int32_t *sums, int64_t rows, int64_t k,
                        const kvserve_blocks_weight *parts, int64_t num_parts, float *out,
                        int64_t ldc, int num_threads);

#endif
