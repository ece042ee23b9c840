// Attention of a prompt's queries over contiguous keys and values (its own, or a cached prefix gathered before
// them), causal or not, flash-attention style: a block of query rows walks the key tiles it may see with an online
// softmax, never holding a score matrix. bf16 runs in the CPU's bf16 dot products (AVX512-BF16: exact products,
// fp32 sums), where torch's SDPA widens bf16 to fp32 on CPUs without AMX tiles and runs at the fp32 rate (a third
// of the bf16 one on AMD Zen 4); fp32 in FMAs. The arithmetic is SDPA's: scores in fp32, probabilities rounded to
// the inputs' dtype for P.V, fp32 sums.
#include <algorithm>
#include <cstdint>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "cpu_math.h"
#include "cpu_types.h"

namespace {

#if defined(__AVX512BF16__)
constexpr int kRows = 32;   // query rows a task keeps
constexpr int kTile = 256;  // keys a step of the walk takes: the softmax's per-row work amortized over more keys
constexpr int kSub = 64;    // keys the dot products take at a time (4 vectors of 16); a tile's last ones no row
                            // sees are skipped
constexpr int kMaxHeadDim = 128;

// The kernels see K, V, queries and probabilities as 32-bit words: a bf16 pair (multiplied in the CPU's bf16
// dot products: exact products, fp32 sums) or an fp32 value (FMAs). kTokensPerWord probabilities (tokens) a word.
template <typename T>
constexpr int kTokensPerWord = 4 / static_cast<int>(sizeof(T));

template <typename T>
inline __m512 madd(__m512 acc, __m512i a, __m512i b) {
  if constexpr (std::is_same_v<T, bf16>) return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
  else return _mm512_fmadd_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(b), acc);
}

// Keys and values packed for the products, per KV head, zero-padded to a multiple of kSub keys (what the walk
// reads). K: groups of 16 keys, each word of a row a vector of the 16 keys' words ([n / 16][D / tokens][16]), so
// a query's broadcast word meets 16 keys at once. V: rows of D words, each word the values of kTokensPerWord
// tokens in one dim ([n / tokens][D]), so a broadcast word of probabilities meets 16 dims.
struct Packed {
  std::vector<uint32_t> k, v;
};

// fetch(t, k_row, v_row) writes token t's key and value rows of the KV head (d values of T each).
template <typename T, typename Fetch>
void pack(Packed& p, int n, int d, const Fetch& fetch) {
  constexpr int tokens = kTokensPerWord<T>;
  const int words = d / tokens;
  const size_t padded = static_cast<size_t>(n + kSub - 1) / kSub * kSub;
  p.k.assign(padded * words, 0);
  p.v.assign(padded * words, 0);
  alignas(64) T k_row[kMaxHeadDim], v_row[kMaxHeadDim];
  for (int t = 0; t < n; ++t) {
    fetch(t, k_row, v_row);
    const uint32_t* k_words = reinterpret_cast<const uint32_t*>(k_row);
    uint32_t* k_dst = p.k.data() + static_cast<size_t>(t / 16) * 16 * words + t % 16;
    for (int j = 0; j < words; ++j) k_dst[j * 16] = k_words[j];
    T* v_dst = reinterpret_cast<T*>(p.v.data() + static_cast<size_t>(t / tokens) * d) + t % tokens;
    for (int j = 0; j < d; ++j) v_dst[tokens * j] = v_row[j];
  }
}

// Rows of one KV head of contiguous keys and values (`*_stride` elements a token).
template <typename T>
struct DenseRows {
  const T *k, *v;
  int64_t k_stride, v_stride;
  int d;
  void operator()(int t, T* k_row, T* v_row) const {
    std::copy(k + t * k_stride, k + t * k_stride + d, k_row);
    std::copy(v + t * v_stride, v + t * v_stride + d, v_row);
  }
};

// Rows of one KV head from the paged caches through a block table: a quantized cache's codes times their token's
// scale in fp32 (kv_quant.dequantize), the keys rotated back (stored rotated: the normalized Hadamard matrix is its
// own inverse), then rounded to T; a model-dtype cache's rows as they are.
template <typename T, typename C>
struct PagedRows {
  const C *k_cache, *v_cache;
  const bf16 *k_scale, *v_scale;
  const int32_t* block_table;
  int block_size, kv_heads, head, d;
  void operator()(int t, T* k_row, T* v_row) const {
    const int64_t slot = static_cast<int64_t>(block_table[t / block_size]) * block_size + t % block_size;
    const C *k = k_cache + (slot * kv_heads + head) * d, *v = v_cache + (slot * kv_heads + head) * d;
    if constexpr (is_code<C>) {
      const float ks = to_float(k_scale[slot * kv_heads + head]), vs = to_float(v_scale[slot * kv_heads + head]);
      alignas(64) float x[kMaxHeadDim];
      for (int j = 0; j < d; ++j) x[j] = to_float(k[j]) * ks;
      hadamard(x, d);
      for (int j = 0; j < d; ++j) k_row[j] = from_float<T>(x[j]);
      for (int j = 0; j < d; ++j) v_row[j] = from_float<T>(to_float(v[j]) * vs);
    } else {
      std::copy(k, k + d, k_row);
      std::copy(v, v + d, v_row);
    }
  }
};

