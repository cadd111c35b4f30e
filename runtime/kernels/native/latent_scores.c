/* A latent decode step's attention scores in one pass over the cached latents
 * (runtime/kernels/latent_scores.py builds, loads and calls this file).
 *
 * A latent KV cache holds z_k per token; the keys are z_k's copied columns (U_k's
 * identity columns, whole RoPE pairs) and z_k . U_rest (the other columns), each pair
 * rotated at its token's position; every query row is scored against them. In torch
 * that is a GEMM over all the batch's tokens, a complex product and two batched score
 * products, each writing its result to memory for the next. Here a tile of TOK tokens
 * is rebuilt in registers (CHUNK accumulator vectors per token, each U_rest row loaded
 * once per tile), rotated and scored while it is in L1.
 *
 * Measured on an AMD EPYC VM (Zen 4, AVX-512; cpu-135m at 40%: r_k 116, 116 copied
 * and 76 rebuilt columns, batch 8, context 256, 9 query heads; medians of 200 calls):
 * the torch form 1.06-1.34 ms with one thread and 0.66-0.85 with two; this kernel
 * 0.61-0.77 and 0.40-0.47. Of its time, ~2/3 is the rebuild's FMAs.
 *
 * Both this and latent_values (probabilities . z_v) read each token's latents where
 * they lie, at its cache slot, instead of a copy gathered for the step: the 30 layers
 * of that step (pools of 2,048 blocks in random order, medians of 15 passes) took
 * 35.6 ms with two threads gathered (torch's index_select, the scores on the copy, a
 * batched product for z_v) and 23.6 read in place; 57.5 and 41.0 with one thread. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec.h"

#if defined(__AVX512F__)
#define TOK 4   /* tokens per tile (measured on Zen 4 before AVX2's 6 x 2: not retried) */
#define CHUNK 4 /* accumulator vectors per token: 16 of 32 registers */
#define HEADS 3 /* query heads whose values are summed at once ... */
#define SPAN 4  /* ... over SPAN vectors of columns: 12 + 4 registers */
#define UNITS 3 /* query heads of a KV head times U_v at once: 12 + 4 registers */
#elif defined(__AVX__)
/* 6 tokens x 2 vectors: 12 of 16 registers, 2 for U_rest, 1 for a broadcast; each
 * U_rest vector loaded feeds 6 FMAs, and 80 rebuilt columns (cpu-135m at 40 %) are 5
 * whole chunks. 3 tokens x 4 vectors fed 3 and left a chunk of 2 vectors. The layer's
 * latent_attention there (batch 8, context 256; AMD EPYC VM, Zen 3, AVX2; calls of
 * both builds alternated, medians of 200, three runs): 0.79-0.92x of 3 x 4's time with
 * two threads, 0.87-0.90x with one; the rebuild's inner loop is 2 loads, 6 broadcasts
 * and 12 FMAs, no spills (5 x 2, 3 x 4, 4 x 3, 8 x 1, 4 x 2: 1.01-1.34x of 6 x 2's). */
#define TOK 6
#define CHUNK 2
#define HEADS 2 /* 8 + 4 of 16 registers */
#define SPAN 4
#define UNITS 2 /* 8 + 4 of 16 registers */
#else /* 16 registers of 4 lanes: the tile as with AVX2 */
#define TOK 6
#define CHUNK 2
#define HEADS 3 /* 9 + 3 of 16 registers */
#define SPAN 3
#define UNITS 3 /* 9 + 3 of 16 registers */
#endif
#define MAX_WIDTH 1024 /* key columns of one rank (kv_heads x head_dim) and padding */

#include "latent_values.h" /* after the register tiles it uses */

int latent_width(void) { return VEC; }

int latent_max_width(void) { return MAX_WIDTH; }

/* keys[t][col .. col + vecs * VEC) = z[t][:r_k] . u[:, col ..] for tokens tokens
 * (z[t]: token t's row)
 * (tokens and vecs constants in the callers below, so the loops unroll into registers) */
