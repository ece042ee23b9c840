// The pieces of cpu_paged_decode.cpp's AVX-512 decode task (head_dim 64 or 128): loads of every cache type as
// fp32, the dot products, P·V. The task scores 16 tokens at a time for all the task's query heads, each dot
// product kept as 16 partial sums and the 16 reduced together (one horizontal sum per token cost more than the
// dot), the next tile's K rows prefetched (blocks lie anywhere in memory); then P·V per KV head. 1.5-2x the
// generic loop on a 64-sequence decode (Intel Xeon AMX, 1 and 2 threads).
#pragma once
#include <cstdint>
#include <type_traits>

#include "cpu_types.h"

#if defined(__AVX512F__)
#include <immintrin.h>
namespace {

inline __m256i load16_bytes(const void* p) {
  return _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m512 load16(const i8* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 load16(const e5m2* p) {  // e5m2 is the high byte of an fp16
  return _mm512_cvtph_ps(_mm256_slli_epi16(load16_bytes(p), 8));
}
inline __m512 load16(const e4m3* p) {  // as an fp16 (sign, then exponent and mantissa shifted in): 2^-8 of its value
  const __m256i b = load16_bytes(p);
  const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8);
  const __m256i rest = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7f)), 7);
  return _mm512_mul_ps(_mm512_cvtph_ps(_mm256_or_si256(sign, rest)), _mm512_set1_ps(256.f));
}

// Lane i of the result: the sum of v[i]'s 16 lanes (a transpose folded into the additions).
inline __m512 sum_each(const __m512* v) {
  __m512 w[8], x[4];
  for (int i = 0; i < 8; ++i)
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
    x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // x[i]'s 128-bit lane L holds vectors 4i..4i+3 summed within lane L; add the four lanes
  __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x44), _mm512_shuffle_f32x4(x[0], x[1], 0xEE));
  __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], 0x44), _mm512_shuffle_f32x4(x[2], x[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xDD));
}

// q·k over D dims as 16 partial sums. bf16 uses the CPU's bf16 dot product where it has one (exact products,
// fp32 sums); otherwise K is widened to fp32 against the fp32 copy of q.
template <int D, typename T, typename C>
inline __m512 dot_partial(const float* qf, const T* q, const C* k) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, bf16> && std::is_same_v<C, bf16>) {
    __m512 acc = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 32)
      acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + d), (__m512bh)_mm512_loadu_si512(k + d));
    return acc;
  }
#endif
  __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qf), load16(k));
  for (int d = 16; d < D; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qf + d), load16(k + d), acc);
  return acc;
}

#if defined(__AVX512VNNI__)
// q.k over D dims as 16 partial sums for int8 keys: each widened to int16 against the query in int16 (15 bits of its
// head's largest magnitude: `quantize_query`), in int16 dot products. Converting the keys to fp32 instead took four
// instructions per 16 products, and bound the kernel by them rather than by reading the cache.
template <int D>
inline __m512 dot_partial_i8(const int16_t* q16, const i8* k) {
  __m512i acc = _mm512_setzero_si512();
  for (int d = 0; d < D; d += 32) {
    const __m512i k16 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(k + d)));
    acc = _mm512_dpwssd_epi32(acc, k16, _mm512_loadu_si512(q16 + d));
  }
  return _mm512_cvtepi32_ps(acc);
}

// Each of `heads` rows of D values as int16 codes of its largest magnitude / 32767; -> the rows' steps.
template <int D>
void quantize_query(const float* qf, int heads, int16_t* q16, float* steps) {
  for (int h = 0; h < heads; ++h) {
    const float* x = qf + h * D;
    __m512 amax = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(x + d)));
    const float largest = _mm512_reduce_max_ps(amax);
    steps[h] = largest > 0.f ? largest / 32767.f : 1.f;
    const __m512 step = _mm512_set1_ps(steps[h]);
    for (int d = 0; d < D; d += 16)  // rounded to nearest even, as nearbyint
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q16 + h * D + d),
                          _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_div_ps(_mm512_loadu_ps(x + d), step))));
  }
}
#endif

// The task's query heads P·V, one KV head at a time: its query heads' accumulators stay in registers (up to
// 16 of them), and each token's V row is widened once for all of them.
template <int D, typename T, typename C>
void weigh_values(T* out, const C* v_cache, const int64_t* offsets, const float* probs, const float* denom, int len,
                  int kv_heads, int group) {
  constexpr int V = D / 16, HEADS = V <= 8 ? 16 / V : 1;
  for (int h = 0; h < kv_heads; ++h) {
    for (int g0 = h * group; g0 < (h + 1) * group; g0 += HEADS) {
      const int heads = (h + 1) * group - g0 < HEADS ? (h + 1) * group - g0 : HEADS;
      __m512 acc[HEADS][V];
      for (int g = 0; g < HEADS; ++g)
        for (int j = 0; j < V; ++j) acc[g][j] = _mm512_setzero_ps();
      for (int t = 0; t < len; ++t) {
        if (h == 0 && t + 32 < len)  // the whole row: the later heads' passes find it in L2
          for (int l = 0; l < kv_heads * D * static_cast<int>(sizeof(C)); l += 64)
            _mm_prefetch(reinterpret_cast<const char*>(v_cache + offsets[t + 32]) + l, _MM_HINT_T1);
        if (t + 16 < len)
          for (int l = 0; l < D * static_cast<int>(sizeof(C)); l += 64)
            _mm_prefetch(reinterpret_cast<const char*>(v_cache + h * D + offsets[t + 16]) + l, _MM_HINT_T0);
        __m512 v[V];
        for (int j = 0; j < V; ++j) v[j] = load16(v_cache + h * D + offsets[t] + 16 * j);
        for (int g = 0; g < HEADS && g < heads; ++g) {
          const __m512 p = _mm512_set1_ps(probs[(g0 + g) * len + t]);
          for (int j = 0; j < V; ++j) acc[g][j] = _mm512_fmadd_ps(p, v[j], acc[g][j]);
        }
      }
      alignas(64) float row[D];
      for (int g = 0; g < heads; ++g) {
        for (int j = 0; j < V; ++j)
          _mm512_store_ps(row + 16 * j, _mm512_mul_ps(acc[g][j], _mm512_set1_ps(denom[g0 + g])));
        for (int d = 0; d < D; ++d) out[(g0 + g) * D + d] = from_float<T>(row[d]);
      }
    }
  }
}

}  // namespace
#endif
