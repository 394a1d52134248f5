/*
 * Fused per-layer elementwise work on the CPU, replacing several torch ops (and their dispatch
 * and temporaries) each:
 *
 *   add_rmsnorm   x += delta (optional); out = cast(x * rsqrt(mean(x^2) + eps) * weight)
 *   silu_mul      out = cast(silu(gate) * up) from the fused gate|up product
 *   gelu_tanh_mul out = cast(gelu_tanh(gate) * up), the same for GeGLU (Gemma)
 *   rope_store    rotate q and k in place (half-rotation RoPE) and write k, v into the paged cache
 *   qk_norm       the per-head RMSNorm of q and k (qwen3), in place, computed in float32
 *   word_sums     each buffer's sum of little-endian 64-bit words (the prepared-weight cache's
 *                 checksums, all in one call)
 *
 * The residual stream x is float32; `out`, `delta` and the q|k|v rows are the model dtype
 * (float32 or bfloat16, chosen by the `_f32` / `_bf16` entry points). Rows run in parallel with
 * OpenMP when there are enough of them to pay for it.
 */
#include <string.h>

#include "common.h"
#include "layer_ops.h"

#define DEFINE_ADD_RMSNORM(NAME, T, LOAD, STORE)                                                   \
    void NAME(float *x, const T *delta, const float *weight, T *out, int64_t rows,                \
              int64_t hidden, float eps, int num_threads) {                                       \
        _Pragma("omp parallel for if (rows >= 8) num_threads(num_threads)")                              \
        for (int64_t r = 0; r < rows; r++) {                                                      \
            float *xr = x + r * hidden;                                                           \
            float sum = 0.f;                                                                      \
            if (delta) {                                                                          \
                const T *dr = delta + r * hidden;                                                 \
                _Pragma("omp simd reduction(+ : sum)") for (int64_t i = 0; i < hidden; i++) {     \
                    xr[i] += LOAD(dr[i]);                                                         \
                    sum += xr[i] * xr[i];                                                         \
                }                                                                                 \
            } else {                                                                              \
                _Pragma("omp simd reduction(+ : sum)") for (int64_t i = 0; i < hidden; i++) sum += \
                    xr[i] * xr[i];                                                                \
            }                                                                                     \
            const float scale = 1.f / sqrtf(sum / (float)hidden + eps);                           \
            T *orow = out + r * hidden;                                                           \
            _Pragma("omp simd") for (int64_t i = 0; i < hidden; i++) orow[i] =                    \
                STORE(xr[i] * scale * weight[i]);                                                 \
        }                                                                                         \
    }

DEFINE_ADD_RMSNORM(kvserve_add_rmsnorm_f32, float, float_identity, float_identity)
DEFINE_ADD_RMSNORM(kvserve_add_rmsnorm_bf16, uint16_t, bf16_to_float, float_to_bf16)

#define DEFINE_SILU_MUL(NAME, T, LOAD, STORE)                                                      \
    void NAME(const T *gate_up, T *out, int64_t rows, int64_t width, int num_threads) {           \
        _Pragma("omp parallel for if (rows >= 8) num_threads(num_threads)")                              \
        for (int64_t r = 0; r < rows; r++) {                                                      \
            const T *gate = gate_up + r * 2 * width, *up = gate + width;                          \
            T *orow = out + r * width;                                                            \
            _Pragma("omp simd") for (int64_t i = 0; i < width; i++) {                             \
                const float g = LOAD(gate[i]);                                                    \
                orow[i] = STORE(g / (1.f + exp_approx(-g)) * LOAD(up[i]));                          \
            }                                                                                     \
        }                                                                                         \
    }

DEFINE_SILU_MUL(kvserve_silu_mul_f32, float, float_identity, float_identity)
#if defined(__AVX512F__) && defined(__AVX512BF16__)
/* bf16 with the CPU's conversions both ways, a vector exp and a reciprocal estimate (one
 * Newton step: ~1e-7 relative, far below bf16's rounding) instead of a division. */
void kvserve_silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t width,
                           int num_threads) {
    _Pragma("omp parallel for if (rows >= 8) num_threads(num_threads)")
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *gate = gate_up + r * 2 * width, *up = gate + width;
        uint16_t *orow = out + r * width;
        int64_t i = 0;
        for (; i + 16 <= width; i += 16) {
            const __m512 g = _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256((const __m256i *)(gate + i)));
            const __m512 u = _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256((const __m256i *)(up + i)));
            const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.f),
                                           exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)));
            __m512 sig = _mm512_rcp14_ps(d);
            sig = _mm512_mul_ps(sig, _mm512_fnmadd_ps(d, sig, _mm512_set1_ps(2.f)));
            _mm256_storeu_si256((__m256i *)(orow + i),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_mul_ps(g, sig), u)));
        }
        for (; i < width; i++) {
            const float g = bf16_to_float(gate[i]);
            orow[i] = float_to_bf16(g / (1.f + exp_approx(-g)) * bf16_to_float(up[i]));
        }
    }
}
#else
DEFINE_SILU_MUL(kvserve_silu_mul_bf16, uint16_t, bf16_to_float, float_to_bf16)
#endif

#define DEFINE_GELU_TANH_MUL(NAME, T, LOAD, STORE)                                                 \
    void NAME(const T *gate_up, T *out, int64_t rows, int64_t width, int num_threads) {           \
        _Pragma("omp parallel for if (rows >= 8) num_threads(num_threads)")                        \
        for (int64_t r = 0; r < rows; r++) {                                                      \
            const T *gate = gate_up + r * 2 * width, *up = gate + width;                          \
            T *orow = out + r * width;                                                            \
            _Pragma("omp simd") for (int64_t i = 0; i < width; i++) orow[i] =                     \
                STORE(gelu_tanh_approx(LOAD(gate[i])) * LOAD(up[i]));                             \
        }                                                                                         \
    }

