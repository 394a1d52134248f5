/*
 * Products with weights kept in 4-bit blocks (`--quantization q4`, kvserve/model/linear/q4.py), with
 * AVX512-VNNI: the weights stay 4 bits in memory and are unpacked in registers, so a decode step,
 * which reads every weight once, reads about half the bytes of int8 weights.
 *
 * Weights are GGUF's Q4_0 / Q4_1 blocks, unchanged: 32 consecutive inputs of one output column
 * share a scale d (and, for Q4_1, an offset m): w = d * q + m, q in 0..15 (Q4_0: m = -8 d).
 * Activations come in blocks of 32 values sharing a scale e, a = e * p with p an integer of about
 * 12 bits held in two int8 parts (see quantize_blocks_row), and `sums` holds e * sum(p) of each
 * block. Then for one block
 *
 *   sum_k w[k] a[k] = (d e) * sum_k q[k] p[k] + m * (e * sum_k p[k])
 *
 * The integer sum is exact (vpdpbusd, unsigned q times signed parts of p); the two float terms
 * are added per block. Each row is computed alone in a fixed order, so its result never depends on the
 * other rows of the step or the thread count.
 *
 * Layout, per panel of 32 output columns and block of 32 inputs (a "record", contiguous):
 *   nibbles [2][4][16][4]: half j of the columns, quarter h of the block, column c, byte b:
 *            low nibble = q[k = 8h + b], high nibble = q[k = 8h + 4 + b] of column 16j + c;
 *            one 64-byte load is 16 columns x 8 inputs, unpacked by a mask and a shift.
 *   d [32] float16, then (Q4_1 only) m [32] float16.
 * Records run over blocks, then panels: [panels][blocks][record bytes]. Columns past n are zero.
 */
#include <stdint.h>
#include <string.h>

#include "common.h"
#include "q4.h"
#include "task_ranges.h"

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>

#define Q4_COLS 32
#define Q4_NIBBLE_BYTES 512

int kvserve_q4_available(void) { return 1; }

static inline __m512i broadcast4(const int8_t *p) {
    int32_t four;
    memcpy(&four, p, 4);
    return _mm512_set1_epi32(four);
}

/* Activations come in two int8 parts (see quantize_blocks_row): a block's values are
 * e * (16 p + r), so its integer sum is sum((16 q) p) + sum(q r): one pass over the unpacked
 * weights multiplies the nibbles shifted up (16 q <= 240 still fits the unsigned operand) by p
 * and the nibbles by r. Exact in int32 (|sum| <= 32 * (240 * 127 + 15 * 8)). */
