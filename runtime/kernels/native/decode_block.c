/* A decoder layer's decode step on the CPU in two calls, one per half-block, each
 * projection dense or low-rank (runtime/kernels/decode_block.py builds, loads and calls
 * this file):
 *
 *   attention half: x += the previous half's summands; RMSNorm; q|k|v (one product, or
 *                   the latent of the down factors side by side, then each up factor);
 *                   RoPE of q and k; k and v written to their cache slots; each query
 *                   head against its KV head's cached keys and values (GQA), read in
 *                   place; the heads' output times W_o -> out (not yet reduced)
 *   MLP half:       x += the attention half's summands (or a latent-cache layer's heads'
 *                   output times W_o); RMSNorm; gate|up (likewise); silu(gate) * up;
 *                   times W_down -> out (not yet reduced)
 *
 * A low-rank projection's latent stays in this call's scratch between its down and up
 * products (a few KB at decode rows) instead of becoming a tensor between torch calls.
 *
 * Across ranks a low-rank column group's latent is all-gathered between its down and up
 * products, and a low-rank row projection's latent all-reduced before its up product,
 * so there each half is cut at its collectives: decode_norm_project (summands, norm, the
 * group's down factors' shard) -> all-gather -> the half from the gathered latent (no
 * norm; the projection's up factors alone) ending in the row projection's down factor
 * (its output the latent, width r) -> all-reduce -> the up factor: where every rank holds
 * it whole, multiplied at the start of the next half's first call (decode_norm_project's
 * latent and up), else by the caller.
 *
 * Why: at a decode step's few rows the products stream their weights and the work
 * between them is tiny, but as torch ops each of those pieces (norm, split, RoPE, cache
 * write, gather, attention, activation) is a call with its own tensors and dispatch.
 * Measured on the Intel Xeon VM (2 threads, the 135M model, batch 1): the products
 * took 18 of a 28 ms step; the rest was the ops between them. Here each half is one
 * OpenMP parallel region: its products share out their panels (panel_kernel.h) and
 * the pieces between them share out rows, heads and columns, with a barrier between
 * stages. Products are the same panel loop as panel_product.c; the norm, residual sum
 * and RoPE are row_ops.c's (row_kernel.h), so the results are those of the unfused path
 * up to the softmax and the attention's sums (the tests compare within fp32 rounding). */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "panel_kernel.h"
#include "row_kernel.h"

/* x [m][h] += parts (nparts 0: nothing to add); xt [h][m] = RMSNorm(x) . w, transposed
 * for the panel product (through normed [m][h]); rows shared out over the threads. w
 * NULL: x is a gathered latent, transposed as it is (no summands, no norm). */
static void add_norm_transposed(float *x, int64_t m, int64_t h, const float *const *parts,
                                const int64_t *ld_parts, int64_t nparts, const float *w,
                                float eps, float *normed, float *xt) {
#pragma omp for schedule(static)
  for (int64_t r = 0; r < m; r++) {
    float *xr = x + r * h, *row = normed + r * h;
    if (w) {
      if (nparts) add_parts_row(xr, parts, ld_parts, nparts, r, h);
      scale_row(xr, w, row_scale(xr, h, eps), row, h);
    } else {
      row = xr;
    }
    for (int64_t j = 0; j < h; j++) xt[j * m + r] = row[j];
  }
}

/* One projection of a half-block: dense, one matrix (down: its panels, n_down its
 * columns), or latent (down: the down factor, or a column group's down factors side by
 * side, n_down their ranks' sum), whose latent each member's up factor (ups[i], ranks[i]
 * rows of the latent in order, widths[i] output columns in order) then multiplies; down
 * NULL: the input is that latent already (gathered from the ranks), the up factors
 * alone. */
typedef struct {
  const float *down;
  int64_t n_down;
  int64_t members; /* 0: dense */
  const float *const *ups;
  const int64_t *ranks;
  const int64_t *widths;
} projection_t;

