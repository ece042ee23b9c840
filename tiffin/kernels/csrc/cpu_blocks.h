// What the quantized block GEMMs share (cpu_quant.cpp, cpu_quant_bf16.cpp): the block layout of the weights (see
// cpu_quant.cpp) and the conversions of the element types they read and write.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define TIFFIN_VNNI 1
#endif
#if !TIFFIN_VNNI && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define TIFFIN_AVX2 1  // cpu_quant_avx2.h's tile
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

// The weight layout (tiffin/kernels/block_layout.py builds it). Rows are interleaved by 16 (padded with zero rows to
// whole groups), so that each 32-bit lane of an AVX-512 register is one output row. A block is 32 inputs; its codes,
// per group of 16 rows, 64 bytes a bit:
// - 8 bits: 8 registers of 64 bytes; register t's byte 4l + j is input 4t + j of lane l.
// - 2 to 6 bits: L = 4 low bits of each code (4 to 6 bits) or 2 (2, 3 bits) in L registers, register r's byte 4l + j
//   holding in its bits Lf..Lf+L-1 the low bits of input 4(r + Lf) + j (L = 4: input 4t + j in the low nibble,
//   4(t + 4) + j in the high one), then a plane of 64 bytes per bit above L: plane p's byte 4l + j has in bit t (0..7)
//   bit L + p of input 4t + j.
// Each block (or half-block) of a row has a scale d and an offset m, w = v(q) d + m (v(q) = q but for the codebook
// kinds), found by the layer's `Kind`:
// - BLOCKS: fp16 `scales` and `offsets` [groups, blocks, 16]; block b's codes at (g * blocks + b) * code_bytes.
// - SUPER_MINS (GGUF's Q4_K, Q5_K): super-blocks of 8 blocks (K a multiple of 256), a group's each a record of its 8
//   blocks' codes, then uint8 sub-scales [8][16] and sub-mins [8][16]; `scales` fp16 [groups, supers, 16] holds d
//   and `offsets` -dmin: a block's d is d * sc, its m -dmin * mn (both exact in fp32).
// - SUPER_MINS16 (Q2_K): as SUPER_MINS, but a byte sc | mn << 4 a half-block [16][16]: d * sc, -dmin * mn per 16.
// - SUPER_CENTRED (Q6_K, Q3_K): records of the 8 blocks' codes, then int8 sub-scales [16 half-blocks][16]; `scales`
//   fp16 [groups, supers, 16] holds d: half-block h's d is d * sc, its m -2^(bits-1) times that (codes centred).
// - CODEBOOK (IQ4_NL): 4-bit BLOCKS without offsets, each code an index into IQ4's int8 values, taken as v(q) =
//   value + 128 (unsigned, for u8 x s8 products) with m = -128 d.
// - SUPER_CODEBOOK (IQ4_XS): records of 8 such blocks, then int8 sub-scales [8][16] (128 bytes); `scales` d: block
//   b's d is d * sc, its m -128 times that.
// - FP8 (8 bits only): the 8-bit registers hold float8 e4m3fn codes (raw bytes, no bias), w = e4m3(q) d, m = 0;
//   `scales` fp32 [groups, blocks, 16] (read through `fp32_scales`), `offsets` empty. Not integers: only the bf16
//   GEMM (cpu_quant_bf16.cpp) and `tiffin_dequantize_rows` read them, never the integer kernels.
enum Kind { BLOCKS, SUPER_MINS, SUPER_CENTRED, FP8, CODEBOOK, SUPER_CODEBOOK, SUPER_MINS16 };
constexpr int SUPER = 8;  // blocks per super-block
// IQ4_NL / IQ4_XS's values + 128, by code
constexpr uint8_t IQ4_UNSIGNED[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};

constexpr int64_t code_bytes(int bits) { return 64 * bits; }
constexpr int low_bits(int bits) { return bits == 8 ? 8 : bits >= 4 ? 4 : 2; }  // a code's bits held as fields
constexpr bool plain_blocks(int kind) { return kind == BLOCKS || kind == FP8 || kind == CODEBOOK; }  // no records
constexpr bool codebook(int kind) { return kind == CODEBOOK || kind == SUPER_CODEBOOK; }
constexpr int halves(int kind) { return kind == SUPER_CENTRED || kind == SUPER_MINS16 ? 2 : 1; }  // d, m a block
// a record's sub-scales (and sub-mins): a byte a block or half-block and lane
constexpr int64_t sub_bytes(int kind) { return plain_blocks(kind) ? 0 : kind == SUPER_CODEBOOK ? 128 : 256; }
constexpr int64_t record_bytes(int bits, int kind) {
  return plain_blocks(kind) ? code_bytes(bits) : SUPER * code_bytes(bits) + sub_bytes(kind);
}

