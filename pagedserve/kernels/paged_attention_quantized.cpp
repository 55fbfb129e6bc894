// The fused paged decode kernel (paged_decode.h) over the quantized pools, read in place:
// QuantizedKVCache's int8 or fp8 e4m3 values [blocks, block_size, kv_heads, head_dim] with one
// float16 scale per token and head [blocks, block_size, kv_heads]. A stored vector's scale is the
// same for all its values, so it multiplies each score once, after the dot product over the
// stored values, and each value row once, folded into its softmax weight: the inner loops only
// widen the stored values to float, and a block is read at half of bf16's bytes.
//
// And paged_decode_attention_int4 over kv/int4.py's layout: values per token (int4 nibbles,
// rotated: the caller rotates the output back), a sequence's open block in a float16 tail, and
// keys per channel within each block (asymmetric: step * (code + zero point), the step float8
// e4m3), each channel with its own width (k_bits, 1..8 bits, 4 on average over a head) and stored
// as bit planes: for block b and KV head h a string of 4 * head_dim * block_size bits, plane j
// its bits j * block_size .. + block_size - 1 (bit t: token t), the planes channel after channel,
// each channel's from its least significant bit. A block is then scored plane by plane: at
// block_size 16 a plane is one 16-bit load holding one bit of all 16 tokens' codes (on AVX-512 a
// mask register as loaded), whatever the channels' widths. With the instruction-set paths of
// cpu_isa.h (scalar, avx2, avx512), the scalar one the reference the others are tested against.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include "cpu_isa.h"
#include "simd_sum.h"
#include "int4_key_bits.h"
#include "kernel_ops.h"
#include "paged_decode.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <string_view>
#include <vector>

namespace {

using namespace pagedserve::decode;
using pagedserve::Isa;
using pagedserve::parse_isa;

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

// int4 values (V rows): value + 8 in a nibble, two per byte, value 2i in byte i's low nibble. The
// keys are bit planes instead (KeyPlanes and the Planes* scorers below).
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

}  // namespace

namespace pagedserve::ops {

// paged_decode_attention (paged_attention.cpp) over quantized pools, read in place: k_data, v_data
// [blocks, block_size, kv_heads, head_dim] (int8 for kind "int8"; uint8 bytes for "fp8" (e4m3));
// k_scales, v_scales [blocks, block_size, kv_heads] float16. q and out share any model dtype.
// firsts: as paged_decode_attention's (a sliding window's first visible positions). workers: the
// decode stack's pool (null: torch's threads).
void paged_decode_attention_quantized(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_data,
                                      const at::Tensor& v_data, const at::Tensor& k_scales,
                                      const at::Tensor& v_scales, const at::Tensor& block_tables,
                                      const at::Tensor& context_lens, double scale, c10::string_view kind,
                                      WorkPool* workers, const std::optional<at::Tensor>& firsts) {
  using namespace pagedserve::decode;
  TORCH_CHECK(k_data.dim() == 4 && k_data.sizes() == v_data.sizes() && k_data.scalar_type() == v_data.scalar_type(),
              "quantized caches must be alike [blocks, bs, kvh, width]");
  TORCH_CHECK(k_scales.dim() == 3 && k_scales.sizes() == v_scales.sizes() &&
                  k_scales.sizes() == k_data.sizes().slice(0, 3) && k_scales.scalar_type() == at::kHalf &&
                  v_scales.scalar_type() == at::kHalf,
              "scales must be float16 [blocks, bs, kvh]");
  TORCH_CHECK(k_data.is_contiguous() && v_data.is_contiguous() && k_scales.is_contiguous() && v_scales.is_contiguous(),
              "tensors must be contiguous");
  const int64_t nb = k_data.size(0), bs = k_data.size(1), kvh = k_data.size(2), width = k_data.size(3);
  const Shapes sh = check_batch(out, q, block_tables, context_lens, kvh, nb, bs, scale, firsts);
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
                                                context_lens.data_ptr<int64_t>(), sh, workers,
                                                firsts ? firsts->data_ptr<int64_t>() : nullptr});
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

// The registered op: torch's threads.
void paged_decode_attention_quantized_op(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_data,
                                         const at::Tensor& v_data, const at::Tensor& k_scales,
                                         const at::Tensor& v_scales, const at::Tensor& block_tables,
                                         const at::Tensor& context_lens, double scale, c10::string_view kind,
                                         const std::optional<at::Tensor>& firsts) {
  paged_decode_attention_quantized(out, q, k_data, v_data, k_scales, v_scales, block_tables, context_lens, scale, kind,
                                   nullptr, firsts);
}

}  // namespace pagedserve::ops

namespace {

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

// float8 e4m3 → float for every bit pattern, built once: a block's 64 key steps are 64 loads
// instead of 64 software conversions.
const float* e4m3_values() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int b = 0; b < 256; ++b)
      t[b] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(b), c10::Float8_e4m3fn::from_bits()));
    return t;
  }();
  return table.data();
}

// A key block's planes read as one integer: plane j of a head's string is its bytes 2j, 2j + 1
// when block_size is 16, and two planes are four bytes (memcpy: one unaligned load).
inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

using pagedserve::kMaxKeyBits;  // a key channel's widest code (kv/int4.py's MAX_KEY_BITS)

