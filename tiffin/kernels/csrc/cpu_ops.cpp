// CPU kernels where torch's ops cost most on a decode step. Paged attention for one-token queries reads K/V
// through the block table in place (the torch path gathers each sequence's blocks into a contiguous copy
// first, tripling the memory traffic of an op bound by it); RMSNorm is one pass instead of ~8 small ops.
// Built by tiffin/kernels/cpu_native.py with the host's compiler; torch's OpenMP runtime runs the threads
// (the library links libgomp.so.1, which resolves to the copy torch already loaded).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

struct bf16 {
  uint16_t bits;
};

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) {
  uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

template <typename T>
T from_float(float x);
template <>
float from_float<float>(float x) { return x; }
template <>
bf16 from_float<bf16>(float x) {  // round to nearest even, as torch does
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if (std::isnan(x)) return bf16{0x7FC0};
  u += 0x7FFF + ((u >> 16) & 1);
  return bf16{static_cast<uint16_t>(u >> 16)};
}

// e^x for x <= 0 (softmax after subtracting the max): Cephes' expf polynomial, written so that the compiler
// vectorizes it (libm's expf is a scalar call). Relative error ~2e-7.
inline float exp_nonpositive(float x) {
  x = x < -87.f ? -87.f : x;
  float n = std::floor(x * 1.44269504f + 0.5f);
  float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// One task: the query heads of one sequence that share KV heads [kv_first, kv_end), reading each token's K (then
// V) rows of those heads together, contiguous in the cache. Scores and the output accumulate in fp32.
template <typename T>
void decode_task(const T* q, T* out, const T* k_cache, const T* v_cache, const int32_t* block_table, int len,
                 int kv_first, int kv_end, int group, int num_kv_heads, int head_dim, int block_size, float scale,
                 std::vector<float>& buf) {
  const int heads = (kv_end - kv_first) * group;  // query heads of this task, from query head kv_first * group
  const int64_t slot_stride = static_cast<int64_t>(num_kv_heads) * head_dim;
  q += kv_first * group * head_dim;
  out += kv_first * group * head_dim;
  buf.resize(static_cast<size_t>(heads) * (2 * head_dim + len + 1));
  float* qf = buf.data();
  float* acc = qf + heads * head_dim;
  float* scores = acc + heads * head_dim;
  float* denom = scores + heads * len;
  for (int i = 0; i < heads * head_dim; ++i) qf[i] = to_float(q[i]) * scale;
  auto slot = [&](const T* cache, int t) {
    return cache + (static_cast<int64_t>(block_table[t / block_size]) * block_size + t % block_size) * slot_stride +
           kv_first * head_dim;
  };
  for (int t = 0; t < len; ++t) {
    const T* k = slot(k_cache, t);
    for (int hq = 0; hq < heads; ++hq) {
      const float* qh = qf + hq * head_dim;
      const T* kh = k + (hq / group) * head_dim;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int d = 0; d < head_dim; ++d) dot += qh[d] * to_float(kh[d]);
      scores[hq * len + t] = dot;
    }
  }
  for (int hq = 0; hq < heads; ++hq) {
    float* sh = scores + hq * len;
    float max = sh[0];
#pragma omp simd reduction(max : max)
    for (int t = 1; t < len; ++t) max = sh[t] > max ? sh[t] : max;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int t = 0; t < len; ++t) {
      sh[t] = exp_nonpositive(sh[t] - max);
      sum += sh[t];
    }
    denom[hq] = 1.f / sum;
  }
  std::memset(acc, 0, sizeof(float) * heads * head_dim);
  for (int t = 0; t < len; ++t) {
    const T* v = slot(v_cache, t);
    for (int hq = 0; hq < heads; ++hq) {
      const float p = scores[hq * len + t];
      const T* vh = v + (hq / group) * head_dim;
      float* ah = acc + hq * head_dim;
#pragma omp simd
      for (int d = 0; d < head_dim; ++d) ah[d] += p * to_float(vh[d]);
    }
  }
  for (int hq = 0; hq < heads; ++hq)
    for (int d = 0; d < head_dim; ++d) out[hq * head_dim + d] = from_float<T>(acc[hq * head_dim + d] * denom[hq]);
}

template <typename T>
void decode(const void* query, int64_t query_row_stride, void* out, int64_t out_row_stride, const void* k_cache,
            const void* v_cache, const int32_t* block_tables, int64_t block_table_stride, const int32_t* seq_lens,
            const int64_t* rows, const int64_t* seqs, int64_t num_rows, int num_heads, int num_kv_heads,
            int head_dim, int block_size, float scale, int num_threads) {
  // Whole sequences per task read the cache contiguously (1.4x faster); with few sequences, one task per KV
  // head instead, so that every thread has work.
  const int kv_per_task = num_rows >= 4 * num_threads ? num_kv_heads : 1;
  const int tasks_per_row = num_kv_heads / kv_per_task;
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> buf;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < num_rows * tasks_per_row; ++task) {
      const int64_t i = task / tasks_per_row;
      const int kv_first = static_cast<int>(task % tasks_per_row) * kv_per_task;
      decode_task(static_cast<const T*>(query) + rows[i] * query_row_stride,
                  static_cast<T*>(out) + rows[i] * out_row_stride, static_cast<const T*>(k_cache),
                  static_cast<const T*>(v_cache), block_tables + seqs[i] * block_table_stride, seq_lens[seqs[i]],
                  kv_first, kv_first + kv_per_task, num_heads / num_kv_heads, num_kv_heads, head_dim, block_size,
                  scale, buf);
    }
  }
}

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

template <typename F>
void by_dtype(int dtype, F&& run) {
  if (dtype == 0) run(float{});
  if (dtype == 2) run(bf16{});
}

}  // namespace

extern "C" void tiffin_rms_norm(int dtype, const void* x, int64_t row_stride, const void* weight, void* out,
                                int64_t rows, int size, float eps, int num_threads) {
  by_dtype(dtype, [&](auto tag) {
    rms_norm<decltype(tag)>(x, row_stride, weight, out, rows, size, eps, num_threads);
  });
}

// dtype: 0 float32, 2 bfloat16 (fp16 stays on torch: converting it is slow without AVX512-FP16). Query row `rows[i]` attends to the first `seq_lens[seqs[i]]` slots
// of block table `seqs[i]`; heads are contiguous within a row, head_dim within a head.
extern "C" void tiffin_paged_decode(int dtype, const void* query, int64_t query_row_stride, void* out,
                                    int64_t out_row_stride, const void* k_cache, const void* v_cache,
                                    const int32_t* block_tables, int64_t block_table_stride, const int32_t* seq_lens,
                                    const int64_t* rows, const int64_t* seqs, int64_t num_rows, int num_heads,
                                    int num_kv_heads, int head_dim, int block_size, float scale, int num_threads) {
  by_dtype(dtype, [&](auto tag) {
    decode<decltype(tag)>(query, query_row_stride, out, out_row_stride, k_cache, v_cache, block_tables,
                          block_table_stride, seq_lens, rows, seqs, num_rows, num_heads, num_kv_heads, head_dim,
                          block_size, scale, num_threads);
  });
}
