// y = x W^T (+ bias) straight from GGUF's quantized blocks (gguf_formats.h), never dequantized to
// memory, for decode-sized batches; the GEMM of prefill-sized ones in bf16 over the blocks
// dequantized a panel at a time (gguf_gemm.inc, AVX-512 BF16); and the blocks dequantized to a
// float matrix, for torch's GEMM elsewhere and for embedding lookups.
//
// The product is llama.cpp's recipe, written anew: each activation row is quantized per 32 values
// to int8 (scale max|x| / 127), each 32 weights' integers are multiplied with those in int8 x int8
// → int32 instructions (AVX2 maddubs + madd, AVX-512 VNNI vpdpbusd), and the int32 sum is scaled
// once by both scales in float32. A decode step then reads the weights' bytes (4.5-6.6 bits per
// weight) once, and spends a handful of instructions per 32 weights.
//
// Paths (cpu_isa.h): the scalar reference (dequantize a block to float, dot with the dequantized
// activations: the same numbers up to float summation order), AVX2, AVX-512 VNNI and AMX tiles
// (gguf_amx.inc), compiled on every x86 machine and chosen at run time; `isa` names one to force
// it (the tests run each path the CPU can execute).
// Float sums in exactly the order written (the build's -ffast-math lets GCC reassociate them, and it
// did so differently per tile size): a row's result must not depend on the rows beside it.
#pragma GCC optimize("no-fast-math")

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "convert.h"
#include "cpu_isa.h"
#include "gguf_formats.h"
#include "kernel_ops.h"
#include "work_pool.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#define PS_X86 1
#else
#define PS_X86 0
#endif

