// W8A8: 8-bit weights with one scale a row (compressed-tensors' int-quantized weights per channel or tensor, their
// input activations int8) against activations quantized to int8 per token, the format's own scheme, dynamically:
// row i of x gets dx[i] = max|x[i, :]| / 127 and codes qx = nearest-even(x * (1 / dx)) in -127..127 (0 where dx is
// 0). The weight is 8-bit BLOCKS (cpu_blocks.h) whose blocks of a row all hold the same fp16 d and m = -128 d, so
// its codes are u = q + 128 of the signed q, w = (u - 128) d, and
//   y[i, n] = dx[i] d[n] sum_k qx[i, k] (u[n, k] - 128) = (dx[i] * d[n]) * (dot[i, n] - 128 sx[i]),
// dot = sum_k qx u (signed x unsigned bytes, as the hardware multiplies them) and sx = sum_k qx: both exact in int32
// over the whole input (|dot| <= 127 * 255 K: K up to 65536), the correction too, so each output is one conversion
// to fp32 (exact below 2^24) times dx d (rounded once): no scaling a block, unlike cpu_quant.cpp's kernels.
//
// The dot products: Intel AMX `tdpbsud` where the CPU has it (tiles of 16 activation rows x 64 inputs against
// 16 x 4-input rows of 16 weight rows), else AVX-512 VNNI `vpdpbusd` (Zen 4). The layout's 8-bit registers are an
// AMX B tile's rows as they are: register t of a block (16 rows x inputs 4t..4t+3) is the VNNI-ordered row t of
// a B tile, a group's blocks follow one another, so 16 registers (64 inputs, two blocks) at a stride of 64 bytes
// are one B tile, loaded straight from the stored codes with no repacking. Tiles need K a multiple of 64; other
// K (a multiple of 32) take the VNNI kernel.
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_blocks.h"

#if TIFFIN_VNNI
namespace {

struct TokenActs {  // one call's activations quantized per token, reused by the calling thread across calls
  std::vector<int8_t> q;  // [rows, stride], rows padded to whole tiles of 16 with zeros
  std::vector<float> dx;  // [m]
  std::vector<int32_t> sx;  // [m]: the sum of the row's codes
  int64_t k = 0, stride = 0;  // stride: k, and a cache line more where k is a multiple of 256 (see quantize_tokens)
};

inline __m512 fp32x16(const void* x, int dtype, int64_t at) {  // 16 inputs as fp32 (exactly)
  if (dtype == 0) return _mm512_loadu_ps(static_cast<const float*>(x) + at);
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(x) + at));
  if (dtype == 1) return _mm512_cvtph_ps(h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// One row: its max magnitude first (NaN skipped, as cpu_quant.cpp's max), then the codes.
void quantize_token(const void* x, int dtype, int64_t k, int8_t* q, float& dx, int32_t& sx) {
  __m512 amax = _mm512_setzero_ps();
  for (int64_t j = 0; j < k; j += 16) amax = _mm512_max_ps(_mm512_abs_ps(fp32x16(x, dtype, j)), amax);
  const float d = _mm512_reduce_max_ps(amax) / 127.f;
  const __m512 id = _mm512_set1_ps(d != 0.f ? 1.f / d : 0.f);
  __m512i sum = _mm512_setzero_si512();
  for (int64_t j = 0; j < k; j += 16) {
    __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(fp32x16(x, dtype, j), id));  // nearest even
    v = _mm512_max_epi32(_mm512_min_epi32(v, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + j), _mm512_cvtepi32_epi8(v));
    sum = _mm512_add_epi32(sum, v);
  }
  dx = d, sx = _mm512_reduce_add_epi32(sum);
}

