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

/* A value (a register, or an array of accumulators): naturally aligned. Declared with
 * 4-byte alignment, GCC 12 kept a 2-D array of them (latent_scores.c's TOK x CHUNK
 * accumulators) on the stack instead of in registers where there are 16 (AVX2): each
 * FMA between a load and a store; the latent scores ran 2x slower (AMD EPYC, Zen 3,
 * cpu-135m at 40 %, batch 8, context 256: 0.93 -> 0.46 ms with two threads). Memory
 * is read and written only through load and store below. */
typedef float vec_t __attribute__((vector_size(VEC * sizeof(float))));
/* the same, for reading and writing float arrays in place (unaligned, aliasing them) */
typedef float vec_in_place
    __attribute__((vector_size(VEC * sizeof(float)), aligned(sizeof(float)), may_alias));

/* Why not memcpy: GCC 12 compiled a memcpy of a 64-byte vector into two 32-byte stores
 * to the stack and one 64-byte load back, which stalls (store forwarding fails): the
 * decode block's attention scores ran 10x slower than their arithmetic. */
static inline vec_t load(const float *p) { return *(const vec_in_place *)p; }

static inline void store(float *p, vec_t v) { *(vec_in_place *)p = v; }

/* the same width of 32-bit integers (comparisons give these: all ones where true) */
typedef int32_t vec_int __attribute__((vector_size(VEC * sizeof(int32_t))));

static inline vec_t splat(float f) { return f - (vec_t){0}; }

/* where: a's lanes where mask is all ones, else b's (C has no ?: on vectors) */
static inline vec_t where(vec_int mask, vec_t a, vec_t b) {
  return (vec_t)(((vec_int)a & mask) | ((vec_int)b & ~mask));
}

/* exp of each lane, within 1 ulp of libm's expf (Cephes' expf: x = n ln2 + r, |r| <=
 * ln2 / 2, a degree-6 polynomial in r, times 2^n built in the exponent bits); 0 below
 * -87.3 (libm: a denormal or 0), and exp(88.376) above 88.376 (libm: up to 3.4e38, then
 * inf): 2^n must fit the exponent. libm's expf, one call per lane, was 5-7 % of a
 * cpu-135m decode step (softmax and SiLU: ~0.9 M calls per step at batch 8, context 256;
 * AMD EPYC VM, perf). */
static inline vec_t vexp(vec_t x) {
  const vec_t lo = splat(-87.3365447f), hi = splat(88.3762626f);
  vec_int below = x < lo;
  x = where(x > hi, hi, where(below, lo, x));
  vec_t n = x * 1.44269504088896341f + 12582912.0f; /* 1.5 x 2^23: rounds to an integer */
  n -= 12582912.0f;
  vec_t r = x - n * 0.693359375f + n * 2.12194440e-4f;
  vec_t p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  vec_int scale = (__builtin_convertvector(n, vec_int) + 127) << 23;
  return (vec_t)((vec_int)(p * (vec_t)scale) & ~below);
}

/* exp of one float, as vexp computes it */
static inline float exp1(float x) {
  float lanes[VEC] = {x};
  return vexp(load(lanes))[0];
}

/* row[j] = exp(row[j] - top) for j < n; returns their sum (softmax's numerators) */
static inline float exp_shifted(float *row, int64_t n, float top) {
  vec_t sum = {0};
  int64_t j = 0;
  for (; j + VEC <= n; j += VEC) {
    vec_t e = vexp(load(row + j) - top);
    store(row + j, e);
    sum += e;
  }
  float total = 0;
  for (int i = 0; i < VEC; i++) total += sum[i];
  if (j < n) { /* the last n - j < VEC, in one vector */
    float lanes[VEC] = {0};
    memcpy(lanes, row + j, sizeof(float) * (size_t)(n - j));
    vec_t e = vexp(load(lanes) - top);
    for (int64_t i = 0; i < n - j; i++) total += row[j + i] = e[i];
  }
  return total;
}

#endif
