// Prompt-sized inputs of quantized layers, bound by arithmetic rather than by reading the weights: each task turns
// its row groups' blocks (cpu_quant.cpp's layout) into bf16 weights once (`q * d + m` in fp32, rounded to nearest
// even), in the pairs `vdpbf16ps` reads (lane l: row l's inputs 2j, 2j + 1), and multiplies every row of bf16
// activations by them, accumulating in fp32 across the whole input. AVX-512 BF16 (Zen 4 and later, Xeon from
// Cooper Lake), or Intel AMX tiles where the CPU has them (Sapphire Rapids on: ~5x the dot products at 64 rows,
// ~10x at 512); elsewhere `tiffin_bf16_gemm_built` says 0 and cpu_quant.cpp's integer kernels serve every size
// (FP8 weights, whose e4m3 codes are no integers, then none: tiffin_block_gemm refuses them). FP8 runs here at every
// number of rows, decode included.
#include <algorithm>
#include <cstdint>
#include <vector>

#include <omp.h>

#include "cpu_blocks.h"

#if TIFFIN_VNNI && defined(__AVX512BF16__)
namespace {

constexpr int64_t TILE = 256;  // uint32 an AMX tile: 16 rows of 64 bytes

// AMX operands are placed apart by whole tiles: `tiles` rounded up to `residue` modulo 4, so that a step's four tiles
// (two of activations, two of weights) sit in different quarters of every 4 KB: different L1 sets, and no 4K
// aliasing against the decoder's stores. Tiles K / 32 KB apart (the same quarter wherever K is a multiple of 128)
// in buffers wherever malloc put them made the same call ~1.3-1.5x slower in some processes than in others.
constexpr int64_t spread(int64_t tiles, int64_t residue) { return tiles + ((residue - tiles) % 4 + 4) % 4; }

// p rounded up to a 4 KB boundary, plus `quarter` KB.
inline uint32_t* placed(uint32_t* p, int quarter) {
  const uintptr_t at = (reinterpret_cast<uintptr_t>(p) + 4095) / 4096 * 4096 + quarter * 1024;
  return reinterpret_cast<uint32_t*>(at);
}

// 16 fp32 outputs (the first `lanes`) to y's elements at.., as out_dtype: store_value's roundings in a register.
inline void store_row(__m512 v, void* y, int out_dtype, int64_t at, int64_t lanes) {
  const __mmask16 keep = lanes >= LANES ? 0xFFFF : static_cast<__mmask16>((1u << lanes) - 1);
  if (out_dtype == 0) return _mm512_mask_storeu_ps(static_cast<float*>(y) + at, keep, v);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  __m256i h;
  if (out_dtype == 2) {  // nearest even by integer carry: store_value's bits, denormals included
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i carried = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
    h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(carried, 16));
    h = _mm256_mask_blend_epi16(nan, h, _mm256_set1_epi16(0x7FC0));
  } else {  // NaN as store_value writes it: the sign, a quiet NaN without payload
    h = _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256i quiet = _mm256_or_si256(_mm256_and_si256(h, _mm256_set1_epi16(static_cast<short>(0x8000))),
                                          _mm256_set1_epi16(0x7E00));
    h = _mm256_mask_blend_epi16(nan, h, quiet);
  }
  _mm256_mask_storeu_epi16(static_cast<uint16_t*>(y) + at, keep, h);
}

