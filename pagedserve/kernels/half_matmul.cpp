// y = x W^T (+ bias) for float32 activations and a weight stored 16-bit (float16 or bfloat16) and
// widened to float32 in registers, for the few rows of a decode step.
//
// Why: single-stream decode on a CPU is bound by the bytes of weight it reads per token. A float32
// model reads 4 per weight; on a CPU without native bf16 (no AVX512_BF16, no AMX) a bf16 model is
// slower still, since torch emulates its matmuls. Stored 16-bit and widened in registers, the
// weight costs 2 bytes per token and the arithmetic stays float32: lossless for a bf16 or f16
// checkpoint. float16 widens with F16C's vcvtph2ps; bfloat16 is the high half of a float32, so it
// widens with a zero-extension and a 16-bit shift.
//
// W stays [N, K] row-major, as loaded: the layer's prefill path reads the same tensor, and with the
// next tile's rows prefetched (below) a one-row call reads W at 1.3-2x float32 F.linear's speed in
// the same process (2 bytes per weight against 4); a panel layout was not tried. Each tile is NR output features x MR
// rows of x with one accumulator per pair: NR widened weight vectors serve MR rows, so W is read
// once per call whatever M is (the rows of x, a few KiB, stay in L1/L2).
// Every (row, feature) pair is summed in one accumulator over k in the same order whatever the
// tile shape, so a row's result does not depend on which rows share its call (batch-invariant for
// a given path). Output features are split over torch's threads in whole tiles.
//
// Paths (cpu_isa.h): scalar (the reference), avx2 (8-wide; the last K % 8 columns added one by
// one) and avx512 (16-wide; the last K % 16 by masked loads).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "convert.h"
#include "cpu_isa.h"
#include "simd_sum.h"
#include "kernel_ops.h"
#include "work_pool.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <utility>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PAGEDSERVE_HALF_X86 1
#endif

namespace {

using pagedserve::Isa;

struct Problem {
  const float* x;      // [M, K], row stride ldx
  int64_t ldx;
  const uint16_t* w;   // [N, K], the 16-bit weight's bits
  const float* bias;   // [N] or null
  float* y;            // [M, N]
  int64_t M, N, K;
};

// Output features [n0, n1) of every row.
using Block = void (*)(const Problem&, int64_t n0, int64_t n1);

// ---- scalar: the reference every vector path is tested against ---------------------------------

template <bool BF16>
inline float widen(uint16_t bits) {
  if constexpr (BF16) return pagedserve::to_float(c10::BFloat16(bits, c10::BFloat16::from_bits()));
  else return pagedserve::to_float(c10::Half(bits, c10::Half::from_bits()));
}

template <bool BF16>
void block_scalar(const Problem& p, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint16_t* w = p.w + n * p.K;
    for (int64_t m = 0; m < p.M; ++m) {
      const float* x = p.x + m * p.ldx;
      float acc = 0.f;
      for (int64_t k = 0; k < p.K; ++k) acc += widen<BF16>(w[k]) * x[k];
      p.y[m * p.N + n] = acc + (p.bias ? p.bias[n] : 0.f);
    }
  }
}

// The 64-byte line at column k of the next tile's NR rows (its rows follow this tile's in W) into
// L1, and of the tile kL2TilesAhead on into L2. A tile's rows are short streams (K x 2 bytes
// each), too short for the hardware prefetcher to run ahead of: fetched a tile early, one line per
// row every 32 columns, a one-row call ran 1.1-1.4x faster on the matrices that outgrow L2
// (small's gate/up and LM head, AVX2 EPYC). One tile ahead still left a core waiting on memory:
// small's 200 MB of bf16 weights streamed by one-row calls at 23 GB/s on 2 threads of a Zen 4
// (12 on one), 31 GB/s with the L2 lines 8 tiles ahead (16: 30; a second L1 line 3 tiles ahead
// instead: 23). Past W's end it is harmless: prefetches never fault.
constexpr int kL2TilesAhead = 8;

template <int NR>
inline void prefetch_next_tile(const uint16_t* w, int64_t K, int64_t k) {
#ifdef PAGEDSERVE_HALF_X86
  for (int r = 0; r < NR; ++r) _mm_prefetch(reinterpret_cast<const char*>(w + (NR + r) * K + k), _MM_HINT_T0);
  for (int r = 0; r < NR; ++r)
    _mm_prefetch(reinterpret_cast<const char*>(w + (kL2TilesAhead * NR + r) * K + k), _MM_HINT_T1);
#endif
}

