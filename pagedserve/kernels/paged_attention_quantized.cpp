// The fused paged decode kernel (paged_decode.h) over the quantized pools, read in place:
// QuantizedKVCache's int8 or fp8 e4m3 values [blocks, block_size, kv_heads, head_dim] with one
// float16 scale per token and head [blocks, block_size, kv_heads]. A stored vector's scale is the
// same for all its values, so it multiplies each score once, after the dot product over the
// stored values, and each value row once, folded into its softmax weight: the inner loops only
// widen the stored values to float, and a block is read at half of bf16's bytes.
//
// And paged_decode_attention_int4 over kv/int4.py's layout: keys per channel within each block,
// values per token (rotated: the caller rotates the output back), a sequence's open block in a
// float16 tail.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "paged_decode.h"

#include <cstdint>
#include <string_view>

namespace {

using namespace pagedserve::decode;

// What every quantized kind shares: stored elements S holding ValuesPerElem values each, a float16
// scale per row, and ValueScale folded into that scale. They compute in float32: q and out are
// converted once per call (they are tiny next to the pools), so each kind is compiled once rather
// than once per model dtype.
template <typename S, int ValuesPerElem = 1, int ValueScale = 1>
struct QuantizedKV {
  using Store = S;
  using Model = float;
  static constexpr bool kQuantized = true;
  static constexpr int kValuesPerElem = ValuesPerElem;  // the entry point's width check uses it
  static constexpr float kValueScale = ValueScale;
};

struct Int8KV : QuantizedKV<int8_t> {
  static float get(const int8_t* row, int64_t d) { return row[d]; }
#if defined(__AVX512F__)
  static __m512 load16(const int8_t* row, int64_t d) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + d))));
  }
#endif
};

// fp8 e4m3 (bias 7) moved bit for bit into float16's fields (bias 15) reads as exactly 2^-8 times
// its value, subnormals included; the CPU converts float16 16 lanes at a time, and the 2^8 rides
// on the row's scale.
struct Fp8KV : QuantizedKV<uint8_t, 1, 256> {
  static float get(const uint8_t* row, int64_t d) {
    const auto bits = static_cast<uint16_t>(((row[d] & 0x7F) << 7) | ((row[d] & 0x80) << 8));
    return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
  }
#if defined(__AVX512F__)
  static __m512 load16(const uint8_t* row, int64_t d) {
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + d)));
    // byte to the top of its 16-bit lane, then an arithmetic shift right by one: the sign lands on
    // bits 15 and 14, exponent and mantissa on 13..7; clearing bit 14 leaves the float16.
    const __m256i h = _mm256_srai_epi16(_mm256_slli_epi16(b, 8), 1);
    return _mm512_cvtph_ps(_mm256_and_si256(h, _mm256_set1_epi16(static_cast<int16_t>(0xBFFF))));
  }
#endif
};

// int4: value + 8 in a nibble, two per byte, value 2i in byte i's low nibble.
struct Int4KV : QuantizedKV<uint8_t, 2> {
  static float get(const uint8_t* row, int64_t d) {
    return static_cast<float>(((row[d >> 1] >> (4 * (d & 1))) & 0xF) - 8);
  }
#if defined(__AVX512F__)
  static __m512 load16(const uint8_t* row, int64_t d) {  // 8 bytes -> 16 values
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + d / 2));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    const __m128i values = _mm_sub_epi8(_mm_unpacklo_epi8(lo, hi), _mm_set1_epi8(8));  // lo0 hi0 lo1 hi1 ...
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(values));
  }
#endif
};

