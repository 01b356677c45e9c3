/* The KV cache's kernels: float16 widened to float32 (halves.py), and decode rows' attention over a float32 cache
   (decode_attention.py). Arrays come as numpy's objects (arrays.h). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "arrays.h"
#include "kernel_parts.h"
#include "vectors.h"

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

/* One query head's attention over positions [start, end) of its keys and values (rows `stride` floats apart, elements
   ds), into row: scores (a buffer of end - start floats) first, then softmax's weights times the values. */
static void attend_head(const float *keys, const float *values, int64_t stride, int64_t ds, const float *query, int64_t qd,
                        int64_t start, int64_t end, int64_t head_dim, float softcap, const float *sink, float *scores, float *out,
                        float *row, int64_t rd) {
  float top = sink ? *sink : -INFINITY;
  for (int64_t p = start; p < end; p++) {
    const float *key = keys + p * stride;
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t d = 0; d < head_dim; d++) s += key[d * ds] * query[d * qd];
    if (softcap > 0) s = softcap * tanhf(s / softcap);
    scores[p - start] = s;
    top = s > top ? s : top;
  }
  float total = sink ? expf(*sink - top) : 0.0f;
  for (int64_t d = 0; d < head_dim; d++) out[d] = 0.0f;
  for (int64_t p = start; p < end; p++) {
    float weight = expf(scores[p - start] - top);
    total += weight;
    const float *value = values + p * stride;
#pragma omp simd
    for (int64_t d = 0; d < head_dim; d++) out[d] += weight * value[d * ds];
  }
  for (int64_t d = 0; d < head_dim; d++) row[d * rd] = out[d] / total;
}

/* exp(x) for x <= 0 (a score less the largest), within 2 float32 units of the last place, in arithmetic that vectorises
   (libm's expf is a call a value): x = k ln 2 + f, exp(f) by Cephes's polynomial, 2**k put in the exponent. Below
   -87 it gives about 1e-38 in place of a smaller number, which no softmax's sum can tell apart. */
static inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float round = 12582912.0f; /* 1.5 * 2**23: adding and subtracting it rounds to a whole number */
  float k = (x * 1.44269504088896341f + round) - round;
  float f = x - k * 0.693359375f + k * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * f + 1.3981999507e-3f;
  p = p * f + 8.3334519073e-3f;
  p = p * f + 4.1665795894e-2f;
  p = p * f + 1.6666665459e-1f;
  p = p * f + 5.0000001201e-1f;
  float y = p * f * f + f + 1.0f;
  int32_t bits = ((int32_t)k + 127) << 23;
  float power;
  memcpy(&power, &bits, sizeof power);
  return y * power;
}

/* attend_head for keys, values, query and row contiguous along a head dimension of `chunks` whole vectors: the query
   and the sum of values held in registers, the weights' exponentials computed together. */
static inline __attribute__((always_inline)) void attend_vectors(const float *keys, const float *values, int64_t stride,
                                                                 const float *query, int64_t start, int64_t end, float softcap,
                                                                 const float *sink, float *scores, float *row, const int chunks) {
  vf q[8], out[8];
  for (int c = 0; c < chunks; c++) q[c] = load(query + c * LANES), out[c] = (vf){0};
  float top = sink ? *sink : -INFINITY;
  for (int64_t p = start; p < end; p++) {
    const float *key = keys + p * stride;
    vf products = load(key) * q[0];
    for (int c = 1; c < chunks; c++) products = products + load(key + c * LANES) * q[c];
    float s = lane_sum(products);
    if (softcap > 0) s = softcap * tanhf(s / softcap);
    scores[p - start] = s;
    top = s > top ? s : top;
  }
  float total = sink ? expf(*sink - top) : 0.0f;
  const int64_t n = end - start;
#pragma omp simd reduction(+ : total)
  for (int64_t i = 0; i < n; i++) {
    float weight = exp_nonpositive(scores[i] - top);
    scores[i] = weight;
    total += weight;
  }
  for (int64_t p = start; p < end; p++) {
    const float *value = values + p * stride;
    const float weight = scores[p - start];
    for (int c = 0; c < chunks; c++) out[c] = out[c] + weight * load(value + c * LANES);
  }
  for (int c = 0; c < chunks; c++) store(row + c * LANES, out[c] / total);
}

#define ATTEND_VECTORS(name, chunks) \
  static void name(const float *keys, const float *values, int64_t stride, const float *query, int64_t start, int64_t end, \
                   float softcap, const float *sink, float *scores, float *row) { \
    attend_vectors(keys, values, stride, query, start, end, softcap, sink, scores, row, chunks); \
  }
ATTEND_VECTORS(attend_64, 4)   /* head dimension 64 (SmolLM2, Llama 3.2 1B) */
ATTEND_VECTORS(attend_128, 8)  /* 128 (most larger models) */
ATTEND_VECTORS(attend_32, 2)
ATTEND_VECTORS(attend_96, 6)

/* One query head's attention over positions [start, end) of its keys and values, every array contiguous along a head
   dimension of head_dim floats (rows of keys and values `stride` floats apart), into row; scores: end - start + head_dim
   floats of scratch. (decoder.c's layers.) */
void attend_contiguous(const float *keys, const float *values, int64_t stride, const float *query, int64_t start, int64_t end,
                       int64_t head_dim, float *scores, float *row) {
  if (head_dim == 64)
    attend_64(keys, values, stride, query, start, end, 0.0f, NULL, scores, row);
  else if (head_dim == 128)
    attend_128(keys, values, stride, query, start, end, 0.0f, NULL, scores, row);
  else if (head_dim == 32)
    attend_32(keys, values, stride, query, start, end, 0.0f, NULL, scores, row);
  else if (head_dim == 96)
    attend_96(keys, values, stride, query, start, end, 0.0f, NULL, scores, row);
  else
    attend_head(keys, values, stride, 1, query, 1, start, end, head_dim, 0.0f, NULL, scores, scores + (end - start), row, 1);
}