// One layer's key widths (k_bits [kv_heads, head_dim]), worked out once per call: where each
// channel's planes start, and each head's channels grouped by width. The SIMD paths score a block
// one width at a time, the width known at compile time (its planes unrolled): one loop over the
// channels in their own order would branch on each channel's width, which a calibrated mix makes
// unpredictable. A channel's place in the sum does not change its terms, only their order.
struct KeyPlanes {
  struct Channel {
    int32_t channel, first;  // the channel, and its first plane: bit p of its codes is plane first + p
  };
  int64_t hd;
  const uint8_t* bits;  // [kv_heads, head_dim], each 1..8, 4 * head_dim a head (checked by the entry)
  std::vector<int32_t> first;  // [kv_heads, head_dim]: channel c's first plane, sum(bits[h][:c])
  std::vector<Channel> by_width;  // [kv_heads, head_dim]: each head's channels, 1-bit ones first
  // [kv_heads, 9]: where head h's channels of width w (1..8) start in by_width, then where they end
  std::vector<int32_t> starts;

  // k_bits checked (int4_key_bits.h), its first planes with it.
  KeyPlanes(const at::Tensor& k_bits, int64_t kvh, int64_t head_dim)
      : hd(head_dim), bits(static_cast<const uint8_t*>(k_bits.data_ptr())),  // (typed once checked, below)
        first(pagedserve::first_key_planes(k_bits, kvh, head_dim, "paged_decode_attention_int4")),
        by_width(kvh * head_dim), starts(kvh * (kMaxKeyBits + 1)) {
    for (int64_t h = 0; h < kvh; ++h) {
      const uint8_t* b = bits + h * hd;
      int32_t count[kMaxKeyBits + 1] = {}, next[kMaxKeyBits + 1] = {};
      for (int64_t c = 0; c < hd; ++c) ++count[b[c]];
      int32_t* s = starts.data() + h * (kMaxKeyBits + 1);
      int32_t at = static_cast<int32_t>(h * hd);
      for (int w = 1; w <= kMaxKeyBits; ++w) {
        s[w - 1] = next[w] = at;
        at += count[w];
      }
      s[kMaxKeyBits] = at;
      for (int64_t c = 0; c < hd; ++c) by_width[next[b[c]]++] = {static_cast<int32_t>(c), first[h * hd + c]};
    }
  }
  const Channel* channels(int64_t h, int w) const { return by_width.data() + starts[h * (kMaxKeyBits + 1) + w - 1]; }
  int count(int64_t h, int w) const {
    const int32_t* s = starts.data() + h * (kMaxKeyBits + 1);
    return s[w] - s[w - 1];
  }
};

// A quantized block's key scores, each path's own (Kq in decode_int4): for its first n tokens,
//   out[g][t] = bias[g] + sum_c qs[g][c] * code(c, t),
// qs the query with the scale and the block's steps folded in, bias the zero points' share. The
// plain bit loop, for any block_size (bit j * bs + t of the head's string, least significant bit
// of each byte first): the reference, and the SIMD paths' keys when block_size is not 16.
template <int G>
struct PlanesScalar {
  static void scores(const float* qs, const uint8_t* planes, const KeyPlanes& kp, int64_t h, int64_t bs, int n,
                     const float* bias, float* out, int64_t stride) {
    const int64_t hd = kp.hd;
    const uint8_t* bits = kp.bits + h * hd;
    const int32_t* first = kp.first.data() + h * hd;
    for (int t = 0; t < n; ++t) {
      float acc[G];
      for (int g = 0; g < G; ++g) acc[g] = bias[g];
      for (int64_t c = 0; c < hd; ++c) {
        int code = 0;
        for (int p = 0; p < bits[c]; ++p) {
          const int64_t bit = (first[c] + p) * bs + t;
          code |= ((planes[bit >> 3] >> (bit & 7)) & 1) << p;
        }
        for (int g = 0; g < G; ++g) acc[g] += qs[g * hd + c] * static_cast<float>(code);
      }
      for (int g = 0; g < G; ++g) out[g * stride + t] = acc[g];
    }
  }
};

#if defined(__AVX512F__)
// AVX-512, block_size 16: a plane is the mask of the 16 tokens whose code has its bit, loaded
// straight into a mask register. A channel's 16 codes are built as integers, one masked add of
// 2^p per plane, converted once and multiplied into the G scores: w + 1 + G instructions a
// channel, where adding each plane's weight to the G scores under its mask would be w * G. Token t
// is lane t of every score vector, so no sums across lanes; narrow groups keep two sets of
// accumulators, two FMA chains a query head in flight. add and add_widths are inlined into scores,
// whose accumulators then stay in registers: called, they were stored after every channel (a
// vector of floats may alias the query it reads).
template <int G>
struct PlanesAvx512 {
  static constexpr int A = G <= 3 ? 2 : 1;