// paged_decode_attention (paged_attention.cpp) over quantized pools, read in place: k_data, v_data
// [blocks, block_size, kv_heads, head_dim] (int8 for kind "int8"; uint8 bytes for "fp8" (e4m3));
// k_scales, v_scales [blocks, block_size, kv_heads] float16. q and out share any model dtype.
void paged_decode_attention_quantized(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_data,
                                      const at::Tensor& v_data, const at::Tensor& k_scales,
                                      const at::Tensor& v_scales, const at::Tensor& block_tables,
                                      const at::Tensor& context_lens, double scale, std::string_view kind) {
  TORCH_CHECK(k_data.dim() == 4 && k_data.sizes() == v_data.sizes() && k_data.scalar_type() == v_data.scalar_type(),
              "quantized caches must be alike [blocks, bs, kvh, width]");
  TORCH_CHECK(k_scales.dim() == 3 && k_scales.sizes() == v_scales.sizes() &&
                  k_scales.sizes() == k_data.sizes().slice(0, 3) && k_scales.scalar_type() == at::kHalf &&
                  v_scales.scalar_type() == at::kHalf,
              "scales must be float16 [blocks, bs, kvh]");
  TORCH_CHECK(k_data.is_contiguous() && v_data.is_contiguous() && k_scales.is_contiguous() && v_scales.is_contiguous(),
              "tensors must be contiguous");
  const int64_t nb = k_data.size(0), bs = k_data.size(1), kvh = k_data.size(2), width = k_data.size(3);
  const Shapes sh = check_batch(out, q, block_tables, context_lens, kvh, nb, bs, scale);
  // The kernel computes in float32: q and out, small next to the pools, are converted here.
  const at::Tensor qf = q.to(at::kFloat);
  at::Tensor of = out.scalar_type() == at::kFloat ? out : at::empty(out.sizes(), out.options().dtype(at::kFloat));
  auto run = [&](auto tag, at::ScalarType stored) {
    using E = decltype(tag);
    using S = typename E::Store;
    TORCH_CHECK(k_data.scalar_type() == stored && width * E::kValuesPerElem == sh.hd,
                "paged_decode_attention_quantized: ", kind, " caches must be ", stored, " [..., ",
                sh.hd / E::kValuesPerElem, "] for head_dim ", sh.hd);
    auto pool = [&](const at::Tensor& data, const at::Tensor& scales) {
      return Pool<E>{data.data_ptr<S>(), scales.data_ptr<c10::Half>(), bs, width, width, bs * kvh * width,
                     kvh * width, 1, bs * kvh, kvh};
    };
    dispatch_group<E>(q.size(1) / kvh, Batch<E>{of.data_ptr<float>(), qf.data_ptr<float>(), pool(k_data, k_scales),
                                                pool(v_data, v_scales), block_tables.data_ptr<int64_t>(),
                                                context_lens.data_ptr<int64_t>(), sh});
  };
  if (kind == "int8") {
    run(Int8KV{}, at::kChar);
  } else if (kind == "fp8") {
    run(Fp8KV{}, at::kByte);
  } else {
    TORCH_CHECK(false, "paged_decode_attention_quantized: unknown kind ", kind, " (int8 or fp8)");
  }
  if (!of.is_same(out)) out.copy_(of);
}

// A tail row: float16, read as float.
struct HalfRows {
  using Store = c10::Half;
  static float get(const c10::Half* row, int64_t d) { return static_cast<float>(row[d]); }
#if defined(__AVX512F__)
  static __m512 load16(const c10::Half* row, int64_t d) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + d)));
  }
#endif
};

struct Int4Pools {
  const uint8_t *k, *v;  // [blocks, bs, kvh, hd / 2]
  const c10::Half *k_scales, *v_scales;  // [blocks, kvh, hd] (per channel), [blocks, bs, kvh] (per token)
  const c10::Half *k_tail, *v_tail;  // [slots, bs, kvh, hd]
  const int64_t* tail_of;  // [blocks]: the block's tail slot, or -1 once it is quantized
};

