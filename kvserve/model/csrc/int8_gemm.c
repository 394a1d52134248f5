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
#define _GNU_SOURCE /* syscall(): the tile unit's permission (int8_amx_setup) */
#include "int8_gemm.h"
#include <stdint.h>
#include <string.h>

#include "task_ranges.h"

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define KVSERVE_INT8_ISA 1

#define NR 4
#define BLOCK_COLS (NR * 16)

#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
/*
 * The AMX-INT8 tile unit (Sapphire Rapids on), from INT8_AMX_MIN_ROWS rows: the same packed
 * weights are its B tiles as they lie ([k / 4][16 columns][4] at a stride of a step's 256
 * bytes), the rows its A tiles as they are (signed x signed: no + 128, no correction), 16
 * rows and 64 inputs a tile, and its int32 sums are exact as vpdpbusd's: the result is the
 * same integers, whatever the path. Measured on the Sapphire Rapids machine (the default
 * model's 30 layers' shapes, 2 threads, one call each from Python, min of 7): 5 rows 11.8 ->
 * 9.8 ms, 8 rows 13.0 -> 9.9, 32 rows 20.0 -> 12.7, 512 rows 132.9 -> 63.9 (1 row, on the
 * vectors either way, 10.0); in the engine, a 5-row verify step of the default model went
 * from 1.71-1.81x a 1-row step's time to 1.45-1.50x.
 */
#include <pthread.h>

#include "amx.h"
#define INT8_AMX 1

#ifndef INT8_AMX_MIN_ROWS
#define INT8_AMX_MIN_ROWS 2
#endif
/* bytes of the weight stream prefetched ahead of the tile loads: the tile unit does not
 * overlap its loads' misses as the vector loads do (5 rows of the default model's layers cost
 * 2x the 1-row vector product without it, in the engine's verify steps) */
#define INT8_AMX_AHEAD 4096

static int int8_amx_on;
static pthread_once_t int8_amx_once = PTHREAD_ONCE_INIT;

static void int8_amx_setup(void) { int8_amx_on = amx_permitted(); }

/* The tiles of AMX_CONFIG (amx.h): 0-3 the sums of a block's 4 x 16 columns, 4 the rows (A),
 * 5-7 the weights (B) in turn */

/* One block of 64 columns for 16 rows at a (row stride lda; `live` of them stored). */
static inline void amx_block(const int8_t *a, int64_t lda, int64_t live, const int8_t *panel,
                             int64_t steps, int32_t *c, int64_t ldc, int64_t cols) {
    int32_t sums[4][16][16] __attribute__((aligned(64)));
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t s = 0; s < steps; s += 16) {
        const int8_t *b = panel + s * BLOCK_COLS * 4;
        /* the next 64 inputs' 4 KB (past the panel's end: the next panel, this thread's next
         * block under the static schedule) */
        for (int line = 0; line < 4096; line += 64)
            _mm_prefetch((const char *)b + INT8_AMX_AHEAD + line, _MM_HINT_T0);
        _tile_loadd(4, a + 4 * s, lda);
        _tile_loadd(5, b, BLOCK_COLS * 4);
        _tile_dpbssd(0, 4, 5);
        _tile_loadd(6, b + 64, BLOCK_COLS * 4);
        _tile_dpbssd(1, 4, 6);
        _tile_loadd(7, b + 128, BLOCK_COLS * 4);
        _tile_dpbssd(2, 4, 7);
        _tile_loadd(5, b + 192, BLOCK_COLS * 4);
        _tile_dpbssd(3, 4, 5);
    }
    _tile_stored(0, sums[0], 64);
    _tile_stored(1, sums[1], 64);
    _tile_stored(2, sums[2], 64);
    _tile_stored(3, sums[3], 64);
    for (int j = 0; j < NR; j++) {
        const int64_t left = cols - 16 * j;
        if (left <= 0) break;
        const __mmask16 mask = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
        for (int64_t i = 0; i < live; i++)
            _mm512_mask_storeu_epi32(c + i * ldc + 16 * j, mask,
                                     _mm512_load_si512((const void *)sums[j][i]));
    }
}

/* The calling thread's buffer for the call's last rows (fewer than 16) with zero rows after
 * them, 16 x k, grown as needed; NULL when memory runs out. */
static int8_t *amx_tail(int64_t k) {
    static _Thread_local int8_t *buffer;
    static _Thread_local int64_t size;
    if (size < 16 * k) {
        free(buffer);
        buffer = aligned_alloc(64, (size_t)((16 * k + 63) / 64 * 64));
        size = buffer ? 16 * k : 0;
    }
    return buffer;
}

/* kvserve_int8_gemm on the tile unit: tasks of (block, chunk of whole 16-row groups); 0, or -1
 * without memory for the tail rows' copy (the caller then takes the vector path, its results
 * the same). */
