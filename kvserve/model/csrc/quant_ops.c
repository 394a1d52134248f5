/*
 * Elementwise kernels of the int8 linear path (see kvserve/model/linear/int8.py), each fusing what
 * sits between two integer matrix products:
 *
 *   quantize_rows     q, s = per-row symmetric int8 of x (the attention output)
 *   add_rmsnorm_q8    x += acc * row_scale * col_scale (optional); q, s = int8 of rmsnorm(x)
 *   silu_mul_q8       m = silu(gate) * up from the int32 gate|up product; m rotated by
 *                     normalized Walsh-Hadamard blocks; q, s = int8 of m
 *   gelu_tanh_mul_q8  the same with gelu_tanh(gate) (GeGLU: Gemma)
 *   add_post_norm_q8  x += R(rmsnorm(acc * row_scale * col_scale) * weight), R the residual
 *                     rotation signs then Walsh-Hadamard blocks (Gemma's post-norms)
 *   dequantize        out = acc * row_scale * col_scale + bias, in the model dtype
 *   rotate_rows       out = x @ m, a row at a time (the rotation of the residual stream)
 *   topk_rows         the columns of each row's k largest values (the logits to recompute)
 *
 * Per-row symmetric quantization: s = max|v| / 127 and q = round-to-nearest-even(v / s); a row of
 * zeros gets s = 0 and q = 0. Every row is handled alone, so a row's result never depends on the
 * other rows of the step. The residual stream x is float32.
 */
#include <string.h>

#include "common.h"
#include "quant_ops.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

/* Writes q[0:n] and returns the scale. */
static inline float quantize_row(const float *v, int64_t n, int8_t *q) {
    const float top = abs_max(v, n);
    const float scale = top / 127.f, inverse = top > 0.f ? 127.f / top : 0.f;
    _Pragma("omp simd") for (int64_t i = 0; i < n; i++) q[i] = (int8_t)nearbyintf(v[i] * inverse);
    return scale;
}

#define DEFINE_QUANTIZE_ROWS(NAME, T, LOAD)                                                        \
    void NAME(const T *x, int64_t rows, int64_t width, int64_t row_stride, int8_t *q,             \
              float *scales, int num_threads) {                                                   \
        _Pragma("omp parallel for if (rows >= 8) num_threads(num_threads)")                        \
        for (int64_t r = 0; r < rows; r++) {                                                      \
            float v[width];                                                                       \
            const T *xr = x + r * row_stride;                                                     \
            _Pragma("omp simd") for (int64_t i = 0; i < width; i++) v[i] = LOAD(xr[i]);           \
            scales[r] = quantize_row(v, width, q + r * width);                                    \
        }                                                                                         \
    }

DEFINE_QUANTIZE_ROWS(kvserve_quantize_rows_f32, float, float_identity)
DEFINE_QUANTIZE_ROWS(kvserve_quantize_rows_bf16, uint16_t, bf16_to_float)

/* acc may be NULL (nothing added). q may be NULL: then only the addition is done. */
void kvserve_add_rmsnorm_q8(float *x, const int32_t *acc, const float *row_scales,
                            const float *col_scales, int8_t *q, float *scales, int64_t rows,
                            int64_t hidden, float eps, int num_threads) {
    _Pragma("omp parallel for if (rows >= 8) num_threads(num_threads)")
    for (int64_t r = 0; r < rows; r++) {
        float *xr = x + r * hidden;
        if (acc) {
            const int32_t *ar = acc + r * hidden;
            const float rs = row_scales[r];
            _Pragma("omp simd") for (int64_t i = 0; i < hidden; i++) xr[i] +=
                (float)ar[i] * rs * col_scales[i];
        }
        if (!q) continue;
        float sum = 0.f;
        _Pragma("omp simd reduction(+ : sum)") for (int64_t i = 0; i < hidden; i++) sum +=
            xr[i] * xr[i];
        const float norm = 1.f / sqrtf(sum / (float)hidden + eps);
        float v[hidden];
        _Pragma("omp simd") for (int64_t i = 0; i < hidden; i++) v[i] = xr[i] * norm;
        scales[r] = quantize_row(v, hidden, q + r * hidden);
    }
}

/* In place, v[0:n] times the Sylvester-Hadamard matrix of order n (a power of 2), NOT
 * normalized: the caller folds 1/sqrt(n) into the row's quantization scale. */