  template <int W>
  [[gnu::always_inline]] static void add(const float* qs, int64_t hd, const uint8_t* planes,
                                         const KeyPlanes::Channel& ch, __m512 (&acc)[G]) {
    const uint8_t* pl = planes + 2 * ch.first;
    __m512i code = _mm512_maskz_mov_epi32(load_u16(pl), _mm512_set1_epi32(1));
    for (int p = 1; p < W; ++p)
      code = _mm512_mask_add_epi32(code, load_u16(pl + 2 * p), code, _mm512_set1_epi32(1 << p));
    const __m512 k = _mm512_cvtepi32_ps(code);
    const float* q = qs + ch.channel;
    for (int g = 0; g < G; ++g) acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(q[g * hd]), k, acc[g]);
  }

  template <int W = 1>
  [[gnu::always_inline]] static void add_widths(const float* qs, const uint8_t* planes, const KeyPlanes& kp, int64_t h,
                                                __m512 (&acc)[A][G]) {
    const KeyPlanes::Channel* ch = kp.channels(h, W);
    const int count = kp.count(h, W);
    int i = 0;
    for (; i + A <= count; i += A)
      for (int a = 0; a < A; ++a) add<W>(qs, kp.hd, planes, ch[i + a], acc[a]);
    for (; i < count; ++i) add<W>(qs, kp.hd, planes, ch[i], acc[0]);
    if constexpr (W < kMaxKeyBits) add_widths<W + 1>(qs, planes, kp, h, acc);
  }

  static void scores(const float* qs, const uint8_t* planes, const KeyPlanes& kp, int64_t h, int64_t bs, int n,
                     const float* bias, float* out, int64_t stride) {
    if (bs != 16) return PlanesScalar<G>::scores(qs, planes, kp, h, bs, n, bias, out, stride);
    __m512 acc[A][G];
    for (int a = 0; a < A; ++a)
      for (int g = 0; g < G; ++g) acc[a][g] = a == 0 ? _mm512_set1_ps(bias[g]) : _mm512_setzero_ps();
    add_widths(qs, planes, kp, h, acc);
    const auto keep = static_cast<__mmask16>((1u << n) - 1);  // a block the context ends in: its first n
    for (int g = 0; g < G; ++g) {
      __m512 s = acc[0][g];
      for (int a = 1; a < A; ++a) s = _mm512_add_ps(s, acc[a][g]);
      _mm512_mask_storeu_ps(out + g * stride, keep, s);
    }
  }
};
#endif

struct Int4Pools {
  const uint8_t* k;  // [blocks, kvh, head_dim * bs / 2]: each block's key bit planes, head by head
  const uint8_t* v;  // [blocks, bs, kvh, hd / 2]: value rows, two codes a byte
  const uint8_t* k_steps;  // [blocks, kvh, hd]: per channel, float8 e4m3 bits
  const int8_t* k_zeros;  // [blocks, kvh, hd]: per channel, in steps
  const KeyPlanes* k_planes;  // the keys' widths (k_bits), worked out once per call
  const c10::Half* v_scales;  // [blocks, bs, kvh] (per token)
  const c10::Half *k_tail, *v_tail;  // [slots, bs, kvh, hd]
  const int64_t* tail_of;  // [blocks]: the block's tail slot, or -1 once it is quantized
  pagedserve::WorkPool* workers;  // the decode stack's pool; null: torch's threads
};

// Where a view of the int4 pools keeps KV head h's data (kept apart from the math, which each path
// supplies): a quantized block's key planes, one run of hd * bs / 2 bytes; its value rows, `vrow`
// bytes apart; and a tail slot's rows, `trow` halves apart.
struct Int4Layout {
  int64_t kvh, bs, hd, vrow, trow;
  const uint8_t* k_planes(const Int4Pools& p, int64_t blk, int64_t h) const {
    return p.k + (blk * kvh + h) * hd * bs / 2;
  }
  const uint8_t* v_rows(const Int4Pools& p, int64_t blk, int64_t h) const {
    return p.v + (blk * bs * kvh + h) * hd / 2;
  }
  int64_t channels(int64_t blk, int64_t h) const { return (blk * kvh + h) * hd; }  // steps, zero points
  int64_t value_scales(int64_t blk, int64_t h) const { return blk * bs * kvh + h; }  // token t: + t * kvh
  int64_t tail_rows(int64_t slot, int64_t h) const { return (slot * bs * kvh + h) * hd; }  // token t: + t * trow
  void prefetch_k(const uint8_t* planes) const { prefetch_bytes(planes, hd * bs / 2); }
  template <bool into_l2 = false>
  void prefetch_v(const uint8_t* rows) const {  // bs runs of hd / 2 bytes
    prefetch_rows<into_l2>(rows, bs, vrow, hd / 2);
  }
  // Everything head h reads of block blk into L2: a quantized block's key planes, steps and zero
  // points, value rows and scales; a tail slot's float16 key and value rows.
  void prefetch_block_l2(const Int4Pools& p, int64_t blk, int64_t h) const {
    if (const int64_t slot = p.tail_of[blk]; slot >= 0) {
      const int64_t at = tail_rows(slot, h), step = trow * sizeof(c10::Half), bytes = hd * sizeof(c10::Half);
      prefetch_rows<true>(p.k_tail + at, bs, step, bytes);
      prefetch_rows<true>(p.v_tail + at, bs, step, bytes);
      return;
    }
    prefetch_bytes<true>(k_planes(p, blk, h), hd * bs / 2);
    prefetch_bytes<true>(p.k_steps + channels(blk, h), hd);
    prefetch_bytes<true>(p.k_zeros + channels(blk, h), hd);
    prefetch_v<true>(v_rows(p, blk, h));
    prefetch_bytes<true>(p.v_scales + value_scales(blk, h), ((bs - 1) * kvh + 1) * sizeof(c10::Half));
  }
};

