/* RoPE (rotary.py): a step's rows of queries or keys turned and scaled in one call. The same float32 operations in the
   same order as numpy's form, none fused into a multiply-add, so the two give the same bits. x, out: float32 (rows, heads, head dim); cos, sin: float32 (rows, 1, head dim / 2); any
   strides (arrays.h). */
#include <stdint.h>

#include "arrays.h"

#ifdef __clang__
#define NO_CONTRACTION
#else
#define NO_CONTRACTION __attribute__((optimize("fp-contract=off")))
#endif

NO_CONTRACTION void rope(const void *x_array, const void *cos_array, const void *sin_array, float scale, const void *out_array) {
#ifdef __clang__
#pragma clang fp contract(off)
#endif
  const float *x = data_of(x_array), *cos = data_of(cos_array), *sin = data_of(sin_array);
  float *out = data_of(out_array);
  const int64_t *shape = shape_of(x_array);
  int64_t xs[8], cs[8], ss[8], os[8];
  strides_of(x_array, 4, xs);
  strides_of(cos_array, 4, cs);
  strides_of(sin_array, 4, ss);
  strides_of(out_array, 4, os);
  const int64_t rows = shape[0], heads = shape[1], half = shape[2] / 2;
  for (int64_t r = 0; r < rows; r++) {
    const float *c = cos + r * cs[0], *s = sin + r * ss[0];
    for (int64_t h = 0; h < heads; h++) {
      const float *src = x + r * xs[0] + h * xs[1];
      float *dst = out + r * os[0] + h * os[1];
      for (int64_t i = 0; i < half; i++) {
        float x1 = src[i * xs[2]], x2 = src[(half + i) * xs[2]];
        float a = x1 * c[i * cs[2]], b = x2 * s[i * ss[2]], d = x2 * c[i * cs[2]], e = x1 * s[i * ss[2]];
        dst[i * os[2]] = (a - b) * scale;
        dst[(half + i) * os[2]] = (d + e) * scale;
      }
    }
  }
}
