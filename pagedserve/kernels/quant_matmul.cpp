// y = x W^T (+ bias) with W quantized in groups of 32 input columns, for the few rows of a decode
// step: W is read once, straight from its packed bytes, and never dequantized to memory.
//
//   int4 (the project's asymmetric format, GGUF Q4_0/Q4_1): w[n,k] = q * s[n,g] + b[n,g], q in
//        [0, 15], b = z - 8 s (GGUF Q4_1's d and m exactly). Each group is 16 bytes; byte i holds column i (low nibble) and
//        column i + 16 (high nibble), so a mask and a shift give columns 0-15 and 16-31 in order,
//        with no shuffle.
//   int8 (GGUF Q8_0): w[n,k] = q * s[n,g], q int8, the 32 bytes of a group in column order.
// s and b are float16 [N, K/32], as GGUF stores them: exact, and a quarter of the bytes each decode
// step reads is not spent on float32 scales.
//
// Per output element the sum is taken group by group in float32:
//   y[m,n] = sum_g s[n,g] * (sum_i q[n,g,i] x[m,g,i])  +  sum_g b[n,g] * xsum[m,g]
// with xsum the per-group sums of x, so the zero point costs one multiply per group, not per
// weight. The result equals the dequantized float matmul up to float rounding. Output features
// are split over torch's threads; each thread walks its rows of W once, and for every row reuses
// the unpacked group for up to four rows of x (one register tile), so W is read once per call.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "convert.h"
#include "simd_sum.h"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

using pagedserve::dispatch_model_dtype;
using pagedserve::from_float;
using pagedserve::to_float;

constexpr int64_t kGroup = 32;
constexpr int kTile = 4;  // rows of x sharing one unpacked group (8 accumulators + 4 weight vectors fit the 16 ymm)

#ifdef __AVX2__

// One group's 32 weights as four float vectors, columns 0-7, 8-15, 16-23, 24-31.
struct Int4Group {
  static inline void unpack(const uint8_t* p, __m256 w[4]) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(bytes, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    w[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    w[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(lo, lo)));
    w[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    w[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(hi, hi)));
  }
  static constexpr int64_t bytes = kGroup / 2;
};

struct Int8Group {
  static inline void unpack(const uint8_t* p, __m256 w[4]) {
    for (int j = 0; j < 4; ++j)
      w[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * j))));
  }
  static constexpr int64_t bytes = kGroup;
};

// out[m] = sum_g s[g] * dot(q_g, x[m, g]) for MT rows of x (row stride K) against one row of W.
// Two accumulators per row (even / odd groups) hide the FMA latency. Every tile size takes the same
// two, in the same order: a row's result is then the same bit for bit whatever rows share its call
// (batch-invariant), so a prompt's logits do not depend on its batch or on what the prefix cache held.
template <typename Group, int MT>
inline void tile_dot(const float* x, int64_t K, const uint8_t* wrow, const float* srow, float* out) {
  constexpr int NA = 2;
  __m256 acc[MT][NA];
  for (int m = 0; m < MT; ++m)
    for (int a = 0; a < NA; ++a) acc[m][a] = _mm256_setzero_ps();
  const int64_t groups = K / kGroup;
  auto step = [&](int64_t g, int a) {
    __m256 w[4];
    Group::unpack(wrow + g * Group::bytes, w);
    const __m256 s = _mm256_broadcast_ss(srow + g);
    for (int m = 0; m < MT; ++m) {
      const float* xm = x + m * K + g * kGroup;
      __m256 d = _mm256_mul_ps(w[0], _mm256_loadu_ps(xm));
      d = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xm + 8), d);
      d = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xm + 16), d);
      d = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xm + 24), d);
      acc[m][a] = _mm256_fmadd_ps(s, d, acc[m][a]);
    }
  };
  int64_t g = 0;
  for (; g + NA <= groups; g += NA)
    for (int a = 0; a < NA; ++a) step(g + a, a);
  for (; g < groups; ++g) step(g, 0);
  for (int m = 0; m < MT; ++m) {
    __m256 t = acc[m][0];
    t = _mm256_add_ps(t, acc[m][1]);
    out[m] = pagedserve::hsum8(t);
  }
}
#endif

// The portable version of tile_dot, one weight at a time (no AVX2, or to test against).
template <bool Int4>
inline void scalar_dot(const float* x, int64_t K, int64_t rows, const uint8_t* wrow, const float* srow, float* out) {
  const int64_t groups = K / kGroup;
  for (int64_t m = 0; m < rows; ++m) {
    float total = 0.f;
    for (int64_t g = 0; g < groups; ++g) {
      const float* xg = x + m * K + g * kGroup;
      float d = 0.f;
      if constexpr (Int4) {
        const uint8_t* p = wrow + g * (kGroup / 2);
        for (int i = 0; i < kGroup / 2; ++i)
          d += static_cast<float>(p[i] & 0x0F) * xg[i] + static_cast<float>(p[i] >> 4) * xg[i + kGroup / 2];
      } else {
        const int8_t* p = reinterpret_cast<const int8_t*>(wrow) + g * kGroup;
        for (int i = 0; i < kGroup; ++i) d += static_cast<float>(p[i]) * xg[i];
      }
      total += srow[g] * d;
    }
    out[m] = total;
  }
}

