/* Products of a quantized weight with a few dozen input rows (batched decode): the weight read once, float32 FMAs for
   every row.

quantized.c's direct kernel turns each chunk of codes into floats for at most four input rows, and beyond eight rows
the engine widened whole tiles to float32 for BLAS, writing and reading back four bytes a weight. Here a panel of NR
weight rows (outputs) is widened, one block of up to 2048 inputs at a time, into a buffer that stays in the core's L2
cache, and a register-blocked kernel multiplies it by the inputs: the inputs transposed (in, rows), eight rows a
vector, each panel weight broadcast against them. NR x MV accumulators (MV vectors of eight rows) stay in registers
over the block; blocks add into a small buffer of the panel's sums, turned into the output's (rows, columns) at the
end. Each product is float32 and in input order within a block, so it equals the dequantised matrix's up to
summation order. The vectors are of eight floats (GCC's and clang's vector extensions): AVX registers on x86, where
AMD's Zen 4 runs as many of their FLOPs a cycle as of AVX-512's, and any row count from 9 up wastes at most 7 lanes;
NR is picked for the registers there are (32 with AVX-512 or on AArch64, else 16). On SmolLM2 at 16 rows a core ran
the products at ~70 GFLOP/s, 32 rows ~85, 64 rows ~93 (bench/panel_speed.py --products). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "arrays.h"
#include "quantized.h"

typedef float v8 __attribute__((vector_size(32)));
#define ROW_VECTORS 4 /* input rows a chunk, in vectors of eight: a chunk's rows share the panel while it is in cache */
#define CHUNK_ROWS (8 * ROW_VECTORS)
/* inputs a panel block holds (rounded to whole groups): 128 KiB for 16 weight rows, in L2. On SmolLM2 at 16 rows,
   blocks of 1536 inputs against 256 (in L1) took 0.8x the time for down (1536 inputs), 0.95x for the others (576). */
#define BLOCK_INPUTS 2048

static inline v8 load8(const float *p) {
  v8 v;
  memcpy(&v, p, sizeof v);
  return v;
}

static inline void store8(float *p, v8 v) { memcpy(p, &v, sizeof v); }

/* acc[j][v] += sum over k < kc of panel[j][k] * x[k][v]: NR panel rows (kc floats apart), MV vectors of eight input
   rows (x: kc rows xs floats apart); acc: NR rows of CHUNK_ROWS floats. */
static inline __attribute__((always_inline)) void panel_block(const float *panel, int64_t kc, const float *x, int64_t xs, float *acc,
                                                              const int NR, const int MV) {
  v8 c[16][ROW_VECTORS]; /* fixed sizes (not NR, MV: arrays of those are variable-length, kept in memory) */
#pragma GCC unroll 16
  for (int j = 0; j < NR; j++)
#pragma GCC unroll 4
    for (int v = 0; v < MV; v++) c[j][v] = load8(acc + j * CHUNK_ROWS + 8 * v);
  for (int64_t k = 0; k < kc; k++) {
    v8 xv[ROW_VECTORS];
#pragma GCC unroll 4
    for (int v = 0; v < MV; v++) xv[v] = load8(x + k * xs + 8 * v);
#pragma GCC unroll 16
    for (int j = 0; j < NR; j++) {
      const float w = panel[j * kc + k];
#pragma GCC unroll 4
      for (int v = 0; v < MV; v++) c[j][v] += xv[v] * w;
    }
  }
#pragma GCC unroll 16
  for (int j = 0; j < NR; j++)
#pragma GCC unroll 4
    for (int v = 0; v < MV; v++) store8(acc + j * CHUNK_ROWS + 8 * v, c[j][v]);
}

/* Panel widths by the vectors of rows a chunk holds (1..4): as many accumulators as leave registers for the inputs */
#if defined(__AVX512F__) || defined(__aarch64__)
#define NR1 16
#define NR2 12
#define NR3 8
#define NR4 6
#else
#define NR1 8
#define NR2 6
#define NR3 4
#define NR4 3
#endif
static const int PANEL_ROWS[4] = {NR1, NR2, NR3, NR4};
#define MAX_NR NR1