namespace pagedserve::gguf {

// The activation rows a call works on, quantized per 32: q int8 [rows, K], d and s float [rows, K/32]
// (d the scale, s = d x the sum of the 32 values: the run's sum, for the weights' offsets). Int16
// activations add `low` [rows, K]: a value is then (kLowSteps q + low) d (quantize_row); where the
// path takes them whole (Path::whole, gguf_simd.inc's takes_whole), kLowSteps q + low in `whole`.
struct Rows {
  const int8_t* q;
  const float* d;
  const float* s;
  int64_t q_stride, d_stride;  // between consecutive rows (of q, low and whole; of d and s)
  const int8_t* low = nullptr;
  const int16_t* whole = nullptr;
  // Each 16 values' integer sum (kLowSteps q + low with `low`), 2 d_stride apart: Q6_K's rows16
  // kernel subtracts 32 x it, its weights being q + 32 under a scale per 16.
  const int32_t* sum16 = nullptr;
};

// Weight rows [n0, n1) (`row_bytes` apart from w, `blocks` blocks each) against `rows` (1-4)
// activation rows: y[i ld + n] = activation row i's dot with weight row n + bias[n] (bias may be
// null; i < rows, or rows / 2 with x.pairs). `end` bounds the weight bytes a kernel may prefetch.
using RangeKernel = void (*)(const uint8_t* w, int64_t row_bytes, int64_t blocks, int64_t n0, int64_t n1,
                             const Rows& x, int rows, const float* bias, float* y, int64_t ld, const uint8_t* end);
using QuantizeRow = void (*)(const float* x, int64_t K, int8_t* q, int8_t* low, float* d, float* s);

namespace scalar {

// x [K] → runs of 32 int8 (and with `low`, int16 activations as the high and low bytes): the
// reference every SIMD quantize_row equals bit for bit (gguf_simd.inc says the arithmetic).
void quantize_row(const float* x, int64_t K, int8_t* q, int8_t* low, float* d, float* s) {
  for (int64_t c = 0; c < K / 32; ++c) {
    const float* xc = x + 32 * c;
    float top = 0.f;
    for (int i = 0; i < 32; ++i) top = std::max(top, std::fabs(xc[i]));
    const float scale = activation_scale(top), inv = activation_inverse(top), inv_low = kLowSteps * inv;
    int sum = 0, sum_low = 0;
    for (int i = 0; i < 32; ++i) {
      const int v = static_cast<int>(std::nearbyint(xc[i] * inv));
      q[32 * c + i] = static_cast<int8_t>(v);
      sum += v;
      if (low != nullptr) {
        const float left = std::fma(-scale, static_cast<float>(v), xc[i]);
        const int l = std::clamp(static_cast<int>(std::nearbyint(left * inv_low)), -127, 127);
        low[32 * c + i] = static_cast<int8_t>(l);
        sum_low += l;
      }
    }
    if (low == nullptr) {
      d[c] = scale;
      s[c] = scale * static_cast<float>(sum);
    } else {
      d[c] = scale / kLowSteps;
      s[c] = d[c] * static_cast<float>(kLowSteps * sum + sum_low);
    }
  }
}

template <Format F>
void dot_rows(const uint8_t* w, int64_t blocks, const Rows& x, int rows, float* out) {
  const FormatInfo fi = info(F);
  float wf[256];
  for (int r = 0; r < rows; ++r) out[r] = 0.f;
  for (int64_t b = 0; b < blocks; ++b) {
    dequantize_row_block(F, w, blocks, b, wf);
    for (int r = 0; r < rows; ++r) {
      for (int c = 0; c < fi.elems / 32; ++c) {
        const int64_t run = b * (fi.elems / 32) + c;
        const int8_t* xq = x.q + r * x.q_stride + 32 * run;
        const int8_t* xl = x.low ? x.low + r * x.q_stride + 32 * run : nullptr;
        float dot = 0.f;
        for (int i = 0; i < 32; ++i) {
          const int v = xl ? kLowSteps * xq[i] + xl[i] : xq[i];
          dot += wf[32 * c + i] * static_cast<float>(v);
        }
        out[r] += dot * x.d[r * x.d_stride + run];
      }
    }
  }
}

template <Format F>
void dot_range(const uint8_t* w, int64_t row_bytes, int64_t blocks, int64_t n0, int64_t n1, const Rows& x, int rows,
               const float* bias, float* y, int64_t ld, const uint8_t*) {
  float dots[4];
  for (int64_t n = n0; n < n1; ++n) {
    dot_rows<F>(w + n * row_bytes, blocks, x, rows, dots);
    for (int i = 0; i < rows; ++i) y[i * ld + n] = dots[i] + (bias ? bias[n] : 0.f);
  }
}

RangeKernel range_kernel(Format f) {
  switch (f) {
    case Format::q4_0: return &dot_range<Format::q4_0>;
    case Format::q4_1: return &dot_range<Format::q4_1>;
    case Format::q5_0: return &dot_range<Format::q5_0>;
    case Format::q5_1: return &dot_range<Format::q5_1>;
    case Format::q8_0: return &dot_range<Format::q8_0>;
    case Format::q4_k: return &dot_range<Format::q4_k>;
    case Format::q5_k: return &dot_range<Format::q5_k>;
    case Format::q6_k: return &dot_range<Format::q6_k>;
  }
  return nullptr;
}

}  // namespace scalar

// How many tasks a matmul of M activation rows over an [N, K] weight splits into: one per ~256k
// multiply-adds (weights x quantized rows, int16 rows counting twice), 8 to 64 of them. A batch's
// matmul is then split finely enough that its last task does not keep the other threads waiting
// (with the pool's default 8, the master thread of a 16-stream decode spent 6 % of its time waiting
// at the end of each matmul).
// Rows [0, M) in blocks of at most `max_rows`, as even as that allows (13 rows under 12: 7 + 6, not
// 12 + 1), each block's first row and row count to fn, in order: the prefill GEMMs' micro-kernels
// (gguf_gemm.inc, gguf_gemm_f32.inc) take a block each.
template <typename Fn>
void for_row_blocks(int64_t M, int64_t max_rows, Fn&& fn) {
  const int64_t blocks = (M + max_rows - 1) / max_rows;
  for (int64_t b = 0, r0 = 0; b < blocks; ++b) {
    const int64_t n = (M - r0) / (blocks - b);  // the remaining rows over the remaining blocks
    fn(r0, n);
    r0 += n;
  }
}

int64_t matmul_tasks(int64_t N, int64_t K, int64_t M, bool wide) {
  return std::clamp<int64_t>(N * K * std::min<int64_t>(M * (wide ? 2 : 1), 64) / (1 << 18), 8, 64);
}

#if PS_X86
// The SIMD helpers are small and called per 32 weights: forced inline, since a call would move the
// accumulators through memory (GCC left some of them out of line on its own budget).
#define PS_INLINE inline __attribute__((always_inline))
#define PS_INLINE_LAMBDA __attribute__((always_inline))
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
#define PS_VNNI 0
#include "gguf_simd.inc"
#include "gguf_gemm_f32.inc"
#include "gguf_gemm_int.inc"
#undef PS_VNNI
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
namespace avx512 {
#define PS_VNNI 1
#include "gguf_simd.inc"
#include "gguf_gemm_f32.inc"
#undef PS_VNNI
}  // namespace avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx512bf16,avx2,fma,f16c")
namespace avx512bf16 {
#include "gguf_gemm.inc"
}  // namespace avx512bf16
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
namespace amx {
#include "gguf_amx.inc"
}  // namespace amx
#pragma GCC pop_options
#endif

struct Path {
  RangeKernel kernel;
  QuantizeRow quantize;
  bool pairs = false;  // int8 activations: the kernel wants each pair of runs swizzled (pairs_swizzled)
  bool whole = false;  // int16 activations: the kernel takes them whole (Rows::whole)
  bool sums16 = false;  // the kernel wants each 16 values' sum (Rows::sum16)
};

Path path_for(Isa isa, Format f) {
#if PS_X86
  if (isa == Isa::amx) return {nullptr, &avx512::quantize_row};  // the tiles take q and low as they are
  if (isa == Isa::avx512) return {avx512::range_kernel(f), &avx512::quantize_row, pairs_swizzled(f), avx512::takes_whole(f)};
  if (isa == Isa::avx2) return {avx2::range_kernel(f), &avx2::quantize_row, pairs_swizzled(f), avx2::takes_whole(f)};
#endif
  return {scalar::range_kernel(f), &scalar::quantize_row};
}

// A quantized row's runs put in planar_pair's order: in every whole pair of 32-value runs, values
// 16-31 of the first trade places with values 0-15 of the second (an odd last run stays as it is).
void swizzle_pairs(int8_t* q, int64_t K) {
  for (int64_t c = 0; c + 64 <= K; c += 64) std::swap_ranges(q + c + 16, q + c + 32, q + c + 32);
}

// Rows of x [M, K] in float32: x itself, or `buffer` (x.numel() floats) with rows [m0, m1) converted
// into it (each quantizing task converts its own rows: on the caller alone, 16 rows' conversion
// was 1.3 % of a 16-stream step's samples, the pool's worker waiting through it).
const float* float_rows(const at::Tensor& x, float* buffer, int64_t m0, int64_t m1) {
  const float* out = nullptr;
  dispatch_model_dtype(x.scalar_type(), "gguf_matmul", [&](auto tag) {
    using T = decltype(tag);
    if constexpr (std::is_same_v<T, float>) {
      out = x.data_ptr<float>();
    } else {
      const int64_t K = x.size(1);
      const T* src = x.data_ptr<T>();
      for (int64_t i = m0 * K; i < m1 * K; ++i) buffer[i] = to_float(src[i]);
      out = buffer;
    }
  });
  return out;
}

// The bias [N] a matmul call adds, if any.
void check_bias(const std::optional<at::Tensor>& bias, int64_t N, const char* op) {
  if (bias) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N, op,
                ": bias must be a contiguous float32 [out_features]");
  }
}

// The output [M, N] (float32, unit column stride: it may be a column slice of a wider one) and the
// bias [N] a matmul call writes and adds.
void check_output(const at::Tensor& out, const std::optional<at::Tensor>& bias, int64_t M, int64_t N, const char* op) {
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.size(0) == M && out.size(1) == N &&
                  out.stride(1) == 1 && out.stride(0) >= N,
              op, ": out must be a float32 [rows, out_features] with unit column stride");
  check_bias(bias, N, op);
}

// Where a call also writes its output rounded to a model dtype (the decode stack's bf16 / f16
// activations), as torch's .to() rounds: each task rounds the columns it computed while they are
// in its cache. Why: one pass after the call ran on the calling thread alone, over values half of
// which the other core had just written: 0.9 ms of a ~25 ms 16-stream step, the pool's worker idle.
class RoundedOutput {
 public:
  RoundedOutput(at::Tensor* rounded, int64_t M, int64_t N, const char* op) {
    if (rounded == nullptr) return;
    const at::ScalarType t = rounded->scalar_type();
    TORCH_CHECK(rounded->dim() == 2 && rounded->size(0) == M && rounded->size(1) == N && rounded->stride(1) == 1 &&
                    (t == at::kBFloat16 || t == at::kHalf || t == at::kFloat),
                op, ": the rounded output must be a [rows, out_features] model dtype with unit column stride");
    data_ = rounded->data_ptr();
    ld_ = rounded->stride(0);
    dtype_ = t;
  }

