// The fused paged decode kernel's machinery, shared by its two entry points: the model-dtype
// pools (paged_attention.cpp) and the quantized ones (paged_attention_quantized.cpp), compiled
// as separate translation units so the build runs them in parallel.
//
// The kernel is written once over a storage kind E, which says how a pool stores one row (one
// token's head_dim values for one KV head):
//   E::Store           the stored element type
//   E::Model           the dtype of q and out
//   E::kQuantized      whether rows carry a float16 scale each (then also E::kValueScale)
//   E::get(row, d)     value d of a row as a float; E::load16(row, d) values d..d+15 (AVX-512)
// Quantized kinds read the value on their grid: times the row's scale and kValueScale, that is the
// real value.
//
// Compiled on the machine that runs it (-march=native), so the AVX-512 path is used where the
// CPU has it; elsewhere plain loops that the compiler vectorizes for what the CPU does have.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include "convert.h"
#include "work_pool.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace pagedserve::decode {

// Scores and weighted sums over one block of n tokens, for the G query heads that share a KV
// head, loading each key and value row once; rows are `rs` stored elements apart. HD == 0 means
// "head_dim known only at run time". Quantized rows give grid values: the caller scales.
template <typename E, int G, int HD>
struct BlockMath {
  using S = typename E::Store;
  static void scores(const float* q, const S* k, int64_t rs, int hd, int n, float* out, int64_t stride) {
    for (int t = 0; t < n; ++t) {
      const S* kt = k + t * rs;
      float acc[G] = {};
      for (int d = 0; d < hd; ++d) {
        const float kv = E::get(kt, d);
        for (int g = 0; g < G; ++g) acc[g] += q[g * hd + d] * kv;
      }
      for (int g = 0; g < G; ++g) out[g * stride + t] = acc[g];
    }
  }
  static void accumulate(const float* probs, int64_t stride, const S* v, int64_t rs, int hd, int n, float* acc) {
    for (int t = 0; t < n; ++t) {
      const S* vt = v + t * rs;
      float p[G];
      for (int g = 0; g < G; ++g) p[g] = probs[g * stride + t];
      for (int d = 0; d < hd; ++d) {
        const float vv = E::get(vt, d);
        for (int g = 0; g < G; ++g) acc[g * hd + d] += p[g] * vv;
      }
    }
  }
};

#if defined(__AVX512F__)
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
template <int HD>
concept WideHeads = HD > 0 && HD % 16 == 0;

template <typename E, int G, int HD>
struct WideRows {
  using S = typename E::Store;
  static constexpr int V = HD / 16;
  static void scores(const float* q, const S* k, int64_t rs, int, int n, float* out, int64_t stride) {
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
          const __m512 kv = E::load16(k + (t + j) * rs, 16 * i);
          for (int g = 0; g < G; ++g) acc[j][g] = _mm512_fmadd_ps(qv[g][i], kv, acc[j][g]);
        }
      }
      for (int g = 0; g < G; ++g)
        _mm_storeu_ps(out + g * stride + t, reduce4(acc[0][g], acc[1][g], acc[2][g], acc[3][g]));
    }
    for (; t < n; ++t) {
      const S* kt = k + t * rs;
      __m512 acc[G];
      for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
      for (int i = 0; i < V; ++i) {
        const __m512 kv = E::load16(kt, 16 * i);
        for (int g = 0; g < G; ++g) acc[g] = _mm512_fmadd_ps(qv[g][i], kv, acc[g]);
      }
      for (int g = 0; g < G; ++g) out[g * stride + t] = _mm512_reduce_add_ps(acc[g]);
    }
  }
  static void accumulate(const float* probs, int64_t stride, const S* v, int64_t rs, int, int n, float* acc_mem) {
    __m512 acc[G][V];
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < V; ++i) acc[g][i] = _mm512_loadu_ps(acc_mem + g * HD + 16 * i);
    for (int t = 0; t < n; ++t) {
      const S* vt = v + t * rs;
      __m512 p[G];
      for (int g = 0; g < G; ++g) p[g] = _mm512_set1_ps(probs[g * stride + t]);
      for (int i = 0; i < V; ++i) {
        const __m512 vv = E::load16(vt, 16 * i);
        for (int g = 0; g < G; ++g) acc[g][i] = _mm512_fmadd_ps(p[g], vv, acc[g][i]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < V; ++i) _mm512_storeu_ps(acc_mem + g * HD + 16 * i, acc[g][i]);
  }
};