// FP8: a register of 64 e4m3 codes (lane l's inputs 4t..4t+3 in bytes 4l..4l+3) as fp16 bits of value / 256, its
// even bytes (inputs 4t, 4t + 2) and odd ones (4t + 1, 4t + 3) a 16-bit lane each: the sign, then exponent and
// mantissa one bit lower (bias 7 against fp16's 15). A code in a 16-bit lane's high byte shifted right
// arithmetically by one: the sign twice, then the 7 bits; the mask drops the copy and what lay below. fp16's
// subnormals are e4m3's (exponent 0: m 2^-9 = m 2^-17 * 256), and vcvtph2ps widens them exactly whatever DAZ says,
// where fp32 bit tricks would meet fp32 denormals.
inline void e4m3_halves(__m512i v, __m512i& even, __m512i& odd) {
  const __m512i mask = _mm512_set1_epi16(static_cast<short>(0xBF80));
  even = _mm512_and_si512(_mm512_srai_epi16(_mm512_slli_epi16(v, 8), 1), mask);
  odd = _mm512_and_si512(_mm512_srai_epi16(v, 1), mask);
}

// e4m3_halves' fp16 (32-bit lane l: row l's two inputs) times d, as bf16 rounded to nearest even, in the same places.
// vcvtph2ps widens a 256-bit half at a time, rows 0..7 then 8..15 with each row's two values side by side: the
// scales come so (`d_lo`, `d_hi`: 256 d, each row's twice).
inline __m512i fp8_products(__m512i h, __m512 d_lo, __m512 d_hi) {
  const __m512 lo = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(h)), d_lo);
  const __m512 hi = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1)), d_hi);
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

// FP8 block b of group g's scales times 256 (the fp16 codes' 2^-8), for fp8_products: rows 0..7 and 8..15 each twice.
inline void fp8_scales(const Weights& w, int64_t blocks, int64_t g, int64_t b, __m512& d_lo, __m512& d_hi) {
  const __m512 d = _mm512_mul_ps(_mm512_loadu_ps(fp32_scales(w) + (g * blocks + b) * LANES), _mm512_set1_ps(256.f));
  d_lo = _mm512_permutexvar_ps(_mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0), d);
  const __m512i upper = _mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8);
  d_hi = _mm512_permutexvar_ps(upper, d);
}

// Register t of an FP8 block's codes (inputs 4t..4t+3) as the bf16 pairs of inputs (4t, 4t + 1) and (4t + 2, 4t + 3):
// e4m3(q) * d rounded once, as the reference.
inline void fp8_pairs(const uint8_t* block, int t, __m512 d_lo, __m512 d_hi, __m512i& p01, __m512i& p23) {
  __m512i even, odd;
  e4m3_halves(_mm512_loadu_si512(block + t * 64), even, odd);
  const __m512i e = fp8_products(even, d_lo, d_hi);  // lane l: row l's (4t, 4t + 2)
  const __m512i o = fp8_products(odd, d_lo, d_hi);   // (4t + 1, 4t + 3)
  p01 = _mm512_mask_blend_epi16(0xAAAAAAAA, e, _mm512_slli_epi32(o, 16));
  p23 = _mm512_mask_blend_epi16(0xAAAAAAAA, _mm512_srli_epi32(e, 16), o);
}

// FP8 block b of group g as bf16 pairs (group_to_bf16's layout).
inline void fp8_block_to_bf16(const Weights& w, int64_t blocks, int64_t g, int64_t b, uint32_t* out) {
  const uint8_t* block = block_codes(w, 8, FP8, blocks, g, b);
  __m512 d_lo, d_hi;
  fp8_scales(w, blocks, g, b, d_lo, d_hi);
  for (int t = 0; t < 8; ++t) {
    __m512i p01, p23;
    fp8_pairs(block, t, d_lo, d_hi, p01, p23);
    _mm512_storeu_si512(out + (b * 16 + t * 2) * LANES, p01);
    _mm512_storeu_si512(out + (b * 16 + t * 2 + 1) * LANES, p23);
  }
}