static inline __attribute__((always_inline)) void rebuild(
    const float *const *z, int64_t r_k, const float *u, int64_t ldu, int64_t col,
    float *keys, const int tokens, const int vecs) {
  vec_t acc[TOK][CHUNK];
#pragma GCC unroll 8
  for (int t = 0; t < tokens; t++)
#pragma GCC unroll 4
    for (int v = 0; v < vecs; v++) acc[t][v] = (vec_t){0};
  for (int64_t k = 0; k < r_k; k++) {
    const float *uk = u + k * ldu + col;
    vec_t w[CHUNK];
#pragma GCC unroll 4
    for (int v = 0; v < vecs; v++) w[v] = load(uk + v * VEC);
#pragma GCC unroll 8
    for (int t = 0; t < tokens; t++) {
      float zt = z[t][k];
#pragma GCC unroll 4
      for (int v = 0; v < vecs; v++) acc[t][v] += zt * w[v];
    }
  }
#pragma GCC unroll 8
  for (int t = 0; t < tokens; t++)
#pragma GCC unroll 4
    for (int v = 0; v < vecs; v++) store(keys + t * MAX_WIDTH + col + v * VEC, acc[t][v]);
}

#define VECS_CASE(n, tokens, zp, kp)                      \
  case n:                                                 \
    if (n <= CHUNK) rebuild(zp, r_k, u, upad, col, kp, tokens, n); \
    break;

/* the first n floats of row p towards the cache, a line at a time: the tokens AHEAD
 * tiles on are on their way while this tile is rebuilt (in the measurement above, 0, 1
 * and 2 tiles ahead: 23.8, 23.6, 23.2 ms with two threads, 42.5, 41.0, 41.0 with one) */
#ifndef AHEAD
#define AHEAD 2
#endif
static inline void prefetch_row(const float *p, int64_t n) {
  for (int64_t i = 0; i < n; i += 64 / sizeof(float)) __builtin_prefetch(p + i);
}

/* the rebuilt columns of a tile's tokens (z: their rows), and the rows ahead
 * (n_ahead of them) prefetched a few per chunk of columns: all at once before the
 * rebuild, the prefetches of a tile's rows (6 x 8 lines at 40 %) stalled on the
 * misses in flight (7 % of score_tile's samples on the prefetch loop, perf); spread,
 * 30 layers' latent_attention took 0.89-0.94x the time (cpu-135m's shapes at 40 %,
 * batch 8, context 256, two threads, AMD EPYC VM, Zen 3, AVX2; the two builds' calls
 * alternated, medians of 30 passes, six runs) */
static void rebuild_tile(const float *const *z, int64_t r_k, const float *u,
                         int64_t upad, float *rest_keys, int tokens,
                         const float *const *ahead, int n_ahead) {
  int64_t chunks = (upad + CHUNK * VEC - 1) / (CHUNK * VEC);
  for (int64_t col = 0, c = 0; col < upad; col += CHUNK * VEC, c++) {
    for (int64_t t = c; t < n_ahead; t += chunks) prefetch_row(ahead[t], r_k);
    int64_t left = (upad - col) / VEC;
    int vecs = left < CHUNK ? (int)left : CHUNK;
    if (tokens == TOK) {
      switch (vecs) {
        VECS_CASE(1, TOK, z, rest_keys) VECS_CASE(2, TOK, z, rest_keys)
        VECS_CASE(3, TOK, z, rest_keys) VECS_CASE(4, TOK, z, rest_keys)
      }
      continue;
    }
    for (int t = 0; t < tokens; t++) { /* the last tile of a sequence, token by token */
      const float *const *zt = z + t;
      float *kt = rest_keys + t * MAX_WIDTH;
      switch (vecs) { VECS_CASE(1, 1, zt, kt) VECS_CASE(2, 1, zt, kt) VECS_CASE(3, 1, zt, kt) VECS_CASE(4, 1, zt, kt) }
    }
  }
}

/* whether every slot of each sequence's first lengths[b] (at most length) tokens is a
 * row of the cache (0 .. rows - 1): the callers read those rows without bounds */
static int slots_in_range(const int64_t *slots, int64_t batch, int64_t length,
                          const int64_t *lengths, int64_t rows) {
  for (int64_t b = 0; b < batch; b++) {
    int64_t n = lengths[b] < length ? lengths[b] : length;
    for (int64_t l = 0; l < n; l++)
      if (slots[b * length + l] < 0 || slots[b * length + l] >= rows) return 0;
  }
  return 1;
}

/* What scoring a tile of one sequence's keys reads and writes (``latent_scores``'
 * arguments, and live: each query row's vectors that are not all zero, ``live_vectors``). */
