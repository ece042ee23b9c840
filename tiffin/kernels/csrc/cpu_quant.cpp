// Quantized linears on int8 activations, llama.cpp's scheme: each row of activations is quantized per block of
// 32 inputs to int8 with one fp32 scale, and every block of a weight row holds unsigned codes `q` (4-bit or
// 8-bit) with a scale `d` and an offset `m`, `w = q * d + m`. So a block's share of an output is
// `d * dx * sum(q * qx) + m * dx * sum(qx)`: an exact integer dot product, scaled in fp32.
//
// Weight rows are interleaved by 16 (cpu_blocks.h has the layout), so that each 32-bit lane of an AVX-512 register
// is one output row: for a group of 16 rows and one block, quad t (inputs 4t..4t+3) of every row is one register of
// 16 x 4 codes, which `vpdpbusd` (VNNI: u8 x s8, 4 products summed into each int32 lane) multiplies by the same 4
// activations broadcast to every lane. A block's 8 quads accumulate in int32 (a half-block's 4 where each half has
// its own scale), then one conversion and fused multiply-add per block scales all 16 rows at once, and no
// horizontal sum is needed.
// Activations: int8 codes `[M, K]` in input order, their scales `dx [M, blocks]` and `dx * sum(qx)` a block and a
// half-block.
// With two levels, a second int8 code a block holds what the first left, at 1/127 of its step: the activation
// is `dx * (127 q1 + q2)` with `dx = max|x| / 127^2`, 15 bits a block (`q1` exact: `127 q1 + q2` fits 16 bits),
// for two integer dot products a block where one does not reach the model's own answers (a flipped argmax on
// SmolLM2-135M at one level, as llama.cpp's scheme flips it).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_blocks.h"
#include "cpu_quant_avx2.h"

namespace {

struct Acts {  // one call's quantized activations, reused by the thread across calls
  std::vector<int8_t> q;   // [M, K]
  std::vector<int8_t> q2;  // [M, K]: the second level's codes (two levels only)
  std::vector<float> dx;   // [M, blocks]: the step of the activation's integer, 127 q + q2 with two levels
  std::vector<float> sx;   // [M, blocks]: dx * the sum of that integer
  std::vector<float> sxh;  // [M, blocks, 2]: the same per half-block
  std::vector<int32_t> isum;  // [M, blocks, 2]: the sum of that integer a half-block
  std::vector<int16_t> wide;  // [M, K]: that integer at two levels (AVX2's 8-bit tile)
  int64_t k = 0, blocks = 0;
};

// Per block: d = max|x| / 127, q = nearest-even(x * (1 / d)) (0 where d is 0); with two levels then, for the rest
// r = x - q d (one rounding), d2 = d / 127 and q2 = nearest-even(r * (1 / d2)).
#if TIFFIN_VNNI || TIFFIN_AVX2
// 8 inputs from x[at] as fp32 (each type converts exactly).
inline __m256 load_fp32x8(const void* x, int dtype, int64_t at) {
  if (dtype == 0) return _mm256_loadu_ps(static_cast<const float*>(x) + at);
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(x) + at));
  if (dtype == 1) return _mm256_cvtph_ps(h);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// nearest-even(v), clamped to +-127 (the rounding mode is the default one, as std::nearbyint's)
inline __m256i round_codes(__m256 v) {
  return _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(v), _mm256_set1_epi32(127)), _mm256_set1_epi32(-127));
}

inline int32_t sum_lanes(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1)));
}

inline float max_lanes(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

// A block's 32 codes (8 a register, |code| <= 127) as bytes in input order: the packs interleave 4-byte runs.
inline void store_codes(int8_t* q, const __m256i (&v)[4]) {
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
  const __m256i in_order = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), in_order);
}