TokenActs& quantize_tokens(const void* x, int dtype, int64_t x_stride, int64_t m, int64_t k, int64_t padded,
                           int threads) {
  thread_local TokenActs mine;
  TokenActs& a = mine;  // the calling thread's (the team below must not name the thread-local: theirs)
  // rows 2^n lines apart fall in a few L1 sets (64 of them): an AMX tile's 16 rows at K = 2048 would share 2 sets
  // (a precaution: no difference measured on a shared 2-core Xeon, where the GEMM waits on L2 anyway)
  a.k = k, a.stride = k % 256 ? k : k + 64;
  a.q.resize(padded * a.stride);
  std::fill(a.q.begin() + m * a.stride, a.q.end(), int8_t{0});
  a.dx.resize(m);
  a.sx.resize(m);
  const int elem = dtype == 0 ? 4 : 2;
#pragma omp parallel for num_threads(threads) if (m * k >= (1 << 16))
  for (int64_t r = 0; r < m; ++r)
    quantize_token(static_cast<const char*>(x) + r * x_stride * elem, dtype, k, &a.q[r * a.stride], a.dx[r], a.sx[r]);
  return a;
}

// Row group g's codes: its blocks' registers in turn, quad t (inputs 4t..4t+3) of all 16 rows at byte 64 t.
inline const uint8_t* group_codes(const Weights& w, int64_t k, int64_t g) { return w.codes + g * (k / QK) * 512; }

// Its 16 rows' d (block 0's: every block holds the same).
inline __m512 group_scales(const Weights& w, int64_t k, int64_t g) { return fp16x16(w.scales + g * (k / QK) * LANES); }

// Integer sums `dot` of activation row i against group g's 16 rows -> outputs (dx d) (dot - 128 sx).
inline void finish(const TokenActs& a, int64_t i, __m512i dot, __m512 d, void* y, int out_dtype, int64_t at,
                   int64_t lanes) {
  const __m512i exact = _mm512_sub_epi32(dot, _mm512_set1_epi32(128 * a.sx[i]));
  store_outputs(_mm512_mul_ps(_mm512_cvtepi32_ps(exact), _mm512_mul_ps(_mm512_set1_ps(a.dx[i]), d)), y, out_dtype,
                at, lanes);
}

// VNNI: activation rows m0..m0+MC against row groups g0..g0+GR, int32 sums over the whole input in registers (MC x
// GR of them, GR code loads and MC broadcasts a quad). A tile asks for the next tile's codes as it reads its own
// where it is the first over them (decode: every weight streams from memory once; see cpu_quant.cpp).
template <int MC, int GR>
void vnni_tile(const TokenActs& a, int64_t m0, const Weights& w, int64_t g0, void* y, int out_dtype,
               int64_t y_stride) {
  const int64_t k = a.k, group_bytes = k / QK * 512;
  __m512i dots[MC][GR];
  for (int i = 0; i < MC; ++i)
    for (int g = 0; g < GR; ++g) dots[i][g] = _mm512_setzero_si512();
  const uint8_t* codes = group_codes(w, k, g0);
  const bool ahead = m0 == 0 && (g0 + 2 * GR) * LANES <= w.n;
  for (int64_t t = 0; t < k / 4; ++t) {
    if (ahead)
      for (int g = 0; g < GR; ++g) _mm_prefetch(reinterpret_cast<const char*>(codes + (GR + g) * group_bytes + t * 64), _MM_HINT_T1);
    __m512i wv[GR];
    for (int g = 0; g < GR; ++g) wv[g] = _mm512_loadu_si512(codes + g * group_bytes + t * 64);
    for (int i = 0; i < MC; ++i) {
      int32_t quad;
      std::memcpy(&quad, &a.q[(m0 + i) * a.stride + 4 * t], 4);
      const __m512i xv = _mm512_set1_epi32(quad);
      for (int g = 0; g < GR; ++g) dots[i][g] = _mm512_dpbusd_epi32(dots[i][g], wv[g], xv);
    }
  }
  for (int g = 0; g < GR; ++g) {
    const __m512 d = group_scales(w, k, g0 + g);
    const int64_t n0 = (g0 + g) * LANES, lanes = std::min<int64_t>(LANES, w.n - n0);
    for (int i = 0; i < MC; ++i) finish(a, m0 + i, dots[i][g], d, y, out_dtype, (m0 + i) * y_stride + n0, lanes);
  }
}

template <int MC>
void vnni_rows(const TokenActs& a, int64_t m0, const Weights& w, int64_t g0, int64_t g1, void* y, int out_dtype,
               int64_t y_stride) {
  int64_t g = g0;
  for (; g + 4 <= g1; g += 4) vnni_tile<MC, 4>(a, m0, w, g, y, out_dtype, y_stride);
  for (; g < g1; ++g) vnni_tile<MC, 1>(a, m0, w, g, y, out_dtype, y_stride);
}