typedef struct {
  const float *z;
  int64_t ldz;
  const int64_t *slots;
  int64_t length;
  const int64_t *lengths;
  int64_t r_k, copy_from, copies;
  const float *u;
  int64_t upad;
  const float *cos, *sin, *queries;
  int64_t heads, wpad;
  const int32_t *live;
  float *scores;
} keys_t;

/* live[row] = (count, the vectors of query row row that are not all zero): a
 * block-diagonal query row is zero outside its KV head's columns, so each head scores
 * only those (cpu-135m: 8 of 24 vectors at full rank, 9-10 at 40 %, with 8 lanes) */
static void live_vectors(const float *queries, int64_t first, int64_t count, int64_t wpad,
                         int32_t *live) {
  int64_t vectors = wpad / VEC;
  for (int64_t row = first; row < first + count; row++) {
    int32_t *own = live + row * (vectors + 1), n = 0;
    for (int64_t v = 0; v < vectors; v++) {
      int any = 0;
      for (int64_t i = 0; i < VEC; i++) any |= queries[row * wpad + v * VEC + i] != 0.0f;
      if (any) own[1 + n++] = (int32_t)v;
    }
    own[0] = n;
  }
}

#if VEC == 8 && TOK == 6
/* c's lanes where bit s of the lane is 0: a's lanes i + (i + s); where it is 1: b's */
#define FOLD(a, b, m1, m2) (__builtin_shuffle(a, b, (vec_int)m1) + __builtin_shuffle(a, b, (vec_int)m2))
#define FOLD4(a, b) FOLD(a, b, ((vec_int){0, 1, 2, 3, 8, 9, 10, 11}), ((vec_int){4, 5, 6, 7, 12, 13, 14, 15}))
#define FOLD2(a, b) FOLD(a, b, ((vec_int){0, 1, 8, 9, 4, 5, 12, 13}), ((vec_int){2, 3, 10, 11, 6, 7, 14, 15}))
#define FOLD1(a, b) FOLD(a, b, ((vec_int){0, 8, 2, 10, 4, 12, 6, 14}), ((vec_int){1, 9, 3, 11, 5, 13, 7, 15}))
/* out[t] = the sum of sum[t]'s lanes, t < tokens: the six vectors folded pairwise into
 * one (lane t after three folds sums input t's lanes when inputs go in bit-reversed
 * order: 0, 4, 2, 6, 1, 5, 3, 7). Summing each vector's lanes in turn instead was
 * 1.03-1.04x this time for the layer's latent_attention (30 layers, cpu-135m's shapes at
 * 40 % and full rank, batch 8, context 256, two threads, AMD EPYC VM, Zen 3; the two
 * builds' calls alternated, medians of 30 passes, three runs). */
static inline void tile_sums(const vec_t sum[TOK], float *out, int tokens) {
  const vec_t zero = {0};
  vec_t all = FOLD1(FOLD2(FOLD4(sum[0], sum[4]), FOLD4(sum[2], zero)),
                    FOLD2(FOLD4(sum[1], sum[5]), FOLD4(sum[3], zero)));
  for (int t = 0; t < tokens; t++) out[t] = all[t];
}
#else
static inline void tile_sums(const vec_t sum[TOK], float *out, int tokens) {
  for (int t = 0; t < tokens; t++) {
    float total = 0;
    for (int i = 0; i < VEC; i++) total += sum[t][i];
    out[t] = total;
  }
}
#endif

/* Sequence b's scores for tokens TOK * tile .. (see latent_scores): the tile's keys
 * rebuilt, rotated and scored while they are in L1. */