// At the block's 32 inputs the scalar arithmetic below, 8 lanes at a time: the decode step quantizes the input of
// every projection on the calling thread, while the others wait.
void quantize_row(const void* x, int dtype, int64_t k, int levels, int8_t* q, int8_t* q2, float* dx, float* sx,
                  float* sxh, int32_t* isum, int16_t* wide) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t b = 0; b < k / QK; ++b) {
    __m256 vals[4], amax = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {  // max_ps returns its second operand where the first is NaN: skipped, as std::max
      vals[j] = load_fp32x8(x, dtype, b * QK + 8 * j);
      amax = _mm256_max_ps(_mm256_andnot_ps(sign, vals[j]), amax);
    }
    const float d = max_lanes(amax) / 127.f, d2 = d / 127.f;
    const float id = d != 0.f ? 1.f / d : 0.f, id2 = d2 != 0.f ? 1.f / d2 : 0.f;
    __m256i codes[4], rests[4], sums[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int j = 0; j < 4; ++j) {
      codes[j] = round_codes(_mm256_mul_ps(vals[j], _mm256_set1_ps(id)));
      if (levels == 1) {
        sums[j / 2] = _mm256_add_epi32(sums[j / 2], codes[j]);
        continue;
      }
      const __m256 rest = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(codes[j]), _mm256_set1_ps(d), vals[j]);
      rests[j] = round_codes(_mm256_mul_ps(rest, _mm256_set1_ps(id2)));
      const __m256i both = _mm256_add_epi32(_mm256_mullo_epi32(codes[j], _mm256_set1_epi32(127)), rests[j]);
      sums[j / 2] = _mm256_add_epi32(sums[j / 2], both);
      if (wide != nullptr)  // |both| <= 16256: the packs do not saturate
        _mm_storeu_si128(reinterpret_cast<__m128i*>(wide + b * QK + 8 * j),
                         _mm_packs_epi32(_mm256_castsi256_si128(both), _mm256_extracti128_si256(both, 1)));
    }
    store_codes(q + b * QK, codes);
    if (levels == 2) store_codes(q2 + b * QK, rests);
    const int32_t low = sum_lanes(sums[0]), high = sum_lanes(sums[1]);
    dx[b] = levels == 1 ? d : d2;
    sx[b] = dx[b] * static_cast<float>(low + high);
    sxh[2 * b] = dx[b] * static_cast<float>(low), sxh[2 * b + 1] = dx[b] * static_cast<float>(high);
    isum[2 * b] = low, isum[2 * b + 1] = high;
  }
}
#else
void quantize_row(const void* x, int dtype, int64_t k, int levels, int8_t* q, int8_t* q2, float* dx, float* sx,
                  float* sxh, int32_t* isum, int16_t* wide) {
  float vals[QK];
  for (int64_t b = 0; b < k / QK; ++b) {
    float amax = 0.f;
    for (int j = 0; j < QK; ++j) {
      vals[j] = load_value(x, dtype, b * QK + j);
      amax = std::max(amax, std::fabs(vals[j]));
    }
    const float d = amax / 127.f, d2 = d / 127.f;
    const float id = d != 0.f ? 1.f / d : 0.f, id2 = d2 != 0.f ? 1.f / d2 : 0.f;
    int sums[2] = {0, 0};
    for (int j = 0; j < QK; ++j) {
      const int v = std::min(127, std::max(-127, static_cast<int>(std::nearbyint(vals[j] * id))));
      q[b * QK + j] = static_cast<int8_t>(v);
      if (levels == 1) {
        sums[j / 16] += v;
        continue;
      }
      const float rest = std::fma(static_cast<float>(-v), d, vals[j]);
      const int v2 = std::min(127, std::max(-127, static_cast<int>(std::nearbyint(rest * id2))));
      q2[b * QK + j] = static_cast<int8_t>(v2);
      sums[j / 16] += 127 * v + v2;
      if (wide != nullptr) wide[b * QK + j] = static_cast<int16_t>(127 * v + v2);
    }
    dx[b] = levels == 1 ? d : d2;
    sx[b] = dx[b] * static_cast<float>(sums[0] + sums[1]);
    sxh[2 * b] = dx[b] * static_cast<float>(sums[0]), sxh[2 * b + 1] = dx[b] * static_cast<float>(sums[1]);
    isum[2 * b] = sums[0], isum[2 * b + 1] = sums[1];
  }
}
#endif