// One (sequence, KV head) at a time, as decode_impl, block by block: a block with a tail slot is
// read from the float16 tail; a quantized one through its grid values, its per-channel key scales
// folded into the query (one product per channel and block instead of one per key value) and its
// per-token value scales into the softmax weights.
template <int G, int HD>
void decode_int4(float* out, const float* q, const Int4Pools& p, const int64_t* tables, const int64_t* lens,
                 const Shapes& sh) {
  using Mq = BlockMath<Int4KV, G, HD>;
  using Mt = BlockMath<HalfRows, G, HD>;
  const int64_t kvh = sh.kv_heads, bs = sh.block_size, hd = sh.hd, heads = kvh * G;
  const int64_t qrow = kvh * hd / 2, trow = kvh * hd;  // stored elements between two tokens' rows
  pagedserve::parallel_for(nullptr, 0, sh.num_seqs * kvh, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * hd), qs(G * hd), acc(G * hd), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / kvh, h = item % kvh, len = lens[s];
      const int64_t* table = tables + s * sh.max_blocks;
      for (int64_t i = 0; i < G * hd; ++i) qf[i] = q[(s * heads + h * G) * hd + i] * sh.scale;
      scores.resize(G * len);
      for (int64_t start = 0; start < len; start += bs) {
        const int64_t blk = table[start / bs], slot = p.tail_of[blk];
        const int n = static_cast<int>(std::min(bs, len - start));
        if (slot >= 0) {
          Mt::scores(qf.data(), p.k_tail + (slot * bs * kvh + h) * hd, trow, hd, n, scores.data() + start, len);
          continue;
        }
        const c10::Half* ks = p.k_scales + (blk * kvh + h) * hd;
        for (int g = 0; g < G; ++g)
          for (int64_t d = 0; d < hd; ++d) qs[g * hd + d] = qf[g * hd + d] * static_cast<float>(ks[d]);
        Mq::scores(qs.data(), p.k + (blk * bs * kvh + h) * hd / 2, qrow, hd, n, scores.data() + start, len);
      }
      float inv_sum[G];
      softmax_rows<G>(scores.data(), len, inv_sum);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t start = 0; start < len; start += bs) {
        const int64_t blk = table[start / bs], slot = p.tail_of[blk];
        const int n = static_cast<int>(std::min(bs, len - start));
        if (slot >= 0) {
          Mt::accumulate(scores.data() + start, len, p.v_tail + (slot * bs * kvh + h) * hd, trow, hd, n, acc.data());
          continue;
        }
        apply_scales<Int4KV, G>(scores.data() + start, len, p.v_scales + blk * bs * kvh + h, kvh, n);
        Mq::accumulate(scores.data() + start, len, p.v + (blk * bs * kvh + h) * hd / 2, qrow, hd, n, acc.data());
      }
      float* os = out + (s * heads + h * G) * hd;
      for (int g = 0; g < G; ++g)
        for (int64_t d = 0; d < hd; ++d) os[g * hd + d] = acc[g * hd + d] * inv_sum[g];
    }
  });
}

template <int G>
void decode_int4_hd(float* out, const float* q, const Int4Pools& p, const int64_t* t, const int64_t* l,
                    const Shapes& sh) {
  switch (sh.hd) {
    case 64: return decode_int4<G, 64>(out, q, p, t, l, sh);
    case 128: return decode_int4<G, 128>(out, q, p, t, l, sh);
    default: return decode_int4<G, 0>(out, q, p, t, l, sh);
  }
}

