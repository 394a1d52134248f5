/*
 * int8 x int8 -> int32 matrix product with AVX512-VNNI (or AVX2), for weights packed once at load:
 *
 *   c[m][n] = sum_k a[m][k] * w[n][k]      a: [rows][k] int8, c: [rows][n] int32
 *
 * The weight is packed as [n / 64][k / 4][64][4]: one 64-byte load holds 4 consecutive k of 16
 * columns, which is what one vpdpbusd consumes against 4 bytes of a row broadcast to every lane.
 * vpdpbusd multiplies unsigned by signed bytes, so rows enter as a + 128 (a byte xor) and the
 * surplus 128 * sum_k w[n][k] (`correction`, computed at packing) is taken off at the end. Sums
 * are exact in int32 (|c| <= 255 * 128 * k), so the result never depends on the row count, the
 * blocking or the thread count.
 *
 * A library int8 product (oneDNN through torch._int_mm) reorders the weight into its own layout
 * on every call, which costs as much as the product itself for the few rows of decode.
 * Work is split over blocks of 64 columns; inside a block, rows go 6 at a time (24 accumulators).
 */
#include "int8_gemm.h"
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define KVSERVE_INT8_ISA 1

#define NR 4
#define BLOCK_COLS (NR * 16)

#define DEFINE_MICRO(MR)                                                                           \
    static inline void micro_##MR(const int8_t *a, int64_t lda, const int8_t *panel,             \
                                  int64_t steps, const int32_t *correction, int32_t *c,           \
                                  int64_t ldc, int64_t cols) {                                    \
        __m512i acc[MR][NR];                                                                      \
        _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++)                                      \
            _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) acc[i][j] =                      \
                _mm512_setzero_si512();                                                           \
        const __m512i flip = _mm512_set1_epi32((int32_t)0x80808080u);                             \
        for (int64_t s = 0; s < steps; s++) {                                                     \
            const int8_t *b = panel + s * BLOCK_COLS * 4;                                         \
            __m512i w[NR];                                                                        \
            _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) w[j] =                           \
                _mm512_loadu_si512((const void *)(b + 64 * j));                                   \
            _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++) {                                \
                int32_t four;                                                                     \
                memcpy(&four, a + i * lda + 4 * s, 4);                                            \
                const __m512i x = _mm512_xor_si512(_mm512_set1_epi32(four), flip);               \
                _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) acc[i][j] =                  \
                    _mm512_dpbusd_epi32(acc[i][j], x, w[j]);                                      \
            }                                                                                     \
        }                                                                                         \
        _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) {                                    \
            const __m512i fix = _mm512_loadu_si512((const void *)(correction + 16 * j));          \
            const int64_t left = cols - 16 * j;                                                   \
            if (left <= 0) break;                                                                 \
            const __mmask16 mask = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1); \
            _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++) _mm512_mask_storeu_epi32(        \
                c + i * ldc + 16 * j, mask, _mm512_sub_epi32(acc[i][j], fix));                     \
        }                                                                                         \
    }

DEFINE_MICRO(1)
DEFINE_MICRO(2)
DEFINE_MICRO(3)
DEFINE_MICRO(4)
DEFINE_MICRO(5)
DEFINE_MICRO(6)

#elif defined(__AVX2__)
#include <immintrin.h>
#define KVSERVE_INT8_ISA 2

/*
 * AVX2 (no VNNI): the same packed weights and the same exact int32 sums. vpmaddubsw multiplies
 * unsigned by signed bytes into 16-bit pair sums, which would saturate for a + 128 (255 * 127 *
 * 2 > 32767), so the weight enters as |w| and its sign moves onto the row byte: |w| * sign(w) a.
 * With |a| <= 127 (the quantizers give -127..127; native.int8_gemm checks it) a pair sum is at
 * most 2 * 128 * 127 < 32767, and vpmaddwd by ones widens pairs of pairs into the int32 sum of
 * 4 k. No + 128 surplus: the correction is not used. A 32-byte chunk holds 4 k of 8 columns; a
 * block of 64 columns goes in 4 passes of 2 chunks, so that up to 4 rows keep their 2 * MR
 * accumulators and the pass's weights in the 16 registers.
 */
#define BLOCK_COLS 64
#define PASS_CHUNKS 2
#define PASS_COLS (8 * PASS_CHUNKS)