template <bool Int4>
void rows_dot(const float* x, int64_t K, int64_t rows, const uint8_t* wrow, const float* srow, float* out) {
#ifdef __AVX2__
  using Group = std::conditional_t<Int4, Int4Group, Int8Group>;
  switch (rows) {
    case 1: return tile_dot<Group, 1>(x, K, wrow, srow, out);
    case 2: return tile_dot<Group, 2>(x, K, wrow, srow, out);
    case 3: return tile_dot<Group, 3>(x, K, wrow, srow, out);
    default: return tile_dot<Group, 4>(x, K, wrow, srow, out);
  }
#else
  scalar_dot<Int4>(x, K, rows, wrow, srow, out);
#endif
}

// n float16 values to float32.
inline void halves_to_float(const c10::Half* h, int64_t n, float* out) {
  int64_t i = 0;
#ifdef __F16C__
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
#endif
  for (; i < n; ++i) out[i] = to_float(h[i]);
}

// xf [M, K] float32 rows; w [N, K/2] (int4) or [N, K] (int8) bytes; s, b [N, K/32] float16.
template <bool Int4, typename TOut, typename TBias>
void group_matmul_impl(TOut* y, const float* xf, const uint8_t* w, const c10::Half* s, const c10::Half* b,
                       const TBias* bias,
                       int64_t M, int64_t K, int64_t N, bool use_scalar) {
  const int64_t groups = K / kGroup;
  const int64_t row_bytes = Int4 ? K / 2 : K;
  std::vector<float> xsum;  // per-group sums of x, for the zero-point term (int4 only)
  if (Int4) {
    xsum.assign(M * groups, 0.f);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t g = 0; g < groups; ++g) {
        float t = 0.f;
        for (int64_t i = 0; i < kGroup; ++i) t += xf[m * K + g * kGroup + i];
        xsum[m * groups + g] = t;
      }
  }
  // At least ~32k weights per task, so a small matrix is not split into slivers costing more to
  // schedule than to compute.
  const int64_t grain = std::max<int64_t>(1, 32768 / K);
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    float dots[kTile];
    std::vector<float> srow(groups), brow(Int4 ? groups : 0);  // this row's scales and offsets in float32
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* wrow = w + n * row_bytes;
      halves_to_float(s + n * groups, groups, srow.data());
      if (Int4) halves_to_float(b + n * groups, groups, brow.data());
      for (int64_t m0 = 0; m0 < M; m0 += kTile) {
        const int64_t rows = std::min<int64_t>(kTile, M - m0);
        if (use_scalar) scalar_dot<Int4>(xf + m0 * K, K, rows, wrow, srow.data(), dots);
        else rows_dot<Int4>(xf + m0 * K, K, rows, wrow, srow.data(), dots);
        for (int64_t r = 0; r < rows; ++r) {
          float v = dots[r];
          if (Int4) {
            const float* xs = xsum.data() + (m0 + r) * groups;
            float z = 0.f;
            for (int64_t g = 0; g < groups; ++g) z += brow[g] * xs[g];
            v += z;
          }
          if (bias) v += to_float(bias[n]);
          y[(m0 + r) * N + n] = from_float<TOut>(v);
        }
      }
    }
  });
}

// Shared checks and dispatch: x [M, K] of a model dtype, out [M, N] of x's dtype or float32,
// bias [N] of x's dtype.
template <bool Int4>
void group_matmul(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                  const std::optional<at::Tensor>& offsets, const std::optional<at::Tensor>& bias, bool scalar,
                  const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), op, ": x must be a contiguous [rows, in_features]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), groups = K / kGroup;
  TORCH_CHECK(K % kGroup == 0, op, ": in_features must be a multiple of 32, got ", K);
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.size(1) == (Int4 ? K / 2 : K) &&
                  w.scalar_type() == (Int4 ? at::kByte : at::kChar),
              op, ": weight must be a contiguous ", Int4 ? "uint8 [out, in/2]" : "int8 [out, in]");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.dim() == 2 &&
                  scales.size(0) == N && scales.size(1) == groups,
              op, ": scales must be a contiguous float16 [out, in/32]");
  if (Int4) {
    TORCH_CHECK(offsets && offsets->scalar_type() == at::kHalf && offsets->is_contiguous() &&
                    offsets->sizes() == scales.sizes(),
                op, ": offsets must be a contiguous float16 [out, in/32]");
  }
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(0) == M && out.size(1) == N &&
                  (out.scalar_type() == x.scalar_type() || out.scalar_type() == at::kFloat),
              op, ": out must be a contiguous [rows, out_features] of x's dtype or float32");
  if (bias) {
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == N && bias->scalar_type() == x.scalar_type(), op,
                ": bias must be a contiguous [out_features] of x's dtype");
  }
  if (M == 0 || N == 0) return;
  dispatch_model_dtype(x.scalar_type(), op, [&](auto tag) {
    using T = decltype(tag);
    const float* xf = nullptr;
    std::vector<float> converted;  // bf16 / f16 activations: converted once, the rows are short
    if constexpr (std::is_same_v<T, float>) {
      xf = x.data_ptr<float>();
    } else {
      converted.resize(M * K);
      const T* src = x.data_ptr<T>();
      for (int64_t i = 0; i < M * K; ++i) converted[i] = to_float(src[i]);
      xf = converted.data();
    }
    const T* bp = bias ? bias->data_ptr<T>() : nullptr;
    const uint8_t* wp = static_cast<const uint8_t*>(w.data_ptr());
    const c10::Half* sc = scales.data_ptr<c10::Half>();
    const c10::Half* bo = Int4 ? offsets->data_ptr<c10::Half>() : nullptr;
    if (out.scalar_type() == at::kFloat) {
      group_matmul_impl<Int4, float, T>(out.data_ptr<float>(), xf, wp, sc, bo, bp, M, K, N, scalar);
    } else {
      group_matmul_impl<Int4, T, T>(out.data_ptr<T>(), xf, wp, sc, bo, bp, M, K, N, scalar);
    }
  });
}

