// What the quantized block GEMMs share (cpu_quant.cpp, cpu_quant_bf16.cpp): the block layout of the weights (see
// cpu_quant.cpp) and the conversions of the element types they read and write.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define TIFFIN_VNNI 1
#endif
#if TIFFIN_VNNI && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define TIFFIN_AMX 1
#endif

namespace {

constexpr int QK = 32;    // inputs per block
constexpr int LANES = 16;  // weight rows interleaved

inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
  uint32_t u;
  if (exp == 0x1F) {
    u = sign | 0x7F800000 | (mant << 13);
  } else if (exp) {
    u = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant) {  // subnormal
    int e = 113;
    uint32_t m = mant;
    while (!(m & 0x400)) m <<= 1, --e;
    u = sign | (static_cast<uint32_t>(e) << 23) | ((m & 0x3FF) << 13);
  } else {
    u = sign;
  }
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline float load_value(const void* x, int dtype, int64_t i) {  // dtype: 0 fp32, 1 fp16, 2 bf16
  if (dtype == 0) return static_cast<const float*>(x)[i];
  const uint16_t h = static_cast<const uint16_t*>(x)[i];
  if (dtype == 1) return half_to_float(h);
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline void store_value(void* y, int dtype, int64_t i, float v) {  // rounding to nearest even, as torch
  if (dtype == 0) {
    static_cast<float*>(y)[i] = v;
    return;
  }
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  uint16_t h;
  if (dtype == 2) {
    h = std::isnan(v) ? 0x7FC0 : static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
  } else {
    const uint32_t sign = (u >> 16) & 0x8000, abs = u & 0x7FFFFFFF;
    if (abs >= 0x7F800000) {
      h = sign | 0x7C00 | (abs > 0x7F800000 ? 0x200 : 0);
    } else if (abs >= 0x477FF000) {  // rounds past 65504
      h = sign | 0x7C00;
    } else if (abs < 0x38800000) {  // subnormal or zero: exact steps of 2^-24
      float a;
      std::memcpy(&a, &abs, sizeof a);
      h = sign | static_cast<uint16_t>(std::nearbyint(a * 16777216.f));
    } else {
      const uint32_t r = abs + 0xFFF + ((abs >> 13) & 1);
      h = sign | static_cast<uint16_t>((r - (112u << 23)) >> 13);
    }
  }
  static_cast<uint16_t*>(y)[i] = h;
}

// Input j (0..31) of lane `lane`'s row in a block of codes (the layout above).
inline int block_code(const uint8_t* block, int bits, int lane, int j) {
  const int quad = j / 4, byte = 4 * lane + j % 4;
  if (bits == 8) return block[quad * 64 + byte];
  const uint8_t packed = block[(quad % 4) * 64 + byte];
  return quad < 4 ? packed & 0x0F : packed >> 4;
}

struct Weights {
  const uint8_t* codes;
  const uint16_t* scales;
  const uint16_t* offsets;
  int64_t n;  // rows, before padding to whole groups
};

#if TIFFIN_AMX
// Intel AMX (Xeon from Sapphire Rapids): 8 tile registers of up to 16 rows of 64 bytes. Linux hands out their
// state only on request, once per process. TIFFIN_CPU_AMX=0 keeps to AVX-512 (to compare the two).
inline bool amx_usable() {
  static const bool granted = [] {
    const char* setting = std::getenv("TIFFIN_CPU_AMX");
    if (setting && std::strcmp(setting, "0") == 0) return false;
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  }();
  return granted;
}

// The calling thread's tile shapes: tile t has rows[t] rows of colsb[t] bytes.
inline void configure_tiles(const uint16_t (&colsb)[8], const uint8_t (&rows)[8]) {
  struct {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  } config;
  for (int t = 0; t < 8; ++t) config.colsb[t] = colsb[t], config.rows[t] = rows[t];
  asm volatile("ldtilecfg %0" ::"m"(config));  // GCC 12 drops the stores before `_tile_loadconfig(&config)`
}

// The tiles back to their initial state: the thread's context switches then save no tile data.
inline void release_tiles() { _tile_release(); }
#else
inline bool amx_usable() { return false; }
inline void configure_tiles(const uint16_t (&)[8], const uint8_t (&)[8]) {}
inline void release_tiles() {}
#endif

#if TIFFIN_VNNI
// The first `lanes` (of 16) outputs in `acc` to y's elements at..at+lanes, as out_dtype.
inline void store_outputs(__m512 acc, void* y, int out_dtype, int64_t at, int64_t lanes) {
  if (out_dtype == 0 && lanes == LANES) {
    _mm512_storeu_ps(static_cast<float*>(y) + at, acc);
    return;
  }
  alignas(64) float out[LANES];
  _mm512_store_ps(out, acc);
  for (int l = 0; l < lanes; ++l) store_value(y, out_dtype, at + l, out[l]);
}
#endif
}  // namespace

// The bf16 GEMM (cpu_quant_bf16.cpp): built where the CPU has AVX-512 BF16 (1), on AMX tiles where it has those (2).
extern "C" int tiffin_bf16_gemm_built();
extern "C" void tiffin_bf16_gemm(int dtype, const void* x, int64_t x_stride, int64_t m, int64_t k, int bits,
                                 const Weights& w, int out_dtype, void* y, int64_t y_stride, int threads);
