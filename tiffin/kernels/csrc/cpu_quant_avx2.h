// cpu_quant.cpp's integer tile for x86 CPUs with AVX2 but no AVX-512 VNNI (AMD Zen 2/3, Intel before Ice Lake),
// llama.cpp's AVX2 scheme on tiffin's layout: a 256-bit register holds 8 of a group's 16 rows (bytes 32 half ..
// 32 half + 31 of each 64-byte register of codes), `vpmaddubsw` multiplies u8 codes by s8 activations and sums
// adjacent pairs into int16 lanes, and `vpmaddwd` by ones widens those to one int32 a row and quad, as `vpdpbusd`
// does in one step.
//
// int16 holds a pair only below 2 * 127 * 129: codes up to 129 are multiplied as they are, and int16 lanes gather
// as many pair sums as stay below 2^15 before widening (a whole block of 4-bit codes). Wider codes (8 bits, the
// codebook kinds' values + 128) are taken less 128, as signed s in -128..127 of magnitude at most 128, multiplied
// as |s| (unsigned) by the activation with s's sign, and the block's dot product gets back 128 * sum(qx): exact
// integers either way, the fp32 scaling is the VNNI tile's. 8-bit codes at two activation levels take
// `avx2_bytes_tile` instead (int16 products of the whole activation).
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>

#include "cpu_blocks.h"

#if TIFFIN_AVX2
namespace {

inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline __m256i bytes32(int v) { return _mm256_set1_epi8(static_cast<char>(v)); }

// f(integral_constant<int, 0>) .. f(integral_constant<int, N - 1>), in order: a loop whose index is a constant
template <typename F, int... I>
inline void unroll_each(F&& f, std::integer_sequence<int, I...>) {
  (f(std::integral_constant<int, I>{}), ...);
}
template <int N, typename F>
inline void unroll(F&& f) {
  unroll_each(f, std::make_integer_sequence<int, N>{});
}

// v's 16-bit lanes shifted left by S (right by -S where S < 0; S = 0: v).
template <int S>
inline __m256i shift16(const __m256i& v) {
  if constexpr (S > 0) return _mm256_slli_epi16(v, S);
  else if constexpr (S < 0) return _mm256_srli_epi16(v, -S);
  else return v;
}

// Bit FROM of each byte of v at bit TO, the byte's other bits cleared. The bits a shift carries across a byte
// boundary land below TO (left) or above it (right): the mask drops them.
template <int FROM, int TO>
inline __m256i move_bit(const __m256i& v) {
  return _mm256_and_si256(shift16<TO - FROM>(v), bytes32(1 << TO));
}

// cpu_blocks.h's load_quads for the 8 lanes at `block` (a block's codes, 32 bytes into them for lanes 8..15):
// quad T's codes in lo, quad T + 4's in hi (below 8 bits).
template <int BITS, int KIND, int T>
inline void load_quads8(const uint8_t* block, __m256i& lo, __m256i& hi) {
  if constexpr (BITS == 8) {
    lo = load32(block + T * 64);
    return;
  }
  constexpr int L = low_bits(BITS), SHIFT = L == 4 ? 0 : 2 * (T / 2);  // 2-bit fields: quad T's at 2 (T / 2)
  const __m256i v = load32(block + (T % L) * 64), mask = bytes32((1 << L) - 1);
  lo = _mm256_and_si256(shift16<-SHIFT>(v), mask);
  hi = _mm256_and_si256(shift16<-SHIFT - 4>(v), mask);
  unroll<BITS - L>([&](auto plane) {  // plane p holds bit L + p of quad q's codes at bit q of each byte
    constexpr int P = decltype(plane)::value;
    const __m256i bits = load32(block + 64 * (L + P));
    lo = _mm256_or_si256(lo, move_bit<T, L + P>(bits));
    hi = _mm256_or_si256(hi, move_bit<T + 4, L + P>(bits));
  });
  if constexpr (codebook(KIND)) {
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(IQ4_UNSIGNED)));
    lo = _mm256_shuffle_epi8(table, lo), hi = _mm256_shuffle_epi8(table, hi);
  }
}

inline __m256 fp16x8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

template <bool SIGNED>
inline __m256 bytes_x8(const uint8_t* p) {
  const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(SIGNED ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v));
}

