/* A plain dense decoder's step of decode rows (fused_decode.py), in one call: on the first shard the rows' token
   embeddings, then per layer the attention norm, the q/k/v product (and its biases), RoPE of queries and keys, keys
   and values into each row's float32 cache slot, attention over it, the output product added to the residual stream,
   the MLP norm, gate/up with SiLU(gate) * up, and the down product added to the stream; on the last shard the final
   norm and the head's product, the logits.

   Shared, the whole call is one OpenMP parallel region: the threads take each product's weight rows by slices and
   the attention by (row, head), task by task, and wait for each phase's tasks to be done before the next (`phase`),
   so a step pays one fork and join, not one per product, and no Python runs between the phases (the head's 49,152
   outputs are one more such phase). Not shared, the same code runs on the calling thread alone. A few rows' products
   read the codes directly (quantized.c); more rows' take the panel kernel (panels.c), each task whole panels. */
#include <math.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>

#ifdef _OPENMP
#include <omp.h>
#else
static int omp_get_max_threads(void) { return 1; }
static int omp_get_thread_num(void) { return 0; }
static int omp_get_num_threads(void) { return 1; }
#endif

#include "kernel_parts.h"
#include "quantized.h"

#define PAIR 32 /* gate/up's outputs interleaved in pairs of PAIR gate then PAIR up (llama.py); PANEL is two of them */
/* weight rows a task of the other products: half a PANEL, so that their tasks split evenly between two threads
   (SmolLM2's output and down products are 9 panels of 64 rows, 5 against 4; 18 of 32 split 9 and 9) */
#define SLICE 32
/* With the panel kernel (more rows than the direct one takes), tasks of whole panels: 96 weight rows (a multiple of
   every panel width, panels.c's NR), gate/up's three PANELs; SmolLM2's output and down products are 6 such tasks */
#define PANEL_SLICE 96
#define PANEL_PAIRS 3

typedef struct {
  matrix qkv, o, gate_up, down;
  const float *attn_norm, *mlp_norm, *qkv_bias, *o_bias; /* biases NULL where the model has none */
} decoder_layer;

/* The shard's ends: the embedding (first shard) and the final norm and head (last shard); NULL where the shard lacks
   one, or where Python computes it (an embedding or head the kernels do not read) */
typedef struct {
  const matrix *embed, *head;
  const float *norm;
  float embed_scale;
} decoder_ends;

typedef struct {
  int64_t n_layers, hidden, n_heads, n_kv, head_dim, inter, positions; /* positions: a cache row's, the pool's */
  float eps, scale;                                                     /* RMS norms' epsilon, the queries' scale */
} decoder_shape;

/* A phase of the step. Its tasks are cut into one contiguous range a thread, as a static schedule would: each thread
   takes its own range's tasks in order, then those left in the others' ranges. A thread waits for the phase's tasks
   to be done, not for the other threads to arrive: with another process on the machine a thread may be descheduled
   for milliseconds, and at a barrier after each of a step's ~180 phases every such pause stopped the whole step (a
   shared one-row SmolLM2 step took 60-110 ms at load 4-6, against 7-8 ms quiet). Now a thread that lies idle holds up
   only the task it had taken; the others do the rest of its range. (Taking every task from one shared counter
   instead cost a quiet step a fifth more: its cache line crossed between the cores at every task, and each thread's
   weight rows were no longer contiguous.) */
typedef struct {
  int64_t taken; /* tasks of this range taken (and tries past its last) */
  char apart[56]; /* one cache line a counter */
} cursor;
#define PHASES 6 /* a layer's */
#define HEAD_ROWS 256 /* the head's weight rows a task: 192 of SmolLM2's, few enough that taking them costs little */
#define PANEL_HEAD_ROWS 192 /* with the panels, whole ones (a multiple of every panel width) */
#define SPINS 4000 /* waits a thread spins (each a pause) before it yields its core to whichever thread the kernel picks */

typedef struct {
  cursor *ranges; /* the phase's, one a thread; then its count of tasks done */
  int me, threads;
} team;

static inline cursor *phase_of(const team *tm, int64_t ph) { return tm->ranges + ph * (tm->threads + 1); }

/* The next task of phase ph for this thread, or -1 when none is left. */
static inline int64_t take(const team *tm, int64_t ph, int64_t tasks) {
  cursor *ranges = phase_of(tm, ph);
  for (int k = 0; k < tm->threads; k++) {
    const int v = (tm->me + k) % tm->threads;
    const int64_t lo = tasks * v / tm->threads, n = tasks * (v + 1) / tm->threads - lo;
    if (__atomic_load_n(&ranges[v].taken, __ATOMIC_RELAXED) >= n) continue;
    const int64_t t = __atomic_fetch_add(&ranges[v].taken, 1, __ATOMIC_RELAXED);
    if (t < n) return lo + t;
  }
  return -1;
}