static inline int64_t panels_of(int64_t columns) { return (columns + VEC - 1) / VEC; }

/* The scratch a latent projection needs for m rows: its latent and its transpose */
static inline int64_t latent_floats(const projection_t *p, int64_t m) {
  return p->members && p->down ? 2 * m * p->n_down : 0;
}

/* Output columns */
static inline int64_t out_width(const projection_t *p) {
  int64_t width = 0;
  for (int64_t i = 0; i < p->members; i++) width += p->widths[i];
  return p->members ? width : p->n_down;
}

/* c [m][ldc] = a . projection, from at [k][m] (a transposed); z: latent_floats scratch.
 * Called by every thread of the region; the threads' writes to c are done when it
 * returns (it ends with a barrier). */
static void project(const projection_t *p, const float *at, int64_t m, int64_t k, float *z,
                    float *c, int64_t ldc) {
  int64_t first, last;
  const float *zt = at; /* down NULL: the input is the latent */
  if (p->down) {
    thread_share(panels_of(p->n_down), &first, &last);
    float *c_down = p->members ? z : c;
    panel_run(at, m, k, p->down, p->n_down, c_down, p->members ? p->n_down : ldc, first, last);
#pragma omp barrier
    if (!p->members) return;
    float *zt_own = z + m * p->n_down;
#pragma omp for schedule(static)
    for (int64_t j = 0; j < p->n_down; j++)
      for (int64_t r = 0; r < m; r++) zt_own[j * m + r] = z[r * p->n_down + j];
    zt = zt_own;
  }
  int64_t total = 0;
  for (int64_t i = 0; i < p->members; i++) total += panels_of(p->widths[i]);
  thread_share(total, &first, &last);
  int64_t base = 0, row = 0, col = 0;
  for (int64_t i = 0; i < p->members; i++) {
    int64_t count = panels_of(p->widths[i]);
    int64_t lo = (first > base ? first : base) - base;
    int64_t hi = (last < base + count ? last : base + count) - base;
    if (lo < hi) panel_run(zt + row * m, m, p->ranks[i], p->ups[i], p->widths[i], c + col, ldc, lo, hi);
    base += count;
    row += p->ranks[i];
    col += p->widths[i];
  }
#pragma omp barrier
}

/* A summand of x made in the half's call rather than handed in: latent [m][k] times proj
 * (h output columns) -- a latent-cache layer's heads' output times W_o, or across ranks
 * a row group's reduced latent times its up factor, which every rank holds whole. Its
 * scratch: the latent transposed, the product [m][h], the projection's own latent. */
static inline int64_t summand_floats(const float *latent, int64_t m, int64_t k, int64_t h,
                                     const projection_t *proj) {
  return latent ? k * m + m * h + latent_floats(proj, m) : 0;
}

/* all, ld_all (nparts + 1 slots) = parts, then the product in scratch (latent not NULL);
 * returns their count */
static int64_t with_summand(const float *const *parts, const int64_t *ld_parts,
                            int64_t nparts, const float *latent, int64_t k, int64_t m,
                            int64_t h, float *scratch, const float **all, int64_t *ld_all) {
  for (int64_t i = 0; i < nparts; i++) all[i] = parts[i], ld_all[i] = ld_parts[i];
  if (!latent) return nparts;
  all[nparts] = scratch + k * m, ld_all[nparts] = h;
  return nparts + 1;
}

/* The product of with_summand, into its scratch; called by every thread of the region */
static void make_summand(const float *latent, int64_t m, int64_t k, int64_t h,
                         const projection_t *proj, float *scratch) {
  float *latent_t = scratch, *projected = scratch + k * m, *z = projected + m * h;
#pragma omp for schedule(static)
  for (int64_t j = 0; j < k; j++)
    for (int64_t r = 0; r < m; r++) latent_t[j * m + r] = latent[r * k + j];
  project(proj, latent_t, m, k, z, projected, h);
}

