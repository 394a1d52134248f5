/*
 * The one-call layer drivers (forward_int8.c, forward_q4.c, forward_blocks.c, one kernel family
 * each): every decoder layer in one call,
 * the same kernels the model's layer loop (kvserve/model/llama.py) calls one by one, without a
 * dozen calls and allocations per layer from Python (at decode row counts those cost as much as
 * the work). Each returns 0, or the attention kernel's nonzero status.
 */
#ifndef KVSERVE_DRIVERS_H
#define KVSERVE_DRIVERS_H

#include <stdint.h>

#include "attention.h"
#include "blocks.h"
#include "kv_int8.h"
#include "layer_ops.h"

/* One int8 product (int8_gemm.c's packing): y = (q8 @ panels) * row_scale * scale + bias. */
typedef struct {
    const int8_t *panels;
    const int32_t *correction;
    const float *scale; /* [n] per output channel */
    const float *bias;  /* [n] or NULL */
    int64_t n, k;
} kvserve_int8_weight;

typedef struct {
    kvserve_int8_weight qkv, o, gate_up, down;
    const float *qk_norm; /* [heads + kv_heads][head_dim] float32, or NULL */
} kvserve_int8_layer;

/* One 4-bit product (q4_gemm.c's layout). */
typedef struct {
    const uint8_t *packed;
    const float *bias; /* [n] or NULL */
    int64_t n, k;
    int64_t asym;
} kvserve_q4_weight;

typedef struct {
    kvserve_q4_weight qkv, o, gate_up, down;
    const float *attn_norm, *mlp_norm; /* [hidden] */
    const float *qk_norm;              /* [heads + kv_heads][head_dim], or NULL */
} kvserve_q4_layer;

/* One product of the block path: its parts (csrc/blocks.h), multiplied in one call. */
typedef struct {
    const kvserve_blocks_weight *parts;
    int64_t num_parts;
} kvserve_blocks_product;

typedef struct {
    kvserve_blocks_product qkv, o, gate_up, down;
    const float *attn_norm, *mlp_norm; /* [hidden] */
    const float *qk_norm;              /* [heads + kv_heads][head_dim], or NULL */
} kvserve_blocks_layer;

int kvserve_forward_int8(float *x, int64_t rows, const kvserve_int8_layer *layers,
                         int64_t num_layers, void *const *kv_layers,
                         float *const *kv_scale_layers, int64_t heads, int64_t kv_heads,
                         int64_t hd, int64_t down_block, float eps, float scale, int bf16,
                         const int64_t *positions, const float *cos, const float *sin,
                         const int64_t *slots, const int64_t *tables, int64_t table_width,
                         const int64_t *row_tables, const int64_t *lengths, int64_t num_blocks,
                         int64_t block_size, int8_t *q8, float *scales_a, float *scales_b,
                         int32_t *acc, void *qkv, void *attn, int nt);
int kvserve_forward_q4(float *x, int64_t rows, const kvserve_q4_layer *layers, int64_t num_layers,
                       void *const *kv_layers, float *const *kv_scale_layers, int64_t heads,
                       int64_t kv_heads, int64_t hd, float eps, float scale, int bf16,
                       const int64_t *positions, const float *cos, const float *sin,
                       const int64_t *slots, const int64_t *tables, int64_t table_width,
                       const int64_t *row_tables, const int64_t *lengths, int64_t num_blocks,
                       int64_t block_size, int8_t *q8, float *e, float *s, float *product,
                       void *qkv, void *attn, int nt);
int kvserve_forward_blocks(float *x, int64_t rows, const kvserve_blocks_layer *layers,
                           int64_t num_layers, void *const *kv_layers,
                           float *const *kv_scale_layers, int64_t heads, int64_t kv_heads,
                           int64_t hd, int64_t hidden, int64_t intermediate, int fine, float eps,
                           float scale, int bf16, const int64_t *positions, const float *cos,
                           const float *sin, const int64_t *slots, const int64_t *tables,
                           int64_t table_width, const int64_t *row_tables,
                           const int64_t *lengths, int64_t num_blocks, int64_t block_size,
                           int8_t *q, int8_t *rest, float *act_scales, int32_t *sums,
                           float *product, void *qkv, void *attn, int nt);

/* RoPE on q and k of `qkv` ([rows][q + 2 kv], in place), k and v written into the cache (in the
 * model dtype, or int8 with its scales when kv_scales is given), then attention of each row's
 * q over its positions into attn ([rows][q]). Returns the attention kernel's status. */

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