// Scores of 4 query rows (`q_stride` apart) against 64 packed keys, times `scale`, into rows of `s`.
template <typename T, int D>
inline void score4(float* s, const T* q, int64_t q_stride, const uint32_t* keys, float scale) {
  constexpr int words = D / kTokensPerWord<T>;
  __m512 acc[4][4];
  for (auto& row : acc)
    for (auto& a : row) a = _mm512_setzero_ps();
  for (int j = 0; j < words; ++j) {
    __m512i k[4];
    for (int c = 0; c < 4; ++c) k[c] = _mm512_loadu_si512(keys + (c * words + j) * 16);
    for (int r = 0; r < 4; ++r) {
      const __m512i qj = _mm512_set1_epi32(reinterpret_cast<const int32_t*>(q + r * q_stride)[j]);
      for (int c = 0; c < 4; ++c) acc[r][c] = madd<T>(acc[r][c], qj, k[c]);
    }
  }
  for (int r = 0; r < 4; ++r)
    for (int c = 0; c < 4; ++c)
      _mm512_storeu_ps(s + r * kTile + 16 * c, _mm512_mul_ps(acc[r][c], _mm512_set1_ps(scale)));
}

// o[r] += p[r] . V over 64 packed tokens for 4 rows (probability words, rows kTile / kTokensPerWord apart), dims
// [d0, d0 + 64).
template <typename T, int D>
inline void weigh4(float* o, const uint32_t* p, const uint32_t* values, int d0) {
  constexpr int row_words = kTile / kTokensPerWord<T>;
  __m512 acc[4][4];
  for (int r = 0; r < 4; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_loadu_ps(o + r * D + d0 + 16 * c);
  for (int j = 0; j < kSub / kTokensPerWord<T>; ++j) {
    __m512i v[4];
    for (int c = 0; c < 4; ++c) v[c] = _mm512_loadu_si512(values + j * D + d0 + 16 * c);
    for (int r = 0; r < 4; ++r) {
      const __m512i pj = _mm512_set1_epi32(static_cast<int32_t>(p[r * row_words + j]));
      for (int c = 0; c < 4; ++c) acc[r][c] = madd<T>(acc[r][c], pj, v[c]);
    }
  }
  for (int r = 0; r < 4; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(o + r * D + d0 + 16 * c, acc[r][c]);
}

inline __mmask16 first_lanes(int64_t n) {  // the lanes below n, of 16
  return n >= 16 ? 0xFFFF : (n > 0 ? static_cast<__mmask16>((1u << n) - 1) : 0);
}

// Row r's scores s[0, width) become probabilities e^(s - m) in p, as T (zero outside the keys [from, seen) it
// sees), its running max m and sum l updated and its output o rescaled to the new max.
template <typename T, int D>
inline void online_softmax(const float* s, uint32_t* p, float* o, float& m, float& l, int64_t from, int64_t seen,
                           int width) {
  const auto lanes = [&](int c) { return static_cast<__mmask16>(first_lanes(seen - c) & ~first_lanes(from - c)); };
  __m512 vmax = _mm512_set1_ps(m);
  for (int c = 0; c < seen; c += 16) vmax = _mm512_mask_max_ps(vmax, lanes(c), vmax, _mm512_loadu_ps(s + c));
  const float m_new = _mm512_reduce_max_ps(vmax);
  const float correction = m == -INFINITY ? 0.f : exp_nonpositive(m - m_new);
  __m512 sum = _mm512_setzero_ps();
  for (int c = 0; c < width; c += 16) {
    const __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(s + c), _mm512_set1_ps(m_new)));
    const __m512 kept = _mm512_maskz_mov_ps(lanes(c), e);
    sum = _mm512_add_ps(sum, kept);
    if constexpr (std::is_same_v<T, bf16>)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + c / 2), (__m256i)_mm512_cvtneps_pbh(kept));
    else
      _mm512_storeu_ps(reinterpret_cast<float*>(p + c), kept);
  }
  l = l * correction + _mm512_reduce_add_ps(sum);
  m = m_new;
  if (correction != 1.f)
    for (int d = 0; d < D; d += 16)
      _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_loadu_ps(o + d), _mm512_set1_ps(correction)));
}