/* Tokens ahead of the one being read whose cached key or value row is prefetched, every
 * cache line of it: one KV head's rows are kv_heads * d floats apart (4 KB for cpu-demo)
 * and scattered over blocks, so the hardware's stream prefetch does not find them, and
 * the reads wait on memory one by one. */
#ifndef TOKENS_AHEAD
#define TOKENS_AHEAD 4
#endif

static inline void prefetch_row(const float *row, int64_t d) {
  for (int64_t i = 0; i < d; i += 64 / sizeof(float)) __builtin_prefetch(row + i);
}

/* One query head of row r against its sequence's cached tokens: softmax(scale . q . k_j)
 * . v_j over j < length, into outt's column r (transposed [heads * d][m]). */
static void attend_head(const float *q, const float *k_rows, const float *v_rows,
                        const int64_t *slots, int64_t length, int64_t ld_slot, float scale,
                        int64_t d, float *scores, float *acc, float *outt, int64_t m) {
  float top = -INFINITY;
  for (int64_t j = 0; j < length; j++) {
    if (j + TOKENS_AHEAD < length) prefetch_row(k_rows + slots[j + TOKENS_AHEAD] * ld_slot, d);
    const float *kj = k_rows + slots[j] * ld_slot;
    vec_t sum = {0};
    int64_t i = 0;
    for (; i + VEC <= d; i += VEC) sum += load(q + i) * load(kj + i);
    float s = 0;
    for (int l = 0; l < VEC; l++) s += sum[l];
    for (; i < d; i++) s += q[i] * kj[i];
    scores[j] = s * scale;
    top = scores[j] > top ? scores[j] : top;
  }
  float total = exp_shifted(scores, length, top);
  for (int64_t i = 0; i < d; i++) acc[i] = 0;
  for (int64_t j = 0; j < length; j++) {
    if (j + TOKENS_AHEAD < length) prefetch_row(v_rows + slots[j + TOKENS_AHEAD] * ld_slot, d);
    float p = scores[j];
    const float *vj = v_rows + slots[j] * ld_slot;
    int64_t i = 0;
    for (; i + VEC <= d; i += VEC) store(acc + i, load(acc + i) + p * load(vj + i));
    for (; i < d; i++) acc[i] += p * vj[i];
  }
  for (int64_t i = 0; i < d; i++) outt[i * m] = acc[i] / total;
}

/* The attention half; see the top of the file. x [m][h] (updated in place), parts: the
 * previous half's summands. qkv_proj: q|k|v (a projection_t), columns heads * d, then
 * kv_heads * d twice. cos, sin [m][d]: each row's RoPE tables (sin
 * signed), half as in rope_vector. k_rows, v_rows: the layer's cache, one row of
 * [kv_heads][d] per slot; row r's new k and v go to slot new_slots[r], and it attends
 * to slots[r * ld_slots + j], j < lengths[r] (its new token among them). out [m][o_proj's
 * columns]: the heads' output times W_o (o_proj; across ranks its down factor's shard,
 * or its Megatron row shard). norm_w NULL: x [m][h] is q|k|v's gathered latent and
 * qkv_proj its up factors. Returns 0, or -1 without scratch memory. */
