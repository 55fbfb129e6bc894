// A greedy step's LM head over GGUF Q8_0 blocks at the kernels' int16 activations, for about int8's
// arithmetic (models/head_screen.py, GGUFHeadScreen).
//
// Why: from a few rows on, a Q8_0 head's products, not its bytes, are what a step waits on, and int16
// activations take two vpdpbusd per 64 weights and row where int8 takes one (16 rows of SmolLM2's
// 49,152 x 576 head, 2 threads of a Zen 4: 2.85 ms at int16, 1.91 at int8). The int8 activations are
// the int16 ones' high byte (gguf_matmul.cpp's quantize_row: a value is (254 q + low) d / 254 at
// int16, q d at int8, the same q), so weight row r's int16 logit E and int8 logit S of hidden row m
// differ by exactly w_r . e_m, e_m the values' low d / 254:
//   |E - S| <= ||w_r|| ||e_m||                                      (Cauchy-Schwarz)
//            + gamma ||w_r|| (||x8_m|| + ||x16_m||)                  (float32's rounding of both sums)
// with gamma twice the worst-case relative error of a sum over K / 32 blocks of d x int32 terms (each
// term at most its block's ||w|| ||x||, so all of them at most ||w_r|| ||x||). ||w_r|| is the
// dequantized row's norm, rounded up at load. The rows whose int8 logit plus that bound reaches the
// largest int8 logit minus its bound are the only ones that can hold the int16 argmax; their groups
// of 16 are computed again at int16 (gguf_matmul16_pairs: gguf_matmul16's bits for those pairs of
// hidden row and group only), and every other logit is -inf.
//
// What it returns is what the head would for its argmax: float32 logits [M, N], every row of a
// candidate's group the full head's value to the bit, the rest -inf (ties resolve as over the full
// logits: every row that can equal the largest is computed). Nothing else may read it as logits;
// the engine asks for it only on steps whose every row is plain greedy (engine/core/assembly.py).
// Q8_0 only: every tied head of the GGUF files measured is Q8_0, and the rounding term above holds
// for blocks that are a scale times signed integers.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <torch/library.h>

#include "convert.h"
#include "gguf_formats.h"
#include "kernel_ops.h"
#include "work_pool.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <string_view>
#include <vector>

