/*
 * Helpers shared by the CPU kernels: bf16 <-> float conversion and a vectorizable exp.
 * Everything is static inline and branch-free so the loops that call it vectorize
 * (with -fno-math-errno -fno-trapping-math, see kvserve/model/kernel_build.py).
 */
#ifndef KVSERVE_COMMON_H
#define KVSERVE_COMMON_H

#include <math.h>
#include <stdint.h>

static inline float bf16_to_float(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    __builtin_memcpy(&f, &bits, sizeof f);
    return f;
}

/* Round to nearest even; a NaN keeps a mantissa bit so it cannot round to infinity. */
static inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    __builtin_memcpy(&bits, &f, sizeof bits);
    const uint32_t nan = (bits & 0x7fffffffu) > 0x7f800000u;
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    return (uint16_t)(nan ? ((bits >> 16) | 0x40u) : rounded);
}

static inline float float_identity(float f) { return f; }

/* max |v[i]| over n values (0 for none): the scale of a symmetric int8 block, row or vector. */
static inline float abs_max(const float *v, int64_t n) {
    float top = 0.f;
    _Pragma("omp simd reduction(max : top)") for (int64_t i = 0; i < n; i++) {
        const float a = fabsf(v[i]);
        top = a > top ? a : top;
    }
    return top;
}

/* exp(x), Cephes' expf polynomial after range reduction: within about one ulp of expf for
 * x in [-87, 88] (clamped outside), and it vectorizes where a libm call would not. */
static inline float exp_approx(float x) {
    x = x < -87.3f ? -87.3f : (x > 88.0f ? 88.0f : x);
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float y = p * r * r + r + 1.0f;
    const int32_t exponent = ((int32_t)n + 127) << 23;
    float scale;
    __builtin_memcpy(&scale, &exponent, sizeof scale);
    return y * scale;
}

/* gelu with the tanh approximation (Gemma's GeGLU, torch's approximate="tanh"),
 * 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), written as g sigmoid(2 sqrt(2 / pi) (...)):
 * the same identity, one exp_approx, and it vectorizes as SiLU's g / (1 + exp(-g)) does. */
static inline float gelu_tanh_approx(float g) {
    const float a = 1.5957691216057308f * (g + 0.044715f * g * g * g);
    return g / (1.f + exp_approx(-a));
}

/* In place, softmax of each of `rows` rows of `length` floats (row stride `length`). */
static inline void softmax_rows(float *scores, int64_t rows, int64_t length) {
    for (int64_t g = 0; g < rows; g++) {
        float *s = scores + g * length, top = -INFINITY, total = 0.f;
        _Pragma("omp simd reduction(max : top)") for (int64_t j = 0; j < length; j++) top =
            s[j] > top ? s[j] : top;
        _Pragma("omp simd reduction(+ : total)") for (int64_t j = 0; j < length; j++) {
            s[j] = exp_approx(s[j] - top);
            total += s[j];
        }
        const float inv = 1.f / total;
        _Pragma("omp simd") for (int64_t j = 0; j < length; j++) s[j] *= inv;
    }
}

/* Cuts `rows` rows into tiles: runs of up to `max_rows` consecutive rows of one prefill chunk
 * (the same table, lengths growing by one). tiles ([rows + 1]) gets each tile's first row, then
 * `rows`; returns the number of tiles. Without row tables every row is a tile of its own. */
static inline int64_t cut_tiles(const int64_t *row_tables, const int64_t *lengths, int64_t rows,
                                int64_t max_rows, int64_t *tiles) {
    int64_t count = 0;
    for (int64_t r = 0; r < rows; r++) {
        const int continues = r > 0 && row_tables && row_tables[r] == row_tables[r - 1] &&
                              lengths[r] == lengths[r - 1] + 1 && r - tiles[count - 1] < max_rows;
        if (!continues) tiles[count++] = r;
    }
    tiles[count] = rows;
    return count;
}

/* Half-rotation RoPE, in place, of `count` consecutive heads of `head_dim` values at `row`,
 * with this position's half tables `c` and `s` ([head_dim / 2] float32). */
#define DEFINE_ROTATE_HEADS(NAME, T, LOAD, STORE)                                                   \
    static inline void NAME(T *row, const float *c, const float *s, int64_t count,                \
                            int64_t head_dim) {                                                   \
        const int64_t half = head_dim / 2;                                                        \
        for (int64_t h = 0; h < count; h++) {                                                     \
            T *x = row + h * head_dim;                                                            \
            _Pragma("omp simd") for (int64_t i = 0; i < half; i++) {                              \
                const float a = LOAD(x[i]), b = LOAD(x[i + half]);                                \
                x[i] = STORE(a * c[i] - b * s[i]);                                                \
                x[i + half] = STORE(b * c[i] + a * s[i]);                                         \
            }                                                                                     \
        }                                                                                         \
    }

DEFINE_ROTATE_HEADS(rotate_heads_f32, float, float_identity, float_identity)
DEFINE_ROTATE_HEADS(rotate_heads_bf16, uint16_t, bf16_to_float, float_to_bf16)

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* `v` as it is, held in a register: a vector used by several multiply-adds is then loaded once,
 * where the compiler would otherwise fold a load from L1 into each of them. In paged
 * attention's inner loops (12 sums and their operands in the 16 vector registers) the folded
 * loads were about 15 for 12 multiply-adds, and two loads a cycle then bound them; the float32
 * row product holds its weight and row chunks the same way. */
static inline __m256 in_register(__m256 v) {
    __asm__("" : "+x"(v));
    return v;
}

/* ((v0+v1)+(v2+v3))+((v4+v5)+(v6+v7)) */
static inline float lanes_sum(__m256 v) {
    const __m256 h = _mm256_hadd_ps(v, v);
    const __m256 h2 = _mm256_hadd_ps(h, h);
    return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(h2), _mm256_extractf128_ps(h2, 1)));
}

/* lanes_sum of each of v[0..3], in one vector of 4, by the same tree */
static inline __m128 lanes_sum4(const __m256 v[4]) {
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    return _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
}

#endif

#if defined(__AVX512F__)
#include <immintrin.h>

/* r[i] = sum of the 16 lanes of v[i], for 16 vectors at once (a transpose by shuffles: about 3
 * instructions per sum instead of the 8 of one horizontal reduction). */
static inline __m512 sum16(const __m512 v[16]) {
    __m512 t[8], u[4];
    for (int i = 0; i < 8; i++)
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++)
        u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
    const __m512 a = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x44),
                                   _mm512_shuffle_f32x4(u[0], u[1], 0xEE));
    const __m512 b = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x44),
                                   _mm512_shuffle_f32x4(u[2], u[3], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
}

/* exp(x) for 16 lanes: exp_approx's polynomial, 2^n applied by scalef. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.0f));
    const __m512 n = _mm512_roundscale_ps(
        _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(y, n);
}
#endif

#endif