template <typename E, int G, int HD>
  requires WideHeads<HD>
struct BlockMath<E, G, HD> : WideRows<E, G, HD> {};

// bf16 rows with head_dim a multiple of 32: 32 stored values are one 64-byte load, widened without
// a conversion instruction per 16 values. Why: on a Zen 4 (AVX-512 on 256-bit units) a context in
// cache is read at the rate of the kernel above's instructions (one thread, 4 MB of KV: 19 GB/s;
// this one 22): per key and value row four widenings of two instructions each, twelve FMAs, and the
// scores' cross-lane sums.
//
// Values: a dword of two bf16 holds value 2j in its low half and 2j + 1 in its high half, so
// shifting it left 16 bits gives value 2j as a float and masking off the low half gives value
// 2j + 1: the row's even and odd values, one instruction each. Each output value is accumulated
// as in the kernel above (the same products and sums in the same order: the same bits); only the
// registers hold even and odd values apart, interleaved back when they are stored.
//
// Keys, where the CPU has AVX512-BF16: vdpbf16ps multiplies 32 stored bf16 by q's own bf16 values
// (the model's, unscaled) and sums pairs in float32, and the score is scaled after: two
// instructions per key and query head where the kernel above needs four widenings and four FMAs.
// The products are exact (8-bit significands); the sums run in another order than the float32
// kernel's, so scores may differ from it in their last bits.
template <typename E, int HD>
concept Bf16Pairs = WideHeads<HD> && HD % 32 == 0 && std::is_same_v<typename E::Store, c10::BFloat16> &&
                    std::is_same_v<typename E::Model, c10::BFloat16>;

template <typename E, int G, int HD>
  requires Bf16Pairs<E, HD>
struct BlockMath<E, G, HD> : WideRows<E, G, HD> {
  using S = c10::BFloat16;
  static constexpr int V = HD / 16, W = HD / 32;  // float vectors and 32-value loads per row
#if defined(__AVX512BF16__)
  static constexpr bool kBf16Dot = true;
#else
  static constexpr bool kBf16Dot = false;
#endif

  static __m512i load32(const S* row, int w) { return _mm512_loadu_si512(row + 32 * w); }
  static __m512 evens(__m512i x) { return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)); }
  static __m512 odds(__m512i x) { return _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(-65536))); }

#if defined(__AVX512BF16__)
  // scale x (q . k) for n keys, q the G query heads' bf16 values as the model gave them.
  static void scores_bf16(const S* q, float scale, const S* k, int64_t rs, int n, float* out, int64_t stride) {
    __m512bh qv[G][W];
    for (int g = 0; g < G; ++g)
      for (int w = 0; w < W; ++w) qv[g][w] = (__m512bh)load32(q + g * HD, w);
    const __m128 scale4 = _mm_set1_ps(scale);
    int t = 0;
    for (; t + 4 <= n; t += 4) {  // four keys' sums across lanes together, as the kernel above
      __m512 acc[4][G];
      for (int j = 0; j < 4; ++j)
        for (int g = 0; g < G; ++g) acc[j][g] = _mm512_setzero_ps();
      for (int w = 0; w < W; ++w) {
        for (int j = 0; j < 4; ++j) {
          const __m512bh kv = (__m512bh)load32(k + (t + j) * rs, w);
          for (int g = 0; g < G; ++g) acc[j][g] = _mm512_dpbf16_ps(acc[j][g], qv[g][w], kv);
        }
      }
      for (int g = 0; g < G; ++g)
        _mm_storeu_ps(out + g * stride + t, _mm_mul_ps(scale4, reduce4(acc[0][g], acc[1][g], acc[2][g], acc[3][g])));
    }
    for (; t < n; ++t) {
      __m512 acc[G];
      for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
      for (int w = 0; w < W; ++w) {
        const __m512bh kv = (__m512bh)load32(k + t * rs, w);
        for (int g = 0; g < G; ++g) acc[g] = _mm512_dpbf16_ps(acc[g], qv[g][w], kv);
      }
      for (int g = 0; g < G; ++g) out[g * stride + t] = scale * _mm512_reduce_add_ps(acc[g]);
    }
  }