int decode_attention(float *x, int64_t m, int64_t h, const float *const *parts,
                     const int64_t *ld_parts, int64_t nparts, const float *norm_w, float eps,
                     const projection_t *qkv_proj, int64_t heads, int64_t kv_heads, int64_t d,
                     const float *cos, const float *sin, int64_t half, float *k_rows,
                     float *v_rows, const int64_t *new_slots, const int64_t *slots,
                     int64_t ld_slots, const int64_t *lengths, float scale,
                     const projection_t *o_proj, float *out) {
  int64_t nq = (heads + 2 * kv_heads) * d, width = heads * d, longest = 0;
  for (int64_t r = 0; r < m; r++) longest = lengths[r] > longest ? lengths[r] : longest;
  int64_t latent = latent_floats(qkv_proj, m) > latent_floats(o_proj, m)
                       ? latent_floats(qkv_proj, m)
                       : latent_floats(o_proj, m);
  float *xt = malloc(sizeof(float) * (size_t)(2 * h * m + m * nq + width * m + latent));
  if (!xt) return -1;
  float *normed = xt + h * m, *qkv = normed + h * m, *attn_t = qkv + m * nq;
  float *z = attn_t + width * m;
  int failed = 0;
#pragma omp parallel
  {
    /* per thread: one head's scores, rotated query and sums */
    float *own = malloc(sizeof(float) * (size_t)(longest + 2 * d));
    if (!own) {
#pragma omp atomic write
      failed = 1;
    }
#pragma omp barrier
    if (!failed) {
      add_norm_transposed(x, m, h, parts, ld_parts, nparts, norm_w, eps, normed, xt);
      project(qkv_proj, xt, m, h, z, qkv, nq);
      int64_t group = heads / kv_heads, ld_slot = kv_heads * d;
#pragma omp for schedule(static)
      for (int64_t unit = 0; unit < m * kv_heads; unit++) {
        int64_t r = unit / kv_heads, g = unit % kv_heads;
        const float *row = qkv + r * nq, *c = cos + r * d, *s = sin + r * d;
        float *k_new = k_rows + new_slots[r] * ld_slot + g * d;
        rope_vector(row + width + g * d, c, s, k_new, d, half);
        memcpy(v_rows + new_slots[r] * ld_slot + g * d, row + width + kv_heads * d + g * d,
               sizeof(float) * (size_t)d);
        float *q = own + longest, *acc = q + d;
        for (int64_t head = g * group; head < (g + 1) * group; head++) {
          rope_vector(row + head * d, c, s, q, d, half);
          attend_head(q, k_rows + g * d, v_rows + g * d, slots + r * ld_slots, lengths[r],
                      ld_slot, scale, d, own, acc, attn_t + head * d * m + r, m);
        }
      }
      project(o_proj, attn_t, m, width, z, out, out_width(o_proj));
    }
    free(own);
  }
  free(xt);
  return failed ? -1 : 0;
}

/* The MLP half: x [m][h] += parts (and, heads_out not NULL, += heads_out [m][k] times
 * o_proj: a latent-cache layer's attention output projected here rather than in a call
 * of its own); RMSNorm . norm_w; gate|up = one product by gate_up_proj (columns: inter
 * of gate, then inter of up); silu(gate) . up; out [m][down columns] = that times W_down
 * (down_proj). norm_w NULL: x is gate|up's gathered latent, as in decode_attention (no
 * heads_out). Returns 0, or -1 without scratch memory. */