// A few rows of activation pairs `x` (FP8's decode steps) against FP8 row groups g0..g0+GR: each register of codes
// is multiplied as it is turned into bf16, in registers, where group_to_bf16 would stage the pairs in memory for a
// row or two to read once. A tile asks for the next tile's block as it reads its own (a decode step streams every
// weight once; see cpu_quant.cpp's prefetch_block).
template <int MC, int GR>
void fp8_direct_tile(const uint32_t* x, int64_t pairs, const Weights& w, int64_t g0, void* y, int out_dtype,
                     int64_t y_stride) {
  const int64_t blocks = pairs / 16;
  __m512 acc[MC][GR];
  for (int i = 0; i < MC; ++i)
    for (int g = 0; g < GR; ++g) acc[i][g] = _mm512_setzero_ps();
  const bool ahead = (g0 + 2 * GR) * LANES <= w.n;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block[GR];
    __m512 d_lo[GR], d_hi[GR];
    for (int g = 0; g < GR; ++g) {
      if (ahead) {
        const char* next = reinterpret_cast<const char*>(block_codes(w, 8, FP8, blocks, g0 + GR + g, b));
        for (int line = 0; line < 512; line += 64) _mm_prefetch(next + line, _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(fp32_scales(w) + ((g0 + GR + g) * blocks + b) * LANES), _MM_HINT_T1);
      }
      block[g] = block_codes(w, 8, FP8, blocks, g0 + g, b);
      fp8_scales(w, blocks, g0 + g, b, d_lo[g], d_hi[g]);
    }
    for (int t = 0; t < 8; ++t) {
      __m512i p01[GR], p23[GR];
      for (int g = 0; g < GR; ++g) fp8_pairs(block[g], t, d_lo[g], d_hi[g], p01[g], p23[g]);
      for (int i = 0; i < MC; ++i) {
        const __m512bh x01 = (__m512bh)_mm512_set1_epi32(x[i * pairs + b * 16 + 2 * t]);
        const __m512bh x23 = (__m512bh)_mm512_set1_epi32(x[i * pairs + b * 16 + 2 * t + 1]);
        for (int g = 0; g < GR; ++g) {
          acc[i][g] = _mm512_dpbf16_ps(acc[i][g], (__m512bh)p01[g], x01);
          acc[i][g] = _mm512_dpbf16_ps(acc[i][g], (__m512bh)p23[g], x23);
        }
      }
    }
  }
  for (int i = 0; i < MC; ++i) {
    for (int g = 0; g < GR; ++g) {
      const int64_t first = (g0 + g) * LANES;
      store_row(acc[i][g], y, out_dtype, i * y_stride + first, std::min<int64_t>(LANES, w.n - first));
    }
  }
}

template <int MC>
void fp8_direct(const uint32_t* x, int64_t pairs, const Weights& w, void* y, int out_dtype, int64_t y_stride,
                int threads) {
  constexpr int64_t GR = 4;
  const int64_t groups = (w.n + LANES - 1) / LANES;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t g0 = 0; g0 < groups; g0 += GR) {
    if (g0 + GR <= groups) fp8_direct_tile<MC, GR>(x, pairs, w, g0, y, out_dtype, y_stride);
    else
      for (int64_t g = g0; g < groups; ++g) fp8_direct_tile<MC, 1>(x, pairs, w, g, y, out_dtype, y_stride);
  }
}

// A register of codes (byte 4l + j: input j of row l) as 16 dwords: rows 8 half .. 8 half + 7, each its inputs 2p and
// 2p + 1, side by side: what cvtne2ps turns into bf16 pairs in place, with no shuffle after it. One vpermb a
// register, where shifts and masks take two and the pairs a vpermw after.
// pair_index(half, p) picks those bytes, into each dword's low byte.
inline __m512i pair_index(int half, int p) {
  alignas(64) uint8_t at[64] = {};
  for (int i = 0; i < 16; ++i) at[4 * i] = static_cast<uint8_t>(4 * (8 * half + i / 2) + 2 * p + i % 2);
  return _mm512_load_si512(at);
}

inline __m512i pair_codes(__m512i v, __m512i index) {
  return _mm512_maskz_permutexvar_epi8(0x1111111111111111ull, index, v);
}

