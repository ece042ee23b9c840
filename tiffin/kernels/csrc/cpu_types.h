// The element types the native CPU kernels read and write (fp32 and bf16; int8 and fp8 KV cache codes), converted as
// torch converts them.
#pragma once
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

struct bf16 {
  uint16_t bits;
};

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) {
  uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

template <typename T>
T from_float(float x);
template <>
float from_float<float>(float x) { return x; }
template <>
bf16 from_float<bf16>(float x) {  // round to nearest even, as torch does
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if (std::isnan(x)) return bf16{0x7FC0};
  u += 0x7FFF + ((u >> 16) & 1);
  return bf16{static_cast<uint16_t>(u >> 16)};
}

#if defined(__AVX512F__)
// 16 values as fp32.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16* p) {
  __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline __m512 round_to(float, __m512 v) { return v; }
inline __m512 round_to(bf16, __m512 v) {  // to bf16 and back, nearest even (from_float's rounding, NaN aside)
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb);
  return _mm512_castsi512_ps(_mm512_and_si512(rounded, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(bf16* p, __m512 v) {  // v already rounded: its top halves
  const __m512i top = _mm512_srli_epi32(_mm512_castps_si512(v), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(top));
}
#endif

template <typename F>
void by_dtype(int dtype, F&& run) {
  if (dtype == 0) run(float{});
  if (dtype == 2) run(bf16{});
}

// A quantized KV cache's codes (tiffin/kernels/kv_quant.py): a value is code * its token and head's scale.
struct i8 {
  int8_t v;
};
struct e4m3 {  // float8_e4m3fn: no infinities, 0x7f / 0xff NaN (never written: codes are clamped to +-448)
  uint8_t v;
};
struct e5m2 {
  uint8_t v;
};

template <int MANT, int BIAS>
float fp8_to_float(uint8_t b) {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i) {
      const int e = (i & 0x7f) >> MANT, m = i & ((1 << MANT) - 1);
      const float mag = e ? std::ldexp(1.f + static_cast<float>(m) / (1 << MANT), e - BIAS)
                          : std::ldexp(static_cast<float>(m) / (1 << MANT), 1 - BIAS);
      t[i] = i & 0x80 ? -mag : mag;
    }
    return t;
  }();
  return table[b];
}

// A finite x within the format's range, rounded to the nearest code, ties to even (as torch converts).
template <int MANT, int BIAS>
uint8_t float_to_fp8(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80);
  u &= 0x7fffffffu;
  float mag;
  std::memcpy(&mag, &u, sizeof mag);
  if (mag < std::ldexp(1.f, 1 - BIAS))  // subnormal: multiples of the smallest step (2^MANT of them: the min normal)
    return sign | static_cast<uint8_t>(std::nearbyint(std::ldexp(mag, BIAS - 1 + MANT)));
  u += (1u << (22 - MANT)) - 1 + ((u >> (23 - MANT)) & 1);  // round the mantissa to MANT bits, ties to even
  return sign | static_cast<uint8_t>(((u >> 23) - 127 + BIAS) << MANT | ((u >> (23 - MANT)) & ((1 << MANT) - 1)));
}

inline float to_float(i8 x) { return x.v; }
inline float to_float(e4m3 x) { return fp8_to_float<3, 7>(x.v); }
inline float to_float(e5m2 x) { return fp8_to_float<2, 15>(x.v); }

template <typename C>
constexpr float code_max() {
  if constexpr (std::is_same_v<C, i8>) return 127.f;
  if constexpr (std::is_same_v<C, e4m3>) return 448.f;
  return 57344.f;
}

template <typename C>
C encode(float y) {  // y = value / scale, within +-code_max<C>() but for rounding
  const float m = code_max<C>(), c = y < -m ? -m : (y > m ? m : y);
  if constexpr (std::is_same_v<C, i8>) return i8{static_cast<int8_t>(std::nearbyint(c))};
  if constexpr (std::is_same_v<C, e4m3>) return e4m3{float_to_fp8<3, 7>(c)};
  if constexpr (std::is_same_v<C, e5m2>) return e5m2{float_to_fp8<2, 15>(c)};
}

// x [n] times the normalized Sylvester Hadamard matrix, in place, where n is a power of two (else unchanged): how a
// quantized cache stores keys and how queries meet them (kv_quant.rotate: the same matrix, summed in another order).
inline void hadamard(float* x, int n) {
  if (n & (n - 1)) return;
#if defined(__AVX512F__)
  if (n == 64 || n == 128) {  // the same sums in the same order, in registers
    __m512 v[8];
    for (int i = 0; i < n / 16; ++i) v[i] = _mm512_loadu_ps(x + 16 * i);
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int h = 1; h < 16; h *= 2) {  // lanes j and j ^ h of a vector: x[j] + x[j ^ h] where bit h of j is 0
      const __m512i partner = _mm512_xor_si512(lane, _mm512_set1_epi32(h));
      const __mmask16 upper = _mm512_test_epi32_mask(lane, _mm512_set1_epi32(h));
      for (int i = 0; i < n / 16; ++i) {
        const __m512 y = _mm512_permutexvar_ps(partner, v[i]);
        v[i] = _mm512_mask_sub_ps(_mm512_add_ps(v[i], y), upper, y, v[i]);
      }
    }
    for (int h = 1; h < n / 16; h *= 2)  // whole vectors
      for (int i = 0; i < n / 16; i += 2 * h)
        for (int j = i; j < i + h; ++j) {
          const __m512 a = v[j], b = v[j + h];
          v[j] = _mm512_add_ps(a, b);
          v[j + h] = _mm512_sub_ps(a, b);
        }
    const __m512 norm = _mm512_set1_ps(1.f / std::sqrt(static_cast<float>(n)));
    for (int i = 0; i < n / 16; ++i) _mm512_storeu_ps(x + 16 * i, _mm512_mul_ps(v[i], norm));
    return;
  }
#endif
  for (int h = 1; h < n; h *= 2)
    for (int i = 0; i < n; i += 2 * h)
      for (int j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
  const float norm = 1.f / std::sqrt(static_cast<float>(n));
  for (int i = 0; i < n; ++i) x[i] *= norm;
}

template <typename C>
constexpr bool is_code = std::is_same_v<C, i8> || std::is_same_v<C, e4m3> || std::is_same_v<C, e5m2>;

// The cache's element type: the query's (T: `cache_dtype` 0 or 2, as T) or the codes of a quantized cache (3 int8,
// 4 fp8 e4m3, 5 fp8 e5m2).
template <typename T, typename F>
void by_cache_dtype(int cache_dtype, F&& run) {
  if (cache_dtype == 3) run(i8{});
  else if (cache_dtype == 4) run(e4m3{});
  else if (cache_dtype == 5) run(e5m2{});
  else run(T{});
}

}  // namespace
