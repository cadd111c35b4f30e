/* The vector type the native kernels compute in: the widest this CPU has (they are
 * built with -march=native), and unaligned loads and stores of it. */
#ifndef DEINFER_VEC_H
#define DEINFER_VEC_H
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define VEC 16 /* one 512-bit register */
#elif defined(__AVX__)
#define VEC 8
#else
#define VEC 4
#endif

typedef float vec_t __attribute__((vector_size(VEC * sizeof(float)), aligned(sizeof(float))));

static inline vec_t load(const float *p) {
  vec_t v;
  memcpy(&v, p, sizeof v);
  return v;
}

static inline void store(float *p, vec_t v) { memcpy(p, &v, sizeof v); }

#endif