// Block b of group g as bf16 pairs: out[b * 16 + j] = 16 lanes (rows), each (input 32b + 2j, 32b + 2j + 1).
template <int BITS, int KIND>
inline void block_to_bf16(const Weights& w, int64_t blocks, int64_t g, int64_t b, uint32_t* out) {
  if constexpr (KIND == FP8) {
    fp8_block_to_bf16(w, blocks, g, b, out);
  } else {
    const uint8_t* block = block_codes(w, BITS, KIND, blocks, g, b);
    __m512 d[2], m[2];  // per half-block
    factors<BITS, KIND>(w, blocks, g, b, 0, d[0], m[0]);
    if constexpr (halves(KIND) == 2) factors<BITS, KIND>(w, blocks, g, b, 1, d[1], m[1]);
    else d[1] = d[0], m[1] = m[0];
    // Rows 0..7 and 8..15 (`lo`, `hi`) each row's factor twice, in the order of pair_codes' values.
    const __m512i lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
    const __m512i index[2][2] = {{pair_index(0, 0), pair_index(0, 1)}, {pair_index(1, 0), pair_index(1, 1)}};
    __m512 dl[2], ml[2], dh[2], mh[2];
    for (int h = 0; h < 2; ++h) {
      dl[h] = _mm512_permutexvar_ps(lo, d[h]), ml[h] = _mm512_permutexvar_ps(lo, m[h]);
      dh[h] = _mm512_permutexvar_ps(hi, d[h]), mh[h] = _mm512_permutexvar_ps(hi, m[h]);
    }
    for (int quad = 0; quad < 8; ++quad) {  // inputs 4 quad .. 4 quad + 3 of every row
      const __m512i v = quad_codes<BITS, KIND>(block, quad);
      const int h = quad / 4;
      for (int p = 0; p < 2; ++p) {  // inputs 4 quad + 2p, + 1: rows 0..7 as cvtne2ps's low half, 8..15 its high
        const __m512 a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(pair_codes(v, index[0][p])), dl[h], ml[h]);
        const __m512 c = _mm512_fmadd_ps(_mm512_cvtepi32_ps(pair_codes(v, index[1][p])), dh[h], mh[h]);
        _mm512_storeu_si512(out + (b * 16 + quad * 2 + p) * LANES, (__m512i)_mm512_cvtne2ps_pbh(c, a));
      }
    }
  }
}

// Group g's weights as bf16 pairs: out[j] = 16 lanes (rows), each (input 2j, input 2j + 1).
template <int BITS, int KIND>
void group_to_bf16(const Weights& w, int64_t blocks, int64_t g, uint32_t* out) {
  for (int64_t b = 0; b < blocks; ++b) block_to_bf16<BITS, KIND>(w, blocks, g, b, out);
}

// Rows m0..m0+MC of bf16 activation pairs `x` against GR row groups' bf16 weight pairs `wb` (`pairs` each): MC x
// GR accumulators, GR weight loads and MC broadcasts a pair of inputs, so that loads do not bound the dot products.
template <int MC, int GR>
void bf16_tile(const uint32_t* x, int64_t pairs, const uint32_t* wb, int64_t m0, void* y, int out_dtype,
               int64_t y_stride, int64_t n0, int64_t n) {
  __m512 acc[MC][GR];
  for (int i = 0; i < MC; ++i)
    for (int g = 0; g < GR; ++g) acc[i][g] = _mm512_setzero_ps();
  for (int64_t j = 0; j < pairs; ++j) {
    __m512bh wv[GR];
    for (int g = 0; g < GR; ++g) wv[g] = (__m512bh)_mm512_loadu_si512(wb + (g * pairs + j) * LANES);
    for (int i = 0; i < MC; ++i) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(x[(m0 + i) * pairs + j]);
      for (int g = 0; g < GR; ++g) acc[i][g] = _mm512_dpbf16_ps(acc[i][g], wv[g], xv);
    }
  }
  for (int i = 0; i < MC; ++i) {
    for (int g = 0; g < GR; ++g) {
      const int64_t first = n0 + g * LANES;
      store_row(acc[i][g], y, out_dtype, (m0 + i) * y_stride + first, std::min<int64_t>(LANES, n - first));
    }
  }
}

