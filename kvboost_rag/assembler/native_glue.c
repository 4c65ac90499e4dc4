/* The elementwise work between the lean forward's matrix products (see native_glue.py).

   A short forward (a decode step) spends more time in the small operations around its products
   than in their arithmetic: through PyTorch each is a dispatched kernel with its own allocation,
   and a layer has ~25 of them. Here they are two functions, called through ctypes:

   - add_rms_norm: residual + delta (rounded to the dtype), then RMSNorm of the sum;
   - rope_split:   queries and keys of a fused q/k/v product rotated, split per head.

   (The SiLU-gated product stays in PyTorch: its exp needs a vector math library to be fast on
   prefills, and a scalar exp would cost more than the call it saves.)

   Every row is computed alone, in the same order whatever the row count, so a token's bits do not
   depend on how a prompt is split into calls (the split-invariance the engine needs). Reductions
   use a fixed number of partial sums, combined in a fixed order: compiled without reassociation
   (no -ffast-math) and without contraction (-ffp-contract=off), the arithmetic is IEEE float32
   operations in program order, the same bits on every x86 or ARM machine whatever the vector width.

   dtype: 0 float32, 1 bfloat16 (stored as uint16; rounded to nearest even, as PyTorch rounds). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16

static inline float from_bf16(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)0x7fc0u : (uint16_t)rounded;
}

/* row[i] = src[i] as float */
static void load_row(int dtype, const void *src, float *row, int64_t n) {
    if (dtype) {
        const uint16_t *s = (const uint16_t *)src;
        for (int64_t i = 0; i < n; i++) row[i] = from_bf16(s[i]);
    } else {
        memcpy(row, src, (size_t)n * sizeof(float));
    }
}

static void store_row(int dtype, const float *row, void *dst, int64_t n) {
    if (dtype) {
        uint16_t *d = (uint16_t *)dst;
        for (int64_t i = 0; i < n; i++) d[i] = to_bf16(row[i]);
    } else {
        memcpy(dst, row, (size_t)n * sizeof(float));
    }
}

/* x rounded to the dtype and back (a no-op in float32). */
static void round_row(int dtype, float *row, int64_t n) {
    if (dtype) {
        for (int64_t i = 0; i < n; i++) row[i] = from_bf16(to_bf16(row[i]));
    }
}

static float sum_of_squares(const float *h, int64_t n) {
    float lanes[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        for (int j = 0; j < LANES; j++) lanes[j] += h[i + j] * h[i + j];
    }
    for (int j = 0; i < n; i++, j++) lanes[j] += h[i] * h[i];
    for (int width = LANES / 2; width > 0; width /= 2) {
        for (int j = 0; j < width; j++) lanes[j] += lanes[j + width];
    }
    return lanes[0];
}

/* For each of `rows` rows of `n` (contiguous): s = residual + delta (rounded; delta may be NULL:
   s = residual), written to `sum` when not NULL; then normed = weight * round(s * 1 / sqrt(mean(s^2) + eps)), rounded, as the models' RMSNorm computes
   it (the statistics in float32, the scale applied in the dtype). Returns 0, or -1 when out of
   memory. */
int add_rms_norm(int dtype, int64_t rows, int64_t n, const void *residual, const void *delta, void *sum,
                 void *normed, const void *weight, float eps) {
    const size_t bytes = dtype ? 2 : 4;
    float *s = malloc(3 * (size_t)n * sizeof(float));
    if (!s) return -1;
    float *d = s + n, *w = d + n;
    load_row(dtype, weight, w, n);
    for (int64_t r = 0; r < rows; r++) {
        const size_t offset = (size_t)r * (size_t)n * bytes;
        load_row(dtype, (const char *)residual + offset, s, n);
        if (delta) {
            load_row(dtype, (const char *)delta + offset, d, n);
            for (int64_t i = 0; i < n; i++) s[i] += d[i];
            round_row(dtype, s, n);
        }
        if (sum) store_row(dtype, s, (char *)sum + offset, n);
        const float scale = 1.0f / sqrtf(sum_of_squares(s, n) / (float)n + eps);
        for (int64_t i = 0; i < n; i++) d[i] = s[i] * scale;
        round_row(dtype, d, n);
        for (int64_t i = 0; i < n; i++) d[i] = w[i] * d[i];
        store_row(dtype, d, (char *)normed + offset, n);
    }
    free(s);
    return 0;
}

/* One fused q/k/v product `qkv` [rows, (heads + 2 * kv_heads) * dim] split into queries
   [heads, rows, dim], keys and values [kv_heads, rows, dim], with queries and keys rotated:
   x * cos + swap_halves(x) * sin (each product and the sum rounded to the dtype), where `cos` and
   `sin` [rows, dim] are the rotary tables with sin's first half negated. Returns 0, or -1 when out
   of memory or dim is odd. */
int rope_split(int dtype, int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim, const void *qkv,
               const void *cos_table, const void *sin_table, void *queries, void *keys, void *values) {
    if (dim % 2) return -1;
    const size_t bytes = dtype ? 2 : 4;
    const int64_t width = (heads + 2 * kv_heads) * dim, half = dim / 2;
    float *x = malloc(5 * (size_t)dim * sizeof(float));
    if (!x) return -1;
    float *c = x + dim, *s = c + dim, *a = s + dim, *b = a + dim;
    for (int64_t r = 0; r < rows; r++) {
        const char *row = (const char *)qkv + (size_t)(r * width) * bytes;
        load_row(dtype, (const char *)cos_table + (size_t)(r * dim) * bytes, c, dim);
        load_row(dtype, (const char *)sin_table + (size_t)(r * dim) * bytes, s, dim);
        for (int64_t h = 0; h < heads + kv_heads; h++) {
            load_row(dtype, row + (size_t)(h * dim) * bytes, x, dim);
            for (int64_t i = 0; i < dim; i++) a[i] = x[i] * c[i];
            for (int64_t i = 0; i < half; i++) b[i] = x[i + half] * s[i];
            for (int64_t i = half; i < dim; i++) b[i] = x[i - half] * s[i];
            round_row(dtype, a, dim);
            round_row(dtype, b, dim);
            for (int64_t i = 0; i < dim; i++) a[i] += b[i];
            char *out = h < heads ? (char *)queries + (size_t)((h * rows + r) * dim) * bytes
                                  : (char *)keys + (size_t)(((h - heads) * rows + r) * dim) * bytes;
            store_row(dtype, a, out, dim);
        }
        for (int64_t h = 0; h < kv_heads; h++) {
            memcpy((char *)values + (size_t)((h * rows + r) * dim) * bytes,
                   row + (size_t)((heads + kv_heads + h) * dim) * bytes, (size_t)dim * bytes);
        }
    }
    free(x);
    return 0;
}