// decode_impl's two L2 requests (prefetch_span_l2, prefetch_block_l2 in paged_decode.h say why)
// over the int4 pools' arrays: a span's blocks as its task starts, the next task's a block at a
// time as this one's are scored. 64 sequences of 384 tokens over 12 layers took 22.1 / 21.0 / 20.8
// ms scattered / backwards / in order against 32.4 / 25.4 / 22.3 without (Zen 4, tasks of whole
// sequences asking eight blocks ahead; examples/paged_decode_bandwidth.py --kv int4). Out of line,
// as those.
__attribute__((noinline)) void prefetch_blocks_l2(const Int4Layout& lay, const Int4Pools& p, int64_t h,
                                                  const int64_t* table, int64_t from, int64_t to) {
  for (int64_t j = from; j < to; ++j) lay.prefetch_block_l2(p, table[j], h);
}

// One (sequence, KV head, span) a task, as decode_impl, the spans joined as there (SpanPlan: one
// long sequence's few KV heads no longer leave a thread idle), block by block: a block with a
// tail slot is read from the float16 tail (Mt); a quantized one's keys from their planes (Kq), its per-channel
// key steps folded into the query (one product per channel and block instead of one per key
// value), its zero points into one bias per query head and block (a key is step * (code + zero
// point) per channel, so q.k = (q * step).code + sum q * step * zero point), and its values
// through their codes (Mv), the per-token value scales folded into the softmax weights. Kq, Mv and
// Mt are the path's block math: the plain loops (scalar), AVX2 or AVX-512.
template <typename Kq, typename Mv, typename Mt, int G>
void decode_int4(float* out, const float* q, const Int4Pools& p, const int64_t* tables, const int64_t* lens,
                 const int64_t* firsts, const Shapes& sh) {
  const int64_t kvh = sh.kv_heads, bs = sh.block_size, hd = sh.hd, heads = kvh * G;
  const Int4Layout lay{kvh, bs, hd, kvh * hd / 2, kvh * hd};
  const KeyPlanes& kp = *p.k_planes;
  const float* e4m3 = e4m3_values();
  const int n_hd = static_cast<int>(hd);
  SpanPlan<G> plan(sh, lens);
  pagedserve::parallel_for(p.workers, 0, plan.size(), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * hd), qs(G * hd), acc(G * hd), step(hd), scores;
    for (int64_t i = begin; i < end; ++i) {
      const SpanTask& task = plan.tasks[i];
      const int64_t s = task.s, h = task.h, len = task.len;
      const int64_t* table = plan.table(i, tables);
      for (int64_t j = 0; j < G * hd; ++j) qf[j] = q[(s * heads + h * G) * hd + j] * sh.scale;
      scores.resize(G * len);
      // Blocks sit at random places in the pool: the next block's keys are asked for ahead, as in
      // decode_impl (prefetch_bytes says why), and into L2 this span's blocks as it starts and the
      // next task's a block at a time (prefetch_blocks_l2).
      const int64_t blocks = plan.blocks(i);
      const bool next = i + 1 < end;
      const int64_t next_blocks = next ? plan.blocks(i + 1) : 0, next_h = next ? plan.tasks[i + 1].h : h;
      const int64_t* next_table = next ? plan.table(i + 1, tables) : table;
      prefetch_blocks_l2(lay, p, h, table, 1, blocks);
      if (p.tail_of[table[0]] < 0) lay.prefetch_k(lay.k_planes(p, table[0], h));
      for (int64_t start = 0; start < len; start += bs) {
        const int64_t blk = table[start / bs], slot = p.tail_of[blk];
        const int n = static_cast<int>(std::min(bs, len - start));
        const int64_t following = start + bs < len ? table[start / bs + 1] : -1;
        if (following >= 0 && p.tail_of[following] < 0) lay.prefetch_k(lay.k_planes(p, following, h));
        if (start / bs < next_blocks) prefetch_blocks_l2(lay, p, next_h, next_table, start / bs, start / bs + 1);
        if (slot >= 0) {
          Mt::scores(qf.data(), p.k_tail + lay.tail_rows(slot, h), lay.trow, n_hd, n, scores.data() + start, len);
          continue;
        }
        lay.prefetch_v(lay.v_rows(p, blk, h));
        const int64_t at = lay.channels(blk, h);
        for (int64_t d = 0; d < hd; ++d) step[d] = e4m3[p.k_steps[at + d]];
        float bias[G];
        for (int g = 0; g < G; ++g) {
          bias[g] = 0.f;
          for (int64_t d = 0; d < hd; ++d) {
            qs[g * hd + d] = qf[g * hd + d] * step[d];
            bias[g] += qs[g * hd + d] * static_cast<float>(p.k_zeros[at + d]);
          }
        }
        Kq::scores(qs.data(), lay.k_planes(p, blk, h), kp, h, bs, n, bias, scores.data() + start, len);
      }
      prefetch_blocks_l2(lay, p, next_h, next_table, std::min(blocks, next_blocks), next_blocks);
      // (a window starts within the first span's first block)
      hide_before_window<G>(scores.data(), len, firsts != nullptr && task.c == 0 ? firsts[s] : 0);
      float inv_sum[G];
      softmax_rows<G>(scores.data(), len, inv_sum, plan.max.data() + i * G, plan.sum.data() + i * G);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t start = 0; start < len; start += bs) {
        const int64_t blk = table[start / bs], slot = p.tail_of[blk];
        const int n = static_cast<int>(std::min(bs, len - start));
        if (slot >= 0) {
          Mt::accumulate(scores.data() + start, len, p.v_tail + lay.tail_rows(slot, h), lay.trow, n_hd, n,
                         acc.data());
          continue;
        }
        apply_scales<Int4KV, G>(scores.data() + start, len, p.v_scales + lay.value_scales(blk, h), kvh, n);
        Mv::accumulate(scores.data() + start, len, lay.v_rows(p, blk, h), lay.vrow, n_hd, n, acc.data());
      }
      plan.finish(i, acc.data(), inv_sum, out + (s * heads + h * G) * hd);
    }
  });
  plan.join(p.workers, heads, out);
}

