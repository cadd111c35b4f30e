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

#if defined(__AVX512F__)
#define VEC 16  /* one 512-bit register */
#define ROWS 16 /* 16 accumulators of 32 registers */
#elif defined(__AVX__)
#define VEC 8
#define ROWS 12 /* 12 accumulators of 16 registers, the rest for weights and broadcasts */
#else
#define VEC 4
#define ROWS 8
#endif
#define MAX_ROWS 16
#ifndef L1_AHEAD
#define L1_AHEAD 2048 /* bytes ahead of the weight read, into L1 */
#endif
#ifndef L2_AHEAD
#define L2_AHEAD 16384 /* and into L2 */
#endif

typedef float vec_t __attribute__((vector_size(VEC * sizeof(float)), aligned(sizeof(float))));

int panel_width(void) { return VEC; }

int panel_rows(void) { return ROWS; }

static inline void prefetch(const float *p, int64_t ahead_bytes, int locality) {
  /* a hint: it never faults, so it may point past the end of the weights */
  __builtin_prefetch((const void *)((uintptr_t)p + (uintptr_t)ahead_bytes), 0, locality);
}

/* rows (a constant in each caller below) rows of c's columns [0, cols) of one panel */
static inline __attribute__((always_inline)) void panel(
    const float *at, int64_t lda, const float *w, int64_t k_len, float *c, int64_t ldc,
    const int rows, int64_t cols) {
  vec_t acc[MAX_ROWS];
#pragma GCC unroll 16
  for (int r = 0; r < rows; r++) acc[r] = (vec_t){0};
  for (int64_t k = 0; k < k_len; k++) {
    const float *wk = w + k * VEC;
    prefetch(wk, L1_AHEAD, 3);
    prefetch(wk, L2_AHEAD, 2);
    vec_t wv = *(const vec_t *)wk;
    const float *ak = at + k * lda;
#pragma GCC unroll 16
    for (int r = 0; r < rows; r++) acc[r] += ak[r] * wv;
  }
  int64_t n = cols < VEC ? cols : VEC;
#pragma GCC unroll 16
  for (int r = 0; r < rows; r++) memcpy(c + r * ldc, &acc[r], (size_t)n * sizeof(float));
}

#define ROWS_CASE(n)                                                        \
  case n:                                                                   \
    if (n <= ROWS) panel(at + r0, m, wp, k, c + r0 * nn + p * VEC, nn, n, nn - p * VEC); \
    break;

/* a transposed into this thread's scratch (kept between calls: a decode step makes
 * hundreds of these products, and one allocation per call page-faults large ones) */
static const float *transposed(const float *a, int64_t m, int64_t k) {
  static __thread float *scratch = NULL;
  static __thread int64_t capacity = 0;
  if (m * k > capacity) {
    free(scratch);
    scratch = malloc((size_t)(m * k) * sizeof(float));
    capacity = scratch ? m * k : 0;
    if (!scratch) return NULL;
  }
  for (int64_t r = 0; r < m; r++)
    for (int64_t j = 0; j < k; j++) scratch[j * m + r] = a[r * k + j];
  return scratch;
}

/* a [m][k], packed [ceil(nn / VEC)][k][VEC] (zero past column nn), c [m][nn]; the
 * panels are shared out over the OpenMP threads in contiguous runs. Returns 0, or -1
 * where the scratch could not be allocated (c is then untouched). */
int panel_product(const float *a, const float *packed, float *c, int64_t m, int64_t k,
                  int64_t nn) {
  const float *at = transposed(a, m, k);
  if (!at) return -1;
  int64_t panels = (nn + VEC - 1) / VEC;
#pragma omp parallel
  {
    int64_t t = omp_get_thread_num(), threads = omp_get_num_threads();
    int64_t first = panels * t / threads, last = panels * (t + 1) / threads;
    for (int64_t p = first; p < last; p++) {
      const float *wp = packed + p * k * VEC;
      for (int64_t r0 = 0; r0 < m; r0 += ROWS) {
        switch (m - r0 < ROWS ? m - r0 : ROWS) {
          ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4)
          ROWS_CASE(5) ROWS_CASE(6) ROWS_CASE(7) ROWS_CASE(8)
          ROWS_CASE(9) ROWS_CASE(10) ROWS_CASE(11) ROWS_CASE(12)
          ROWS_CASE(13) ROWS_CASE(14) ROWS_CASE(15) ROWS_CASE(16)
        }
      }
    }
  }
  return 0;
}