struct Weights {  // tiffin.kernels.cpu_native.NativeWeights
  const uint8_t* codes;
  const uint16_t* scales;  // fp16, or fp32 for FP8
  const uint16_t* offsets;
  int64_t n;  // rows, before padding to whole groups
  int32_t bits, kind;
  int32_t per_token;  // W8A8 (8-bit BLOCKS, d one a row, m = -128 d): activations int8 per token (cpu_quant_w8a8.cpp)
};

inline const float* fp32_scales(const Weights& w) { return reinterpret_cast<const float*>(w.scales); }

// An e4m3fn code's value, exactly: integers scaled by powers of two, which never pass through fp32 denormals (the
// process may flush them). 0x7f / 0xff are NaN.
inline float e4m3_to_float(uint8_t c) {
  const int e = (c >> 3) & 0xF, m = c & 7;
  if (e == 15 && m == 7) return NAN;
  const float mag = e ? std::ldexp(static_cast<float>(8 + m), e - 10) : std::ldexp(static_cast<float>(m), -9);
  return c & 0x80 ? -mag : mag;
}

// Block b's codes in group g of a layer of `blocks` blocks a row, in format (bits, kind): the kernels pass both as
// constants, the scalar code the layer's.
inline const uint8_t* block_codes(const Weights& w, int bits, int kind, int64_t blocks, int64_t g, int64_t b) {
  if (plain_blocks(kind)) return w.codes + (g * blocks + b) * code_bytes(bits);
  const int64_t record = g * (blocks / SUPER) + b / SUPER;
  return w.codes + record * record_bytes(bits, kind) + (b % SUPER) * code_bytes(bits);
}

// The sub-scales of block b's record in group g (SUPER_* kinds).
inline const uint8_t* sub_scales(const Weights& w, int bits, int kind, int64_t blocks, int64_t g, int64_t b) {
  const int64_t record = g * (blocks / SUPER) + b / SUPER;
  return w.codes + record * record_bytes(bits, kind) + SUPER * code_bytes(bits);
}

// v(q) of input j (0..31) of lane `lane`'s row in a block of codes: the code, or its codebook value + 128.
inline int block_code(const uint8_t* block, int bits, int kind, int lane, int j) {
  const int quad = j / 4, byte = 4 * lane + j % 4, low = low_bits(bits);
  if (bits == 8) return block[quad * 64 + byte];
  int code = (block[(quad % low) * 64 + byte] >> (low * (quad / low))) & ((1 << low) - 1);
  for (int p = 0; p < bits - low; ++p) code |= ((block[64 * low + p * 64 + byte] >> quad) & 1) << (low + p);
  return codebook(kind) ? IQ4_UNSIGNED[code] : code;
}

// d and m of lane `lane` at input j of block b in group g.
inline void block_factors(const Weights& w, int64_t blocks, int64_t g, int64_t b, int j, int lane, float& d, float& m) {
  if (w.kind == BLOCKS) {
    const int64_t at = (g * blocks + b) * LANES + lane;
    d = half_to_float(w.scales[at]), m = half_to_float(w.offsets[at]);
    return;
  }
  if (w.kind == FP8 || w.kind == CODEBOOK) {
    const int64_t at = (g * blocks + b) * LANES + lane;
    d = w.kind == FP8 ? fp32_scales(w)[at] : half_to_float(w.scales[at]), m = w.kind == FP8 ? 0.f : -128.f * d;
    return;
  }
  const int64_t super_at = (g * (blocks / SUPER) + b / SUPER) * LANES + lane;
  const uint8_t* sub = sub_scales(w, w.bits, w.kind, blocks, g, b);
  if (w.kind == SUPER_MINS) {
    d = half_to_float(w.scales[super_at]) * static_cast<float>(sub[(b % SUPER) * LANES + lane]);
    m = half_to_float(w.offsets[super_at]) * static_cast<float>(sub[128 + (b % SUPER) * LANES + lane]);
    return;
  }
  const int entry = halves(w.kind) == 2 ? 2 * (b % SUPER) + j / 16 : b % SUPER;
  if (w.kind == SUPER_MINS16) {
    const uint8_t both = sub[entry * LANES + lane];
    d = half_to_float(w.scales[super_at]) * static_cast<float>(both & 15);
    m = half_to_float(w.offsets[super_at]) * static_cast<float>(both >> 4);
    return;
  }
  d = half_to_float(w.scales[super_at]) * static_cast<float>(static_cast<int8_t>(sub[entry * LANES + lane]));
  m = -static_cast<float>(w.kind == SUPER_CODEBOOK ? 128 : 1 << (w.bits - 1)) * d;
}

