// Fused paged decode attention for CPU: each (sequence, KV head) reads its K and V blocks once,
// straight from the head-major pool through its block table, with no gathered copy.
//
// The pure-torch path gathers every block of the batch into a padded contiguous tensor and then
// runs two batched matmuls over it: the KV bytes cross memory three times (read, write, read
// again) and the padding up to the longest context is read too. Decode attention is bound by
// memory traffic, so reading each block once, in place, is what makes it faster.
//
// Compiled on the machine that runs it (-march=native), so the AVX-512 path is used where the
// CPU has it; elsewhere plain loops that the compiler vectorizes for what the CPU does have.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "convert.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using pagedserve::from_float;
using pagedserve::to_float;

// Scores and weighted sums over one block of n tokens, for the G query heads that share a KV
// head, loading each key and value row once. HD == 0 means "head_dim known only at run time".
template <typename T, int G, int HD>
struct BlockMath {
  static void scores(const float* q, const T* k, int hd, int n, float* out, int64_t stride) {
    for (int t = 0; t < n; ++t) {
      const T* kt = k + static_cast<int64_t>(t) * hd;
      float acc[G] = {};
      for (int d = 0; d < hd; ++d) {
        const float kv = to_float(kt[d]);
        for (int g = 0; g < G; ++g) acc[g] += q[g * hd + d] * kv;
      }
      for (int g = 0; g < G; ++g) out[g * stride + t] = acc[g];
    }
  }
  static void accumulate(const float* probs, int64_t stride, const T* v, int hd, int n, float* acc) {
    for (int t = 0; t < n; ++t) {
      const T* vt = v + static_cast<int64_t>(t) * hd;
      float p[G];
      for (int g = 0; g < G; ++g) p[g] = probs[g * stride + t];
      for (int d = 0; d < hd; ++d) {
        const float vv = to_float(vt[d]);
        for (int g = 0; g < G; ++g) acc[g * hd + d] += p[g] * vv;
      }
    }
  }
};

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// The sums of the 16 lanes of a, b, c and d, as one 4-lane vector.
inline __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
  // fold 512 -> 256 bits: 128-bit lanes [a0+a2, a1+a3, b0+b2, b1+b3], and the same for c, d
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
  // fold again: lane i holds four partial sums of vector i (a, b, c, d)
  __m512 x = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
  // sum within each 128-bit lane, then take element 0 of each lane
  x = _mm512_add_ps(x, _mm512_shuffle_ps(x, x, 0x4E));
  x = _mm512_add_ps(x, _mm512_shuffle_ps(x, x, 0xB1));
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), x));
}

// head_dim a multiple of 16 known at compile time: the query (and the output accumulator) live
// in registers, HD / 16 vectors per query head.
template <typename T, int G, int HD>
  requires(HD > 0 && HD % 16 == 0)
struct BlockMath<T, G, HD> {
  static constexpr int V = HD / 16;
  static void scores(const float* q, const T* k, int, int n, float* out, int64_t stride) {
    __m512 qv[G][V];
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < V; ++i) qv[g][i] = _mm512_loadu_ps(q + g * HD + 16 * i);
    int t = 0;
    // Four keys at a time: their four dot products per query head are summed across lanes
    // together (reduce4), a quarter of the shuffles of reducing each one on its own.
    for (; t + 4 <= n; t += 4) {
      __m512 acc[4][G];
      for (int j = 0; j < 4; ++j)
        for (int g = 0; g < G; ++g) acc[j][g] = _mm512_setzero_ps();
      for (int i = 0; i < V; ++i) {
        for (int j = 0; j < 4; ++j) {
          const __m512 kv = load16(k + (t + j) * HD + 16 * i);
          for (int g = 0; g < G; ++g) acc[j][g] = _mm512_fmadd_ps(qv[g][i], kv, acc[j][g]);
        }
      }
      for (int g = 0; g < G; ++g)
        _mm_storeu_ps(out + g * stride + t, reduce4(acc[0][g], acc[1][g], acc[2][g], acc[3][g]));
    }
    for (; t < n; ++t) {
      const T* kt = k + t * HD;
      __m512 acc[G];
      for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
      for (int i = 0; i < V; ++i) {
        const __m512 kv = load16(kt + 16 * i);
        for (int g = 0; g < G; ++g) acc[g] = _mm512_fmadd_ps(qv[g][i], kv, acc[g]);
      }
      for (int g = 0; g < G; ++g) out[g * stride + t] = _mm512_reduce_add_ps(acc[g]);
    }
  }
  static void accumulate(const float* probs, int64_t stride, const T* v, int, int n, float* acc_mem) {
    __m512 acc[G][V];
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < V; ++i) acc[g][i] = _mm512_loadu_ps(acc_mem + g * HD + 16 * i);
    for (int t = 0; t < n; ++t) {
      const T* vt = v + t * HD;
      __m512 p[G];
      for (int g = 0; g < G; ++g) p[g] = _mm512_set1_ps(probs[g * stride + t]);
      for (int i = 0; i < V; ++i) {
        const __m512 vv = load16(vt + 16 * i);
        for (int g = 0; g < G; ++g) acc[g][i] = _mm512_fmadd_ps(p[g], vv, acc[g][i]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < V; ++i) _mm512_storeu_ps(acc_mem + g * HD + 16 * i, acc[g][i]);
  }
};
#endif

