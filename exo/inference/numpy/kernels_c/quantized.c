/* Products and widenings over quantized weights, read straight from their codes (packed.py's PackedMatrix).

A weight is (out, in) rows of codes: 4 bits (two a byte, code 2k in the low nibble of byte k, code 2k + 1 in the
high one) or 8 bits (one a byte), a scale and a bias for each group of inputs, w = scale * code + bias. Scales and
biases are float16 or bfloat16 bits (value_at), or float32 as they are;
MXFP4 (fp4) codes stand for E2M1 values, its scales are E8M0 exponents read through a table of powers of two (a
quarter of each: the codes are taken as four times their values, which are then whole numbers) and it has no biases.

Where a group is whole 16-code vectors, a weight row's dot product runs in one 16-lane accumulator: each group's
partial products are scaled as a vector and added, and the lanes are summed once a row (reducing every group to a
number before its scale cost as much as the products). Four input rows share each chunk of codes turned into floats.
The 4-bit codes' even and odd inputs come apart (prepare), so that a chunk's low codes meet the even inputs and its
high codes the odd ones, unit-stride. Other group sizes take plain loops. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "arrays.h"
#include "quantized.h"
#include "vectors.h"
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

/* A scale or bias. float16 by the CPU's own conversion (F16C, ARM's __fp16) rather than the 256 KiB table: reading
   the table cost SmolLM2's 8-bit head a fifth of its time (its rows stream from memory, the table's lines from L2),
   and a one-row decode step a tenth. Both are exact, so the values are the same. */
static inline float value_at(const void *values, int kind, const float *table, int64_t i) {
  if (kind == VALUES_F16) {
    const uint16_t bits = ((const uint16_t *)values)[i];
#if defined(__F16C__) && !defined(EXO_HALVES_BY_TABLE) /* (the table's way: bench/decode_step.py's baseline) */
    return _cvtsh_ss(bits);
#elif defined(__aarch64__) && !defined(EXO_HALVES_BY_TABLE)
    __fp16 half;
    memcpy(&half, &bits, sizeof half);
    return (float)half;
#else
    return table[bits];
#endif
  }
  if (kind == VALUES_BF16) {
    const uint32_t bits = (uint32_t)((const uint16_t *)values)[i] << 16;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
  }
  if (kind == VALUES_FLOAT) return ((const float *)values)[i];
  return table[((const uint8_t *)values)[i]];
}

/* 4-bit codes as four times their E2M1 values: magnitudes m = 0, 1 are 0, 2; m >= 2 are (2 + m % 2) << m / 2;
   codes 8 and up negative. */
static inline vi e2m1_times_4(vi c) {
  vi m = c & 7, e = m >> 1, small = m < 2;
  vi magnitude = (small & (m + m)) | (~small & ((2 + (m & 1)) << e));
  vi negative = -(c >> 3);
  return (magnitude ^ negative) - negative;
}

/* 16 bytes as 32-bit integers: GCC turns __builtin_convertvector of bytes into one extraction a lane, so x86 takes
   its widening instructions. */
static inline vi bytes_to_ints(const uint8_t *p) {
  vi r;
#if defined(__AVX512F__)
  __m512i wide = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
  memcpy(&r, &wide, sizeof r);
#elif defined(__AVX2__)
  __m128i bytes = _mm_loadu_si128((const __m128i *)p);
  __m256i low = _mm256_cvtepu8_epi32(bytes), high = _mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8));
  memcpy(&r, &low, sizeof low);
  memcpy((char *)&r + sizeof low, &high, sizeof high);
#else
  vb bytes;
  memcpy(&bytes, p, sizeof bytes);
  r = __builtin_convertvector(bytes, vi);
#endif
  return r;
}

static const float E2M1_TIMES_4[16] = {0, 2, 4, 6, 8, 12, 16, 24, 0, -2, -4, -6, -8, -12, -16, -24};

static inline __attribute__((always_inline)) void split_codes(const uint8_t *p, int fp4, vf *low, vf *high) {
  vi c = bytes_to_ints(p);
  vi lo = c & 15, hi = c >> 4;
  if (fp4) {
    lo = e2m1_times_4(lo);
    hi = e2m1_times_4(hi);
  }
  *low = __builtin_convertvector(lo, vf);
  *high = __builtin_convertvector(hi, vf);
}

int64_t prepared_floats(const matrix *m, int64_t rows) { return rows * (m->bits == 4 ? m->n_in : 0) + rows * m->n_groups + 1; }