/* block_W_MV: panels of NR<W> weight rows against MV vectors of input rows (MV <= W) */
typedef void (*block_fn)(const float *, int64_t, const float *, int64_t, float *);
#define BLOCK(W, MV) \
  static void block_##W##_##MV(const float *panel, int64_t kc, const float *x, int64_t xs, float *acc) { \
    panel_block(panel, kc, x, xs, acc, NR##W, MV); \
  }
BLOCK(1, 1) BLOCK(2, 1) BLOCK(2, 2) BLOCK(3, 1) BLOCK(3, 2) BLOCK(3, 3) BLOCK(4, 1) BLOCK(4, 2) BLOCK(4, 3) BLOCK(4, 4)
static const block_fn BLOCKS[4][4] = {{block_1_1}, {block_2_1, block_2_2}, {block_3_1, block_3_2, block_3_3}, {block_4_1, block_4_2, block_4_3, block_4_4}};

/* Inputs a block of the panel holds: whole groups, BLOCK_INPUTS or fewer unless a group is larger. */
static int64_t block_inputs(const matrix *m) {
  const int64_t group = m->n_in / m->n_groups, block = group >= BLOCK_INPUTS ? group : BLOCK_INPUTS / group * group;
  return block < m->n_in ? block : m->n_in;
}

/* Scratch of one thread's panels: the block of widened weights and the panel's sums for every chunk of rows. */
typedef struct {
  float *panel, *acc;
} scratch;

/* A buffer of at least `floats` floats that the calling thread keeps for its next products (`which`: 0 the inputs
   transposed, 1 the panels' scratch), grown as needed; NULL where memory ran out. Kept, not allocated per product:
   buffers of 128 KiB and more come from mmap, and a product touching fresh pages cost 15 us more. */
static float *kept_buffer(int which, size_t floats) {
  static __thread float *buffers[2];
  static __thread size_t sizes[2];
  if (sizes[which] < floats) {
    free(buffers[which]);
    buffers[which] = malloc(sizeof(float) * floats);
    sizes[which] = buffers[which] ? floats : 0;
  }
  return buffers[which];
}

/* Weight rows j0..j1 (at most nr) @ the transposed inputs xt (n_in, padded) into out[r * os + j - lo]. */
static void panel_rows(const matrix *m, const float *xt, int64_t rows, int64_t padded, int64_t lo, int64_t j0, int64_t j1, float *out,
                       int64_t os, int width, scratch *s) {
  const int64_t group = m->n_in / m->n_groups, block_groups = block_inputs(m) / group;
  const int64_t n = j1 - j0, chunks = (padded + CHUNK_ROWS - 1) / CHUNK_ROWS;
  const int nr = PANEL_ROWS[width - 1];
  memset(s->acc, 0, sizeof(float) * (size_t)(chunks * MAX_NR * CHUNK_ROWS));
  for (int64_t g0 = 0; g0 < m->n_groups; g0 += block_groups) {
    const int64_t g1 = g0 + block_groups < m->n_groups ? g0 + block_groups : m->n_groups, kc = (g1 - g0) * group;
    widen_groups(m, j0, NULL, n, g0, g1, s->panel, kc);
    if (n < nr) memset(s->panel + n * kc, 0, sizeof(float) * (size_t)((nr - n) * kc));
    for (int64_t c = 0; c < chunks; c++) {
      const int64_t vectors = (padded - c * CHUNK_ROWS) / 8 < ROW_VECTORS ? (padded - c * CHUNK_ROWS) / 8 : ROW_VECTORS;
      BLOCKS[width - 1][vectors - 1](s->panel, kc, xt + g0 * group * padded + c * CHUNK_ROWS, padded, s->acc + c * MAX_NR * CHUNK_ROWS);
    }
  }
  for (int64_t r = 0; r < rows; r++) {
    const float *sums = s->acc + (r / CHUNK_ROWS) * MAX_NR * CHUNK_ROWS + r % CHUNK_ROWS;
    for (int64_t j = 0; j < n; j++) out[r * os + j0 + j - lo] = sums[j * CHUNK_ROWS];
  }
}

static int scratch_for(const matrix *m, int64_t padded, scratch *s) {
  const int64_t chunks = (padded + CHUNK_ROWS - 1) / CHUNK_ROWS, panel = MAX_NR * block_inputs(m);
  float *kept = kept_buffer(1, (size_t)(panel + chunks * MAX_NR * CHUNK_ROWS));
  s->panel = kept, s->acc = kept ? kept + panel : NULL;
  return kept ? 0 : -1;
}

