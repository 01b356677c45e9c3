/* 16-lane float vectors (GCC's and clang's vector extensions, lowered to AVX-512, AVX2 or NEON): the kernels' inner
   loops are written in them, since the compilers vectorised the plain loops one group of inputs at a time, reducing
   each to a number (as costly as the products themselves) or not at all. */
#ifndef EXO_VECTORS_H
#define EXO_VECTORS_H
#include <stdint.h>
#include <string.h>

#define LANES 16
typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint8_t vb __attribute__((vector_size(16)));

static inline vf load(const float *p) {
  vf v;
  memcpy(&v, p, sizeof v);
  return v;
}

static inline void store(float *p, vf v) { memcpy(p, &v, sizeof v); }

/* The lanes' sum, halves added pairwise (in lane order each addition waited for the one before). */
static inline float lane_sum(vf v) {
  typedef float v8 __attribute__((vector_size(32)));
  typedef float v4 __attribute__((vector_size(16)));
  v8 a, b;
  memcpy(&a, &v, sizeof a);
  memcpy(&b, (char *)&v + sizeof a, sizeof b);
  a = a + b;
  v4 c, d;
  memcpy(&c, &a, sizeof c);
  memcpy(&d, (char *)&a + sizeof c, sizeof d);
  c = c + d;
  return (c[0] + c[2]) + (c[1] + c[3]);
}
#endif