// One task: query rows [0, rows) of one head against the keys each may see (row r: the first `visible + r` keys,
// all `n_k` where not causal; of those only the last `window` where window > 0), walking the tiles with a running
// max `m` and sum `l` per row, scores soft-capped at `softcap` where > 0. Rows past `rows` up to a multiple of 4
// repeat the last one in the products and are never stored.
template <typename T, int D>
void attend_rows(const T* q, int64_t q_stride, T* out, int64_t out_stride, const Packed& kv, int rows,
                 int64_t visible, int n_k, bool causal, float scale, int window, float softcap) {
  constexpr int tokens = kTokensPerWord<T>, p_row = kTile / tokens, v_row = D;  // words
  alignas(64) float s[kRows * kTile], o[kRows * D], m[kRows], l[kRows];
  alignas(64) uint32_t p[kRows * p_row];
  alignas(64) T tail[4 * D];
  const int padded = (rows + 3) / 4 * 4;
  std::fill(o, o + padded * D, 0.f);
  std::fill(m, m + rows, -INFINITY);
  std::fill(l, l + rows, 0.f);
  std::fill(p + rows * p_row, p + padded * p_row, 0u);
  for (int i = 0; i < 4; ++i) {  // the last group of 4 rows, contiguous
    const T* row = q + std::min(padded - 4 + i, rows - 1) * q_stride;
    std::copy(row, row + D, tail + i * D);
  }
  const auto seen_by = [&](int r) { return causal ? std::min<int64_t>(visible + r, n_k) : n_k; };
  const auto from_of = [&](int r) { return window > 0 ? std::max<int64_t>(seen_by(r) - window, 0) : 0; };
  const int64_t last = seen_by(rows - 1);
  for (int64_t t0 = from_of(0) / kSub * kSub; t0 < last; t0 += kTile) {  // packed keys start on kSub bounds
    const int width = static_cast<int>(std::min<int64_t>(kTile, (last - t0 + kSub - 1) / kSub * kSub));
    for (int r = 0; r < padded; r += 4) {
      const bool whole = rows - r >= 4;
      for (int c = 0; c < width; c += kSub)
        score4<T, D>(s + r * kTile + c, whole ? q + r * q_stride : tail, whole ? q_stride : D,
                     kv.k.data() + (t0 + c) * D / tokens, scale);
    }
    for (int r = 0; r < rows; ++r) {
      const int64_t seen = std::clamp<int64_t>(seen_by(r) - t0, 0, kTile);
      const int64_t from = std::clamp<int64_t>(from_of(r) - t0, 0, kTile);
      soft_cap(s + r * kTile, width, softcap);
      online_softmax<T, D>(s + r * kTile, p + r * p_row, o + r * D, m[r], l[r], from, seen, width);
    }
    for (int r = 0; r < padded; r += 4)
      for (int c = 0; c < width; c += kSub)
        for (int d0 = 0; d0 < D; d0 += 64)
          weigh4<T, D>(o + r * D, p + r * p_row + c / tokens, kv.v.data() + (t0 + c) / tokens * v_row, d0);
  }
  for (int r = 0; r < rows; ++r) {
    const __m512 inv = _mm512_set1_ps(1.f / l[r]);
    for (int d = 0; d < D; d += 16)
      store16(out + r * out_stride + d, round_to(T{}, _mm512_mul_ps(_mm512_loadu_ps(o + r * D + d), inv)));
  }
}

// rows_of(h): the fetch of KV head h's rows (DenseRows, PagedRows).
template <typename T, int D, typename RowsOf>
void prefill(const T* q, int64_t q_stride, T* out, int64_t out_stride, int n_q, int n_k, int heads, int kv_heads,
             const RowsOf& rows_of, float scale, bool causal, int window, float softcap, int num_threads) {
  std::vector<Packed> packed(kv_heads);
#pragma omp parallel for num_threads(num_threads)
  for (int h = 0; h < kv_heads; ++h) pack<T>(packed[h], n_k, D, rows_of(h));
  const int blocks = (n_q + kRows - 1) / kRows;
  // the last query blocks see the most keys: handed out first, they do not end the step alone
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
  for (int64_t task = 0; task < static_cast<int64_t>(blocks) * heads; ++task) {
    const int block = blocks - 1 - static_cast<int>(task / heads), h = static_cast<int>(task % heads);
    const int r0 = block * kRows, rows = std::min(kRows, n_q - r0);
    attend_rows<T, D>(q + r0 * q_stride + h * D, q_stride, out + r0 * out_stride + h * D, out_stride,
                      packed[h / (heads / kv_heads)], rows, static_cast<int64_t>(n_k) - n_q + r0 + 1, n_k, causal,
                      scale, window, softcap);
  }
}