#endif

  static void accumulate(const float* probs, int64_t stride, const S* v, int64_t rs, int, int n, float* acc_mem) {
    // acc[g][2w] holds values 32w + 0, 2, .., 30 of query head g; acc[g][2w + 1] values 32w + 1, .., 31.
    const __m512i even_idx = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd_idx = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    const __m512i lo_idx = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi_idx = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    __m512 acc[G][V];
    for (int g = 0; g < G; ++g)
      for (int w = 0; w < W; ++w) {
        const __m512 a = _mm512_loadu_ps(acc_mem + g * HD + 32 * w), b = _mm512_loadu_ps(acc_mem + g * HD + 32 * w + 16);
        acc[g][2 * w] = _mm512_permutex2var_ps(a, even_idx, b);
        acc[g][2 * w + 1] = _mm512_permutex2var_ps(a, odd_idx, b);
      }
    for (int t = 0; t < n; ++t) {
      const S* vt = v + t * rs;
      __m512 p[G];
      for (int g = 0; g < G; ++g) p[g] = _mm512_set1_ps(probs[g * stride + t]);
      for (int w = 0; w < W; ++w) {
        const __m512i x = load32(vt, w);
        const __m512 ve = evens(x), vo = odds(x);
        for (int g = 0; g < G; ++g) {
          acc[g][2 * w] = _mm512_fmadd_ps(p[g], ve, acc[g][2 * w]);
          acc[g][2 * w + 1] = _mm512_fmadd_ps(p[g], vo, acc[g][2 * w + 1]);
        }
      }
    }
    for (int g = 0; g < G; ++g)
      for (int w = 0; w < W; ++w) {
        const __m512 e = acc[g][2 * w], o = acc[g][2 * w + 1];
        _mm512_storeu_ps(acc_mem + g * HD + 32 * w, _mm512_permutex2var_ps(e, lo_idx, o));
        _mm512_storeu_ps(acc_mem + g * HD + 32 * w + 16, _mm512_permutex2var_ps(e, hi_idx, o));
      }
  }
};
#endif

// Ask for cache lines ahead of use. Blocks sit at random places in the pool and are only a few
// KiB each, too short for the hardware prefetcher to ramp up: without this the loops stall on
// memory latency (measured: ~5 GB/s of KV read against ~25 GB/s the memory can give). Into L1 by
// default; `into_l2` for lines wanted a few blocks from now (prefetch_span_l2).
// On x86-64 the instruction is written out: GCC counts __builtin_prefetch as free of side effects
// and deletes calls to an out-of-line helper made only of prefetches (seen: a build with none).
template <bool into_l2 = false>
inline void prefetch_line(const char* line) {
#if defined(__x86_64__) && defined(__GNUC__)
  if constexpr (into_l2) {
    asm volatile("prefetcht1 %0" : : "m"(*line));
  } else {
    asm volatile("prefetcht0 %0" : : "m"(*line));
  }
#elif defined(__GNUC__)
  __builtin_prefetch(line, 0, into_l2 ? 2 : 3);
#endif
}

template <bool into_l2 = false>
inline void prefetch_bytes(const void* p, int64_t bytes) {
  const auto begin = reinterpret_cast<uintptr_t>(p);
  for (uintptr_t a = begin & ~uintptr_t{63}; a < begin + bytes; a += 64)  // every line the range touches
    prefetch_line<into_l2>(reinterpret_cast<const char*>(a));
}

