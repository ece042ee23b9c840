// Quantized linears on int8 activations, llama.cpp's scheme: each row of activations is quantized per block of
// 32 inputs to int8 with one fp32 scale (`quantize_rows`), and every block of a weight row holds unsigned codes
// `q` (4-bit, two per byte, or 8-bit) with a scale `d` and an offset `m`, `w = q * d + m`. So a block's share of
// an output is `d * dx * sum(q * qx) + m * dx * sum(qx)`: an exact integer dot product (AVX-512 VNNI's u8 x s8
// `vpdpbusd`), scaled in fp32. The weights are read as stored, once per step for all the rows of a tile: decode
// steps are bound by reading them.
//
// Layouts (all rows padded to an even number of blocks `nb2`, pads zero):
// - 4-bit codes `[N, nb2 * 16]`: block b's 16 bytes hold its inputs 0..15 in the low nibbles and 16..31 in the
//   high ones (GGUF's Q4 order); 8-bit codes `[N, nb2 * 32]`.
// - weight scales and offsets `[N, nb2]` fp16 (GGUF stores them so; AWQ and GPTQ scales are fp16 too).
// - quantized activations (`Acts`): codes `[M, nb2 * 32]`, their scales expanded to 8 lanes a block
//   `[M, nb2 / 2, 16]`, and `dx * sum(qx)` `[M, nb2]`.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define TIFFIN_VNNI 1
#endif

namespace {

constexpr int QK = 32;  // inputs per block

inline float load_value(const void* x, int dtype, int64_t i) {
  if (dtype == 0) return static_cast<const float*>(x)[i];
  const uint16_t h = static_cast<const uint16_t*>(x)[i];
  if (dtype == 2) {  // bf16
    uint32_t u = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  }
  // fp16
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

inline void store_value(void* y, int dtype, int64_t i, float v) {
  if (dtype == 0) {
    static_cast<float*>(y)[i] = v;
    return;
  }
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  uint16_t h;
  if (dtype == 2) {  // bf16, round to nearest even as torch does
    h = std::isnan(v) ? 0x7FC0 : static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
  } else {  // fp16, round to nearest even
    const uint32_t sign = (u >> 16) & 0x8000;
    const uint32_t abs = u & 0x7FFFFFFF;
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

struct Acts {
  std::vector<int8_t> q;     // [M, kp]
  std::vector<float> dxe;    // [M, pairs, 16]
  std::vector<float> sx;     // [M, nb2]
  int64_t kp = 0, pairs = 0, nb2 = 0;
};

// Row r of x: per block, d = max|x| / 127, q = nearest-even(x * (1 / d)) (0 where d is 0).
void quantize_row(const void* x, int dtype, int64_t k, int8_t* q, float* dxe, float* sx) {
  const int64_t nb = k / QK;
  float vals[QK];
  for (int64_t b = 0; b < nb; ++b) {
    float amax = 0.f;
    for (int j = 0; j < QK; ++j) {
      vals[j] = load_value(x, dtype, b * QK + j);
      amax = std::max(amax, std::fabs(vals[j]));
    }
    const float d = amax / 127.f;
    const float id = d != 0.f ? 1.f / d : 0.f;
    int sum = 0;
    for (int j = 0; j < QK; ++j) {
      const int v = static_cast<int>(std::nearbyint(vals[j] * id));
      q[b * QK + j] = static_cast<int8_t>(std::min(127, std::max(-127, v)));
      sum += q[b * QK + j];
    }
    for (int lane = 0; lane < 8; ++lane) dxe[(b / 2) * 16 + (b % 2) * 8 + lane] = d;
    sx[b] = d * static_cast<float>(sum);
  }
}

void quantize(const void* x, int dtype, int64_t row_stride, int64_t m, int64_t k, Acts& a, int threads) {
  const int64_t nb = k / QK, nb2 = nb + (nb & 1);
  a.kp = nb2 * QK, a.pairs = nb2 / 2, a.nb2 = nb2;
  a.q.assign(m * a.kp, 0);
  a.dxe.assign(m * a.pairs * 16, 0.f);
  a.sx.assign(m * nb2, 0.f);
  const int elem = dtype == 0 ? 4 : 2;
#pragma omp parallel for num_threads(threads) if (m * k >= (1 << 16))
  for (int64_t r = 0; r < m; ++r) {
    const void* row = static_cast<const char*>(x) + r * row_stride * elem;
    quantize_row(row, dtype, k, &a.q[r * a.kp], &a.dxe[r * a.pairs * 16], &a.sx[r * nb2]);
  }
}

// sum(a[i] * b[i]) over n fp16 a and fp32 b.
inline float dot_half_float(const uint16_t* a, const float* b, int64_t n) {
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 keep = n - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 ha = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(keep, a + i));
    acc = _mm512_fmadd_ps(ha, _mm512_maskz_loadu_ps(keep, b + i), acc);
  }
  return _mm512_reduce_add_ps(acc);
#else
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s += load_value(a, 1, i) * b[i];
  return s;
#endif
}

#if TIFFIN_VNNI
// Blocks 2p and 2p+1 of a weight row as 64 unsigned codes, each block's inputs in order.
template <int BITS>
inline __m512i load_codes(const uint8_t* row, int64_t p) {
  if constexpr (BITS == 4) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + p * 32));
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    const __m512i t = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);  // lo(b0, b1), hi(b0, b1)
    return _mm512_shuffle_i64x2(t, t, 0xD8);                                    // b0 lo, b0 hi, b1 lo, b1 hi
  } else {
    return _mm512_loadu_si512(row + p * 64);
  }
}