#define DEFINE_Q4_MICRO(MR)                                                                        \
    static inline void q4_micro_##MR(const int8_t *a, const int8_t *a2, int64_t lda,              \
                                     const float *scales, const float *sums, int64_t lds,         \
                                     const uint8_t *panel, int64_t blocks, int64_t record,        \
                                     int asym, float *c, int64_t ldc, int64_t cols) {             \
        __m512 res[MR][2];                                                                        \
        _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++) res[i][0] = res[i][1] =              \
            _mm512_setzero_ps();                                                                  \
        const __m512i low = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8((char)0xF0);          \
        for (int64_t g = 0; g < blocks; g++) {                                                    \
            const uint8_t *rec = panel + g * record;                                              \
            __m512i acc[MR][2];                                                                   \
            _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++) acc[i][0] = acc[i][1] =          \
                _mm512_setzero_si512();                                                           \
            _Pragma("GCC unroll 4") for (int h = 0; h < 4; h++) {                                 \
                __m512i lo[2], hi[2], lo16[2], hi16[2];                                           \
                _Pragma("GCC unroll 2") for (int j = 0; j < 2; j++) {                             \
                    const __m512i w = _mm512_loadu_si512((const void *)(rec + 256 * j + 64 * h)); \
                    lo[j] = _mm512_and_si512(w, low);                                             \
                    hi[j] = _mm512_and_si512(_mm512_srli_epi16(w, 4), low);                       \
                    lo16[j] = _mm512_and_si512(_mm512_slli_epi16(w, 4), high);                    \
                    hi16[j] = _mm512_and_si512(w, high);                                          \
                }                                                                                 \
                _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++) {                            \
                    const int8_t *ai = a + i * lda + 32 * g + 8 * h;                              \
                    const int8_t *ri = a2 + i * lda + 32 * g + 8 * h;                             \
                    const __m512i pl = broadcast4(ai), ph = broadcast4(ai + 4);                   \
                    const __m512i rl = broadcast4(ri), rh = broadcast4(ri + 4);                   \
                    _Pragma("GCC unroll 2") for (int j = 0; j < 2; j++) {                         \
                        acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], lo16[j], pl);                  \
                        acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], hi16[j], ph);                  \
                        acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], lo[j], rl);                    \
                        acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], hi[j], rh);                    \
                    }                                                                             \
                }                                                                                 \
            }                                                                                     \
            const __m512 d0 = _mm512_cvtph_ps(                                                   \
                _mm256_loadu_si256((const __m256i *)(rec + Q4_NIBBLE_BYTES)));                    \
            const __m512 d1 = _mm512_cvtph_ps(                                                   \
                _mm256_loadu_si256((const __m256i *)(rec + Q4_NIBBLE_BYTES + 32)));               \
            __m512 m0, m1;                                                                        \
            if (asym) {                                                                           \
                m0 = _mm512_cvtph_ps(                                                            \
                    _mm256_loadu_si256((const __m256i *)(rec + Q4_NIBBLE_BYTES + 64)));           \
                m1 = _mm512_cvtph_ps(                                                            \
                    _mm256_loadu_si256((const __m256i *)(rec + Q4_NIBBLE_BYTES + 96)));           \
            } else {                                                                              \
                m0 = _mm512_mul_ps(d0, _mm512_set1_ps(-8.f));                                     \
                m1 = _mm512_mul_ps(d1, _mm512_set1_ps(-8.f));                                     \
            }                                                                                     \
            _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++) {                                \
                const __m512 e = _mm512_set1_ps(scales[i * lds + g]);                             \
                const __m512 s = _mm512_set1_ps(sums[i * lds + g]);                               \
                res[i][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i][0]), _mm512_mul_ps(d0, e), \
                                            _mm512_fmadd_ps(m0, s, res[i][0]));                   \
                res[i][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i][1]), _mm512_mul_ps(d1, e), \
                                            _mm512_fmadd_ps(m1, s, res[i][1]));                   \
            }                                                                                     \
        }                                                                                         \
        _Pragma("GCC unroll 2") for (int j = 0; j < 2; j++) {                                     \
            const int64_t left = cols - 16 * j;                                                   \
            if (left <= 0) break;                                                                 \
            const __mmask16 mask = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1); \
            _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++)                                  \
                _mm512_mask_storeu_ps(c + i * ldc + 16 * j, mask, res[i][j]);                     \
        }                                                                                         \
    }

DEFINE_Q4_MICRO(1)
DEFINE_Q4_MICRO(2)
DEFINE_Q4_MICRO(3)
DEFINE_Q4_MICRO(4)

#define Q4_MR 4

/*
 * c[r][col] = sum_k w[col][k] a[r][k] for a: [rows][k] int8 with scales and sums [rows][k / 32]
 * float32, the weight packed as above ([panels][k / 32][record]), c: [rows][n] float32.
 * k is a positive multiple of 32 (the caller checks).
 */
