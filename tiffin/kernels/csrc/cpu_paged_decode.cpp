// Paged attention for one-token queries (decode), read through the block table in place: the torch path gathers
// each sequence's blocks into a contiguous copy first, tripling the memory traffic of an op bound by it. Tasks are
// a sequence's query heads sharing some KV heads; for head_dim 64 or 128 a vectorized task scores 16 tokens at a
// time on AVX-512 (cpu_paged_decode_avx512.h) or 8 on AVX2 (cpu_paged_decode_avx2.h), elsewhere the generic loop.
// Built with the other kernels by tiffin/kernels/cpu_native.py.
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
#include "cpu_paged_decode_avx2.h"
#include "cpu_paged_decode_avx512.h"
#include "cpu_types.h"

namespace {

// Each of `rows` rows of `len` scores becomes e^(score - its max); denom[row] = 1 / the row's sum.
inline void softmax_rows(float* scores, float* denom, int rows, int len) {
  for (int r = 0; r < rows; ++r) {
    float* sr = scores + static_cast<int64_t>(r) * len;
#if defined(__AVX512F__)
    const auto tail = [&](int t) { return static_cast<__mmask16>(len - t >= 16 ? 0xFFFF : (1u << (len - t)) - 1); };
    __m512 vmax = _mm512_set1_ps(sr[0]);
    for (int t = 0; t < len; t += 16)
      vmax = _mm512_mask_max_ps(vmax, tail(t), _mm512_maskz_loadu_ps(tail(t), sr + t), vmax);
    const __m512 max = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
    __m512 sum = _mm512_setzero_ps();
    for (int t = 0; t < len; t += 16) {
      const __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail(t), sr + t), max));
      _mm512_mask_storeu_ps(sr + t, tail(t), e);
      sum = _mm512_mask_add_ps(sum, tail(t), sum, e);
    }
    denom[r] = 1.f / _mm512_reduce_add_ps(sum);
#elif defined(__AVX2__) && defined(__FMA__)
    const int whole = len / 8 * 8;
    __m256 vmax = _mm256_set1_ps(sr[0]);
    for (int t = 0; t < whole; t += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(sr + t));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    float max = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    for (int t = whole; t < len; ++t) max = sr[t] > max ? sr[t] : max;
    __m256 sum = _mm256_setzero_ps();
    for (int t = 0; t < whole; t += 8) {
      const __m256 e = exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(sr + t), _mm256_set1_ps(max)));
      _mm256_storeu_ps(sr + t, e);
      sum = _mm256_add_ps(sum, e);
    }
    float total = sum8(sum);
    for (int t = whole; t < len; ++t) total += sr[t] = exp_nonpositive(sr[t] - max);
    denom[r] = 1.f / total;
#else
    float max = sr[0];
#pragma omp simd reduction(max : max)
    for (int t = 1; t < len; ++t) max = sr[t] > max ? sr[t] : max;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int t = 0; t < len; ++t) {
      sr[t] = exp_nonpositive(sr[t] - max);
      sum += sr[t];
    }
    denom[r] = 1.f / sum;
#endif
  }
}

// The cache offsets of tokens [lo, lo + len) of a sequence (its window's keys: all from lo = 0), found once per
// sequence and shared by its heads and by K and V: offsets[t] is token lo + t's slot times `slot_stride`.
inline void token_offsets(std::vector<int64_t>& offsets, const int32_t* block_table, int block_size, int lo, int len,
                          int64_t slot_stride) {
  offsets.resize(len);
  for (int b = lo / block_size, i = lo % block_size, t = 0; t < len; ++b, i = 0) {
    const int64_t first = static_cast<int64_t>(block_table[b]) * block_size;
    for (; i < block_size && t < len; ++i, ++t) offsets[t] = (first + i) * slot_stride;
  }
}

