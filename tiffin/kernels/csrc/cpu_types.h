// The element types the native CPU kernels read and write (fp32 and bf16), converted as torch converts them.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

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

template <typename F>
void by_dtype(int dtype, F&& run) {
  if (dtype == 0) run(float{});
  if (dtype == 2) run(bf16{});
}

}  // namespace