// f(bits, kind) with both as compile-time constants, for the formats the kernels are built for; false for another.
// FP8 only with FLOAT_CODES (the bf16 GEMM's formats): its codes are not integers, the integer kernels have no
// instance for it.
template <bool FLOAT_CODES = false, typename F>
bool by_format(int bits, int kind, F&& f) {
  using std::integral_constant;
  if constexpr (FLOAT_CODES)
    if (kind == FP8 && bits == 8) return f(integral_constant<int, 8>{}, integral_constant<int, FP8>{}), true;
  if (kind == BLOCKS && bits == 4) return f(integral_constant<int, 4>{}, integral_constant<int, BLOCKS>{}), true;
  if (kind == BLOCKS && bits == 5) return f(integral_constant<int, 5>{}, integral_constant<int, BLOCKS>{}), true;
  if (kind == BLOCKS && bits == 8) return f(integral_constant<int, 8>{}, integral_constant<int, BLOCKS>{}), true;
  if (kind == SUPER_MINS && bits == 4) return f(integral_constant<int, 4>{}, integral_constant<int, SUPER_MINS>{}), true;
  if (kind == SUPER_MINS && bits == 5) return f(integral_constant<int, 5>{}, integral_constant<int, SUPER_MINS>{}), true;
  if (kind == SUPER_CENTRED && bits == 6)
    return f(integral_constant<int, 6>{}, integral_constant<int, SUPER_CENTRED>{}), true;
  if (kind == SUPER_CENTRED && bits == 3)
    return f(integral_constant<int, 3>{}, integral_constant<int, SUPER_CENTRED>{}), true;
  if (kind == SUPER_MINS16 && bits == 2)
    return f(integral_constant<int, 2>{}, integral_constant<int, SUPER_MINS16>{}), true;
  if (kind == CODEBOOK && bits == 4) return f(integral_constant<int, 4>{}, integral_constant<int, CODEBOOK>{}), true;
  if (kind == SUPER_CODEBOOK && bits == 4)
    return f(integral_constant<int, 4>{}, integral_constant<int, SUPER_CODEBOOK>{}), true;
  return false;
}

#if TIFFIN_VNNI
// Quads t (lo) and t + 4 (hi) of a block's codes as whole values v(q), one a byte (t = 0..3); at 8 bits, register t
// (0..7) in lo. The codebook kinds' 4-bit codes are looked up in registers (vpshufb: 16 entries in each 128 bits).
template <int BITS, int KIND = BLOCKS>
inline void load_quads(const uint8_t* block, int t, __m512i& lo, __m512i& hi) {
  if constexpr (BITS == 8) {
    lo = _mm512_loadu_si512(block + t * 64);
    return;
  }
  constexpr int L = low_bits(BITS);
  const __m512i v = _mm512_loadu_si512(block + (t % L) * 64), mask = _mm512_set1_epi8((1 << L) - 1);
  if constexpr (L == 4) {  // nibbles: quad t low, t + 4 high
    lo = _mm512_and_si512(v, mask);
    hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
  } else {  // 2-bit fields: quad t's at 2 (t / 2), quad t + 4's 4 bits above it
    lo = _mm512_and_si512(_mm512_srl_epi16(v, _mm_cvtsi32_si128(2 * (t / 2))), mask);
    hi = _mm512_and_si512(_mm512_srl_epi16(v, _mm_cvtsi32_si128(2 * (t / 2) + 4)), mask);
  }
  for (int p = 0; p < BITS - L; ++p) {  // a set plane bit adds 1 << (L + p) to its code
    const __m512i plane = _mm512_loadu_si512(block + 64 * L + p * 64);
    const __m512i bit = _mm512_set1_epi8(static_cast<char>(1 << (L + p)));
    lo = _mm512_mask_add_epi8(lo, _mm512_test_epi8_mask(plane, _mm512_set1_epi8(static_cast<char>(1 << t))), lo, bit);
    hi = _mm512_mask_add_epi8(hi, _mm512_test_epi8_mask(plane, _mm512_set1_epi8(static_cast<char>(16 << t))), hi, bit);
  }
  if constexpr (codebook(KIND)) {
    const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(IQ4_UNSIGNED)));
    lo = _mm512_shuffle_epi8(table, lo), hi = _mm512_shuffle_epi8(table, hi);
  }
}