void prepare_into(const matrix *m, const float *x, int64_t rows, inputs *in, float *scratch) {
  int64_t n_in = m->n_in, half = n_in / 2, group = n_in / m->n_groups;
  float *sums = scratch + (m->bits == 4 ? rows * n_in : 0);
  if (m->bits == 4) {
    float *even = scratch, *odd = scratch + rows * half;
    for (int64_t r = 0; r < rows; r++)
      for (int64_t k = 0; k < half; k++) {
        even[r * half + k] = x[r * n_in + 2 * k];
        odd[r * half + k] = x[r * n_in + 2 * k + 1];
      }
    in->a = even, in->b = odd, in->stride = half;
  } else {
    in->a = x, in->b = NULL, in->stride = n_in;
  }
  for (int64_t r = 0; r < rows; r++)
    for (int64_t g = 0; g < m->n_groups; g++) {
      float s = 0.0f;
#pragma omp simd reduction(+ : s)
      for (int64_t k = 0; k < group; k++) s += x[r * n_in + g * group + k];
      sums[r * m->n_groups + g] = s;
    }
  in->sums = sums;
}

static float *prepare(const matrix *m, const float *x, int64_t rows, inputs *in) {
  float *scratch = malloc(sizeof(float) * (size_t)prepared_floats(m, rows));
  if (scratch) prepare_into(m, x, rows, in, scratch);
  return scratch;
}

/* One group's products for R input rows, scaled and added to acc (and bias * the group's input sum to offset). */
static inline __attribute__((always_inline)) void dot_group(const matrix *m, const uint8_t *row, const float *a, const float *b,
                                                            const float *sums, int64_t sx, int64_t j, int64_t g, int64_t per_group,
                                                            vf *acc, float *offset, const int R, const int bits, const int fp4,
                                                            const int kind) {
  const int64_t n_groups = m->n_groups;
  vf part[4] = {0};
  for (int64_t c = 0; c < per_group; c++) {
    int64_t at = (g * per_group + c) * LANES;
    if (bits == 4) {
      vf low, high;
      split_codes(row + at, fp4, &low, &high);
      for (int r = 0; r < R; r++) {
        part[r] = part[r] + load(a + r * sx + at) * low;
        part[r] = part[r] + load(b + r * sx + at) * high;
      }
    } else {
      vf codes = __builtin_convertvector(bytes_to_ints(row + at), vf);
      for (int r = 0; r < R; r++) part[r] = part[r] + load(a + r * sx + at) * codes;
    }
  }
  float scale = value_at(m->scales, kind, m->table, j * n_groups + g);
  for (int r = 0; r < R; r++) acc[r] = acc[r] + part[r] * scale;
  if (!fp4) {
    float bias = value_at(m->biases, kind, m->table, j * n_groups + g);
    for (int r = 0; r < R; r++) offset[r] += bias * sums[r * n_groups + g];
  }
}

/* Weight row j's dot products with input rows first..first + R into out[(first + r) * out_stride]: explicit vectors.
   Even and odd groups add into accumulators of their own, so that one group's scaling need not wait for the last's. */
static inline __attribute__((always_inline)) void dot_block(const matrix *m, const inputs *in, int64_t j, int64_t first,
                                                            float *out, int64_t out_stride, const int R, const int bits,
                                                            const int fp4, const int kind) {
  const int64_t n_groups = m->n_groups, per_group = m->row_bytes / n_groups / LANES, sx = in->stride;
  const uint8_t *row = m->codes + j * m->row_bytes;
  const float *a = in->a + first * sx, *b = bits == 4 ? in->b + first * sx : NULL, *sums = in->sums + first * n_groups;
  vf even[4] = {0}, odd[4] = {0};
  float even_offset[4] = {0}, odd_offset[4] = {0};
  int64_t g = 0;
  if (per_group == 1) { /* 32-input groups of 4-bit codes (GGUF's blocks), 16-input ones of 8-bit: no inner loop */
    for (; g + 2 <= n_groups; g += 2) {
      dot_group(m, row, a, b, sums, sx, j, g, 1, even, even_offset, R, bits, fp4, kind);
      dot_group(m, row, a, b, sums, sx, j, g + 1, 1, odd, odd_offset, R, bits, fp4, kind);
    }
  } else {
    for (; g + 2 <= n_groups; g += 2) {
      dot_group(m, row, a, b, sums, sx, j, g, per_group, even, even_offset, R, bits, fp4, kind);
      dot_group(m, row, a, b, sums, sx, j, g + 1, per_group, odd, odd_offset, R, bits, fp4, kind);
    }
  }
  if (g < n_groups) dot_group(m, row, a, b, sums, sx, j, g, per_group, even, even_offset, R, bits, fp4, kind);
  for (int r = 0; r < R; r++) out[(first + r) * out_stride] = lane_sum(even[r] + odd[r]) + (even_offset[r] + odd_offset[r]);
}