Acts& quantize(const void* x, int dtype, int64_t row_stride, int64_t m, int64_t k, int levels, int threads) {
  thread_local Acts mine;
  Acts& a = mine;  // the calling thread's: the team below must not name the thread-local itself (theirs)
  a.k = k, a.blocks = k / QK;
  a.q.resize(m * k);
  a.q2.resize(levels == 2 ? m * k : 0);
  a.dx.resize(m * a.blocks);
  a.sx.resize(m * a.blocks);
  a.sxh.resize(m * a.blocks * 2);
  a.isum.resize(m * a.blocks * 2);
#if TIFFIN_AVX2
  a.wide.resize(levels == 2 ? m * k : 0);  // only AVX2's 8-bit tile reads it
#endif
  const int elem = dtype == 0 ? 4 : 2;
#pragma omp parallel for num_threads(threads) if (m * k >= (1 << 16))
  for (int64_t r = 0; r < m; ++r) {
    const void* row = static_cast<const char*>(x) + r * row_stride * elem;
    int8_t* q2 = levels == 2 ? &a.q2[r * k] : nullptr;
    int16_t* wide = a.wide.empty() ? nullptr : &a.wide[r * k];
    quantize_row(row, dtype, k, levels, &a.q[r * k], q2, &a.dx[r * a.blocks], &a.sx[r * a.blocks],
                 &a.sxh[r * a.blocks * 2], &a.isum[r * a.blocks * 2], wide);
  }
  return a;
}


// Where a tile's prefetches go: the next tile's row groups, or after a weight's last tile the first groups of the
// weight the thread runs next (a grouped GEMM's next expert), or nowhere (w null).
struct Ahead {
  const Weights* w;
  int64_t g;
};

#if TIFFIN_VNNI
// Quad t (and, below 8 bits, quad t + 4) of activation row i's block `q` against the row groups' codes, into
// dots[0][.][i] (quad t + 4 into dots[H - 1]: its own half-block's where halves are scaled apart).
template <int BITS, int H, int GR, int MC>
inline void accumulate(__m512i (&dots)[H][GR][MC], int i, const int8_t* q, int t, const __m512i* lo, const __m512i* hi) {
  int32_t quad;
  std::memcpy(&quad, q + 4 * t, 4);
  const __m512i aq = _mm512_set1_epi32(quad);
  for (int g = 0; g < GR; ++g) dots[0][g][i] = _mm512_dpbusd_epi32(dots[0][g][i], lo[g], aq);
  if constexpr (BITS < 8) {
    std::memcpy(&quad, q + 4 * (t + 4), 4);
    const __m512i ah = _mm512_set1_epi32(quad);
    for (int g = 0; g < GR; ++g) dots[H - 1][g][i] = _mm512_dpbusd_epi32(dots[H - 1][g][i], hi[g], ah);
  }
}

// Block b of row groups g..g+GR into L2. A tile asks for the next tile's block as it reads its own: a decode step
// streams every weight from memory once, and the hardware prefetchers, which start afresh in each 4 KB page,
// leave the cores waiting (batch-1 decode of SmolLM2 Q4_1 on a Xeon: 0.89x -> 1.12-1.18x llama.cpp's,
// benchmarks/README.md).
template <int BITS, int KIND, int GR>  // always inlined: GCC 12 otherwise drops the prefetches of the four-group tiles
__attribute__((always_inline)) inline void prefetch_block(const Weights& w, int64_t g, int64_t b, int64_t blocks) {
  for (int i = 0; i < GR; ++i) {
    const char* codes = reinterpret_cast<const char*>(block_codes(w, BITS, KIND, blocks, g + i, b));
    for (int64_t line = 0; line < code_bytes(BITS); line += 64) _mm_prefetch(codes + line, _MM_HINT_T1);
    if (!plain_blocks(KIND) && b % SUPER) continue;  // a record's scales serve its 8 blocks
    const int64_t at = plain_blocks(KIND) ? ((g + i) * blocks + b) * LANES : ((g + i) * (blocks / SUPER) + b / SUPER) * LANES;
    _mm_prefetch(reinterpret_cast<const char*>(w.scales + at), _MM_HINT_T1);
    if (KIND == BLOCKS || KIND == SUPER_MINS || KIND == SUPER_MINS16)  // the kinds with offsets
      _mm_prefetch(reinterpret_cast<const char*>(w.offsets + at), _MM_HINT_T1);
    if constexpr (!plain_blocks(KIND)) {
      const char* sub = reinterpret_cast<const char*>(sub_scales(w, BITS, KIND, blocks, g + i, b));
      for (int64_t line = 0; line < sub_bytes(KIND); line += 64) _mm_prefetch(sub + line, _MM_HINT_T1);
    }
  }
}

