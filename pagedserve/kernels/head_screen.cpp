// The greedy pick over an LM head without reading all of it (models/head_screen.py).
//
// Why: one stream's decode reads every weight once per token, and the LM head is a large share of
// them (small: 32,000 x 768 bf16, 49 of the 200 MB a token reads). A greedy step only needs the
// head's argmax. An int8 copy of the head (a scale per row) gives every logit to within a bound
// known before the step: |h . w_r - s_r (h . q_r)| <= ||h|| ||w_r - s_r q_r||, plus float32's
// rounding of both sums (Cauchy-Schwarz; models/head_screen.py computes the per-row factor once).
// Rows whose upper bound reaches the largest lower bound are the only ones that can win; only they
// are computed from the head's own weights. The rest of the weight is not read: the step reads half
// the head's bytes plus a few rows.
//
// What it returns is what the head would: float32 logits [M, N], the candidates computed as the
// head's own kernel does (float32 sums of the widened weight, then rounded to the head's output
// dtype, `out_dtype`), every other entry -inf. The argmax of that is the full head's argmax up to
// float32 summation order; with a 16-bit `out_dtype` the margin covers the output's rounding, so every row
// that rounds to the largest value is a candidate and the lowest index among them wins, as it does
// over the full logits. Nothing else may read it as logits (sampling, logprobs): the engine asks
// for it only on steps whose every row is plain greedy (engine/core/assembly.py).
//
// Paths (cpu_isa.h): scalar (the reference), avx2 and avx512 for the screen's int8 pass; the
// candidates' exact sums are one function on every path, so their values do not depend on it.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "convert.h"
#include "cpu_isa.h"
#include "simd_sum.h"
#include "kernel_ops.h"
#include "work_pool.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PAGEDSERVE_SCREEN_X86 1
#endif

namespace {

using pagedserve::Isa;

struct Screen {
  const float* h;       // [M, K]
  const int8_t* q;      // [N, K]
  const float* scale;   // [N]
  float* out;           // [M, N]: s_n (h_m . q_n)
  int64_t M, N, K;
};

using ScreenBlock = void (*)(const Screen&, int64_t n0, int64_t n1);

void screen_scalar(const Screen& s, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* q = s.q + n * s.K;
    for (int64_t m = 0; m < s.M; ++m) {
      const float* h = s.h + m * s.K;
      float acc = 0.f;
      for (int64_t k = 0; k < s.K; ++k) acc += h[k] * static_cast<float>(q[k]);
      s.out[m * s.N + n] = acc * s.scale[n];
    }
  }
}

}  // namespace

#ifdef PAGEDSERVE_SCREEN_X86
namespace {

// One weight row at a time (a single forward stream, which the hardware prefetcher follows; four
// rows side by side, four streams 768 bytes apart, ran at a third of the rate on small's head),
// each of its vectors widened once and multiplied into up to kRowsAtOnce rows of h, each row's sum
// split over accumulators so that at least four FMA chains are in flight (one chain a row of h
// left 4 rows at 0.98 ms a call on small's head, cold; two: 0.87). The row stays in L1 across h's
// blocks of rows.
constexpr int kRowsAtOnce = 4;

template <int MR>
constexpr int chains() { return MR == 1 ? 4 : 2; }

// Calls row<MR>(n, m0) over every weight row in [n0, n1) and block of up to kRowsAtOnce rows of h.
template <template <int> class Row>
void walk(const Screen& s, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t m0 = 0; m0 < s.M; m0 += kRowsAtOnce) {
      switch (std::min<int64_t>(kRowsAtOnce, s.M - m0)) {
        case 1: Row<1>::run(s, n, m0); break;
        case 2: Row<2>::run(s, n, m0); break;
        case 3: Row<3>::run(s, n, m0); break;
        default: Row<4>::run(s, n, m0); break;
      }
    }
  }
}

#pragma GCC push_options
#pragma GCC target("avx2,fma")

using pagedserve::hsum8;

