// A step's K or V rows into the quantized KV pools in one call.
//
// int8 / fp8 (kv/quant.py's QuantizedKVCache): each row's vector per KV head quantized on its own
// (a float16 scale, its largest magnitude over the format's largest code) and stored at its slot.
// The torch path (quantize_kv, then two index_copy_) spends ~10 small ops a layer on it; this is
// the engine's path on CPU, and the decode stack's (decode_stack.cpp), which calls it directly.
//
// int4 (kv/int4.py): the rows of blocks the step fills quantized into their blocks, those blocks'
// new rows also kept in their tail slots for this step's reads, and every other row into its
// block's float16 tail slot. The torch path (Int4KVCache's own write) spends ~30 small ops a layer
// on the same work. Keys are quantized per block, head and channel with a float8 step and an int8
// zero point, each channel at its own bits (key_bits, 1..8, 4 a channel on average: channels are
// not equally worth their bits). A head's block is stored as bit planes, each channel's from its
// least significant bit, a plane one bit per token: any mix of widths then fills the bytes of 4-bit
// codes, and a decode scores a block plane by plane. Values are quantized per token, two 4-bit
// codes a byte, as int8's are.
//
// The bits match the torch paths' exactly (tests/kernels/test_kv_write.py compares them).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "convert.h"
#include "int4_key_bits.h"
#include "kernel_ops.h"
#include "work_pool.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr float kStepMin = 1.0f / 512, kStepMax = 448;   // e4m3's smallest subnormal and largest finite
constexpr float kValueMax = 7.0f, kScaleMin = 1e-6f;     // value codes -7..7 (+8); kv/quant.py's floor

// Every division goes through these two, compiled as IEEE divisions, as torch divides: the build's
// -ffast-math would multiply by a reciprocal instead, one ulp off at times, which moves a value
// that sits on a rounding tie to the other code. (The attribute stays on these leaves: a function
// built with other math options than the headers' inline helpers would call them out of line.)
#define PAGEDSERVE_IEEE_MATH __attribute__((optimize("O3", "no-fast-math"), noinline))
PAGEDSERVE_IEEE_MATH void divide(float* q, const float* x, const float* d, int64_t n) {
  for (int64_t i = 0; i < n; ++i) q[i] = x[i] / d[i];
}

PAGEDSERVE_IEEE_MATH void divide_by(float* q, const float* x, float d, int64_t n) {
  for (int64_t i = 0; i < n; ++i) q[i] = x[i] / d;
}
#undef PAGEDSERVE_IEEE_MATH

struct Pool {
  uint8_t* data;  // K: [blocks, kvh, hd * bs / 2] bit planes; V: [blocks, bs, kvh, hd / 2]
  void* scales;   // K: [blocks, kvh, hd] float8 e4m3; V: [blocks, bs, kvh] float16
  int8_t* zeros;  // K: [blocks, kvh, hd]; V: null
  const uint8_t* bits;   // K: [kvh, hd] each channel's bits; V: null
  const float* levels;   // K: [kvh * hd] 2^bits - 1, the channel's largest code
  const int32_t* first;  // K: [kvh * hd] the channel's first plane within its head
  int64_t bs, kvh, hd;
};

// The smallest e4m3 at least x (x clamped to e4m3's positive range first): a step rounded down
// would clip its channel's range.
uint8_t e4m3_at_least(float x) {
  x = std::min(std::max(x, kStepMin), kStepMax);
  const c10::Float8_e4m3fn y(x);
  return static_cast<float>(y) < x ? static_cast<uint8_t>(y.x + 1) : y.x;
}

void pack_row(uint8_t* out, const float* codes, int64_t n) {
  for (int64_t i = 0; i < n / 2; ++i)
    out[i] = static_cast<uint8_t>(codes[2 * i]) | static_cast<uint8_t>(static_cast<uint8_t>(codes[2 * i + 1]) << 4);
}