// The scales of a quantized cache's tokens [lo, lo + len) for the task's KV heads: ks[h * len + t] (vs[...]) is
// token lo + t's K (V) scale of KV head kv_first + h. A block's scales are `[block_size, num_kv_heads]`, read block
// by block through the table, a few blocks ahead prefetched (each block lies anywhere: every one a cache miss
// otherwise).
inline void token_scales(float* ks, float* vs, const bf16* k_scale, const bf16* v_scale, const int32_t* block_table,
                         int block_size, int lo, int len, int kv_first, int kv_heads, int num_kv_heads) {
  constexpr int AHEAD = 8;
  const int end_block = (lo + len + block_size - 1) / block_size;
  const int64_t block_stride = static_cast<int64_t>(block_size) * num_kv_heads;
  for (int b = lo / block_size, i = lo % block_size, t = 0; t < len; ++b, i = 0) {
    if (b + AHEAD < end_block) {
      __builtin_prefetch(k_scale + block_table[b + AHEAD] * block_stride + kv_first);
      __builtin_prefetch(v_scale + block_table[b + AHEAD] * block_stride + kv_first);
    }
    const int64_t first = block_table[b] * block_stride + kv_first;
    for (; i < block_size && t < len; ++i, ++t)
      for (int h = 0; h < kv_heads; ++h) {
        ks[h * len + t] = to_float(k_scale[first + i * num_kv_heads + h]);
        vs[h * len + t] = to_float(v_scale[first + i * num_kv_heads + h]);
      }
  }
}

// Probabilities times their tokens' V scales (sum_t p_t s_t v_t): row hq of `probs` by row hq / group of `scales`.
inline void weigh_by_scales(float* __restrict probs, const float* __restrict scales, int heads, int group, int len) {
  for (int hq = 0; hq < heads; ++hq) {
    float* __restrict p = probs + static_cast<int64_t>(hq) * len;
    const float* __restrict s = scales + static_cast<int64_t>(hq / group) * len;
#pragma omp simd
    for (int t = 0; t < len; ++t) p[t] *= s[t];
  }
}

// One task: the query heads of one sequence that share KV heads [kv_first, kv_end), reading each token's K (then
// V) rows of those heads together, contiguous in the cache. Scores and the output accumulate in fp32. A quantized
// cache (C a code type) multiplies each token's scores by its K scale and its probabilities by its V scale.
template <typename T, typename C>
void decode_task(const T* q, T* out, const C* k_cache, const C* v_cache, const bf16* k_scale, const bf16* v_scale,
                 const int32_t* block_table, int len, int kv_first, int kv_end, int group, int num_kv_heads,
                 int head_dim, int block_size, float scale, int lo, float softcap, std::vector<float>& buf,
                 std::vector<int64_t>& offsets) {
  const int heads = (kv_end - kv_first) * group;  // query heads of this task, from query head kv_first * group
  const int64_t slot_stride = static_cast<int64_t>(num_kv_heads) * head_dim;
  q += kv_first * group * head_dim;
  out += kv_first * group * head_dim;
  token_offsets(offsets, block_table, block_size, lo, len, slot_stride);
  const int kv_heads = kv_end - kv_first;
  buf.resize(static_cast<size_t>(heads) * (2 * head_dim + len + 1) + 2 * kv_heads * len);
  float* qf = buf.data();
  float* acc = qf + heads * head_dim;
  float* scores = acc + heads * head_dim;
  float* denom = scores + heads * len;
  float* ks = denom + heads;
  float* vs = ks + kv_heads * len;
  if constexpr (is_code<C>) {
    token_scales(ks, vs, k_scale, v_scale, block_table, block_size, lo, len, kv_first, kv_heads, num_kv_heads);
  }
  for (int i = 0; i < heads * head_dim; ++i) qf[i] = to_float(q[i]) * scale;
  if constexpr (is_code<C>)  // keys are stored rotated
    for (int hq = 0; hq < heads; ++hq) hadamard(qf + hq * head_dim, head_dim);
  for (int t = 0; t < len; ++t) {
    const C* k = k_cache + offsets[t] + kv_first * head_dim;
    for (int hq = 0; hq < heads; ++hq) {
      const float* qh = qf + hq * head_dim;
      const C* kh = k + (hq / group) * head_dim;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int d = 0; d < head_dim; ++d) dot += qh[d] * to_float(kh[d]);
      scores[hq * len + t] = is_code<C> ? dot * ks[(hq / group) * len + t] : dot;
    }
  }
  soft_cap(scores, static_cast<int64_t>(heads) * len, softcap);
  softmax_rows(scores, denom, heads, len);
  std::memset(acc, 0, sizeof(float) * heads * head_dim);
  for (int t = 0; t < len; ++t) {
    const C* v = v_cache + offsets[t] + kv_first * head_dim;
    for (int hq = 0; hq < heads; ++hq) {
      const float p = is_code<C> ? scores[hq * len + t] * vs[(hq / group) * len + t] : scores[hq * len + t];
      const C* vh = v + (hq / group) * head_dim;
      float* ah = acc + hq * head_dim;
#pragma omp simd
      for (int d = 0; d < head_dim; ++d) ah[d] += p * to_float(vh[d]);
    }
  }
  for (int hq = 0; hq < heads; ++hq)
    for (int d = 0; d < head_dim; ++d) out[hq * head_dim + d] = from_float<T>(acc[hq * head_dim + d] * denom[hq]);
}