// cpu_blocks.h's `factors` for lanes lane0..lane0+7.
template <int BITS, int KIND>
inline void factors8(const Weights& w, int64_t blocks, int64_t g, int64_t b, int h, int lane0, __m256& d, __m256& m) {
  if constexpr (KIND == BLOCKS || KIND == CODEBOOK) {
    const int64_t at = (g * blocks + b) * LANES + lane0;
    d = fp16x8(w.scales + at);
    m = KIND == BLOCKS ? fp16x8(w.offsets + at) : _mm256_mul_ps(d, _mm256_set1_ps(-128.f));
    return;
  }
  const int64_t super_at = (g * (blocks / SUPER) + b / SUPER) * LANES + lane0;
  const uint8_t* sub = sub_scales(w, BITS, KIND, blocks, g, b) + lane0;
  if constexpr (KIND == SUPER_MINS) {
    d = _mm256_mul_ps(fp16x8(w.scales + super_at), bytes_x8<false>(sub + (b % SUPER) * LANES));
    m = _mm256_mul_ps(fp16x8(w.offsets + super_at), bytes_x8<false>(sub + 128 + (b % SUPER) * LANES));
  } else if constexpr (KIND == SUPER_MINS16) {  // sc | mn << 4
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sub + (2 * (b % SUPER) + h) * LANES));
    const __m256i both = _mm256_cvtepu8_epi32(bytes);
    d = _mm256_mul_ps(fp16x8(w.scales + super_at), _mm256_cvtepi32_ps(_mm256_and_si256(both, _mm256_set1_epi32(15))));
    m = _mm256_mul_ps(fp16x8(w.offsets + super_at), _mm256_cvtepi32_ps(_mm256_srli_epi32(both, 4)));
  } else {
    const int entry = KIND == SUPER_CODEBOOK ? b % SUPER : 2 * (b % SUPER) + h;
    d = _mm256_mul_ps(fp16x8(w.scales + super_at), bytes_x8<true>(sub + entry * LANES));
    m = _mm256_mul_ps(d, _mm256_set1_ps(-static_cast<float>(KIND == SUPER_CODEBOOK ? 128 : 1 << (BITS - 1))));
  }
}

// acc[i]: activation row m0 + i's outputs at lanes 8 half .. 8 half + 7 of row group g.
template <int MC>
inline void store8(const __m256 (&acc)[MC], int64_t m0, const Weights& w, int64_t g, int half, void* y, int out_dtype,
                   int64_t y_stride) {
  const int64_t n0 = g * LANES + 8 * half, lanes = std::min<int64_t>(8, w.n - n0);
  for (int i = 0; i < MC; ++i) {
    const int64_t at = (m0 + i) * y_stride + n0;
    if (out_dtype == 0 && lanes == 8) {
      _mm256_storeu_ps(static_cast<float*>(y) + at, acc[i]);
      continue;
    }
    alignas(32) float out[8];
    _mm256_store_ps(out, acc[i]);
    for (int l = 0; l < lanes; ++l) store_value(y, out_dtype, at + l, out[l]);
  }
}

// Activation rows m0..m0+MC against lanes 8 half .. 8 half + 7 of row group g: `Acts` is cpu_quant.cpp's.
template <int BITS, int KIND, int LEVELS, int MC, typename Acts>
void avx2_tile(const Acts& a, int64_t m0, const Weights& w, int64_t g, int half, void* y, int out_dtype,
               int64_t y_stride) {
  constexpr int H = halves(KIND), T = BITS == 8 ? 8 : 4;  // quads t: t and t + 4 below 8 bits
  constexpr bool WIDE = BITS == 8 || codebook(KIND);
  constexpr int TOP = WIDE ? 128 : (1 << BITS) - 1;  // the largest unsigned factor of a product
  constexpr int PER_T = H == 1 && BITS < 8 ? 2 : 1;  // pair sums a quad step adds to each int16 lane
  constexpr int GATHER = 32767 / (2 * 127 * TOP) / PER_T;  // quad steps int16 lanes hold (0: widen each product)
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[MC];
  for (int i = 0; i < MC; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < a.blocks; ++b) {
    const uint8_t* codes = block_codes(w, BITS, KIND, a.blocks, g, b) + 32 * half;
    __m256i dots[LEVELS][H][MC], pairs[LEVELS][H][MC];
    for (int l = 0; l < LEVELS; ++l)
      for (int h = 0; h < H; ++h)
        for (int i = 0; i < MC; ++i) dots[l][h][i] = pairs[l][h][i] = _mm256_setzero_si256();
    unroll<T>([&](auto step) {
      constexpr int t = decltype(step)::value;
      __m256i lo, hi;
      load_quads8<BITS, KIND, t>(codes, lo, hi);
      if constexpr (WIDE) lo = _mm256_xor_si256(lo, bytes32(0x80)), hi = _mm256_xor_si256(hi, bytes32(0x80));
      const __m256i abs_lo = WIDE ? _mm256_abs_epi8(lo) : lo, abs_hi = WIDE ? _mm256_abs_epi8(hi) : hi;
      auto add = [&](int l, int h, int i, const __m256i& codes_abs, const __m256i& codes_signed, const int8_t* quad) {
        int32_t four;
        std::memcpy(&four, quad, 4);
        __m256i act = _mm256_set1_epi32(four);
        if constexpr (WIDE) act = _mm256_sign_epi8(act, codes_signed);
        const __m256i p = _mm256_maddubs_epi16(codes_abs, act);
        if constexpr (GATHER == 0) dots[l][h][i] = _mm256_add_epi32(dots[l][h][i], _mm256_madd_epi16(p, ones));
        else pairs[l][h][i] = _mm256_add_epi16(pairs[l][h][i], p);
      };
      for (int i = 0; i < MC; ++i) {
        for (int l = 0; l < LEVELS; ++l) {
          const int8_t* q = (l == 0 ? a.q.data() : a.q2.data()) + (m0 + i) * a.k + b * QK;
          add(l, 0, i, abs_lo, lo, q + 4 * t);
          if constexpr (BITS < 8) add(l, H - 1, i, abs_hi, hi, q + 4 * (t + 4));
        }
      }
      if constexpr (GATHER > 0 && ((t + 1) % GATHER == 0 || t == T - 1)) {
        for (int l = 0; l < LEVELS; ++l)
          for (int h = 0; h < H; ++h)
            for (int i = 0; i < MC; ++i) {
              dots[l][h][i] = _mm256_add_epi32(dots[l][h][i], _mm256_madd_epi16(pairs[l][h][i], ones));
              pairs[l][h][i] = _mm256_setzero_si256();
            }
      }
    });
    for (int h = 0; h < H; ++h) {
      __m256 d, m;
      factors8<BITS, KIND>(w, a.blocks, g, b, h, 8 * half, d, m);
      for (int i = 0; i < MC; ++i) {
        const int64_t row = (m0 + i) * a.blocks + b;
        __m256i dot = dots[0][h][i];
        if constexpr (LEVELS == 2)  // 127 q1 + q2: (x << 7) - x + rest
          dot = _mm256_add_epi32(_mm256_sub_epi32(_mm256_slli_epi32(dot, 7), dot), dots[1][h][i]);
        if constexpr (WIDE)  // (s + 128) x = s x + 128 x, a block's (WIDE kinds scale blocks whole)
          dot = _mm256_add_epi32(dot, _mm256_set1_epi32(128 * (a.isum[2 * row] + a.isum[2 * row + 1])));
        const float sx = H == 2 ? a.sxh[2 * row + h] : a.sx[row];
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d, _mm256_set1_ps(a.dx[row])), acc[i]);
        acc[i] = _mm256_fmadd_ps(m, _mm256_set1_ps(sx), acc[i]);
      }
    }
  }
  store8(acc, m0, w, g, half, y, out_dtype, y_stride);
}