void kvserve_q4_gemm(const int8_t *a, const float *scales, const float *sums, int64_t rows,
                     int64_t k, const uint8_t *packed, int64_t n, int asym, float *c,
                     int num_threads) {
    if (rows <= 0 || n <= 0 || k <= 0) return;
    const int64_t blocks = k / 32, panels = (n + Q4_COLS - 1) / Q4_COLS;
    const int64_t record = Q4_NIBBLE_BYTES + (asym ? 128 : 64);
    /* Tasks are (panel, row chunk): with few panels the rows are cut as well, so that every
     * thread gets work. */
    const int64_t chunk = panels < 2 * num_threads && rows >= 2 * Q4_MR
                              ? ((rows + 1) / 2 + Q4_MR - 1) / Q4_MR * Q4_MR
                              : rows;
    const int64_t chunks = (rows + chunk - 1) / chunk;
    const int parallel = panels * chunks > 1 && rows * n * k >= (1 << 16);
    task_share share; /* (task_ranges.h) */
    const int teams = task_share_init(&share, panels * chunks, parallel ? num_threads : 1);
    _Pragma("omp parallel if (teams > 1) num_threads(teams)") {
        task_cursor cursor = task_cursor_of(&share);
        for (int64_t task; (task = next_task(&cursor)) >= 0;) {
            const int64_t p = task / chunks, first = (task % chunks) * chunk;
            const int64_t last = first + chunk < rows ? first + chunk : rows;
            const uint8_t *panel = packed + p * blocks * record;
            const int64_t cols = n - p * Q4_COLS < Q4_COLS ? n - p * Q4_COLS : Q4_COLS;
            float *out = c + p * Q4_COLS;
            int64_t i = first;
#define Q4_CALL(MR)                                                                                \
        q4_micro_##MR(a + i * k, a + (rows + i) * k, k, scales + i * blocks, sums + i * blocks,    \
                      blocks, panel, blocks, record, asym, out + i * n, n, cols)
            for (; i + Q4_MR <= last; i += Q4_MR) Q4_CALL(4);
            switch (last - i) {
            case 3: Q4_CALL(3); break;
            case 2: Q4_CALL(2); break;
            case 1: Q4_CALL(1); break;
            default: break;
            }
#undef Q4_CALL
        }
    }
}

#else
int kvserve_q4_available(void) { return 0; }

void kvserve_q4_gemm(const int8_t *a, const float *scales, const float *sums, int64_t rows,
                     int64_t k, const uint8_t *packed, int64_t n, int asym, float *c,
                     int num_threads) {
    (void)a, (void)scales, (void)sums, (void)rows, (void)k, (void)packed, (void)n, (void)asym,
        (void)c, (void)num_threads;
}
#endif

/*
 * Activations in blocks of 32, each value in two int8 parts: for a block with e = max|v| / 127
 * (a block of zeros: e = 0), p = round-to-nearest-even(v / e) as llama.cpp's Q8_0, then the rest
 * r = round((v - e p) * 16 / e), in -8..8, so that v ~= (e / 16) * (16 p + r) within e / 32:
 * 12 bits per value where Q8_0 keeps 8. A block of 32 int8 values loses its small values next to
 * a large one, and the normalized hidden states carry a few very large channels: with 8 bits,
 * near-tied greedy choices of the default model flip (docs/benchmarks.md). The product pays a
 * second multiply per weight, on the same unpacked weights.
 * Stored: p at q[row][k], r at q[rows + row][k], the scale e / 16 and the block's
 * (e / 16) * sum(16 p + r) per row and block.
 */
static inline void quantize_blocks_row(const float *v, int64_t width, int8_t *q, int8_t *rest,
                                       float *scales, float *sums) {
    for (int64_t b = 0; b < width; b += 32) {
        const float top = abs_max(v + b, 32);
        const float e = top / 127.f, inverse = top > 0.f ? 127.f / top : 0.f;
        int32_t total = 0;
        _Pragma("omp simd reduction(+ : total)") for (int64_t i = b; i < b + 32; i++) {
            const float p = nearbyintf(v[i] * inverse);
            float r = nearbyintf((v[i] - e * p) * inverse * 16.f);
            r = r > 8.f ? 8.f : (r < -8.f ? -8.f : r);
            q[i] = (int8_t)p;
            rest[i] = (int8_t)r;
            total += 16 * (int32_t)p + (int32_t)r;
        }
        scales[b / 32] = e / 16.f;
        sums[b / 32] = e / 16.f * (float)total;
    }
}