void int4_group_matmul(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                       const at::Tensor& offsets, const std::optional<at::Tensor>& bias, bool scalar) {
  group_matmul<true>(out, x, w, scales, offsets, bias, scalar, "int4_group_matmul");
}

void int8_group_matmul(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                       const std::optional<at::Tensor>& bias, bool scalar) {
  group_matmul<false>(out, x, w, scales, std::nullopt, bias, scalar, "int8_group_matmul");
}

// out [N, K] = the dequantized weight, in out's dtype: for prefill-sized batches, where one
// dequantization and a float GEMM beat the matrix-vector kernel (measured; see quant.py).
void group_dequantize(at::Tensor& out, const at::Tensor& w, const at::Tensor& scales,
                      const std::optional<at::Tensor>& offsets) {
  const bool int4 = w.scalar_type() == at::kByte;
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(1) % kGroup == 0,
              "group_dequantize: out must be a contiguous [out, in] with in a multiple of 32");
  const int64_t N = out.size(0), K = out.size(1), groups = K / kGroup;
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.size(0) == N && w.size(1) == (int4 ? K / 2 : K) &&
                  (int4 || w.scalar_type() == at::kChar),
              "group_dequantize: weight must be a contiguous uint8 [out, in/2] (int4) or int8 [out, in]");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.numel() == N * groups,
              "group_dequantize: scales must be a contiguous float16 [out, in/32]");
  TORCH_CHECK(!int4 || (offsets && offsets->scalar_type() == at::kHalf && offsets->is_contiguous() &&
                        offsets->numel() == N * groups),
              "group_dequantize: int4 needs float16 offsets [out, in/32]");
  const c10::Half* s = scales.data_ptr<c10::Half>();
  const c10::Half* b = int4 ? offsets->data_ptr<c10::Half>() : nullptr;
  const uint8_t* wp = static_cast<const uint8_t*>(w.data_ptr());
  dispatch_model_dtype(out.scalar_type(), "group_dequantize", [&](auto tag) {
    using T = decltype(tag);
    T* o = out.data_ptr<T>();
    at::parallel_for(0, N * groups, std::max<int64_t>(1, 1024 / kGroup), [&](int64_t g0, int64_t g1) {
      for (int64_t g = g0; g < g1; ++g) {
        T* og = o + g * kGroup;
        const float sg = to_float(s[g]);
        if (int4) {
          const float bg = to_float(b[g]);
          const uint8_t* p = wp + g * (kGroup / 2);
          for (int i = 0; i < kGroup / 2; ++i) {
            og[i] = from_float<T>(static_cast<float>(p[i] & 0x0F) * sg + bg);
            og[i + kGroup / 2] = from_float<T>(static_cast<float>(p[i] >> 4) * sg + bg);
          }
        } else {
          const int8_t* p = reinterpret_cast<const int8_t*>(wp) + g * kGroup;
          for (int i = 0; i < kGroup; ++i) og[i] = from_float<T>(static_cast<float>(p[i]) * sg);
        }
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  // `scalar` runs the portable loop even where AVX2 is compiled in (the tests compare the two).
  m.def("int4_group_matmul(Tensor(a!) out, Tensor x, Tensor w, Tensor scales, Tensor offsets, Tensor? bias, "
        "bool scalar=False) -> ()");
  m.def("group_dequantize(Tensor(a!) out, Tensor w, Tensor scales, Tensor? offsets) -> ()");
  m.def("int8_group_matmul(Tensor(a!) out, Tensor x, Tensor w, Tensor scales, Tensor? bias, bool scalar=False) -> ()");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("int4_group_matmul", &int4_group_matmul);
  m.impl("int8_group_matmul", &int8_group_matmul);
  m.impl("group_dequantize", &group_dequantize);
}