/* attend_vectors for G query heads (queries and rows head_dim = LANES * chunks floats apart) that share their keys and
   values: each key and value read once for all of them. Each head's arithmetic is attend_vectors' own, in its order;
   scores: G * (end - start) floats. */
static inline __attribute__((always_inline)) void attend_group_vectors(const float *keys, const float *values, int64_t stride,
                                                                       const float *queries, int64_t start, int64_t end,
                                                                       float *scores, float *rows, const int chunks, const int G) {
  const int64_t n = end - start, hd = (int64_t)chunks * LANES;
  vf q[4][4], out[4][4];
  float top[4], total[4];
  for (int g = 0; g < G; g++) {
    top[g] = -INFINITY, total[g] = 0.0f;
    for (int c = 0; c < chunks; c++) q[g][c] = load(queries + g * hd + c * LANES), out[g][c] = (vf){0};
  }
  for (int64_t p = start; p < end; p++) {
    const float *key = keys + p * stride;
    vf k[4];
    for (int c = 0; c < chunks; c++) k[c] = load(key + c * LANES);
    for (int g = 0; g < G; g++) {
      vf products = k[0] * q[g][0];
      for (int c = 1; c < chunks; c++) products = products + k[c] * q[g][c];
      const float s = lane_sum(products);
      scores[g * n + p - start] = s;
      top[g] = s > top[g] ? s : top[g];
    }
  }
  for (int g = 0; g < G; g++) {
    float *own = scores + g * n, sum = 0.0f;
    const float shift = top[g];
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; i++) {
      float weight = exp_nonpositive(own[i] - shift);
      own[i] = weight;
      sum += weight;
    }
    total[g] = sum;
  }
  for (int64_t p = start; p < end; p++) {
    const float *value = values + p * stride;
    vf v[4];
    for (int c = 0; c < chunks; c++) v[c] = load(value + c * LANES);
    for (int g = 0; g < G; g++) {
      const float weight = scores[g * n + p - start];
      for (int c = 0; c < chunks; c++) out[g][c] = out[g][c] + weight * v[c];
    }
  }
  for (int g = 0; g < G; g++)
    for (int c = 0; c < chunks; c++) store(rows + g * hd + c * LANES, out[g][c] / total[g]);
}

#define ATTEND_GROUP(G) \
  static void attend_64_by_##G(const float *keys, const float *values, int64_t stride, const float *queries, int64_t start, \
                               int64_t end, float *scores, float *rows) { \
    attend_group_vectors(keys, values, stride, queries, start, end, scores, rows, 4, G); \
  }
ATTEND_GROUP(2)
ATTEND_GROUP(3)
ATTEND_GROUP(4)

void attend_heads(const float *keys, const float *values, int64_t stride, const float *queries, int64_t heads, int64_t start,
                  int64_t end, int64_t head_dim, float *scores, float *rows) {
  if (head_dim == 64 && heads == 2)
    attend_64_by_2(keys, values, stride, queries, start, end, scores, rows);
  else if (head_dim == 64 && heads == 3)
    attend_64_by_3(keys, values, stride, queries, start, end, scores, rows);
  else if (head_dim == 64 && heads == 4)
    attend_64_by_4(keys, values, stride, queries, start, end, scores, rows);
  else
    for (int64_t h = 0; h < heads; h++)
      attend_contiguous(keys, values, stride, queries + h * head_dim, start, end, head_dim, scores, rows + h * head_dim);
}

/* attn[first + r] (attn: float32 (rows, heads * head dim)) = query row first + r's attention (q: (rows, heads, head dim), scaled) over positions
   [ends[r] - window (0 where window is 0), ends[r]) of slab slot slot + r, layer li: one pass over its cache, the
   softmax shifted by the row's largest score. slab: (slots, layers, planes, kv heads, positions, head dim); a slot of
   one plane (latent attention) holds keys that are their own values. softcap > 0: scores become softcap *
   tanh(score / softcap); sinks (float32, one logit per query head, or none) join each softmax's denominator. ends:
   contiguous int64. Returns 0, or -1 where memory ran out. */
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
  const int64_t ps = slab_strides[4], ds = slab_strides[5], qd = q_strides[2], rd = attn_strides[1];
  const int unit = ds == 1 && qd == 1 && rd == 1;
  for (int64_t r = 0; r < n_rows; r++) {
    const int64_t end = ends[r], start = window > 0 ? (end - window > 0 ? end - window : 0) : 0;
    for (int64_t h = 0; h < n_heads; h++) {
      const float *base = slab + (slot + r) * slab_strides[0] + li * slab_strides[1] + (h / group) * slab_strides[3];
      const float *values = base + values_plane * slab_strides[2];
      const float *query = q + (first + r) * q_strides[0] + h * q_strides[1];
      const float *sink = n_sinks ? sinks + h : NULL;
      float *row = attn + (first + r) * attn_strides[0] + h * head_dim * rd;
      if (unit && head_dim == 64)
        attend_64(base, values, ps, query, start, end, softcap, sink, scores, row);
      else if (unit && head_dim == 128)
        attend_128(base, values, ps, query, start, end, softcap, sink, scores, row);
      else if (unit && head_dim == 32)
        attend_32(base, values, ps, query, start, end, softcap, sink, scores, row);
      else if (unit && head_dim == 96)
        attend_96(base, values, ps, query, start, end, softcap, sink, scores, row);
      else
        attend_head(base, values, ps, ds, query, qd, start, end, head_dim, softcap, sink, scores, out, row, rd);
    }
  }
  free(scores);
  return 0;
}