static void score_tile(const keys_t *a, int64_t b, int64_t tile) {
  int64_t l0 = tile * TOK, length = a->length, wpad = a->wpad, copies = a->copies;
  int64_t span = length - l0 < TOK ? length - l0 : TOK; /* score columns of this tile */
  int64_t n = a->lengths[b] < length ? a->lengths[b] : length; /* the sequence's tokens */
  int tokens = n - l0 <= 0 ? 0 : (n - l0 < TOK ? (int)(n - l0) : TOK);
  float *out = a->scores + b * a->heads * length + l0;
  float keys[TOK][MAX_WIDTH] __attribute__((aligned(64)));
  const int64_t *slots = a->slots + b * length;
  const float *ahead[TOK]; /* the rows AHEAD tiles on (prefetched) */
  int n_ahead = 0;
  for (int64_t t = l0 + AHEAD * TOK; t < l0 + (AHEAD + 1) * TOK && t < n; t++)
    ahead[n_ahead++] = a->z + slots[t] * a->ldz;
  if (!tokens || !a->upad) /* no rebuild to spread them over */
    for (int t = 0; t < n_ahead; t++) prefetch_row(ahead[t], a->r_k);
  if (tokens) {
    const float *zt[TOK];
    for (int t = 0; t < tokens; t++) zt[t] = a->z + slots[l0 + t] * a->ldz;
    for (int t = 0; t < TOK; t++) { /* a tile's unused tokens are scored, not written */
      int64_t from = t < tokens ? copies : 0;
      memset(keys[t] + from, 0, (size_t)(wpad - from) * sizeof(float));
    }
    for (int t = 0; t < tokens; t++)
      memcpy(keys[t], zt[t] + a->copy_from, (size_t)copies * sizeof(float));
    rebuild_tile(zt, a->r_k, a->u, a->upad, keys[0] + copies, tokens, ahead, n_ahead);
    vec_int swap;
    for (int i = 0; i < VEC; i++) swap[i] = i ^ 1;
    for (int t = 0; t < tokens; t++) {
      const float *c = a->cos + (l0 + t) * wpad, *s = a->sin + (l0 + t) * wpad;
      for (int64_t j = 0; j < wpad; j += VEC) {
        vec_t x = load(keys[t] + j);
        store(keys[t] + j, x * load(c + j) + __builtin_shuffle(x, swap) * load(s + j));
      }
    }
  }
  for (int64_t h = 0; h < a->heads; h++, out += length) {
    if (tokens) {
      const float *q = a->queries + (b * a->heads + h) * wpad;
      const int32_t *own = a->live + (b * a->heads + h) * (wpad / VEC + 1);
      vec_t sum[TOK];
#pragma GCC unroll 8
      for (int t = 0; t < TOK; t++) sum[t] = (vec_t){0};
      for (int32_t i = 1; i <= own[0]; i++) {
        int64_t j = (int64_t)own[i] * VEC;
        vec_t qv = load(q + j);
#pragma GCC unroll 8
        for (int t = 0; t < TOK; t++) sum[t] += qv * load(keys[t] + j);
      }
      tile_sums(sum, out, tokens);
    }
    for (int64_t t = tokens; t < span; t++) out[t] = -INFINITY;
  }
}

/* scores [batch][heads][length]: queries [batch][heads][wpad] against the keys of the
 * first lengths[b] (at most length) tokens of each sequence, token l of sequence b at
 * cache row slots[b * length + l] of z [rows][ldz] (-inf past them): the row's columns
 * copy_from .. copy_from + copies, then
 * z[:, :r_k] . u [r_k][upad] (the rest of the key columns, zero past them), the pair at 2j, 2j + 1
 * rotated by cos, sin [length][wpad] as x . cos + swap(x) . sin (sin signed, zero past
 * the key columns). copies and the rest even; wpad, upad multiples of VEC;
 * copies + upad <= MAX_WIDTH. Returns -1 (nothing written) where a slot is not below
 * rows, -2 without scratch memory, else 0. */
int latent_scores(const float *z, int64_t rows, int64_t ldz, const int64_t *slots,
                  int64_t batch, int64_t length, const int64_t *lengths, int64_t r_k,
                  int64_t copy_from, int64_t copies, const float *u, int64_t upad,
                  const float *cos, const float *sin, const float *queries, int64_t heads,
                  int64_t wpad, float *scores) {
  if (!slots_in_range(slots, batch, length, lengths, rows)) return -1;
  int64_t tiles = (length + TOK - 1) / TOK;
  int32_t *live = malloc(sizeof(int32_t) * (size_t)(batch * heads * (wpad / VEC + 1)));
  if (!live) return -2;
  live_vectors(queries, 0, batch * heads, wpad, live);
  keys_t a = {z, ldz, slots, length, lengths, r_k, copy_from, copies, u, upad,
              cos, sin, queries, heads, wpad, live, scores};
#pragma omp parallel for schedule(static)
  for (int64_t job = 0; job < batch * tiles; job++) score_tile(&a, job / tiles, job % tiles);
  free(live);
  return 0;
}