// rows [bs, kvh, hd] float → block b's key bit planes, steps and zero points (kv/int4.py: quantize_key_blocks).
void store_key_block(const Pool& p, int64_t b, const float* rows) {
  const int64_t bs = p.bs, row = p.kvh * p.hd;  // a channel c: head * hd + dimension
  auto* steps = static_cast<uint8_t*>(p.scales) + b * row;
  int8_t* zeros = p.zeros + b * row;
  std::vector<float> lo(rows, rows + row), hi(lo), span(row), step(row), zero(row), codes(bs * row);
  for (int64_t o = 1; o < bs; ++o)
    for (int64_t c = 0; c < row; ++c) {
      lo[c] = std::min(lo[c], rows[o * row + c]);
      hi[c] = std::max(hi[c], rows[o * row + c]);
    }
  // The step spans the channel's range in its 2^bits - 1 levels and is at least max|x| / 127 (its
  // zero point fits int8).
  for (int64_t c = 0; c < row; ++c) span[c] = hi[c] - lo[c];
  divide(span.data(), span.data(), p.levels, row);
  for (int64_t c = 0; c < row; ++c) hi[c] = std::max(std::fabs(lo[c]), std::fabs(hi[c]));
  divide_by(hi.data(), hi.data(), 127.0f, row);
  for (int64_t c = 0; c < row; ++c) {
    steps[c] = e4m3_at_least(std::max(span[c], hi[c]));
    step[c] = static_cast<float>(c10::Float8_e4m3fn(steps[c], c10::Float8_e4m3fn::from_bits()));
  }
  divide(zero.data(), lo.data(), step.data(), row);
  for (int64_t c = 0; c < row; ++c) {
    zero[c] = std::min(std::max(std::nearbyint(zero[c]), -128.0f), 127.0f);
    zeros[c] = static_cast<int8_t>(zero[c]);
  }
  for (int64_t o = 0; o < bs; ++o) {
    float* q = codes.data() + o * row;
    divide(q, rows + o * row, step.data(), row);
    for (int64_t c = 0; c < row; ++c) q[c] = std::min(std::max(std::nearbyint(q[c] - zero[c]), 0.0f), p.levels[c]);
  }
  // Bit `(first + bit) * bs + token` of the head's bytes, least significant first, holds that bit of
  // the token's code in the channel.
  const int64_t head_bytes = p.hd * bs / 2;
  uint8_t* planes = p.data + b * p.kvh * head_bytes;
  std::memset(planes, 0, p.kvh * head_bytes);
  for (int64_t c = 0; c < row; ++c) {
    uint8_t* head = planes + c / p.hd * head_bytes;
    if (bs % 8 == 0) {  // a plane's bytes whole: 8 tokens' codes (at most 8 bits) as the bytes of a word
      for (int64_t k = 0; k < bs / 8; ++k) {
        uint64_t word = 0;
        for (int i = 0; i < 8; ++i) word |= static_cast<uint64_t>(codes[(8 * k + i) * row + c]) << (8 * i);
        // bit `bit` of each byte gathered into one byte, token i at bit i: the multiply moves byte i's
        // bit to bit 56 + i and nothing else there (no branch on the bits, which are random)
        for (int64_t bit = 0; bit < p.bits[c]; ++bit)
          head[(p.first[c] + bit) * bs / 8 + k] =
              static_cast<uint8_t>((((word >> bit) & 0x0101010101010101ull) * 0x0102040810204080ull) >> 56);
      }
      continue;
    }
    for (int64_t o = 0; o < bs; ++o) {
      const auto code = static_cast<uint32_t>(codes[o * row + c]);
      for (int64_t bit = 0; bit < p.bits[c]; ++bit) {
        const int64_t at = (p.first[c] + bit) * bs + o;
        head[at / 8] |= static_cast<uint8_t>((code >> bit & 1) << (at % 8));
      }
    }
  }
}

// One vector's float16 scale as kv/quant.py's quantize_kv sets it (its largest magnitude over
// `largest`, the format's largest code, and at least kScaleMin), and x / scale into y, the codes
// before their rounding.
c10::Half scale_vector(float* y, const float* x, int64_t n, float largest) {
  float amax = 0.0f;
  for (int64_t d = 0; d < n; ++d) amax = std::max(amax, std::fabs(x[d]));
  divide_by(&amax, &amax, largest, 1);
  const c10::Half scale(std::max(amax, kScaleMin));
  divide_by(y, x, static_cast<float>(scale), n);
  return scale;
}