#if defined(__AVX512F__)
static inline void walsh_hadamard(float *v, int64_t n) {
    int64_t h = 1;
    if (n >= 16) {
        /* stages 1, 2, 4, 8 inside each 16-lane vector: lane j pairs with lane j ^ h; the lower
         * one gets a + b, the upper one a - b (that is, its partner minus itself) */
        const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
        for (int64_t i = 0; i < n; i += 16) {
            __m512 x = _mm512_loadu_ps(v + i);
            for (int stage = 1; stage < 16; stage <<= 1) {
                const __m512 partner =
                    _mm512_permutexvar_ps(_mm512_xor_si512(lanes, _mm512_set1_epi32(stage)), x);
                const __mmask16 upper = _mm512_test_epi32_mask(lanes, _mm512_set1_epi32(stage));
                x = _mm512_mask_sub_ps(_mm512_add_ps(x, partner), upper, partner, x);
            }
            _mm512_storeu_ps(v + i, x);
        }
        h = 16;
    }
    for (; h < n; h <<= 1)
        for (int64_t i = 0; i < n; i += 2 * h)
            _Pragma("omp simd") for (int64_t j = i; j < i + h; j++) {
                const float a = v[j], b = v[j + h];
                v[j] = a + b;
                v[j + h] = a - b;
            }
}
#else
static inline void walsh_hadamard(float *v, int64_t n) {
    for (int64_t h = 1; h < n; h <<= 1)
        for (int64_t i = 0; i < n; i += 2 * h)
            _Pragma("omp simd") for (int64_t j = i; j < i + h; j++) {
                const float a = v[j], b = v[j + h];
                v[j] = a + b;
                v[j + h] = a - b;
            }
}
#endif


/* The gate|up product's rows into int8 activations of the down product: m = act(gate) * up,
 * rotated by Walsh-Hadamard blocks, quantized per row. act(g) = g sigmoid(a): silu with a = g,
 * gelu_tanh with a = 2 sqrt(2 / pi) (g + 0.044715 g^3). acc: [rows][2 * width] int32, gate
 * columns first; col_scales: [2 * width]. One function per activation (a macro, not a flag):
 * OpenMP outlines the parallel body before constants propagate, and a flag left at run time
 * kept the scalar loop from vectorizing (silu 40% slower, measured). */
#define SILU_ARGUMENT(g) (g)
#define GELU_ARGUMENT(g) (1.5957691216057308f * ((g) + 0.044715f * (g) * (g) * (g)))
#define SILU_ARGUMENT16(g) (g)
#define GELU_ARGUMENT16(g)                                                                         \
    _mm512_mul_ps(_mm512_set1_ps(1.5957691216057308f),                                           \
                  _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(0.044715f), g), _mm512_mul_ps(g, g), \
                                  g))

#if defined(__AVX512F__)
#define GATED_Q8_VECTOR(ARGUMENT16)                                                                \
    const __m512 row_scale = _mm512_set1_ps(rs), one = _mm512_set1_ps(1.f);                       \
    for (; i + 16 <= width; i += 16) {                                                            \
        const __m512 g = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(gate + i)),          \
                                       _mm512_mul_ps(row_scale, _mm512_loadu_ps(gate_scales + i))); \
        const __m512 u = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(up + i)),            \
                                       _mm512_mul_ps(row_scale, _mm512_loadu_ps(up_scales + i)));  \
        const __m512 a = ARGUMENT16(g);                                                           \
        /* sigmoid(a) = 1 / (1 + exp(-a)): a reciprocal estimate and one Newton step */           \
        const __m512 d = _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), a)));      \
        __m512 s = _mm512_rcp14_ps(d);                                                            \
        s = _mm512_mul_ps(s, _mm512_fnmadd_ps(d, s, _mm512_set1_ps(2.f)));                        \
        _mm512_storeu_ps(v + i, _mm512_mul_ps(_mm512_mul_ps(g, s), u));                           \
    }
#else
#define GATED_Q8_VECTOR(ARGUMENT16)
#endif