// avx2_tile for 8-bit codes (KIND BLOCKS) at two levels: codes widened to int16 as they load and multiplied by the
// activation's whole integer (`Acts::wide`: 127 q + q2, |x| <= 16256) in `vpmaddwd`, whose int32 pair sums hold
// 255 x 16256 twice: one product, not one a level, and no sign trick (in cache 11-25% faster on an AVX2 EPYC;
// at one level the byte tile's single `vpmaddubsw` stays ahead). A register's 32 bytes are 8 rows' 4 codes;
// widened, 4 rows each, whose two pair sums a row the block's end adds (`vphaddd`) and puts back in row order.
template <int MC, typename Acts>
void avx2_bytes_tile(const Acts& a, int64_t m0, const Weights& w, int64_t g, int half, void* y, int out_dtype,
                     int64_t y_stride) {
  __m256 acc[MC];
  for (int i = 0; i < MC; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < a.blocks; ++b) {
    const uint8_t* codes = block_codes(w, 8, BLOCKS, a.blocks, g, b) + 32 * half;
    __m256i rows03[MC], rows47[MC];
    for (int i = 0; i < MC; ++i) rows03[i] = rows47[i] = _mm256_setzero_si256();
    unroll<8>([&](auto step) {
      constexpr int t = decltype(step)::value;
      const __m128i* at = reinterpret_cast<const __m128i*>(codes + t * 64);
      const __m256i c03 = _mm256_cvtepu8_epi16(_mm_loadu_si128(at)), c47 = _mm256_cvtepu8_epi16(_mm_loadu_si128(at + 1));
      for (int i = 0; i < MC; ++i) {
        int64_t four;
        std::memcpy(&four, &a.wide[(m0 + i) * a.k + b * QK + 4 * t], 8);
        const __m256i x = _mm256_set1_epi64x(four);
        rows03[i] = _mm256_add_epi32(rows03[i], _mm256_madd_epi16(c03, x));
        rows47[i] = _mm256_add_epi32(rows47[i], _mm256_madd_epi16(c47, x));
      }
    });
    __m256 d, m;
    factors8<8, BLOCKS>(w, a.blocks, g, b, 0, 8 * half, d, m);
    for (int i = 0; i < MC; ++i) {
      const int64_t row = (m0 + i) * a.blocks + b;
      // 128-bit lanes: [r0 r1 r4 r5] [r2 r3 r6 r7] -> r0..r7
      const __m256i dot = _mm256_permute4x64_epi64(_mm256_hadd_epi32(rows03[i], rows47[i]), 0xD8);
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d, _mm256_set1_ps(a.dx[row])), acc[i]);
      acc[i] = _mm256_fmadd_ps(m, _mm256_set1_ps(a.sx[row]), acc[i]);
    }
  }
  store8(acc, m0, w, g, half, y, out_dtype, y_stride);
}

}  // namespace
#endif