// Rows m0..m0+MC of the output for weight rows [n0, n1).
template <int BITS, int MC>
void tile(const Acts& a, int64_t m0, const uint8_t* codes, int64_t code_stride, const uint16_t* wd,
          const uint16_t* wm, void* y, int out_dtype, int64_t y_stride, int64_t n0, int64_t n1) {
  const __m512i halves = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* w = codes + n * code_stride;
    const uint16_t* d = wd + n * a.nb2;
    __m512 acc[MC];
    for (int i = 0; i < MC; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t p = 0; p < a.pairs; ++p) {
      const __m512i wv = load_codes<BITS>(w, p);
      int32_t d2bits;
      std::memcpy(&d2bits, d + 2 * p, sizeof d2bits);
      const __m128 d2 = _mm_cvtph_ps(_mm_cvtsi32_si128(d2bits));
      const __m512 ds = _mm512_permutexvar_ps(halves, _mm512_zextps128_ps512(d2));
      for (int i = 0; i < MC; ++i) {
        const int64_t r = m0 + i;
        const __m512i av = _mm512_loadu_si512(&a.q[r * a.kp + p * 64]);
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, av);
        const __m512 s = _mm512_mul_ps(ds, _mm512_loadu_ps(&a.dxe[(r * a.pairs + p) * 16]));
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, acc[i]);
      }
    }
    for (int i = 0; i < MC; ++i) {
      const int64_t r = m0 + i;
      const float v = _mm512_reduce_add_ps(acc[i]) + dot_half_float(wm + n * a.nb2, &a.sx[r * a.nb2], a.nb2);
      store_value(y, out_dtype, r * y_stride + n, v);
    }
  }
}
#else
template <int BITS>
inline int code_at(const uint8_t* row, int64_t i) {  // input i of a weight row
  if constexpr (BITS == 8) return row[i];
  const int64_t b = i / QK, j = i % QK;
  const uint8_t byte = row[b * 16 + (j & 15)];
  return j < 16 ? byte & 0x0F : byte >> 4;
}

