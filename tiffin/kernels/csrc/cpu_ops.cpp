// CPU kernels where torch's ops cost most on a decode step, each one pass where torch runs several small ops:
// K/V written into their cache slots (quantized per head where the cache is), RMSNorm, rotary embeddings, the
// greedy argmax. (Paged decode attention: cpu_paged_decode.cpp.) Built by tiffin/kernels/cpu_native.py with the
// host's compiler; torch's OpenMP runtime runs the threads (the library links libgomp.so.1, which resolves to the
// copy torch already loaded).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "cpu_math.h"
#include "cpu_types.h"

namespace {

// One head of `n` values, rotated where it is a key, as kv_quant.quantize stores it: the largest magnitude over
// code_max, in bf16, divides the values.
template <typename C>
void quantize_head(const float* x, int n, C* codes, bf16* scale) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<C, i8>) {
    if (n % 16 == 0) {  // 16 lanes at a time: the same max, quotients and round-half-even (MXCSR's default)
      __m512 amax = _mm512_setzero_ps();
      for (int d = 0; d < n; d += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(x + d)));
      const float s = to_float(from_float<bf16>(std::max(_mm512_reduce_max_ps(amax) / 127.f, 1.17549435e-38f)));
      *scale = from_float<bf16>(s);
      const __m512 sv = _mm512_set1_ps(s), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
      for (int d = 0; d < n; d += 16) {
        const __m512 y = _mm512_min_ps(_mm512_max_ps(_mm512_div_ps(_mm512_loadu_ps(x + d), sv), lo), hi);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + d), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(y)));
      }
      return;
    }
  }
#endif
  float amax = 0.f;
  for (int d = 0; d < n; ++d) amax = std::max(amax, std::fabs(x[d]));  // std::fmax: a libm call per value
  const float s = to_float(from_float<bf16>(std::max(amax / code_max<C>(), 1.17549435e-38f)));
  *scale = from_float<bf16>(s);
  for (int d = 0; d < n; ++d) codes[d] = encode<C>(x[d] / s);
}

// Each token's K and V heads ([heads, head_dim] rows, `*_row_stride` elements apart) into cache slot `slots[t]`
// (-1: none): copied, or quantized per head (`quantize_head`), keys rotated first (kv_quant.rotate).
template <typename T, typename C>
void write_kv(const T* key, int64_t key_row_stride, const T* value, int64_t value_row_stride, int64_t tokens,
              int heads, int head_dim, const int64_t* slots, C* k_cache, C* v_cache, bf16* k_scale, bf16* v_scale,
              int num_threads) {
  const int64_t row = static_cast<int64_t>(heads) * head_dim;
#pragma omp parallel num_threads(num_threads) if (tokens * row >= (1 << 16))
  {
    std::vector<float> xf(is_code<C> ? head_dim : 0);
#pragma omp for
    for (int64_t t = 0; t < tokens; ++t) {
      if (slots[t] < 0) continue;
      for (int side = 0; side < 2; ++side) {
        const T* x = side ? value + t * value_row_stride : key + t * key_row_stride;
        C* cache = (side ? v_cache : k_cache) + slots[t] * row;
        if constexpr (!is_code<C>) {
          std::memcpy(cache, x, row * sizeof(T));
        } else {
          bf16* scales = (side ? v_scale : k_scale) + slots[t] * heads;
          for (int h = 0; h < heads; ++h) {
            for (int d = 0; d < head_dim; ++d) xf[d] = to_float(x[h * head_dim + d]);
            if (side == 0) hadamard(xf.data(), head_dim);  // keys are stored rotated
            quantize_head(xf.data(), head_dim, cache + h * head_dim, scales + h);
          }
        }
      }
    }
  }
}

}  // namespace

extern "C" void tiffin_write_kv(int dtype, const void* key, int64_t key_row_stride, const void* value,
                                int64_t value_row_stride, int64_t tokens, int heads, int head_dim, const int64_t* slots,
                                int cache_dtype, void* k_cache, void* v_cache, void* k_scale, void* v_scale,
                                int num_threads) {
  by_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    by_cache_dtype<T>(cache_dtype, [&](auto cache_tag) {
      using C = decltype(cache_tag);
      write_kv<T, C>(static_cast<const T*>(key), key_row_stride, static_cast<const T*>(value), value_row_stride,
                     tokens, heads, head_dim, slots, static_cast<C*>(k_cache), static_cast<C*>(v_cache),
                     static_cast<bf16*>(k_scale), static_cast<bf16*>(v_scale), num_threads);
    });
  });
}

