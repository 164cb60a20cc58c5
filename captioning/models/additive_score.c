/* The additive score and its gradients in one pass over the keys, on the CPU.

   score[b,g,l] = sum_a w[a] tanh(k[b,l,a] + q[b,g,a]) + bias

   for B images, G queries per image (the words of a caption, or the beams of a search),
   L cells and A attention units; keys (B, L, A), queries (B, G, A), scores (B, G, L), all
   contiguous, fp32 (the keys may be bf16). Each row of keys is read once while its A values sit
   in registers and L1: the add, the activation and the projection never write the
   (B, G, L, A) hidden layer out. tanh(x) = 2 s - 1 with s = sigmoid(2x), whose exponential
   is Cephes' single-precision polynomial, written so that the compiler vectorises it
   (about 2 ulp; NaN stays NaN). With t = g s (1 - s), the backward pass forms

   d/dk[b,l,a] = 4 w[a] sum_g t,   d/dq[b,g,a] = 4 w[a] sum_l t,   d/dw[a] = sum g (2 s - 1)

   in the same single pass. OpenMP splits the images (or the cells) over `threads` threads
   (torch's count); the process's OpenMP runtime is torch's, so they are torch's threads. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

static inline float sigmoid_of_double(float x) { /* sigmoid(2x) = 1 / (1 + exp(-2x)) */
  float y = -2.0f * x;
  y = y > 88.0f ? 88.0f : y; /* exp(88) is near fp32's largest; a NaN passes both */
  y = y < -88.0f ? -88.0f : y;
  const float n = (y * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round(y/ln 2) */
  float r = y - n * 0.693359375f;
  r = r - n * -2.12194440e-4f; /* y - n ln 2 in two parts */
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f; /* exp(r) */
  union {
    int32_t i;
    float f;
  } scale = {.i = ((int32_t)n + 127) << 23}; /* 2^n */
  return 1.0f / (1.0f + p * scale.f);
}

static inline float from_bf16(uint16_t v) {
  union {
    uint32_t i;
    float f;
  } x = {.i = (uint32_t)v << 16};
  return x.f;
}

/* Row (b, l) of the keys, in fp32. */
static inline void load_row(const void *keys, int bf16, int64_t row, int64_t A, float *out) {
  if (bf16) {
    const uint16_t *k = (const uint16_t *)keys + row * A;
#pragma omp simd
    for (int64_t a = 0; a < A; ++a) out[a] = from_bf16(k[a]);
  } else {
    memcpy(out, (const float *)keys + row * A, sizeof(float) * A);
  }
}

void additive_score_forward(const void *keys, int bf16, const float *queries,
                            const float *weight, float bias, float *scores, int64_t B,
                            int64_t G, int64_t L, int64_t A, int threads) {
  float *w2 = malloc(sizeof(float) * A);
  double total = 0.0;
  for (int64_t a = 0; a < A; ++a) {
    w2[a] = 2.0f * weight[a];
    total += weight[a];
  }
  const float shift = bias - (float)total; /* w tanh(x) + b = 2 w sigmoid(2x) + b - sum(w) */
#pragma omp parallel num_threads(threads)
  {
    float *row = malloc(sizeof(float) * A);
#pragma omp for collapse(2) schedule(static)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t l = 0; l < L; ++l) {
        load_row(keys, bf16, b * L + l, A, row);
        for (int64_t g = 0; g < G; ++g) {
          const float *q = queries + (b * G + g) * A;
          float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
          for (int64_t a = 0; a < A; ++a) sum += w2[a] * sigmoid_of_double(row[a] + q[a]);
          scores[(b * G + g) * L + l] = sum + shift;
        }
      }
    free(row);
  }
  free(w2);
}

void additive_score_backward(const void *keys, int bf16, const float *queries,
                             const float *weight, const float *grad, float *grad_keys,
                             int accumulate, float *grad_queries, float *grad_weight, int64_t B,
                             int64_t G, int64_t L, int64_t A, int threads) {
  float *partial = calloc((size_t)threads * A, sizeof(float)); /* sum g s, one row a thread */
#pragma omp parallel num_threads(threads)
  {
    float *mine = partial + (size_t)omp_get_thread_num() * A;
    float *row = malloc(sizeof(float) * A), *summed = malloc(sizeof(float) * A);
#pragma omp for schedule(static)
    for (int64_t b = 0; b < B; ++b) {
      float *gq = grad_queries + b * G * A;
      memset(gq, 0, sizeof(float) * G * A);
      for (int64_t l = 0; l < L; ++l) {
        load_row(keys, bf16, b * L + l, A, row);
        memset(summed, 0, sizeof(float) * A);
        for (int64_t g = 0; g < G; ++g) {
          const float *q = queries + (b * G + g) * A;
          float *gqg = gq + g * A;
          const float gv = grad[(b * G + g) * L + l];
#pragma omp simd
          for (int64_t a = 0; a < A; ++a) {
            const float s = sigmoid_of_double(row[a] + q[a]);
            const float u = gv * s;
            const float t = u - u * s; /* g s (1 - s) */
            mine[a] += u;
            gqg[a] += t;
            summed[a] += t;
          }
        }
        float *gk = grad_keys + (b * L + l) * A;
        if (accumulate) {
#pragma omp simd
          for (int64_t a = 0; a < A; ++a) gk[a] += 4.0f * weight[a] * summed[a];
        } else {
#pragma omp simd
          for (int64_t a = 0; a < A; ++a) gk[a] = 4.0f * weight[a] * summed[a];
        }
      }
      for (int64_t g = 0; g < G; ++g) {
#pragma omp simd
        for (int64_t a = 0; a < A; ++a) gq[g * A + a] *= 4.0f * weight[a];
      }
    }
    free(row);
    free(summed);
  }
  double grad_sum = 0.0; /* sum g, for d/dw = 2 sum g s - sum g */
  for (int64_t i = 0; i < B * G * L; ++i) grad_sum += grad[i];
  for (int64_t a = 0; a < A; ++a) {
    double sum = 0.0;
    for (int t = 0; t < threads; ++t) sum += partial[(size_t)t * A + a];
    grad_weight[a] = (float)(2.0 * sum - grad_sum);
  }
  free(partial);
}
