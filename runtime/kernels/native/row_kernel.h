/* One row's element-wise work, shared by row_ops.c (a pass over rows per call) and
 * decode_block.c (inside a decode block's single parallel region). Each sum is over a
 * row in a fixed order, so every rank and every caller gets the same bits. */
#ifndef DEINFER_ROW_KERNEL_H
#define DEINFER_ROW_KERNEL_H
#include <math.h>

#include "vec.h"

/* 1 / sqrt(mean(x^2) + eps) of one row */
static inline float row_scale(const float *xr, int64_t dim, float eps) {
  vec_t acc = {0};
  int64_t j = 0;
  for (; j + VEC <= dim; j += VEC) {
    vec_t v = load(xr + j);
    acc += v * v;
  }
  float sum = 0;
  for (int i = 0; i < VEC; i++) sum += acc[i];
  for (; j < dim; j++) sum += xr[j] * xr[j];
  return 1.0f / sqrtf(sum / (float)dim + eps);
}

/* o = x * scale * w (w NULL: no weight) */
static inline void scale_row(const float *xr, const float *w, float scale, float *o,
                             int64_t dim) {
  int64_t j = 0;
  for (; j + VEC <= dim; j += VEC) {
    vec_t v = load(xr + j) * scale;
    store(o + j, w ? v * load(w + j) : v);
  }
  for (; j < dim; j++) o[j] = w ? xr[j] * scale * w[j] : xr[j] * scale;
}

/* row r of x += parts[0][r] + parts[1][r] + ... (summed in that order first, the order
 * an all-reduce sums its ranks' tensors); part p's rows ld_parts[p] apart */
static inline void add_parts_row(float *xr, const float *const *parts, const int64_t *ld_parts,
                                 int64_t nparts, int64_t r, int64_t dim) {
  int64_t j = 0;
  for (; j + VEC <= dim; j += VEC) {
    vec_t sum = load(parts[0] + r * ld_parts[0] + j);
    for (int64_t p = 1; p < nparts; p++) sum += load(parts[p] + r * ld_parts[p] + j);
    store(xr + j, load(xr + j) + sum);
  }
  for (; j < dim; j++) {
    float sum = parts[0][r * ld_parts[0] + j];
    for (int64_t p = 1; p < nparts; p++) sum += parts[p][r * ld_parts[p] + j];
    xr[j] += sum;
  }
}

/* o = x . c + swap(x) . s for one head's vector (the tables' row of its position, s
 * signed); swap pairs j with j + half (neox: half = dim / 2) or with j ^ 1 (half = 0) */
static inline void rope_vector(const float *xr, const float *c, const float *s, float *o,
                               int64_t dim, int64_t half) {
  if (half) {
    int64_t j = 0;
    for (; j + VEC <= half; j += VEC) {
      vec_t lo = load(xr + j), hi = load(xr + half + j);
      store(o + j, lo * load(c + j) + hi * load(s + j));
      store(o + half + j, hi * load(c + half + j) + lo * load(s + half + j));
    }
    for (; j < half; j++) {
      float lo = xr[j], hi = xr[half + j];
      o[j] = lo * c[j] + hi * s[j];
      o[half + j] = hi * c[half + j] + lo * s[half + j];
    }
  } else {
    for (int64_t j = 0; j < dim; j++) o[j] = xr[j] * c[j] + xr[j ^ 1] * s[j];
  }
}

#endif