namespace {

// Rows of `x` normalized as the reference models do: in fp32, rounded to T, then times the weight (in T).
template <typename T>
void rms_norm(const void* x, int64_t row_stride, const void* weight, void* out, int64_t rows, int size, float eps,
              int num_threads) {
  const T* xs = static_cast<const T*>(x);
  const T* w = static_cast<const T*>(weight);
  T* o = static_cast<T*>(out);
  // a decode step's few rows take microseconds: waking the other threads would cost more
#pragma omp parallel for num_threads(num_threads) if (rows * size >= (1 << 18))
  for (int64_t i = 0; i < rows; ++i) {
    const T* row = xs + i * row_stride;
    float squares = 0.f;
#pragma omp simd reduction(+ : squares)
    for (int d = 0; d < size; ++d) squares += to_float(row[d]) * to_float(row[d]);
    const float inv = 1.f / std::sqrt(squares / size + eps);
    for (int d = 0; d < size; ++d)
      o[i * size + d] = from_float<T>(to_float(w[d]) * to_float(from_float<T>(to_float(row[d]) * inv)));
  }
}

// Neox-style rotary embedding of rows `x` [heads, head_dim] into `out` (contiguous): with c, s the cos and sin
// of the row's position (fp32 tables of head_dim / 2 columns) rounded to T, the first half becomes x1 c - x2 s
// and the second x2 c + x1 s, every product and sum rounded to T as torch's ops round them.
template <typename T>
void rotary(const void* x, int64_t row_stride, const int64_t* positions, const float* cos, const float* sin, void* out,
            int64_t rows, int heads, int head_dim, int num_threads) {
  const int half = head_dim / 2;
  auto r = [](float v) { return to_float(from_float<T>(v)); };
#pragma omp parallel for num_threads(num_threads) if (rows * heads * head_dim >= (1 << 15))
  for (int64_t i = 0; i < rows; ++i) {
    const float* c = cos + positions[i] * half;
    const float* sn = sin + positions[i] * half;
    for (int h = 0; h < heads; ++h) {
      const T* x1 = static_cast<const T*>(x) + i * row_stride + h * head_dim;
      const T* x2 = x1 + half;
      T* o = static_cast<T*>(out) + (i * heads + h) * head_dim;
#pragma omp simd
      for (int d = 0; d < half; ++d) {
        const float a = to_float(x1[d]), b = to_float(x2[d]), cd = r(c[d]), sd = r(sn[d]);
        o[d] = from_float<T>(r(a * cd) - r(b * sd));
        o[half + d] = from_float<T>(r(b * cd) + r(a * sd));
      }
    }
  }
}

// Each row's index of its first maximum, NaN counting as above everything (as torch.max): the greedy pick. torch
// tracks the index through its whole reduction; here one vectorized pass finds the max, and a search in vectorized
// chunks of 64 its first occurrence: 64 x 32000 bf16 logits, 2 threads, AMD Zen 4: 850 -> 141 us (fp32 844 -> 88).
template <typename T>
void argmax(const void* x, int64_t row_stride, int64_t* out, int64_t rows, int64_t size, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * size >= (1 << 16))
  for (int64_t i = 0; i < rows; ++i) {
    const T* row = static_cast<const T*>(x) + i * row_stride;
    float max = -INFINITY;
    int nan = 0;
#pragma omp simd reduction(max : max) reduction(| : nan)
    for (int64_t d = 0; d < size; ++d) {
      const float v = to_float(row[d]);
      max = v > max ? v : max;
      nan |= v != v;
    }
    const float pick = max;  // NaN rows: the first NaN (NaN != NaN), found by the plain scan below
    int64_t chunk = 0;
    for (; !nan && chunk < size; chunk += 64) {
      const int64_t end = chunk + 64 < size ? chunk + 64 : size;
      int hit = 0;
#pragma omp simd reduction(| : hit)
      for (int64_t d = chunk; d < end; ++d) hit |= to_float(row[d]) == pick;
      if (hit) break;
    }
    int64_t at = chunk;
    while (at < size && (nan ? to_float(row[at]) == to_float(row[at]) : to_float(row[at]) != pick)) ++at;
    out[i] = at < size ? at : 0;  // no pick: a row of -inf only, whose first is torch's
  }
}


}  // namespace

extern "C" void tiffin_rms_norm(int dtype, const void* x, int64_t row_stride, const void* weight, void* out,
                                int64_t rows, int size, float eps, int num_threads) {
  by_dtype(dtype, [&](auto tag) {
    rms_norm<decltype(tag)>(x, row_stride, weight, out, rows, size, eps, num_threads);
  });
}


extern "C" void tiffin_rotary(int dtype, const void* x, int64_t row_stride, const int64_t* positions, const float* cos,
                              const float* sin, void* out, int64_t rows, int heads, int head_dim, int num_threads) {
  by_dtype(dtype, [&](auto tag) {
    rotary<decltype(tag)>(x, row_stride, positions, cos, sin, out, rows, heads, head_dim, num_threads);
  });
}

extern "C" void tiffin_argmax(int dtype, const void* x, int64_t row_stride, int64_t* out, int64_t rows, int64_t size,
                              int num_threads) {
  by_dtype(dtype, [&](auto tag) { argmax<decltype(tag)>(x, row_stride, out, rows, size, num_threads); });
}
