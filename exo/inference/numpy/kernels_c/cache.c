/* The KV cache's kernels: float16 widened to float32 (halves.py), and decode rows' attention over a float32 cache
   (decode_attention.py). Arrays come as numpy's objects (arrays.h). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "arrays.h"

/* out (a contiguous float32 array of src's shape) = src's (4 dimensions, float16, any strides) bits as float32: exponent and mantissa shifted into a float32's, which,
   times 2**112 (the two formats' exponent biases apart), is the same number, subnormals and zeros included. Infinities
   and NaNs are not kept (a cache holds neither). */
void widen_halves(const void *src_array, const void *out_array) {
  const float rebias = 0x1p112f;
  const uint16_t *src = data_of(src_array);
  const int64_t *shape = shape_of(src_array);
  int64_t strides[8];
  strides_of(src_array, 2, strides);
  float *out = data_of(out_array);
  for (int64_t i = 0; i < shape[0]; i++)
    for (int64_t j = 0; j < shape[1]; j++)
      for (int64_t k = 0; k < shape[2]; k++) {
        const uint16_t *s = src + i * strides[0] + j * strides[1] + k * strides[2];
        float *d = out + ((i * shape[1] + j) * shape[2] + k) * shape[3];
        int64_t n = shape[3], step = strides[3];
#pragma omp simd
        for (int64_t m = 0; m < n; m++) {
          uint32_t h = s[m * step], bits = ((h & 0x7FFFu) << 13) | ((h & 0x8000u) << 16);
          float f;
          memcpy(&f, &bits, sizeof f);
          d[m] = f * rebias;
        }
      }
}

/* attn[first + r] (attn: float32 (rows, heads * head dim)) = query row first + r's attention (q: (rows, heads, head dim), scaled) over positions
   [ends[r] - window (0 where window is 0), ends[r]) of slab slot slot + r, layer li: one pass over its cache, the
   softmax shifted by the row's largest score. slab: (slots, layers, planes, kv heads, positions, head dim); a slot of
   one plane (latent attention) holds keys that are their own values. softcap > 0: scores become softcap *
   tanh(score / softcap); sinks (float32, one logit per query head, or none) join each softmax's denominator. ends:
   contiguous int64. Returns 0,
   or -1 where memory ran out. */
int attend_decode(const void *slab_array, int64_t slot, int64_t li, const void *q_array, int64_t first, const void *ends_array,
                  int64_t window, float softcap, const void *sinks_array, const void *attn_array) {
  const float *slab = data_of(slab_array), *q = data_of(q_array), *sinks = data_of(sinks_array);
  const int64_t *ends = data_of(ends_array), *slab_shape = shape_of(slab_array), *q_shape = shape_of(q_array);
  const int64_t n_rows = shape_of(ends_array)[0], n_sinks = shape_of(sinks_array)[0];
  float *attn = data_of(attn_array);
  int64_t slab_strides[8], q_strides[8], attn_strides[8];
  strides_of(slab_array, 4, slab_strides);
  strides_of(q_array, 4, q_strides);
  strides_of(attn_array, 4, attn_strides);
  const int64_t n_heads = q_shape[1], head_dim = q_shape[2], group = n_heads / slab_shape[3], values_plane = slab_shape[2] - 1;
  int64_t longest = 1;
  for (int64_t r = 0; r < n_rows; r++) longest = ends[r] > longest ? ends[r] : longest;
  float *scores = malloc(sizeof(float) * (size_t)(longest + head_dim));
  if (!scores) return -1;
  float *out = scores + longest;
  const int64_t ps = slab_strides[4], ds = slab_strides[5], qd = q_strides[2];
  for (int64_t r = 0; r < n_rows; r++) {
    const int64_t end = ends[r], start = window > 0 ? (end - window > 0 ? end - window : 0) : 0;
    for (int64_t h = 0; h < n_heads; h++) {
      const float *base = slab + (slot + r) * slab_strides[0] + li * slab_strides[1] + (h / group) * slab_strides[3];
      const float *keys = base, *values = base + values_plane * slab_strides[2];
      const float *query = q + (first + r) * q_strides[0] + h * q_strides[1];
      float top = n_sinks ? sinks[h] : -INFINITY;
      for (int64_t p = start; p < end; p++) {
        const float *key = keys + p * ps;
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int64_t d = 0; d < head_dim; d++) s += key[d * ds] * query[d * qd];
        if (softcap > 0) s = softcap * tanhf(s / softcap);
        scores[p - start] = s;
        top = s > top ? s : top;
      }
      float total = n_sinks ? expf(sinks[h] - top) : 0.0f;
      for (int64_t d = 0; d < head_dim; d++) out[d] = 0.0f;
      for (int64_t p = start; p < end; p++) {
        float weight = expf(scores[p - start] - top);
        total += weight;
        const float *value = values + p * ps;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; d++) out[d] += weight * value[d * ds];
      }
      float *row = attn + (first + r) * attn_strides[0] + h * head_dim * attn_strides[1];
      for (int64_t d = 0; d < head_dim; d++) row[d * attn_strides[1]] = out[d] / total;
    }
  }
  free(scores);
  return 0;
}