  // y's rows [m0, m1) x columns [c0, c1) (y's row stride ld), rounded into the output.
  void round(const float* y, int64_t ld, int64_t m0, int64_t m1, int64_t c0, int64_t c1) const {
    if (data_ == nullptr || c0 >= c1) return;
    dispatch_model_dtype(dtype_, "RoundedOutput", [&](auto tag) {
      using T = decltype(tag);
      T* to = static_cast<T*>(data_);
      for (int64_t m = m0; m < m1; ++m) convert_row(to + m * ld_ + c0, y + m * ld + c0, c1 - c0);
    });
  }

  // All of y's M rows and N columns, split by rows over `pool`: after a kernel that has no tasks
  // of columns (the AMX tiles).
  void round_all(const float* y, int64_t ld, int64_t M, int64_t N, WorkPool* pool) const {
    if (data_ == nullptr) return;
    pagedserve::parallel_rows(pool, M, N, [&](int64_t m0, int64_t m1) { round(y, ld, m0, m1, 0, N); });
  }

 private:
  void* data_ = nullptr;
  int64_t ld_ = 0;
  at::ScalarType dtype_ = at::kFloat;
};

// The activation rows x [M, K] quantized per 32 for `path` (int16 with `residual`: each value's int8
// and the int8 of its remainder, or where the path takes them whole kLowSteps q + low as int16;
// int8 pair-swizzled where it wants that), and the Rows view of row m onwards.
struct QuantizedRows {
  int64_t K, runs;
  bool whole, sums16;
  // One allocation a call for all of it (x's float32 copy, the planes, the scales): a decode token
  // makes ~120 of these calls, and five allocations each kept glibc's malloc consolidating its
  // free lists (~4 % of a decode profile). Every element is written before it is read: allocated,
  // not zeroed (a 16-row step's zeroing of these showed as 0.6 % of its samples in memset).
  std::unique_ptr<std::byte[]> memory;
  int8_t* q;
  int8_t* low = nullptr;
  int16_t* values = nullptr;
  int32_t* sum16 = nullptr;
  float* d;
  float* s;

  QuantizedRows(const at::Tensor& x, const Path& path, bool residual, WorkPool* pool)
      : K(x.size(1)), runs(K / 32), whole(residual && path.whole), sums16(path.sums16) {
    const int64_t M = x.size(0), n = M * K;
    const bool convert = x.scalar_type() != at::kFloat;
    // float32 and int16 parts first, so every part stays aligned to its element
    memory = std::make_unique_for_overwrite<std::byte[]>((convert ? 4 * n : 0) + 8 * M * runs + (sums16 ? 8 * M * runs : 0) +
                                                         (whole ? 2 * n : 0) + (residual ? 2 * n : n));
    std::byte* next = memory.get();
    auto take = [&](int64_t bytes) { std::byte* part = next; next += bytes; return part; };
    float* buffer = convert ? reinterpret_cast<float*>(take(4 * n)) : nullptr;
    d = reinterpret_cast<float*>(take(4 * M * runs));
    s = reinterpret_cast<float*>(take(4 * M * runs));
    if (sums16) sum16 = reinterpret_cast<int32_t*>(take(8 * M * runs));
    if (whole) values = reinterpret_cast<int16_t*>(take(2 * n));
    q = reinterpret_cast<int8_t*>(take(n));
    if (residual) low = reinterpret_cast<int8_t*>(take(n));
    pagedserve::parallel_for(pool, 0, M, std::max<int64_t>(1, 8192 / K), [&](int64_t m0, int64_t m1) {
      const float* xf = float_rows(x, buffer, m0, m1);
      for (int64_t m = m0; m < m1; ++m) {
        int8_t* qm = q + m * K;
        int8_t* lm = low ? low + m * K : nullptr;
        path.quantize(xf + m * K, K, qm, lm, d + m * runs, s + m * runs);
        if (whole) {
          for (int64_t i = 0; i < K; ++i) values[m * K + i] = static_cast<int16_t>(kLowSteps * qm[i] + lm[i]);
        } else if (path.pairs) {  // int8 activations (int16 ones go whole where a path pairs)
          swizzle_pairs(qm, K);
        }
        for (int64_t i = 0; sums16 && i < 2 * runs; ++i) {
          int32_t sum = 0;
          for (int t = 16 * i; t < 16 * i + 16; ++t) sum += lm ? kLowSteps * qm[t] + lm[t] : qm[t];
          sum16[m * 2 * runs + i] = sum;
        }
      }
    });
  }
  Rows at(int64_t m) const {
    return Rows{q + m * K, d + m * runs, s + m * runs, K, runs, low ? low + m * K : nullptr,
                whole ? values + m * K : nullptr, sums16 ? sum16 + 2 * m * runs : nullptr};
  }
};

// What a matmul call reads and writes: the activations quantized for `path`, the bias, the weight's
// bytes and the output rows.
struct Operands {
  QuantizedRows xq;
  const float* bias;
  const uint8_t* w;
  float* y;
  int64_t ld;
  Operands(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& b,
           const Path& path, bool residual, WorkPool* pool)
      : xq(x, path, residual, pool), bias(b ? b->data_ptr<float>() : nullptr), w(weight.data_ptr<uint8_t>()),
        y(out.data_ptr<float>()), ld(out.stride(0)) {}
};

constexpr int kTile = 4;          // activation rows sharing one unpacked weight run
constexpr int64_t kRowSpan = 16;  // weight rows a batch's tiles take in turn, while they stay in L1