int decode_mlp(float *x, int64_t m, int64_t h, const float *const *parts,
               const int64_t *ld_parts, int64_t nparts, const float *norm_w, float eps,
               const float *heads_out, int64_t k, const projection_t *o_proj,
               const projection_t *gate_up_proj, int64_t inter, const projection_t *down_proj,
               float *out) {
  int64_t latent = latent_floats(gate_up_proj, m) > latent_floats(down_proj, m)
                       ? latent_floats(gate_up_proj, m)
                       : latent_floats(down_proj, m);
  int64_t extra = summand_floats(heads_out, m, k, h, o_proj);
  float *xt = malloc(sizeof(float) * (size_t)(2 * h * m + m * 2 * inter + inter * m + latent + extra));
  const float **all = malloc(sizeof(float *) * (size_t)(nparts + 1));
  int64_t *ld_all = malloc(sizeof(int64_t) * (size_t)(nparts + 1));
  if (!xt || !all || !ld_all) {
    free(xt), free(all), free(ld_all);
    return -1;
  }
  float *normed = xt + h * m, *gate_up = normed + h * m, *hidden_t = gate_up + m * 2 * inter;
  float *z = hidden_t + inter * m, *summand = z + latent;
  int64_t n_all = with_summand(parts, ld_parts, nparts, heads_out, k, m, h, summand, all, ld_all);
#pragma omp parallel
  {
    if (heads_out) make_summand(heads_out, m, k, h, o_proj, summand);
    add_norm_transposed(x, m, h, all, ld_all, n_all, norm_w, eps, normed, xt);
    project(gate_up_proj, xt, m, h, z, gate_up, 2 * inter);
    /* silu(gate) . up, VEC columns at a time, then the last ones one at a time */
    int64_t vectors = inter / VEC;
#pragma omp for schedule(static)
    for (int64_t c = 0; c <= vectors; c++) {
      for (int64_t r = 0; r < m; r++) {
        const float *g = gate_up + r * 2 * inter, *u = g + inter;
        if (c < vectors) {
          int64_t j = c * VEC;
          vec_t hidden = load(g + j) / (1.0f + vexp(-load(g + j))) * load(u + j);
          for (int i = 0; i < VEC; i++) hidden_t[(j + i) * m + r] = hidden[i];
          continue;
        }
        for (int64_t j = vectors * VEC; j < inter; j++)
          hidden_t[j * m + r] = g[j] / (1.0f + exp1(-g[j])) * u[j];
      }
    }
    project(down_proj, hidden_t, m, inter, z, out, out_width(down_proj));
  }
  free(xt), free(all), free(ld_all);
  return 0;
}

/* x [m][h] += parts (and, latent not NULL, += latent [m][k] times up: with_summand); the
 * normed x (RMSNorm . norm_w) times proj -> out [m][its columns], and times then (NULL:
 * none; dense: it takes no scratch) -> then_out; keep (NULL: not kept): proj's latent
 * [m][its down factors' columns]. One parallel region; returns 0, or -1 without scratch
 * memory. */
static int norm_and_project(float *x, int64_t m, int64_t h, const float *const *parts,
                            const int64_t *ld_parts, int64_t nparts, const float *norm_w,
                            float eps, const float *latent, int64_t k, const projection_t *up,
                            const projection_t *proj, float *out, const projection_t *then,
                            float *then_out, float *keep) {
  int64_t extra = summand_floats(latent, m, k, h, up);
  float *xt = malloc(sizeof(float) * (size_t)(2 * h * m + latent_floats(proj, m) + extra));
  const float **all = malloc(sizeof(float *) * (size_t)(nparts + 1));
  int64_t *ld_all = malloc(sizeof(int64_t) * (size_t)(nparts + 1));
  if (!xt || !all || !ld_all) {
    free(xt), free(all), free(ld_all);
    return -1;
  }
  float *normed = xt + h * m, *z = normed + h * m, *summand = z + latent_floats(proj, m);
  int64_t n_all = with_summand(parts, ld_parts, nparts, latent, k, m, h, summand, all, ld_all);
#pragma omp parallel
  {
    if (latent) make_summand(latent, m, k, h, up, summand);
    add_norm_transposed(x, m, h, all, ld_all, n_all, norm_w, eps, normed, xt);
    project(proj, xt, m, h, z, out, out_width(proj));
    if (then) project(then, xt, m, h, NULL, then_out, out_width(then));
  }
  if (keep) memcpy(keep, z, sizeof(float) * (size_t)(m * proj->n_down));
  free(xt), free(all), free(ld_all);
  return 0;
}

/* Across ranks, the first piece of a half whose column group is low-rank: x [m][h] +=
 * parts, and (latent not NULL) += latent [m][k] times up -- the previous row group's
 * reduced latent times its up factor, which every rank holds: that product in this call
 * rather than in one of its own with its Python around it; out [m][proj's columns] =
 * RMSNorm(x) . norm_w times proj (the group's down factors' shard), the latent the ranks
 * then all-gather. Returns 0, or -1 without scratch memory. */