// Calls tile<NR, MR>(p, n, m) over [n0, n1) x [0, M): whole NR x MR tiles, then narrower ones at
// the edges (a table of every shape, so each is a fully unrolled instantiation).
template <int NR, int MR, template <int, int> class Tile>
void walk_tiles(const Problem& p, int64_t n0, int64_t n1) {
  using Fn = void (*)(const Problem&, int64_t, int64_t);
  static constexpr auto table = []<int... R>(std::integer_sequence<int, R...>) {
    return std::array<Fn, NR * MR>{&Tile<R / MR + 1, R % MR + 1>::run...};
  }(std::make_integer_sequence<int, NR * MR>{});
  for (int64_t n = n0; n < n1; n += NR) {
    const int nr = static_cast<int>(std::min<int64_t>(NR, n1 - n));
    for (int64_t m = 0; m < p.M; m += MR) {  // the NR weight rows stay in L1 across the row tiles
      const int mr = static_cast<int>(std::min<int64_t>(MR, p.M - m));
      table[(nr - 1) * MR + (mr - 1)](p, n, m);
    }
  }
}

}  // namespace

#ifdef PAGEDSERVE_HALF_X86
namespace {

// ---- avx2: AVX2 + FMA + F16C, 8 floats per vector ----------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

template <bool BF16>
inline __m256 widen8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  else return _mm256_cvtph_ps(h);
}

using pagedserve::hsum8;

template <bool BF16>
struct Avx2 {
  // 12 accumulators + 3 weight vectors of the 16 ymm (x is the FMAs' memory operand). Measured
  // against 4 x 2, 2 x 4, 4 x 3 and 4 x 4 on small's shapes: as fast for one row, up to 1.5x faster
  // for 8-16 (fewer widenings per FMA; 1.0-1.8x by shape on a noisy machine); 4 x 4 spills.
  static constexpr int kNR = 3, kMR = 4;

  template <int NR, int MR>
  struct Tile {
    static void run(const Problem& p, int64_t n, int64_t m) {
      const int64_t K = p.K, ldx = p.ldx;
      const uint16_t* w = p.w + n * K;
      const float* x = p.x + m * ldx;
      __m256 acc[NR][MR];
      for (int r = 0; r < NR; ++r)
        for (int i = 0; i < MR; ++i) acc[r][i] = _mm256_setzero_ps();
      const int64_t body = K & ~int64_t{7};
      for (int64_t k = 0; k < body; k += 8) {
        if ((k & 31) == 0) prefetch_next_tile<NR>(w, K, k);
        __m256 wv[NR];
        for (int r = 0; r < NR; ++r) wv[r] = widen8<BF16>(w + r * K + k);
        for (int i = 0; i < MR; ++i) {
          const __m256 xv = _mm256_loadu_ps(x + i * ldx + k);
          for (int r = 0; r < NR; ++r) acc[r][i] = _mm256_fmadd_ps(wv[r], xv, acc[r][i]);
        }
      }
      for (int i = 0; i < MR; ++i)
        for (int r = 0; r < NR; ++r) {
          float v = hsum8(acc[r][i]);
          for (int64_t k = body; k < K; ++k) v += widen<BF16>(w[r * K + k]) * x[i * ldx + k];  // the last K % 8
          p.y[(m + i) * p.N + n + r] = v + (p.bias ? p.bias[n + r] : 0.f);
        }
    }
  };

  static void block(const Problem& p, int64_t n0, int64_t n1) { walk_tiles<kNR, kMR, Tile>(p, n0, n1); }
};

#pragma GCC pop_options

// ---- avx512: AVX-512 F/BW/VL, 16 floats per vector ---------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")

