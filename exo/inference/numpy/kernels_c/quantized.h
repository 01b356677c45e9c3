/* A quantized matrix as the kernels read it (packed.py's PackedMatrix, native.py's Matrix), and the direct product's
   parts that other kernels run from inside their own parallel regions (decoder.c). */
#ifndef EXO_QUANTIZED_H
#define EXO_QUANTIZED_H
#include <stdint.h>

#define PANEL 64 /* weight rows one task of a parallel product takes */

/* scales' and biases' form: float16 bits (converted by the CPU where it can, else through the table), float32, 8-bit
   codes through the table (MXFP4's exponents), bfloat16 bits (the high half of a float32) */
enum { VALUES_F16 = 0, VALUES_FLOAT = 1, VALUES_BYTE = 2, VALUES_BF16 = 3 };

typedef struct {
  const uint8_t *codes; /* n_out rows of row_bytes */
  const void *scales, *biases; /* n_out rows of n_groups; biases NULL for MXFP4 */
  const float *table;
  int64_t n_out, n_in, row_bytes, n_groups;
  int32_t bits, kind, fp4;
} matrix;

/* Inputs as the kernels read them: for 4 bits the even inputs (rows, in / 2), then the odd ones; every row's group
   sums (rows, n_groups) after them. */
typedef struct {
  const float *a, *b, *sums;
  int64_t stride; /* between input rows of a and b */
} inputs;

/* floats of scratch prepare_into needs for `rows` input rows */
int64_t prepared_floats(const matrix *m, int64_t rows);
/* x (rows, in) contiguous as the kernels read it, into scratch (prepared_floats long) */
void prepare_into(const matrix *m, const float *x, int64_t rows, inputs *in, float *scratch);
/* out[r * out_stride + j - lo] = x[r] . w[j] for weight rows j in [j0, j1), on the calling thread */
void rows_range(const matrix *m, const inputs *in, int64_t rows, int64_t lo, int64_t j0, int64_t j1, float *out, int64_t out_stride);
/* groups g0..g1 of weight rows ids[i] (ids NULL: j0 + i), i < n, as float32 into out, rows out_stride floats apart */
void widen_groups(const matrix *m, int64_t j0, const int64_t *ids, int64_t n, int64_t g0, int64_t g1, float *out, int64_t out_stride);
/* out[i] = weight row ids[i] as float32, rows n_in floats apart (ids within the matrix: the caller checks) */
void dequantize_rows(const matrix *m, const int64_t *ids, int64_t n, float *out);
/* panels.c's product for many input rows, in parts another kernel shares out itself (decoder.c): the inputs
   transposed for the panels (panel_inputs_floats long), a thread's panel buffers made ready for the matrix
   (panel_reserve: 0, or -1 where memory ran out; done, panel_range then fails for no lack of memory), and
   out[r * os + j - lo] = x[r] . w[j] for weight rows j in [j0, j1), on the calling thread (0, or -1 without memory). */
int64_t panel_inputs_floats(const matrix *m, int64_t rows);
void panel_inputs(const matrix *m, const float *x, int64_t rows, float *xt);
int panel_reserve(const matrix *m, int64_t rows);
int panel_range(const matrix *m, const float *xt, int64_t rows, int64_t lo, int64_t j0, int64_t j1, float *out, int64_t os);
#endif