template <int BITS, int MC>
void tile(const Acts& a, int64_t m0, const uint8_t* codes, int64_t code_stride, const uint16_t* wd,
          const uint16_t* wm, void* y, int out_dtype, int64_t y_stride, int64_t n0, int64_t n1) {
  std::vector<int32_t> w(QK);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = codes + n * code_stride;
    float acc[MC] = {};
    for (int64_t b = 0; b < 2 * a.pairs; ++b) {
      for (int j = 0; j < QK; ++j) w[j] = code_at<BITS>(row, b * QK + j);
      for (int i = 0; i < MC; ++i) {
        const int8_t* q = &a.q[(m0 + i) * a.kp + b * QK];
        int32_t dot = 0;
#pragma omp simd reduction(+ : dot)
        for (int j = 0; j < QK; ++j) dot += w[j] * q[j];
        const float dw = load_value(wd, 1, n * a.nb2 + b);
        acc[i] += static_cast<float>(dot) * (dw * a.dxe[((m0 + i) * a.pairs + b / 2) * 16 + (b % 2) * 8]);
      }
    }
    for (int i = 0; i < MC; ++i) {
      const int64_t r = m0 + i;
      store_value(y, out_dtype, r * y_stride + n, acc[i] + dot_half_float(wm + n * a.nb2, &a.sx[r * a.nb2], a.nb2));
    }
  }
}
#endif

template <int BITS>
void gemm(const Acts& a, int64_t m, const uint8_t* codes, int64_t n, const uint16_t* wd, const uint16_t* wm,
          void* y, int out_dtype, int64_t y_stride, int threads) {
  constexpr int NT = 16;  // weight rows a task reads: its codes stay in L1 across the row chunks
  const int64_t code_stride = a.kp * BITS / 8, tiles = (n + NT - 1) / NT;
#pragma omp parallel for num_threads(threads) schedule(static) if (m * n * a.kp >= (1 << 18))
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t n0 = t * NT, n1 = std::min(n, n0 + NT);
    int64_t m0 = 0;
    for (; m0 + 4 <= m; m0 += 4) tile<BITS, 4>(a, m0, codes, code_stride, wd, wm, y, out_dtype, y_stride, n0, n1);
    switch (m - m0) {
      case 3: tile<BITS, 3>(a, m0, codes, code_stride, wd, wm, y, out_dtype, y_stride, n0, n1); break;
      case 2: tile<BITS, 2>(a, m0, codes, code_stride, wd, wm, y, out_dtype, y_stride, n0, n1); break;
      case 1: tile<BITS, 1>(a, m0, codes, code_stride, wd, wm, y, out_dtype, y_stride, n0, n1); break;
      default: break;
    }
  }
}

}  // namespace

// y[m, n] (out_dtype, row stride y_stride) = x[m, :k] (dtype: 0 fp32, 1 fp16, 2 bf16) against the weight rows.
extern "C" void tiffin_int8_gemm(int dtype, const void* x, int64_t x_stride, int64_t m, int64_t k, int bits,
                                 const uint8_t* codes, int64_t n, const uint16_t* wd, const uint16_t* wm, int out_dtype,
                                 void* y, int64_t y_stride, int threads) {
  Acts a;
  quantize(x, dtype, x_stride, m, k, a, threads);
  if (bits == 4) gemm<4>(a, m, codes, n, wd, wm, y, out_dtype, y_stride, threads);
  if (bits == 8) gemm<8>(a, m, codes, n, wd, wm, y, out_dtype, y_stride, threads);
}

// The activation quantization alone, for tests: q [m, kp], dx [m, nb2] (one scale a block), sx [m, nb2].
extern "C" void tiffin_quantize_acts(int dtype, const void* x, int64_t x_stride, int64_t m, int64_t k, int8_t* q,
                                     float* dx, float* sx, int threads) {
  Acts a;
  quantize(x, dtype, x_stride, m, k, a, threads);
  std::memcpy(q, a.q.data(), a.q.size());
  for (int64_t r = 0; r < m; ++r)
    for (int64_t b = 0; b < 2 * a.pairs; ++b) dx[r * 2 * a.pairs + b] = a.dxe[(r * a.pairs + b / 2) * 16 + (b % 2) * 8];
  std::memcpy(sx, a.sx.data(), a.sx.size() * sizeof(float));
}