template <bool BF16>
inline __m512 widen16(const uint16_t* p, __mmask16 mask) {
  const __m256i h = _mm256_maskz_loadu_epi16(mask, p);
  if constexpr (BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  else return _mm512_cvtph_ps(h);
}

template <bool BF16>
struct Avx512 {
  static constexpr int kNR = 4, kMR = 4;  // 16 accumulators + 4 weight vectors of the 32 zmm (not measured)

  template <int NR, int MR>
  struct Tile {
    static void run(const Problem& p, int64_t n, int64_t m) {
      const int64_t K = p.K, ldx = p.ldx;
      const uint16_t* w = p.w + n * K;
      const float* x = p.x + m * ldx;
      __m512 acc[NR][MR];
      for (int r = 0; r < NR; ++r)
        for (int i = 0; i < MR; ++i) acc[r][i] = _mm512_setzero_ps();
      for (int64_t k = 0; k < K; k += 16) {
        if ((k & 31) == 0) prefetch_next_tile<NR>(w, K, k);
        // Masked loads zero the lanes past K: the tail is one more step of the same loop.
        const __mmask16 mask = K - k >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (K - k)) - 1);
        __m512 wv[NR];
        for (int r = 0; r < NR; ++r) wv[r] = widen16<BF16>(w + r * K + k, mask);
        for (int i = 0; i < MR; ++i) {
          const __m512 xv = _mm512_maskz_loadu_ps(mask, x + i * ldx + k);
          for (int r = 0; r < NR; ++r) acc[r][i] = _mm512_fmadd_ps(wv[r], xv, acc[r][i]);
        }
      }
      for (int i = 0; i < MR; ++i)
        for (int r = 0; r < NR; ++r)
          p.y[(m + i) * p.N + n + r] = _mm512_reduce_add_ps(acc[r][i]) + (p.bias ? p.bias[n + r] : 0.f);
    }
  };

  static void block(const Problem& p, int64_t n0, int64_t n1) { walk_tiles<kNR, kMR, Tile>(p, n0, n1); }
};

#pragma GCC pop_options

}  // namespace
#endif  // PAGEDSERVE_HALF_X86

namespace {

// The path's block function and its tile width (threads get whole tiles of output features).
std::pair<Block, int64_t> choose(Isa isa, bool bf16) {
#ifdef PAGEDSERVE_HALF_X86
  if (isa == Isa::avx512) return {bf16 ? &Avx512<true>::block : &Avx512<false>::block, Avx512<true>::kNR};
  if (isa == Isa::avx2) return {bf16 ? &Avx2<true>::block : &Avx2<false>::block, Avx2<true>::kNR};
#endif
  return {bf16 ? &block_scalar<true> : &block_scalar<false>, 1};
}

}  // namespace

namespace pagedserve::ops {

// out [M, N] float32 = x [M, K] float32 (rows with unit stride) . w^T, w a contiguous float16 or
// bfloat16 [N, K], + bias [N] float32.
void half_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                 const std::string& isa_name, WorkPool* pool) {
  constexpr const char* op = "half_linear";
  const Isa isa = pagedserve::parse_isa(isa_name, op);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 && x.stride(0) >= x.size(1), op,
              ": x must be float32 [rows, in_features] with contiguous rows");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.size(1) == K &&
                  (w.scalar_type() == at::kHalf || w.scalar_type() == at::kBFloat16),
              op, ": weight must be a contiguous float16 or bfloat16 [out_features, in_features] matching x");
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.scalar_type() == at::kFloat && out.size(0) == M &&
                  out.size(1) == N,
              op, ": out must be a contiguous float32 [rows, out_features]");
  if (bias) {
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == N && bias->scalar_type() == at::kFloat, op,
                ": bias must be a contiguous float32 [out_features]");
  }
  if (M == 0 || N == 0) return;
  const Problem p{x.data_ptr<float>(), x.stride(0), static_cast<const uint16_t*>(w.data_ptr()),
                  bias ? bias->data_ptr<float>() : nullptr, out.data_ptr<float>(), M, N, K};
  const auto [block, width] = choose(isa, w.scalar_type() == at::kBFloat16);
  // At least ~32k weights per task (quant_matmul.cpp's grain), so a small matrix is not split into
  // slivers costing more to schedule than to compute.
  const int64_t tiles = (N + width - 1) / width;
  const int64_t grain = std::max<int64_t>(1, 32768 / (K * width));
  pagedserve::parallel_for(pool, 0, tiles, grain, [&](int64_t t0, int64_t t1) {
    block(p, t0 * width, std::min(N, t1 * width));
  });
}

// The registered op: torch's threads.
void half_linear_op(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                    const std::string& isa_name) {
  half_linear(out, x, w, bias, isa_name, nullptr);
}

}  // namespace pagedserve::ops

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("half_linear(Tensor(a!) out, Tensor x, Tensor w, Tensor? bias, str isa='auto') -> ()");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) { m.impl("half_linear", &pagedserve::ops::half_linear_op); }
