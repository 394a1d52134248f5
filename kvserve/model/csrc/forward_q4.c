/*
 * Every decoder layer of the 4-bit path (kvserve/model/linear/q4.py) in one call, as
 * forward_int8.c does for the int8 path. Per layer, with x the float32 residual and (q8, e, s)
 * the rows in blocks of 32 (kvserve/model/csrc/q4_gemm.c):
 *
 *   q8, e, s = blocks(rmsnorm(x) * attn_norm)
 *   qkv = q8 @ qkv (+ bias; q/k norms where the model has them), in the model dtype
 *   rope_store(qkv); attn = attention(q)             (int8 or model-dtype cache)
 *   q8, e, s = blocks(attn);   x += q8 @ o
 *   q8, e, s = blocks(rmsnorm(x) * mlp_norm);   g|u = q8 @ gate_up
 *   q8, e, s = blocks(silu(g) * u);   x += q8 @ down
 */
#include <stdint.h>

#include "common.h"
#include "drivers.h"
#include "q4.h"

/* The q|k|v product (float32) with its bias and per-head q/k norms, stored in the model dtype,
 * then RoPE and the cache write, attention, and the per-block int8 of the attention output. */
#define DEFINE_ATTENTION_Q4(NAME, T, SUFFIX, STORE)                                                \
    static int NAME(const kvserve_q4_layer *layer, const float *product, T *qkv, T *attn,         \
                    void *kv, float *kv_scales, int64_t rows, int64_t heads, int64_t kv_heads,    \
                    int64_t hd, float eps, const int64_t *positions, const float *cos,            \
                    const float *sin, const int64_t *slots, const int64_t *tables,                \
                    int64_t table_width, const int64_t *row_tables, const int64_t *lengths,       \
                    int64_t num_blocks, int64_t block_size, float scale, int8_t *q8,              \
                    float *e, float *s, int nt) {                                                 \
        const int64_t width = layer->qkv.n, q_size = heads * hd;                                  \
        const float *bias = layer->qkv.bias, *norm = layer->qk_norm;                              \
        _Pragma("omp parallel for if (rows >= 8) num_threads(nt)")                                \
        for (int64_t r = 0; r < rows; r++) {                                                      \
            float v[width];                                                                       \
            const float *pr = product + r * width;                                                \
            _Pragma("omp simd") for (int64_t i = 0; i < width; i++) v[i] =                        \
                pr[i] + (bias ? bias[i] : 0.f);                                                   \
            if (norm)                                                                             \
                for (int64_t h = 0; h < heads + kv_heads; h++) {                                  \
                    float *head = v + h * hd, sum = 0.f;                                          \
                    _Pragma("omp simd reduction(+ : sum)") for (int64_t i = 0; i < hd; i++) sum += \
                        head[i] * head[i];                                                        \
                    const float inv = 1.f / sqrtf(sum / (float)hd + eps);                         \
                    _Pragma("omp simd") for (int64_t i = 0; i < hd; i++) head[i] *=              \
                        inv * norm[h * hd + i];                                                   \
                }                                                                                 \
            T *qr = qkv + r * width;                                                              \
            _Pragma("omp simd") for (int64_t i = 0; i < width; i++) qr[i] = STORE(v[i]);          \
        }                                                                                         \
        const int status = kvserve_store_and_attend_##SUFFIX(                                    \
            qkv, attn, kv, kv_scales, rows, heads, kv_heads, hd, positions, cos, sin, slots,      \
            tables, table_width, row_tables, lengths, num_blocks, block_size, scale, nt);         \
        if (status != 0) return status;                                                           \
        kvserve_quantize_blocks_##SUFFIX(attn, rows, q_size, q_size, q8, e, s, nt);               \
        return 0;                                                                                 \
    }

DEFINE_ATTENTION_Q4(attention_q4_f32, float, f32, float_identity)
DEFINE_ATTENTION_Q4(attention_q4_bf16, uint16_t, bf16, float_to_bf16)

static inline void q4_product(const kvserve_q4_weight *w, const int8_t *q8, const float *e,
                              const float *s, int64_t rows, float *out, int nt) {
    kvserve_q4_gemm(q8, e, s, rows, w->k, w->packed, w->n, (int)w->asym, out, nt);
}

/*
 * x: [rows][hidden] float32, the embedded rows; on return, the residual after the last layer
 * (its final norm is the caller's). kv_layers[l] is layer l's cache
 * ([2][kv_heads][num_blocks][block_size][head_dim]); kv_scale_layers is NULL for a cache in the
 * model dtype, else layer l's scales. Workspace: q8 [rows][max(hidden, q, intermediate)] int8,
 * e and s [rows][max(hidden, q, intermediate) / 32] float32, product
 * [rows][max(q + 2 kv, 2 intermediate, hidden)] float32, qkv [rows][q + 2 kv] and attn [rows][q]
 * in the model dtype (bf16 when `bf16`, else float32).
 */
int kvserve_forward_q4(float *x, int64_t rows, const kvserve_q4_layer *layers, int64_t num_layers,
                       void *const *kv_layers, float *const *kv_scale_layers, int64_t heads,
                       int64_t kv_heads, int64_t hd, float eps, float scale, int bf16,
                       const int64_t *positions, const float *cos, const float *sin,
                       const int64_t *slots, const int64_t *tables, int64_t table_width,
                       const int64_t *row_tables, const int64_t *lengths, int64_t num_blocks,
                       int64_t block_size, int8_t *q8, float *e, float *s, float *product,
                       void *qkv, void *attn, int nt) {
    if (rows <= 0 || num_layers <= 0) return 0;
    const int64_t hidden = layers[0].o.n;
    kvserve_add_rmsnorm_qb(x, NULL, layers[0].attn_norm, q8, e, s, rows, hidden, eps, 1, nt);
    for (int64_t l = 0; l < num_layers; l++) {
        const kvserve_q4_layer *layer = layers + l;
        float *kv_scales = kv_scale_layers ? kv_scale_layers[l] : NULL;
        q4_product(&layer->qkv, q8, e, s, rows, product, nt);
        const int status =
            bf16 ? attention_q4_bf16(layer, product, (uint16_t *)qkv, (uint16_t *)attn,
                                     kv_layers[l], kv_scales, rows, heads, kv_heads, hd, eps,
                                     positions, cos, sin, slots, tables, table_width, row_tables,
                                     lengths, num_blocks, block_size, scale, q8, e, s, nt)
                 : attention_q4_f32(layer, product, (float *)qkv, (float *)attn, kv_layers[l],
                                    kv_scales, rows, heads, kv_heads, hd, eps, positions, cos, sin,
                                    slots, tables, table_width, row_tables, lengths, num_blocks,
                                    block_size, scale, q8, e, s, nt);
        if (status != 0) return status;
        q4_product(&layer->o, q8, e, s, rows, product, nt);
        kvserve_add_rmsnorm_qb(x, product, layer->mlp_norm, q8, e, s, rows, hidden, eps, 1, nt);
        q4_product(&layer->gate_up, q8, e, s, rows, product, nt);
        kvserve_silu_mul_qb(product, q8, e, s, rows, layer->gate_up.n / 2, nt);
        q4_product(&layer->down, q8, e, s, rows, product, nt);
        const int last = l + 1 == num_layers;
        kvserve_add_rmsnorm_qb(x, product, last ? NULL : layers[l + 1].attn_norm, q8, e, s, rows,
                               hidden, eps, !last, nt);
    }
    return 0;
}