// rows [bs, kvh, hd] float → block b's value codes and float16 scales, one per token and head
// (kv/quant.py: quantize_kv's int4).
void store_value_block(const Pool& p, int64_t b, const float* rows) {
  const int64_t hd = p.hd, n = p.bs * p.kvh;  // a vector v: token * kvh + head
  auto* scales = static_cast<c10::Half*>(p.scales) + b * n;
  std::vector<float> codes(hd);
  for (int64_t v = 0; v < n; ++v) {
    scales[v] = scale_vector(codes.data(), rows + v * hd, hd, kValueMax);
    for (int64_t d = 0; d < hd; ++d)
      codes[d] = std::min(std::max(std::nearbyint(codes[d]), -kValueMax), kValueMax) + 8.0f;
    pack_row(p.data + (b * n + v) * (hd / 2), codes.data(), hd);
  }
}

const int64_t* longs(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kLong && t.dim() == 1 && t.is_contiguous(), name, " must be contiguous int64 [n]");
  return t.data_ptr<int64_t>();
}

}  // namespace

namespace pagedserve::ops {

// x [T, kvh, hd] float16: the step's rows as stored (V already rotated). tail [slots, bs, kvh, hd]
// float16. data, scales, zero_points: the pool (zero_points empty for V); key_bits [kvh, hd] uint8:
// each key channel's bits (empty for V). full_blocks [F] the blocks this step fills, full_slots [F]
// their tail slots (-1: every row is in x), full_rows / full_tokens [R] row (index into full_blocks
// * bs + offset) and token of the step's rows in them; tail_rows / tail_tokens [Tr] flat tail row
// (slot * bs + offset) and token of the rest. Every index is the host's plan (kv/int4.py:
// WritePlan); ranges are checked here.
void int4_kv_write(const at::Tensor& x, at::Tensor& tail, at::Tensor& data, at::Tensor& scales,
                   at::Tensor& zero_points, const at::Tensor& key_bits, const at::Tensor& full_blocks,
                   const at::Tensor& full_slots, const at::Tensor& full_rows, const at::Tensor& full_tokens,
                   const at::Tensor& tail_rows, const at::Tensor& tail_tokens) {
  TORCH_CHECK(tail.dim() == 4 && tail.size(3) % 2 == 0 && tail.scalar_type() == at::kHalf && tail.is_contiguous(),
              "int4_kv_write: tail must be contiguous float16 [slots, bs, kvh, head_dim] with an even head_dim");
  const int64_t bs = tail.size(1), kvh = tail.size(2), hd = tail.size(3), nb = data.dim() ? data.size(0) : 0;
  const bool keys = zero_points.numel() > 0;
  TORCH_CHECK(data.scalar_type() == at::kByte && data.is_contiguous() &&
                  (keys ? data.sizes() == at::IntArrayRef({nb, kvh, hd * bs / 2})
                        : data.sizes() == at::IntArrayRef({nb, bs, kvh, hd / 2})),
              "int4_kv_write: data must be contiguous uint8 ", keys ? "[blocks, kvh, head_dim * bs / 2] (keys)"
                                                                     : "[blocks, bs, kvh, head_dim / 2] (values)");
  TORCH_CHECK(x.dim() == 3 && x.size(1) == kvh && x.size(2) == hd && x.scalar_type() == at::kHalf && x.is_contiguous(),
              "int4_kv_write: x must be contiguous float16 [tokens, kvh, head_dim]");
  std::vector<float> levels;   // keys: each channel's largest code, 2^bits - 1 ...
  std::vector<int32_t> first;  // ... and first plane within its head, worked out once per call
  if (keys) {
    TORCH_CHECK(scales.sizes() == at::IntArrayRef({nb, kvh, hd}) && scales.scalar_type() == at::kFloat8_e4m3fn &&
                    zero_points.sizes() == scales.sizes() && zero_points.scalar_type() == at::kChar &&
                    scales.is_contiguous() && zero_points.is_contiguous(),
                "int4_kv_write: key steps and zero points must be float8_e4m3fn and int8 [blocks, kvh, head_dim]");
    first = pagedserve::first_key_planes(key_bits, kvh, hd, "int4_kv_write");
    levels.resize(kvh * hd);
    for (int64_t c = 0; c < kvh * hd; ++c) levels[c] = static_cast<float>((1 << key_bits.data_ptr<uint8_t>()[c]) - 1);
  } else {
    TORCH_CHECK(key_bits.numel() == 0, "int4_kv_write: key_bits must be empty for values");
    TORCH_CHECK(scales.sizes() == data.sizes().slice(0, 3) && scales.scalar_type() == at::kHalf &&
                    scales.is_contiguous(),
                "int4_kv_write: value scales must be float16 [blocks, bs, kvh]");
  }
  const int64_t n_tokens = x.size(0), n_slots = tail.size(0), row = kvh * hd, nf = full_blocks.numel();
  const int64_t *blocks = longs(full_blocks, "full_blocks"), *slots = longs(full_slots, "full_slots");
  const int64_t *rows = longs(full_rows, "full_rows"), *rtok = longs(full_tokens, "full_tokens");
  const int64_t *trows = longs(tail_rows, "tail_rows"), *ttok = longs(tail_tokens, "tail_tokens");
  TORCH_CHECK(full_slots.numel() == nf && full_tokens.numel() == full_rows.numel() &&
                  tail_tokens.numel() == tail_rows.numel(), "int4_kv_write: plan lists of unequal lengths");
  for (int64_t j = 0; j < nf; ++j)
    TORCH_CHECK(blocks[j] >= 0 && blocks[j] < nb && slots[j] >= -1 && slots[j] < n_slots,
                "int4_kv_write: full block ", blocks[j], " or slot ", slots[j], " out of range");
  for (int64_t r = 0; r < full_rows.numel(); ++r)
    TORCH_CHECK(rows[r] >= 0 && rows[r] < nf * bs && rtok[r] >= 0 && rtok[r] < n_tokens,
                "int4_kv_write: full row ", rows[r], " or token ", rtok[r], " out of range");
  for (int64_t r = 0; r < tail_rows.numel(); ++r)
    TORCH_CHECK(trows[r] >= 0 && trows[r] < n_slots * bs && ttok[r] >= 0 && ttok[r] < n_tokens,
                "int4_kv_write: tail row ", trows[r], " or token ", ttok[r], " out of range");

  const auto* xs = x.data_ptr<c10::Half>();
  auto* ts = tail.data_ptr<c10::Half>();
  const Pool pool{data.data_ptr<uint8_t>(), scales.data_ptr(), keys ? zero_points.data_ptr<int8_t>() : nullptr,
                  keys ? key_bits.data_ptr<uint8_t>() : nullptr, levels.data(), first.data(), bs, kvh, hd};
  // Filled blocks first: a slot one of them leaves may be handed to another block in this plan,
  // whose rows then land in it below (kv/int4.py: TailMap._make_plan).
  std::vector<float> filled(nf * bs * row, 0.0f);
  for (int64_t j = 0; j < nf; ++j)
    if (slots[j] >= 0)
      for (int64_t i = 0; i < bs * row; ++i) filled[j * bs * row + i] = static_cast<float>(ts[slots[j] * bs * row + i]);
  for (int64_t r = 0; r < full_rows.numel(); ++r) {
    const int64_t j = rows[r] / bs, o = rows[r] % bs;
    for (int64_t i = 0; i < row; ++i) filled[rows[r] * row + i] = static_cast<float>(xs[rtok[r] * row + i]);
    if (slots[j] >= 0)  // whole in its slot too, for this step's decodes
      std::memcpy(ts + (slots[j] * bs + o) * row, xs + rtok[r] * row, row * sizeof(c10::Half));
  }
  for (int64_t j = 0; j < nf; ++j)
    (keys ? store_key_block : store_value_block)(pool, blocks[j], filled.data() + j * bs * row);
  for (int64_t r = 0; r < tail_rows.numel(); ++r)
    std::memcpy(ts + trows[r] * row, xs + ttok[r] * row, row * sizeof(c10::Half));
}

// x [T, kvh, hd] in a model dtype (rows and heads may be strided, as a view into the fused QKV
// output is; head_dim contiguous) → flat slots `slots` [T] of data [blocks, bs, kvh, hd] (int8 for
// "int8"; uint8, e4m3's bits, for "fp8") and their float16 scales [blocks, bs, kvh], as
// kv/quant.py's QuantizedKVCache.write stores them.
void quantized_kv_write(at::Tensor& data, at::Tensor& scales, const at::Tensor& slots, const at::Tensor& x,
                        c10::string_view kind) {
  TORCH_CHECK(kind == "int8" || kind == "fp8", "quantized_kv_write: unknown kind ", kind, " (int8 or fp8)");
  const bool fp8 = kind == "fp8";
  TORCH_CHECK(data.dim() == 4 && data.is_contiguous() && data.scalar_type() == (fp8 ? at::kByte : at::kChar),
              "quantized_kv_write: ", kind, " data must be contiguous ", fp8 ? "uint8" : "int8",
              " [blocks, bs, kvh, head_dim]");
  TORCH_CHECK(scales.sizes() == data.sizes().slice(0, 3) && scales.scalar_type() == at::kHalf && scales.is_contiguous(),
              "quantized_kv_write: scales must be contiguous float16 [blocks, bs, kvh]");
  const int64_t kvh = data.size(2), hd = data.size(3), n_slots = data.size(0) * data.size(1);
  TORCH_CHECK(x.dim() == 3 && x.size(1) == kvh && x.size(2) == hd && x.stride(2) == 1,
              "quantized_kv_write: x must be [tokens, kvh, head_dim] with head_dim contiguous");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous() &&
                  slots.numel() == x.size(0),
              "quantized_kv_write: slots must be contiguous int64, one per token");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < x.size(0); ++i)
    TORCH_CHECK(slot[i] >= 0 && slot[i] < n_slots, "quantized_kv_write: slot ", slot[i], " out of range");
  const float largest = fp8 ? 448.0f : 127.0f;  // kv/quant.py's _QMAX
  auto* codes = static_cast<uint8_t*>(data.data_ptr());
  auto* scale = scales.data_ptr<c10::Half>();
  std::vector<float> row(hd), y(hd);
  dispatch_model_dtype(x.scalar_type(), "quantized_kv_write", [&](auto tag) {
    using T = decltype(tag);
    const T* xs = x.data_ptr<T>();
    for (int64_t i = 0; i < x.size(0); ++i)
      for (int64_t h = 0; h < kvh; ++h) {
        const T* src = xs + i * x.stride(0) + h * x.stride(1);
        for (int64_t d = 0; d < hd; ++d) row[d] = to_float(src[d]);
        const int64_t vector = slot[i] * kvh + h;
        scale[vector] = scale_vector(y.data(), row.data(), hd, largest);
        uint8_t* out = codes + vector * hd;
        for (int64_t d = 0; d < hd; ++d) {
          const float c = std::min(std::max(fp8 ? y[d] : std::nearbyint(y[d]), -largest), largest);
          out[d] = fp8 ? c10::Float8_e4m3fn(c).x : static_cast<uint8_t>(static_cast<int8_t>(c));
        }
      }
  });
}