// out [M, N] (float32; rows may be strided, a column slice of a wider output) = x [M, K] W^T (+ bias),
// W [N, row bytes] the format's blocks.
//
// `residual`: int16 activations, x ≈ (254 q + low) d / 254 with low the int8 value of what q left
// over: the integer kernel takes both bytes against each unpacked weight run and joins their sums
// in int32, so ~16 bits of activation precision cost a second maddubs per run, not a second row.
// An LM head takes it: int8 activations there moved SmolLM2's logits by up to ~0.05 and flipped a
// near-tie ("The" / "L" before "Paris").
void gguf_matmul(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, c10::string_view format,
                 const std::optional<at::Tensor>& bias, bool residual, c10::string_view isa_name, WorkPool* pool,
                 at::Tensor* rounded) {
  const char* op = "gguf_matmul";
  const Format f = parse_format(std::string_view(format.data(), format.size()), op);
  const Isa isa = parse_isa(std::string_view(isa_name.data(), isa_name.size()), op, /*tiles=*/true);
  const FormatInfo fi = info(f);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), op, ": x must be a contiguous [rows, in_features]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % fi.elems == 0, op, ": in_features ", K, " is not a multiple of ", fi.name, "'s block of ", fi.elems);
  const int64_t blocks = K / fi.elems, row_bytes = blocks * fi.bytes;
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() && w.size(1) == row_bytes, op,
              ": weight must be a contiguous uint8 [out_features, ", row_bytes, "] of ", fi.name,
              " blocks (planes for 32-weight formats: gguf_formats.h)");
  check_output(out, bias, M, N, op);
  const RoundedOutput round(rounded, M, N, op);
  if (M == 0 || N == 0) return;
  // On an AMX CPU, batches of more than kMaxVectorRows rows go to the tiles; decode rows keep the
  // AVX-512 path (one row, SmolLM2's default file, 2 threads: 110-114 tok/s through the tiles'
  // unpacking and a vector form of their sums, since removed, against 168-183).
#if PS_X86
  const bool tiles = isa == Isa::amx && M > amx::kMaxVectorRows;
#else
  const bool tiles = false;
#endif
  const Path path = path_for(tiles ? Isa::amx : vector_isa(isa), f);
  const Operands in(out, x, w, bias, path, residual, pool);
  const QuantizedRows& xq = in.xq;
  const float* bp = in.bias;
  const uint8_t* wp = in.w;
  float* y = in.y;
  const int64_t ld = in.ld;
#if PS_X86
  if (tiles) {
    amx::matmul(f, wp, row_bytes, blocks, N, K, M, xq.at(0), bp, y, ld, pool);
    return round.round_all(y, ld, M, N, pool);
  }
#endif
  // Tasks of at least ~32k weights: a small matrix is not split into slivers that cost more to
  // schedule than to compute; on the decode stack's pool, matmul_tasks of them.
  pagedserve::parallel_for(pool, 0, N, std::max<int64_t>(1, 32768 / K), [&](int64_t n0, int64_t n1) {
    const uint8_t* task_end = wp + n1 * row_bytes;
    for (int64_t a = n0; a < n1; a += kRowSpan) {
      const int64_t b = std::min(n1, a + kRowSpan);
      for (int64_t m = 0; m < M; m += kTile) {
        const int rows = static_cast<int>(std::min<int64_t>(kTile, M - m));
        path.kernel(wp, row_bytes, blocks, a, b, xq.at(m), rows, bp, y + m * ld, ld, task_end);
      }
    }
    round.round(y, ld, 0, M, n0, n1);
  }, matmul_tasks(N, K, M, residual));
}

// The registered op: torch's threads.
void gguf_matmul_op(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, c10::string_view format,
                    const std::optional<at::Tensor>& bias, bool residual, c10::string_view isa_name,
                    const std::optional<at::Tensor>& rounded) {
  at::Tensor into = rounded.value_or(at::Tensor());
  gguf_matmul(out, x, w, format, bias, residual, isa_name, nullptr, rounded ? &into : nullptr);
}

// The rows16 layout's checks: its format, and the weight [ceil(N / 16), blocks x block bytes].
Format rows16_format(const at::Tensor& w, c10::string_view format, int64_t N, int64_t K, const char* op) {
  const Format f = parse_format(std::string_view(format.data(), format.size()), op);
  const FormatInfo fi = info(f);
  TORCH_CHECK(K % fi.elems == 0, op, ": in_features ", K, " is not a multiple of ", fi.name, "'s block of ", fi.elems);
  const int64_t bytes = K / fi.elems * rows16_block_bytes(f);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() && w.size(0) == (N + 15) / 16 &&
                  w.size(1) == bytes,
              op, ": weight must be a contiguous uint8 [", (N + 15) / 16, ", ", bytes, "] in the rows16 layout (gguf_formats.h)");
  return f;
}

// The planar layout's checks: its format, and the weight [N, K / block weights x block bytes].
Format planar_format(const at::Tensor& w, c10::string_view format, int64_t N, int64_t K, const char* op) {
  const Format f = parse_format(std::string_view(format.data(), format.size()), op);
  const FormatInfo fi = info(f);
  TORCH_CHECK(K % fi.elems == 0, op, ": in_features ", K, " is not a multiple of ", fi.name, "'s block of ", fi.elems);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() && w.size(0) == N &&
                  w.size(1) == K / fi.elems * fi.bytes,
              op, ": weight must be a contiguous uint8 [", N, ", ", K / fi.elems * fi.bytes, "] of ", fi.name, " blocks");
  return f;
}

// How a rows16 call computes a group of 16 weight rows against up to 4 activation rows at a time (8
// for Q5_0 / Q5_1 on VNNI: rows16_max_rows). The group kernels (AVX-512 VNNI; AVX2 for Q4_0 / Q4_1)
// read the layout as it lies; other paths (scalar; AVX2's other formats) rewrite each group as 16
// rows of their own layout for their own kernel.
struct Rows16Plan {
  Format f;
  int64_t N, blocks, group_bytes, row_bytes;
  void (*group_kernel)(const uint8_t*, int64_t, const Rows&, int, float (*)[16]) = nullptr;
  int max_rows = 4;  // activation rows a group kernel call takes at most (rows16_max_rows)
  Path path;

  Rows16Plan(const at::Tensor& w, c10::string_view format, int64_t N_, int64_t K, Isa isa, bool residual, const char* op)
      : f(rows16_format(w, format, N_, K, op)), N(N_), blocks(K / info(f).elems), group_bytes(w.size(1)),
        row_bytes(blocks * info(f).bytes), path(path_for(isa, f)) {
#if PS_X86
    if (isa == Isa::avx512) {
      group_kernel = avx512::rows16_kernel(f, residual);
      max_rows = avx512::rows16_max_rows(f);
    }
    if (isa == Isa::avx2) {
      group_kernel = avx2::rows16_kernel(f, residual);
      max_rows = avx2::rows16_max_rows(f);
    }
#endif
    // The group kernels and the tiles take both int8 planes in their own order; the others their
    // path's activations.
    if (group_kernel != nullptr) path.pairs = path.whole = false;
    path.sums16 = group_kernel != nullptr && f == Format::q6_k;
  }

