/* A latent decode step's values (included by latent_scores.c, which defines the
 * register tiles HEADS, SPAN and UNITS): the probabilities times the cached z_v of each
 * KV head's query heads, over the z_v columns its U_v rows reach, and those times U_v.
 * The softmax . z_v . U_v order never rebuilds a value: softmax(q.K^T) . (z_v . U_v) =
 * (softmax(q.K^T) . z_v) . U_v. */
#ifndef DEINFER_LATENT_VALUES_H
#define DEINFER_LATENT_VALUES_H
#include <stdint.h>
#include <string.h>

#include "vec.h"

/* Tokens ahead whose z_v lines mix prefetches: a cache block's rows (16 at the spec's
 * default block_size) lie one after another (the hardware's prefetcher follows them),
 * the next block anywhere; 16 on is, at that default, the next block's row. 30 layers' latent_attention with it took 0.88-0.97x the
 * time without it at 40 % (8 ahead, four runs) and 0.91-0.97x at full rank, where no
 * key is rebuilt (16 ahead, four runs; cpu-135m's shapes, batch 8, context 256, blocks
 * in random order, two threads, AMD EPYC VM, Zen 3, AVX2; builds' calls alternated,
 * medians of 30 passes; 4, 8 and 16 ahead within each other's noise). */
#ifndef MIX_AHEAD
#define MIX_AHEAD 16
#endif

/* acc[h][v] += p[h][t] . z_v[t][start[v] .. + VEC) over tokens t < n (token t at cache
 * row row[t] of z_v, the rows' z_v columns; p's rows length apart; heads h < hs) */