// Rows x [..., hd] (a model dtype, any layout) times int4 values' rotation R [hd, hd]
// (float32, kv/quant.py's hadamard_matrix), in float32: y[d] = sum over j in order of x[j] R[j][d],
// so a row's bits are the same in any call, split or batch. torch's matmul sums in an order of its
// own choosing, by shape, layout and threads: the decode stack's and the Python path's rotations
// then differed in the last bit, now and then a float16 code.
at::Tensor int4_rotate(const at::Tensor& x, const at::Tensor& rotation, WorkPool* pool) {
  const int64_t hd = x.dim() > 0 ? x.size(-1) : 0;
  TORCH_CHECK(rotation.dim() == 2 && rotation.size(0) == hd && rotation.size(1) == hd &&
                  rotation.scalar_type() == at::kFloat && rotation.is_contiguous(),
              "int4_rotate: the rotation must be a contiguous float32 [head_dim, head_dim] for rows of ", hd);
  const at::Tensor rows = x.to(at::kFloat).contiguous();
  at::Tensor out = at::empty(rows.sizes(), rows.options());
  const float* in = rows.data_ptr<float>();
  const float* r = rotation.data_ptr<float>();
  float* y = out.data_ptr<float>();
  pagedserve::parallel_for(pool, 0, hd > 0 ? rows.numel() / hd : 0, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      float* o = y + row * hd;
      std::fill_n(o, hd, 0.0f);
      for (int64_t j = 0; j < hd; ++j) {
        const float xj = in[row * hd + j];
        for (int64_t d = 0; d < hd; ++d) o[d] += xj * r[j * hd + d];
      }
    }
  });
  return out;
}