  // A scratch for one task's planar rewrites (empty where the group kernel reads the layout).
  std::vector<uint8_t> scratch() const { return std::vector<uint8_t>(group_kernel ? 0 : 16 * row_bytes); }

  // Group g's rows against activation rows [m0, m1), max_rows at a time while that many are left,
  // then up to 4, into y (row m at y + m ld, the group's first output at column 16 g) + bias.
  void group(const uint8_t* w, int64_t g, const QuantizedRows& xq, int64_t m0, int64_t m1, const float* bias, float* y,
             int64_t ld, std::vector<uint8_t>& planar) const {
    const uint8_t* bytes = w + g * group_bytes;
    const int64_t n0 = 16 * g, width = std::min<int64_t>(16, N - n0);
    if (group_kernel == nullptr) rows16_to_planar(f, bytes, blocks, planar.data());
    for (int64_t m = m0, rows = 0; m < m1; m += rows) {
      rows = m1 - m >= max_rows ? max_rows : std::min<int64_t>(4, m1 - m);
      if (group_kernel == nullptr) {
        path.kernel(planar.data(), row_bytes, blocks, 0, width, xq.at(m), static_cast<int>(rows),
                    bias ? bias + n0 : nullptr, y + m * ld + n0, ld, planar.data() + 16 * row_bytes);
        continue;
      }
      float dots[8][16];
      group_kernel(bytes, blocks, xq.at(m), static_cast<int>(rows), dots);
      for (int r = 0; r < rows; ++r)
        for (int64_t i = 0; i < width; ++i) y[(m + r) * ld + n0 + i] = dots[r][i] + (bias ? bias[n0 + i] : 0.f);
    }
  }
};

// out [M, N] (float32, unit column stride) = x [M, K] W^T (+ bias), W in the rows16 layout
// (gguf_formats.h). The AVX-512 VNNI path, and the AVX2 one for Q4_0 / Q4_1, run rows16_group over
// 16 weight rows and up to 4 activation rows at a time (Rows16Plan), with the same bits; on an AMX CPU, Q8_0
// calls of 8 rows or more go to the tiles, which read the layout as their B operand and give the
// VNNI path's results bit for bit; the other paths rewrite each group as 16 planar rows and run
// their own kernel over them, so the layout computes the same products everywhere (tested against
// each other and the float matmul).
void gguf_matmul16(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, c10::string_view format,
                   const std::optional<at::Tensor>& bias, bool residual, c10::string_view isa_name, WorkPool* pool,
                   at::Tensor* rounded) {
  const char* op = "gguf_matmul16";
  const Isa requested = parse_isa(std::string_view(isa_name.data(), isa_name.size()), op, /*tiles=*/true);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), op, ": x must be a contiguous [rows, in_features]");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  const Rows16Plan plan(w, format, N, K, vector_isa(requested), residual, op);
  check_output(out, bias, M, N, op);
  const RoundedOutput round(rounded, M, N, op);
  if (M == 0 || N == 0) return;
  const Operands in(out, x, w, bias, plan.path, residual, pool);
#if PS_X86
  if (requested == Isa::amx && amx::rows16_tiles(plan.f, M)) {
    amx::matmul16(in.w, plan.group_bytes, plan.blocks, N, K, M, in.xq.at(0), in.bias, in.y, in.ld, pool);
    return round.round_all(in.y, in.ld, M, N, pool);
  }
#endif
  pagedserve::parallel_for(pool, 0, w.size(0), std::max<int64_t>(1, 2048 / K), [&](int64_t g0, int64_t g1) {
    std::vector<uint8_t> planar = plan.scratch();
    for (int64_t g = g0; g < g1; ++g) plan.group(in.w, g, in.xq, 0, M, in.bias, in.y, in.ld, planar);
    round.round(in.y, in.ld, 0, M, 16 * g0, std::min(N, 16 * g1));
  });
}

// Only some (activation row, group) pairs of gguf_matmul16: pairs [P, 2] int32 (row m, group g)
// writes out[m, 16 g .. 16 g + 15] (the columns that exist) and nothing else; each the value
// gguf_matmul16 gives it, to the bit (a row's sums do not depend on the rows or groups beside it;
// the tiles give the vector path's bits). An LM head's screen (gguf_head_screen.cpp) computes its
// candidates so.
void gguf_matmul16_pairs(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, c10::string_view format,
                         const at::Tensor& pairs, bool residual, c10::string_view isa_name, WorkPool* pool) {
  const char* op = "gguf_matmul16_pairs";
  const Isa requested = parse_isa(std::string_view(isa_name.data(), isa_name.size()), op, /*tiles=*/true);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), op, ": x must be a contiguous [rows, in_features]");
  TORCH_CHECK(pairs.dim() == 2 && pairs.size(1) == 2 && pairs.scalar_type() == at::kInt && pairs.is_contiguous(), op,
              ": pairs must be a contiguous int32 [P, 2] of (row, group)");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1), P = pairs.size(0);
  const Rows16Plan plan(w, format, N, K, vector_isa(requested), residual, op);
  check_output(out, std::nullopt, M, N, op);
  const int32_t* pair = pairs.data_ptr<int32_t>();
  for (int64_t p = 0; p < P; ++p) {
    TORCH_CHECK(pair[2 * p] >= 0 && pair[2 * p] < M && pair[2 * p + 1] >= 0 && pair[2 * p + 1] < w.size(0), op,
                ": pair ", p, " (", pair[2 * p], ", ", pair[2 * p + 1], ") is outside ", M, " rows and ", w.size(0),
                " groups");
  }
  if (P == 0) return;
  const Operands in(out, x, w, std::nullopt, plan.path, residual, pool);
  pagedserve::parallel_for(pool, 0, P, 4, [&](int64_t p0, int64_t p1) {
    std::vector<uint8_t> planar = plan.scratch();
    for (int64_t p = p0; p < p1; ++p)
      plan.group(in.w, pair[2 * p + 1], in.xq, pair[2 * p], pair[2 * p] + 1, nullptr, in.y, in.ld, planar);
  });
}

// The registered op: torch's threads.
void gguf_matmul16_pairs_op(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, c10::string_view format,
                            const at::Tensor& pairs, bool residual, c10::string_view isa_name) {
  gguf_matmul16_pairs(out, x, w, format, pairs, residual, isa_name, nullptr);
}

