// Prompt-sized inputs of quantized layers, bound by arithmetic rather than by reading the weights: each task turns
// its row groups' blocks (cpu_quant.cpp's layout) into bf16 weights once (`q * d + m` in fp32, rounded to nearest
// even), in the pairs `vdpbf16ps` reads (lane l: row l's inputs 2j, 2j + 1), and multiplies every row of bf16
// activations by them, accumulating in fp32 across the whole input. AVX-512 BF16 (Zen 4 and later, Xeon from
// Cooper Lake); elsewhere `tiffin_bf16_gemm_built` says 0 and cpu_quant.cpp's integer kernels serve every size.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_blocks.h"

#if TIFFIN_VNNI && defined(__AVX512BF16__)
namespace {

inline __m512i bf16_bits(__m512 v) {  // fp32 -> bf16 bits in each 32-bit lane's low half, nearest even
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  return _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
}

// Group g's weights as bf16 pairs: out[j] = 16 lanes (rows), each (input 2j, input 2j + 1).
template <int BITS>
void group_to_bf16(const Weights& w, int64_t blocks, int64_t g, uint32_t* out) {
  constexpr int64_t block_bytes = LANES * QK * BITS / 8;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t at = (g * blocks + b) * LANES;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.scales + at)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.offsets + at)));
    const uint8_t* block = w.codes + (g * blocks + b) * block_bytes;
    for (int quad = 0; quad < 8; ++quad) {  // inputs 4 quad .. 4 quad + 3 of every row
      __m512i v = _mm512_loadu_si512(block + (BITS == 4 ? quad % 4 : quad) * 64);
      if constexpr (BITS == 4) v = quad < 4 ? _mm512_and_si512(v, _mm512_set1_epi8(0x0F))
                                            : _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F));
      __m512i bits[4];
      for (int j = 0; j < 4; ++j) {
        const __m512i code = _mm512_and_si512(_mm512_srli_epi32(v, 8 * j), _mm512_set1_epi32(0xFF));
        bits[j] = bf16_bits(_mm512_fmadd_ps(_mm512_cvtepi32_ps(code), d, m));
      }
      _mm512_storeu_si512(out + (b * 16 + quad * 2) * LANES, _mm512_or_si512(bits[0], _mm512_slli_epi32(bits[1], 16)));
      _mm512_storeu_si512(out + (b * 16 + quad * 2 + 1) * LANES, _mm512_or_si512(bits[2], _mm512_slli_epi32(bits[3], 16)));
    }
  }
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
      store_outputs(acc[i][g], y, out_dtype, (m0 + i) * y_stride + first, std::min<int64_t>(LANES, n - first));
    }
  }
}

template <int GR>
void bf16_rows(const uint32_t* x, int64_t m, int64_t pairs, const uint32_t* wb, void* y, int out_dtype,
               int64_t y_stride, int64_t n0, int64_t n) {
  int64_t m0 = 0;
  for (; m0 + 6 <= m; m0 += 6) bf16_tile<6, GR>(x, pairs, wb, m0, y, out_dtype, y_stride, n0, n);
  for (; m0 < m; ++m0) bf16_tile<1, GR>(x, pairs, wb, m0, y, out_dtype, y_stride, n0, n);
}

template <int BITS>
void gemm_bf16(const void* x, int dtype, int64_t x_stride, int64_t m, int64_t k, const Weights& w, void* y,
               int out_dtype, int64_t y_stride, int threads) {
  const int64_t pairs = k / 2, blocks = k / QK, groups = (w.n + LANES - 1) / LANES;
  thread_local std::vector<uint32_t> mine;
  std::vector<uint32_t>& xb = mine;  // the calling thread's, as `quantize`'s
  xb.resize(m * pairs);
  const int elem = dtype == 0 ? 4 : 2;
#pragma omp parallel for num_threads(threads)
  for (int64_t r = 0; r < m; ++r) {  // the activations as bf16 pairs, rounded to nearest even
    const char* row = static_cast<const char*>(x) + r * x_stride * elem;
    uint32_t* out = &xb[r * pairs];
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
      _mm512_storeu_si512(out + j / 2, both);
    }
  }
#pragma omp parallel num_threads(threads)
  {
    constexpr int64_t GT = 4;  // row groups a task turns into bf16, then multiplies together
    std::vector<uint32_t> wb(GT * pairs * LANES);  // a lane a row: two bf16 inputs
#pragma omp for schedule(static)
    for (int64_t t = 0; t < (groups + GT - 1) / GT; ++t) {
      const int64_t g0 = t * GT, count = std::min(GT, groups - g0);
      for (int64_t g = 0; g < count; ++g) group_to_bf16<BITS>(w, blocks, g0 + g, &wb[g * pairs * LANES]);
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

extern "C" int tiffin_bf16_gemm_built() { return 1; }

extern "C" void tiffin_bf16_gemm(int dtype, const void* x, int64_t x_stride, int64_t m, int64_t k, int bits,
                                 const Weights& w, int out_dtype, void* y, int64_t y_stride, int threads) {
  if (bits == 4) gemm_bf16<4>(x, dtype, x_stride, m, k, w, y, out_dtype, y_stride, threads);
  if (bits == 8) gemm_bf16<8>(x, dtype, x_stride, m, k, w, y, out_dtype, y_stride, threads);
}
#else
extern "C" int tiffin_bf16_gemm_built() { return 0; }

extern "C" void tiffin_bf16_gemm(int, const void*, int64_t, int64_t, int64_t, int, const Weights&, int, void*, int64_t,
                                 int) {}
#endif