#define DEFINE_GATED_Q8(NAME, ARGUMENT, ARGUMENT16)                                                \
    void NAME(const int32_t *acc, const float *row_scales, const float *col_scales, int8_t *q,    \
              float *scales, int64_t rows, int64_t width, int64_t block, int num_threads) {       \
        _Pragma("omp parallel for if (rows >= 8) num_threads(num_threads)")                        \
        for (int64_t r = 0; r < rows; r++) {                                                      \
            const int32_t *gate = acc + r * 2 * width, *up = gate + width;                        \
            const float *gate_scales = col_scales, *up_scales = col_scales + width;               \
            const float rs = row_scales[r];                                                       \
            float v[width];                                                                       \
            int64_t i = 0;                                                                        \
            GATED_Q8_VECTOR(ARGUMENT16)                                                           \
            for (; i < width; i++) {                                                              \
                const float g = (float)gate[i] * rs * gate_scales[i];                             \
                v[i] = g / (1.f + exp_approx(-ARGUMENT(g))) * ((float)up[i] * rs * up_scales[i]); \
            }                                                                                     \
            if (block > 1)                                                                        \
                for (int64_t b = 0; b < width; b += block) walsh_hadamard(v + b, block);          \
            /* normalizing the rotation scales every value alike: only the row scale changes */   \
            scales[r] = quantize_row(v, width, q + r * width) / sqrtf((float)block);              \
        }                                                                                         \
    }

DEFINE_GATED_Q8(kvserve_silu_mul_q8, SILU_ARGUMENT, SILU_ARGUMENT16)
DEFINE_GATED_Q8(kvserve_gelu_tanh_mul_q8, GELU_ARGUMENT, GELU_ARGUMENT16)

/* x[r] += (rmsnorm(y[r]) * weight) R for the int32 product y = acc * row_scale * col_scale
 * ([rows][hidden], in the model's basis): R = diag(signs) then normalized Walsh-Hadamard blocks
 * of `block` columns (the residual rotation of the families with post-norms; block 1 and no
 * signs: R = I). A post-norm cannot be folded into a product as a pre-norm is (its weight acts
 * after the normalization of the product's own output), so it is applied here, then rotated. */
void kvserve_add_post_norm_q8(float *x, const int32_t *acc, const float *row_scales,
                              const float *col_scales, const float *weight, const float *signs,
                              int64_t rows, int64_t hidden, int64_t block, float eps,
                              int num_threads) {
    _Pragma("omp parallel for if (rows >= 8) num_threads(num_threads)")
    for (int64_t r = 0; r < rows; r++) {
        const int32_t *ar = acc + r * hidden;
        const float rs = row_scales[r];
        float v[hidden], sum = 0.f;
        _Pragma("omp simd reduction(+ : sum)") for (int64_t i = 0; i < hidden; i++) {
            v[i] = (float)ar[i] * rs * col_scales[i];
            sum += v[i] * v[i];
        }
        const float scale = 1.f / sqrtf(sum / (float)hidden + eps);
        if (signs) {
            _Pragma("omp simd") for (int64_t i = 0; i < hidden; i++) v[i] *= scale * weight[i] * signs[i];
        } else {
            _Pragma("omp simd") for (int64_t i = 0; i < hidden; i++) v[i] *= scale * weight[i];
        }
        if (block > 1)
            for (int64_t b = 0; b < hidden; b += block) walsh_hadamard(v + b, block);
        const float norm = 1.f / sqrtf((float)block);
        float *xr = x + r * hidden;
        _Pragma("omp simd") for (int64_t i = 0; i < hidden; i++) xr[i] += v[i] * norm;
    }
}

#define DEFINE_DEQUANTIZE(NAME, T, STORE)                                                          \
    void NAME(const int32_t *acc, const float *row_scales, const float *col_scales,              \
              const float *bias, T *out, int64_t rows, int64_t cols, int num_threads) {           \
        _Pragma("omp parallel for if (rows >= 8) num_threads(num_threads)")                        \
        for (int64_t r = 0; r < rows; r++) {                                                      \
            const int32_t *ar = acc + r * cols;                                                   \
            const float rs = row_scales[r];                                                       \
            T *orow = out + r * cols;                                                             \
            if (bias) {                                                                           \
                _Pragma("omp simd") for (int64_t i = 0; i < cols; i++) orow[i] =                  \
                    STORE((float)ar[i] * rs * col_scales[i] + bias[i]);                           \
            } else {                                                                              \
                _Pragma("omp simd") for (int64_t i = 0; i < cols; i++) orow[i] =                  \
                    STORE((float)ar[i] * rs * col_scales[i]);                                     \
            }                                                                                     \
        }                                                                                         \
    }

