/*
 * Grammar bitmasks applied to logits, for structured output.
 *
 *   apply_token_bitmask  logits[rows[i], t] = -inf wherever bit t of bitmask row i is clear
 *
 * The bitmask is the layout llguidance and xgrammar both fill: int32 words, token t allowed when
 * bit (t % 32) of word (t / 32) is set. Tokens past the bitmask's last word are disallowed (a
 * padded vocabulary's unused rows), so a model larger than the tokenizer never draws them.
 */
#include "common.h"
#include "bitmask.h"

void kvserve_apply_token_bitmask(float *logits, int64_t logit_row_stride, int64_t vocab,
                                 const int32_t *bitmask, int64_t words, const int64_t *rows,
                                 int64_t num_rows, int num_threads) {
    _Pragma("omp parallel for if (num_rows >= 4) num_threads(num_threads)")
    for (int64_t i = 0; i < num_rows; i++) {
        float *row = logits + rows[i] * logit_row_stride;
        const uint32_t *mask = (const uint32_t *)(bitmask + i * words);
        const int64_t covered = words * 32 < vocab ? words * 32 : vocab;
        for (int64_t w = 0; w * 32 < covered; w++) {
            const uint32_t bits = mask[w];
            if (bits == 0xFFFFFFFFu) continue;
            const int64_t base = w * 32;
            const int64_t end = base + 32 < covered ? base + 32 : covered;
            for (int64_t t = base; t < end; t++) {
                if (!((bits >> (t - base)) & 1u)) row[t] = -INFINITY;
            }
        }
        for (int64_t t = covered; t < vocab; t++) row[t] = -INFINITY;
    }
}
