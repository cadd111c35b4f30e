/* Decode-sized products on the CPU: c [M, N] = a [M, K] . W [N, K]^T, for the few rows
 * of a decode step (runtime/kernels/panel.py builds, loads and calls this file).
 *
 * W is stored once in panels of VEC output columns, [ceil(N / VEC)][K][VEC], so a
 * panel is one sequential stream. Each of up to ROWS rows keeps one accumulator vector
 * per panel: per k, one weight vector times each row's k-th value (a is transposed
 * first, into at [K][M], so those M values share one cache line).
 *
 * Why not the BLAS: at 16 rows a product reads each weight once and does 32 FLOPs per
 * 4 bytes, so the stream of its weights from memory and its arithmetic take similar
 * times, and oneDNN's and MKL's kernels pay the two one after the other. Prefetching
 * each panel's stream ahead of the arithmetic overlaps them. On an Intel Xeon (AVX-512,
 * two threads; medians of 7 passes over 256 MB of distinct matrices), 576 x 3072 at 16
 * rows: oneDNN with its reordered weight 0.56 ms, this loop without prefetch 0.65, with
 * L1_AHEAD only 0.46, with both 0.42 (1 KB / 8 KB ahead 0.43, 4 KB / 32 KB 0.43); the
 * weights alone stream in ~0.3 ms. The 576 x 49152 LM head at 16 rows: 7.6 -> 6.1 ms. */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "panel_kernel.h"

int panel_width(void) { return VEC; }

int panel_rows(void) { return ROWS; }

/* a transposed into this thread's scratch (kept between calls: a decode step makes
 * hundreds of these products, and one allocation per call page-faults large ones) */
static const float *transposed(const float *a, int64_t lda, int64_t m, int64_t k) {
  static __thread float *scratch = NULL;
  static __thread int64_t capacity = 0;
  if (m * k > capacity) {
    free(scratch);
    scratch = malloc((size_t)(m * k) * sizeof(float));
    capacity = scratch ? m * k : 0;
    if (!scratch) return NULL;
  }
  for (int64_t r = 0; r < m; r++)
    for (int64_t j = 0; j < k; j++) scratch[j * m + r] = a[r * lda + j];
  return scratch;
}

/* a [m][k] (rows lda apart), packed [ceil(nn / VEC)][k][VEC] (zero past column nn), c
 * [m][nn]; the panels are shared out over the OpenMP threads in contiguous runs. Returns
 * 0, or -1 where the scratch could not be allocated (c is then untouched). */
int panel_product(const float *a, int64_t lda, const float *packed, float *c, int64_t m,
                  int64_t k, int64_t nn) {
  const float *at = transposed(a, lda, m, k);
  if (!at) return -1;
  int64_t panels = (nn + VEC - 1) / VEC;
#pragma omp parallel
  {
    int64_t first, last;
    thread_share(panels, &first, &last);
    panel_run(at, m, k, packed, nn, c, nn, first, last);
  }
  return 0;
}