template <int MR>
struct RowAvx2 {
  static void run(const Screen& s, int64_t n, int64_t m0) {
    constexpr int C = chains<MR>();
    const int64_t K = s.K, body = K - K % (8 * C);
    const int8_t* q = s.q + n * K;
    const float* h = s.h + m0 * K;
    __m256 acc[MR][C];
    for (int r = 0; r < MR; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
    for (int64_t k = 0; k < body; k += 8 * C) {
      for (int c = 0; c < C; ++c) {
        const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + k + 8 * c));
        const __m256 wv = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
        for (int r = 0; r < MR; ++r) acc[r][c] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(h + r * K + k + 8 * c), acc[r][c]);
      }
    }
    for (int r = 0; r < MR; ++r) {
      for (int c = 1; c < C; ++c) acc[r][0] = _mm256_add_ps(acc[r][0], acc[r][c]);
      float t = hsum8(acc[r][0]);
      for (int64_t k = body; k < K; ++k) t += h[r * K + k] * static_cast<float>(q[k]);
      s.out[(m0 + r) * s.N + n] = t * s.scale[n];
    }
  }
};

void screen_avx2(const Screen& s, int64_t n0, int64_t n1) { walk<RowAvx2>(s, n0, n1); }

#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma")

template <int MR>
struct RowAvx512 {
  static void run(const Screen& s, int64_t n, int64_t m0) {
    constexpr int C = chains<MR>();
    const int64_t K = s.K, body = K - K % (16 * C);
    const int8_t* q = s.q + n * K;
    const float* h = s.h + m0 * K;
    __m512 acc[MR][C];
    for (int r = 0; r < MR; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t k = 0; k < body; k += 16 * C) {
      for (int c = 0; c < C; ++c) {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k + 16 * c));
        const __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
        for (int r = 0; r < MR; ++r) acc[r][c] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(h + r * K + k + 16 * c), acc[r][c]);
      }
    }
    for (int64_t k = body; k < K; k += 16) {  // the rest, 16 at a time, the last masked
      const __mmask16 mask = K - k >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (K - k)) - 1);
      const __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, q + k)));
      for (int r = 0; r < MR; ++r) acc[r][0] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(mask, h + r * K + k), acc[r][0]);
    }
    for (int r = 0; r < MR; ++r) {
      for (int c = 1; c < C; ++c) acc[r][0] = _mm512_add_ps(acc[r][0], acc[r][c]);
      s.out[(m0 + r) * s.N + n] = _mm512_reduce_add_ps(acc[r][0]) * s.scale[n];
    }
  }
};

void screen_avx512(const Screen& s, int64_t n0, int64_t n1) { walk<RowAvx512>(s, n0, n1); }

#pragma GCC pop_options

}  // namespace
#endif  // PAGEDSERVE_SCREEN_X86

namespace {

ScreenBlock choose(Isa isa) {
#ifdef PAGEDSERVE_SCREEN_X86
  if (isa == Isa::avx512) return &screen_avx512;
  if (isa == Isa::avx2) return &screen_avx2;
#endif
  return &screen_scalar;
}

// h . w_n as the head's kernel sums it: float32, the weight widened exactly, in order.
template <typename W>
float exact_dot(const float* h, const W* w, int64_t K) {
  float acc = 0.f;
  for (int64_t k = 0; k < K; ++k) acc += h[k] * pagedserve::to_float(w[k]);
  return acc;
}

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// The output dtype's rounding, and the largest gap it can close between two values near x: a value
// that rounds to at least round(T) is above T - gap (bf16 keeps 8 significant bits, float16 11;
// twice their unit in the last place, for the binade's edge).
struct Rounding {
  c10::ScalarType dtype;
  float gap(float x) const {
    const float rel = dtype == c10::ScalarType::BFloat16 ? 0x1p-7f : dtype == c10::ScalarType::Half ? 0x1p-10f : 0.f;
    return 2.f * rel * std::fabs(x);
  }
  float apply(float x) const {
    if (dtype == c10::ScalarType::BFloat16) return pagedserve::round_to<c10::BFloat16>(x);
    if (dtype == c10::ScalarType::Half) return pagedserve::round_to<c10::Half>(x);
    return x;
  }
};

}  // namespace