#if defined(__AVX512F__)
// decode_task on 16 lanes (cpu_paged_decode_avx512.h), for head_dim D 64 or 128.
template <int D, typename T, typename C>
void decode_task_avx512(const T* q, T* out, const C* k_cache, const C* v_cache, const bf16* k_scale,
                        const bf16* v_scale, const int32_t* block_table, int len, int kv_first, int kv_end, int group,
                        int num_kv_heads, int block_size, float scale, int lo, float softcap,
                        std::vector<float>& buf, std::vector<int64_t>& offsets) {
  const int heads = (kv_end - kv_first) * group, kv_heads = kv_end - kv_first;  // query heads from kv_first * group
  q += kv_first * group * D;
  out += kv_first * group * D;
  token_offsets(offsets, block_table, block_size, lo, len, static_cast<int64_t>(num_kv_heads) * D);
  buf.resize(static_cast<size_t>(heads) * (D + len + 1) + 2 * kv_heads * len + heads * (D / 2 + 1));
  float* qf = buf.data();
  float* scores = qf + heads * D;
  float* denom = scores + heads * len;
  float* ks = denom + heads;
  float* vs = ks + kv_heads * len;
  float* q_steps = vs + kv_heads * len;  // int8 keys: the query's int16 codes and their steps
  int16_t* q16 = reinterpret_cast<int16_t*>(q_steps + heads);
  if constexpr (is_code<C>) {
    token_scales(ks, vs, k_scale, v_scale, block_table, block_size, lo, len, kv_first, kv_heads, num_kv_heads);
  }
  k_cache += kv_first * D;
  v_cache += kv_first * D;
  for (int i = 0; i < heads * D; ++i) qf[i] = to_float(q[i]);
  if constexpr (is_code<C>)  // keys are stored rotated
    for (int hq = 0; hq < heads; ++hq) hadamard(qf + hq * D, D);
#if defined(__AVX512VNNI__)
  constexpr bool int16_dots = std::is_same_v<C, i8>;
  if constexpr (int16_dots) quantize_query<D>(qf, heads, q16, q_steps);
#else
  constexpr bool int16_dots = false;
#endif
  // q.k of head hq over the 16 tokens from `at`, and of token `at` alone
  auto dot = [&](int hq, int64_t at) {
#if defined(__AVX512VNNI__)
    if constexpr (int16_dots) return dot_partial_i8<D>(q16 + hq * D, k_cache + (hq / group) * D + at);
#endif
    return dot_partial<D>(qf + hq * D, q + hq * D, k_cache + (hq / group) * D + at);
  };
  auto head_scale = [&](int hq) { return int16_dots ? scale * q_steps[hq] : scale; };
  int t = 0;
  const int row_lines = kv_heads * D * static_cast<int>(sizeof(C)) / 64;
  for (; t + 16 <= len; t += 16) {  // every head over one tile of 16 tokens, while its K rows are in L1
    for (int j = t + 16; j < t + 32 && j < len; ++j)  // the next tile's rows: blocks lie anywhere in memory
      for (int l = 0; l < row_lines; ++l)
        _mm_prefetch(reinterpret_cast<const char*>(k_cache + offsets[j]) + 64 * l, _MM_HINT_T0);
    for (int j = t + 32; j < t + 48 && j < len; ++j)  // and the one after into L2: L1 tracks few misses at a time
      for (int l = 0; l < row_lines; ++l)
        _mm_prefetch(reinterpret_cast<const char*>(k_cache + offsets[j]) + 64 * l, _MM_HINT_T1);
    for (int hq = 0; hq < heads; ++hq) {
      __m512 part[16];
      for (int j = 0; j < 16; ++j) part[j] = dot(hq, offsets[t + j]);
      __m512 s16 = _mm512_mul_ps(sum_each(part), _mm512_set1_ps(head_scale(hq)));
      if constexpr (is_code<C>) s16 = _mm512_mul_ps(s16, _mm512_loadu_ps(ks + (hq / group) * len + t));
      _mm512_storeu_ps(scores + hq * len + t, s16);
    }
  }
  for (; t < len; ++t)
    for (int hq = 0; hq < heads; ++hq) {
      const float token_scale = is_code<C> ? ks[(hq / group) * len + t] : 1.f;
      scores[hq * len + t] = _mm512_reduce_add_ps(dot(hq, offsets[t])) * head_scale(hq) * token_scale;
    }
  soft_cap(scores, static_cast<int64_t>(heads) * len, softcap);
  softmax_rows(scores, denom, heads, len);
  if constexpr (is_code<C>) weigh_by_scales(scores, vs, heads, group, len);
  weigh_values<D>(out, v_cache, offsets.data(), scores, denom, len, kv_heads, group);
}
#endif

