// The fused paged decode kernel (paged_decode.h) over the quantized pools, read in place:
// QuantizedKVCache's int8, fp8 e4m3 or int4 values [blocks, block_size, kv_heads, width] with one
// float16 scale per token and head [blocks, block_size, kv_heads]. A stored vector's scale is the
// same for all its values, so it multiplies each score once, after the dot product over the
// stored values, and each value row once, folded into its softmax weight: the inner loops only
// widen the stored values to float, and a block is read at a half (int8, fp8) or a quarter (int4)
// of bf16's bytes.
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
// [blocks, block_size, kv_heads, width] (int8 for kind "int8"; uint8 bytes for "fp8" (e4m3) and
// "int4" (two values a byte, width head_dim / 2)); k_scales, v_scales [blocks, block_size,
// kv_heads] float16. q and out share any model dtype.
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
  } else if (kind == "int4") {
    run(Int4KV{}, at::kByte);
  } else {
    TORCH_CHECK(false, "paged_decode_attention_quantized: unknown kind ", kind, " (int8, fp8 or int4)");
  }
  if (!of.is_same(out)) out.copy_(of);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("paged_decode_attention_quantized(Tensor(a!) out, Tensor q, Tensor k_data, Tensor v_data, Tensor k_scales, "
        "Tensor v_scales, Tensor block_tables, Tensor context_lens, float scale, str kind) -> ()");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("paged_decode_attention_quantized", &paged_decode_attention_quantized);
}
