// float32 linear layers, y = x W^T (+ b), over weights packed once into column panels.
//
// Why: on an AVX2-only CPU torch's float32 linear paths are slow where a serving step spends
// most of its time, a handful of rows (a decode batch) against a large weight: oneDNN's packed
// path reaches ~15-24 GFLOP/s per core for 8 rows and MKL's less (measured on small's shapes, one
// thread, AMD EPYC under load). A register-blocked kernel that streams each weight panel once per
// block of rows is faster for one row (1.3-2.3x oneDNN's speed) and for prompt chunks (295 rows:
// 1.1-1.3x); at 8 rows it wins on the large matrices that dominate (gate_up, down, lm_head:
// 1.24-1.35x, and its prefetch adds 1.05-1.3x) and is within 0.8-0.9x on the two small ones.
//
// Layout: W [N, K] becomes panels [ceil(N / 16), K, 16]: for each block of 16 output columns, the
// K weights of those columns interleaved, so the kernel reads one panel front to back, 64 bytes
// per k (zero-padded past N). The micro-kernel holds up to 6 rows x 16 columns of accumulators in
// 12 AVX registers, broadcasting one x value per row per k. Panels are split over torch's threads.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGEDSERVE_PANEL_AVX2 1
#endif

namespace {

constexpr int64_t kPanel = 16;  // output columns per panel: two 8-float AVX registers
constexpr int kMaxRows = 6;        // rows per micro-kernel call: 6 x 2 accumulators + 2 weights + 1 broadcast
constexpr int64_t kSlice = 256;    // K per pass over a panel slice (16 KiB of it, kept in L1)
constexpr int64_t kPrefetch = 32;  // k rows (64-byte lines) of the panel read ahead

// out[r, 0:cols] = x[r, :] . panel[:, 0:cols] (+ bias) for MR rows.
template <int MR>
void micro_kernel(const float* __restrict x, int64_t ldx, const float* __restrict panel, int64_t k_len,
                  float* __restrict out, int64_t ldo, int64_t cols, const float* __restrict bias, bool accumulate) {
#ifdef PAGEDSERVE_PANEL_AVX2
  // Named accumulators, not arrays: GCC keeps an array of vectors in memory and stores it on
  // every iteration, which halved this loop's speed.
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00,
         c40 = c00, c41 = c00, c50 = c00, c51 = c00;
#define PAGEDSERVE_ROW(r)                                        \
  if constexpr (MR > r) {                                        \
    const __m256 a = _mm256_broadcast_ss(x + r * ldx + k);       \
    c##r##0 = _mm256_fmadd_ps(a, b0, c##r##0);                   \
    c##r##1 = _mm256_fmadd_ps(a, b1, c##r##1);                   \
  }
  for (int64_t k = 0; k < k_len; ++k) {
    // 32 lines ahead (2 KiB): the panel streams from memory in the first row block, and the
    // hardware prefetcher alone left decode-sized calls waiting on it (1.05-1.3x faster measured,
    // 8 rows). A prefetch past the panel's end is harmless: prefetches never fault.
    _mm_prefetch(reinterpret_cast<const char*>(panel + (k + kPrefetch) * kPanel), _MM_HINT_T0);
    const __m256 b0 = _mm256_loadu_ps(panel + k * kPanel);
    const __m256 b1 = _mm256_loadu_ps(panel + k * kPanel + 8);
    PAGEDSERVE_ROW(0) PAGEDSERVE_ROW(1) PAGEDSERVE_ROW(2) PAGEDSERVE_ROW(3) PAGEDSERVE_ROW(4) PAGEDSERVE_ROW(5)
  }
#undef PAGEDSERVE_ROW
  const __m256 acc[kMaxRows][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
  alignas(32) float tmp[kPanel];
  for (int r = 0; r < MR; ++r) {
    _mm256_store_ps(tmp, acc[r][0]);
    _mm256_store_ps(tmp + 8, acc[r][1]);
    float* o = out + r * ldo;
    if (accumulate)
      for (int64_t c = 0; c < cols; ++c) o[c] += tmp[c];
    else
      for (int64_t c = 0; c < cols; ++c) o[c] = tmp[c] + (bias ? bias[c] : 0.f);
  }
#else
  float acc[MR][kPanel] = {};
  for (int64_t k = 0; k < k_len; ++k)
    for (int r = 0; r < MR; ++r)
      for (int64_t c = 0; c < kPanel; ++c) acc[r][c] += x[r * ldx + k] * panel[k * kPanel + c];
  for (int r = 0; r < MR; ++r)
    for (int64_t c = 0; c < cols; ++c) out[r * ldo + c] = acc[r][c] + (accumulate ? out[r * ldo + c] : bias ? bias[c] : 0.f);
#endif
}

using MicroKernel = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t, const float*, bool);
constexpr MicroKernel kKernels[kMaxRows + 1] = {nullptr,          micro_kernel<1>, micro_kernel<2>, micro_kernel<3>,
                                                micro_kernel<4>, micro_kernel<5>, micro_kernel<6>};

at::Tensor panel_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat, "panel_pack: a 2-D float32 weight");
  const auto w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1), panels = (n + kPanel - 1) / kPanel;
  auto packed = at::zeros({panels, k, kPanel}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t c = 0; c < kPanel && p * kPanel + c < n; ++c) {
        const float* row = src + (p * kPanel + c) * k;
        float* col = dst + p * k * kPanel + c;
        for (int64_t i = 0; i < k; ++i) col[i * kPanel] = row[i];
      }
  });
  return packed;
}