// Activation rows m0..m0+MC against row groups g0..g0+GR, prefetching `ahead`'s (only the first activation rows do).
template <int BITS, int KIND, int LEVELS, int MC, int GR>
void tile(const Acts& a, int64_t m0, Ahead ahead, const Weights& w, int64_t g0, void* y, int out_dtype,
          int64_t y_stride) {
  constexpr int H = halves(KIND);  // integer sums a block: one a half-block where each has its scale
  static_assert(H == 1 || BITS < 8, "8-bit codes are scaled a block at a time");
  __m512 acc[GR][MC];
  for (int g = 0; g < GR; ++g)
    for (int i = 0; i < MC; ++i) acc[g][i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < a.blocks; ++b) {
    if (ahead.w != nullptr) prefetch_block<BITS, KIND, GR>(*ahead.w, ahead.g, b, a.blocks);
    __m512i dots[H][GR][MC], rests[H][GR][MC];  // per level
    for (int h = 0; h < H; ++h)
      for (int g = 0; g < GR; ++g)
        for (int i = 0; i < MC; ++i) dots[h][g][i] = rests[h][g][i] = _mm512_setzero_si512();
    for (int t = 0; t < (BITS == 8 ? 8 : 4); ++t) {
      __m512i lo[GR], hi[GR];
      for (int g = 0; g < GR; ++g) load_quads<BITS, KIND>(block_codes(w, BITS, KIND, a.blocks, g0 + g, b), t, lo[g], hi[g]);
      for (int i = 0; i < MC; ++i) {
        const int64_t at = (m0 + i) * a.k + b * QK;
        accumulate<BITS, H, GR, MC>(dots, i, &a.q[at], t, lo, hi);
        if constexpr (LEVELS == 2) accumulate<BITS, H, GR, MC>(rests, i, &a.q2[at], t, lo, hi);
      }
    }
    for (int h = 0; h < H; ++h) {
      for (int g = 0; g < GR; ++g) {
        __m512 d, m;
        factors<BITS, KIND>(w, a.blocks, g0 + g, b, h, d, m);
        for (int i = 0; i < MC; ++i) {
          __m512i dot = dots[h][g][i];
          if constexpr (LEVELS == 2)  // 127 q1 + q2: (x << 7) - x + rest
            dot = _mm512_add_epi32(_mm512_sub_epi32(_mm512_slli_epi32(dot, 7), dot), rests[h][g][i]);
          const int64_t row = (m0 + i) * a.blocks + b;
          const float sx = H == 2 ? a.sxh[2 * row + h] : a.sx[row];
          acc[g][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, _mm512_set1_ps(a.dx[row])), acc[g][i]);
          acc[g][i] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx), acc[g][i]);
        }
      }
    }
  }
  for (int g = 0; g < GR; ++g) {
    const int64_t n0 = (g0 + g) * LANES, lanes = std::min<int64_t>(LANES, w.n - n0);
    for (int i = 0; i < MC; ++i) store_outputs(acc[g][i], y, out_dtype, (m0 + i) * y_stride + n0, lanes);
  }
}
#elif TIFFIN_AVX2
template <int BITS, int KIND, int LEVELS, int MC, int GR>
void tile(const Acts& a, int64_t m0, Ahead, const Weights& w, int64_t g0, void* y, int out_dtype, int64_t y_stride) {
  for (int64_t g = g0; g < g0 + GR; ++g)
    for (int half = 0; half < 2 && g * LANES + 8 * half < w.n; ++half)
      if constexpr (BITS == 8 && KIND == BLOCKS && LEVELS == 2) avx2_bytes_tile<MC>(a, m0, w, g, half, y, out_dtype, y_stride);
      else avx2_tile<BITS, KIND, LEVELS, MC>(a, m0, w, g, half, y, out_dtype, y_stride);
}
#else
// The VNNI tile's arithmetic for any other CPU (ARM, x86 without AVX2; the compiler vectorizes over the 16 lanes): a block's
// codes and factors decoded once for all MC activation rows, each row's integer dot products summed in int32 lanes,
// each half-block scaled by the same fp32 expression, in block order.
template <int BITS, int KIND, int LEVELS, int MC, int GR>
void tile(const Acts& a, int64_t m0, Ahead, const Weights& w, int64_t g0, void* y, int out_dtype, int64_t y_stride) {
  for (int64_t g = g0; g < g0 + GR; ++g) {
    float acc[MC][LANES] = {};
    for (int64_t b = 0; b < a.blocks; ++b) {
      const uint8_t* block = block_codes(w, BITS, KIND, a.blocks, g, b);
      int32_t codes[QK][LANES];
      float d[2][LANES], m[2][LANES];
      for (int j = 0; j < QK; ++j)
        for (int l = 0; l < LANES; ++l) codes[j][l] = block_code(block, BITS, KIND, l, j);
      for (int h = 0; h < 2; ++h)
        for (int l = 0; l < LANES; ++l) block_factors(w, a.blocks, g, b, 16 * h, l, d[h][l], m[h][l]);
      for (int i = 0; i < MC; ++i) {
        const int64_t row = (m0 + i) * a.k + b * QK, at = (m0 + i) * a.blocks + b;
        for (int h = 0; h < 2; ++h) {  // half-blocks, each with its d and m (the same two for most kinds)
          int32_t dot[LANES] = {};
          for (int j = 16 * h; j < 16 * h + 16; ++j) {
            const int32_t act = LEVELS == 1 ? a.q[row + j] : 127 * a.q[row + j] + a.q2[row + j];
            for (int l = 0; l < LANES; ++l) dot[l] += codes[j][l] * act;
          }
          for (int l = 0; l < LANES; ++l)
            acc[i][l] += static_cast<float>(dot[l]) * (d[h][l] * a.dx[at]) + m[h][l] * a.sxh[2 * at + h];
        }
      }
    }
    for (int i = 0; i < MC; ++i)
      for (int l = 0; l < LANES && g * LANES + l < w.n; ++l)
        store_value(y, out_dtype, (m0 + i) * y_stride + g * LANES + l, acc[i][l]);
  }
}
#endif