/* This thread's `count` tasks of phase ph are done; then it waits for all `tasks` of it. */
static inline void end_phase(const team *tm, int64_t ph, int64_t count, int64_t tasks) {
  int64_t *finished = &phase_of(tm, ph)[tm->threads].taken;
  __atomic_fetch_add(finished, count, __ATOMIC_RELEASE);
  for (int spins = 0; __atomic_load_n(finished, __ATOMIC_ACQUIRE) < tasks; spins++) {
    if (spins < SPINS) {
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
    } else {
      sched_yield();
    }
  }
}

/* out = x * weight / rms(x), one row of n, as llama.py's rms_norm */
static void rms_norm_row(const float *x, const float *weight, int64_t n, float eps, float *out) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; i++) s += x[i] * x[i];
  const float scale = 1.0f / sqrtf(s * (1.0f / (float)n) + eps);
  for (int64_t i = 0; i < n; i++) out[i] = x[i] * weight[i] * scale;
}

/* A product's inputs as its kernel reads them: the direct kernel's (prepare_into), or transposed for the panels. */
typedef struct {
  inputs in;
  const float *xt;
  int64_t rows;
  int panels;
} product_inputs;

static int64_t product_floats(const matrix *m, int64_t rows, int panels) {
  return panels ? panel_inputs_floats(m, rows) : prepared_floats(m, rows);
}

static void prepare_product(const matrix *m, const float *x, int64_t rows, int panels, product_inputs *p, float *scratch) {
  p->rows = rows, p->panels = panels, p->xt = scratch;
  if (panels)
    panel_inputs(m, x, rows, scratch);
  else
    prepare_into(m, x, rows, &p->in, scratch);
}

/* out[r * os + j - lo] = x[r] . w[j] for weight rows j in [j0, j1); nonzero where the panels lacked memory */
static int product_range(const matrix *m, const product_inputs *p, int64_t lo, int64_t j0, int64_t j1, float *out, int64_t os) {
  if (p->panels) return panel_range(m, p->xt, p->rows, lo, j0, j1, out, os);
  rows_range(m, &p->in, p->rows, lo, j0, j1, out, os);
  return 0;
}

static void norm_and_prepare(const decoder_shape *d, const float *h, const float *weight, int64_t rows, float *x, const matrix *m,
                             int panels, product_inputs *in, float *scratch) {
  for (int64_t r = 0; r < rows; r++) rms_norm_row(h + r * d->hidden, weight, d->hidden, d->eps, x + r * d->hidden);
  prepare_product(m, x, rows, panels, in, scratch);
}

/* One decode step for rows that are each one new position: on the first shard (ids not NULL) h is made from the
   rows' token ids, then it goes through layers 0..n_layers, and on the last shard (logits not NULL) the final norm
   and the head's product write logits (rows, head->n_out). Row r's cache slot is at slots[r] ((layers, keys and
   values, kv heads, positions, head dim) float32), its position positions[r], its RoPE cos and sin at cos, sin + r *
   head_dim / 2. `panels`: the products by the panel kernel (many rows), else by the direct one. Returns 0; -1 where
   memory ran out (h then partly updated); -2, computing nothing, where a token id lies outside the embedding. */
