/* A latent decode step's attention scores in one pass over the cached latents
 * (runtime/kernels/latent_scores.py builds, loads and calls this file).
 *
 * A latent KV cache holds z_k per token; the keys are z_k's copied columns (U_k's
 * identity columns, whole RoPE pairs) and z_k . U_rest (the other columns), each pair
 * rotated at its token's position; every query row is scored against them. In torch
 * that is a GEMM over all the batch's tokens, a complex product and two batched score
 * products, each writing its result to memory for the next. Here a tile of TOK tokens
 * is rebuilt in registers (CHUNK accumulator vectors per token, each U_rest row loaded
 * once per tile), rotated and scored while it is in L1.
 *
 * Measured on an AMD EPYC VM (Zen 4, AVX-512; cpu-135m at 40%: r_k 116, 116 copied
 * and 76 rebuilt columns, batch 8, context 256, 9 query heads; medians of 200 calls):
 * the torch form 1.06-1.34 ms with one thread and 0.66-0.85 with two; this kernel
 * 0.61-0.77 and 0.40-0.47. Of its time, ~2/3 is the rebuild's FMAs. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define VEC 16
#define TOK 4   /* tokens per tile */
#define CHUNK 4 /* accumulator vectors per token: 16 of 32 registers */
#elif defined(__AVX__)
#define VEC 8
#define TOK 3
#define CHUNK 4 /* 12 of 16 registers, the rest for U_rest and broadcasts */
#else
#define VEC 4
#define TOK 2
#define CHUNK 3
#endif
#define MAX_WIDTH 1024 /* key columns of one rank (kv_heads x head_dim) and padding */

typedef float vec_t __attribute__((vector_size(VEC * sizeof(float)), aligned(sizeof(float))));
typedef int32_t ivec_t __attribute__((vector_size(VEC * sizeof(int32_t))));

int latent_width(void) { return VEC; }

int latent_max_width(void) { return MAX_WIDTH; }

static inline vec_t load(const float *p) { return *(const vec_t *)p; }

static inline void store(float *p, vec_t v) { memcpy(p, &v, sizeof(vec_t)); }

/* keys[t][col .. col + vecs * VEC) = z[t][:r_k] . u[:, col ..] for tokens tokens
 * (tokens and vecs constants in the callers below, so the loops unroll into registers) */
static inline __attribute__((always_inline)) void rebuild(
    const float *z, int64_t ldz, int64_t r_k, const float *u, int64_t ldu, int64_t col,
    float *keys, const int tokens, const int vecs) {
  vec_t acc[TOK][CHUNK];
#pragma GCC unroll 4
  for (int t = 0; t < tokens; t++)
#pragma GCC unroll 4
    for (int v = 0; v < vecs; v++) acc[t][v] = (vec_t){0};
  for (int64_t k = 0; k < r_k; k++) {
    const float *uk = u + k * ldu + col;
    vec_t w[CHUNK];
#pragma GCC unroll 4
    for (int v = 0; v < vecs; v++) w[v] = load(uk + v * VEC);
#pragma GCC unroll 4
    for (int t = 0; t < tokens; t++) {
      float zt = z[t * ldz + k];
#pragma GCC unroll 4
      for (int v = 0; v < vecs; v++) acc[t][v] += zt * w[v];
    }
  }
#pragma GCC unroll 4
  for (int t = 0; t < tokens; t++)
#pragma GCC unroll 4
    for (int v = 0; v < vecs; v++) store(keys + t * MAX_WIDTH + col + v * VEC, acc[t][v]);
}

#define VECS_CASE(n, tokens, zp, kp)                      \
  case n:                                                 \
    if (n <= CHUNK) rebuild(zp, ldz, r_k, u, upad, col, kp, tokens, n); \
    break;