// Row groups g0..g1 against activation rows m0..m0+MC (`lead`: the first of the weight's rows, which prefetches;
// `then`: where the weight's last tile prefetches).
template <int BITS, int KIND, int LEVELS, int MC>
void rows(const Acts& a, int64_t m0, bool lead, const Weights& w, int64_t g0, int64_t g1, void* y, int out_dtype,
          int64_t y_stride, Ahead then) {
  constexpr int GR = (MC <= 2 ? 4 : 2) / halves(KIND);  // half-blocks' sums take twice the registers
  auto ahead = [&](int64_t g, int64_t gr) {  // the next gr groups, whole ones: later rows find them cached
    if (!lead) return Ahead{nullptr, 0};
    if ((g + 2 * gr) * LANES <= w.n) return Ahead{&w, g + gr};
    return then.w != nullptr && (then.g + gr) * LANES <= then.w->n ? then : Ahead{nullptr, 0};
  };
  int64_t g = g0;
  for (; g + GR <= g1; g += GR) tile<BITS, KIND, LEVELS, MC, GR>(a, m0, ahead(g, GR), w, g, y, out_dtype, y_stride);
  for (; g < g1; ++g) tile<BITS, KIND, LEVELS, MC, 1>(a, m0, ahead(g, 1), w, g, y, out_dtype, y_stride);
}