#if defined(__x86_64__) && defined(__GNUC__)
#define PAGEDSERVE_INT4_X86 1
#endif

#ifdef PAGEDSERVE_INT4_X86
// ---- avx2: AVX2 + FMA + F16C, 8 floats per vector ----------------------------------------------
// Without it the plain loops are what an AVX2 machine runs, and GCC leaves the int4 ones scalar
// (each value's nibble shift, each key bit's position, depends on its index): measured 4.5x the
// int8 kernel's time on W1's decodes with nibble keys. Here each 16 values of a value row, 8
// bytes, become two vectors in four instructions, and a key channel's 16 codes come from its
// planes two at a time (PlanesAvx2).
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

// Values d .. d + 15 of a row as two vectors of 8 floats: int4's grid values or a tail's float16.
struct Int4x16 {
  using Store = uint8_t;
  static void load(const uint8_t* row, int d, __m256& lo, __m256& hi) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + d / 2));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i nibbles = _mm_unpacklo_epi8(_mm_and_si128(b, mask), _mm_and_si128(_mm_srli_epi16(b, 4), mask));
    const __m128i values = _mm_sub_epi8(nibbles, _mm_set1_epi8(8));  // value 2i from byte i's low nibble
    lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(values));
    hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(values, 8)));
  }
};
struct Halfx16 {
  using Store = c10::Half;
  static void load(const c10::Half* row, int d, __m256& lo, __m256& hi) {
    lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + d)));
    hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + d + 8)));
  }
};

using pagedserve::hsum8;

// The lane sums of a, b, c and d as one 4-lane vector (three hadds: a quarter of the shuffles of
// four hsum8).
inline __m128 hsum8x4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

// BlockMath for head_dim a multiple of 16 (HD, or the run-time hd when HD is 0). Scores take four
// keys at a time while their 4 x G accumulators fit the 16 registers (G <= 3), else one; the
// query is read from L1 as the FMAs' memory operand. The weighted sum runs 16 output values at a
// time over the block's rows, the G query heads' 2 x G accumulators in registers.
template <typename L, int G, int HD>
struct Avx2Math {
  using S = typename L::Store;
  static constexpr int kKeys = G <= 3 ? 4 : 1;
  static void scores(const float* q, const S* k, int64_t rs, int hd_rt, int n, float* out, int64_t stride) {
    const int hd = HD ? HD : hd_rt;
    int t = 0;
    if constexpr (kKeys == 4) {
      for (; t + 4 <= n; t += 4) {
        __m256 acc[4][G];
        for (int j = 0; j < 4; ++j)
          for (int g = 0; g < G; ++g) acc[j][g] = _mm256_setzero_ps();
        for (int d = 0; d < hd; d += 16) {
          for (int j = 0; j < 4; ++j) {
            __m256 lo, hi;
            L::load(k + (t + j) * rs, d, lo, hi);
            for (int g = 0; g < G; ++g) {
              acc[j][g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * hd + d), lo, acc[j][g]);
              acc[j][g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * hd + d + 8), hi, acc[j][g]);
            }
          }
        }
        for (int g = 0; g < G; ++g)
          _mm_storeu_ps(out + g * stride + t, hsum8x4(acc[0][g], acc[1][g], acc[2][g], acc[3][g]));
      }
    }
    for (; t < n; ++t) {
      __m256 acc[G];
      for (int g = 0; g < G; ++g) acc[g] = _mm256_setzero_ps();
      for (int d = 0; d < hd; d += 16) {
        __m256 lo, hi;
        L::load(k + t * rs, d, lo, hi);
        for (int g = 0; g < G; ++g) {
          acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * hd + d), lo, acc[g]);
          acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * hd + d + 8), hi, acc[g]);
        }
      }
      for (int g = 0; g < G; ++g) out[g * stride + t] = hsum8(acc[g]);
    }
  }
  static void accumulate(const float* probs, int64_t stride, const S* v, int64_t rs, int hd_rt, int n, float* acc) {
    const int hd = HD ? HD : hd_rt;
    for (int d = 0; d < hd; d += 16) {
      __m256 lo_acc[G], hi_acc[G];
      for (int g = 0; g < G; ++g) {
        lo_acc[g] = _mm256_loadu_ps(acc + g * hd + d);
        hi_acc[g] = _mm256_loadu_ps(acc + g * hd + d + 8);
      }
      for (int t = 0; t < n; ++t) {
        __m256 lo, hi;
        L::load(v + t * rs, d, lo, hi);
        for (int g = 0; g < G; ++g) {
          const __m256 w = _mm256_broadcast_ss(probs + g * stride + t);
          lo_acc[g] = _mm256_fmadd_ps(w, lo, lo_acc[g]);
          hi_acc[g] = _mm256_fmadd_ps(w, hi, hi_acc[g]);
        }
      }
      for (int g = 0; g < G; ++g) {
        _mm256_storeu_ps(acc + g * hd + d, lo_acc[g]);
        _mm256_storeu_ps(acc + g * hd + d + 8, hi_acc[g]);
      }
    }
  }
};

