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

#endif
