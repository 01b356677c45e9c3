/* RoPE (rotary.py): a step's rows of queries or keys turned and scaled in one call. The same float32 operations in the
   same order as numpy's form, none fused into a multiply-add, so the two give the same bits. Strides in elements. */
#include <stdint.h>

#ifdef __clang__
#define NO_CONTRACTION
#else
#define NO_CONTRACTION __attribute__((optimize("fp-contract=off")))
#endif

NO_CONTRACTION void rope(const float *x, const int64_t *shape, const int64_t *xs, const float *cos, const float *sin,
                         const int64_t *cs, float scale, float *out, const int64_t *os) {
#ifdef __clang__
#pragma clang fp contract(off)
#endif
  const int64_t rows = shape[0], heads = shape[1], half = shape[2] / 2;
  for (int64_t r = 0; r < rows; r++) {
    const float *c = cos + r * cs[0], *s = sin + r * cs[0];
    for (int64_t h = 0; h < heads; h++) {
      const float *src = x + r * xs[0] + h * xs[1];
      float *dst = out + r * os[0] + h * os[1];
      for (int64_t i = 0; i < half; i++) {
        float x1 = src[i * xs[2]], x2 = src[(half + i) * xs[2]];
        float a = x1 * c[i * cs[2]], b = x2 * s[i * cs[2]], d = x2 * c[i * cs[2]], e = x1 * s[i * cs[2]];
        dst[i * os[2]] = (a - b) * scale;
        dst[(half + i) * os[2]] = (d + e) * scale;
      }
    }
  }
}