// Ask for a block's cache lines ahead of use. Blocks sit at random places in the pool and are
// only a few KiB each, too short for the hardware prefetcher to ramp up: without this the loops
// stall on memory latency (measured: ~5 GB/s of KV read against ~25 GB/s the memory can give).
template <typename T>
inline void prefetch_block(const T* p, int64_t elems) {
#if defined(__GNUC__)
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < elems * static_cast<int64_t>(sizeof(T)); off += 64) __builtin_prefetch(c + off, 0, 3);
#endif
}

struct Shapes {
  int64_t num_seqs, max_blocks, kv_heads, num_blocks, block_size, hd;
  float scale;
};

template <typename T, int G, int HD>
void decode_impl(T* out, const T* q, const T* k, const T* v, const int64_t* tables, const int64_t* lens,
                 const Shapes& sh) {
  using M = BlockMath<T, G, HD>;
  const int64_t kv_heads = sh.kv_heads, bs = sh.block_size, hd = sh.hd, heads = kv_heads * G;
  at::parallel_for(0, sh.num_seqs * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * hd), acc(G * hd), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / kv_heads, h = item % kv_heads;
      const int64_t len = lens[s];
      const int64_t* table = tables + s * sh.max_blocks;
      const T* qs = q + (s * heads + h * G) * hd;
      for (int64_t i = 0; i < G * hd; ++i) qf[i] = to_float(qs[i]) * sh.scale;
      scores.resize(G * len);
      const int64_t head_base = h * sh.num_blocks;
      const int64_t block_elems = bs * hd;
      prefetch_block(k + (head_base + table[0]) * block_elems, block_elems);
      for (int64_t start = 0; start < len; start += bs) {
        const int64_t j = start / bs;
        const T* kb = k + (head_base + table[j]) * block_elems;
        if (start + bs < len) prefetch_block(k + (head_base + table[j + 1]) * block_elems, block_elems);
        prefetch_block(v + (head_base + table[j]) * block_elems, block_elems);
        M::scores(qf.data(), kb, hd, static_cast<int>(std::min(bs, len - start)), scores.data() + start, len);
      }
      float inv_sum[G];
      for (int g = 0; g < G; ++g) {  // softmax in place; exp over whole rows so it vectorizes
        float* row = scores.data() + g * len;
        float m = row[0];  // len >= 1; no infinities, which -ffast-math assumes away
        for (int64_t t = 1; t < len; ++t) m = std::max(m, row[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) {
          row[t] = std::exp(row[t] - m);
          sum += row[t];
        }
        inv_sum[g] = 1.f / sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t start = 0; start < len; start += bs) {
        const T* vb = v + (head_base + table[start / bs]) * bs * hd;
        M::accumulate(scores.data() + start, len, vb, hd, static_cast<int>(std::min(bs, len - start)), acc.data());
      }
      T* os = out + (s * heads + h * G) * hd;
      for (int g = 0; g < G; ++g)
        for (int64_t d = 0; d < hd; ++d) os[g * hd + d] = from_float<T>(acc[g * hd + d] * inv_sum[g]);
    }
  });
}

template <typename T, int G>
void dispatch_head_dim(T* out, const T* q, const T* k, const T* v, const int64_t* tables, const int64_t* lens,
                       const Shapes& sh) {
  switch (sh.hd) {
    case 64: return decode_impl<T, G, 64>(out, q, k, v, tables, lens, sh);
    case 128: return decode_impl<T, G, 128>(out, q, k, v, tables, lens, sh);
    default: return decode_impl<T, G, 0>(out, q, k, v, tables, lens, sh);
  }
}

