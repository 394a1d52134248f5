/* The "bitmask" kernel family (bitmask.c): grammar bitmasks applied to logits. */
#ifndef KVSERVE_BITMASK_H
#define KVSERVE_BITMASK_H

#include <stdint.h>

void kvserve_apply_token_bitmask(float *logits, int64_t logit_row_stride, int64_t vocab,
                                 const int32_t *bitmask, int64_t words, const int64_t *rows,
                                 int64_t num_rows, int num_threads);

#endif