/* x += delta (when given); then, with `normalize`, the two-part blocks of rmsnorm(x) * weight
 * into q [2][rows][hidden]. */
void kvserve_add_rmsnorm_qb(float *x, const float *delta, const float *weight, int8_t *q,
                            float *scales, float *sums, int64_t rows, int64_t hidden, float eps,
                            int normalize, int num_threads) {
    _Pragma("omp parallel for if (rows >= 8) num_threads(num_threads)")
    for (int64_t r = 0; r < rows; r++) {
        float *xr = x + r * hidden;
        if (delta) {
            const float *dr = delta + r * hidden;
            _Pragma("omp simd") for (int64_t i = 0; i < hidden; i++) xr[i] += dr[i];
        }
        if (!normalize) continue;
        float sum = 0.f;
        _Pragma("omp simd reduction(+ : sum)") for (int64_t i = 0; i < hidden; i++) sum +=
            xr[i] * xr[i];
        const float norm = 1.f / sqrtf(sum / (float)hidden + eps);
        float v[hidden];
        _Pragma("omp simd") for (int64_t i = 0; i < hidden; i++) v[i] = xr[i] * norm * weight[i];
        quantize_blocks_row(v, hidden, q + r * hidden, q + (rows + r) * hidden,
                            scales + r * (hidden / 32), sums + r * (hidden / 32));
    }
}

#define DEFINE_QUANTIZE_BLOCKS(NAME, T, LOAD)                                                      \
    void NAME(const T *x, int64_t rows, int64_t width, int64_t row_stride, int8_t *q,             \
              float *scales, float *sums, int num_threads) {                                      \
        _Pragma("omp parallel for if (rows >= 8) num_threads(num_threads)")                        \
        for (int64_t r = 0; r < rows; r++) {                                                      \
            float v[width];                                                                       \
            const T *xr = x + r * row_stride;                                                     \
            _Pragma("omp simd") for (int64_t i = 0; i < width; i++) v[i] = LOAD(xr[i]);           \
            quantize_blocks_row(v, width, q + r * width, q + (rows + r) * width,                  \
                                scales + r * (width / 32), sums + r * (width / 32));              \
        }                                                                                         \
    }

DEFINE_QUANTIZE_BLOCKS(kvserve_quantize_blocks_f32, float, float_identity)
DEFINE_QUANTIZE_BLOCKS(kvserve_quantize_blocks_bf16, uint16_t, bf16_to_float)

/* m = gelu_tanh(gate) * up (GeGLU), otherwise as kvserve_silu_mul_qb. */
void kvserve_gelu_tanh_mul_qb(const float *gate_up, int8_t *q, float *scales, float *sums,
                              int64_t rows, int64_t width, int num_threads) {
    _Pragma("omp parallel for if (rows >= 8) num_threads(num_threads)")
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up + r * 2 * width, *up = gate + width;
        float v[width];
        _Pragma("omp simd") for (int64_t i = 0; i < width; i++) v[i] =
            gelu_tanh_approx(gate[i]) * up[i];
        quantize_blocks_row(v, width, q + r * width, q + (rows + r) * width,
                            scales + r * (width / 32), sums + r * (width / 32));
    }
}

/* m = silu(gate) * up from the float gate|up product [rows][2 * width], quantized per block. */
void kvserve_silu_mul_qb(const float *gate_up, int8_t *q, float *scales, float *sums,
                         int64_t rows, int64_t width, int num_threads) {
    _Pragma("omp parallel for if (rows >= 8) num_threads(num_threads)")
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up + r * 2 * width, *up = gate + width;
        float v[width];
        _Pragma("omp simd") for (int64_t i = 0; i < width; i++) v[i] =
            gate[i] / (1.f + exp_approx(-gate[i])) * up[i];
        quantize_blocks_row(v, width, q + r * width, q + (rows + r) * width,
                            scales + r * (width / 32), sums + r * (width / 32));
    }
}
