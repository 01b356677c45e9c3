/* RoPE (rotary.py): a step's rows of queries or keys turned and scaled in one call. The same float32 operations in the
   same order as numpy's form, none fused into a multiply-add, so the two give the same bits. x, out: float32 (rows, heads, head dim); cos, sin: float32 (rows, 1, head dim / 2); any
   strides (arrays.h). */
#include <stdint.h>

#include "arrays.h"
#include "kernel_parts.h"

#ifdef __clang__
#define NO_CONTRACTION
#else
#define NO_CONTRACTION __attribute__((optimize("fp-contract=off")))
#endif

/* One row's heads; unit: every array contiguous along the head dimension (then the loops are plain vectors). */
static inline __attribute__((always_inline)) void rope_row(const float *x, const int64_t *xs, const float *c, const float *s,
                                                           int64_t cs, int64_t ss, float scale, float *out, const int64_t *os,
                                                           int64_t heads, int64_t half, const int unit) {
  const int64_t xd = unit ? 1 : xs[2], od = unit ? 1 : os[2];
  if (unit) cs = ss = 1;
  for (int64_t h = 0; h < heads; h++) {
    const float *src = x + h * xs[1];
    float *dst = out + h * os[1];
    for (int64_t i = 0; i < half; i++) {
      float x1 = src[i * xd], x2 = src[(half + i) * xd];
      float a = x1 * c[i * cs], b = x2 * s[i * ss], d = x2 * c[i * cs], e = x1 * s[i * ss];
      dst[i * od] = (a - b) * scale;
      dst[(half + i) * od] = (d + e) * scale;
    }
  }
}

NO_CONTRACTION static void rope_unit(const float *x, const int64_t *xs, const float *c, const float *s, float scale, float *out,
                                     const int64_t *os, int64_t heads, int64_t half) {
#ifdef __clang__
#pragma clang fp contract(off)
#endif
  rope_row(x, xs, c, s, 1, 1, scale, out, os, heads, half, 1);
}

NO_CONTRACTION static void rope_strided(const float *x, const int64_t *xs, const float *c, const float *s, int64_t cs, int64_t ss,
                                        float scale, float *out, const int64_t *os, int64_t heads, int64_t half) {
#ifdef __clang__
#pragma clang fp contract(off)
#endif
  rope_row(x, xs, c, s, cs, ss, scale, out, os, heads, half, 0);
}

/* heads of head_dim (2 * half) floats one after another, turned by cos and sin (half floats each) and scaled, into out
   laid out the same (decoder.c's layers). */
void rope_contiguous(const float *x, const float *cos, const float *sin, float scale, float *out, int64_t heads, int64_t half) {
  const int64_t strides[3] = {0, 2 * half, 1};
  rope_unit(x, strides, cos, sin, scale, out, strides, heads, half);
}

void rope(const void *x_array, const void *cos_array, const void *sin_array, float scale, const void *out_array) {
  const float *x = data_of(x_array), *cos = data_of(cos_array), *sin = data_of(sin_array);
  float *out = data_of(out_array);
  const int64_t *shape = shape_of(x_array);
  int64_t xs[8], cs[8], ss[8], os[8];
  strides_of(x_array, 4, xs);
  strides_of(cos_array, 4, cs);
  strides_of(sin_array, 4, ss);
  strides_of(out_array, 4, os);
  const int64_t rows = shape[0], heads = shape[1], half = shape[2] / 2;
  const int unit = xs[2] == 1 && cs[2] == 1 && ss[2] == 1 && os[2] == 1;
  for (int64_t r = 0; r < rows; r++) {
    if (unit)
      rope_unit(x + r * xs[0], xs, cos + r * cs[0], sin + r * ss[0], scale, out + r * os[0], os, heads, half);
    else
      rope_strided(x + r * xs[0], xs, cos + r * cs[0], sin + r * ss[0], cs[2], ss[2], scale, out + r * os[0], os, heads, half);
  }
}