// `rows` rows of `row_bytes` each, `step` bytes apart (token-major rows, one KV head's among the
// others'). Rows of one or two whole cache lines (int8 / fp8 rows of head_dim 64 or 128, float16
// tail rows of 64) have their lines asked for directly, the count fixed: prefetch_bytes' bounds a
// row cost the int8 kernel 7.6 against 7.0 GB/s in cache on one thread and ~5 % of its time from
// memory (12 layers, 2 threads); a loop over a row's lines with the count read at run time kept
// none of that (docs/BENCHMARKS.md).
template <bool into_l2 = false>
inline void prefetch_rows(const void* first, int64_t rows, int64_t step, int64_t row_bytes) {
  const char* p = static_cast<const char*>(first);
  const bool lines = step % 64 == 0 && reinterpret_cast<uintptr_t>(p) % 64 == 0;
  if (lines && row_bytes == 64) {
    for (int64_t t = 0; t < rows; ++t) prefetch_line<into_l2>(p + t * step);
  } else if (lines && row_bytes == 128) {
    for (int64_t t = 0; t < rows; ++t) {
      prefetch_line<into_l2>(p + t * step);
      prefetch_line<into_l2>(p + t * step + 64);
    }
  } else {
    for (int64_t t = 0; t < rows; ++t) prefetch_bytes<into_l2>(p + t * step, row_bytes);
  }
}

// Where one pool keeps the rows (and, quantized, the scales) of KV head h's block b; strides in
// stored elements (scales).
template <typename E>
struct Pool {
  using S = typename E::Store;
  const S* data;
  const c10::Half* scales;  // quantized kinds only
  int64_t block_size, width;  // tokens per block, stored elements per row
  int64_t head_stride, block_stride, row_stride;
  int64_t scale_head_stride, scale_block_stride, scale_row_stride;

  const S* rows(int64_t h, int64_t b) const { return data + h * head_stride + b * block_stride; }
  const c10::Half* row_scales(int64_t h, int64_t b) const {
    return scales + h * scale_head_stride + b * scale_block_stride;
  }
  template <bool into_l2 = false>
  void prefetch(int64_t h, int64_t b) const {
    const S* r = rows(h, b);
    const int64_t row_bytes = width * static_cast<int64_t>(sizeof(S));
    if (row_stride == width) {  // head-major: the block is one run
      prefetch_bytes<into_l2>(r, block_size * row_bytes);
    } else {  // token-major: this head's rows, between the other heads'
      prefetch_rows<into_l2>(r, block_size, row_stride * static_cast<int64_t>(sizeof(S)), row_bytes);
    }
    if constexpr (E::kQuantized)
      prefetch_bytes<into_l2>(row_scales(h, b), ((block_size - 1) * scale_row_stride + 1) * sizeof(c10::Half));
  }
};

// A span's K and V blocks 1.. into L2 as its task starts. Why: a pool a server has reused hands a
// prompt the runs finished sequences gave back, tail first, between other sequences' blocks, and
// the hardware prefetcher follows ascending runs only; asking a block ahead into L1 keeps only the
// lines L1's miss buffers hold in flight. On a Zen 4 (2 threads, `small`'s W1-like step, 315 MB of
// bf16 KV) descending and shuffled tables read 11-12 GB/s against 20 in order, and 15-16 with this.
// Ascending runs (a fresh pool's prompts) are asked for too: their 2 KiB blocks, one per KV head
// and pool, are too short a run for the hardware to be ahead of the task; with the next task's
// blocks also asked for (prefetch_block_l2), 64 sequences of 384 tokens in order read 22.5-23.5
// GB/s against 17.0-20.2 when they were left to it (four alternated pairs; backwards and
// scattered tables unchanged). Out of line: inlined into the task loop it cost 7-10 % with no
// prefetch issued (docs/BENCHMARKS.md).
template <typename E>
__attribute__((noinline)) void prefetch_span_l2(const Pool<E>& k, const Pool<E>& v, int64_t h, const int64_t* table,
                                                int64_t blocks) {
  for (int64_t j = 1; j < blocks; ++j) {
    k.template prefetch<true>(h, table[j]);
    v.template prefetch<true>(h, table[j]);
  }
}

