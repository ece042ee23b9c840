// A decode step of a Llama-family model's decoder layers in one call, from the kernels the model's torch path
// runs one by one (RMSNorm, the int8 GEMM of quantized projections, rotary, paged decode attention): at batch 1 a
// step's ~400 small ops cost more in Python than their work (tiffin/engine/worker/cpu_decode.py decides when it
// runs). Each layer: h = norm(x); q, k, v = h Wqkv (+ bias); q, k = norm_qk(q, k); q, k = rotary(q, k); K/V
// written to their slots; a = attention(q); x += a Wo; h = norm(x); x += (silu(h Wg) * h Wu) Wd, or in a mixture of
// experts' layer the routing-weighted sum of that MLP over each token's chosen experts (`moe`). Every result is
// rounded to the model dtype where torch rounds it.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <numeric>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "cpu_types.h"

extern "C" void tiffin_rms_norm(int dtype, const void* x, int64_t row_stride, const void* weight, void* out,
                                int64_t rows, int size, float eps, int num_threads);
extern "C" void tiffin_rotary(int dtype, const void* x, int64_t row_stride, const int64_t* positions, const float* cos,
                              const float* sin, void* out, int64_t rows, int heads, int head_dim, int num_threads);
extern "C" void tiffin_paged_decode(int dtype, const void* query, int64_t query_row_stride, void* out,
                                    int64_t out_row_stride, int cache_dtype, const void* k_cache, const void* v_cache,
                                    const void* k_scale, const void* v_scale, const int32_t* block_tables,
                                    int64_t block_table_stride, const int32_t* seq_lens, const int64_t* rows,
                                    const int64_t* seqs, int64_t num_rows, int num_heads, int num_kv_heads,
                                    int head_dim, int block_size, float scale, int window, float softcap,
                                    int num_threads);
extern "C" void tiffin_write_kv(int dtype, const void* key, int64_t key_row_stride, const void* value,
                                int64_t value_row_stride, int64_t tokens, int heads, int head_dim, const int64_t* slots,
                                int cache_dtype, void* k_cache, void* v_cache, void* k_scale, void* v_scale,
                                int num_threads);
struct Weights;  // cpu_blocks.h
extern "C" int tiffin_block_gemm(int dtype, const void* x, int64_t x_stride, int64_t m, int64_t k, const Weights* w,
                                 int out_dtype, void* y, int64_t y_stride, int levels, int threads);
extern "C" int tiffin_grouped_gemm(int dtype, const void* x, int64_t x_stride, int64_t k, const Weights* const* ws,
                                   const int64_t* starts, int64_t count, int out_dtype, void* y, int64_t y_stride,
                                   int levels, int threads);

constexpr int MAX_PARTS = 3;

struct QuantLinear {  // a projection in tiffin.kernels.block_gemm's block layout, in parts stored alike (q/k/v)
  const Weights* parts[MAX_PARTS];
  int64_t part_features[MAX_PARTS];  // each part's outputs, side by side
  int64_t num_parts;
  const void* bias;  // model dtype, or null
  int64_t out_features, in_features, levels;
};

struct MoE {  // models/moe.py's SparseMoE with its experts kept in blocks (LinearExperts)
  const void* router;  // [experts, hidden] in the model dtype
  const QuantLinear* gate_up;  // [experts], every expert's parts stored alike
  const QuantLinear* down;  // [experts]
  int64_t experts, top_k, renormalize;
  const QuantLinear* shared_gate_up;  // Qwen2-MoE's shared expert, or null
  const QuantLinear* shared_down;
  const void* shared_gate;  // its gate's weight [hidden] in the model dtype
};

struct DecoderLayer {
  const void* input_norm;
  const void* post_norm;
  const void* q_norm;  // per-head RMSNorm weights (Qwen3), or null
  const void* k_norm;
  QuantLinear qkv, o, gate_up, down;
  void* k_cache;  // [blocks, block_size, kv_heads, head_dim]
  void* v_cache;
  void* k_scale;  // a quantized cache's scales [blocks, block_size, kv_heads], or null
  void* v_scale;
  const MoE* moe;  // null: the dense MLP
};

struct Decoder {
  int64_t dtype;  // 0 fp32, 2 bf16
  int64_t cache_dtype;  // dtype, or a quantized cache's codes (tiffin_paged_decode's codes)
  int64_t hidden, heads, kv_heads, head_dim, block_size, num_layers;
  double eps, scale;
  const float* cos;  // [max_positions, head_dim / 2]
  const float* sin;
  const DecoderLayer* layers;
};