// AVX2, block_size 16: no mask registers, so a plane's bits are compared byte by byte. Two planes
// (p and p + 1, four bytes: each one's tokens 0-7, then 8-15) are broadcast to every 32-bit lane,
// and lane i tests bit i of each byte: its four bytes say whether tokens i and 8 + i have bits p
// and p + 1, and become 2^p or 2^(p+1) where they do. After the channel's planes each lane folds
// to token i's code in byte 0 and token 8 + i's in byte 1: two vectors of 8 floats, in token order.
// As on AVX-512, add and add_widths are inlined into scores, its accumulators kept in registers.
template <int G>
struct PlanesAvx2 {
  static constexpr int A = G == 1 ? 2 : 1;  // 16 registers: 2 x G accumulators a set, and the constants

  template <int W>
  [[gnu::always_inline]] static void add(const float* qs, int64_t hd, const uint8_t* planes,
                                         const KeyPlanes::Channel& ch, __m256 (&lo)[G], __m256 (&hi)[G]) {
    const uint8_t* pl = planes + 2 * ch.first;
    const __m256i sel = _mm256_setr_epi32(0x01010101, 0x02020202, 0x04040404, 0x08080808, 0x10101010, 0x20202020,
                                          0x40404040, static_cast<int>(0x80808080u));
    __m256i code = _mm256_setzero_si256();
    for (int p = 0; p + 1 < W; p += 2) {
      const __m256i x = _mm256_set1_epi32(static_cast<int>(load_u32(pl + 2 * p)));
      const __m256i hit = _mm256_cmpeq_epi8(_mm256_and_si256(x, sel), sel);
      const uint32_t weight = (0x0101u << p) | (0x01010000u << (p + 1));
      code = _mm256_or_si256(code, _mm256_and_si256(hit, _mm256_set1_epi32(static_cast<int>(weight))));
    }
    if constexpr (W % 2 == 1) {  // the last plane alone (its two bytes, read no further): counted in bytes 0 and 1
      const __m256i x = _mm256_set1_epi16(static_cast<int16_t>(load_u16(pl + 2 * (W - 1))));
      const __m256i hit = _mm256_cmpeq_epi8(_mm256_and_si256(x, sel), sel);
      code = _mm256_or_si256(code, _mm256_and_si256(hit, _mm256_set1_epi32(static_cast<int>(0x0101u << (W - 1)))));
    }
    code = _mm256_or_si256(code, _mm256_srli_epi32(code, 16));  // even planes' bits | odd planes'
    const __m256i byte = _mm256_set1_epi32(0xFF);
    const __m256 k_lo = _mm256_cvtepi32_ps(_mm256_and_si256(code, byte));
    const __m256 k_hi = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(code, 8), byte));
    const float* q = qs + ch.channel;
    for (int g = 0; g < G; ++g) {
      // set1 from the float: given _mm256_broadcast_ss's pointer, GCC kept the accumulators in memory
      const __m256 w = _mm256_set1_ps(q[g * hd]);
      lo[g] = _mm256_fmadd_ps(w, k_lo, lo[g]);
      hi[g] = _mm256_fmadd_ps(w, k_hi, hi[g]);
    }
  }

  template <int W = 1>
  [[gnu::always_inline]] static void add_widths(const float* qs, const uint8_t* planes, const KeyPlanes& kp, int64_t h,
                                                __m256 (&lo)[A][G], __m256 (&hi)[A][G]) {
    const KeyPlanes::Channel* ch = kp.channels(h, W);
    const int count = kp.count(h, W);
    int i = 0;
    for (; i + A <= count; i += A)
      for (int a = 0; a < A; ++a) add<W>(qs, kp.hd, planes, ch[i + a], lo[a], hi[a]);
    for (; i < count; ++i) add<W>(qs, kp.hd, planes, ch[i], lo[0], hi[0]);
    if constexpr (W < kMaxKeyBits) add_widths<W + 1>(qs, planes, kp, h, lo, hi);
  }

  static void scores(const float* qs, const uint8_t* planes, const KeyPlanes& kp, int64_t h, int64_t bs, int n,
                     const float* bias, float* out, int64_t stride) {
    if (bs != 16) return PlanesScalar<G>::scores(qs, planes, kp, h, bs, n, bias, out, stride);
    __m256 lo[A][G], hi[A][G];
    for (int a = 0; a < A; ++a)
      for (int g = 0; g < G; ++g) lo[a][g] = hi[a][g] = a == 0 ? _mm256_set1_ps(bias[g]) : _mm256_setzero_ps();
    add_widths(qs, planes, kp, h, lo, hi);
    for (int g = 0; g < G; ++g) {
      __m256 l = lo[0][g], u = hi[0][g];
      for (int a = 1; a < A; ++a) {
        l = _mm256_add_ps(l, lo[a][g]);
        u = _mm256_add_ps(u, hi[a][g]);
      }
      if (n == 16) {
        _mm256_storeu_ps(out + g * stride, l);
        _mm256_storeu_ps(out + g * stride + 8, u);
      } else {  // a block the context ends in: its first n
        alignas(32) float all[16];
        _mm256_store_ps(all, l);
        _mm256_store_ps(all + 8, u);
        std::copy(all, all + n, out + g * stride);
      }
    }
  }
};

