/*
 * Every decoder layer of the GGUF block path (kvserve/model/linear/blocks.py) in one call: the
 * kernels the model's layer loop (kvserve/model/llama.py) calls one by one for a model whose
 * products keep the file's blocks, in the same order, without a dozen calls and allocations
 * per layer from Python.
 *
 * Per layer, with x the float32 residual and a the activation blocks (8 or 12 bits):
 *   a = blocks(rmsnorm(x) * attn_norm)       (the previous layer's down product added first)
 *   p = a @ qkv (+ bias), float32            then the per-head q/k norms where the model has
 *                                            them; stored in the model dtype
 *   rope_store(qkv); attn = attention(q)     over each row's own positions
 *   a = blocks(attn);     p = a @ o
 *   x += p;               a = blocks(rmsnorm(x) * mlp_norm)
 *   p = a @ gate_up;      a = blocks(silu(gate) * up)
 *   p = a @ down;         x += p (the next layer's first step)
 */
#include <stdint.h>

#include "blocks.h"
#include "common.h"
#include "drivers.h"

/* The q|k|v product (float32, biases in) normed per head where the model has q/k norms, then
 * stored in the model dtype; RoPE and the cache write; attention; the blocks of its output. */
#define DEFINE_ATTENTION_BLOCKS(NAME, T, SUFFIX, STORE)                                            \
    static int NAME(const kvserve_blocks_layer *layer, float *product, T *qkv, T *attn,           \
                    void *kv, float *kv_scales, int64_t rows, int64_t heads, int64_t kv_heads,    \
                    int64_t hd, float eps, const int64_t *positions, const float *cos,            \
                    const float *sin, const int64_t *slots, const int64_t *tables,                \
                    int64_t table_width, const int64_t *row_tables, const int64_t *lengths,       \
                    int64_t num_blocks, int64_t block_size, float scale, int8_t *q, int8_t *rest, \
                    float *act_scales, int32_t *sums, int nt) {                                   \
        const int64_t width = (heads + 2 * kv_heads) * hd, q_size = heads * hd;                   \
        if (layer->qk_norm)                                                                       \
            kvserve_qk_norm_f32(product, rows, width, heads + kv_heads, hd, layer->qk_norm, eps,  \
                                nt);                                                              \
        _Pragma("omp parallel for if (rows >= 8) num_threads(nt)")                                \
        for (int64_t r = 0; r < rows; r++) {                                                      \
            const float *pr = product + r * width;                                                \
            T *qr = qkv + r * width;                                                              \
            _Pragma("omp simd") for (int64_t i = 0; i < width; i++) qr[i] = STORE(pr[i]);         \
        }                                                                                         \
        const int status = kvserve_store_and_attend_##SUFFIX(                                    \
            qkv, attn, kv, kv_scales, rows, heads, kv_heads, hd, positions, cos, sin, slots,      \
            tables, table_width, row_tables, lengths, num_blocks, block_size, scale, nt);         \
        if (status != 0) return status;                                                           \
        kvserve_blocks_quantize_##SUFFIX(attn, rows, q_size, q_size, q, rest, act_scales, sums,   \
                                         nt);                                                     \
        return 0;                                                                                 \
    }

DEFINE_ATTENTION_BLOCKS(attention_blocks_f32, float, f32, float_identity)
DEFINE_ATTENTION_BLOCKS(attention_blocks_bf16, uint16_t, bf16, float_to_bf16)

static inline int blocks_product(const kvserve_blocks_product *w, const int8_t *q,
                                 const int8_t *rest, const float *act_scales,
                                 const int32_t *sums, int64_t rows, int64_t k, float *out,
                                 int64_t columns, int nt) {
    return kvserve_blocks_gemm(q, rest, act_scales, sums, rows, k, w->parts, w->num_parts, out,
                               columns, nt);
}