namespace {

#if defined(__AVX512F__)
// e^x for 16 lanes within ~2 ulp: x = n ln2 + r (Cody-Waite, |r| <= ln2 / 2), e^r by its Taylor series to r^7.
inline __m512 exp16(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040);
  for (const float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

#endif

// act = silu(g) * u over n values, each rounded to T as torch's two ops round.
template <typename T>
void silu_and_mul(const T* g, const T* u, T* act, int64_t n) {
  int64_t j = 0;
#if defined(__AVX512F__)
  for (; j + 16 <= n; j += 16) {
    const __m512 gate = load16(g + j);
    const __m512 one = _mm512_set1_ps(1.f);
    const __m512 silu = round_to(T{}, _mm512_div_ps(gate, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), gate)))));
    store16(act + j, round_to(T{}, _mm512_mul_ps(silu, load16(u + j))));
  }
#endif
  for (; j < n; ++j) {
    const float gate = to_float(g[j]);
    const float silu = to_float(from_float<T>(gate / (1.f + std::exp(-gate))));
    act[j] = from_float<T>(silu * to_float(u[j]));
  }
}

template <typename T>
struct Step {
  const Decoder& d;
  int64_t tokens;
  const int64_t* positions;
  const int64_t* slots;
  int threads;
  std::vector<T> h, qkv, qk, attn, gate_up, act, out;
  std::vector<int64_t> rows;
  // a mixture of experts': routing weights [tokens, k]; then rows of (token, choice) pairs in expert order
  std::vector<T> routed, xs, expert_gate_up, expert_act, ys, shared;
  std::vector<int64_t> chosen, at, starts;
  std::vector<const Weights*> ws;

  void linear(const QuantLinear& w, const T* x, T* y) {
    const int dtype = static_cast<int>(d.dtype);
    for (int64_t p = 0, first = 0; p < w.num_parts; first += w.part_features[p++])
      tiffin_block_gemm(dtype, x, w.in_features, tokens, w.in_features, w.parts[p], dtype, y + first, w.out_features,
                        static_cast<int>(w.levels), threads);
    if (w.bias != nullptr) {
      const T* b = static_cast<const T*>(w.bias);
      for (int64_t t = 0; t < tokens; ++t)
        for (int64_t j = 0; j < w.out_features; ++j) {
          T& v = y[t * w.out_features + j];
          v = from_float<T>(to_float(v) + to_float(b[j]));
        }
    }
  }

  void add(T* x, const T* y, int64_t n) {  // x += y, rounded
    for (int64_t i = 0; i < n; ++i) x[i] = from_float<T>(to_float(x[i]) + to_float(y[i]));
  }

  void attention(const DecoderLayer& layer, const int32_t* block_tables, int64_t table_stride,
                 const int32_t* seq_lens) {
    const int64_t q_size = d.heads * d.head_dim, kv_size = d.kv_heads * d.head_dim, width = q_size + 2 * kv_size;
    const int dtype = static_cast<int>(d.dtype), heads = static_cast<int>(d.heads + d.kv_heads);
    linear(layer.qkv, h.data(), qkv.data());
    if (layer.q_norm != nullptr) {  // per head, q and k heads in place
      for (int64_t t = 0; t < tokens; ++t) {
        T* row = &qkv[t * width];
        tiffin_rms_norm(dtype, row, d.head_dim, layer.q_norm, row, d.heads, static_cast<int>(d.head_dim),
                        static_cast<float>(d.eps), 1);
        tiffin_rms_norm(dtype, row + q_size, d.head_dim, layer.k_norm, row + q_size, d.kv_heads,
                        static_cast<int>(d.head_dim), static_cast<float>(d.eps), 1);
      }
    }
    tiffin_rotary(dtype, qkv.data(), width, positions, d.cos, d.sin, qk.data(), tokens, heads,
                  static_cast<int>(d.head_dim), threads);
    const int cache_dtype = static_cast<int>(d.cache_dtype), kv_heads = static_cast<int>(d.kv_heads);
    tiffin_write_kv(dtype, &qk[q_size], q_size + kv_size, &qkv[q_size + kv_size], width, tokens, kv_heads,
                    static_cast<int>(d.head_dim), slots, cache_dtype, layer.k_cache, layer.v_cache, layer.k_scale,
                    layer.v_scale, threads);
    tiffin_paged_decode(dtype, qk.data(), q_size + kv_size, attn.data(), q_size, cache_dtype, layer.k_cache,
                        layer.v_cache, layer.k_scale, layer.v_scale, block_tables, table_stride, seq_lens,
                        rows.data(), rows.data(), tokens, static_cast<int>(d.heads), kv_heads,
                        static_cast<int>(d.head_dim), static_cast<int>(d.block_size), static_cast<float>(d.scale),
                        0, 0.f, threads);  // the Llama family: no window, no soft-cap
  }