// out [M, N] = x [M, K] . W^T (+ bias [N]), W given as panel_pack(W).
void panel_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "panel_linear: x [M, K] float32 rows");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.size(1) == x.size(1) && packed.is_contiguous(),
              "panel_linear: weight panels [P, K, 16] matching x");
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(0) == x.size(0) && out.scalar_type() == at::kFloat,
              "panel_linear: out [M, N] float32, contiguous");
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1), ldx = x.stride(0);
  TORCH_CHECK((n + kPanel - 1) / kPanel == packed.size(0), "panel_linear: out has ", n, " columns, weight ",
              packed.size(0), " panels");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->is_contiguous() && bias->scalar_type() == at::kFloat,
                "panel_linear: bias [N] float32");
    b = bias->data_ptr<float>();
  }
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // Row blocks as even as the 6-row limit allows (8 rows: 4 + 4, not 6 + 2), so no block runs
  // a narrow, load-bound kernel. Each panel stays in cache while every row block reads it.
  const int64_t blocks = (m + kMaxRows - 1) / kMaxRows;
  const int64_t panels = packed.size(0);
  // Enough panels per task that a thread's share is worth waking it for.
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, k * std::min<int64_t>(m, 16)));
  at::parallel_for(0, panels, grain, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t cols = std::min(kPanel, n - p * kPanel);
      const float* panel = wp + p * k * kPanel;
      // K in slices whose part of the panel (16 KiB) stays in L1 while every row block reads it.
      for (int64_t k0 = 0; k0 < k; k0 += kSlice) {
        const int64_t kl = std::min(kSlice, k - k0);
        int64_t r0 = 0;
        for (int64_t blk = 0; blk < blocks; ++blk) {
          const int64_t rows = (m - r0) / (blocks - blk);  // the remaining rows over the remaining blocks
          kKernels[rows](xp + r0 * ldx + k0, ldx, panel + k0 * kPanel, kl, op + r0 * n + p * kPanel, n, cols,
                         b ? b + p * kPanel : nullptr, k0 > 0);
          r0 += rows;
        }
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("panel_pack(Tensor weight) -> Tensor");
  m.def("panel_linear(Tensor(a!) out, Tensor x, Tensor packed, Tensor? bias) -> ()");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("panel_pack", &panel_pack);
  m.impl("panel_linear", &panel_linear);
}