#if TIFFIN_AMX
// AMX: the same bf16 pairs through tiles of 16 rows of 64 bytes: activations 16 rows x 32 inputs, weights 16 pairs x
// 16 rows (block_to_bf16's layout is already the one `tdpbf16ps` reads), sums 16 x 16 fp32. Two activation tiles
// and two weight tiles feed four sums a step of 32 inputs. The activations are stored tile by tile (`xt`: tile
// (r, s), rows 16r.. and inputs 32s.., 1 KB at (r * xs + s) * TILE): a tile of rows K * 2 bytes apart would put
// its 16 lines in a few sets of L1 (all in one where K is a multiple of 2048), and the prefetchers follow a
// contiguous stream. On the Xeon measured a tile load costs about three products (~17 ns against ~5.3), so the
// loads, not the products, bound the multiply: four a step for four products is the fewest eight tiles allow.

struct NoFeed {
  void operator()() {}
};

// Turns blocks b0..b0 + chunk of `count` row groups from g into bf16 pairs (group i's block b0 + s at out + (i *
// stride + s) * TILE), spread evenly over `calls` calls: the vector units decode the next chunk between the tile
// unit's steps on the current one (~10% faster at 16-512 rows than decoding, then multiplying).
template <int BITS, int KIND>
struct Decoder {
  const Weights& w;
  int64_t blocks, g, count, b0, chunk;
  uint32_t* out;
  int64_t stride, calls, credit = 0, group = 0, block = 0;

  void one() {
    block_to_bf16<BITS, KIND>(w, blocks, g + group, b0 + block, out + (group * stride - b0) * TILE);
    if (++block == chunk) block = 0, ++group;
  }
  void operator()() {  // count * chunk blocks over `calls` calls, Bresenham's way
    for (credit += count * chunk; credit >= calls; credit -= calls) one();
  }
  void finish() {
    while (group < count) one();
  }
};

// Activation tiles r0, r0 + 1 (MR of them) against NR row groups' weight tiles (`wb`, group i's at wb + i * stride *
// TILE) for `steps` steps from s0, feeding `feed` a step. Sums in tiles 0..3 (activations in 4, 5, weights in 6, 7),
// which wait in `sums` (tile (r, i) at (r0 + r) * 2 + i) between chunks of steps, and go to y after the last.
template <int MR, int NR, typename Feed>
void amx_chunk(const uint32_t* xt, int64_t xs, int64_t s0, int64_t steps, const uint32_t* wb, int64_t stride,
               float* sums, bool first, bool last, int64_t r0, int64_t m, void* y, int out_dtype, int64_t y_stride,
               int64_t n0, int64_t n, Feed&& feed) {
  float* c = sums + r0 * 2 * TILE;
  if (first) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  } else {
    _tile_loadd(0, c, 64);
    if constexpr (NR == 2) _tile_loadd(1, c + TILE, 64);
    if constexpr (MR == 2) _tile_loadd(2, c + 2 * TILE, 64);
    if constexpr (MR == 2 && NR == 2) _tile_loadd(3, c + 3 * TILE, 64);
  }
  const uint32_t* x0 = xt + (r0 * xs + s0) * TILE;
  const uint32_t* x1 = x0 + xs * TILE;
  const uint32_t* w1 = wb + stride * TILE;
  for (int64_t s = 0; s < steps; ++s) {
    _tile_loadd(4, x0 + s * TILE, 64);
    if constexpr (MR == 2) _tile_loadd(5, x1 + s * TILE, 64);
    _tile_loadd(6, wb + s * TILE, 64);
    if constexpr (NR == 2) _tile_loadd(7, w1 + s * TILE, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NR == 2) _tile_dpbf16ps(1, 4, 7);
    if constexpr (MR == 2) _tile_dpbf16ps(2, 5, 6);
    if constexpr (MR == 2 && NR == 2) _tile_dpbf16ps(3, 5, 7);
    feed();
  }
  _tile_stored(0, c, 64);
  if constexpr (NR == 2) _tile_stored(1, c + TILE, 64);
  if constexpr (MR == 2) _tile_stored(2, c + 2 * TILE, 64);
  if constexpr (MR == 2 && NR == 2) _tile_stored(3, c + 3 * TILE, 64);
  if (!last) return;
  for (int r = 0; r < MR; ++r) {
    const int64_t row0 = (r0 + r) * 16;
    for (int i = 0; i < NR; ++i) {
      const int64_t at = n0 + i * LANES, lanes = std::min<int64_t>(LANES, n - at);
      for (int j = 0; j < 16 && row0 + j < m; ++j)
        store_row(_mm512_loadu_ps(c + (r * 2 + i) * TILE + j * 16), y, out_dtype, (row0 + j) * y_stride + at, lanes);
    }
  }
}