/* out [batch][heads][r_v] = probs [batch][heads][length] . z_v of each sequence's first
 * lengths[b] (at most length) tokens, token l of sequence b at cache row
 * slots[b * length + l] of z [rows][ldz], its z_v at columns r_k .. r_k + r_v. Each KV
 * head's query heads (heads / kv_heads of them, in turn) take only z_v's columns
 * value_rows[g] = (first, count) (the rows of its U_v that are not zero: one whole head
 * in the copy basis, ``runtime.model.latent_basis``); only those of out are written.
 * value_rows NULL: every head all r_v. One job per sequence and span of SPAN vectors of
 * columns. Returns -1 (nothing written) where a slot is not below rows, else 0. */
int latent_values(const float *probs, const float *z, int64_t rows, int64_t ldz,
                  const int64_t *slots, int64_t batch, int64_t length,
                  const int64_t *lengths, int64_t r_k, int64_t r_v, int64_t heads,
                  const int64_t *value_rows, int64_t kv_heads, float *out) {
  if (!slots_in_range(slots, batch, length, lengths, rows)) return -1;
  const int64_t span = SPAN * VEC, spans = (r_v + span - 1) / span;
  values_t a = {probs, z + r_k, ldz, slots, length, lengths, r_v, heads,
                value_rows, value_rows ? kv_heads : 1, out};
#pragma omp parallel for schedule(static)
  for (int64_t job = 0; job < batch * spans; job++)
    values_span(&a, job / spans, (job % spans) * span);
  return 0;
}

/* query row unit (b * heads + head) laid out as the keys are, scaled: key column j is
 * dim key_dims[j] of KV head key_heads[j], zero where that is not the row's KV head */
static void lay_out_query(const float *q, int64_t unit, int64_t heads, int64_t group,
                          int64_t d, float scale, const int64_t *key_dims,
                          const int64_t *key_heads, int64_t width, int64_t wpad,
                          float *queries) {
  int64_t g = unit % heads / group;
  const float *qh = q + unit * d;
  float *qb = queries + unit * wpad;
  for (int64_t j = 0; j < wpad; j++)
    qb[j] = j < width && key_heads[j] == g ? scale * qh[key_dims[j]] : 0.0f;
}

/* row [n] of scores -> its softmax */
static void softmax_row(float *row, int64_t n) {
  float top = -INFINITY;
  for (int64_t j = 0; j < n; j++) top = row[j] > top ? row[j] : top;
  float total = exp_shifted(row, n, top);
  for (int64_t j = 0; j < n; j++) row[j] /= total;
}

/* A latent layer's operands of latent_attention that stay from step to step (the
 * descriptor of runtime/kernels/latent_scores.py's LatentLayer, laid out and checked
 * once): key column j is dim key_dims[j] of KV head key_heads[j] (width of them); the
 * keys are z_k's columns copy_from .. + copies, then z_k . u [r_k][upad]; wpad: the
 * columns padded (the RoPE tables' width); U_v per KV head u_v [kv_heads][r_v][d] and
 * bias_v [kv_heads * d] (NULL: none); value_rows [kv_heads][2]: per KV head (first,
 * count), the rows of its U_v that are not zero. */
typedef struct {
  const int64_t *key_dims, *key_heads;
  int64_t width, r_k, r_v, copy_from, copies;
  const float *u;
  int64_t upad, wpad, kv_heads;
  const float *u_v;
  const int64_t *value_rows;
  const float *bias_v;
} latent_layer_t;

/* A decode step's tokens, the same in every layer (LatentStep's descriptor): sequence
 * b's new latent goes to cache row new_slots[b], its first lengths[b] (at most length)
 * tokens are at rows slots[b * length ..]. */
typedef struct {
  const int64_t *new_slots, *slots, *lengths;
  int64_t batch, length;
} latent_step_t;