int decode_norm_project(float *x, int64_t m, int64_t h, const float *const *parts,
                        const int64_t *ld_parts, int64_t nparts, const float *norm_w,
                        float eps, const float *latent, int64_t k, const projection_t *up,
                        const projection_t *proj, float *out) {
  return norm_and_project(x, m, h, parts, ld_parts, nparts, norm_w, eps, latent, k, up, proj,
                          out, NULL, NULL, NULL);
}

/* A latent-cache layer's q beside its k|v latent, from one norm: out [m][q's columns],
 * latent [m][kv_proj's down columns], both from RMSNorm(x) . norm_w. q_proj (q's merged
 * matrix) times it -> out, and kv_proj (k's and v's down factors side by side, dense)
 * -> latent; or, q_proj NULL, kv_proj is the group's down factors with q's latent first
 * and q's up factor as its one member: its latent -> latent, q -> out. Then each head of
 * q (d columns) rotated by its row's tables cos, sin [m][d] (sin signed, half as in
 * rope_vector; cos NULL: q as projected), in this call rather than as a call of its own
 * with its Python around it. Returns 0, or -1 without scratch memory. */
int decode_q_and_latent(float *x, int64_t m, int64_t h, const float *const *parts,
                        const int64_t *ld_parts, int64_t nparts, const float *norm_w,
                        float eps, const projection_t *q_proj, const projection_t *kv_proj,
                        const float *cos, const float *sin, int64_t d, int64_t half,
                        float *latent, float *out) {
  int failed =
      q_proj ? norm_and_project(x, m, h, parts, ld_parts, nparts, norm_w, eps, NULL, 0, NULL,
                                q_proj, out, kv_proj, latent, NULL)
             : norm_and_project(x, m, h, parts, ld_parts, nparts, norm_w, eps, NULL, 0, NULL,
                                kv_proj, out, NULL, NULL, latent);
  if (failed || !cos) return failed;
  int64_t width = out_width(q_proj ? q_proj : kv_proj), heads = width / d;
  float *turned = malloc(sizeof(float) * (size_t)d);
  if (!turned) return -1;
  for (int64_t r = 0; r < m; r++) /* m x heads vectors of d: a few thousand floats */
    for (int64_t head = 0; head < heads; head++) {
      float *q = out + r * width + head * d;
      rope_vector(q, cos + r * d, sin + r * d, turned, d, half);
      memcpy(q, turned, sizeof(float) * (size_t)d);
    }
  free(turned);
  return 0;
}

/* latent_scores.c's latent_attention, which a latent-cache layer's attention half calls
 * by address once its q and latent are made (the two files build as libraries of their
 * own; layer and step are that file's descriptors). */
typedef int (*latent_attention_fn)(const void *layer, const void *step, const float *q,
                                   int64_t heads, int64_t d, float scale, float *z,
                                   int64_t rows, int64_t ldz, const float *new_rows,
                                   int64_t ld_new, const float *cos, const float *sin,
                                   float *out);

/* A latent-cache layer's attention half in one call, up to W_o: decode_q_and_latent
 * (x += parts, RMSNorm, q beside the latent, q rotated by cos, sin), then attend with q
 * and the latent's columns kv_first .. as the new latents (attend's layer and step, the
 * cache z [rows][ldz], the keys' tables key_cos, key_sin, scale) -> out [m][q's
 * columns], the heads' output (W_o is the MLP half's call). The q and latent never leave
 * this call's scratch, and no Python runs between the two: against the two calls with
 * their Python between them, a latent decode step of cpu-135m at 40 % took 0.96-0.99x
 * the time (one engine, batch 8, context 240-268, two threads, steps alternated, medians
 * of 14 pairs, three runs; AMD EPYC VM, Zen 3). Returns 0, -1 without scratch memory, -2
 * where a slot is not a row of the cache. */