// Block b of KV head h, K and V, into L2: the next task's, one block per block of the task that
// runs before it (decode_impl). Why: a task began by waiting on its first blocks from memory with
// nothing else to do; with the next task's lines on their way while this one computes, the kernel
// read 63 MB of KV (16 sequences of 128 tokens, 30 layers) at 18-26 GB/s against 13-18 on a Zen 4,
// in every block order (examples/paged_decode_bandwidth.py). Out of line, as prefetch_span_l2.
template <typename E>
__attribute__((noinline)) void prefetch_block_l2(const Pool<E>& k, const Pool<E>& v, int64_t h, int64_t b) {
  k.template prefetch<true>(h, b);
  v.template prefetch<true>(h, b);
}

// Multiplies entry t of each of the G rows (`stride` apart) by token t's scale: for quantized K,
// the scores (dot products over grid values); for quantized V, the softmax weights, before the
// value rows they weight are summed.
template <typename E, int G>
inline void apply_scales(float* rows, int64_t stride, const c10::Half* scales, int64_t scale_stride, int n) {
  for (int t = 0; t < n; ++t) {
    const float s = static_cast<float>(scales[t * scale_stride]) * E::kValueScale;
    for (int g = 0; g < G; ++g) rows[g * stride + t] *= s;
  }
}

// The G score rows (len each, one after another) exponentiated in place, max-shifted; inv_sum[g]
// gets 1 / row g's sum (applied to the output once, not to every weight), and, when asked for,
// row_max[g] the max it was shifted by and row_sum[g] the sum. exp over whole rows, so it vectorizes.
// A sliding window's start inside a context's first block: each of G score rows (`len` apart)
// weighs its first `hidden` positions exp(lowest - max) = 0, so the softmax and the sum over the
// values are those of the visible positions alone.
template <int G>
inline void hide_before_window(float* scores, int64_t len, int64_t hidden) {
  for (int g = 0; hidden > 0 && g < G; ++g) std::fill_n(scores + g * len, hidden, std::numeric_limits<float>::lowest());
}

template <int G>
inline void softmax_rows(float* scores, int64_t len, float* inv_sum, float* row_max = nullptr,
                         float* row_sum = nullptr) {
  for (int g = 0; g < G; ++g) {
    float* row = scores + g * len;
    float m = row[0];  // len >= 1; no infinities, which -ffast-math assumes away
    for (int64_t t = 1; t < len; ++t) m = std::max(m, row[t]);
    float sum = 0.f;
    for (int64_t t = 0; t < len; ++t) {
      row[t] = std::exp(row[t] - m);
      sum += row[t];
    }
    inv_sum[g] = 1.f / sum;
    if (row_max != nullptr) row_max[g] = m;
    if (row_sum != nullptr) row_sum[g] = sum;
  }
}

struct Shapes {
  int64_t num_seqs, max_blocks, kv_heads, num_blocks, block_size, hd;
  float scale;
};

template <typename E>
struct Batch {
  using T = typename E::Model;
  T* out;
  const T* q;
  Pool<E> k, v;
  const int64_t* tables;
  const int64_t* lens;
  Shapes sh;
  WorkPool* pool = nullptr;  // null: torch's threads
  // Per sequence, the first position of its table it sees (a sliding window that starts inside
  // the table's first block, models/attention.py's window_view); null: all of them.
  const int64_t* firsts = nullptr;
};

// Whether BlockMath M takes the keys' scores from their bf16 values (scores_bf16, AVX512-BF16).
template <typename M>
constexpr bool bf16_dot() {
  if constexpr (requires { M::kBf16Dot; }) {
    return M::kBf16Dot;
  } else {
    return false;
  }
}

// A context is read in spans of kSpanTokens (whole blocks): each (sequence, KV head, span) is one
// task, so one long sequence's three KV heads do not leave one of two threads idle for a third of
// the kernel, as they did when a task was a whole (sequence, KV head). A span's softmax is
// shifted by its own max; the spans are then joined, in order, rescaled to the largest
// (flash-decoding). The split depends on a sequence's length alone, never on the batch or the
// threads, so a sequence's output is the same bits in any batch; a context within one span is
// computed exactly as before the split.
constexpr int64_t kSpanTokens = 128;