// The registered op: torch's threads.
void gguf_matmul16_op(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, c10::string_view format,
                      const std::optional<at::Tensor>& bias, bool residual, c10::string_view isa_name,
                      const std::optional<at::Tensor>& rounded) {
  at::Tensor into = rounded.value_or(at::Tensor());
  gguf_matmul16(out, x, w, format, bias, residual, isa_name, nullptr, rounded ? &into : nullptr);
}

// out [N, K] (float32, bfloat16 or float16) = a rows16 weight's blocks dequantized straight from
// the groups, a group at a time on the SIMD paths (gguf_simd.inc's dequantize_group); with `ids`
// [n] (int64), out [n, K] = those rows only (a quantized embedding's lookups: each id's bytes out
// of its group, not the group's 16 rows), row by row. Every path gives the same bits.
void gguf_dequantize16(at::Tensor& out, const at::Tensor& w, c10::string_view format,
                       const std::optional<at::Tensor>& ids, c10::string_view isa_name) {
  const char* op = "gguf_dequantize16";
  const Isa isa = parse_isa(std::string_view(isa_name.data(), isa_name.size()), op);
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous(), op, ": out must be a contiguous [rows, in_features]");
  // With ids the weight's row count is not given: its groups' 16 rows each (the last padded).
  const int64_t K = out.size(1), rows = ids ? 16 * w.size(0) : out.size(0);
  const Format f = rows16_format(w, format, rows, K, op);
  const int elems = info(f).elems;
  const int64_t blocks = K / elems;
  const int64_t* id = nullptr;
  if (ids) {
    TORCH_CHECK(ids->scalar_type() == at::kLong && ids->dim() == 1 && ids->is_contiguous() && ids->numel() == out.size(0),
                op, ": ids must be a contiguous int64 [rows of out]");
    id = ids->data_ptr<int64_t>();
    for (int64_t i = 0; i < ids->numel(); ++i)
      TORCH_CHECK(id[i] >= 0 && id[i] < rows, op, ": row id ", id[i], " is outside the weight's ", rows, " rows");
  }
  const uint8_t* wp = w.data_ptr<uint8_t>();
  dispatch_model_dtype(out.scalar_type(), op, [&](auto tag) {
    using T = decltype(tag);
    T* o = out.data_ptr<T>();
#if PS_X86
    if (!id && isa != Isa::scalar) {
      const auto group = isa == Isa::avx512 ? &avx512::dequantize_group<T> : &avx2::dequantize_group<T>;
      // ~32k values a task, as below (16 rows a group)
      at::parallel_for(0, w.size(0), std::max<int64_t>(1, 2048 / K), [&](int64_t g0, int64_t g1) {
        for (int64_t g = g0; g < g1; ++g)
          group(f, wp + g * w.size(1), blocks, static_cast<int>(std::min<int64_t>(16, rows - 16 * g)), o + 16 * g * K, K);
      });
      return;
    }
#endif
    // A decode step's lookups (up to ~256k values: 455 rows of 576) stay on the calling thread: an
    // OpenMP region would wake OpenMP's worker, which then spins on the core the decode stack's pool
    // computes on (64 streams of the default file: 0.63x the speed with the region).
    const int64_t grain = std::max<int64_t>(1, (id ? 262144 : 32768) / K);
    at::parallel_for(0, out.size(0), grain, [&](int64_t i0, int64_t i1) {
      float buf[256];
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t n = id ? id[i] : i;
        for (int64_t b = 0; b < blocks; ++b) {
          dequantize_rows16_block(f, wp + n / 16 * w.size(1), b, static_cast<int>(n % 16), buf);
          T* ob = o + i * K + elems * b;
          for (int j = 0; j < elems; ++j) ob[j] = from_float<T>(buf[j]);
        }
      }
    });
  });
}

// out [N, K] (float32, bfloat16 or float16) = the weight's blocks dequantized (a row at a time on
// the SIMD paths: gguf_simd.inc's dequantize_rows; the same bits).
void gguf_dequantize(at::Tensor& out, const at::Tensor& w, c10::string_view format, c10::string_view isa_name) {
  const char* op = "gguf_dequantize";
  const Isa isa = parse_isa(std::string_view(isa_name.data(), isa_name.size()), op);
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous(), op, ": out must be a contiguous [rows, in_features]");
  const int64_t N = out.size(0), K = out.size(1);
  const Format f = planar_format(w, format, N, K, op);
  const FormatInfo fi = info(f);
  const int64_t blocks = K / fi.elems;
  const uint8_t* wp = w.data_ptr<uint8_t>();
  dispatch_model_dtype(out.scalar_type(), op, [&](auto tag) {
    using T = decltype(tag);
    T* o = out.data_ptr<T>();
#if PS_X86
    if (isa != Isa::scalar) {
      const auto rows = isa == Isa::avx512 ? &avx512::dequantize_rows<T> : &avx2::dequantize_rows<T>;
      at::parallel_for(0, N, std::max<int64_t>(1, 32768 / K), [&](int64_t n0, int64_t n1) {
        rows(f, wp, w.size(1), blocks, n0, n1, o, K);
      });
      return;
    }
#endif
    // Split only above 32k values: a decode step's embedding lookups (up to 56 rows of 576) stay on
    // the calling thread, outside OpenMP, whose worker would then spin on the core the decode
    // stack's pool thread needs (work_pool.h); a prefill chunk's lookups and whole weights split.
    at::parallel_for(0, N * blocks, std::max<int64_t>(1, 32768 / fi.elems), [&](int64_t b0, int64_t b1) {
      float buf[256];
      for (int64_t b = b0; b < b1; ++b) {
        dequantize_row_block(f, wp + b / blocks * blocks * fi.bytes, blocks, b % blocks, buf);
        T* ob = o + b * fi.elems;
        for (int i = 0; i < fi.elems; ++i) ob[i] = from_float<T>(buf[i]);
      }
    });
  });
}

