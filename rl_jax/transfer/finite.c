/* Copies of weights that also say whether every value is finite, and the check alone.
 *
 * A value of an IEEE format (float16, bfloat16, float32, float64) is non-finite exactly when its
 * exponent bits are all ones: (bits & exp) == exp. Each loop keeps the minimum of
 * (bits & exp) ^ exp, which is zero exactly for a non-finite value; the compiler vectorises the
 * loops (load, store, and, xor, min), so the check rides along with the copy's loads and costs no
 * pass over memory of its own.
 *
 * Arrays are given as rows: `rows` rows of `n` values of `width` bytes, row r starting at
 * base + r * stride (bytes). Returns 1 when every value is finite, 0 when one is not, -1 for an
 * unknown width. Row starts need the alignment of their values' width; source and destination
 * never overlap. */

#include <stddef.h>
#include <stdint.h>

#define KERNELS(T, W)                                                                       \
  static int copy_rows_##W(char *dst, ptrdiff_t dst_stride, const char *src,                 \
                           ptrdiff_t src_stride, size_t rows, size_t n, T exp) {             \
    T low = (T)~(T)0;                                                                       \
    for (size_t r = 0; r < rows; r++) {                                                     \
      T *restrict d = (T *)(dst + (ptrdiff_t)r * dst_stride);                               \
      const T *restrict s = (const T *)(src + (ptrdiff_t)r * src_stride);                   \
      for (size_t i = 0; i < n; i++) {                                                      \
        T x = s[i];                                                                         \
        d[i] = x;                                                                           \
        T m = (T)((x & exp) ^ exp);                                                         \
        low = m < low ? m : low;                                                            \
      }                                                                                     \
    }                                                                                       \
    return low != 0;                                                                        \
  }                                                                                         \
  static int check_rows_##W(const char *src, ptrdiff_t src_stride, size_t rows, size_t n,   \
                            T exp) {                                                        \
    T low = (T)~(T)0;                                                                       \
    for (size_t r = 0; r < rows; r++) {                                                     \
      const T *s = (const T *)(src + (ptrdiff_t)r * src_stride);                            \
      for (size_t i = 0; i < n; i++) {                                                      \
        T m = (T)((s[i] & exp) ^ exp);                                                      \
        low = m < low ? m : low;                                                            \
      }                                                                                     \
    }                                                                                       \
    return low != 0;                                                                        \
  }

KERNELS(uint16_t, 2)
KERNELS(uint32_t, 4)
KERNELS(uint64_t, 8)

int rl_jax_copy_finite(char *dst, ptrdiff_t dst_stride, const char *src, ptrdiff_t src_stride,
                       size_t rows, size_t n, int width, uint64_t exp) {
  switch (width) {
    case 2: return copy_rows_2(dst, dst_stride, src, src_stride, rows, n, (uint16_t)exp);
    case 4: return copy_rows_4(dst, dst_stride, src, src_stride, rows, n, (uint32_t)exp);
    case 8: return copy_rows_8(dst, dst_stride, src, src_stride, rows, n, exp);
  }
  return -1;
}

/* float32 -> bfloat16, rounded to nearest even (ml_dtypes' cast, bit for bit: a NaN becomes
 * the quiet NaN 0x7fc0 with its sign), and whether every result is finite (a finite float32
 * beyond bfloat16's range rounds to infinity and counts as non-finite). */
int rl_jax_cast_bf16_finite(char *dst, ptrdiff_t dst_stride, const char *src,
                            ptrdiff_t src_stride, size_t rows, size_t n) {
  uint16_t low = 0xffff;
  for (size_t r = 0; r < rows; r++) {
    uint16_t *restrict d = (uint16_t *)(dst + (ptrdiff_t)r * dst_stride);
    const uint32_t *restrict s = (const uint32_t *)(src + (ptrdiff_t)r * src_stride);
    for (size_t i = 0; i < n; i++) {
      uint32_t u = s[i];
      uint16_t rounded = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
      uint16_t nan = (uint16_t)(((u >> 16) & 0x8000u) | 0x7fc0u);
      uint16_t h = (u & 0x7fffffffu) > 0x7f800000u ? nan : rounded;
      d[i] = h;
      uint16_t m = (uint16_t)((h & 0x7f80u) ^ 0x7f80u);
      low = m < low ? m : low;
    }
  }
  return low != 0;
}

int rl_jax_check_finite(const char *src, ptrdiff_t src_stride, size_t rows, size_t n,
                        int width, uint64_t exp) {
  switch (width) {
    case 2: return check_rows_2(src, src_stride, rows, n, (uint16_t)exp);
    case 4: return check_rows_4(src, src_stride, rows, n, (uint32_t)exp);
    case 8: return check_rows_8(src, src_stride, rows, n, exp);
  }
  return -1;
}