template <typename T>
void dispatch_group(int64_t group, T* out, const T* q, const T* k, const T* v, const int64_t* tables,
                    const int64_t* lens, const Shapes& sh) {
  switch (group) {
    case 1: return dispatch_head_dim<T, 1>(out, q, k, v, tables, lens, sh);
    case 2: return dispatch_head_dim<T, 2>(out, q, k, v, tables, lens, sh);
    case 3: return dispatch_head_dim<T, 3>(out, q, k, v, tables, lens, sh);
    case 4: return dispatch_head_dim<T, 4>(out, q, k, v, tables, lens, sh);
    case 5: return dispatch_head_dim<T, 5>(out, q, k, v, tables, lens, sh);
    case 6: return dispatch_head_dim<T, 6>(out, q, k, v, tables, lens, sh);
    case 7: return dispatch_head_dim<T, 7>(out, q, k, v, tables, lens, sh);
    case 8: return dispatch_head_dim<T, 8>(out, q, k, v, tables, lens, sh);
    default: TORCH_CHECK(false, "paged_decode_attention: query heads per KV head must be 1..8, got ", group);
  }
}

template <typename T>
void run_typed(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
               const int64_t* tables, const int64_t* lens, int64_t group, const Shapes& sh) {
  dispatch_group<T>(group, out.data_ptr<T>(), q.data_ptr<T>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(),
                    tables, lens, sh);
}

// out, q: [seqs, heads, head_dim]; k_cache, v_cache: [kv_heads, blocks, block_size, head_dim];
// block_tables: [seqs, max_blocks] int64; context_lens: [seqs] int64 (tokens each sequence sees).
void paged_decode_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "q and out must be [seqs, heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(), "caches must be [kvh, blocks, bs, hd]");
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "tensors must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "block tables and lengths must be int64");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.is_contiguous() && context_lens.is_contiguous(),
              "block tables must be a contiguous [seqs, max_blocks]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == out.scalar_type() &&
                  v_cache.scalar_type() == q.scalar_type(),
              "q, out and the caches must share a dtype");
  Shapes sh{q.size(0), block_tables.size(1), k_cache.size(0), k_cache.size(1), k_cache.size(2), q.size(2),
            static_cast<float>(scale)};
  const int64_t heads = q.size(1);
  TORCH_CHECK(k_cache.size(3) == sh.hd && heads % sh.kv_heads == 0, "head shapes do not match");
  TORCH_CHECK(block_tables.size(0) == sh.num_seqs && context_lens.size(0) == sh.num_seqs,
              "one table row and one length per sequence");
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  for (int64_t s = 0; s < sh.num_seqs; ++s) {  // a bad table would read outside the pool: refuse it
    TORCH_CHECK(lens[s] > 0 && lens[s] <= sh.max_blocks * sh.block_size, "context length out of range");
    for (int64_t j = 0; j < (lens[s] + sh.block_size - 1) / sh.block_size; ++j) {
      const int64_t b = tables[s * sh.max_blocks + j];
      TORCH_CHECK(b >= 0 && b < sh.num_blocks, "block id ", b, " out of range");
    }
  }
  const int64_t group = heads / sh.kv_heads;
  switch (q.scalar_type()) {
    case at::kFloat: return run_typed<float>(out, q, k_cache, v_cache, tables, lens, group, sh);
    case at::kBFloat16: return run_typed<c10::BFloat16>(out, q, k_cache, v_cache, tables, lens, group, sh);
    case at::kHalf: return run_typed<c10::Half>(out, q, k_cache, v_cache, tables, lens, group, sh);
    default: TORCH_CHECK(false, "paged_decode_attention: unsupported dtype ", q.scalar_type());
  }
}

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
  switch (scores.scalar_type()) {
    case at::kFloat: return causal_softmax_impl<float>(scores.data_ptr<float>(), rows, q_len, ctx);
    case at::kBFloat16: return causal_softmax_impl<c10::BFloat16>(scores.data_ptr<c10::BFloat16>(), rows, q_len, ctx);
    case at::kHalf: return causal_softmax_impl<c10::Half>(scores.data_ptr<c10::Half>(), rows, q_len, ctx);
    default: TORCH_CHECK(false, "causal_softmax_: unsupported dtype ", scores.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY(pagedserve, m) {
  m.def("paged_decode_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, float scale) -> ()");
  m.def("causal_softmax_(Tensor(a!) scores, int q_len) -> ()");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("causal_softmax_", &causal_softmax_);
}