// out [M, N] (float32, unit column stride: it may be a column slice of a wider one) = x [M, K]
// (float32) W^T (+ bias), W in the rows16 layout (`rows16`) or planar, through the integers
// (gguf_gemm_int.inc, AVX2): `residual`, x quantized to the int16 activations (kLowSteps q + low)
// and each panel of 16 weight rows' integers widened to int16 once for every row of the chunk;
// else to int8 ones against the panel's weight bytes (maddubs), which only formats whose weights
// are unsigned and of at most 5 bits allow (int8_gemm_takes: not Q8_0, not Q6_K). "scalar" is the
// reference, the scalar integer kernel over the same activations (gguf_matmul / gguf_matmul16):
// the same products up to float summation order. gguf_gemm's "auto" takes float32 x here on the
// AVX2 path (int8: where the format allows; int16: where int16_gemm_pays).
void gguf_gemm_int(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, c10::string_view format,
                   const std::optional<at::Tensor>& bias, bool rows16, bool residual, c10::string_view isa_name,
                   WorkPool* pool) {
  const char* op = residual ? "gguf_gemm_int16" : "gguf_gemm_int8";
  const std::string_view name(isa_name.data(), isa_name.size());
  // Two paths: AVX2 ("auto" wherever the CPU runs it, AVX-512 CPUs included) and the scalar reference
  const Isa isa = parse_isa(name, op) == Isa::scalar ? Isa::scalar : Isa::avx2;
  TORCH_CHECK(name == "auto" || name == "scalar" || name == "avx2", op, ": its paths are scalar and avx2, not ", name);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat, op,
              ": x must be a contiguous float32 [rows, in_features]");
  const int64_t M = x.size(0), K = x.size(1), N = out.dim() == 2 ? out.size(1) : 0;
  const Format f = rows16 ? rows16_format(w, format, N, K, op) : planar_format(w, format, N, K, op);
#if PS_X86
  TORCH_CHECK(residual || avx2::int8_gemm_takes(f), op, ": ", info(f).name,
              "'s signed weights overflow maddubs; its int8 activations take gguf_matmul's kernels");
#endif
  if (isa == Isa::scalar) {
    return rows16 ? gguf_matmul16(out, x, w, format, bias, residual, "scalar", pool)
                  : gguf_matmul(out, x, w, format, bias, residual, "scalar", pool);
  }
  check_output(out, bias, M, N, op);
  if (M == 0 || N == 0) return;
#if PS_X86
  const Path path{nullptr, &avx2::quantize_row, false, /*whole=*/residual};
  const Operands in(out, x, w, bias, path, residual, pool);
  avx2::gemm_int(f, residual, rows16, in.w, w.size(1), N, K, in.xq.at(0), M, in.bias, in.y, in.ld, pool);
#endif
}

// gguf_gemm's reference: the weight dequantized as gguf_dequantize does, rounded to bfloat16 for
// bfloat16 x (as that kernel reads it), each product summed in float32 in k order.
template <typename X, typename T>
void gemm_reference(Format f, bool rows16, const uint8_t* wp, int64_t stride, int64_t N, int64_t K, const X* xp,
                    int64_t M, const float* b, T* o, int64_t ldo, WorkPool* pool) {
  const int elems = info(f).elems;
  const int64_t blocks = K / elems;
  std::vector<float> wf(N * K);
  pagedserve::parallel_for(pool, 0, N, 1, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t blk = 0; blk < blocks; ++blk) {
        float* y = wf.data() + n * K + blk * elems;
        if (rows16)
          dequantize_rows16_block(f, wp + n / 16 * stride, blk, static_cast<int>(n % 16), y);
        else
          dequantize_row_block(f, wp + n * stride, blocks, blk, y);
        if constexpr (std::is_same_v<X, c10::BFloat16>)
          for (int j = 0; j < elems; ++j) y[j] = round_to<c10::BFloat16>(y[j]);
      }
  });
  pagedserve::parallel_for(pool, 0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t n = 0; n < N; ++n) {
        float sum = 0.f;
        for (int64_t k = 0; k < K; ++k) sum += to_float(xp[m * K + k]) * wf[n * K + k];
        o[m * ldo + n] = from_float<T>(sum + (b ? b[n] : 0.f));
      }
  });
}

// out [M, N] (unit column stride: it may be a column slice of a wider one) = x [M, K] W^T (+ bias),
// W in the rows16 layout (`rows16`) or planar: a prompt chunk's GEMM. x in bfloat16 (out bfloat16
// or float32): gguf_gemm.inc's kernel, which needs AVX-512 BF16 (where GGUFLinear calls it:
// gguf_gemm_usable, which leaves AMX-BF16 CPUs to torch's GEMM). x in float32 (out float32):
// gguf_gemm_f32.inc's, on the AVX2 or the AVX-512 path ("auto": the CPU's best; "amx" runs the
// AVX-512 one), except that "auto" on the AVX2 path hands the calls to gguf_gemm_int, whose
// activations are the integer kernels' (`residual`: int16, near-float, where int16_gemm_pays; else
// int8 where int8_gemm_takes the format, and int16 for the others), not float32's bits. "scalar"
// the reference: the weight dequantized as gguf_dequantize does (rounded to bfloat16 for bf16 x, as
// that kernel reads it), each product summed in float32 in k order.
void gguf_gemm(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, c10::string_view format,
               const std::optional<at::Tensor>& bias, bool rows16, c10::string_view isa_name, bool residual,
               WorkPool* pool) {
  const char* op = "gguf_gemm";
  const Isa isa = parse_isa(std::string_view(isa_name.data(), isa_name.size()), op);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && (bf16 || x.scalar_type() == at::kFloat), op,
              ": x must be a contiguous bfloat16 or float32 [rows, in_features]");
  TORCH_CHECK(!bf16 || isa == Isa::scalar || (cpu_runs(Isa::avx512) && avx512_bf16_in_cpuid()), op,
              ": this CPU has no AVX-512 BF16 for bfloat16 x (the scalar path runs anywhere)");
  const int64_t M = x.size(0), K = x.size(1), N = out.dim() == 2 ? out.size(1) : 0;
  TORCH_CHECK(out.dim() == 2 && out.size(0) == M && out.stride(1) == 1 && out.stride(0) >= N &&
                  (out.scalar_type() == at::kFloat || (bf16 && out.scalar_type() == at::kBFloat16)),
              op, ": out must be a float32 (or, for bfloat16 x, bfloat16) [rows, out_features] with unit column stride");
  const Format f = rows16 ? rows16_format(w, format, N, K, op) : planar_format(w, format, N, K, op);
  check_bias(bias, N, op);
  if (M == 0 || N == 0) return;
#if PS_X86
  // "auto" on the AVX2 path takes float32 x through the integers, where that measured faster
  if (isa_name == "auto" && isa == Isa::avx2 && !bf16 && out.scalar_type() == at::kFloat) {
    if (!residual && avx2::int8_gemm_takes(f)) return gguf_gemm_int(out, x, w, format, bias, rows16, false, "avx2", pool);
    if (avx2::int16_gemm_pays(f, M)) return gguf_gemm_int(out, x, w, format, bias, rows16, true, "avx2", pool);
  }