namespace pagedserve::gguf {

namespace {

constexpr int kGroupRows = 16;  // the rows16 layout's weight rows a group

// Each hidden row's bound per unit of ||w_r||, from its int16 quantization (q, low [M, K], d [M, K/32]
// the int16 step d / 254); infinity for a row of x [M, K] (float32) that is not finite, whose
// quantization bounds nothing.
std::vector<float> bound_factors(const at::Tensor& x, const at::Tensor& q, const at::Tensor& low, const at::Tensor& d) {
  const int64_t M = q.size(0), K = q.size(1), runs = K / 32;
  const double gamma = 2.0 * static_cast<double>(runs + 4) * std::ldexp(1.0, -24);
  std::vector<float> factors(M);
  for (int64_t m = 0; m < M; ++m) {
    const int8_t* qm = q.data_ptr<int8_t>() + m * K;
    const int8_t* lm = low.data_ptr<int8_t>() + m * K;
    const float* xm = x.data_ptr<float>() + m * K;
    double norm2 = 0;
    for (int64_t i = 0; i < K; ++i) norm2 += static_cast<double>(xm[i]) * xm[i];
    if (!pagedserve::is_finite_bits(norm2)) {
      factors[m] = std::numeric_limits<float>::infinity();
      continue;
    }
    double e2 = 0, x8 = 0, x16 = 0;
    for (int64_t c = 0; c < runs; ++c) {
      int64_t l2 = 0, q2 = 0, v2 = 0;
      for (int64_t i = 32 * c; i < 32 * c + 32; ++i) {
        const int64_t v = kLowSteps * qm[i] + lm[i];
        l2 += lm[i] * lm[i];
        q2 += qm[i] * qm[i];
        v2 += v * v;
      }
      const double step = d.data_ptr<float>()[m * runs + c];
      e2 += step * step * static_cast<double>(l2);
      x16 += step * step * static_cast<double>(v2);
      x8 += step * step * kLowSteps * kLowSteps * static_cast<double>(q2);
    }
    const double bound = (std::sqrt(e2) + gamma * (std::sqrt(x8) + std::sqrt(x16))) * (1.0 + std::ldexp(1.0, -16));
    // (rounded up, not to nearest; -ffast-math folds std::isfinite, so the bits say it)
    factors[m] = pagedserve::is_finite_bits(bound) && bound < 1e30 ? static_cast<float>(bound)
                                                                    : std::numeric_limits<float>::infinity();
  }
  return factors;
}

// Hidden row m's candidate groups in `y` (its int8 logits): the groups holding a row whose upper
// bound reaches the largest lower bound. The other groups' logits become -inf. Every group is a
// candidate where the bound or that largest lower bound is not finite (the hidden row or the
// weight's products are not); the row norms are finite (GGUFHeadScreen refuses a head without).
std::vector<int32_t> candidate_groups(float* y, const float* norms, int64_t N, float factor) {
  std::vector<int32_t> groups;
  const int64_t count = (N + kGroupRows - 1) / kGroupRows;
  float lo = std::numeric_limits<float>::lowest();
  if (pagedserve::is_finite_bits(factor)) {
    float lanes[kGroupRows];  // a maximum per lane, so the loop vectorizes
    for (float& lane : lanes) lane = std::numeric_limits<float>::lowest();
    int64_t n = 0;
    for (; n + kGroupRows <= N; n += kGroupRows)
      for (int i = 0; i < kGroupRows; ++i) lanes[i] = std::max(lanes[i], y[n + i] - norms[n + i] * factor);
    for (; n < N; ++n) lo = std::max(lo, y[n] - norms[n] * factor);
    for (float lane : lanes) lo = std::max(lo, lane);
  }
  if (!pagedserve::is_finite_bits(factor) || !pagedserve::is_finite_bits(lo) ||
      lo == std::numeric_limits<float>::lowest()) {
    for (int64_t g = 0; g < count; ++g) groups.push_back(static_cast<int32_t>(g));
    return groups;
  }
  // Whether a group's rows reach lo, its lanes compared together (written plainly, GCC unrolled the
  // 16 lanes into scalar compares: 1.3 ms of Gemma 3's 15 ms over 16 rows of its 262,144-row head).
  const auto reaches = [&](int64_t n0, int64_t width) {
    int hits = 0;
#pragma omp simd reduction(+ : hits)
    for (int64_t i = 0; i < width; ++i) hits += y[n0 + i] + norms[n0 + i] * factor >= lo ? 1 : 0;
    return hits > 0;
  };
  for (int64_t g = 0; g < count; ++g) {
    const int64_t n0 = g * kGroupRows, width = std::min<int64_t>(kGroupRows, N - n0);
    const bool whole = width == kGroupRows;
    if (whole ? reaches(n0, kGroupRows) : reaches(n0, width)) {
      groups.push_back(static_cast<int32_t>(g));
    } else if (whole) {
      for (int i = 0; i < kGroupRows; ++i) y[n0 + i] = -std::numeric_limits<float>::infinity();
    } else {
      for (int64_t i = 0; i < width; ++i) y[n0 + i] = -std::numeric_limits<float>::infinity();
    }
  }
  return groups;
}

}  // namespace

at::Tensor gguf_screened_logits16(const at::Tensor& x, const at::Tensor& w, c10::string_view format,
                                  const at::Tensor& row_norms, c10::string_view isa, WorkPool* pool) {
  const char* op = "gguf_screened_logits16";
  TORCH_CHECK(std::string_view(format.data(), format.size()) == "Q8_0", op,
              ": only Q8_0 heads have a screen (its bound's rounding term is a scale times signed integers'), not ",
              std::string_view(format.data(), format.size()));
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 32 == 0, op, ": x must be [rows, K] with K a multiple of 32");
  TORCH_CHECK(row_norms.dim() == 1 && row_norms.scalar_type() == at::kFloat && row_norms.is_contiguous(), op,
              ": row_norms must be a contiguous float32 [out_features]");
  const at::Tensor rows = x.contiguous();
  const int64_t M = rows.size(0), K = rows.size(1), N = row_norms.size(0);
  at::Tensor out = at::empty({M, N}, rows.options().dtype(at::kFloat));
  gguf_matmul16(out, rows, w, format, std::nullopt, /*residual=*/false, isa, pool);  // the screen; checks w
  if (M == 0 || N == 0) return out;

  const at::Tensor xf = rows.to(at::kFloat).contiguous();
  at::Tensor q = at::empty({M, K}, rows.options().dtype(at::kChar)), low = at::empty({M, K}, q.options());
  at::Tensor d = at::empty({M, K / 32}, rows.options().dtype(at::kFloat)), s = at::empty({M, K / 32}, d.options());
  gguf_quantize_activations(q, d, s, xf, isa, low);  // (every path quantizes to the same bits)
  const std::vector<float> factors = bound_factors(xf, q, low, d);

  std::vector<std::vector<int32_t>> groups(M);
  float* y = out.data_ptr<float>();
  const float* norms = row_norms.data_ptr<float>();
  pagedserve::parallel_for(pool, 0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) groups[m] = candidate_groups(y + m * N, norms, N, factors[m]);
  });

  // The candidates at int16, written over their int8 logits.
  std::vector<int32_t> pairs;
  for (int64_t m = 0; m < M; ++m)
    for (int32_t g : groups[m]) pairs.insert(pairs.end(), {static_cast<int32_t>(m), g});
  const at::Tensor pair_rows = at::from_blob(pairs.data(), {static_cast<int64_t>(pairs.size() / 2), 2}, at::kInt);
  gguf_matmul16_pairs(out, rows, w, format, pair_rows, /*residual=*/true, isa, pool);
  return out;
}

// The registered op: torch's threads.
at::Tensor gguf_screened_logits16_op(const at::Tensor& x, const at::Tensor& w, c10::string_view format,
                                     const at::Tensor& row_norms, c10::string_view isa) {
  return gguf_screened_logits16(x, w, format, row_norms, isa, nullptr);
}

}  // namespace pagedserve::gguf

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("gguf_screened_logits16(Tensor x, Tensor w, str format, Tensor row_norms, str isa='auto') -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("gguf_screened_logits16", &pagedserve::gguf::gguf_screened_logits16_op);
}