// out, q [seqs, heads, head_dim] (any model dtype, computed in float32); k_data, v_data [blocks, bs,
// kvh, head_dim / 2] uint8; k_scales [blocks, kvh, head_dim], v_scales [blocks, bs, kvh] float16;
// k_tail, v_tail [slots, bs, kvh, head_dim] float16; tail_of [blocks] int64.
void paged_decode_attention_int4(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_data,
                                 const at::Tensor& v_data, const at::Tensor& k_scales, const at::Tensor& v_scales,
                                 const at::Tensor& k_tail, const at::Tensor& v_tail, const at::Tensor& tail_of,
                                 const at::Tensor& block_tables, const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(k_data.dim() == 4 && k_data.sizes() == v_data.sizes() && k_data.scalar_type() == at::kByte &&
                  v_data.scalar_type() == at::kByte, "int4 pools must be uint8 [blocks, bs, kvh, head_dim / 2]");
  const int64_t nb = k_data.size(0), bs = k_data.size(1), kvh = k_data.size(2), hd = 2 * k_data.size(3);
  TORCH_CHECK(k_scales.sizes() == at::IntArrayRef({nb, kvh, hd}) && v_scales.sizes() == k_data.sizes().slice(0, 3) &&
                  k_scales.scalar_type() == at::kHalf && v_scales.scalar_type() == at::kHalf,
              "scales must be float16 [blocks, kvh, head_dim] (K) and [blocks, bs, kvh] (V)");
  TORCH_CHECK(k_tail.dim() == 4 && k_tail.sizes() == v_tail.sizes() && k_tail.size(1) == bs && k_tail.size(2) == kvh &&
                  k_tail.size(3) == hd && k_tail.scalar_type() == at::kHalf && v_tail.scalar_type() == at::kHalf,
              "tails must be float16 [slots, bs, kvh, head_dim]");
  TORCH_CHECK(tail_of.scalar_type() == at::kLong && tail_of.dim() == 1 && tail_of.size(0) == nb,
              "tail_of must be int64 [blocks]");
  for (const at::Tensor* t : {&k_data, &v_data, &k_scales, &v_scales, &k_tail, &v_tail, &tail_of})
    TORCH_CHECK(t->is_contiguous(), "tensors must be contiguous");
  const Shapes sh = check_batch(out, q, block_tables, context_lens, kvh, nb, bs, scale);
  TORCH_CHECK(sh.hd == hd, "q's head_dim ", sh.hd, " is not the pools' ", hd);
  const int64_t* slots = tail_of.data_ptr<int64_t>();
  for (int64_t b = 0; b < nb; ++b) TORCH_CHECK(slots[b] < k_tail.size(0), "tail slot ", slots[b], " out of range");
  const at::Tensor qf = q.to(at::kFloat).contiguous();
  at::Tensor of = out.scalar_type() == at::kFloat ? out : at::empty(out.sizes(), out.options().dtype(at::kFloat));
  const Int4Pools p{k_data.data_ptr<uint8_t>(), v_data.data_ptr<uint8_t>(), k_scales.data_ptr<c10::Half>(),
                    v_scales.data_ptr<c10::Half>(), k_tail.data_ptr<c10::Half>(), v_tail.data_ptr<c10::Half>(), slots};
  const int64_t* t = block_tables.data_ptr<int64_t>();
  const int64_t* l = context_lens.data_ptr<int64_t>();
  float* o = of.data_ptr<float>();
  const float* qp = qf.data_ptr<float>();
  switch (q.size(1) / kvh) {
    case 1: decode_int4_hd<1>(o, qp, p, t, l, sh); break;
    case 2: decode_int4_hd<2>(o, qp, p, t, l, sh); break;
    case 3: decode_int4_hd<3>(o, qp, p, t, l, sh); break;
    case 4: decode_int4_hd<4>(o, qp, p, t, l, sh); break;
    case 5: decode_int4_hd<5>(o, qp, p, t, l, sh); break;
    case 6: decode_int4_hd<6>(o, qp, p, t, l, sh); break;
    case 7: decode_int4_hd<7>(o, qp, p, t, l, sh); break;
    case 8: decode_int4_hd<8>(o, qp, p, t, l, sh); break;
    default: TORCH_CHECK(false, "paged_decode_attention_int4: query heads per KV head must be 1..8");
  }
  if (!of.is_same(out)) out.copy_(of);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("paged_decode_attention_quantized(Tensor(a!) out, Tensor q, Tensor k_data, Tensor v_data, Tensor k_scales, "
        "Tensor v_scales, Tensor block_tables, Tensor context_lens, float scale, str kind) -> ()");
  m.def("paged_decode_attention_int4(Tensor(a!) out, Tensor q, Tensor k_data, Tensor v_data, Tensor k_scales, "
        "Tensor v_scales, Tensor k_tail, Tensor v_tail, Tensor tail_of, Tensor block_tables, Tensor context_lens, "
        "float scale) -> ()");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("paged_decode_attention_quantized", &paged_decode_attention_quantized);
  m.impl("paged_decode_attention_int4", &paged_decode_attention_int4);
}
