/*
 * float32 products of a few rows with a fixed weight, out = x w^T + bias: the row counts of
 * decode steps, where the BLAS's small-row path streams the weights at a tenth to a third of
 * the memory's speed on the CPU measured (4-10 GB/s against 29; docs/benchmarks.md). Such a product is bound by reading
 * the weight, so each weight row is read once per call, for every row of x: the columns are cut
 * into panels of four weight rows (a task each), and a panel, once loaded, stays in L1 while
 * the rows of x go past it two at a time.
 *
 * Every output is one fixed arithmetic, whatever the number of rows and of threads: eight
 * lanes (lane i takes k = i mod 8, fused multiply-adds in order of k), the lanes added as
 * ((0+1)+(2+3))+((4+5)+(6+7)), then the bias. A row's result does not depend on the other rows
 * of the call, so a decode row gives the same logits alone and in a batch.
 *
 * x: [rows][k], w: [n][k], out: [rows][n], all contiguous; bias: [n] or NULL; k % 8 == 0
 * (kvserve/model/kernels.py checks all of it).
 */
#include <stdint.h>

#include "common.h"
#include "f32_gemm.h"
#include "task_ranges.h"

#if defined(__AVX2__) && defined(__FMA__)

int kvserve_f32_gemm_available(void) { return 1; }

/* out[r][c] for R (a constant, 1 or 2) rows of x and the four weight rows of one panel */
static inline __attribute__((always_inline)) void panel_rows(const float *x, const int R,
                                                            int64_t k, const float *w,
                                                            const float *bias, float *out,
                                                            int64_t n) {
    __m256 acc[2][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < 4; c++) acc[r][c] = _mm256_setzero_ps();
    for (int64_t d = 0; d < k; d += 8) {
        __m256 wv[4];
        for (int c = 0; c < 4; c++) wv[c] = in_register(_mm256_loadu_ps(w + c * k + d));
        for (int r = 0; r < R; r++) {
            const __m256 xv = in_register(_mm256_loadu_ps(x + r * k + d));
            for (int c = 0; c < 4; c++) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
        }
    }
    for (int r = 0; r < R; r++) {
        __m128 sums = lanes_sum4(acc[r]);
        if (bias) sums = _mm_add_ps(sums, _mm_loadu_ps(bias));
        _mm_storeu_ps(out + r * n, sums);
    }
}

/* out[r][0] for one weight row (the columns past the last whole panel), in the same sums */
static inline void column_rows(const float *x, int64_t rows, int64_t k, const float *w,
                               const float *bias, float *out, int64_t n) {
    for (int64_t r = 0; r < rows; r++) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t d = 0; d < k; d += 8)
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * k + d), _mm256_loadu_ps(w + d), acc);
        out[r * n] = bias ? lanes_sum(acc) + bias[0] : lanes_sum(acc);
    }
}

void kvserve_f32_gemm(const float *x, int64_t rows, int64_t k, const float *w, int64_t n,
                      const float *bias, float *out, int num_threads) {
    if (rows <= 0 || n <= 0) return;
    const int64_t panels = n / 4;
    task_share share; /* (task_ranges.h) */
    const int teams = task_share_init(&share, panels, panels > 1 ? num_threads : 1);
    _Pragma("omp parallel if (teams > 1) num_threads(teams)") {
        task_cursor cursor = task_cursor_of(&share);
        for (int64_t p; (p = next_task(&cursor)) >= 0;) {
            const int64_t j = 4 * p;
            const float *b = bias ? bias + j : NULL;
            int64_t r = 0;
            for (; r + 2 <= rows; r += 2)
                panel_rows(x + r * k, 2, k, w + j * k, b, out + r * n + j, n);
            if (r < rows) panel_rows(x + r * k, 1, k, w + j * k, b, out + r * n + j, n);
        }
    }
    for (int64_t j = panels * 4; j < n; j++)
        column_rows(x, rows, k, w + j * k, bias ? bias + j : NULL, out + j, n);
}

#else

/* Without AVX2 and FMA the callers keep the BLAS. */
int kvserve_f32_gemm_available(void) { return 0; }

void kvserve_f32_gemm(const float *x, int64_t rows, int64_t k, const float *w, int64_t n,
                      const float *bias, float *out, int num_threads) {
    (void)x, (void)rows, (void)k, (void)w, (void)n, (void)bias, (void)out, (void)num_threads;
}

#endif