int decode_step(const decoder_layer *layers, const decoder_shape *d, const decoder_ends *ends, const int64_t *ids, float *h,
                float *logits, int64_t rows, float *const *slots, const int64_t *positions, const float *cos, const float *sin,
                int shared, int panels) {
  const int64_t hidden = d->hidden, hd = d->head_dim, half = hd / 2, n_heads = d->n_heads, n_kv = d->n_kv;
  const int64_t qkv_width = (n_heads + 2 * n_kv) * hd, q_width = n_heads * hd, group = n_heads / n_kv;
  const int64_t row_floats = d->positions * hd, layer_floats = 2 * n_kv * row_floats;
  const matrix *head = logits ? ends->head : NULL;
  if (ids) {
    for (int64_t r = 0; r < rows; r++)
      if (ids[r] < 0 || ids[r] >= ends->embed->n_out) return -2;
    dequantize_rows(ends->embed, ids, rows, h);
    if (ends->embed_scale != 1.0f)
      for (int64_t i = 0; i < rows * hidden; i++) h[i] *= ends->embed_scale;
  }
  int64_t prepared = head ? product_floats(head, rows, panels) : 0, longest = 1;
  for (int64_t li = 0; li < d->n_layers; li++) {
    const matrix *ms[4] = {&layers[li].qkv, &layers[li].o, &layers[li].gate_up, &layers[li].down};
    for (int i = 0; i < 4; i++) prepared = product_floats(ms[i], rows, panels) > prepared ? product_floats(ms[i], rows, panels) : prepared;
  }
  const int64_t slice = panels ? PANEL_SLICE : SLICE, pairs_a_task = panels ? PANEL_PAIRS : 1, panel_floats = PANEL * pairs_a_task;
  for (int64_t r = 0; r < rows; r++) longest = positions[r] + 1 > longest ? positions[r] + 1 : longest;
  const int64_t work_floats = rows * (qkv_width + 2 * q_width + d->inter);
  float *work = malloc(sizeof(float) * (size_t)work_floats);
  if (!work) return -1;
  float *qkv = work, *q = qkv + rows * qkv_width, *attn = q + rows * q_width, *act = attn + rows * q_width;
  const int64_t n_phases = PHASES * d->n_layers + 1;
  const int threads = shared ? omp_get_max_threads() : 1;
  cursor *phases = calloc((size_t)(n_phases * (threads + 1)), sizeof(cursor));
  if (!phases) {
    free(work);
    return -1;
  }
  int failed = 0;

#pragma omp parallel if (shared) num_threads(threads)
  {
    const team tm = {phases, omp_get_thread_num(), omp_get_num_threads()};
    /* each thread's panel of products (rows, PANEL), attention scores, and a product's inputs as the kernels read
       them: every thread prepares its own copy (a few us) when it takes its first task of a phase, which spares a
       wait a product (a thread that takes a task knows the phase before is done and the next not begun). A thread without memory takes no task: the others do them all. */
    float *mine = malloc(sizeof(float) * (size_t)(rows * panel_floats + group * longest + hd + rows * hidden + prepared));
    /* the panel kernel's own buffers, made ready for every matrix now: a task then never lacks memory half-way */
    for (int64_t li = 0; li < d->n_layers && mine && panels; li++) {
      const matrix *ms[4] = {&layers[li].qkv, &layers[li].o, &layers[li].gate_up, &layers[li].down};
      for (int i = 0; i < 4 && mine; i++)
        if (panel_reserve(ms[i], rows)) free(mine), mine = NULL;
    }
    if (mine && head && panels && panel_reserve(head, rows)) free(mine), mine = NULL;
    if (!mine) {
#pragma omp atomic write
      failed = 1;
    }
    float *panel = mine, *scores = mine + rows * panel_floats, *x = mine ? scores + group * longest + hd : NULL, *scratch = mine ? x + rows * hidden : NULL;
    product_inputs in;
    int64_t t, count; /* a task, and how many of the phase's this thread did */
    int short_of = 0;   /* a panel product lacked memory (never, once panel_reserve has been) */
    int64_t ph = 0;
    for (int64_t li = 0; li < d->n_layers && mine; li++) {
      const decoder_layer *layer = layers + li;

      const int64_t qkv_slices = (qkv_width + slice - 1) / slice;
      count = 0;
      for (int ready = 0; (t = take(&tm, ph, qkv_slices)) >= 0; count++) {
        if (!ready++) norm_and_prepare(d, h, layer->attn_norm, rows, x, &layer->qkv, panels, &in, scratch);
        const int64_t j0 = t * slice, j1 = j0 + slice < qkv_width ? j0 + slice : qkv_width;
        short_of |= product_range(&layer->qkv, &in, 0, j0, j1, qkv, qkv_width);
      }
      end_phase(&tm, ph++, count, qkv_slices);

      /* each (row, query head): biased, turned and scaled into q; each (row, kv head): its key turned and its value
         into the row's cache */
      count = 0;
      for (; (t = take(&tm, ph, rows * (n_heads + n_kv))) >= 0; count++) {
        const int64_t r = t / (n_heads + n_kv), head = t % (n_heads + n_kv);
        float *out = qkv + r * qkv_width;
        const float *c = cos + r * half, *s = sin + r * half;
        if (head < n_heads) {
          float *part = out + head * hd;
          if (layer->qkv_bias)
            for (int64_t i = 0; i < hd; i++) part[i] += layer->qkv_bias[head * hd + i];
          rope_contiguous(part, c, s, d->scale, q + r * q_width + head * hd, 1, half);
          continue;
        }
        const int64_t g = head - n_heads;
        float *key = out + q_width + g * hd, *value = out + q_width + n_kv * hd + g * hd;
        if (layer->qkv_bias)
          for (int64_t i = 0; i < hd; i++) {
            key[i] += layer->qkv_bias[q_width + g * hd + i];
            value[i] += layer->qkv_bias[q_width + n_kv * hd + g * hd + i];
          }
        float *cached = slots[r] + li * layer_floats + g * row_floats + positions[r] * hd;
        rope_contiguous(key, c, s, 1.0f, cached, 1, half);
        float *cached_value = cached + n_kv * row_floats;
        for (int64_t i = 0; i < hd; i++) cached_value[i] = value[i];
      }
      end_phase(&tm, ph++, count, rows * (n_heads + n_kv));

      /* by (row, query head); or, with rows enough to keep every thread busy, by (row, kv head), its query heads
         together (each key and value read once for them) */
      const int64_t heads_a_task = rows * n_kv >= 4 * tm.threads ? group : 1, attend_tasks = rows * n_heads / heads_a_task;
      count = 0;
      for (; (t = take(&tm, ph, attend_tasks)) >= 0; count++) {
        const int64_t r = t / (n_heads / heads_a_task), head = t % (n_heads / heads_a_task) * heads_a_task;
        const float *keys = slots[r] + li * layer_floats + (head / group) * row_floats;
        attend_heads(keys, keys + n_kv * row_floats, hd, q + r * q_width + head * hd, heads_a_task, 0, positions[r] + 1, hd, scores,
                     attn + r * q_width + head * hd);
      }
      end_phase(&tm, ph++, count, attend_tasks);

      const int64_t hidden_slices = (hidden + slice - 1) / slice;
      count = 0;
      for (int ready = 0; (t = take(&tm, ph, hidden_slices)) >= 0; count++) {
        if (!ready++) prepare_product(&layer->o, attn, rows, panels, &in, scratch);
        const int64_t j0 = t * slice, j1 = j0 + slice < hidden ? j0 + slice : hidden;
        short_of |= product_range(&layer->o, &in, j0, j0, j1, panel, panel_floats);
        for (int64_t r = 0; r < rows; r++)
          for (int64_t j = j0; j < j1; j++) {
            float v = panel[r * panel_floats + j - j0];
            if (layer->o_bias) v += layer->o_bias[j];
            h[r * hidden + j] += v;
          }
      }
      end_phase(&tm, ph++, count, hidden_slices);

      const int64_t pairs = 2 * d->inter / PANEL, pair_tasks = (pairs + pairs_a_task - 1) / pairs_a_task;
      count = 0;
      for (int ready = 0; (t = take(&tm, ph, pair_tasks)) >= 0; count++) {
        if (!ready++) norm_and_prepare(d, h, layer->mlp_norm, rows, x, &layer->gate_up, panels, &in, scratch);
        const int64_t p0 = t * pairs_a_task, p1 = p0 + pairs_a_task < pairs ? p0 + pairs_a_task : pairs;
        short_of |= product_range(&layer->gate_up, &in, p0 * PANEL, p0 * PANEL, p1 * PANEL, panel, panel_floats);
        for (int64_t r = 0; r < rows; r++)
          for (int64_t p = p0; p < p1; p++)
            for (int64_t i = 0; i < PAIR; i++) {
              const float *pair = panel + r * panel_floats + (p - p0) * PANEL;
              const float gate = pair[i], up = pair[PAIR + i];
              act[r * d->inter + p * PAIR + i] = gate / (1.0f + expf(-gate)) * up;
            }
      }
      end_phase(&tm, ph++, count, pair_tasks);

      count = 0;

      for (int ready = 0; (t = take(&tm, ph, hidden_slices)) >= 0; count++) {
        if (!ready++) prepare_product(&layer->down, act, rows, panels, &in, scratch);
        const int64_t j0 = t * slice, j1 = j0 + slice < hidden ? j0 + slice : hidden;
        short_of |= product_range(&layer->down, &in, j0, j0, j1, panel, panel_floats);
        for (int64_t r = 0; r < rows; r++)
          for (int64_t j = j0; j < j1; j++) h[r * hidden + j] += panel[r * panel_floats + j - j0];
      }
      end_phase(&tm, ph++, count, hidden_slices);
    }
    if (head && mine) {
      const int64_t head_rows = panels ? PANEL_HEAD_ROWS : HEAD_ROWS, head_tasks = (head->n_out + head_rows - 1) / head_rows;
      count = 0;
      for (int ready = 0; (t = take(&tm, ph, head_tasks)) >= 0; count++) {
        if (!ready++) norm_and_prepare(d, h, ends->norm, rows, x, head, panels, &in, scratch);
        const int64_t j0 = t * head_rows, j1 = j0 + head_rows < head->n_out ? j0 + head_rows : head->n_out;
        short_of |= product_range(head, &in, 0, j0, j1, logits, head->n_out);
      }
    }
    if (short_of) {
#pragma omp atomic write
      failed = 1;
    }
    free(mine);
  }
  free(phases);
  free(work);
  return failed ? -1 : 0;
}