/*
 * x: [rows][hidden] float32, the embedded rows; on return, the residual after the last layer
 * (its final norm is the caller's). kv_layers[l] is layer l's cache; kv_scale_layers is NULL for
 * a cache in the model dtype, else layer l's scales. `fine`: 12-bit activation blocks (`rest`
 * is then used). Workspace: q and rest [rows][max(hidden, q, intermediate)] int8, act_scales
 * [rows][max(...) / 32] float32, sums [rows][max(...) / 16] int32, product
 * [rows][max(q + 2 kv, 2 intermediate, hidden)] float32, qkv [rows][q + 2 kv] and attn
 * [rows][q] in the model dtype (bf16 when `bf16`, else float32). Returns 0, a negative status of
 * the block product (-1 refused shapes, -2 not built) as -10 + status, or the attention's.
 */
int kvserve_forward_blocks(float *x, int64_t rows, const kvserve_blocks_layer *layers,
                           int64_t num_layers, void *const *kv_layers,
                           float *const *kv_scale_layers, int64_t heads, int64_t kv_heads,
                           int64_t hd, int64_t hidden, int64_t intermediate, int fine, float eps,
                           float scale, int bf16, const int64_t *positions, const float *cos,
                           const float *sin, const int64_t *slots, const int64_t *tables,
                           int64_t table_width, const int64_t *row_tables,
                           const int64_t *lengths, int64_t num_blocks, int64_t block_size,
                           int8_t *q, int8_t *rest, float *act_scales, int32_t *sums,
                           float *product, void *qkv, void *attn, int nt) {
    if (rows <= 0 || num_layers <= 0) return 0;
    int8_t *r = fine ? rest : NULL;
    const int64_t width = (heads + 2 * kv_heads) * hd, q_size = heads * hd;
    kvserve_blocks_add_rmsnorm(x, NULL, layers[0].attn_norm, rows, hidden, eps, q, r, act_scales,
                               sums, nt);
    for (int64_t l = 0; l < num_layers; l++) {
        const kvserve_blocks_layer *layer = layers + l;
        float *kv_scales = kv_scale_layers ? kv_scale_layers[l] : NULL;
        int status = blocks_product(&layer->qkv, q, r, act_scales, sums, rows, hidden, product,
                                    width, nt);
        if (status != 0) return -10 + status;
        status = bf16 ? attention_blocks_bf16(layer, product, (uint16_t *)qkv, (uint16_t *)attn,
                                              kv_layers[l], kv_scales, rows, heads, kv_heads, hd,
                                              eps, positions, cos, sin, slots, tables,
                                              table_width, row_tables, lengths, num_blocks,
                                              block_size, scale, q, r, act_scales, sums, nt)
                      : attention_blocks_f32(layer, product, (float *)qkv, (float *)attn,
                                             kv_layers[l], kv_scales, rows, heads, kv_heads, hd,
                                             eps, positions, cos, sin, slots, tables, table_width,
                                             row_tables, lengths, num_blocks, block_size, scale,
                                             q, r, act_scales, sums, nt);
        if (status != 0) return status;
        status = blocks_product(&layer->o, q, r, act_scales, sums, rows, q_size, product, hidden,
                                nt);
        if (status != 0) return -10 + status;
        kvserve_blocks_add_rmsnorm(x, product, layer->mlp_norm, rows, hidden, eps, q, r,
                                   act_scales, sums, nt);
        status = blocks_product(&layer->gate_up, q, r, act_scales, sums, rows, hidden, product,
                                2 * intermediate, nt);
        if (status != 0) return -10 + status;
        kvserve_blocks_silu_mul(product, rows, intermediate, q, r, act_scales, sums, nt);
        status = blocks_product(&layer->down, q, r, act_scales, sums, rows, intermediate, product,
                                hidden, nt);
        if (status != 0) return -10 + status;
        const int last = l + 1 == num_layers;
        kvserve_blocks_add_rmsnorm(x, product, last ? NULL : layers[l + 1].attn_norm, rows, hidden,
                                   eps, last ? NULL : q, r, act_scales, sums, nt);
    }
    return 0;
}