// The calling thread's row groups g0..g1 against every activation row, a pair of groups and a chunk of up to CHUNK
// steps at a time (the whole input up to 2048 inputs: sums kept in tiles beat smaller chunks, whose sums a tile
// store and load each carry over), the next pair or chunk decoded into the other half of a double buffer meanwhile.
template <int BITS, int KIND>
void amx_groups(const uint32_t* xt, int64_t xs, int64_t m, int64_t steps, const Weights& w, int64_t g0, int64_t g1,
                void* y, int out_dtype, int64_t y_stride) {
  constexpr int64_t CHUNK = 64;
  if (g0 >= g1) return;
  const int64_t chunk = std::min(steps, CHUNK), tiles = (m + 15) / 16;
  thread_local std::vector<uint32_t> buffer;  // kept: fresh ones would fault their pages in every call
  thread_local std::vector<float> sums;
  const int64_t gs = spread(chunk, 1), hs = spread(2 * gs, 0);  // tiles from group to group, half to half
  buffer.resize(2 * hs * TILE + 2048);
  sums.resize((tiles + 1) * 2 * TILE);
  uint32_t* const base = placed(buffer.data(), 2);  // weights at 2 KB and 3 KB of every 4 KB, activations 0 and 1
  auto half = [&](int64_t item) { return base + item % 2 * hs * TILE; };
  const int64_t chunks = (steps + chunk - 1) / chunk, items = (g1 - g0 + 1) / 2 * chunks;
  const int64_t calls = (tiles + 1) / 2;  // feed() calls a step
  auto length = [&](int64_t item) { return std::min(chunk, steps - item % chunks * chunk); };
  auto decoder = [&](int64_t item) {  // fed a step of the item before it: a last chunk may be shorter than its own
    const int64_t g = g0 + item / chunks * 2, s0 = item % chunks * chunk, fed = item ? length(item - 1) : 1;
    return Decoder<BITS, KIND>{w, steps, g, std::min<int64_t>(2, g1 - g), s0, length(item), half(item), gs, calls * fed};
  };
  decoder(0).finish();
  for (int64_t item = 0; item < items; ++item) {
    const int64_t g = g0 + item / chunks * 2, s0 = item % chunks * chunk, len = std::min(chunk, steps - s0);
    const bool two = g + 1 < g1, first = s0 == 0, last = s0 + len == steps;
    auto run = [&](auto&& feed) {
      auto tile = [&](auto mr, auto nr, int64_t r0) {
        amx_chunk<decltype(mr)::value, decltype(nr)::value>(xt, xs, s0, len, half(item), gs, sums.data(), first,
                                                            last, r0, m, y, out_dtype, y_stride, g * LANES, w.n, feed);
      };
      using One = std::integral_constant<int, 1>;
      using Two = std::integral_constant<int, 2>;
      int64_t r0 = 0;
      for (; r0 + 1 < tiles; r0 += 2) two ? tile(Two{}, Two{}, r0) : tile(Two{}, One{}, r0);
      if (r0 < tiles) two ? tile(One{}, Two{}, r0) : tile(One{}, One{}, r0);
    };
    if (item + 1 < items) {
      auto next = decoder(item + 1);
      run(next);
      next.finish();
    } else {
      run(NoFeed{});
    }
  }
}
#else
template <int BITS, int KIND>
void amx_groups(const uint32_t*, int64_t, int64_t, int64_t, const Weights&, int64_t, int64_t, void*, int, int64_t) {}
#endif