/* the rebuilt columns of a tile's tokens (z: the first token's row) */
static void rebuild_tile(const float *z, int64_t ldz, int64_t r_k, const float *u,
                         int64_t upad, float *rest_keys, int tokens) {
  for (int64_t col = 0; col < upad; col += CHUNK * VEC) {
    int64_t left = (upad - col) / VEC;
    int vecs = left < CHUNK ? (int)left : CHUNK;
    if (tokens == TOK) {
      switch (vecs) {
        VECS_CASE(1, TOK, z, rest_keys) VECS_CASE(2, TOK, z, rest_keys)
        VECS_CASE(3, TOK, z, rest_keys) VECS_CASE(4, TOK, z, rest_keys)
      }
      continue;
    }
    for (int t = 0; t < tokens; t++) { /* the last tile of a sequence, token by token */
      const float *zt = z + t * ldz;
      float *kt = rest_keys + t * MAX_WIDTH;
      switch (vecs) { VECS_CASE(1, 1, zt, kt) VECS_CASE(2, 1, zt, kt) VECS_CASE(3, 1, zt, kt) VECS_CASE(4, 1, zt, kt) }
    }
  }
}

/* scores [batch][heads][length]: queries [batch][heads][wpad] against the keys of
 * z [batch * length][ldz] (each sequence's length rows; the first lengths[b] hold its
 * tokens, -inf past them): z's columns copy_from .. copy_from + copies, then
 * z[:, :r_k] . u [r_k][upad] (the rest of the key columns, zero past them), the pair at 2j, 2j + 1
 * rotated by cos, sin [length][wpad] as x . cos + swap(x) . sin (sin signed, zero past
 * the key columns). copies and the rest even; wpad, upad multiples of VEC;
 * copies + upad <= MAX_WIDTH. */
void latent_scores(const float *z, int64_t ldz, int64_t batch, int64_t length,
                   const int64_t *lengths, int64_t r_k, int64_t copy_from, int64_t copies,
                   const float *u, int64_t upad, const float *cos,
                   const float *sin, const float *queries, int64_t heads, int64_t wpad,
                   float *scores) {
  int64_t tiles = (length + TOK - 1) / TOK;
  ivec_t swap;
  for (int i = 0; i < VEC; i++) swap[i] = i ^ 1;
#pragma omp parallel for schedule(static)
  for (int64_t job = 0; job < batch * tiles; job++) {
    int64_t b = job / tiles, l0 = (job % tiles) * TOK;
    int64_t span = length - l0 < TOK ? length - l0 : TOK; /* score columns of this tile */
    int64_t valid = lengths[b] - l0;
    int tokens = valid <= 0 ? 0 : (valid < TOK ? (int)valid : TOK);
    float *out = scores + b * heads * length + l0;
    float keys[TOK][MAX_WIDTH] __attribute__((aligned(64)));
    if (tokens) {
      const float *zt = z + (b * length + l0) * ldz;
      for (int t = 0; t < TOK; t++) { /* a tile's unused tokens are scored, not written */
        int64_t from = t < tokens ? copies : 0;
        memset(keys[t] + from, 0, (size_t)(wpad - from) * sizeof(float));
      }
      for (int t = 0; t < tokens; t++)
        memcpy(keys[t], zt + t * ldz + copy_from, (size_t)copies * sizeof(float));
      rebuild_tile(zt, ldz, r_k, u, upad, keys[0] + copies, tokens);
      for (int t = 0; t < tokens; t++) {
        const float *c = cos + (l0 + t) * wpad, *s = sin + (l0 + t) * wpad;
        for (int64_t j = 0; j < wpad; j += VEC) {
          vec_t x = load(keys[t] + j);
          store(keys[t] + j, x * load(c + j) + __builtin_shuffle(x, swap) * load(s + j));
        }
      }
    }
    for (int64_t h = 0; h < heads; h++, out += length) {
      if (tokens) {
        const float *q = queries + (b * heads + h) * wpad;
        vec_t sum[TOK];
#pragma GCC unroll 4
        for (int t = 0; t < TOK; t++) sum[t] = (vec_t){0};
        for (int64_t j = 0; j < wpad; j += VEC) {
          vec_t qv = load(q + j);
#pragma GCC unroll 4
          for (int t = 0; t < TOK; t++) sum[t] += qv * load(keys[t] + j);
        }
        for (int t = 0; t < tokens; t++) {
          float total = 0;
          for (int i = 0; i < VEC; i++) total += sum[t][i];
          out[t] = total;
        }
      }
      for (int64_t t = tokens; t < span; t++) out[t] = -INFINITY;
    }
  }
}