// One task: sequence s's KV head h, span c of its `spans`, `len` tokens from token `start`.
struct SpanTask {
  int64_t s, h, c, spans, start, len;
};

// A batch's tasks, every (sequence, KV head)'s spans consecutive from span 0, and what the split
// ones leave for the join: each task's softmax max and sum (G each) and, where its (sequence, KV
// head) has more than one span, its unnormalized G x hd output. Both decode entry points that read
// spans (decode_impl here, decode_int4 over int4 pools) run their tasks and join through it.
template <int G>
struct SpanPlan {
  int64_t block_size, max_blocks, hd;
  std::vector<SpanTask> tasks;
  std::vector<float> max, sum;
  // every split task writes its whole part before the join reads it: not zeroed (16 rows' 73 KB
  // were a serial memset each layer, the pool's worker idle); null where nothing is split
  std::unique_ptr<float[]> parts;

  SpanPlan(const Shapes& sh, const int64_t* lens) : block_size(sh.block_size), max_blocks(sh.max_blocks), hd(sh.hd) {
    const int64_t span = std::max<int64_t>(1, kSpanTokens / block_size) * block_size;  // whole blocks
    for (int64_t s = 0; s < sh.num_seqs; ++s) {
      const int64_t spans = (lens[s] + span - 1) / span;
      for (int64_t h = 0; h < sh.kv_heads; ++h)
        for (int64_t c = 0; c < spans; ++c)
          tasks.push_back({s, h, c, spans, c * span, std::min(span, lens[s] - c * span)});
    }
    const int64_t n = size();
    max.resize(n * G);
    sum.resize(n * G);
    if (n > sh.num_seqs * sh.kv_heads) parts = std::make_unique_for_overwrite<float[]>(n * G * hd);
  }

  int64_t size() const { return static_cast<int64_t>(tasks.size()); }
  // task i's part of its sequence's block table, and how many blocks it reads
  const int64_t* table(int64_t i, const int64_t* tables) const {
    return tables + tasks[i].s * max_blocks + tasks[i].start / block_size;
  }
  int64_t blocks(int64_t i) const { return (tasks[i].len + block_size - 1) / block_size; }

  // Task i's G x hd sums (acc) with its rows' 1 / sum: the output rows os of its (sequence, KV head)
  // where it is the only span, else kept for the join.
  template <typename T>
  void finish(int64_t i, const float* acc, const float* inv_sum, T* os) {
    if (tasks[i].spans > 1) {
      std::copy(acc, acc + G * hd, parts.get() + i * G * hd);
      return;
    }
    for (int g = 0; g < G; ++g)
      for (int64_t d = 0; d < hd; ++d) os[g * hd + d] = from_float<T>(acc[g * hd + d] * inv_sum[g]);
  }

  // Joins each split (sequence, KV head)'s spans, in span order, rescaled to their largest max,
  // into out [seqs, heads, hd].
  template <typename T>
  void join(WorkPool* pool, int64_t heads, T* out) const {
    if (parts == nullptr) return;
    pagedserve::parallel_for(pool, 0, size(), 64, [&](int64_t begin, int64_t end) {
      std::vector<float> acc(G * hd);
      for (int64_t i = begin; i < end; ++i) {
        const SpanTask& task = tasks[i];
        if (task.spans == 1 || task.c != 0) continue;
        float top[G], total[G] = {};
        for (int g = 0; g < G; ++g) {
          top[g] = max[i * G + g];
          for (int64_t c = 1; c < task.spans; ++c) top[g] = std::max(top[g], max[(i + c) * G + g]);
        }
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t c = 0; c < task.spans; ++c) {
          const int64_t j = i + c;
          for (int g = 0; g < G; ++g) {
            const float w = std::exp(max[j * G + g] - top[g]);
            total[g] += sum[j * G + g] * w;
            const float* part = parts.get() + (j * G + g) * hd;
            for (int64_t d = 0; d < hd; ++d) acc[g * hd + d] += part[d] * w;
          }
        }
        T* os = out + (task.s * heads + task.h * G) * hd;
        for (int g = 0; g < G; ++g) {
          const float inv = 1.f / total[g];
          for (int64_t d = 0; d < hd; ++d) os[g * hd + d] = from_float<T>(acc[g * hd + d] * inv);
        }
      }
    });
  }
};

