// cpu_paged_decode.cpp's vectorized decode task on 8 lanes, for x86 CPUs with AVX2 but no AVX-512 (AMD Zen 2/3,
// Intel before Ice Lake): head_dim 64 or 128, a cache in the model's dtype or quantized (int8, fp8 codes). Scores 8 tokens at a time for every query head of the task, each dot product kept as 8 partial sums and
// the 8 reduced together, the next tiles' K rows prefetched (blocks lie anywhere in memory); then P·V a query head
// and 64 dims at a time, the accumulators in registers. The generic loop reduces each dot product alone and keeps
// P·V's sums in memory.
#pragma once
#include <algorithm>
#include <cstdint>

#include "cpu_math.h"
#include "cpu_types.h"

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define TIFFIN_AVX2_DECODE 1
namespace {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline __m128i load8_bytes(const void* p) {
  return _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8(const i8* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 load8(const e5m2* p) { return _mm256_cvtph_ps(_mm_slli_epi16(load8_bytes(p), 8)); }  // an fp16's top
inline __m256 load8(const e4m3* p) {  // as an fp16 (sign, then exponent and mantissa shifted in): 2^-8 of its value
  const __m128i b = load8_bytes(p);
  const __m128i sign = _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8);
  const __m128i rest = _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7f)), 7);
  return _mm256_mul_ps(_mm256_cvtph_ps(_mm_or_si128(sign, rest)), _mm256_set1_ps(256.f));
}

// Lane i of the result: the sum of v[i]'s 8 lanes.
inline __m256 sum_each8(const __m256* v) {
  // q0's low 128 bits: v0..v3's sums of their lanes 0-3, its high 128 bits the same of lanes 4-7; q1 of v4..v7
  const __m256 q0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 q1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(q0, q1, 0x20), _mm256_permute2f128_ps(q0, q1, 0x31));
}

// q·k over D dims as 8 partial sums.
template <int D, typename C>
inline __m256 dot8(const float* q, const C* k) {
  __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(q), load8(k));
  for (int d = 8; d < D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(k + d), acc);
  return acc;
}

// Tokens [from, to)'s rows of `bytes` bytes, to the cache level HINT names.
template <int HINT, typename C>
inline void prefetch_rows(const C* cache, const int64_t* offsets, int from, int to, int bytes) {
  for (int j = from; j < to; ++j)
    for (int l = 0; l < bytes; l += 64) _mm_prefetch(reinterpret_cast<const char*>(cache + offsets[j]) + l, static_cast<decltype(_MM_HINT_T0)>(HINT));
}

// scores[hq * len + t] = qf[hq] · K[t] of head hq / group, for the task's `heads` query heads (q pre-scaled, fp32),
// times the token's K scale ks[(hq / group) * len + t] where `ks` is given (a quantized cache). `offsets` are element
// offsets of each token's row of `kv_heads` heads in `k_cache`.
template <int D, typename C>
void scores8(const float* qf, const C* k_cache, const int64_t* offsets, int len, int heads, int group, int kv_heads,
             const float* ks, float* scores) {
  const int row_bytes = kv_heads * D * static_cast<int>(sizeof(C));
  int t = 0;
  for (; t + 8 <= len; t += 8) {  // the next tile's rows to L1, the one after to L2 (L1 tracks few misses at once)
    prefetch_rows<_MM_HINT_T0>(k_cache, offsets, t + 8, std::min(t + 16, len), row_bytes);
    prefetch_rows<_MM_HINT_T1>(k_cache, offsets, std::min(t + 16, len), std::min(t + 24, len), row_bytes);
    for (int hq = 0; hq < heads; ++hq) {
      const C* k = k_cache + (hq / group) * D;
      __m256 part[8];
      for (int j = 0; j < 8; ++j) part[j] = dot8<D>(qf + hq * D, k + offsets[t + j]);
      const __m256 s8 = sum_each8(part);
      _mm256_storeu_ps(scores + hq * len + t, ks ? _mm256_mul_ps(s8, _mm256_loadu_ps(ks + (hq / group) * len + t)) : s8);
    }
  }
  for (; t < len; ++t)
    for (int hq = 0; hq < heads; ++hq) {
      const float s = sum8(dot8<D>(qf + hq * D, k_cache + (hq / group) * D + offsets[t]));
      scores[hq * len + t] = ks ? s * ks[(hq / group) * len + t] : s;
    }
}

// out[hq] = sum_t probs[hq * len + t] V[t] of head hq / group, times denom[hq], rounded to T: 64 dims at a time, their
// 8 accumulators in registers.
template <int D, typename T, typename C>
void weigh_values8(T* out, const C* v_cache, const int64_t* offsets, const float* probs, const float* denom, int len,
                   int heads, int group) {
  for (int hq = 0; hq < heads; ++hq)
    for (int c = 0; c < D; c += 64) {
      const C* v = v_cache + (hq / group) * D + c;
      const float* p = probs + hq * len;
      __m256 acc[8];
      for (auto& a : acc) a = _mm256_setzero_ps();
      for (int t = 0; t < len; ++t) {
        const __m256 pt = _mm256_set1_ps(p[t]);
        for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(pt, load8(v + offsets[t] + 8 * j), acc[j]);
      }
      alignas(32) float row[64];
      for (int j = 0; j < 8; ++j) _mm256_store_ps(row + 8 * j, _mm256_mul_ps(acc[j], _mm256_set1_ps(denom[hq])));
      for (int d = 0; d < 64; ++d) out[hq * D + c + d] = from_float<T>(row[d]);
    }
}

}  // namespace
#endif
