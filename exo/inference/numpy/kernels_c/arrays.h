/* numpy arrays handed over as the Python objects themselves (ctypes' py_object), their fields read here: fetching an
   array's address in Python (arr.ctypes.data) cost 1 us, as much as a small product's arithmetic. The fields follow
   numpy's PyArrayObject_fields, at the offset native.py finds and checks against arr.ctypes before any kernel runs. */
#ifndef EXO_ARRAYS_H
#define EXO_ARRAYS_H
#include <stdint.h>

typedef struct {
  char *data;
  int nd;
  const int64_t *shape, *strides; /* strides in bytes */
} array_fields;

extern int64_t exo_array_offset;

static inline const array_fields *fields(const void *array) { return (const array_fields *)((const char *)array + exo_array_offset); }
static inline void *data_of(const void *array) { return fields(array)->data; }
static inline const int64_t *shape_of(const void *array) { return fields(array)->shape; }
/* an array's strides in elements of `size` bytes, into out (up to 8 dimensions) */
static inline void strides_of(const void *array, int64_t size, int64_t *out) {
  const array_fields *f = fields(array);
  for (int i = 0; i < f->nd && i < 8; i++) out[i] = f->strides[i] / size;
}
#endif