int decode_latent_attention(float *x, int64_t m, int64_t h, const float *const *parts,
                            const int64_t *ld_parts, int64_t nparts, const float *norm_w,
                            float eps, const projection_t *q_proj, const projection_t *kv_proj,
                            const float *cos, const float *sin, int64_t d, int64_t half,
                            latent_attention_fn attend, const void *layer, const void *step,
                            float *z, int64_t rows, int64_t ldz, int64_t kv_first,
                            const float *key_cos, const float *key_sin, float scale,
                            float *out) {
  int64_t width = out_width(q_proj ? q_proj : kv_proj), columns = kv_proj->n_down;
  float *q = malloc(sizeof(float) * (size_t)(m * (width + columns)));
  if (!q) return -1;
  float *latent = q + m * width;
  int failed = decode_q_and_latent(x, m, h, parts, ld_parts, nparts, norm_w, eps, q_proj,
                                   kv_proj, cos, sin, d, half, latent, q);
  if (!failed) {
    failed = attend(layer, step, q, width / d, d, scale, z, rows, ldz, latent + kv_first,
                    columns, key_cos, key_sin, out);
    failed = failed == -1 ? -2 : failed ? -1 : 0;
  }
  free(q);
  return failed;
}

/* A decode step's attention over a dense cache alone, for layers that make their own
 * projections around it: row r's k and v ([kv_heads][d] at k + r * ldk, v + r * ldv,
 * RoPE already applied to k) written to slot new_slots[r], then each query head of q
 * (q + r * ldq, rotated) against its KV head's cached rows, as in decode_attention;
 * out [m][heads * d]. Returns 0, or -1 without scratch memory. */
int decode_cached_attention(const float *q, int64_t ldq, const float *k, int64_t ldk,
                            const float *v, int64_t ldv, int64_t m, int64_t heads,
                            int64_t kv_heads, int64_t d, float *k_rows, float *v_rows,
                            const int64_t *new_slots, const int64_t *slots, int64_t ld_slots,
                            const int64_t *lengths, float scale, float *out) {
  int64_t longest = 0, group = heads / kv_heads, ld_slot = kv_heads * d;
  for (int64_t r = 0; r < m; r++) longest = lengths[r] > longest ? lengths[r] : longest;
  int failed = 0;
#pragma omp parallel if (m * kv_heads > 1)
  {
    float *own = malloc(sizeof(float) * (size_t)(longest + d));
    if (!own) {
#pragma omp atomic write
      failed = 1;
    }
#pragma omp barrier
    if (!failed) {
#pragma omp for schedule(static)
      for (int64_t unit = 0; unit < m * kv_heads; unit++) {
        int64_t r = unit / kv_heads, g = unit % kv_heads, slot = new_slots[r] * ld_slot + g * d;
        memcpy(k_rows + slot, k + r * ldk + g * d, sizeof(float) * (size_t)d);
        memcpy(v_rows + slot, v + r * ldv + g * d, sizeof(float) * (size_t)d);
        for (int64_t head = g * group; head < (g + 1) * group; head++)
          attend_head(q + r * ldq + head * d, k_rows + g * d, v_rows + g * d,
                      slots + r * ld_slots, lengths[r], ld_slot, scale, d, own, own + longest,
                      out + r * heads * d + head * d, 1);
      }
    }
    free(own);
  }
  return failed ? -1 : 0;
}

/* One layer of decode_layers: its attention half over a dense cache (k_rows not NULL:
 * decode_attention's projections and cache rows) or a latent one (k_rows NULL:
 * decode_latent_attention's, W_o then in the MLP half's call, as its heads_out), then its
 * MLP half; each projection whole on this one rank. */