static inline __attribute__((always_inline)) void mix(
    const float *p, int64_t length, int hs, const float *z_v, int64_t ldz, const int64_t *row,
    int64_t n, const int64_t *start, vec_t acc[HEADS][SPAN], const int vecs) {
  for (int64_t t = 0; t < n; t++) {
    const float *zt = z_v + row[t] * ldz;
    if (t + MIX_AHEAD < n) { /* the first and last of this span's lines, MIX_AHEAD rows on */
      const float *next = z_v + row[t + MIX_AHEAD] * ldz;
      __builtin_prefetch(next + start[0]);
      __builtin_prefetch(next + start[vecs - 1] + VEC - 1);
    }
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

#define MIX_CASE(n)                                                      \
  case n:                                                                \
    if (n <= SPAN) mix(ph, length, here, z_v, ldz, row, tokens, start, acc, n); \
    break;

/* out[b][h][first .. first + count) = probs[b][h] . those columns of z_v over token
 * rows row[t] (t < tokens; row[t]'s z_v at z_v + row[t] * ldz), for the query heads h0 ..
 * h0 + hs of one KV head, whose U_v rows outside [first, first + count) are zero, and
 * columns [lo, hi) of that range (one job's span): HEADS heads' accumulators in
 * registers, each token's span read once per HEADS heads (from L1 or L2 after the
 * first). Where the range is not a multiple of VEC, its last vector ends at the range's
 * end (it overlaps the one before; only its new columns are stored): no partial loads;
 * a range of fewer than VEC columns, one column at a time. */
static void mix_range(const float *probs, int64_t length, int64_t h0, int64_t hs,
                      const float *z_v, int64_t ldz, const int64_t *row, int64_t tokens,
                      int64_t first, int64_t count, int64_t lo, int64_t hi, int64_t r_v,
                      float *out) {
  if (count < VEC) {
    for (int64_t h = h0; h < h0 + hs; h++)
      for (int64_t c = lo; c < hi; c++) {
        float sum = 0;
        for (int64_t t = 0; t < tokens; t++) sum += probs[h * length + t] * z_v[row[t] * ldz + c];
        out[h * r_v + c] = sum;
      }
    return;
  }
  int vecs = (int)((hi - lo + VEC - 1) / VEC);
  int64_t start[SPAN];
  for (int v = 0; v < vecs; v++) {
    start[v] = lo + v * VEC;
    if (start[v] + VEC > first + count) start[v] = first + count - VEC; /* the last */
  }
  for (int64_t g0 = h0; g0 < h0 + hs; g0 += HEADS) {
    int here = h0 + hs - g0 < HEADS ? (int)(h0 + hs - g0) : HEADS;
    const float *ph = probs + g0 * length;
    vec_t acc[HEADS][SPAN];
    for (int h = 0; h < HEADS; h++)
      for (int v = 0; v < SPAN; v++) acc[h][v] = (vec_t){0};
    switch (vecs) { MIX_CASE(1) MIX_CASE(2) MIX_CASE(3) MIX_CASE(4) }
    for (int h = 0; h < here; h++) {
      float *oh = out + (g0 + h) * r_v, lanes[VEC];
      for (int v = 0; v < vecs; v++) { /* columns from lo + v * VEC on (new ones only) */
        int64_t col = lo + v * VEC, skip = col - start[v];
        memcpy(lanes, &acc[h][v], sizeof lanes);
        memcpy(oh + col, lanes + skip, (size_t)(VEC - skip) * sizeof(float));
      }
    }
  }
}

/* What mixing one sequence's z_v reads and writes (``latent_values``' arguments). */
typedef struct {
  const float *probs, *z_v;
  int64_t ldz;
  const int64_t *slots;
  int64_t length;
  const int64_t *lengths;
  int64_t r_v, heads;
  const int64_t *value_rows;
  int64_t groups;
  float *out;
} values_t;

/* Sequence b's mixed values in columns c0 .. c0 + SPAN * VEC (see latent_values). */
static void values_span(const values_t *a, int64_t b, int64_t c0) {
  int64_t count = a->lengths[b] < a->length ? a->lengths[b] : a->length;
  int64_t group = a->heads / a->groups, r_v = a->r_v;
  for (int64_t g = 0; g < a->groups; g++) {
    int64_t first = a->value_rows ? a->value_rows[2 * g] : 0;
    int64_t columns = a->value_rows ? a->value_rows[2 * g + 1] : r_v;
    int64_t lo = c0 > first ? c0 : first, end = first + columns;
    int64_t hi = c0 + SPAN * VEC < end ? c0 + SPAN * VEC : end;
    if (lo >= hi) continue;
    mix_range(a->probs + b * a->heads * a->length, a->length, g * group, group, a->z_v,
              a->ldz, a->slots + b * a->length, count, first, columns, lo, hi, r_v,
              a->out + b * a->heads * r_v);
  }
}

/* o[u][i0 .. + vecs * VEC) = bias + p[u][:n] . u_v[:n, i0 ..] for units u < units_here
 * of one KV head (p's rows r_v apart, o's d apart; u_v that head's rows, d apart): the
 * accumulators of UNITS heads in registers, each U_v row's vectors loaded once for
 * them (a loop per head read o and wrote it back at every FMA) */
static inline __attribute__((always_inline)) void up_v(
    const float *p, int64_t r_v, int64_t n, int units_here, const float *u_v, int64_t d,
    int64_t i0, const float *bias, float *o, const int vecs) {
  vec_t acc[UNITS][SPAN];
#pragma GCC unroll 4
  for (int u = 0; u < UNITS; u++)
#pragma GCC unroll 4
    for (int v = 0; v < vecs; v++) acc[u][v] = bias ? load(bias + i0 + v * VEC) : (vec_t){0};
  for (int64_t c = 0; c < n; c++) {
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
    if (n <= SPAN) up_v(p, r_v, count, units_here, u_v_g, d, i0, bias, o, n); \
    break;

/* out's rows of sequence b's query heads of KV head g = bias + their mixed values .
 * the rows value_rows[g] of g's U_v (u_v [kv_heads][r_v][d]; mixed [heads][r_v] per
 * sequence, out [heads][d]) */
static void heads_times_u_v(const float *mixed, int64_t b, int64_t g, int64_t heads,
                            int64_t kv_heads, int64_t r_v, int64_t d, const float *u_v,
                            const int64_t *value_rows, const float *bias_v, float *out) {
  int64_t group = heads / kv_heads, first = b * heads + g * group;
  const float *bias = bias_v ? bias_v + g * d : NULL;
  int64_t from = value_rows[2 * g], count = value_rows[2 * g + 1];
  const float *u_v_g = u_v + (g * r_v + from) * d; /* the rows latent_values mixed */
  for (int64_t u0 = 0; u0 < group; u0 += UNITS) {
    int units_here = group - u0 < UNITS ? (int)(group - u0) : UNITS;
    const float *p = mixed + (first + u0) * r_v + from;
    float *o = out + (first + u0) * d;
    for (int64_t i0 = 0; i0 + VEC <= d; i0 += SPAN * VEC) {
      int64_t left = (d - i0) / VEC;
      int vecs = left < SPAN ? (int)left : SPAN;
      switch (vecs) { UP_CASE(1) UP_CASE(2) UP_CASE(3) UP_CASE(4) }
    }
    for (int u = 0; u < units_here; u++) /* head_dim past whole vectors */
      for (int64_t i = d / VEC * VEC; i < d; i++) {
        float sum = bias ? bias[i] : 0.0f;
        for (int64_t c = 0; c < count; c++) sum += p[u * r_v + c] * u_v_g[c * d + i];
        o[u * d + i] = sum;
      }
  }
}

#endif