DEFINE_DEQUANTIZE(kvserve_dequantize_f32, float, float_identity)
DEFINE_DEQUANTIZE(kvserve_dequantize_bf16, uint16_t, float_to_bf16)

/* out[r] = x[r] @ m for x: [rows][n], m: [n][n] float32, one row at a time in a fixed order, so
 * a row's result never depends on how many rows share the call (a library GEMM may pick
 * another kernel, and another summation order, for another row count). With fewer rows than
 * threads, each row's columns are split between the threads: every output still sums over k in
 * the same order, and a single row (batch-1 decode) reads the matrix at every core's bandwidth
 * (16 MiB for hidden 2048). */
void kvserve_rotate_rows(const float *x, const float *m, float *out, int64_t rows, int64_t n,
                         int num_threads) {
    const int64_t parts = rows < num_threads ? (num_threads + rows - 1) / rows : 1;
    const int64_t width = ((n + parts - 1) / parts + 15) / 16 * 16;
    const int parallel = rows * parts > 1 && rows * n * n >= (1 << 16);
    _Pragma("omp parallel for schedule(static) if (parallel) num_threads(num_threads)")
    for (int64_t task = 0; task < rows * parts; task++) {
        const int64_t r = task / parts, first = (task % parts) * width;
        const int64_t last = first + width < n ? first + width : n;
        if (first >= last) continue;
        const float *xr = x + r * n;
        float *orow = out + r * n;
        memset(orow + first, 0, sizeof(float) * (last - first));
        for (int64_t k = 0; k < n; k++) {
            const float xk = xr[k];
            const float *mk = m + k * n;
            _Pragma("omp simd") for (int64_t j = first; j < last; j++) orow[j] += xk * mk[j];
        }
    }
}

/* indices[r][0:k] = the columns of the k largest values of row r of x: [rows][n] float32, in
 * decreasing order, the lower column first among equal values (NaN never selected). A running
 * threshold (the k-th best so far) lets nearly every value be rejected by one comparison, 16 at
 * a time where AVX-512 exists. k <= 64 and k <= n. */
void kvserve_topk_rows(const float *x, int64_t rows, int64_t n, int64_t k, int64_t *indices,
                       int num_threads) {
    _Pragma("omp parallel for if (rows >= 2) num_threads(num_threads)")
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * n;
        float best[64];
        int64_t where[64];
        int64_t count = 0;
        float threshold = -INFINITY; /* valid once count == k */
#define KVSERVE_TOPK_OFFER(COLUMN)                                                                 \
    do {                                                                                           \
        const int64_t column_ = (COLUMN);                                                          \
        const float value_ = row[column_];                                                         \
        if (!(value_ == value_)) break;                                                            \
        if (count == k && !(value_ > threshold)) break;                                            \
        int64_t slot_ = count < k ? count++ : k - 1;                                               \
        while (slot_ > 0 && best[slot_ - 1] < value_) {                                            \
            best[slot_] = best[slot_ - 1];                                                         \
            where[slot_] = where[slot_ - 1];                                                       \
            slot_--;                                                                               \
        }                                                                                          \
        best[slot_] = value_;                                                                      \
        where[slot_] = column_;                                                                    \
        if (count == k) threshold = best[k - 1];                                                   \
    } while (0)
        int64_t j = 0;
        for (; j < n && count < k; j++) KVSERVE_TOPK_OFFER(j);
#if defined(__AVX512F__)
        for (; j + 16 <= n; j += 16) {
            __mmask16 above = _mm512_cmp_ps_mask(_mm512_loadu_ps(row + j),
                                                 _mm512_set1_ps(threshold), _CMP_GT_OQ);
            while (above) {
                const int lane = __builtin_ctz(above);
                above &= above - 1;
                KVSERVE_TOPK_OFFER(j + lane);
            }
        }
#endif
        for (; j < n; j++) KVSERVE_TOPK_OFFER(j);
#undef KVSERVE_TOPK_OFFER
        for (int64_t i = 0; i < k; i++) indices[r * k + i] = i < count ? where[i] : 0;
    }
}