typedef struct {
  const float *input_norm;
  const projection_t *qkv; /* dense cache */
  float *k_rows;
  float *v_rows;
  const projection_t *o;       /* either cache */
  const projection_t *q;       /* latent cache: decode_latent_attention's q_proj */
  const projection_t *kv;      /* its kv_proj */
  int64_t kv_first;            /* the new latents' first column */
  const void *scores;          /* latent_scores.c's layer descriptor */
  float *z;                    /* the cache rows [rows][ldz] */
  int64_t rows;
  int64_t ldz;
  const float *key_cos;        /* the keys' RoPE tables */
  const float *key_sin;
  const float *post_norm;
  const projection_t *gate_up;
  int64_t inter;
  const projection_t *down;
} layer_t;

/* The heads' output's columns of a latent-cache layer (h for a dense one: W_o's output) */
static int64_t heads_width(const layer_t *l, int64_t h) {
  return l->k_rows ? h : out_width(l->q ? l->q : l->kv);
}

/* A decode step's layers on one rank, one after the other in this call: each layer's
 * attention half and MLP half, each half's output the next half's summand, the last
 * layer's MLP output -> out [m][h] (not added to x: the caller's final norm adds it).
 * The arguments after layers are the halves', the same for every layer (one step's
 * tokens): decode_attention's for dense caches, decode_latent_attention's (attend, step)
 * for latent ones. Why one call: between the halves' calls Python ran cold (each half
 * streams MBs of weights through the caches): 90 us a layer on the AMD EPYC VM with one
 * thread, 2.6 ms of a 45 ms batch-1 step of cpu-135m. Returns 0, -1 without scratch
 * memory, -2 where a latent cache's slot is not one of its rows. */
int decode_layers(float *x, int64_t m, int64_t h, float eps, const layer_t *layers,
                  int64_t n_layers, int64_t heads, int64_t kv_heads, int64_t d,
                  const float *cos, const float *sin, int64_t half, const int64_t *new_slots,
                  const int64_t *slots, int64_t ld_slots, const int64_t *lengths,
                  latent_attention_fn attend, const void *step, float scale, float *out) {
  int64_t widest = h;
  for (int64_t i = 0; i < n_layers; i++)
    widest = heads_width(layers + i, h) > widest ? heads_width(layers + i, h) : widest;
  float *heads_out = malloc(sizeof(float) * (size_t)(m * (widest + h))), *mlp_out = heads_out + m * widest;
  if (!heads_out) return -1;
  const float *previous[1] = {mlp_out}, *attention[1] = {heads_out};
  const int64_t ld[1] = {h};
  int failed = 0;
  for (int64_t i = 0; i < n_layers && !failed; i++) {
    const layer_t *l = layers + i;
    float *down_out = i + 1 == n_layers ? out : mlp_out;
    int64_t nparts = i ? 1 : 0; /* the first layer's x is the embedding alone */
    if (l->k_rows) {
      failed = decode_attention(x, m, h, previous, ld, nparts, l->input_norm, eps, l->qkv,
                                heads, kv_heads, d, cos, sin, half, l->k_rows, l->v_rows,
                                new_slots, slots, ld_slots, lengths, scale, l->o, heads_out);
      failed = failed ? failed
                      : decode_mlp(x, m, h, attention, ld, 1, l->post_norm, eps, NULL, 0, NULL,
                                   l->gate_up, l->inter, l->down, down_out);
    } else {
      failed = decode_latent_attention(x, m, h, previous, ld, nparts, l->input_norm, eps, l->q,
                                       l->kv, cos, sin, d, half, attend, l->scores, step, l->z,
                                       l->rows, l->ldz, l->kv_first, l->key_cos, l->key_sin,
                                       scale, heads_out);
      failed = failed ? failed
                      : decode_mlp(x, m, h, NULL, NULL, 0, l->post_norm, eps, heads_out,
                                   heads_width(l, h), l->o, l->gate_up, l->inter, l->down,
                                   down_out);
    }
  }
  free(heads_out);
  return failed;
}