at::Tensor int4_rotate_op(const at::Tensor& x, const at::Tensor& rotation) { return int4_rotate(x, rotation, nullptr); }

}  // namespace pagedserve::ops

// The keys of n blocks back as float32 [n, bs, kvh, hd] (kv/int4.py: key_block_values), for prompt
// chunks, which read earlier blocks dequantized: data [n, kvh, hd * bs / 2] bit planes, steps
// [n, kvh, hd] float8 e4m3, zero_points [n, kvh, hd] int8, key_bits [kvh, hd]. The torch path
// spends ~14x the int4 nibbles' time on planes; here a channel's codes are its planes' bits
// shifted into place, one pass over the bytes.
at::Tensor int4_key_values(const at::Tensor& data, const at::Tensor& steps, const at::Tensor& zero_points,
                           const at::Tensor& key_bits) {
  TORCH_CHECK(steps.dim() == 3 && steps.scalar_type() == at::kFloat8_e4m3fn && steps.is_contiguous(),
              "int4_key_values: steps must be contiguous float8_e4m3fn [blocks, kvh, head_dim]");
  const int64_t n = steps.size(0), kvh = steps.size(1), hd = steps.size(2);
  TORCH_CHECK(zero_points.sizes() == steps.sizes() && zero_points.scalar_type() == at::kChar &&
                  zero_points.is_contiguous(), "int4_key_values: zero_points must be contiguous int8 like steps");
  TORCH_CHECK(data.dim() == 3 && data.size(0) == n && data.size(1) == kvh && data.size(2) * 2 % hd == 0 &&
                  data.scalar_type() == at::kByte && data.is_contiguous(),
              "int4_key_values: data must be contiguous uint8 [blocks, kvh, head_dim * bs / 2]");
  const int64_t head_bytes = data.size(2), bs = head_bytes * 2 / hd;
  const std::vector<int32_t> first = pagedserve::first_key_planes(key_bits, kvh, hd, "int4_key_values");
  const uint8_t* bits = key_bits.data_ptr<uint8_t>();
  at::Tensor out = at::empty({n, bs, kvh, hd}, steps.options().dtype(at::kFloat));
  const uint8_t* planes = data.data_ptr<uint8_t>();
  const auto* step_bits = static_cast<const uint8_t*>(steps.data_ptr());
  const int8_t* zeros = zero_points.data_ptr<int8_t>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, n * kvh, 16, [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> code(bs);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / kvh, h = item % kvh;
      const uint8_t* head = planes + item * head_bytes;
      for (int64_t d = 0; d < hd; ++d) {
        const int64_t c = h * hd + d;
        std::fill(code.begin(), code.end(), 0u);
        for (int64_t bit = 0; bit < bits[c]; ++bit) {
          const int64_t at = (first[c] + bit) * bs;  // the plane's first bit
          if (bs % 8 == 0) {  // whole bytes, 8 tokens each: the inner loop vectorizes
            for (int64_t k = 0; k < bs / 8; ++k)
              for (int i = 0; i < 8; ++i) code[8 * k + i] |= static_cast<uint32_t>(head[at / 8 + k] >> i & 1) << bit;
          } else {
            for (int64_t t = 0; t < bs; ++t)
              code[t] |= static_cast<uint32_t>(head[(at + t) / 8] >> ((at + t) % 8) & 1) << bit;
          }
        }
        const float step = static_cast<float>(
            c10::Float8_e4m3fn(step_bits[item * hd + d], c10::Float8_e4m3fn::from_bits()));
        const float zero = zeros[item * hd + d];
        for (int64_t t = 0; t < bs; ++t)
          o[((b * bs + t) * kvh + h) * hd + d] = (static_cast<float>(code[t]) + zero) * step;
      }
    }
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("int4_kv_write(Tensor x, Tensor(a!) tail, Tensor(b!) data, Tensor(c!) scales, Tensor(d!) zero_points, "
        "Tensor key_bits, Tensor full_blocks, Tensor full_slots, Tensor full_rows, Tensor full_tokens, "
        "Tensor tail_rows, Tensor tail_tokens) -> ()");
  m.def("int4_key_values(Tensor data, Tensor steps, Tensor zero_points, Tensor key_bits) -> Tensor");
  m.def("quantized_kv_write(Tensor(a!) data, Tensor(b!) scales, Tensor slots, Tensor x, str kind) -> ()");
  m.def("int4_rotate(Tensor x, Tensor rotation) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("int4_kv_write", &pagedserve::ops::int4_kv_write);
  m.impl("int4_key_values", &int4_key_values);
  m.impl("quantized_kv_write", &pagedserve::ops::quantized_kv_write);
  m.impl("int4_rotate", &pagedserve::ops::int4_rotate_op);
}