// Row groups g0..g1 against activation rows m0..m1, MC rows of them at a time.
template <int BITS, int KIND, int LEVELS>
void row_groups(const Acts& a, int64_t m0, int64_t m1, const Weights& w, int64_t g0, int64_t g1, void* y,
                int out_dtype, int64_t y_stride, Ahead then) {
  int64_t m = m0;
  for (; m + 4 <= m1; m += 4) rows<BITS, KIND, LEVELS, 4>(a, m, m == m0, w, g0, g1, y, out_dtype, y_stride, then);
  switch (m1 - m) {
    case 3: rows<BITS, KIND, LEVELS, 3>(a, m, m == m0, w, g0, g1, y, out_dtype, y_stride, then); break;
    case 2: rows<BITS, KIND, LEVELS, 2>(a, m, m == m0, w, g0, g1, y, out_dtype, y_stride, then); break;
    case 1: rows<BITS, KIND, LEVELS, 1>(a, m, m == m0, w, g0, g1, y, out_dtype, y_stride, then); break;
    default: break;
  }
}

// row_groups(args...) for w's format and `levels`, as compile-time constants (a format by_format knows).
template <typename... Args>
void by_levels(const Weights& w, int levels, Args&&... args) {
  by_format(w.bits, w.kind, [&](auto bits, auto kind) {
    constexpr int BITS = decltype(bits)::value, KIND = decltype(kind)::value;
    if (levels == 1) row_groups<BITS, KIND, 1>(args...);
    else row_groups<BITS, KIND, 2>(args...);
  });
}

constexpr int64_t GT = 4;  // row groups read together: their codes stay in L1 across the activation rows

void gemm(const Acts& a, int64_t m, const Weights& w, void* y, int out_dtype, int64_t y_stride, int levels,
          int threads) {
  const int64_t groups = (w.n + LANES - 1) / LANES;
  // threads pay from ~32 KB of codes on (their start costs about a microsecond); each takes an equal share of the
  // groups (whole tasks of GT would leave one thread a task more: 5 against 4 on a 576-row projection)
#pragma omp parallel num_threads(threads) if (m * groups * a.blocks >= 128)
  for (int64_t g0 = groups * omp_get_thread_num() / omp_get_num_threads(),
               end = groups * (omp_get_thread_num() + 1) / omp_get_num_threads();
       g0 < end; g0 += GT) {
    by_levels(w, levels, a, 0, m, w, g0, std::min(end, g0 + GT), y, out_dtype, y_stride, Ahead{nullptr, 0});
  }
}

// The experts of a grouped GEMM that one parallel region runs (the others go through tiffin_block_gemm alone):
// row groups shared out evenly over the threads across the experts' boundaries.
void grouped(const Acts& a, const std::vector<int64_t>& run, const Weights* const* ws, const int64_t* starts,
             void* y, int out_dtype, int64_t y_stride, int levels, int threads) {
  std::vector<int64_t> first(run.size() + 1, 0);  // each expert's first row group in the shared count
  int64_t work = 0;
  for (size_t i = 0; i < run.size(); ++i) {
    const int64_t e = run[i];
    first[i + 1] = first[i] + (ws[e]->n + LANES - 1) / LANES;
    work += (starts[e + 1] - starts[e]) * (first[i + 1] - first[i]) * a.blocks;
  }
  const int64_t total = first.back();
#pragma omp parallel num_threads(threads) if (work >= 128)
  {
    const int64_t begin = total * omp_get_thread_num() / omp_get_num_threads();
    const int64_t end = total * (omp_get_thread_num() + 1) / omp_get_num_threads();
    for (size_t i = 0; i < run.size(); ++i) {
      const int64_t lo = std::max(begin, first[i]), hi = std::min(end, first[i + 1]), e = run[i];
      const Weights& w = *ws[e];
      // an expert's last tile asks for the next one's first rows: without, each expert this thread runs starts
      // with its weights still in memory (a MoE decode step reads 8 of 64 experts, out of the caches)
      const bool next = i + 1 < run.size() && first[i + 1] < end;
      const Ahead then{next ? ws[run[i + 1]] : nullptr, 0};
      for (int64_t g = lo; g < hi; g += GT)
        by_levels(w, levels, a, starts[e], starts[e + 1], w, g - first[i], std::min(hi, g + GT) - first[i], y,
                  out_dtype, y_stride, then);
    }
  }
}

}  // namespace