/* A latent layer's decode attention in one call (the torch form: eager_attention's
 * decode_latent, with the cache write before it). Row b's new latent (r_k + r_v floats
 * at new_rows + b * ld_new) is written to cache row new_slots[b] of z [rows][ldz]; each
 * query head of q [batch][heads][d] (RoPE applied) is laid out as the keys are (the
 * other KV heads' columns zero), scaled, and scored (latent_scores, pairs rotated by
 * cos, sin [length][wpad]); softmax over each sequence's tokens; probabilities . z_v
 * (latent_values, each KV head's query heads over its z_v columns value_rows[g]); each
 * head's result times those rows of its KV head's U_v, plus bias_v -> out
 * [batch][heads][d]. Every step that torch took as its own op (a gather of the query
 * columns, a mask, a pad, the softmax, a batched product per KV head) reads and writes
 * this call's scratch instead. The operands that stay from call to call come as two
 * descriptors, made once per layer and once per step: passed one by one (31 arguments,
 * checked at every call), the latent step of cpu-135m at 40 % read 1.22-1.26x the
 * dense-KV step, with them 1.18-1.21x (batch 8, context 240-268, two threads, AMD EPYC
 * VM, Zen 3; medians of 28 step pairs, three runs of each, processes alternated).
 * The steps run in one parallel region, each shared out over its threads and followed
 * by a barrier (five regions before, each a fork and a join). Taking whole sequences
 * per thread through every step instead (no barriers, a sequence's latents still in L2
 * for its values) was no faster: cpu-135m, batch 8, context 256, 30 layers, two
 * threads, AMD EPYC VM (Zen 3, AVX2): 15.67 / 15.69 against 15.55 / 15.68 ms at 40 %,
 * 10.42 / 10.65 against 10.10 / 10.38 at full rank (two runs, medians of 30 passes).
 * Returns -1 (nothing written) where a slot is not below rows, -2 without scratch
 * memory (the new latents may be written), else 0. */
int latent_attention(const latent_layer_t *layer, const latent_step_t *step, const float *q,
                     int64_t heads, int64_t d, float scale, float *z, int64_t rows, int64_t ldz,
                     const float *new_rows, int64_t ld_new, const float *cos, const float *sin,
                     float *out) {
  const latent_layer_t *l = layer;
  const int64_t *new_slots = step->new_slots, *slots = step->slots, *lengths = step->lengths;
  int64_t batch = step->batch, length = step->length, r_k = l->r_k, r_v = l->r_v;
  int64_t wpad = l->wpad, kv_heads = l->kv_heads;
  for (int64_t b = 0; b < batch; b++)
    if (new_slots[b] < 0 || new_slots[b] >= rows) return -1;
  if (!slots_in_range(slots, batch, length, lengths, rows)) return -1;
  int64_t units = batch * heads, group = heads / kv_heads;
  int64_t tiles = (length + TOK - 1) / TOK, spans = (r_v + SPAN * VEC - 1) / (SPAN * VEC);
  float *queries = malloc(sizeof(float) * (size_t)(units * (wpad + length + r_v)));
  int32_t *live = malloc(sizeof(int32_t) * (size_t)(units * (wpad / VEC + 1)));
  if (!queries || !live) {
    free(queries);
    free(live);
    return -2;
  }
  float *scores = queries + units * wpad, *mixed = scores + units * length;
  for (int64_t b = 0; b < batch; b++) /* before any sequence reads the cache */
    memcpy(z + new_slots[b] * ldz, new_rows + b * ld_new, sizeof(float) * (size_t)(r_k + r_v));
  keys_t k = {z, ldz, slots, length, lengths, r_k, l->copy_from, l->copies, l->u, l->upad,
              cos, sin, queries, heads, wpad, live, scores};
  values_t v = {scores, z + r_k, ldz, slots, length, lengths, r_v, heads,
                l->value_rows, kv_heads, mixed};
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t unit = 0; unit < units; unit++) {
      lay_out_query(q, unit, heads, group, d, scale, l->key_dims, l->key_heads, l->width, wpad,
                    queries);
      live_vectors(queries, unit, 1, wpad, live);
    }
#pragma omp for schedule(static)
    for (int64_t job = 0; job < batch * tiles; job++) score_tile(&k, job / tiles, job % tiles);
#pragma omp for schedule(static)
    for (int64_t unit = 0; unit < units; unit++) {
      int64_t n = lengths[unit / heads] < length ? lengths[unit / heads] : length;
      softmax_row(scores + unit * length, n);
    }
#pragma omp for schedule(static)
    for (int64_t job = 0; job < batch * spans; job++)
      values_span(&v, job / spans, job % spans * SPAN * VEC);
#pragma omp for schedule(static)
    for (int64_t job = 0; job < batch * kv_heads; job++)
      heads_times_u_v(mixed, job / kv_heads, job % kv_heads, heads, kv_heads, r_v, d, l->u_v,
                      l->value_rows, l->bias_v, out);
  }
  free(queries);
  free(live);
  return 0;
}