#if TIFFIN_AVX2_DECODE
// decode_task on 8 lanes (cpu_paged_decode_avx2.h), for head_dim D 64 or 128.
template <int D, typename T, typename C>
void decode_task_avx2(const T* q, T* out, const C* k_cache, const C* v_cache, const bf16* k_scale,
                      const bf16* v_scale, const int32_t* block_table, int len, int kv_first, int kv_end, int group,
                      int num_kv_heads, int block_size, float scale, int lo, float softcap, std::vector<float>& buf,
                      std::vector<int64_t>& offsets) {
  const int heads = (kv_end - kv_first) * group, kv_heads = kv_end - kv_first;  // query heads from kv_first * group
  q += kv_first * group * D;
  out += kv_first * group * D;
  token_offsets(offsets, block_table, block_size, lo, len, static_cast<int64_t>(num_kv_heads) * D);
  buf.resize(static_cast<size_t>(heads) * (D + len + 1) + 2 * kv_heads * len);
  float* qf = buf.data();
  float* scores = qf + heads * D;
  float* denom = scores + heads * len;
  float* ks = denom + heads;
  float* vs = ks + kv_heads * len;
  for (int i = 0; i < heads * D; ++i) qf[i] = to_float(q[i]) * scale;
  if constexpr (is_code<C>) {  // keys are stored rotated
    token_scales(ks, vs, k_scale, v_scale, block_table, block_size, lo, len, kv_first, kv_heads, num_kv_heads);
    for (int hq = 0; hq < heads; ++hq) hadamard(qf + hq * D, D);
  }
  scores8<D>(qf, k_cache + kv_first * D, offsets.data(), len, heads, group, kv_heads, is_code<C> ? ks : nullptr,
             scores);
  soft_cap(scores, static_cast<int64_t>(heads) * len, softcap);
  softmax_rows(scores, denom, heads, len);
  if constexpr (is_code<C>) weigh_by_scales(scores, vs, heads, group, len);
  weigh_values8<D>(out, v_cache + kv_first * D, offsets.data(), scores, denom, len, heads, group);
}
#endif

// The vectorized task this CPU runs for head_dim D (64 or 128), where it has one.
#if defined(__AVX512F__)
template <int D, typename T, typename C>
constexpr auto vector_task = decode_task_avx512<D, T, C>;
#elif TIFFIN_AVX2_DECODE
template <int D, typename T, typename C>
constexpr auto vector_task = decode_task_avx2<D, T, C>;
#endif