template <int GR>
void bf16_rows(const uint32_t* x, int64_t m, int64_t pairs, const uint32_t* wb, void* y, int out_dtype,
               int64_t y_stride, int64_t n0, int64_t n) {
  int64_t m0 = 0;
  for (; m0 + 6 <= m; m0 += 6) bf16_tile<6, GR>(x, pairs, wb, m0, y, out_dtype, y_stride, n0, n);
  switch (m - m0) {  // the last rows together: a row alone would load GR weights for GR products
    case 5: return bf16_tile<5, GR>(x, pairs, wb, m0, y, out_dtype, y_stride, n0, n);
    case 4: return bf16_tile<4, GR>(x, pairs, wb, m0, y, out_dtype, y_stride, n0, n);
    case 3: return bf16_tile<3, GR>(x, pairs, wb, m0, y, out_dtype, y_stride, n0, n);
    case 2: return bf16_tile<2, GR>(x, pairs, wb, m0, y, out_dtype, y_stride, n0, n);
    case 1: return bf16_tile<1, GR>(x, pairs, wb, m0, y, out_dtype, y_stride, n0, n);
    default: return;
  }
}

template <int BITS, int KIND>
void gemm_bf16(const void* x, int dtype, int64_t x_stride, int64_t m, int64_t k, const Weights& w, void* y,
               int out_dtype, int64_t y_stride, int threads) {
  const int64_t pairs = k / 2, blocks = k / QK, groups = (w.n + LANES - 1) / LANES;
  thread_local std::vector<uint32_t> mine;
  std::vector<uint32_t>& xb = mine;  // the calling thread's, as `quantize`'s
  const bool amx = amx_usable() && m >= 16;  // fewer rows (FP8's decode) would fill a tile with padding
  const int64_t padded = amx ? (m + 15) / 16 * 16 : m;  // AMX reads whole tiles of 16 rows
  const int64_t steps = k / 32, xs = spread(steps, 1);  // AMX: tiles from 16 rows to the next 16
  xb.resize(amx ? padded / 16 * xs * TILE + 1024 : m * pairs);
  uint32_t* const xt = amx ? placed(xb.data(), 0) : xb.data();
  if (amx) std::fill(xt + m / 16 * xs * TILE, xb.data() + xb.size(), 0u);  // the padding rows' tiles
  const int elem = dtype == 0 ? 4 : 2;
#pragma omp parallel for num_threads(threads) if (m * k >= (1 << 16))
  for (int64_t r = 0; r < m; ++r) {  // the activations as bf16 pairs, rounded to nearest even
    const char* row = static_cast<const char*>(x) + r * x_stride * elem;
    // row-major, or in AMX tiles: row r of tile (r / 16, s) at (r / 16 * xs + s) * TILE + r % 16 * 16
    uint32_t* out = amx ? xt + r / 16 * xs * TILE + r % 16 * 16 : xt + r * pairs;
    const int64_t step_stride = amx ? TILE : 16;
    for (int64_t j = 0; j < k; j += 32) {  // k: whole blocks of 32
      __m512i both;
      if (dtype == 2) {
        both = _mm512_loadu_si512(row + j * 2);
      } else {
        __m512 lo, hi;
        if (dtype == 0) {
          lo = _mm512_loadu_ps(reinterpret_cast<const float*>(row) + j);
          hi = _mm512_loadu_ps(reinterpret_cast<const float*>(row) + j + 16);
        } else {
          lo = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + j * 2)));
          hi = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + j * 2 + 32)));
        }
        both = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  // 32 bf16 in order
      }
      _mm512_storeu_si512(out + j / 32 * step_stride, both);
    }
  }
  if constexpr (KIND == FP8) {
    switch (m) {  // up to 4 rows: decoded in registers, each row's dot products as the pairs come
      case 1: return fp8_direct<1>(xb.data(), pairs, w, y, out_dtype, y_stride, threads);
      case 2: return fp8_direct<2>(xb.data(), pairs, w, y, out_dtype, y_stride, threads);
      case 3: return fp8_direct<3>(xb.data(), pairs, w, y, out_dtype, y_stride, threads);
      case 4: return fp8_direct<4>(xb.data(), pairs, w, y, out_dtype, y_stride, threads);
      default: break;
    }
  }
  if (amx) {
#pragma omp parallel num_threads(threads)
    {  // each thread an equal share of the pairs of row groups
      configure_tiles({64, 64, 64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16, 16, 16});
      const int64_t duos = (groups + 1) / 2, t = omp_get_thread_num(), all = omp_get_num_threads();
      amx_groups<BITS, KIND>(xt, xs, m, steps, w, duos * t / all * 2, std::min(groups, duos * (t + 1) / all * 2), y,
                             out_dtype, y_stride);
      release_tiles();
    }
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    constexpr int64_t GT = 4;  // row groups a task turns into bf16, then multiplies together
    thread_local std::vector<uint32_t> wb;  // a lane a row: two bf16 inputs; kept, as amx_groups' buffers
    wb.resize(GT * pairs * LANES);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < (groups + GT - 1) / GT; ++t) {
      const int64_t g0 = t * GT, count = std::min(GT, groups - g0);
      for (int64_t g = 0; g < count; ++g) group_to_bf16<BITS, KIND>(w, blocks, g0 + g, &wb[g * pairs * LANES]);
      const int64_t n0 = g0 * LANES;
      switch (count) {
        case 4: bf16_rows<4>(xb.data(), m, pairs, wb.data(), y, out_dtype, y_stride, n0, w.n); break;
        case 3: bf16_rows<3>(xb.data(), m, pairs, wb.data(), y, out_dtype, y_stride, n0, w.n); break;
        case 2: bf16_rows<2>(xb.data(), m, pairs, wb.data(), y, out_dtype, y_stride, n0, w.n); break;
        default: bf16_rows<1>(xb.data(), m, pairs, wb.data(), y, out_dtype, y_stride, n0, w.n); break;
      }
    }
  }
}
}  // namespace

extern "C" int tiffin_bf16_gemm_built() { return amx_usable() ? 2 : 1; }

extern "C" void tiffin_bf16_gemm(int dtype, const void* x, int64_t x_stride, int64_t m, int64_t k, const Weights& w,
                                 int out_dtype, void* y, int64_t y_stride, int threads) {
  by_format<true>(w.bits, w.kind, [&](auto bits, auto kind) {
    gemm_bf16<decltype(bits)::value, decltype(kind)::value>(x, dtype, x_stride, m, k, w, y, out_dtype, y_stride, threads);
  });
}
#else
extern "C" int tiffin_bf16_gemm_built() { return 0; }

extern "C" void tiffin_bf16_gemm(int, const void*, int64_t, int64_t, int64_t, const Weights&, int, void*, int64_t, int) {}
#endif