// Quad `quad` (inputs 4 quad .. 4 quad + 3) of every lane's values v(q), one a byte.
template <int BITS, int KIND = BLOCKS>
inline __m512i quad_codes(const uint8_t* block, int quad) {
  __m512i lo, hi;
  load_quads<BITS, KIND>(block, BITS == 8 ? quad : quad % 4, lo, hi);
  return BITS == 8 || quad < 4 ? lo : hi;
}

inline __m512 fp16x16(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

// Sixteen bytes as fp32, unsigned or signed.
template <bool SIGNED>
inline __m512 bytes_x16(const uint8_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(SIGNED ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v));
}

// The 16 lanes' d and m of block b (half-block h for the kinds with two halves) in group g.
template <int BITS, int KIND>
inline void factors(const Weights& w, int64_t blocks, int64_t g, int64_t b, int h, __m512& d, __m512& m) {
  if constexpr (KIND == BLOCKS) {
    const int64_t at = (g * blocks + b) * LANES;
    d = fp16x16(w.scales + at), m = fp16x16(w.offsets + at);
    return;
  }
  if constexpr (KIND == FP8) {
    d = _mm512_loadu_ps(fp32_scales(w) + (g * blocks + b) * LANES), m = _mm512_setzero_ps();
    return;
  }
  if constexpr (KIND == CODEBOOK) {
    d = fp16x16(w.scales + (g * blocks + b) * LANES), m = _mm512_mul_ps(d, _mm512_set1_ps(-128.f));
    return;
  }
  const int64_t super_at = (g * (blocks / SUPER) + b / SUPER) * LANES;
  const uint8_t* sub = sub_scales(w, BITS, KIND, blocks, g, b);
  if constexpr (KIND == SUPER_MINS) {
    d = _mm512_mul_ps(fp16x16(w.scales + super_at), bytes_x16<false>(sub + (b % SUPER) * LANES));
    m = _mm512_mul_ps(fp16x16(w.offsets + super_at), bytes_x16<false>(sub + 128 + (b % SUPER) * LANES));
  } else if constexpr (KIND == SUPER_MINS16) {  // sc | mn << 4
    const uint8_t* at = sub + (2 * (b % SUPER) + h) * LANES;
    const __m512i both = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)));
    d = _mm512_mul_ps(fp16x16(w.scales + super_at), _mm512_cvtepi32_ps(_mm512_and_si512(both, _mm512_set1_epi32(15))));
    m = _mm512_mul_ps(fp16x16(w.offsets + super_at), _mm512_cvtepi32_ps(_mm512_srli_epi32(both, 4)));
  } else {
    const int entry = KIND == SUPER_CODEBOOK ? b % SUPER : 2 * (b % SUPER) + h;
    d = _mm512_mul_ps(fp16x16(w.scales + super_at), bytes_x16<true>(sub + entry * LANES));
    m = _mm512_mul_ps(d, _mm512_set1_ps(-static_cast<float>(KIND == SUPER_CODEBOOK ? 128 : 1 << (BITS - 1))));
  }
}
#endif

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
extern "C" void tiffin_bf16_gemm(int dtype, const void* x, int64_t x_stride, int64_t m, int64_t k, const Weights& w,
                                 int out_dtype, void* y, int64_t y_stride, int threads);

// The W8A8 GEMM (cpu_quant_w8a8.cpp) of per-token weights: from tiffin_w8a8_min_rows() rows on (-1: not built).
extern "C" int64_t tiffin_w8a8_min_rows();
extern "C" void tiffin_w8a8_gemm(int dtype, const void* x, int64_t x_stride, int64_t m, int64_t k, const Weights& w,
                                 int out_dtype, void* y, int64_t y_stride, int threads);