template <typename T, typename C>
void decode(const void* query, int64_t query_row_stride, void* out, int64_t out_row_stride, const void* k_cache,
            const void* v_cache, const void* k_scale, const void* v_scale, const int32_t* block_tables,
            int64_t block_table_stride, const int32_t* seq_lens, const int64_t* rows, const int64_t* seqs,
            int64_t num_rows, int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
            int window, float softcap, int num_threads) {
  // Whole sequences per task read the cache contiguously (1.4x faster); with few sequences, one task per KV
  // head instead, so that every thread has work.
  const int kv_per_task = num_rows >= 4 * num_threads ? num_kv_heads : 1;
  const int tasks_per_row = num_kv_heads / kv_per_task;
  const C *kc = static_cast<const C*>(k_cache), *vc = static_cast<const C*>(v_cache);
  const bf16 *ks = static_cast<const bf16*>(k_scale), *vs = static_cast<const bf16*>(v_scale);
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> buf;
    std::vector<int64_t> offsets;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < num_rows * tasks_per_row; ++task) {
      const int64_t i = task / tasks_per_row;
      const int kv_first = static_cast<int>(task % tasks_per_row) * kv_per_task;
      const T* q = static_cast<const T*>(query) + rows[i] * query_row_stride;
      T* o = static_cast<T*>(out) + rows[i] * out_row_stride;
      const int32_t* table = block_tables + seqs[i] * block_table_stride;
      const int group = num_heads / num_kv_heads, seq_len = seq_lens[seqs[i]], kv_end = kv_first + kv_per_task;
      const int lo = window > 0 && seq_len > window ? seq_len - window : 0, len = seq_len - lo;  // keys it sees
#if defined(__AVX512F__) || TIFFIN_AVX2_DECODE
      if (head_dim == 64 || head_dim == 128) {
        auto run = head_dim == 64 ? vector_task<64, T, C> : vector_task<128, T, C>;
        run(q, o, kc, vc, ks, vs, table, len, kv_first, kv_end, group, num_kv_heads, block_size, scale, lo, softcap,
            buf, offsets);
        continue;
      }
#endif
      decode_task(q, o, kc, vc, ks, vs, table, len, kv_first, kv_end, group, num_kv_heads, head_dim, block_size,
                  scale, lo, softcap, buf, offsets);
    }
  }
}
}  // namespace

// dtype: 0 float32, 2 bfloat16 (fp16 stays on torch: converting it is slow without AVX512-FP16); cache_dtype the
// same, or 3 int8, 4 fp8 e4m3, 5 fp8 e5m2 codes with bf16 scales [slots, num_kv_heads]. Query row `rows[i]` attends
// to the first `seq_lens[seqs[i]]` slots of block table `seqs[i]` (the last `window` of them where window > 0),
// its scores soft-capped at `softcap` where > 0; heads are contiguous within a row, head_dim within a head.
extern "C" void tiffin_paged_decode(int dtype, const void* query, int64_t query_row_stride, void* out,
                                    int64_t out_row_stride, int cache_dtype, const void* k_cache, const void* v_cache,
                                    const void* k_scale, const void* v_scale, const int32_t* block_tables,
                                    int64_t block_table_stride, const int32_t* seq_lens, const int64_t* rows,
                                    const int64_t* seqs, int64_t num_rows, int num_heads, int num_kv_heads,
                                    int head_dim, int block_size, float scale, int window, float softcap,
                                    int num_threads) {
  by_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    by_cache_dtype<T>(cache_dtype, [&](auto cache_tag) {
      decode<T, decltype(cache_tag)>(query, query_row_stride, out, out_row_stride, k_cache, v_cache, k_scale,
                                     v_scale, block_tables, block_table_stride, seq_lens, rows, seqs, num_rows,
                                     num_heads, num_kv_heads, head_dim, block_size, scale, window, softcap,
                                     num_threads);
    });
  });
}