#pragma GCC pop_options
#endif  // PAGEDSERVE_INT4_X86

// The path's kernel for G query heads per KV head: scalar is the plain loops (BlockMath with
// head_dim known at run time, PlanesScalar), the reference the others are tested against; avx2
// the math above (values and tails when head_dim is a multiple of 16, else the plain loops);
// avx512 PlanesAvx512 and BlockMath's AVX-512 specialization (head_dim 64 and 128), compiled where
// the build machine has AVX-512 (-march=native). Keys take their path's planes for block_size 16,
// the plain bit loop otherwise.
template <int G>
void decode_int4_path(Isa isa, float* out, const float* q, const Int4Pools& p, const int64_t* t, const int64_t* l,
                      const int64_t* f, const Shapes& sh) {
#ifdef PAGEDSERVE_INT4_X86
  if (isa == Isa::avx2) {
    using K = PlanesAvx2<G>;
    switch (sh.hd) {
      case 64: return decode_int4<K, Avx2Math<Int4x16, G, 64>, Avx2Math<Halfx16, G, 64>, G>(out, q, p, t, l, f, sh);
      case 128: return decode_int4<K, Avx2Math<Int4x16, G, 128>, Avx2Math<Halfx16, G, 128>, G>(out, q, p, t, l, f, sh);
      default:
        if (sh.hd % 16 == 0)
          return decode_int4<K, Avx2Math<Int4x16, G, 0>, Avx2Math<Halfx16, G, 0>, G>(out, q, p, t, l, f, sh);
        return decode_int4<K, BlockMath<Int4KV, G, 0>, BlockMath<HalfRows, G, 0>, G>(out, q, p, t, l, f, sh);
    }
  }
#endif
#if defined(__AVX512F__)
  if (isa == Isa::avx512) {
    using K = PlanesAvx512<G>;
    switch (sh.hd) {
      case 64: return decode_int4<K, BlockMath<Int4KV, G, 64>, BlockMath<HalfRows, G, 64>, G>(out, q, p, t, l, f, sh);
      case 128: return decode_int4<K, BlockMath<Int4KV, G, 128>, BlockMath<HalfRows, G, 128>, G>(out, q, p, t, l, f, sh);
      default: return decode_int4<K, BlockMath<Int4KV, G, 0>, BlockMath<HalfRows, G, 0>, G>(out, q, p, t, l, f, sh);
    }
  }
#endif
  decode_int4<PlanesScalar<G>, BlockMath<Int4KV, G, 0>, BlockMath<HalfRows, G, 0>, G>(out, q, p, t, l, f, sh);
}

// out, q [seqs, heads, head_dim] (any model dtype, computed in float32); k_data [blocks, kvh,
// head_dim * bs / 2] uint8, each block's key bit planes by head; k_steps [blocks, kvh, head_dim]
// float8 e4m3, k_zeros the same int8; k_bits [kvh, head_dim] uint8, each key channel's width;
// v_data [blocks, bs, kvh, head_dim / 2] uint8; v_scales [blocks, bs, kvh] float16; k_tail, v_tail
// [slots, bs, kvh, head_dim] float16; tail_of [blocks] int64. The shapes (blocks, bs, kvh,
// head_dim) are v_data's: the key planes' last size is head_dim * bs / 2 whatever the widths.
}  // namespace

