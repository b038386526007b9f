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
#ifdef __AVX2__
#include <immintrin.h>
#endif

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

/* One contiguous run of ``n`` values copied with non-temporal (streaming) stores where the CPU
 * has AVX2, and whether they are all finite. A large copy's destination then goes to memory
 * without first being read into the cache (a plain store reads each line it writes): the
 * staging copy of a version moves a third less memory. The destination is not left in the
 * cache, so callers hash the source (the same bytes) rather than the destination. Stores are
 * fenced before returning (what follows, e.g. a progress row saying the block is written,
 * becomes visible after them). Without AVX2, and for 8-byte values, the plain copy. */
int rl_jax_copy_finite_stream(char *dst, const char *src, size_t n, int width, uint64_t exp) {
#ifdef __AVX2__
  if (width == 4 || width == 2) {
    size_t bytes = n * (size_t)width, i = 0;
    uint32_t low32 = 0xffffffffu;
    uint16_t low16 = 0xffff;
    /* head: up to the destination's first 32-byte boundary, value by value */
    while (i < bytes && ((uintptr_t)(dst + i) & 31)) {
      if (width == 4) {
        uint32_t x = *(const uint32_t *)(src + i), m = (x & (uint32_t)exp) ^ (uint32_t)exp;
        *(uint32_t *)(dst + i) = x;
        low32 = m < low32 ? m : low32;
      } else {
        uint16_t x = *(const uint16_t *)(src + i);
        uint16_t m = (uint16_t)((x & (uint16_t)exp) ^ (uint16_t)exp);
        *(uint16_t *)(dst + i) = x;
        low16 = m < low16 ? m : low16;
      }
      i += (size_t)width;
    }
    __m256i e = width == 4 ? _mm256_set1_epi32((int)(uint32_t)exp)
                           : _mm256_set1_epi16((short)(uint16_t)exp);
    __m256i l0 = _mm256_set1_epi32(-1), l1 = l0;
    for (; i + 128 <= bytes; i += 128) {
      __m256i a = _mm256_loadu_si256((const __m256i *)(src + i));
      __m256i b = _mm256_loadu_si256((const __m256i *)(src + i + 32));
      __m256i c = _mm256_loadu_si256((const __m256i *)(src + i + 64));
      __m256i d = _mm256_loadu_si256((const __m256i *)(src + i + 96));
      _mm256_stream_si256((__m256i *)(dst + i), a);
      _mm256_stream_si256((__m256i *)(dst + i + 32), b);
      _mm256_stream_si256((__m256i *)(dst + i + 64), c);
      _mm256_stream_si256((__m256i *)(dst + i + 96), d);
      a = _mm256_xor_si256(_mm256_and_si256(a, e), e);
      b = _mm256_xor_si256(_mm256_and_si256(b, e), e);
      c = _mm256_xor_si256(_mm256_and_si256(c, e), e);
      d = _mm256_xor_si256(_mm256_and_si256(d, e), e);
      if (width == 4) {
        l0 = _mm256_min_epu32(l0, _mm256_min_epu32(a, b));
        l1 = _mm256_min_epu32(l1, _mm256_min_epu32(c, d));
      } else {
        l0 = _mm256_min_epu16(l0, _mm256_min_epu16(a, b));
        l1 = _mm256_min_epu16(l1, _mm256_min_epu16(c, d));
      }
    }
    _mm_sfence();
    if (width == 4) {
      uint32_t lanes[8];
      _mm256_storeu_si256((__m256i *)lanes, _mm256_min_epu32(l0, l1));
      for (int k = 0; k < 8; k++) low32 = lanes[k] < low32 ? lanes[k] : low32;
    } else {
      uint16_t lanes[16];
      _mm256_storeu_si256((__m256i *)lanes, _mm256_min_epu16(l0, l1));
      for (int k = 0; k < 16; k++) low16 = lanes[k] < low16 ? lanes[k] : low16;
    }
    /* tail */
    int tail = rl_jax_copy_finite(dst + i, 0, src + i, 0, 1, (bytes - i) / (size_t)width,
                                  width, exp);
    return tail == 1 && (width == 4 ? low32 != 0 : low16 != 0);
  }
#endif
  return rl_jax_copy_finite(dst, 0, src, 0, 1, n, width, exp);
}