// Calls run(T{}, integral_constant<D>) for `dtype` (0 fp32, 2 bf16) and a head_dim the kernel is built for.
template <typename F>
void by_dtype_and_head_dim(int dtype, int head_dim, F&& run) {
  by_dtype(dtype, [&](auto t) {
    if (head_dim == 64) run(t, std::integral_constant<int, 64>{});
    if (head_dim == 128) run(t, std::integral_constant<int, 128>{});
  });
}
#endif

}  // namespace

// Whether this build has the prefill attention for `dtype` (0 fp32, 2 bf16: the CPU's AVX512-BF16) at head_dim.
extern "C" int tiffin_prefill_supported(int dtype, int head_dim) {
#if defined(__AVX512BF16__)
  return (dtype == 0 || dtype == 2) && (head_dim == 64 || head_dim == 128);
#else
  (void)dtype, (void)head_dim;
  return 0;
#endif
}

// out[i] = softmax(q[i] . K^T * scale) V for each query row i and head, rows of `heads` (`kv_heads`) heads of
// head_dim contiguous values (`dtype` 0 fp32, 2 bf16), rows `*_stride` elements apart. Causal: query i, the last
// n_q of n_k positions, sees the first n_k - n_q + i + 1 keys (the last `window` of them where window > 0);
// otherwise all n_k. Scores soft-capped at `softcap` where > 0 (cap * tanh(score / cap)).
extern "C" void tiffin_prefill_attention(int dtype, const void* q, int64_t q_stride, const void* k, int64_t k_stride,
                                         const void* v, int64_t v_stride, void* out, int64_t out_stride, int n_q,
                                         int n_k, int heads, int kv_heads, int head_dim, float scale, int causal,
                                         int window, float softcap, int num_threads) {
#if defined(__AVX512BF16__)
  by_dtype_and_head_dim(dtype, head_dim, [&](auto t, auto d) {
    using T = decltype(t);
    constexpr int D = decltype(d)::value;
    const auto rows_of = [&](int h) {
      return DenseRows<T>{static_cast<const T*>(k) + h * D, static_cast<const T*>(v) + h * D, k_stride, v_stride, D};
    };
    prefill<T, D>(static_cast<const T*>(q), q_stride, static_cast<T*>(out), out_stride, n_q, n_k, heads, kv_heads,
                  rows_of, scale, causal != 0, window, softcap, num_threads);
  });
#else
  (void)dtype, (void)q, (void)q_stride, (void)k, (void)k_stride, (void)v, (void)v_stride, (void)out;
  (void)out_stride, (void)n_q, (void)n_k, (void)heads, (void)kv_heads, (void)head_dim, (void)scale, (void)causal;
  (void)window, (void)softcap, (void)num_threads;
#endif
}

// The same with the n_k keys and values read through `block_table` from paged caches ([blocks, block_size,
// kv_heads, head_dim]) of `cache_dtype` (the query's, or 3 int8, 4 fp8 e4m3, 5 fp8 e5m2 codes with bf16 scales
// [slots, kv_heads], keys stored rotated): no dequantized copy of the cache, and the queries not rotated.
extern "C" void tiffin_prefill_paged(int dtype, const void* q, int64_t q_stride, void* out, int64_t out_stride,
                                     int n_q, int n_k, int heads, int kv_heads, int head_dim, int cache_dtype,
                                     const void* k_cache, const void* v_cache, const void* k_scale,
                                     const void* v_scale, const int32_t* block_table, int block_size, float scale,
                                     int causal, int window, float softcap, int num_threads) {
#if defined(__AVX512BF16__)
  by_dtype_and_head_dim(dtype, head_dim, [&](auto t, auto d) {
    using T = decltype(t);
    constexpr int D = decltype(d)::value;
    by_cache_dtype<T>(cache_dtype, [&](auto c) {
      using C = decltype(c);
      const auto rows_of = [&](int h) {
        return PagedRows<T, C>{static_cast<const C*>(k_cache), static_cast<const C*>(v_cache),
                               static_cast<const bf16*>(k_scale), static_cast<const bf16*>(v_scale),
                               block_table, block_size, kv_heads, h, D};
      };
      prefill<T, D>(static_cast<const T*>(q), q_stride, static_cast<T*>(out), out_stride, n_q, n_k, heads, kv_heads,
                    rows_of, scale, causal != 0, window, softcap, num_threads);
    });
  });
#else
  (void)dtype, (void)q, (void)q_stride, (void)out, (void)out_stride, (void)n_q, (void)n_k, (void)heads;
  (void)kv_heads, (void)head_dim, (void)cache_dtype, (void)k_cache, (void)v_cache, (void)k_scale, (void)v_scale;
  (void)block_table, (void)block_size, (void)scale, (void)causal, (void)window, (void)softcap, (void)num_threads;
#endif
}
