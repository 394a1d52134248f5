/*
 * Every decoder layer of the int8 path (kvserve/model/linear/int8.py) in one call: the same kernels
 * model's layer loop (kvserve/model/llama.py) calls one by one, without a dozen ctypes calls and
 * tensor allocations per layer (at decode row counts those cost as much as the work).
 *
 * Per layer, with x the float32 residual (rotated) and (q8, s) int8 rows and their scales:
 *   acc = q8 @ qkv          qkv = dequantize(acc) (+ bias), in the model dtype; then the
 *                           per-head RMSNorm of q and k where the model has one (qwen3)
 *   rope_store(qkv)         rotate q, k; write k, v into the cache (int8 or the model dtype)
 *   attn = attention(q)     over each row's own positions
 *   q8, s = int8(attn);     acc = q8 @ o
 *   x += acc;               q8, s = int8(rmsnorm(x))
 *   acc = q8 @ gate_up;     q8, s = int8(hadamard(silu(gate) * up))
 *   acc = q8 @ down;        x += acc; q8, s = int8(rmsnorm(x)) for the next layer
 */
#include <stdint.h>

#include "common.h"
#include "drivers.h"
#include "int8_gemm.h"
#include "quant_ops.h"

/* The typed middle of a layer: dequantize q|k|v, the q/k norms, RoPE and cache write,
 * attention, int8 of the attention output. Returns the attention kernel's status (0, or -1 for
 * shapes it refuses). */
#define DEFINE_ATTENTION_PART(NAME, T, SUFFIX)                                                     \
    static int NAME(const kvserve_int8_weight *w, const float *qk_norm, float eps,               \
                    const int32_t *acc, const float *s, T *qkv,                                   \
                    T *attn, void *kv, float *kv_scales, int64_t rows, int64_t heads,             \
                    int64_t kv_heads, int64_t hd, const int64_t *positions, const float *cos,     \
                    const float *sin, const int64_t *slots, const int64_t *tables,                \
                    int64_t table_width, const int64_t *row_tables, const int64_t *lengths,       \
                    int64_t num_blocks, int64_t block_size, float scale, int8_t *q8,              \
                    float *s_out, int nt) {                                                       \
        const int64_t width = w->n, q_size = heads * hd;                                          \
        kvserve_dequantize_##SUFFIX(acc, s, w->scale, w->bias, qkv, rows, width, nt);             \
        if (qk_norm)                                                                              \
            kvserve_qk_norm_##SUFFIX(qkv, rows, width, heads + kv_heads, hd, qk_norm, eps, nt);   \
        const int status = kvserve_store_and_attend_##SUFFIX(                                    \
            qkv, attn, kv, kv_scales, rows, heads, kv_heads, hd, positions, cos, sin, slots,      \
            tables, table_width, row_tables, lengths, num_blocks, block_size, scale, nt);         \
        if (status != 0) return status;                                                           \
        kvserve_quantize_rows_##SUFFIX(attn, rows, q_size, q_size, q8, s_out, nt);                \
        return 0;                                                                                 \
    }

DEFINE_ATTENTION_PART(attention_part_f32, float, f32)
DEFINE_ATTENTION_PART(attention_part_bf16, uint16_t, bf16)

/*
 * x: [rows][hidden] float32, the embedded rows already rotated; on return, the residual after
 * the last layer (its final norm is the caller's). kv_layers[l] is layer l's cache
 * ([2][kv_heads][num_blocks][block_size][head_dim]); kv_scale_layers is NULL for a cache in the
 * model dtype, else layer l's scales. Workspace: q8 [rows][max(hidden, q, intermediate)] int8,
 * scales_a, scales_b [rows] float32, acc [rows][max(q + 2 kv, 2 intermediate, hidden)] int32,
 * qkv [rows][q + 2 kv] and attn [rows][q] in the model dtype (bf16 when `bf16`, else float32).
 */
int kvserve_forward_int8(float *x, int64_t rows, const kvserve_int8_layer *layers,
                         int64_t num_layers, void *const *kv_layers,
                         float *const *kv_scale_layers, int64_t heads, int64_t kv_heads,
                         int64_t hd, int64_t down_block, float eps, float scale, int bf16,
                         const int64_t *positions, const float *cos, const float *sin,
                         const int64_t *slots, const int64_t *tables, int64_t table_width,
                         const int64_t *row_tables, const int64_t *lengths, int64_t num_blocks,
                         int64_t block_size, int8_t *q8, float *scales_a, float *scales_b,
                         int32_t *acc, void *qkv, void *attn, int nt) {
    if (rows <= 0 || num_layers <= 0) return 0;
    const int64_t hidden = layers[0].o.n;
    float *s = scales_a, *next = scales_b, *swap;
    kvserve_add_rmsnorm_q8(x, NULL, NULL, NULL, q8, s, rows, hidden, eps, nt);
    for (int64_t l = 0; l < num_layers; l++) {
        const kvserve_int8_layer *layer = layers + l;
        float *kv_scales = kv_scale_layers ? kv_scale_layers[l] : NULL;
        kvserve_int8_gemm(q8, rows, layer->qkv.k, layer->qkv.panels, layer->qkv.correction,
                          layer->qkv.n, acc, nt);
        const int status =
            bf16 ? attention_part_bf16(&layer->qkv, layer->qk_norm, eps, acc, s, (uint16_t *)qkv, (uint16_t *)attn,
                                       kv_layers[l], kv_scales, rows, heads, kv_heads, hd,
                                       positions, cos, sin, slots, tables, table_width,
                                       row_tables, lengths, num_blocks, block_size, scale, q8,
                                       next, nt)
                 : attention_part_f32(&layer->qkv, layer->qk_norm, eps, acc, s, (float *)qkv, (float *)attn,
                                      kv_layers[l], kv_scales, rows, heads, kv_heads, hd,
                                      positions, cos, sin, slots, tables, table_width,
                                      row_tables, lengths, num_blocks, block_size, scale, q8,
                                      next, nt);
        if (status != 0) return status;
        swap = s, s = next, next = swap;
        kvserve_int8_gemm(q8, rows, layer->o.k, layer->o.panels, layer->o.correction, layer->o.n,
                          acc, nt);
        kvserve_add_rmsnorm_q8(x, acc, s, layer->o.scale, q8, next, rows, hidden, eps, nt);
        swap = s, s = next, next = swap;
        kvserve_int8_gemm(q8, rows, layer->gate_up.k, layer->gate_up.panels,
                          layer->gate_up.correction, layer->gate_up.n, acc, nt);
        kvserve_silu_mul_q8(acc, s, layer->gate_up.scale, q8, next, rows, layer->gate_up.n / 2,
                            down_block, nt);
        swap = s, s = next, next = swap;
        kvserve_int8_gemm(q8, rows, layer->down.k, layer->down.panels, layer->down.correction,
                          layer->down.n, acc, nt);
        const int last = l + 1 == num_layers;
        kvserve_add_rmsnorm_q8(x, acc, s, layer->down.scale, last ? NULL : q8,
                               last ? NULL : next, rows, hidden, eps, nt);
        swap = s, s = next, next = swap;
    }
    return 0;
}