template <typename E, int G, int HD>
void decode_impl(const Batch<E>& b) {
  using M = BlockMath<E, G, HD>;
  using T = typename E::Model;
  constexpr bool kBf16Dot = bf16_dot<M>();
  const Shapes& sh = b.sh;
  const int64_t kv_heads = sh.kv_heads, bs = sh.block_size, hd = sh.hd, heads = kv_heads * G;
  SpanPlan<G> plan(sh, b.lens);
  pagedserve::parallel_for(b.pool, 0, plan.size(), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * hd), acc(G * hd), scores;
    for (int64_t i = begin; i < end; ++i) {
      const SpanTask& task = plan.tasks[i];
      const int64_t s = task.s, h = task.h, len = task.len;
      const int64_t* table = plan.table(i, b.tables);
      // the chunk's next task, whose blocks this one asks for (prefetch_block_l2)
      const bool next = i + 1 < end;
      const int64_t next_blocks = next ? plan.blocks(i + 1) : 0, next_h = next ? plan.tasks[i + 1].h : h;
      const int64_t* next_table = next ? plan.table(i + 1, b.tables) : nullptr;
      const T* qs = b.q + (s * heads + h * G) * hd;
      if constexpr (!kBf16Dot) {
        for (int64_t j = 0; j < G * hd; ++j) qf[j] = to_float(qs[j]) * sh.scale;
      }
      scores.resize(G * len);
      // what the hardware will not, the quantized pools' token-major rows and scales too (a
      // request a row: 64 sequences of 384 tokens over int8 pools, medians of six pairs, 11.2 / 11.2
      // / 10.9 GB/s backwards / scattered / in order against 7.0 / 6.9 / 9.3 without,
      // examples/paged_decode_bandwidth.py --kv int8)
      prefetch_span_l2(b.k, b.v, h, table, plan.blocks(i));
      b.k.prefetch(h, table[0]);
      for (int64_t start = 0; start < len; start += bs) {
        const int64_t j = start / bs;
        const int n = static_cast<int>(std::min(bs, len - start));
        if (start + bs < len) b.k.prefetch(h, table[j + 1]);
        b.v.prefetch(h, table[j]);
        if (j < next_blocks) prefetch_block_l2(b.k, b.v, next_h, next_table[j]);
        if constexpr (kBf16Dot) {
          M::scores_bf16(qs, sh.scale, b.k.rows(h, table[j]), b.k.row_stride, n, scores.data() + start, len);
        } else {
          M::scores(qf.data(), b.k.rows(h, table[j]), b.k.row_stride, hd, n, scores.data() + start, len);
        }
        if constexpr (E::kQuantized)
          apply_scales<E, G>(scores.data() + start, len, b.k.row_scales(h, table[j]), b.k.scale_row_stride, n);
      }
      // the next task's blocks past this one's count
      for (int64_t j = plan.blocks(i); j < next_blocks; ++j) prefetch_block_l2(b.k, b.v, next_h, next_table[j]);
      // (a window starts within the first span's first block)
      hide_before_window<G>(scores.data(), len, b.firsts != nullptr && task.c == 0 ? b.firsts[s] : 0);
      float inv_sum[G];
      softmax_rows<G>(scores.data(), len, inv_sum, plan.max.data() + i * G, plan.sum.data() + i * G);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t start = 0; start < len; start += bs) {
        const int64_t blk = table[start / bs];
        const int n = static_cast<int>(std::min(bs, len - start));
        if constexpr (E::kQuantized)
          apply_scales<E, G>(scores.data() + start, len, b.v.row_scales(h, blk), b.v.scale_row_stride, n);
        M::accumulate(scores.data() + start, len, b.v.rows(h, blk), b.v.row_stride, hd, n, acc.data());
      }
      plan.finish(i, acc.data(), inv_sum, b.out + (s * heads + h * G) * hd);
    }
  });
  plan.join(b.pool, heads, b.out);
}