// The activation quantization alone, for tests: q and q2 [m, k] (q2 with two levels), dx and sx [m, k / 32], sxh
// [m, k / 16].
extern "C" void tiffin_quantize_acts(int dtype, const void* x, int64_t x_stride, int64_t m, int64_t k, int levels,
                                     int8_t* q, int8_t* q2, float* dx, float* sx, float* sxh, int threads) {
  const Acts& a = quantize(x, dtype, x_stride, m, k, levels, threads);
  std::memcpy(q, a.q.data(), a.q.size());
  std::memcpy(q2, a.q2.data(), a.q2.size());
  std::memcpy(dx, a.dx.data(), a.dx.size() * sizeof(float));
  std::memcpy(sx, a.sx.data(), a.sx.size() * sizeof(float));
  std::memcpy(sxh, a.sxh.data(), a.sxh.size() * sizeof(float));
}

// Weight rows `rows` as fp32 `out [count, k]`: `q * d + m`, FP8's `e4m3(q) * d` (a quantized token embedding's
// lookup).
extern "C" void tiffin_dequantize_rows(const Weights* w, int64_t k, const int64_t* rows, int64_t count, float* out) {
  const int64_t blocks = k / QK;
  for (int64_t r = 0; r < count; ++r) {
    const int64_t group = rows[r] / LANES;
    const int lane = static_cast<int>(rows[r] % LANES);
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* block = block_codes(*w, w->bits, w->kind, blocks, group, b);
      float d, m;
      for (int j = 0; j < QK; ++j) {
        if (j % 16 == 0) block_factors(*w, blocks, group, b, j, lane, d, m);
        const int q = block_code(block, w->bits, w->kind, lane, j);
        out[r * k + b * QK + j] = w->kind == FP8 ? e4m3_to_float(static_cast<uint8_t>(q)) * d
                                                 : static_cast<float>(q) * d + m;
      }
    }
  }
}

// The fewest activation rows that take bf16 dot products at two levels (from about here arithmetic, not reading
// the weights, bounds a call), or -1 where the CPU has none.
extern "C" int64_t tiffin_bf16_min_rows() {
  const int built = tiffin_bf16_gemm_built();
  return built == 2 ? 16 : built == 1 ? 32 : -1;  // AMX tiles: their cost is turning the weights into bf16
}

// Whether tiffin_block_gemm hands `m` rows against `w` to the W8A8 GEMM (block_gemm.py's `in_per_token`).
static bool w8a8_runs(const Weights& w, int64_t m, int64_t k) {
  const int64_t rows = tiffin_w8a8_min_rows();
  return w.per_token && w.bits == 8 && w.kind == BLOCKS && k <= 65536 && rows >= 0 && m >= rows;
}

// What this build computes quantized layers with, for the log.
extern "C" const char* tiffin_quant_kernels() {
#if TIFFIN_VNNI
  switch (tiffin_bf16_gemm_built()) {
    case 2: return "AVX-512 VNNI integer dot products; AMX bf16 tiles for prompt-sized steps";
    case 1: return "AVX-512 VNNI integer dot products; AVX-512 BF16 for prompt-sized steps";
    default: return "AVX-512 VNNI integer dot products";
  }
#elif TIFFIN_AVX2
  return "AVX2 integer dot products (no AVX-512 VNNI on this CPU)";
#else
  return "portable C++ (no AVX-512 VNNI nor AVX2 on this CPU: several times slower)";
#endif
}