#endif
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const float* b = bias ? bias->data_ptr<float>() : nullptr;
  const int64_t stride = w.size(1), ldo = out.stride(0);
  dispatch_model_dtype(x.scalar_type(), op, [&](auto x_tag) {
    using X = decltype(x_tag);
    if constexpr (!std::is_same_v<X, c10::Half>) {
      const X* xp = x.data_ptr<X>();
      dispatch_model_dtype(out.scalar_type(), op, [&](auto tag) {
        using T = decltype(tag);
        if constexpr (!std::is_same_v<T, c10::Half>) {
          T* o = out.data_ptr<T>();
#if PS_X86
          if constexpr (std::is_same_v<X, c10::BFloat16>) {
            if (isa != Isa::scalar) return avx512bf16::gemm<T>(f, rows16, wp, stride, N, K, xp, K, M, b, o, ldo, pool);
          } else if constexpr (std::is_same_v<T, float>) {
            if (isa != Isa::scalar) {
              const auto kernel = isa == Isa::avx2 ? &avx2::gemm_f32 : &avx512::gemm_f32;
              return kernel(f, rows16, wp, stride, N, K, xp, K, M, b, o, ldo, pool);
            }
          }
#endif
          gemm_reference(f, rows16, wp, stride, N, K, xp, M, b, o, ldo, pool);
        }
      });
    }
  });
}

void gguf_gemm_int16_op(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, c10::string_view format,
                        const std::optional<at::Tensor>& bias, bool rows16, c10::string_view isa_name) {
  gguf_gemm_int(out, x, w, format, bias, rows16, true, isa_name, nullptr);
}

void gguf_gemm_int8_op(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, c10::string_view format,
                       const std::optional<at::Tensor>& bias, bool rows16, c10::string_view isa_name) {
  gguf_gemm_int(out, x, w, format, bias, rows16, false, isa_name, nullptr);
}

// The registered op: torch's threads.
void gguf_gemm_op(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, c10::string_view format,
                  const std::optional<at::Tensor>& bias, bool rows16, c10::string_view isa_name, bool residual) {
  gguf_gemm(out, x, w, format, bias, rows16, isa_name, residual, nullptr);
}

// The int8 activations every path computes with, and with `low` the int16 ones (tests: the paths
// agree on them).
void gguf_quantize_activations(at::Tensor& q, at::Tensor& d, at::Tensor& s, const at::Tensor& x,
                               c10::string_view isa_name, const std::optional<at::Tensor>& low) {
  const char* op = "gguf_quantize_activations";
  const Isa isa = parse_isa(std::string_view(isa_name.data(), isa_name.size()), op);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat && x.size(1) % 32 == 0, op,
              ": x must be a contiguous float32 [rows, K] with K a multiple of 32");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(q.scalar_type() == at::kChar && q.is_contiguous() && q.numel() == M * K, op, ": q must be int8 [rows, K]");
  TORCH_CHECK(d.scalar_type() == at::kFloat && d.is_contiguous() && d.numel() == M * K / 32 && s.sizes() == d.sizes() &&
                  s.scalar_type() == at::kFloat && s.is_contiguous(),
              op, ": d and s must be float32 [rows, K/32]");
  if (low) {
    TORCH_CHECK(low->scalar_type() == at::kChar && low->is_contiguous() && low->numel() == M * K, op,
                ": low must be int8 [rows, K]");
  }
  const QuantizeRow quantize = path_for(isa, Format::q8_0).quantize;
  for (int64_t m = 0; m < M; ++m)
    quantize(x.data_ptr<float>() + m * K, K, q.data_ptr<int8_t>() + m * K,
             low ? low->data_ptr<int8_t>() + m * K : nullptr, d.data_ptr<float>() + m * K / 32,
             s.data_ptr<float>() + m * K / 32);
}

}  // namespace pagedserve::gguf

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("gguf_matmul(Tensor(a!) out, Tensor x, Tensor w, str format, Tensor? bias=None, bool residual=False, "
        "str isa='auto', Tensor(b!)? rounded=None) -> ()");
  m.def("gguf_dequantize(Tensor(a!) out, Tensor w, str format, str isa='auto') -> ()");
  m.def("gguf_matmul16(Tensor(a!) out, Tensor x, Tensor w, str format, Tensor? bias=None, bool residual=False, "
        "str isa='auto', Tensor(b!)? rounded=None) -> ()");
  m.def("gguf_matmul16_pairs(Tensor(a!) out, Tensor x, Tensor w, str format, Tensor pairs, bool residual=False, "
        "str isa='auto') -> ()");
  m.def("gguf_dequantize16(Tensor(a!) out, Tensor w, str format, Tensor? ids=None, str isa='auto') -> ()");
  m.def("gguf_gemm(Tensor(a!) out, Tensor x, Tensor w, str format, Tensor? bias=None, bool rows16=True, "
        "str isa='auto', bool residual=True) -> ()");
  m.def("gguf_gemm_int16(Tensor(a!) out, Tensor x, Tensor w, str format, Tensor? bias=None, bool rows16=True, "
        "str isa='auto') -> ()");
  m.def("gguf_gemm_int8(Tensor(a!) out, Tensor x, Tensor w, str format, Tensor? bias=None, bool rows16=True, "
        "str isa='auto') -> ()");
  m.def("gguf_gemm_usable() -> bool", &pagedserve::bf16_gemm_usable);
  m.def("gguf_quantize_activations(Tensor(a!) q, Tensor(b!) d, Tensor(c!) s, Tensor x, str isa='auto', "
        "Tensor(d!)? low=None) -> ()");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("gguf_matmul", &pagedserve::gguf::gguf_matmul_op);
  m.impl("gguf_dequantize", &pagedserve::gguf::gguf_dequantize);
  m.impl("gguf_matmul16", &pagedserve::gguf::gguf_matmul16_op);
  m.impl("gguf_matmul16_pairs", &pagedserve::gguf::gguf_matmul16_pairs_op);
  m.impl("gguf_dequantize16", &pagedserve::gguf::gguf_dequantize16);
  m.impl("gguf_gemm", &pagedserve::gguf::gguf_gemm_op);
  m.impl("gguf_gemm_int16", &pagedserve::gguf::gguf_gemm_int16_op);
  m.impl("gguf_gemm_int8", &pagedserve::gguf::gguf_gemm_int8_op);
  m.impl("gguf_quantize_activations", &pagedserve::gguf::gguf_quantize_activations);
}