// Row groups g0..g1 against every activation row, 4 rows at a time.
void vnni_groups(const TokenActs& a, int64_t m, const Weights& w, int64_t g0, int64_t g1, void* y, int out_dtype,
                 int64_t y_stride) {
  int64_t m0 = 0;
  for (; m0 + 4 <= m; m0 += 4) vnni_rows<4>(a, m0, w, g0, g1, y, out_dtype, y_stride);
  switch (m - m0) {
    case 3: vnni_rows<3>(a, m0, w, g0, g1, y, out_dtype, y_stride); break;
    case 2: vnni_rows<2>(a, m0, w, g0, g1, y, out_dtype, y_stride); break;
    case 1: vnni_rows<1>(a, m0, w, g0, g1, y, out_dtype, y_stride); break;
    default: break;
  }
}

#if TIFFIN_AMX && defined(__AMX_INT8__)
constexpr bool AMX_INT8 = true;

// AMX: activation rows m0..m0 + 16 MR (whole tiles: the buffer is padded) against groups g0..g0+NR, sums in tiles
// 0..3 (int32, 16 x 16), activations in 4 and 5 (16 rows x 64 inputs, row stride a.stride), weights in 6 and 7.
template <int MR, int NR>
void amx_tile(const TokenActs& a, int64_t m0, int64_t m, const Weights& w, int64_t g0, void* y, int out_dtype,
              int64_t y_stride) {
  const int64_t k = a.k, stride = a.stride;
  const int8_t* x0 = &a.q[m0 * stride];
  const uint8_t* w0 = group_codes(w, k, g0);
  const uint8_t* w1 = w0 + k / QK * 512;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t j = 0; j < k; j += 64) {  // 64 inputs: a B tile's 16 quads, 1 KB of a group's codes
    _tile_loadd(4, x0 + j, stride);
    if constexpr (MR == 2) _tile_loadd(5, x0 + 16 * stride + j, stride);
    _tile_loadd(6, w0 + j * LANES, 64);
    if constexpr (NR == 2) _tile_loadd(7, w1 + j * LANES, 64);
    _tile_dpbsud(0, 4, 6);  // signed activations x unsigned codes
    if constexpr (NR == 2) _tile_dpbsud(1, 4, 7);
    if constexpr (MR == 2) _tile_dpbsud(2, 5, 6);
    if constexpr (MR == 2 && NR == 2) _tile_dpbsud(3, 5, 7);
  }
  alignas(64) int32_t sums[4][16][LANES];
  _tile_stored(0, sums[0], 64);
  if constexpr (NR == 2) _tile_stored(1, sums[1], 64);
  if constexpr (MR == 2) _tile_stored(2, sums[2], 64);
  if constexpr (MR == 2 && NR == 2) _tile_stored(3, sums[3], 64);
  for (int g = 0; g < NR; ++g) {
    const __m512 d = group_scales(w, k, g0 + g);
    const int64_t n0 = (g0 + g) * LANES, lanes = std::min<int64_t>(LANES, w.n - n0);
    for (int r = 0; r < MR; ++r)
      for (int64_t i = m0 + 16 * r; i < std::min(m, m0 + 16 * r + 16); ++i)
        finish(a, i, _mm512_load_si512(sums[2 * r + g][i - m0 - 16 * r]), d, y, out_dtype, i * y_stride + n0, lanes);
  }
}

// Row groups g0..g1 against every activation row: pairs of groups, 32 rows at a time.
void amx_groups(const TokenActs& a, int64_t m, const Weights& w, int64_t g0, int64_t g1, void* y, int out_dtype,
                int64_t y_stride) {
  for (int64_t g = g0; g < g1; g += 2) {
    const bool two = g + 1 < g1;
    int64_t m0 = 0;
    for (; m0 + 16 < m; m0 += 32) {
      if (two) amx_tile<2, 2>(a, m0, m, w, g, y, out_dtype, y_stride);
      else amx_tile<2, 1>(a, m0, m, w, g, y, out_dtype, y_stride);
    }
    if (m0 < m) {
      if (two) amx_tile<1, 2>(a, m0, m, w, g, y, out_dtype, y_stride);
      else amx_tile<1, 1>(a, m0, m, w, g, y, out_dtype, y_stride);
    }
  }
}
#else
constexpr bool AMX_INT8 = false;
void amx_groups(const TokenActs&, int64_t, const Weights&, int64_t, int64_t, void*, int, int64_t) {}
#endif