template <typename E, int G>
void dispatch_head_dim(const Batch<E>& b) {
  switch (b.sh.hd) {
    case 64: return decode_impl<E, G, 64>(b);
    case 128: return decode_impl<E, G, 128>(b);
    default: return decode_impl<E, G, 0>(b);
  }
}

template <typename E>
void dispatch_group(int64_t group, const Batch<E>& b) {
  switch (group) {
    case 1: return dispatch_head_dim<E, 1>(b);
    case 2: return dispatch_head_dim<E, 2>(b);
    case 3: return dispatch_head_dim<E, 3>(b);
    case 4: return dispatch_head_dim<E, 4>(b);
    case 5: return dispatch_head_dim<E, 5>(b);
    case 6: return dispatch_head_dim<E, 6>(b);
    case 7: return dispatch_head_dim<E, 7>(b);
    case 8: return dispatch_head_dim<E, 8>(b);
    // models/attention.py's FUSED_DECODE_MAX_GROUP routes wider groups to the matmul path.
    default: TORCH_CHECK(false, "paged decode attention: query heads per KV head must be 1..8, got ", group);
  }
}

// Checks what both decode ops take besides the pools: out, q [seqs, heads, head_dim] sharing a
// model dtype; block_tables [seqs, max_blocks] and context_lens [seqs], int64. A table naming a
// block outside the pool would read outside it: refused. `firsts` (int64 [seqs]), where given:
// each before both the sequence's length and the end of its table's first block.
inline Shapes check_batch(const at::Tensor& out, const at::Tensor& q, const at::Tensor& block_tables,
                          const at::Tensor& context_lens, int64_t kv_heads, int64_t num_blocks, int64_t block_size,
                          double scale, const std::optional<at::Tensor>& firsts = std::nullopt) {
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "q and out must be [seqs, heads, head_dim]");
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous(), "tensors must be contiguous");
  TORCH_CHECK(q.scalar_type() == out.scalar_type(), "q and out must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "block tables and lengths must be int64");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.is_contiguous() && context_lens.is_contiguous(),
              "block tables must be a contiguous [seqs, max_blocks]");
  Shapes sh{q.size(0), block_tables.size(1), kv_heads, num_blocks, block_size, q.size(2), static_cast<float>(scale)};
  TORCH_CHECK(kv_heads > 0 && q.size(1) % kv_heads == 0, "head shapes do not match");
  TORCH_CHECK(block_tables.size(0) == sh.num_seqs && context_lens.size(0) == sh.num_seqs,
              "one table row and one length per sequence");
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  if (firsts) {
    TORCH_CHECK(firsts->scalar_type() == at::kLong && firsts->is_contiguous() && firsts->numel() == sh.num_seqs,
                "window starts must be a contiguous int64 [seqs]");
    const int64_t* first = firsts->data_ptr<int64_t>();
    for (int64_t s = 0; s < sh.num_seqs; ++s)
      TORCH_CHECK(first[s] >= 0 && first[s] < std::min(lens[s], sh.block_size),
                  "a window's start must lie in its table's first block, before its length");
  }
  for (int64_t s = 0; s < sh.num_seqs; ++s) {
    TORCH_CHECK(lens[s] > 0 && lens[s] <= sh.max_blocks * sh.block_size, "context length out of range");
    for (int64_t j = 0; j < (lens[s] + sh.block_size - 1) / sh.block_size; ++j) {
      const int64_t b = tables[s * sh.max_blocks + j];
      TORCH_CHECK(b >= 0 && b < sh.num_blocks, "block id ", b, " out of range");
    }
  }
  return sh;
}

}  // namespace pagedserve::decode