DEFINE_GELU_TANH_MUL(kvserve_gelu_tanh_mul_f32, float, float_identity, float_identity)
DEFINE_GELU_TANH_MUL(kvserve_gelu_tanh_mul_bf16, uint16_t, bf16_to_float, float_to_bf16)

/*
 * qkv: [rows][(heads + 2 kv_heads) * head_dim], q heads then k heads then v heads.
 * cos, sin: [max_positions][head_dim / 2] float32 (the half table; both halves share it).
 * kv: this layer's cache [2][kv_heads][num_blocks * block_size][head_dim].
 */
#define DEFINE_ROPE_STORE(NAME, T, ROTATE)                                                    \
    void NAME(T *qkv, const int64_t *positions, const float *cos_table, const float *sin_table,   \
              const int64_t *slots, T *kv, int64_t rows, int64_t heads, int64_t kv_heads,         \
              int64_t head_dim, int64_t num_slots, int num_threads) {                             \
        const int64_t half = head_dim / 2, width = (heads + 2 * kv_heads) * head_dim;             \
        const int64_t head_stride = num_slots * head_dim;                                         \
        T *k_cache = kv, *v_cache = kv + kv_heads * head_stride;                                  \
        _Pragma("omp parallel for if (rows >= 8) num_threads(num_threads)")                              \
        for (int64_t r = 0; r < rows; r++) {                                                      \
            T *row = qkv + r * width;                                                             \
            const float *c = cos_table + positions[r] * half, *s = sin_table + positions[r] * half; \
            ROTATE(row, c, s, heads + kv_heads, head_dim);                                        \
            const int64_t slot = slots[r];                                                        \
            for (int64_t h = 0; h < kv_heads; h++) {                                              \
                memcpy(k_cache + h * head_stride + slot * head_dim,                               \
                       row + (heads + h) * head_dim, sizeof(T) * head_dim);                       \
                memcpy(v_cache + h * head_stride + slot * head_dim,                               \
                       row + (heads + kv_heads + h) * head_dim, sizeof(T) * head_dim);            \
            }                                                                                     \
        }                                                                                         \
    }

DEFINE_ROPE_STORE(kvserve_rope_store_f32, float, rotate_heads_f32)
DEFINE_ROPE_STORE(kvserve_rope_store_bf16, uint16_t, rotate_heads_bf16)

/* In place: each of the first `num_heads` heads of `head_dim` values of every row of qkv
 * ([rows][width]) becomes head * (rsqrt(mean(head^2) + eps) * weight[head index]), computed in
 * float32 and stored back in the model dtype (the arithmetic of forward_q4.c's q/k norms).
 * weight: [num_heads][head_dim] float32. */
#define DEFINE_QK_NORM(NAME, T, LOAD, STORE)                                                       \
    void NAME(T *qkv, int64_t rows, int64_t width, int64_t num_heads, int64_t head_dim,           \
              const float *weight, float eps, int num_threads) {                                  \
        _Pragma("omp parallel for if (rows >= 8) num_threads(num_threads)")                        \
        for (int64_t r = 0; r < rows; r++) {                                                      \
            for (int64_t h = 0; h < num_heads; h++) {                                             \
                T *head = qkv + r * width + h * head_dim;                                         \
                const float *w = weight + h * head_dim;                                           \
                float sum = 0.f;                                                                  \
                _Pragma("omp simd reduction(+ : sum)") for (int64_t i = 0; i < head_dim; i++) {   \
                    const float v = LOAD(head[i]);                                                \
                    sum += v * v;                                                                 \
                }                                                                                 \
                const float scale = 1.f / sqrtf(sum / (float)head_dim + eps);                     \
                _Pragma("omp simd") for (int64_t i = 0; i < head_dim; i++) head[i] =              \
                    STORE(LOAD(head[i]) * (scale * w[i]));                                        \
            }                                                                                     \
        }                                                                                         \
    }

DEFINE_QK_NORM(kvserve_qk_norm_f32, float, float_identity, float_identity)
DEFINE_QK_NORM(kvserve_qk_norm_bf16, uint16_t, bf16_to_float, float_to_bf16)

/* sums[i] = the sum, modulo 2^64, of the whole little-endian 64-bit words of data[i] (its first
 * nbytes[i] / 8 * 8 bytes; the tail is the caller's). One call for every tensor of a prepared
 * file, so that a caller may do other work while it runs. Returns 0, or -1 (nothing written)
 * for a negative count or size or a missing pointer. */
int kvserve_word_sums(int64_t count, const uint8_t *const *data, const int64_t *nbytes,
                      uint64_t *sums, int num_threads) {
    if (count < 0 || (count > 0 && (!data || !nbytes || !sums))) return -1;
    for (int64_t i = 0; i < count; i++)
        if (nbytes[i] < 0 || (nbytes[i] >= 8 && !data[i])) return -1;
    for (int64_t i = 0; i < count; i++) {
        const uint8_t *bytes = data[i];
        const int64_t words = nbytes[i] / 8;
        uint64_t total = 0;
        _Pragma("omp parallel for reduction(+ : total) num_threads(num_threads) if (words >= (1 << 18))")
        for (int64_t w = 0; w < words; w++) {
            uint64_t word;
            memcpy(&word, bytes + 8 * w, 8);
            total += word;
        }
        sums[i] = total;
    }
    return 0;
}