  void mlp(const QuantLinear& gate_up_w, const QuantLinear& down_w, T* y) {  // y = (silu(h Wg) * h Wu) Wd
    const int64_t inter = down_w.in_features;
    gate_up.resize(tokens * 2 * inter), act.resize(tokens * inter);
    linear(gate_up_w, h.data(), gate_up.data());
    for (int64_t t = 0; t < tokens; ++t) {
      const T* g = &gate_up[t * 2 * inter];
      silu_and_mul(g, g + inter, &act[t * inter], inter);
    }
    linear(down_w, act.data(), y);
  }

  // Each token's top_k experts (`chosen`, by falling probability; ties to the lower index, as torch.topk) and
  // routing weights (`routed`): the router's logits rounded to T, their softmax in fp32, renormalized where the
  // config says, rounded to T.
  void route(const MoE& m) {
    const int64_t experts = m.experts, k = m.top_k, hidden = d.hidden;
    const T* router = static_cast<const T*>(m.router);
    std::vector<float> probs(experts);
    std::vector<int64_t> ids(experts);
    for (int64_t t = 0; t < tokens; ++t) {
      const T* row = &h[t * hidden];
      float top = -INFINITY, sum = 0.f;
      for (int64_t e = 0; e < experts; ++e) {
        probs[e] = to_float(from_float<T>(dot(row, router + e * hidden, hidden)));
        top = std::max(top, probs[e]);
      }
      for (float& p : probs) sum += p = std::exp(p - top);
      for (float& p : probs) p /= sum;
      std::iota(ids.begin(), ids.end(), 0);
      std::partial_sort(ids.begin(), ids.begin() + k, ids.end(),
                        [&](int64_t a, int64_t b) { return probs[a] > probs[b] || (probs[a] == probs[b] && a < b); });
      float kept = 0.f;
      for (int64_t j = 0; j < k; ++j) kept += probs[ids[j]];
      for (int64_t j = 0; j < k; ++j) {
        chosen[t * k + j] = ids[j];
        routed[t * k + j] = from_float<T>(m.renormalize ? probs[ids[j]] / kept : probs[ids[j]]);
      }
    }
  }

  static float dot(const T* a, const T* b, int64_t n) {  // fp32 sums, 16 lanes
    int64_t j = 0;
    float sum = 0.f;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    for (; j + 16 <= n; j += 16) acc = _mm512_fmadd_ps(load16(a + j), load16(b + j), acc);
    sum = _mm512_reduce_add_ps(acc);
#endif
    for (; j < n; ++j) sum += to_float(a[j]) * to_float(b[j]);
    return sum;
  }

  // One grouped GEMM of every chosen expert's part p of `linears` on its rows of x (expert order) into y's columns.
  void experts_gemm(const MoE& m, const QuantLinear* linears, const T* x, T* y) {
    const QuantLinear& any = linears[0];
    const int dtype = static_cast<int>(d.dtype);
    for (int64_t p = 0, first = 0; p < any.num_parts; first += any.part_features[p++]) {
      for (int64_t e = 0; e < m.experts; ++e) ws[e] = linears[e].parts[p];
      tiffin_grouped_gemm(dtype, x, any.in_features, any.in_features, ws.data(), starts.data(), m.experts, dtype,
                          y + first, any.out_features, static_cast<int>(any.levels), threads);
    }
  }

