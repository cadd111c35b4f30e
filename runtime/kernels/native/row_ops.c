/* A decode step's per-row element-wise work on the CPU, one pass each
 * (runtime/kernels/row_ops.py builds, loads and calls this file): RMSNorm and RoPE; and
 * exp as the decode kernels' softmaxes and SiLU take it (vec.h's vexp), for its test.
 *
 * Why: in torch an RMSNorm is five ops (pow, mean, add, rsqrt, two products), each a
 * pass over the rows and a new tensor, and RoPE four (roll, two products, add). At a
 * decode step's few rows the work is tiny and the passes' overheads are the cost: on
 * the AMD EPYC VM (Zen 4, one thread), cpu-demo tp 1 at batch 16 spent 3.4 ms of a
 * 144 ms step in its 17 norms ([16, 2048], ~200 us each) and 1.6 ms in 16 rotations.
 * Each sum below is over a row in a fixed order (so every rank gets the same result). */
#include <omp.h>

#include "row_kernel.h"

/* out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w (w NULL: no scale); x's rows ldx apart,
 * out's dim apart */
void rms_norm(const float *x, int64_t ldx, const float *w, float *out, int64_t rows,
              int64_t dim, float eps) {
#pragma omp parallel for schedule(static) if (rows * dim >= 65536)
  for (int64_t r = 0; r < rows; r++) {
    const float *xr = x + r * ldx;
    scale_row(xr, w, row_scale(xr, dim, eps), out + r * dim, dim);
  }
}

/* The residual stream's step between two blocks, in one pass per row: x[r] += parts[0][r]
 * + parts[1][r] + ... (summed in that order, the order an all-reduce sums its ranks'
 * tensors, so every rank gets the same bits), then out[r] = RMSNorm(x[r]) . w (w NULL:
 * no scale). x's rows ldx apart, part p's ld_parts[p] apart, out's dim apart. */
void add_rms_norm(float *x, int64_t ldx, const float *const *parts, const int64_t *ld_parts,
                  int64_t nparts, const float *w, float *out, int64_t rows, int64_t dim,
                  float eps) {
#pragma omp parallel for schedule(static) if (rows * dim >= 65536)
  for (int64_t r = 0; r < rows; r++) {
    float *xr = x + r * ldx;
    add_parts_row(xr, parts, ld_parts, nparts, r, dim);
    if (out) scale_row(xr, w, row_scale(xr, dim, eps), out + r * dim, dim);
  }
}

/* out [tokens][heads][dim] = x . cos + swap(x) . sin, per token t and head h: x's
 * vector at x + t * ld_token + h * ld_head, the tables' row t at cos/sin + t * dim (sin
 * signed); swap pairs j with j + half (neox: half = dim / 2, the two halves swapped) or
 * with j ^ 1 (half = 0: adjacent pairs) */
void rope(const float *x, int64_t ld_token, int64_t ld_head, const float *cos,
          const float *sin, float *out, int64_t tokens, int64_t heads, int64_t dim,
          int64_t half) {
#pragma omp parallel for schedule(static) if (tokens * heads * dim >= 65536)
  for (int64_t row = 0; row < tokens * heads; row++) {
    int64_t t = row / heads, h = row % heads;
    const float *xr = x + t * ld_token + h * ld_head, *c = cos + t * dim, *s = sin + t * dim;
    rope_vector(xr, c, s, out + row * dim, dim, half);
  }
}

/* out[i] = exp(x[i]) for i < n, VEC lanes at a time as the decode kernels compute it
 * (vexp), then the last ones one at a time (exp1) */
void vector_exp(const float *x, float *out, int64_t n) {
  int64_t i = 0;
  for (; i + VEC <= n; i += VEC) store(out + i, vexp(load(x + i)));
  for (; i < n; i++) out[i] = exp1(x[i]);
}
