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

/* the rebuilt columns of a tile's tokens (z: their rows) */
static void rebuild_tile(const float *const *z, int64_t r_k, const float *u,
                         int64_t upad, float *rest_keys, int tokens) {
  for (int64_t col = 0; col < upad; col += CHUNK * VEC) {
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

/* the first n floats of row p towards the cache, a line at a time: the tokens AHEAD
 * tiles on are on their way while this tile is rebuilt (in the measurement above, 0, 1
 * and 2 tiles ahead: 23.8, 23.6, 23.2 ms with two threads, 42.5, 41.0, 41.0 with one) */
#ifndef AHEAD
#define AHEAD 2
#endif
static inline void prefetch_row(const float *p, int64_t n) {
  for (int64_t i = 0; i < n; i += 64 / sizeof(float)) __builtin_prefetch(p + i);
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
  int64_t tiles = (length + TOK - 1) / TOK, vectors = wpad / VEC;
  /* each query row's vectors that are not all zero, and how many: a block-diagonal query
   * row is zero outside its KV head's columns, so each head scores only those (cpu-135m:
   * 8 of 24 vectors at full rank, 9-10 at 40 %, with 8 lanes) */
  int32_t *live = malloc(sizeof(int32_t) * (size_t)(batch * heads * (vectors + 1)));
  if (!live) return -2;
  for (int64_t row = 0; row < batch * heads; row++) {
    int32_t *own = live + row * (vectors + 1), count = 0;
    for (int64_t v = 0; v < vectors; v++) {
      int any = 0;
      for (int64_t i = 0; i < VEC; i++) any |= queries[row * wpad + v * VEC + i] != 0.0f;
      if (any) own[1 + count++] = (int32_t)v;
    }
    own[0] = count;
  }
  vec_int swap;
  for (int i = 0; i < VEC; i++) swap[i] = i ^ 1;
#pragma omp parallel for schedule(static)
  for (int64_t job = 0; job < batch * tiles; job++) {
    int64_t b = job / tiles, l0 = (job % tiles) * TOK;
    int64_t span = length - l0 < TOK ? length - l0 : TOK; /* score columns of this tile */
    int64_t n = lengths[b] < length ? lengths[b] : length; /* the sequence's tokens */
    int tokens = n - l0 <= 0 ? 0 : (n - l0 < TOK ? (int)(n - l0) : TOK);
    float *out = scores + b * heads * length + l0;
    float keys[TOK][MAX_WIDTH] __attribute__((aligned(64)));
    for (int64_t t = l0 + AHEAD * TOK; t < l0 + (AHEAD + 1) * TOK && t < n; t++)
      prefetch_row(z + slots[b * length + t] * ldz, r_k);
    if (tokens) {
      const float *zt[TOK];
      for (int t = 0; t < tokens; t++) zt[t] = z + slots[b * length + l0 + t] * ldz;
      for (int t = 0; t < TOK; t++) { /* a tile's unused tokens are scored, not written */
        int64_t from = t < tokens ? copies : 0;
        memset(keys[t] + from, 0, (size_t)(wpad - from) * sizeof(float));
      }
      for (int t = 0; t < tokens; t++)
        memcpy(keys[t], zt[t] + copy_from, (size_t)copies * sizeof(float));
      rebuild_tile(zt, r_k, u, upad, keys[0] + copies, tokens);
      for (int t = 0; t < tokens; t++) {
        const float *c = cos + (l0 + t) * wpad, *s = sin + (l0 + t) * wpad;
        for (int64_t j = 0; j < wpad; j += VEC) {
          vec_t x = load(keys[t] + j);
          store(keys[t] + j, x * load(c + j) + __builtin_shuffle(x, swap) * load(s + j));
        }
      }
    }
    for (int64_t h = 0; h < heads; h++, out += length) {
      if (tokens) {
        const float *q = queries + (b * heads + h) * wpad;
        const int32_t *own = live + (b * heads + h) * (vectors + 1);
        vec_t sum[TOK];
#pragma GCC unroll 8
        for (int t = 0; t < TOK; t++) sum[t] = (vec_t){0};
        for (int32_t i = 1; i <= own[0]; i++) {
          int64_t j = (int64_t)own[i] * VEC;
          vec_t qv = load(q + j);
#pragma GCC unroll 8
          for (int t = 0; t < TOK; t++) sum[t] += qv * load(keys[t] + j);
        }
        for (int t = 0; t < tokens; t++) {
          float total = 0;
          for (int i = 0; i < VEC; i++) total += sum[t][i];
          out[t] = total;
        }
      }
      for (int64_t t = tokens; t < span; t++) out[t] = -INFINITY;
    }
  }
  free(live);
  return 0;
}

/* acc[h][v] += p[h][t] . z_v[t][start[v] .. + VEC) over tokens t < n (token t at cache
 * row row[t] of z_v, the rows' z_v columns; p's rows length apart; heads h < hs) */
static inline __attribute__((always_inline)) void mix(
    const float *p, int64_t length, int hs, const float *z_v, int64_t ldz, const int64_t *row,
    int64_t n, const int64_t *start, vec_t acc[HEADS][SPAN], const int vecs) {
  for (int64_t t = 0; t < n; t++) {
    const float *zt = z_v + row[t] * ldz;
    vec_t w[SPAN];
#pragma GCC unroll 4
    for (int v = 0; v < vecs; v++) w[v] = load(zt + start[v]);
#pragma GCC unroll 4
    for (int h = 0; h < HEADS; h++) {
      float ph = h < hs ? p[h * length + t] : 0.0f;
#pragma GCC unroll 4
      for (int v = 0; v < vecs; v++) acc[h][v] += ph * w[v];
    }
  }
}

#define MIX_CASE(n)                                                       \
  case n:                                                                 \
    if (n <= SPAN) mix(ph, length, hs, z_v, ldz, row, count, start, acc, n); \
    break;

/* out [batch][heads][r_v] = probs [batch][heads][length] . z_v of each sequence's first
 * lengths[b] (at most length) tokens, token l of sequence b at cache row
 * slots[b * length + l] of z [rows][ldz], its z_v at columns r_k .. r_k + r_v. One job
 * per sequence and span of SPAN vectors of columns: the accumulators of HEADS heads
 * in registers, each token's span read once per HEADS heads (from L1 or L2 after the
 * first). Where r_v is not a multiple of VEC, the last vector ends at r_v (it overlaps
 * the one before; only its new columns are stored): no partial loads. r_v < VEC: one
 * column at a time. Returns -1 (nothing written) where a slot is not below rows, else 0. */
int latent_values(const float *probs, const float *z, int64_t rows, int64_t ldz,
                  const int64_t *slots, int64_t batch, int64_t length,
                  const int64_t *lengths, int64_t r_k, int64_t r_v, int64_t heads,
                  float *out) {
  if (!slots_in_range(slots, batch, length, lengths, rows)) return -1;
  const int64_t span = SPAN * VEC, spans = (r_v + span - 1) / span;
  const float *z_v = z + r_k;
#pragma omp parallel for schedule(static)
  for (int64_t job = 0; job < batch * spans; job++) {
    int64_t b = job / spans, c0 = (job % spans) * span;
    int64_t count = lengths[b] < length ? lengths[b] : length;
    int64_t cols = r_v - c0 < span ? r_v - c0 : span;
    const int64_t *row = slots + b * length;
    float *o = out + b * heads * r_v;
    if (r_v < VEC) {
      for (int64_t h = 0; h < heads; h++)
        for (int64_t c = 0; c < r_v; c++) {
          float sum = 0;
          for (int64_t t = 0; t < count; t++)
            sum += probs[(b * heads + h) * length + t] * z_v[row[t] * ldz + c];
          o[h * r_v + c] = sum;
        }
      continue;
    }
    int vecs = (int)((cols + VEC - 1) / VEC);
    int64_t start[SPAN];
    for (int v = 0; v < vecs; v++) {
      start[v] = c0 + v * VEC;
      if (start[v] + VEC > r_v) start[v] = r_v - VEC; /* the last, overlapping */
    }
    for (int64_t h0 = 0; h0 < heads; h0 += HEADS) {
      int hs = heads - h0 < HEADS ? (int)(heads - h0) : HEADS;
      const float *ph = probs + (b * heads + h0) * length;
      vec_t acc[HEADS][SPAN];
      for (int h = 0; h < HEADS; h++)
        for (int v = 0; v < SPAN; v++) acc[h][v] = (vec_t){0};
      switch (vecs) { MIX_CASE(1) MIX_CASE(2) MIX_CASE(3) MIX_CASE(4) }
      for (int h = 0; h < hs; h++) {
        float *oh = o + (h0 + h) * r_v, lanes[VEC];
        for (int v = 0; v < vecs; v++) { /* columns from c0 + v * VEC on (new ones only) */
          int64_t first = c0 + v * VEC, skip = first - start[v];
          memcpy(lanes, &acc[h][v], sizeof lanes);
          memcpy(oh + first, lanes + skip, (size_t)(VEC - skip) * sizeof(float));
        }
      }
    }
  }
  return 0;
}

/* o[u][i0 .. + vecs * VEC) = bias + p[u] . u_v[:, i0 ..] for units u < units_here of
 * one KV head (p's rows r_v apart, o's d apart; u_v [r_v][d] that head's): the
 * accumulators of UNITS heads in registers, each U_v row's vectors loaded once for
 * them (a loop per head read o and wrote it back at every FMA) */
static inline __attribute__((always_inline)) void up_v(
    const float *p, int64_t r_v, int units_here, const float *u_v, int64_t d, int64_t i0,
    const float *bias, float *o, const int vecs) {
  vec_t acc[UNITS][SPAN];
#pragma GCC unroll 4
  for (int u = 0; u < UNITS; u++)
#pragma GCC unroll 4
    for (int v = 0; v < vecs; v++) acc[u][v] = bias ? load(bias + i0 + v * VEC) : (vec_t){0};
  for (int64_t c = 0; c < r_v; c++) {
    vec_t w[SPAN];
#pragma GCC unroll 4
    for (int v = 0; v < vecs; v++) w[v] = load(u_v + c * d + i0 + v * VEC);
#pragma GCC unroll 4
    for (int u = 0; u < UNITS; u++) {
      float pu = u < units_here ? p[u * r_v + c] : 0.0f;
#pragma GCC unroll 4
      for (int v = 0; v < vecs; v++) acc[u][v] += pu * w[v];
    }
  }
  for (int u = 0; u < units_here; u++)
#pragma GCC unroll 4
    for (int v = 0; v < vecs; v++) store(o + u * d + i0 + v * VEC, acc[u][v]);
}

#define UP_CASE(n)                                                                   \
  case n:                                                                            \
    if (n <= SPAN) up_v(p, r_v, units_here, u_v + g * r_v * d, d, i0, bias, o, n); \
    break;

/* A latent layer's decode attention in one call (the torch form: eager_attention's
 * decode_latent, with the cache write before it). Row b's new latent (r_k + r_v floats
 * at new_rows + b * ld_new) is written to cache row new_slots[b]; each query head of q
 * [batch][heads][d] (RoPE applied) is laid out as the keys are (key column j: dim
 * key_dims[j] of KV head key_heads[j]; the other KV heads' columns zero), scaled, and
 * scored (latent_scores); softmax over each sequence's tokens; probabilities . z_v
 * (latent_values); each head's result times its KV head's U_v (u_v [kv_heads][r_v][d]),
 * plus bias_v [kv_heads * d] (NULL: none) -> out [batch][heads][d]. Every step that torch
 * took as its own op (a gather of the query columns, a mask, a pad, the softmax, a
 * batched product per KV head) reads and writes this call's scratch instead.
 * Returns -1 (nothing written) where a slot is not below rows, -2 without scratch
 * memory (the new latents may be written), else 0. */
int latent_attention(const float *q, int64_t heads, int64_t d, float scale,
                     const int64_t *key_dims, const int64_t *key_heads, int64_t width,
                     float *z, int64_t rows, int64_t ldz, const float *new_rows,
                     int64_t ld_new, const int64_t *new_slots, const int64_t *slots,
                     int64_t batch, int64_t length, const int64_t *lengths, int64_t r_k,
                     int64_t r_v, int64_t copy_from, int64_t copies, const float *u,
                     int64_t upad, const float *cos, const float *sin, int64_t wpad,
                     int64_t kv_heads, const float *u_v, const float *bias_v, float *out) {
  for (int64_t b = 0; b < batch; b++)
    if (new_slots[b] < 0 || new_slots[b] >= rows) return -1;
  if (!slots_in_range(slots, batch, length, lengths, rows)) return -1;
  int64_t units = batch * heads, group = heads / kv_heads;
  float *queries = malloc(sizeof(float) * (size_t)(units * (wpad + length + r_v)));
  if (!queries) return -2;
  float *scores = queries + units * wpad, *mixed = scores + units * length;
#pragma omp parallel for schedule(static)
  for (int64_t unit = 0; unit < units; unit++) {
    int64_t b = unit / heads, g = unit % heads / group;
    if (unit % heads == 0)
      memcpy(z + new_slots[b] * ldz, new_rows + b * ld_new, sizeof(float) * (size_t)(r_k + r_v));
    const float *qh = q + unit * d;
    float *qb = queries + unit * wpad;
    for (int64_t j = 0; j < wpad; j++)
      qb[j] = j < width && key_heads[j] == g ? scale * qh[key_dims[j]] : 0.0f;
  }
  if (latent_scores(z, rows, ldz, slots, batch, length, lengths, r_k, copy_from, copies, u,
                    upad, cos, sin, queries, heads, wpad, scores)) {
    free(queries);
    return -2; /* the slots were checked above: only scratch can have failed */
  }
#pragma omp parallel for schedule(static)
  for (int64_t unit = 0; unit < units; unit++) {
    float *row = scores + unit * length, top = -INFINITY, total = 0;
    int64_t n = lengths[unit / heads] < length ? lengths[unit / heads] : length;
    for (int64_t j = 0; j < n; j++) top = row[j] > top ? row[j] : top;
    total = exp_shifted(row, n, top);
    for (int64_t j = 0; j < n; j++) row[j] /= total;
  }
  latent_values(scores, z, rows, ldz, slots, batch, length, lengths, r_k, r_v, heads, mixed);
#pragma omp parallel for schedule(static)
  for (int64_t job = 0; job < batch * kv_heads; job++) {
    int64_t b = job / kv_heads, g = job % kv_heads, first = b * heads + g * group;
    const float *bias = bias_v ? bias_v + g * d : NULL;
    for (int64_t u0 = 0; u0 < group; u0 += UNITS) {
      int units_here = group - u0 < UNITS ? (int)(group - u0) : UNITS;
      const float *p = mixed + (first + u0) * r_v;
      float *o = out + (first + u0) * d;
      for (int64_t i0 = 0; i0 + VEC <= d; i0 += SPAN * VEC) {
        int64_t left = (d - i0) / VEC;
        int vecs = left < SPAN ? (int)left : SPAN;
        switch (vecs) { UP_CASE(1) UP_CASE(2) UP_CASE(3) UP_CASE(4) }
      }
      for (int u = 0; u < units_here; u++) /* head_dim past whole vectors */
        for (int64_t i = d / VEC * VEC; i < d; i++) {
          float sum = bias ? bias[i] : 0.0f;
          for (int64_t c = 0; c < r_v; c++) sum += p[u * r_v + c] * u_v[(g * r_v + c) * d + i];
          o[u * d + i] = sum;
        }
    }
  }
  free(queries);
  return 0;
}
