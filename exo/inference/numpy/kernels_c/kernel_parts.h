/* Kernels of one source file that another runs on its own threads (decoder.c's layers): plain pointers, no numpy
   arrays. */
#ifndef EXO_KERNEL_PARTS_H
#define EXO_KERNEL_PARTS_H
#include <stdint.h>

/* cache.c: one query head's attention over positions [start, end), keys, values, query and row contiguous along the
   head dimension; scores: end - start + head_dim floats of scratch */
void attend_contiguous(const float *keys, const float *values, int64_t stride, const float *query, int64_t start, int64_t end,
                       int64_t head_dim, float *scores, float *row);
/* cache.c: attend_contiguous for `heads` query heads that share keys and values (queries and rows heads of head_dim
   floats one after another), each key and value read once for all where the head dimension allows, the same
   arithmetic each head; scores: heads * (end - start) + head_dim floats of scratch */
void attend_heads(const float *keys, const float *values, int64_t stride, const float *queries, int64_t heads, int64_t start,
                  int64_t end, int64_t head_dim, float *scores, float *rows);
/* rope.c: `heads` contiguous heads of 2 * half floats turned, scaled, into out (the same bits as rotary.py's rope) */
void rope_contiguous(const float *x, const float *cos, const float *sin, float scale, float *out, int64_t heads, int64_t half);
#endif