typedef void (*block_fn)(const matrix *, const inputs *, int64_t, int64_t, float *, int64_t);
/* A kernel for each row block, code format and scale format (affine: 16-bit or float32 scales; MXFP4: exponents) */
#define BLOCK(name, R, bits, fp4, kind) \
  static void name(const matrix *m, const inputs *in, int64_t j, int64_t first, float *out, int64_t os) { \
    dot_block(m, in, j, first, out, os, R, bits, fp4, kind); \
  }
#define BLOCKS(name, bits, fp4, kind) \
  BLOCK(name##_1, 1, bits, fp4, kind) BLOCK(name##_2, 2, bits, fp4, kind) BLOCK(name##_4, 4, bits, fp4, kind) \
  static const block_fn name[3] = {name##_1, name##_2, name##_4};
BLOCKS(dot4_f16, 4, 0, VALUES_F16)
BLOCKS(dot4_bf16, 4, 0, VALUES_BF16)
BLOCKS(dot4_float, 4, 0, VALUES_FLOAT)
BLOCKS(dot4_fp4, 4, 1, VALUES_BYTE)
BLOCKS(dot8_f16, 8, 0, VALUES_F16)
BLOCKS(dot8_bf16, 8, 0, VALUES_BF16)
BLOCKS(dot8_float, 8, 0, VALUES_FLOAT)

static inline float level(int code, int fp4) { return fp4 ? E2M1_TIMES_4[code] : (float)code; }

/* Weight row j's dot product with input row r, plain loops (groups that are not whole vectors). */
static float dot_plain(const matrix *m, const inputs *in, int64_t j, int64_t r) {
  const int64_t n_groups = m->n_groups, group_bytes = m->row_bytes / n_groups;
  const uint8_t *row = m->codes + j * m->row_bytes;
  const float *a = in->a + r * in->stride, *b = m->bits == 4 ? in->b + r * in->stride : NULL;
  float total = 0.0f;
  for (int64_t g = 0; g < n_groups; g++) {
    float s = 0.0f;
    for (int64_t k = g * group_bytes; k < (g + 1) * group_bytes; k++) {
      if (m->bits == 4)
        s += a[k] * level(row[k] & 15, m->fp4) + b[k] * level(row[k] >> 4, m->fp4);
      else
        s += a[k] * (float)row[k];
    }
    total += s * value_at(m->scales, m->kind, m->table, j * n_groups + g);
    if (!m->fp4) total += in->sums[r * n_groups + g] * value_at(m->biases, m->kind, m->table, j * n_groups + g);
  }
  return total;
}

/* out[r * out_stride + j - lo] = x[r] . w[j] for weight rows j in [j0, j1). */
void rows_range(const matrix *m, const inputs *in, int64_t rows, int64_t lo, int64_t j0, int64_t j1, float *out, int64_t os) {
  if ((m->row_bytes / m->n_groups) % LANES) {
    for (int64_t j = j0; j < j1; j++)
      for (int64_t r = 0; r < rows; r++) out[r * os + j - lo] = dot_plain(m, in, j, r);
    return;
  }
  const block_fn *blocks = m->bits == 4 ? (m->fp4 ? dot4_fp4 : m->kind == VALUES_FLOAT ? dot4_float : m->kind == VALUES_BF16 ? dot4_bf16 : dot4_f16)
                                         : (m->kind == VALUES_FLOAT ? dot8_float : m->kind == VALUES_BF16 ? dot8_bf16 : dot8_f16);
  block_fn one = blocks[0], two = blocks[1], four = blocks[2];
  for (int64_t j = j0; j < j1; j++) {
    float *column = out + (j - lo);
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) four(m, in, j, r, column, os);
    if (rows - r >= 2) two(m, in, j, r, column, os), r += 2;
    if (r < rows) one(m, in, j, r, column, os);
  }
}

/* x (rows, in) contiguous @ weight rows lo..hi into out (rows, hi - lo; rows out_stride floats apart), on the calling
   thread. Returns 0, or -1 where memory ran out. */
int product_rows(const matrix *m, const float *x, int64_t rows, int64_t lo, int64_t hi, float *out, int64_t out_stride) {
  inputs in;
  float *scratch = prepare(m, x, rows, &in);
  if (!scratch) return -1;
  rows_range(m, &in, rows, lo, lo, hi, out, out_stride);
  free(scratch);
  return 0;
}

/* As product_rows, PANEL weight rows a task shared among OpenMP's threads (the calling thread only, built without). */
int parallel_rows(const matrix *m, const float *x, int64_t rows, int64_t lo, int64_t hi, float *out, int64_t out_stride) {
  inputs in;
  float *scratch = prepare(m, x, rows, &in);
  if (!scratch) return -1;
  int64_t panels = (hi - lo + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < panels; p++) {
    int64_t j0 = lo + p * PANEL, j1 = j0 + PANEL < hi ? j0 + PANEL : hi;
    rows_range(m, &in, rows, lo, j0, j1, out, out_stride);
  }
  free(scratch);
  return 0;
}

int64_t exo_array_offset = -1;

/* x @ weight rows lo..hi into out as product_rows (shared: parallel_rows), x and out float32 numpy arrays (arrays.h,
   their dtype checked by the caller). Returns -2, computing nothing, unless x is (rows, in) contiguous, out (rows,
   hi - lo) with contiguous rows, and lo..hi within the matrix: the caller checks and converts in Python only then. */
int product_arrays(const matrix *m, const void *x, const void *out, int64_t lo, int64_t hi, int shared) {
  const array_fields *xf = fields(x), *of = fields(out);
  if (xf->nd != 2 || of->nd != 2 || xf->shape[1] != m->n_in || xf->strides[1] != 4 || (xf->shape[0] > 1 && xf->strides[0] != 4 * m->n_in)
      || of->shape[0] != xf->shape[0] || of->shape[1] != hi - lo || (hi > lo + 1 && of->strides[1] != 4) || of->strides[0] % 4
      || lo < 0 || lo > hi || hi > m->n_out)
    return -2;
  return (shared ? parallel_rows : product_rows)(m, (const float *)xf->data, xf->shape[0], lo, hi, (float *)of->data, of->strides[0] / 4);
}

/* 1 where this library was built with OpenMP (parallel_rows shares its panels), else 0. */
int has_threads(void) {
#ifdef _OPENMP
  return 1;
#else
  return 0;
#endif
}

/* Groups g0..g1 of weight row j as float32 into dest, inputs in order: plain loops (groups that are not whole vectors). */
static void widen_plain(const matrix *m, int64_t j, int64_t g0, int64_t g1, float *restrict dest) {
  const int64_t n_groups = m->n_groups, group_bytes = m->row_bytes / n_groups, per_byte = m->bits == 4 ? 2 : 1;
  const uint8_t *row = m->codes + j * m->row_bytes;
  dest -= g0 * group_bytes * per_byte;
  for (int64_t g = g0; g < g1; g++) {
    float scale = value_at(m->scales, m->kind, m->table, j * n_groups + g);
    float bias = m->fp4 ? 0.0f : value_at(m->biases, m->kind, m->table, j * n_groups + g);
    for (int64_t k = g * group_bytes; k < (g + 1) * group_bytes; k++) {
      if (m->bits == 4) {
        dest[2 * k] = level(row[k] & 15, m->fp4) * scale + bias;
        dest[2 * k + 1] = level(row[k] >> 4, m->fp4) * scale + bias;
      } else {
        dest[k] = (float)row[k] * scale + bias;
      }
    }
  }
}

/* 16 bytes of codes at k as float32 into dest (the chunk's first input), inputs in order: a byte's low code is the
   even input's, its high code the odd one's. */
static inline __attribute__((always_inline)) void widen_chunk(const uint8_t *row, int64_t k, float scale, float bias,
                                                              float *restrict dest, const int bits, const int fp4) {
  if (bits == 4) {
    vf low, high;
    split_codes(row + k, fp4, &low, &high);
    low = low * scale + bias, high = high * scale + bias;
#if defined(__clang__) || __GNUC__ >= 12
    store(dest, __builtin_shufflevector(low, high, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23));
    store(dest + LANES, __builtin_shufflevector(low, high, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31));
#else
    for (int i = 0; i < LANES; i++) dest[2 * i] = low[i], dest[2 * i + 1] = high[i];
#endif
  } else {
    store(dest, __builtin_convertvector(bytes_to_ints(row + k), vf) * scale + bias);
  }
}

/* Groups g0..g1 of weight row j as float32 into dest, inputs in order, by vectors. */
static inline __attribute__((always_inline)) void widen_row(const matrix *m, int64_t j, int64_t g0, int64_t g1, float *restrict dest,
                                                            const int bits, const int fp4, const int kind) {
  const int64_t n_groups = m->n_groups, group_bytes = m->row_bytes / n_groups, per_byte = bits == 4 ? 2 : 1;
  const uint8_t *row = m->codes + j * m->row_bytes;
  const void *scales = m->scales, *biases = m->biases;
  const float *table = m->table;
  dest -= g0 * group_bytes * per_byte;
  if (group_bytes == LANES) { /* one chunk a group (GGUF's 32-input blocks of 4-bit codes): no inner loop */
    for (int64_t g = g0; g < g1; g++) {
      const float scale = value_at(scales, kind, table, j * n_groups + g);
      const float bias = fp4 ? 0.0f : value_at(biases, kind, table, j * n_groups + g);
      widen_chunk(row, g * LANES, scale, bias, dest + g * LANES * per_byte, bits, fp4);
    }
    return;
  }
  for (int64_t g = g0; g < g1; g++) {
    const float scale = value_at(scales, kind, table, j * n_groups + g);
    const float bias = fp4 ? 0.0f : value_at(biases, kind, table, j * n_groups + g);
    for (int64_t k = g * group_bytes; k < (g + 1) * group_bytes; k += LANES) widen_chunk(row, k, scale, bias, dest + k * per_byte, bits, fp4);
  }
}

/* Groups g0..g1 of rows ids[i] (ids NULL: j0 + i) for i in [0, n) as float32 into out, rows out_stride floats apart. */
typedef void (*widen_fn)(const matrix *, int64_t, const int64_t *, int64_t, int64_t, int64_t, float *, int64_t);
#define WIDEN(name, bits, fp4, kind) \
  static void name(const matrix *m, int64_t j0, const int64_t *ids, int64_t n, int64_t g0, int64_t g1, float *out, int64_t out_stride) { \
    for (int64_t i = 0; i < n; i++) widen_row(m, ids ? ids[i] : j0 + i, g0, g1, out + i * out_stride, bits, fp4, kind); \
  }
WIDEN(widen4_f16, 4, 0, VALUES_F16)
WIDEN(widen4_bf16, 4, 0, VALUES_BF16)
WIDEN(widen4_float, 4, 0, VALUES_FLOAT)
WIDEN(widen4_fp4, 4, 1, VALUES_BYTE)
WIDEN(widen8_f16, 8, 0, VALUES_F16)
WIDEN(widen8_bf16, 8, 0, VALUES_BF16)
WIDEN(widen8_float, 8, 0, VALUES_FLOAT)

void widen_groups(const matrix *m, int64_t j0, const int64_t *ids, int64_t n, int64_t g0, int64_t g1, float *out, int64_t out_stride) {
  if ((m->row_bytes / m->n_groups) % LANES) {
    for (int64_t i = 0; i < n; i++) widen_plain(m, ids ? ids[i] : j0 + i, g0, g1, out + i * out_stride);
    return;
  }
  widen_fn widen = m->bits == 4 ? (m->fp4 ? widen4_fp4 : m->kind == VALUES_FLOAT ? widen4_float : m->kind == VALUES_BF16 ? widen4_bf16 : widen4_f16)
                                : (m->kind == VALUES_FLOAT ? widen8_float : m->kind == VALUES_BF16 ? widen8_bf16 : widen8_f16);
  widen(m, j0, ids, n, g0, g1, out, out_stride);
}

static void widen_rows(const matrix *m, int64_t j0, const int64_t *ids, int64_t n, float *out, int64_t out_stride) {
  widen_groups(m, j0, ids, n, 0, m->n_groups, out, out_stride);
}

/* tile[j - lo] = weight row j as float32 for j in [lo, hi), for BLAS; tile: a float32 numpy array (arrays.h) of at
   least hi - lo rows of n_in, each contiguous. */
void widen_tile(const matrix *m, int64_t lo, int64_t hi, const void *tile) {
  widen_rows(m, lo, NULL, hi - lo, data_of(tile), fields(tile)->strides[0] / 4);
}

/* out[i] = weight row ids[i] as float32, rows n_in floats apart (embedding lookups). */
void dequantize_rows(const matrix *m, const int64_t *ids, int64_t n, float *out) { widen_rows(m, 0, ids, n, out, m->n_in); }