namespace pagedserve::ops {

void paged_decode_attention_int4(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_data,
                                 const at::Tensor& v_data, const at::Tensor& k_steps, const at::Tensor& k_zeros,
                                 const at::Tensor& k_bits, const at::Tensor& v_scales, const at::Tensor& k_tail,
                                 const at::Tensor& v_tail, const at::Tensor& tail_of, const at::Tensor& block_tables,
                                 const at::Tensor& context_lens, double scale, c10::string_view isa_name,
                                 WorkPool* workers, const std::optional<at::Tensor>& firsts) {
  using namespace pagedserve::decode;
  const Isa isa = parse_isa(isa_name, "paged_decode_attention_int4");
  TORCH_CHECK(v_data.dim() == 4 && v_data.scalar_type() == at::kByte,
              "the int4 value pool must be uint8 [blocks, bs, kvh, head_dim / 2]");
  const int64_t nb = v_data.size(0), bs = v_data.size(1), kvh = v_data.size(2), hd = 2 * v_data.size(3);
  TORCH_CHECK(k_data.dim() == 3 && k_data.scalar_type() == at::kByte &&
                  k_data.sizes() == at::IntArrayRef({nb, kvh, hd * bs / 2}),
              "the int4 key pool must be uint8 [blocks, kvh, head_dim * bs / 2] = [", nb, ", ", kvh, ", ", hd * bs / 2,
              "] (bit planes), got ", k_data.scalar_type(), " ", k_data.sizes());
  TORCH_CHECK(k_steps.sizes() == at::IntArrayRef({nb, kvh, hd}) && k_zeros.sizes() == k_steps.sizes() &&
                  k_steps.scalar_type() == at::kFloat8_e4m3fn && k_zeros.scalar_type() == at::kChar,
              "key steps and zero points must be float8_e4m3fn and int8 [blocks, kvh, head_dim]");
  TORCH_CHECK(v_scales.sizes() == at::IntArrayRef({nb, bs, kvh}) && v_scales.scalar_type() == at::kHalf,
              "value scales must be float16 [blocks, bs, kvh]");
  TORCH_CHECK(k_tail.dim() == 4 && k_tail.sizes() == v_tail.sizes() && k_tail.size(1) == bs && k_tail.size(2) == kvh &&
                  k_tail.size(3) == hd && k_tail.scalar_type() == at::kHalf && v_tail.scalar_type() == at::kHalf,
              "tails must be float16 [slots, bs, kvh, head_dim]");
  TORCH_CHECK(tail_of.scalar_type() == at::kLong && tail_of.dim() == 1 && tail_of.size(0) == nb,
              "tail_of must be int64 [blocks]");
  for (const at::Tensor* t : {&k_data, &v_data, &k_steps, &k_zeros, &v_scales, &k_tail, &v_tail, &tail_of})
    TORCH_CHECK(t->is_contiguous(), "tensors must be contiguous");
  const KeyPlanes planes(k_bits, kvh, hd);  // checks the widths
  const Shapes sh = check_batch(out, q, block_tables, context_lens, kvh, nb, bs, scale, firsts);
  TORCH_CHECK(sh.hd == hd, "q's head_dim ", sh.hd, " is not the pools' ", hd);
  const int64_t* slots = tail_of.data_ptr<int64_t>();
  const int64_t* t = block_tables.data_ptr<int64_t>();
  const int64_t* l = context_lens.data_ptr<int64_t>();
  const int64_t* f = firsts ? firsts->data_ptr<int64_t>() : nullptr;
  for (int64_t s = 0; s < sh.num_seqs; ++s)  // the blocks read (check_batch: in range), not the whole pool's
    for (int64_t j = 0; j < (l[s] + bs - 1) / bs; ++j)
      TORCH_CHECK(slots[t[s * sh.max_blocks + j]] < k_tail.size(0), "tail slot ", slots[t[s * sh.max_blocks + j]],
                  " out of range");
  const at::Tensor qf = q.to(at::kFloat).contiguous();
  at::Tensor of = out.scalar_type() == at::kFloat ? out : at::empty(out.sizes(), out.options().dtype(at::kFloat));
  const Int4Pools p{k_data.data_ptr<uint8_t>(),
                    v_data.data_ptr<uint8_t>(),
                    static_cast<const uint8_t*>(k_steps.data_ptr()),  // float8 bits, read through e4m3_values()
                    k_zeros.data_ptr<int8_t>(),
                    &planes,
                    v_scales.data_ptr<c10::Half>(),
                    k_tail.data_ptr<c10::Half>(),
                    v_tail.data_ptr<c10::Half>(),
                    slots,
                    workers};
  float* o = of.data_ptr<float>();
  const float* qp = qf.data_ptr<float>();
  switch (q.size(1) / kvh) {
    case 1: decode_int4_path<1>(isa, o, qp, p, t, l, f, sh); break;
    case 2: decode_int4_path<2>(isa, o, qp, p, t, l, f, sh); break;
    case 3: decode_int4_path<3>(isa, o, qp, p, t, l, f, sh); break;
    case 4: decode_int4_path<4>(isa, o, qp, p, t, l, f, sh); break;
    case 5: decode_int4_path<5>(isa, o, qp, p, t, l, f, sh); break;
    case 6: decode_int4_path<6>(isa, o, qp, p, t, l, f, sh); break;
    case 7: decode_int4_path<7>(isa, o, qp, p, t, l, f, sh); break;
    case 8: decode_int4_path<8>(isa, o, qp, p, t, l, f, sh); break;
    default: TORCH_CHECK(false, "paged_decode_attention_int4: query heads per KV head must be 1..8");
  }
  if (!of.is_same(out)) out.copy_(of);
}

// The registered op: torch's threads.
void paged_decode_attention_int4_op(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_data,
                                    const at::Tensor& v_data, const at::Tensor& k_steps, const at::Tensor& k_zeros,
                                    const at::Tensor& k_bits, const at::Tensor& v_scales, const at::Tensor& k_tail,
                                    const at::Tensor& v_tail, const at::Tensor& tail_of,
                                    const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                                    c10::string_view isa_name, const std::optional<at::Tensor>& firsts) {
  paged_decode_attention_int4(out, q, k_data, v_data, k_steps, k_zeros, k_bits, v_scales, k_tail, v_tail, tail_of,
                              block_tables, context_lens, scale, isa_name, nullptr, firsts);
}

}  // namespace pagedserve::ops

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("paged_decode_attention_quantized(Tensor(a!) out, Tensor q, Tensor k_data, Tensor v_data, Tensor k_scales, "
        "Tensor v_scales, Tensor block_tables, Tensor context_lens, float scale, str kind, Tensor? firsts=None) -> ()");
  m.def("paged_decode_attention_int4(Tensor(a!) out, Tensor q, Tensor k_data, Tensor v_data, Tensor k_steps, "
        "Tensor k_zeros, Tensor k_bits, Tensor v_scales, Tensor k_tail, Tensor v_tail, Tensor tail_of, "
        "Tensor block_tables, Tensor context_lens, float scale, str isa='auto', Tensor? firsts=None) -> ()");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("paged_decode_attention_quantized", &pagedserve::ops::paged_decode_attention_quantized_op);
  m.impl("paged_decode_attention_int4", &pagedserve::ops::paged_decode_attention_int4_op);
}
