/* The decode product's inner loop, shared by panel_product.c (one product per call) and
 * decode_block.c (a decode block's products inside one parallel region); why it is
 * shaped so: panel_product.c. */
#ifndef DEINFER_PANEL_KERNEL_H
#define DEINFER_PANEL_KERNEL_H
#include <omp.h>

#include "vec.h"

#if defined(__AVX512F__)
#define ROWS 16 /* 16 accumulators of 32 registers */
#elif defined(__AVX__)
#define ROWS 12 /* 12 accumulators of 16 registers, the rest for weights and broadcasts */
#else
#define ROWS 8
#endif
#define MAX_ROWS 16
#ifndef L1_AHEAD
#define L1_AHEAD 2048 /* bytes ahead of the weight read, into L1 */
#endif
#ifndef L2_AHEAD
#define L2_AHEAD 16384 /* and into L2 */
#endif

static inline void prefetch(const float *p, int64_t ahead_bytes, int locality) {
  /* a hint: it never faults, so it may point past the end of the weights */
  __builtin_prefetch((const void *)((uintptr_t)p + (uintptr_t)ahead_bytes), 0, locality);
}

/* One row (batch-1 decode): c's columns [0, cols) of one panel, w's stream read by
 * CHAINS independent sums of every CHAINS-th k and without software prefetch. One sum
 * waits on the FMA's latency at every k, and at one FMA per 32 bytes the prefetches
 * are as many instructions again; the hardware's stream prefetch follows a panel alone.
 * AMD EPYC (Zen 3, AVX2), the products of cpu-135m's 30 layers (425 MB) at one row,
 * medians of 9, interleaved: 0.94x the time of the rows' loop below with one thread,
 * 0.91x with two (with the prefetches kept 1.05x and 1.04x). Two and three rows this
 * way took 1.03x and 1.17x: they stay in that loop. */
#define CHAINS 4
static inline __attribute__((always_inline)) void single_row(
    const float *at, int64_t lda, const float *w, int64_t k_len, float *c, int64_t cols) {
  vec_t acc[CHAINS] = {0};
  int64_t k = 0;
  for (; k + CHAINS <= k_len; k += CHAINS)
#pragma GCC unroll 4
    for (int j = 0; j < CHAINS; j++) acc[j] += at[(k + j) * lda] * load(w + (k + j) * VEC);
  for (; k < k_len; k++) acc[0] += at[k * lda] * load(w + k * VEC);
  vec_t sum = (acc[0] + acc[1]) + (acc[2] + acc[3]);
  memcpy(c, &sum, (size_t)(cols < VEC ? cols : VEC) * sizeof(float));
}

/* rows (a constant in each caller below) rows of c's columns [0, cols) of one panel */
static inline __attribute__((always_inline)) void panel(
    const float *at, int64_t lda, const float *w, int64_t k_len, float *c, int64_t ldc,
    const int rows, int64_t cols) {
  if (rows == 1) {
    single_row(at, lda, w, k_len, c, cols);
    return;
  }
  vec_t acc[MAX_ROWS];
#pragma GCC unroll 16
  for (int r = 0; r < rows; r++) acc[r] = (vec_t){0};
  for (int64_t k = 0; k < k_len; k++) {
    const float *wk = w + k * VEC;
    prefetch(wk, L1_AHEAD, 3);
    prefetch(wk, L2_AHEAD, 2);
    vec_t wv = load(wk);
    const float *ak = at + k * lda;
#pragma GCC unroll 16
    for (int r = 0; r < rows; r++) acc[r] += ak[r] * wv;
  }
  int64_t n = cols < VEC ? cols : VEC;
#pragma GCC unroll 16
  for (int r = 0; r < rows; r++) memcpy(c + r * ldc, &acc[r], (size_t)n * sizeof(float));
}

#define ROWS_CASE(n)                                                                \
  case n:                                                                           \
    if (n <= ROWS) panel(at + r0, m, wp, k, c + r0 * ldc + p * VEC, ldc, n, nn - p * VEC); \
    break;

/* Panels [first, last) of c [m][nn] (rows ldc apart) = a . W, from at [k][m] (a
 * transposed) and W packed [ceil(nn / VEC)][k][VEC] (zero past column nn).
 *
 * Rows beyond ROWS take more passes over a panel, the rows shared evenly between them:
 * a short last pass has too few accumulators to cover the FMA's latency. AMD EPYC (Zen
 * 3, AVX2: ROWS 12), one thread, cpu-demo's shapes streamed from memory, medians of 7:
 * 16 rows as 8 + 8 took 0.91-0.93x the time of 12 + 4 (65-72 against 61-66 GFLOP/s),
 * 14 rows as 7 + 7 0.87-0.90x of 12 + 2; 20 rows as 10 + 10 0.97-1.01x of 12 + 8. */
static void panel_run(const float *at, int64_t m, int64_t k, const float *packed, int64_t nn,
                      float *c, int64_t ldc, int64_t first, int64_t last) {
  int64_t passes = (m + ROWS - 1) / ROWS;
  for (int64_t p = first; p < last; p++) {
    const float *wp = packed + p * k * VEC;
    for (int64_t i = 0; i < passes; i++) {
      int64_t r0 = m * i / passes;
      switch (m * (i + 1) / passes - r0) {
        ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4)
        ROWS_CASE(5) ROWS_CASE(6) ROWS_CASE(7) ROWS_CASE(8)
        ROWS_CASE(9) ROWS_CASE(10) ROWS_CASE(11) ROWS_CASE(12)
        ROWS_CASE(13) ROWS_CASE(14) ROWS_CASE(15) ROWS_CASE(16)
      }
    }
  }
}

/* Thread t of T's share [first, last) of n units, in contiguous runs */
static inline void thread_share(int64_t n, int64_t *first, int64_t *last) {
  int64_t t = omp_get_thread_num(), threads = omp_get_num_threads();
  *first = n * t / threads;
  *last = n * (t + 1) / threads;
}

#endif