namespace pagedserve::ops {

// Logits [M, N] of h [M, K] through a head of weight [N, K] (float32, bfloat16 or float16) for a
// greedy pick: the rows that can hold the argmax computed exactly (then rounded to `out_dtype`:
// "float32", "bfloat16" or "float16", the dtype the head's output has), every other -inf. q [N, K]
// int8 and scale [N] are the head's screen copy, bound [N] each row's error factor (see above).
// On `pool` where given (the decode stack's), else torch's threads.
at::Tensor screened_logits(const at::Tensor& h_in, const at::Tensor& q, const at::Tensor& scale,
                           const at::Tensor& bound, const at::Tensor& weight, const std::string& out_dtype,
                           const std::string& isa_name, WorkPool* pool) {
  constexpr const char* op = "screened_logits";
  const Isa isa = pagedserve::parse_isa(isa_name, op);
  TORCH_CHECK(h_in.dim() == 2, op, ": h must be [rows, hidden]");
  const int64_t M = h_in.size(0), K = h_in.size(1), N = q.size(0);
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous() && q.scalar_type() == at::kChar && q.size(1) == K, op,
              ": q must be a contiguous int8 [vocab, hidden] matching h");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.size(0) == N && weight.size(1) == K, op,
              ": weight must be a contiguous [vocab, hidden] matching q");
  for (const at::Tensor* t : {&scale, &bound}) {
    TORCH_CHECK(t->is_contiguous() && t->numel() == N && t->scalar_type() == at::kFloat, op,
                ": scale and bound must be contiguous float32 [vocab]");
  }
  Rounding rounding{at::kFloat};
  if (out_dtype == "bfloat16") rounding.dtype = at::kBFloat16;
  else if (out_dtype == "float16") rounding.dtype = at::kHalf;
  else TORCH_CHECK(out_dtype == "float32", op, ": out_dtype must be float32, bfloat16 or float16, not '", out_dtype, "'");
  const at::Tensor h = h_in.to(at::kFloat).contiguous();  // exact: h's values as the head reads them
  at::Tensor out = at::empty({M, N}, h.options());
  if (M == 0 || N == 0) return out;
  const Screen s{h.data_ptr<float>(), q.data_ptr<int8_t>(), scale.data_ptr<float>(), out.data_ptr<float>(), M, N, K};
  const ScreenBlock block = choose(isa);
  // ~64k weights per task.
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(K, 1));
  pagedserve::parallel_for(pool, 0, N, grain, [&](int64_t n0, int64_t n1) { block(s, n0, n1); });

  const float* b = bound.data_ptr<float>();
  pagedserve::dispatch_model_dtype(weight.scalar_type(), op, [&](auto tag) {
    using W = decltype(tag);
    const W* w = static_cast<const W*>(weight.data_ptr());
    for (int64_t m = 0; m < M; ++m) {
      const float* hm = s.h + m * K;
      float* row = out.data_ptr<float>() + m * N;
      double norm2 = 0.0;
      for (int64_t k = 0; k < K; ++k) norm2 += static_cast<double>(hm[k]) * hm[k];
      if (!pagedserve::is_finite_bits(norm2)) {  // h not finite: every row, as the head would compute it
        for (int64_t n = 0; n < N; ++n) row[n] = rounding.apply(exact_dot(hm, w + n * K, K));
        continue;
      }
      const float hn = static_cast<float>(std::sqrt(norm2) * (1.0 + 1e-6));  // rounded up
      float best_low = std::numeric_limits<float>::lowest();  // the winner's value is at least this
      for (int64_t n = 0; n < N; ++n) best_low = std::max(best_low, row[n] - hn * b[n]);
      // (float's smallest normal: a threshold of 0 must keep values that round to 0 from below)
      const float threshold = best_low - rounding.gap(best_low) - std::numeric_limits<float>::min();
      for (int64_t n = 0; n < N; ++n) {
        row[n] = row[n] + hn * b[n] >= threshold ? rounding.apply(exact_dot(hm, w + n * K, K)) : kNegInf;
      }
    }
  });
  return out;
}

// The registered op: torch's threads.
at::Tensor screened_logits_op(const at::Tensor& h, const at::Tensor& q, const at::Tensor& scale, const at::Tensor& bound,
                              const at::Tensor& weight, const std::string& out_dtype, const std::string& isa) {
  return screened_logits(h, q, scale, bound, weight, out_dtype, isa, nullptr);
}

}  // namespace pagedserve::ops

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("screened_logits(Tensor h, Tensor q, Tensor scale, Tensor bound, Tensor weight, str out_dtype, "
        "str isa='auto') -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) { m.impl("screened_logits", &pagedserve::ops::screened_logits_op); }