// y[m, n] (out_dtype, row stride y_stride) = x[m, :k] (dtype: 0 fp32, 1 fp16, 2 bf16) against the weight rows, the
// activations quantized per block of 32 to `levels` (1 or 2) of int8 codes, or at two levels and from
// `tiffin_bf16_min_rows` rows on, rounded to bf16 against the weights turned into bf16 (fp32 sums either way).
// FP8 weights always take the bf16 dot products, per-token (W8A8) weights from `tiffin_w8a8_min_rows` rows on the
// W8A8 GEMM on activations int8 per token (`levels` aside, both). Returns 0, or -1 for a format the kernels are not
// built for (nothing written): FP8 where the CPU has no AVX-512 BF16.
extern "C" int tiffin_block_gemm(int dtype, const void* x, int64_t x_stride, int64_t m, int64_t k, const Weights* w,
                                 int out_dtype, void* y, int64_t y_stride, int levels, int threads) {
  if (w->kind == FP8) {  // e4m3 codes are no integers
    if (w->bits != 8 || !tiffin_bf16_gemm_built()) return -1;
    tiffin_bf16_gemm(dtype, x, x_stride, m, k, *w, out_dtype, y, y_stride, threads);
    return 0;
  }
  if (!by_format(w->bits, w->kind, [](auto, auto) {})) return -1;
  if (w8a8_runs(*w, m, k)) {  // the weight's own activation scheme, whatever `levels`
    tiffin_w8a8_gemm(dtype, x, x_stride, m, k, *w, out_dtype, y, y_stride, threads);
    return 0;
  }
  if (levels == 2 && tiffin_bf16_gemm_built() && m >= tiffin_bf16_min_rows()) {
    tiffin_bf16_gemm(dtype, x, x_stride, m, k, *w, out_dtype, y, y_stride, threads);
    return 0;
  }
  gemm(quantize(x, dtype, x_stride, m, k, levels, threads), m, *w, y, out_dtype, y_stride, levels, threads);
  return 0;
}

// Experts e = 0..count-1 at once (a mixture of experts' chosen ones): rows starts[e]..starts[e + 1] of y = the same
// rows of x against ws[e], each as tiffin_block_gemm computes it alone, bit for bit. The int8 ones (decode-sized)
// share one quantization of x and one parallel region, so a step pays no thread start per expert. Returns 0, or -1
// (nothing written) for a format the kernels are not built for.
extern "C" int tiffin_grouped_gemm(int dtype, const void* x, int64_t x_stride, int64_t k, const Weights* const* ws,
                                   const int64_t* starts, int64_t count, int out_dtype, void* y, int64_t y_stride,
                                   int levels, int threads) {
  std::vector<int64_t> run;
  for (int64_t e = 0; e < count; ++e) {
    const Weights& w = *ws[e];
    const int64_t m = starts[e + 1] - starts[e];
    if (w.kind == FP8 ? w.bits != 8 || !tiffin_bf16_gemm_built() : !by_format(w.bits, w.kind, [](auto, auto) {}))
      return -1;
    const bool bf16 = levels == 2 && tiffin_bf16_gemm_built() && m >= tiffin_bf16_min_rows();
    if (m > 0 && !(w.kind == FP8 || w8a8_runs(w, m, k) || bf16)) run.push_back(e);
  }
  for (int64_t e = 0; e < count; ++e) {  // before the shared quantization: these quantize on their own
    const int64_t m = starts[e + 1] - starts[e];
    if (m > 0 && std::find(run.begin(), run.end(), e) == run.end())
      tiffin_block_gemm(dtype, static_cast<const char*>(x) + starts[e] * x_stride * (dtype == 0 ? 4 : 2), x_stride, m,
                        k, ws[e], out_dtype, static_cast<char*>(y) + starts[e] * y_stride * (out_dtype == 0 ? 4 : 2),
                        y_stride, levels, threads);
  }
  if (!run.empty())
    grouped(quantize(x, dtype, x_stride, starts[count], k, levels, threads), run, ws, starts, y, out_dtype, y_stride,
            levels, threads);
  return 0;
}