static inline int64_t padded_rows(int64_t rows) { return (rows + 7) / 8 * 8; }

int64_t panel_inputs_floats(const matrix *m, int64_t rows) { return m->n_in * padded_rows(rows); }

/* The rows transposed, a cache line of each row at a time: reading one input of every row in turn, rows a multiple
   of 2 KiB apart fall in the same few L1 sets and evict each other (1536 inputs: 5x slower). */
void panel_inputs(const matrix *m, const float *x, int64_t rows, float *xt) {
  const int64_t n_in = m->n_in, padded = padded_rows(rows), line = 16;
  for (int64_t k0 = 0; k0 < n_in; k0 += line) {
    const int64_t k1 = k0 + line < n_in ? k0 + line : n_in;
    for (int64_t r = 0; r < rows; r++)
      for (int64_t k = k0; k < k1; k++) xt[k * padded + r] = x[r * n_in + k];
    for (int64_t k = k0; k < k1; k++)
      for (int64_t r = rows; r < padded; r++) xt[k * padded + r] = 0.0f;
  }
}

int panel_reserve(const matrix *m, int64_t rows) {
  scratch s;
  return scratch_for(m, padded_rows(rows), &s);
}

int panel_range(const matrix *m, const float *xt, int64_t rows, int64_t lo, int64_t j0, int64_t j1, float *out, int64_t os) {
  const int64_t padded = padded_rows(rows);
  const int width = padded / 8 < ROW_VECTORS ? (int)(padded / 8) : ROW_VECTORS, nr = PANEL_ROWS[width - 1];
  scratch s;
  if (scratch_for(m, padded, &s)) return -1;
  for (int64_t j = j0; j < j1; j += nr) panel_rows(m, xt, rows, padded, lo, j, j + nr < j1 ? j + nr : j1, out, os, width, &s);
  return 0;
}

/* x (rows, in) contiguous @ weight rows lo..hi into out (rows, hi - lo; rows os floats apart); its panels shared among
   OpenMP's threads where `shared` (and the library has them). Returns 0, or -1 where memory ran out. */
int panel_product(const matrix *m, const float *x, int64_t rows, int64_t lo, int64_t hi, float *out, int64_t os, int shared) {
  const int64_t padded = padded_rows(rows);
  const int width = padded / 8 < ROW_VECTORS ? (int)(padded / 8) : ROW_VECTORS, nr = PANEL_ROWS[width - 1];
  float *xt = kept_buffer(0, (size_t)panel_inputs_floats(m, rows));
  if (!xt) return -1;
  panel_inputs(m, x, rows, xt);
  const int64_t panels = (hi - lo + nr - 1) / nr;
  int failed = 0;
#pragma omp parallel for schedule(static) if (shared) reduction(| : failed)
  for (int64_t p = 0; p < panels; p++) {
    const int64_t j0 = lo + p * nr, j1 = j0 + nr < hi ? j0 + nr : hi;
    failed |= panel_range(m, xt, rows, lo, j0, j1, out, os);
  }
  return failed ? -1 : 0;
}

/* panel_product with x and out float32 numpy arrays (arrays.h), as quantized.c's product_arrays: -2, computing
   nothing, unless x is (rows, in) contiguous, out (rows, hi - lo) with contiguous rows and lo..hi within the matrix. */
int panel_product_arrays(const matrix *m, const void *x, const void *out, int64_t lo, int64_t hi, int shared) {
  const array_fields *xf = fields(x), *of = fields(out);
  if (xf->nd != 2 || of->nd != 2 || xf->shape[1] != m->n_in || xf->strides[1] != 4 || (xf->shape[0] > 1 && xf->strides[0] != 4 * m->n_in)
      || of->shape[0] != xf->shape[0] || of->shape[1] != hi - lo || (hi > lo + 1 && of->strides[1] != 4) || of->strides[0] % 4
      || lo < 0 || lo > hi || hi > m->n_out || xf->shape[0] < 1)
    return -2;
  return panel_product(m, (const float *)xf->data, xf->shape[0], lo, hi, (float *)of->data, of->strides[0] / 4, shared);
}