#define DEFINE_MICRO(MR)                                                                           \
    static inline void micro_##MR(const int8_t *a, int64_t lda, const int8_t *panel,             \
                                  int64_t steps, const int32_t *correction, int32_t *c,           \
                                  int64_t ldc, int64_t cols) {                                    \
        (void)correction;                                                                         \
        const __m256i ones = _mm256_set1_epi16(1);                                                \
        for (int pass = 0; pass < BLOCK_COLS / PASS_COLS && PASS_COLS * pass < cols; pass++) {    \
            __m256i acc[MR][PASS_CHUNKS];                                                         \
            _Pragma("GCC unroll 4") for (int i = 0; i < MR; i++)                                  \
                _Pragma("GCC unroll 2") for (int j = 0; j < PASS_CHUNKS; j++) acc[i][j] =         \
                    _mm256_setzero_si256();                                                       \
            const int8_t *b = panel + 32 * PASS_CHUNKS * pass;                                    \
            for (int64_t s = 0; s < steps; s++, b += BLOCK_COLS * 4) {                            \
                __m256i w[PASS_CHUNKS], magnitude[PASS_CHUNKS];                                   \
                _Pragma("GCC unroll 2") for (int j = 0; j < PASS_CHUNKS; j++) {                   \
                    w[j] = _mm256_loadu_si256((const __m256i *)(b + 32 * j));                     \
                    magnitude[j] = _mm256_abs_epi8(w[j]);                                         \
                }                                                                                 \
                _Pragma("GCC unroll 4") for (int i = 0; i < MR; i++) {                            \
                    int32_t four;                                                                 \
                    memcpy(&four, a + i * lda + 4 * s, 4);                                        \
                    const __m256i x = _mm256_set1_epi32(four);                                    \
                    _Pragma("GCC unroll 2") for (int j = 0; j < PASS_CHUNKS; j++) {               \
                        const __m256i pairs =                                                     \
                            _mm256_maddubs_epi16(magnitude[j], _mm256_sign_epi8(x, w[j]));        \
                        acc[i][j] = _mm256_add_epi32(acc[i][j], _mm256_madd_epi16(pairs, ones));  \
                    }                                                                             \
                }                                                                                 \
            }                                                                                     \
            _Pragma("GCC unroll 2") for (int j = 0; j < PASS_CHUNKS; j++) {                       \
                const int64_t first = PASS_COLS * pass + 8 * j, left = cols - first;              \
                if (left <= 0) break;                                                             \
                _Pragma("GCC unroll 4") for (int i = 0; i < MR; i++) {                            \
                    if (left >= 8) {                                                              \
                        _mm256_storeu_si256((__m256i *)(c + i * ldc + first), acc[i][j]);         \
                    } else {                                                                      \
                        int32_t lanes[8];                                                         \
                        _mm256_storeu_si256((__m256i *)lanes, acc[i][j]);                         \
                        memcpy(c + i * ldc + first, lanes, (size_t)left * sizeof(int32_t));       \
                    }                                                                             \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
    }

DEFINE_MICRO(1)
DEFINE_MICRO(2)
DEFINE_MICRO(3)
DEFINE_MICRO(4)

/* Five and six rows would not fit the registers: two calls. */
static inline void micro_5(const int8_t *a, int64_t lda, const int8_t *panel, int64_t steps,
                           const int32_t *correction, int32_t *c, int64_t ldc, int64_t cols) {
    micro_3(a, lda, panel, steps, correction, c, ldc, cols);
    micro_2(a + 3 * lda, lda, panel, steps, correction, c + 3 * ldc, ldc, cols);
}

static inline void micro_6(const int8_t *a, int64_t lda, const int8_t *panel, int64_t steps,
                           const int32_t *correction, int32_t *c, int64_t ldc, int64_t cols) {
    micro_3(a, lda, panel, steps, correction, c, ldc, cols);
    micro_3(a + 3 * lda, lda, panel, steps, correction, c + 3 * ldc, ldc, cols);
}

#else
#define KVSERVE_INT8_ISA 0
#endif

/* 1: AVX512-VNNI, 2: AVX2, 0: no kernel (the callers keep the float path). */
int kvserve_int8_gemm_available(void) { return KVSERVE_INT8_ISA; }

#if KVSERVE_INT8_ISA

void kvserve_int8_gemm(const int8_t *a, int64_t rows, int64_t k, const int8_t *packed,
                       const int32_t *correction, int64_t n, int32_t *c, int num_threads) {
    /* Nothing to compute (a step whose rows need no logits hands in zero rows): the chunk
     * arithmetic below would divide by zero. */
    if (rows <= 0 || n <= 0 || k <= 0) return;
    const int64_t blocks = (n + BLOCK_COLS - 1) / BLOCK_COLS, steps = k / 4;
    /* Tasks are (column block, row chunk): with an odd number of blocks (576 columns are 9) the
     * rows are cut in two as well, so that two threads get equal shares. */
    const int64_t chunk = blocks % 2 && rows >= 12 ? ((rows + 1) / 2 + 5) / 6 * 6 : rows;
    const int64_t chunks = (rows + chunk - 1) / chunk;
    const int parallel = blocks * chunks > 1 && rows * n * k >= (1 << 18);
    _Pragma("omp parallel for schedule(static) if (parallel) num_threads(num_threads)")
    for (int64_t task = 0; task < blocks * chunks; task++) {
        const int64_t nb = task / chunks, first = (task % chunks) * chunk;
        const int64_t last = first + chunk < rows ? first + chunk : rows;
        const int8_t *panel = packed + nb * steps * BLOCK_COLS * 4;
        const int32_t *fix = correction + nb * BLOCK_COLS;
        const int64_t cols = n - nb * BLOCK_COLS < BLOCK_COLS ? n - nb * BLOCK_COLS : BLOCK_COLS;
        int32_t *out = c + nb * BLOCK_COLS;
        int64_t i = first;
        for (; i + 6 <= last; i += 6) micro_6(a + i * k, k, panel, steps, fix, out + i * n, n, cols);
        switch (last - i) {
        case 5: micro_5(a + i * k, k, panel, steps, fix, out + i * n, n, cols); break;
        case 4: micro_4(a + i * k, k, panel, steps, fix, out + i * n, n, cols); break;
        case 3: micro_3(a + i * k, k, panel, steps, fix, out + i * n, n, cols); break;
        case 2: micro_2(a + i * k, k, panel, steps, fix, out + i * n, n, cols); break;
        case 1: micro_1(a + i * k, k, panel, steps, fix, out + i * n, n, cols); break;
        default: break;
        }
    }
}
#else
void kvserve_int8_gemm(const int8_t *a, int64_t rows, int64_t k, const int8_t *packed,
                       const int32_t *correction, int64_t n, int32_t *c, int num_threads) {
    (void)a, (void)rows, (void)k, (void)packed, (void)correction, (void)n, (void)c,
        (void)num_threads;
}
#endif
