// Fused paged decode attention for CPU: each (sequence, KV head) reads its K and V blocks once,
// straight from the pool through its block table, with no gathered copy.
//
// The pure-torch path gathers every block of the batch into a padded contiguous tensor and then
// runs two batched matmuls over it: the KV bytes cross memory three times (read, write, read
// again) and the padding up to the longest context is read too. Decode attention is bound by
// memory traffic, so reading each block once, in place, is what makes it faster.
//
// This file: the entry point for the engine's model-dtype pools (HeadMajorKVCache, [kv_heads,
// blocks, block_size, head_dim]) and the prompt chunks' causal softmax. Quantized pools:
// paged_attention_quantized.cpp. The kernel itself: paged_decode.h.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "convert.h"
#include "kernel_ops.h"
#include "paged_decode.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using namespace pagedserve::decode;
using pagedserve::dispatch_model_dtype;
using pagedserve::from_float;
using pagedserve::to_float;

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

template <typename T>
struct Plain {  // the model dtype itself: rows of T, no scales
  using Store = T;
  using Model = T;  // the dtype of q and out
  static constexpr bool kQuantized = false;
  static float get(const T* row, int64_t d) { return to_float(row[d]); }
#if defined(__AVX512F__)
  static __m512 load16(const T* row, int64_t d) { return ::load16(row + d); }
#endif
};

}  // namespace

namespace pagedserve::ops {

using namespace pagedserve::decode;

// out, q: [seqs, heads, head_dim]; k_cache, v_cache: [kv_heads, blocks, block_size, head_dim] in
// q's dtype; block_tables: [seqs, max_blocks] int64; context_lens: [seqs] int64 (the table's
// tokens); firsts: [seqs] int64 or none, the first of them each sequence sees (a sliding window).
void paged_decode_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, double scale, WorkPool* workers,
                            const std::optional<at::Tensor>& firsts) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(), "caches must be [kvh, blocks, bs, hd]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "tensors must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "q, out and the caches must share a dtype");
  const int64_t kvh = k_cache.size(0), nb = k_cache.size(1), bs = k_cache.size(2), hd = k_cache.size(3);
  const Shapes sh = check_batch(out, q, block_tables, context_lens, kvh, nb, bs, scale, firsts);
  TORCH_CHECK(hd == sh.hd, "head shapes do not match");
  dispatch_model_dtype(q.scalar_type(), "paged_decode_attention", [&](auto tag) {
    using E = Plain<decltype(tag)>;
    auto pool = [&](const at::Tensor& c) {
      return Pool<E>{c.data_ptr<typename E::Store>(), nullptr, bs, hd, nb * bs * hd, bs * hd, hd, 0, 0, 0};
    };
    dispatch_group<E>(q.size(1) / kvh, Batch<E>{out.data_ptr<typename E::Store>(), q.data_ptr<typename E::Store>(),
                                                pool(k_cache), pool(v_cache), block_tables.data_ptr<int64_t>(),
                                                context_lens.data_ptr<int64_t>(), sh, workers,
                                                firsts ? firsts->data_ptr<int64_t>() : nullptr});
  });
}

// The registered op: torch's threads.
void paged_decode_attention_op(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                               const at::Tensor& v_cache, const at::Tensor& block_tables,
                               const at::Tensor& context_lens, double scale, const std::optional<at::Tensor>& firsts) {
  paged_decode_attention(out, q, k_cache, v_cache, block_tables, context_lens, scale, nullptr, firsts);
}

}  // namespace pagedserve::ops

namespace {

using pagedserve::from_float;
using pagedserve::to_float;

// A prompt chunk's attention probabilities, in place: scores [..., q_len, ctx] where query i sits
// at position ctx - q_len + i and sees keys 0..that position. Softmax over what it sees, zero
// beyond: one pass instead of masked_fill + softmax, and no exp over the masked half.
template <typename T>
void causal_softmax_impl(T* scores, int64_t rows, int64_t q_len, int64_t ctx) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 4096 / ctx), [&](int64_t begin, int64_t end) {
    std::vector<float> row(ctx);
    for (int64_t r = begin; r < end; ++r) {
      T* x = scores + r * ctx;
      const int64_t seen = ctx - q_len + (r % q_len) + 1;
      float m = to_float(x[0]);
      for (int64_t j = 0; j < seen; ++j) {
        row[j] = to_float(x[j]);
        m = std::max(m, row[j]);
      }
      float sum = 0.f;
      for (int64_t j = 0; j < seen; ++j) {
        row[j] = std::exp(row[j] - m);
        sum += row[j];
      }
      const float inv = 1.f / sum;
      for (int64_t j = 0; j < seen; ++j) x[j] = from_float<T>(row[j] * inv);
      for (int64_t j = seen; j < ctx; ++j) x[j] = from_float<T>(0.f);
    }
  });
}

void causal_softmax_(at::Tensor& scores, int64_t q_len) {
  TORCH_CHECK(scores.is_contiguous() && scores.dim() >= 2, "causal_softmax_: scores must be contiguous [..., q_len, ctx]");
  const int64_t ctx = scores.size(-1);
  TORCH_CHECK(scores.size(-2) == q_len && q_len >= 1 && q_len <= ctx, "causal_softmax_: q_len must be in [1, ctx]");
  const int64_t rows = scores.numel() / ctx;
  dispatch_model_dtype(scores.scalar_type(), "causal_softmax_", [&](auto tag) {
    using T = decltype(tag);
    causal_softmax_impl<T>(scores.data_ptr<T>(), rows, q_len, ctx);
  });
}

}  // namespace

TORCH_LIBRARY(pagedserve, m) {
  m.def("paged_decode_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, float scale, Tensor? firsts=None) -> ()");
  m.def("causal_softmax_(Tensor(a!) scores, int q_len) -> ()");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("paged_decode_attention", &pagedserve::ops::paged_decode_attention_op);
  m.impl("causal_softmax_", &causal_softmax_);
}