  // out = sum over each token's chosen experts e of routed * down_e(silu(gate_e h) * up_e h), each expert's rows in
  // one grouped GEMM: only the chosen experts' weights are read, with one thread start a projection; plus the
  // shared expert's MLP times sigmoid(h Wgate) where there is one.
  void moe(const MoE& m) {
    const int64_t k = m.top_k, pairs = tokens * k, inter = m.down[0].in_features, hidden = d.hidden;
    chosen.resize(pairs), routed.resize(pairs), at.resize(pairs), starts.assign(m.experts + 1, 0);
    ws.resize(m.experts), xs.resize(pairs * hidden), ys.resize(pairs * hidden);
    expert_gate_up.resize(pairs * 2 * inter), expert_act.resize(pairs * inter);
    route(m);
    for (int64_t i = 0; i < pairs; ++i) ++starts[chosen[i] + 1];
    for (int64_t e = 0; e < m.experts; ++e) starts[e + 1] += starts[e];
    std::vector<int64_t> next(starts.begin(), starts.end() - 1);
    for (int64_t i = 0; i < pairs; ++i) {  // pair i = (token i / k, choice i % k) to its expert's rows, in order
      at[i] = next[chosen[i]]++;
      std::memcpy(&xs[at[i] * hidden], &h[i / k * hidden], hidden * sizeof(T));
    }
    experts_gemm(m, m.gate_up, xs.data(), expert_gate_up.data());
    for (int64_t s = 0; s < pairs; ++s) {
      const T* g = &expert_gate_up[s * 2 * inter];
      silu_and_mul(g, g + inter, &expert_act[s * inter], inter);
    }
    experts_gemm(m, m.down, expert_act.data(), ys.data());
    std::vector<float> sum(hidden);
    for (int64_t t = 0; t < tokens; ++t) {  // each weighted output rounded to T, their sum in choice order once
      std::fill(sum.begin(), sum.end(), 0.f);
      for (int64_t i = t * k; i < (t + 1) * k; ++i) {
        const T* y = &ys[at[i] * hidden];
        const float w = to_float(routed[i]);
        for (int64_t j = 0; j < hidden; ++j) sum[j] += to_float(from_float<T>(to_float(y[j]) * w));
      }
      for (int64_t j = 0; j < hidden; ++j) out[t * hidden + j] = from_float<T>(sum[j]);
    }
    if (m.shared_gate_up == nullptr) return;
    shared.resize(tokens * hidden);
    mlp(*m.shared_gate_up, *m.shared_down, shared.data());
    for (int64_t t = 0; t < tokens; ++t) {  // out + sigmoid(gate) * shared, each op rounded to T
      const float logit = to_float(from_float<T>(dot(&h[t * hidden], static_cast<const T*>(m.shared_gate), hidden)));
      const float gate = to_float(from_float<T>(1.f / (1.f + std::exp(-logit))));
      for (int64_t j = t * hidden; j < (t + 1) * hidden; ++j)
        out[j] = from_float<T>(to_float(out[j]) + to_float(from_float<T>(gate * to_float(shared[j]))));
    }
  }

  void run(T* x, const int32_t* block_tables, int64_t table_stride, const int32_t* seq_lens) {
    const int64_t q_size = d.heads * d.head_dim, kv_size = d.kv_heads * d.head_dim, hidden = d.hidden;
    h.resize(tokens * hidden), out.resize(tokens * hidden), attn.resize(tokens * q_size);
    qkv.resize(tokens * (q_size + 2 * kv_size)), qk.resize(tokens * (q_size + kv_size));
    rows.resize(tokens);
    for (int64_t t = 0; t < tokens; ++t) rows[t] = t;
    const int dtype = static_cast<int>(d.dtype);
    for (int64_t i = 0; i < d.num_layers; ++i) {
      const DecoderLayer& layer = d.layers[i];
      tiffin_rms_norm(dtype, x, hidden, layer.input_norm, h.data(), tokens, static_cast<int>(hidden),
                      static_cast<float>(d.eps), threads);
      attention(layer, block_tables, table_stride, seq_lens);
      linear(layer.o, attn.data(), out.data());
      add(x, out.data(), tokens * hidden);
      tiffin_rms_norm(dtype, x, hidden, layer.post_norm, h.data(), tokens, static_cast<int>(hidden),
                      static_cast<float>(d.eps), threads);
      if (layer.moe != nullptr) moe(*layer.moe);
      else mlp(layer.gate_up, layer.down, out.data());
      add(x, out.data(), tokens * hidden);
    }
  }
};

}  // namespace

// Every decoder layer on `tokens` one-token queries: x [tokens, hidden] (the embeddings) becomes the last layer's
// output, before the final norm. Each token is one sequence: its block table row, its length with this token.
extern "C" void tiffin_decode_layers(const Decoder* decoder, void* x, int64_t tokens, const int64_t* positions,
                                     const int64_t* slot_mapping, const int32_t* block_tables, int64_t table_stride,
                                     const int32_t* seq_lens, int threads) {
  by_dtype(static_cast<int>(decoder->dtype), [&](auto tag) {
    using T = decltype(tag);
    Step<T> step{*decoder, tokens, positions, slot_mapping, threads};
    step.run(static_cast<T*>(x), block_tables, table_stride, seq_lens);
  });
}