// The fewest activation rows that take AMX tiles: a tile's step costs the same at 1 row as at 16, and VNNI's grows
// with the rows; one thread, 1536 x 576 / 576 x 1536 / 8960 x 1536 (us), VNNI against AMX: 4 rows 38 / 48 / 578
// against 31 / 52 / 658, 6 rows 50 / 68 / 697 against 35 / 62 / 679, 8 rows 62 / 86 / 838 against 43 / 70 / 699.
constexpr int64_t AMX_MIN_ROWS = 6;

inline bool amx_int8_usable() { return AMX_INT8 && amx_usable(); }

}  // namespace

// The fewest activation rows at which per-token weights (Weights::per_token) take this GEMM, or -1 where it is not
// built (no AVX-512 VNNI: cpu_quant.cpp's kernels serve them, per block). Every number: one integer dot product
// over the whole input beats the per-block kernels' (two a block at 15 bits, each scaled) from one row on (a
// decode step about even, bound by reading the weights; 2..16 rows 1.7-5x), and a row's output then depends on
// nothing but the row, AMX or VNNI alike: no batch-size or CPU dependence of a W8A8 model's answers.
extern "C" int64_t tiffin_w8a8_min_rows() { return 1; }

// Which dot products it runs on (for tests and the log): 2 AMX from AMX_MIN_ROWS rows on (K a multiple of 64),
// 1 VNNI only (measured on a Xeon denied AMX: 1.7-4.3x the per-block kernels from 2 to 64 rows, against the
// AVX-512 BF16 GEMM from 32 rows; Zen 4 has the same instructions).
extern "C" int tiffin_w8a8_built() { return amx_int8_usable() ? 2 : 1; }

// y[m, n] (out_dtype, row stride y_stride) = x[m, :k] (dtype: 0 fp32, 1 fp16, 2 bf16) against per-token weight
// rows `w`, as the top of this file says. K a multiple of 32, at most 65536.
extern "C" void tiffin_w8a8_gemm(int dtype, const void* x, int64_t x_stride, int64_t m, int64_t k, const Weights& w,
                                 int out_dtype, void* y, int64_t y_stride, int threads) {
  const bool amx = amx_int8_usable() && m >= AMX_MIN_ROWS && k % 64 == 0;
  const TokenActs& a = quantize_tokens(x, dtype, x_stride, m, k, amx ? (m + 15) / 16 * 16 : m, threads);
  const int64_t groups = (w.n + LANES - 1) / LANES;
  // each thread an equal share of the groups (threads pay from ~32 KB of codes on, as in cpu_quant.cpp), 4 groups
  // at a time (their codes stay in cache across the activation rows)
#pragma omp parallel num_threads(threads) if (m * groups * k >= 128 * QK)
  {
    const int64_t first = groups * omp_get_thread_num() / omp_get_num_threads();
    const int64_t end = groups * (omp_get_thread_num() + 1) / omp_get_num_threads();
    if (amx) configure_tiles({64, 64, 64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16, 16, 16});
    for (int64_t g0 = first; g0 < end; g0 += 4) {
      const int64_t g1 = std::min(end, g0 + 4);
      if (amx) amx_groups(a, m, w, g0, g1, y, out_dtype, y_stride);
      else vnni_groups(a, m, w, g0, g1, y, out_dtype, y_stride);
    }
    if (amx) release_tiles();
  }
}
#else
extern "C" int64_t tiffin_w8a8_min_rows() { return -1; }
extern "C" int tiffin_w8a8_built() { return 0; }
extern "C" void tiffin_w8a8_gemm(int, const void*, int64_t, int64_t, int64_t, const Weights&, int, void*, int64_t, int) {}
#endif