static int amx_gemm(const int8_t *a, int64_t rows, int64_t k, const int8_t *packed, int64_t n,
                    int32_t *c, int num_threads) {
    const int64_t blocks = (n + BLOCK_COLS - 1) / BLOCK_COLS, steps = k / 4;
    const int64_t groups = (rows + 15) / 16, whole = rows / 16, tail = rows - 16 * whole;
    /* with an odd number of blocks, the row groups cut in two as well (as below) */
    const int64_t per = blocks % 2 && groups >= 2 ? (groups + 1) / 2 : groups;
    const int64_t chunks = (groups + per - 1) / per;
    const int parallel = blocks * chunks > 1 && rows * n * k >= (1 << 18);
    int8_t *padded = NULL; /* the last group, read by every thread */
    if (tail) {
        padded = amx_tail(k);
        if (!padded) return -1;
        memcpy(padded, a + 16 * whole * k, (size_t)(tail * k));
        memset(padded + tail * k, 0, (size_t)((16 - tail) * k));
    }
    _Pragma("omp parallel if (parallel) num_threads(num_threads)") {
        _tile_loadconfig(&AMX_CONFIG);
        _Pragma("omp for schedule(static)")
        for (int64_t task = 0; task < blocks * chunks; task++) {
            const int64_t nb = task / chunks, first = (task % chunks) * per;
            const int64_t last = first + per < groups ? first + per : groups;
            const int8_t *panel = packed + nb * steps * BLOCK_COLS * 4;
            const int64_t cols = n - nb * BLOCK_COLS < BLOCK_COLS ? n - nb * BLOCK_COLS : BLOCK_COLS;
            for (int64_t g = first; g < last; g++) {
                const int partial = g == whole;
                amx_block(partial ? padded : a + 16 * g * k, k, partial ? tail : 16, panel, steps,
                          c + 16 * g * n + nb * BLOCK_COLS, n, cols);
            }
        }
        _tile_release();
    }
    return 0;
}
#endif

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

/* The rows from which on the product takes the tile unit; 0: never (no AMX-INT8 here, or
 * KVSERVE_AMX=0, read once). */
int kvserve_int8_gemm_amx(void) {
#ifdef INT8_AMX
    pthread_once(&int8_amx_once, int8_amx_setup);
    return int8_amx_on ? INT8_AMX_MIN_ROWS : 0;
#else
    return 0;
#endif
}

#if KVSERVE_INT8_ISA

void kvserve_int8_gemm(const int8_t *a, int64_t rows, int64_t k, const int8_t *packed,
                       const int32_t *correction, int64_t n, int32_t *c, int num_threads) {
    /* Nothing to compute (a step whose rows need no logits hands in zero rows): the chunk
     * arithmetic below would divide by zero. */
    if (rows <= 0 || n <= 0 || k <= 0) return;
#ifdef INT8_AMX
    pthread_once(&int8_amx_once, int8_amx_setup);
    if (int8_amx_on && rows >= INT8_AMX_MIN_ROWS && k % 64 == 0 &&
        amx_gemm(a, rows, k, packed, n, c, num_threads) == 0)
        return;
#endif
    const int64_t blocks = (n + BLOCK_COLS - 1) / BLOCK_COLS, steps = k / 4;
    /* Tasks are (column block, row chunk): with an odd number of blocks (576 columns are 9) the
     * rows are cut in two as well, so that two threads get equal shares. */
    const int64_t chunk = blocks % 2 && rows >= 12 ? ((rows + 1) / 2 + 5) / 6 * 6 : rows;
    const int64_t chunks = (rows + chunk - 1) / chunk;
    const int parallel = blocks * chunks > 1 && rows * n * k >= (1 << 18);
    task_share share; /* (task_ranges.h) */
    const int teams = task_share_init(&share, blocks * chunks, parallel ? num_threads : 1);
    _Pragma("omp parallel if (teams > 1) num_threads(teams)") {
        task_cursor cursor = task_cursor_of(&share);
        for (int64_t task; (task = next_task(&cursor)) >= 0;) {
            const int64_t nb = task / chunks, first = (task % chunks) * chunk;
            const int64_t last = first + chunk < rows ? first + chunk : rows;
            const int8_t *panel = packed + nb * steps * BLOCK_COLS * 4;
            const int32_t *fix = correction + nb * BLOCK_COLS;
            const int64_t left = n - nb * BLOCK_COLS, cols = left < BLOCK_COLS ? left : BLOCK_COLS;
            int32_t *out = c + nb * BLOCK_COLS;
            int64_t i = first;
            for (; i + 6 <= last; i += 6)
                micro_6(a + i * k, k, panel, steps, fix, out + i * n, n, cols);
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
}
#else
void kvserve_int8_gemm(const int8_t *a, int64_t rows, int64_t k, const int8_t *packed,
                       const int32_t *correction, int64_t n, int32_t *c, int num_threads) {
    (void)a, (void)rows, (void)k, (void)packed, (void)correction, (void)n, (void)c,
        (void)num_threads;
}
#endif
