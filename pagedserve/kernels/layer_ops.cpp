// The small per-layer operations of a Llama block, each one pass over memory instead of the
// five to ten torch ops (each a kernel launch and a temporary) they take when written in torch:
// RMSNorm (optionally adding the residual first), rotary embedding in place, SiLU-and-multiply.
// Numbers are computed in float32 and rounded to the tensor's dtype where the torch ops they
// replace round, so bf16 results are bit-identical to transformers' (tested).
#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "convert.h"
#include "kernel_ops.h"
#include "work_pool.h"

#if defined(__linux__)
#include <sched.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <set>
#include <thread>
#include <tuple>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

using pagedserve::dispatch_model_dtype;
using pagedserve::from_float;
using pagedserve::round_to;
using pagedserve::to_float;

// Rows are independent: split them over `pool` (a decode stack's own threads) or, without one,
// torch's, a few rows per task (parallel_rows). The decode stack must pass its pool: an OpenMP
// region between two of its matmuls left OpenMP's worker spinning on the core the pool's worker
// needed (48 % of the samples of a 16-stream decode were libgomp's spin).
template <typename F>
void for_rows(pagedserve::WorkPool* pool, int64_t rows, int64_t row_elems, F&& body) {
  pagedserve::parallel_rows(pool, rows, row_elems, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) body(r);
  });
}

// out = weight * round(x * rsqrt(mean(x^2) + eps)), as transformers computes it (the normalized
// row is cast to the dtype before the weight multiplies it). With `residual`, x is first
// replaced by residual + x (rounded, as `x + residual` in torch), and residual receives it.
template <typename T>
void rms_norm_impl(T* out, const T* x, T* residual, const T* weight, int64_t rows, int64_t h, int64_t x_stride,
                   float eps, pagedserve::WorkPool* pool) {
  for_rows(pool, rows, h, [&](int64_t r) {
    const T* __restrict xr = x + r * x_stride;
    T* __restrict res = residual ? residual + r * h : nullptr;
    if (res) {  // separate loops, each simple enough for the compiler to vectorize
      for (int64_t i = 0; i < h; ++i) res[i] = from_float<T>(to_float(xr[i]) + to_float(res[i]));
    }
    const T* __restrict src = res ? res : xr;
    float ss = 0.f;
    for (int64_t i = 0; i < h; ++i) ss += to_float(src[i]) * to_float(src[i]);
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(h) + eps);
    T* __restrict o = out + r * h;
    for (int64_t i = 0; i < h; ++i) o[i] = from_float<T>(to_float(weight[i]) * round_to<T>(to_float(src[i]) * inv));
  });
}

// In place on q [T, heads, head_dim] and k [T, kv_heads, head_dim] (rows may be strided, heads
// contiguous): x' = x * cos + rotate_half(x) * sin, with cos/sin rows [max_pos, head_dim] float32.
// Rounded where transformers' three torch ops round (cos/sin cast to the dtype, each product,
// the sum), so bf16 results are bit-identical to its rotary embedding.
template <typename T>
void rotary_impl(T* q, T* k, const int64_t* positions, const float* cos, const float* sin, int64_t tokens,
                 int64_t q_heads, int64_t k_heads, int64_t hd, int64_t q_stride, int64_t k_stride,
                 pagedserve::WorkPool* pool) {
  const int64_t half = hd / 2;
  for_rows(pool, tokens, (q_heads + k_heads) * hd, [&](int64_t t) {
    const float* c = cos + positions[t] * hd;
    const float* s = sin + positions[t] * hd;
    auto rotate = [&](T* x) {
      for (int64_t i = 0; i < half; ++i) {
        const float a = to_float(x[i]), b = to_float(x[i + half]);
        const float c1 = round_to<T>(c[i]), s1 = round_to<T>(s[i]);
        const float c2 = round_to<T>(c[i + half]), s2 = round_to<T>(s[i + half]);
        x[i] = from_float<T>(round_to<T>(a * c1) + round_to<T>(-b * s1));
        x[i + half] = from_float<T>(round_to<T>(b * c2) + round_to<T>(a * s2));
      }
    };
    for (int64_t h = 0; h < q_heads; ++h) rotate(q + t * q_stride + h * hd);
    for (int64_t h = 0; h < k_heads; ++h) rotate(k + t * k_stride + h * hd);
  });
}

// out [T, I] = silu(x[:, :I]) * x[:, I:], with the gate rounded to the dtype before the product
// (F.silu(gate) * up in torch).
template <typename T>
void silu_and_mul_impl(T* out, const T* x, int64_t rows, int64_t inter, pagedserve::WorkPool* pool) {
  for_rows(pool, rows, inter, [&](int64_t r) {
    const T* g = x + r * 2 * inter;
    const T* u = g + inter;
    T* o = out + r * inter;
    for (int64_t i = 0; i < inter; ++i) {
      const float gv = to_float(g[i]);
      o[i] = from_float<T>(round_to<T>(gv / (1.f + std::exp(-gv))) * to_float(u[i]));
    }
  });
}

}  // namespace

namespace pagedserve::ops {

void rms_norm(at::Tensor& out, const at::Tensor& x, const std::optional<at::Tensor>& residual,
              const at::Tensor& weight, double eps, WorkPool* pool) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rms_norm: x must be [rows, hidden] with contiguous rows");
  const int64_t rows = x.size(0), h = x.size(1);
  TORCH_CHECK(out.is_contiguous() && out.sizes() == x.sizes(), "rms_norm: out must be a contiguous [rows, hidden]");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == h, "rms_norm: weight must be [hidden]");
  TORCH_CHECK(out.scalar_type() == x.scalar_type() && weight.scalar_type() == x.scalar_type(),
              "rms_norm: x, out and weight must share a dtype");
  if (residual) {
    TORCH_CHECK(residual->is_contiguous() && residual->sizes() == x.sizes() &&
                    residual->scalar_type() == x.scalar_type(),
                "rms_norm: residual must be a contiguous tensor like x");
  }
  dispatch_model_dtype(x.scalar_type(), "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    rms_norm_impl<T>(out.data_ptr<T>(), x.data_ptr<T>(), residual ? residual->data_ptr<T>() : nullptr,
                     weight.data_ptr<T>(), rows, h, x.stride(0), static_cast<float>(eps), pool);
  });
}

void rotary_embedding(at::Tensor& q, at::Tensor& k, const at::Tensor& positions, const at::Tensor& cos,
                      const at::Tensor& sin, WorkPool* pool) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2),
              "rotary_embedding: q and k must be [tokens, heads, head_dim]");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && q.stride(1) == q.size(2) && k.stride(1) == k.size(2),
              "rotary_embedding: heads must be contiguous within a token");
  TORCH_CHECK(q.scalar_type() == k.scalar_type(), "rotary_embedding: q and k must share a dtype");
  const int64_t hd = q.size(2);
  TORCH_CHECK(hd % 2 == 0, "rotary_embedding: head_dim must be even");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.dim() == 2 && cos.size(1) == hd && sin.sizes() == cos.sizes(),
              "rotary_embedding: cos and sin must be contiguous float32 [max_positions, head_dim]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == q.size(0),
              "rotary_embedding: positions must be int64 [tokens]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < positions.numel(); ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "rotary_embedding: position ", pos[t], " out of range");
  dispatch_model_dtype(q.scalar_type(), "rotary_embedding", [&](auto tag) {
    using T = decltype(tag);
    rotary_impl<T>(q.data_ptr<T>(), k.data_ptr<T>(), pos, cos.data_ptr<float>(), sin.data_ptr<float>(), q.size(0),
                   q.size(1), k.size(1), hd, q.stride(0), k.stride(0), pool);
  });
}

void silu_and_mul(at::Tensor& out, const at::Tensor& x, WorkPool* pool) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0, "silu_and_mul: x must be a contiguous [rows, 2I]");
  TORCH_CHECK(out.is_contiguous() && out.size(0) == x.size(0) && out.size(1) * 2 == x.size(1) &&
                  out.scalar_type() == x.scalar_type(),
              "silu_and_mul: out must be a contiguous [rows, I] of x's dtype");
  dispatch_model_dtype(x.scalar_type(), "silu_and_mul", [&](auto tag) {
    using T = decltype(tag);
    silu_and_mul_impl<T>(out.data_ptr<T>(), x.data_ptr<T>(), x.size(0), out.size(1), pool);
  });
}

}  // namespace pagedserve::ops

namespace {

// How many threads one at::parallel_for over `items` runs on: what every kernel here gets. Built
// without OpenMP, ATen's parallel_for silently runs on the calling thread alone; the tests ask this.
int64_t parallel_threads(int64_t items) {
  std::atomic<uint64_t> seen{0};
  at::parallel_for(0, items, 1, [&](int64_t, int64_t) { seen |= uint64_t{1} << (at::get_thread_num() % 64); });
  return __builtin_popcountll(seen.load());
}

// The index of each row's largest value, as torch.argmax (the first of equal maxima; a NaN counts
// as the largest, the first NaN wins), on the calling thread alone: a decode step's greedy pick is
// one pass over a few vocabulary-wide rows, and torch's own reduction forks its OpenMP team, whose
// join waits out a scheduler time slice whenever another process holds a core. Two passes per row:
// the maximum, then its first index. The first keeps 16 lanes of float maxima and of absolute bit
// patterns (a NaN's is above infinity's), so it vectorizes: written as one loop with a bool for
// the NaN, GCC kept it scalar (2.4 ms for 64 rows of 32,000 on a Sapphire Rapids core; 0.6 now).
int64_t row_argmax_one(const float* v, int64_t n) {
  constexpr int kLanes = 16;
  constexpr uint32_t kAbs = 0x7fffffffu, kInf = 0x7f800000u;
  const auto abs_bits = [](float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    return bits & kAbs;
  };
  float top[kLanes];
  uint32_t widest[kLanes];
  std::fill_n(top, kLanes, v[0]);
  std::fill_n(widest, kLanes, 0u);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      top[l] = v[i + l] > top[l] ? v[i + l] : top[l];
      widest[l] = std::max(widest[l], abs_bits(v[i + l]));
    }
  }
  for (; i < n; ++i) {
    top[0] = v[i] > top[0] ? v[i] : top[0];
    widest[0] = std::max(widest[0], abs_bits(v[i]));
  }
  float best = top[0];
  uint32_t bits = widest[0];
  for (int l = 1; l < kLanes; ++l) {
    best = top[l] > best ? top[l] : best;
    bits = std::max(bits, widest[l]);
  }
  int64_t j = 0;
  if (bits > kInf) {  // NaN found from the bits: the build's -ffast-math lets the compiler assume x == x
    while (abs_bits(v[j]) <= kInf) ++j;
  } else {
    while (v[j] != best) ++j;
  }
  return j;
}

at::Tensor row_argmax(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 && x.size(1) > 0,
              "row_argmax: x must be a float32 [rows, n > 0] with contiguous rows");
  const int64_t rows = x.size(0), n = x.size(1);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) o[r] = row_argmax_one(x.data_ptr<float>() + r * x.stride(0), n);
  return out;
}

// Runs `jobs` jobs of `items` items each on a WorkPool of `threads`, every item adding 1 to its
// counter: the tests check that every counter ends at `jobs` (no chunk lost, none run twice), how
// many threads ran chunks, and on how many CPUs (where OpenMP's threads are pinned one per core,
// the pool's workers must be too, not on the caller's core). In the first job the calling thread holds its first chunk until a
// worker has run one (for at most 10 s): on a loaded machine a worker may otherwise never be on a
// core while the caller runs every chunk itself, which is the pool working as meant, not a fault.
std::tuple<at::Tensor, int64_t, int64_t> work_pool_counts(int64_t threads, int64_t jobs, int64_t items) {
  TORCH_CHECK(threads >= 1 && jobs >= 0 && items >= 0, "work_pool_counts: threads >= 1, jobs and items >= 0");
  at::Tensor counts = at::zeros({items}, at::kInt);
  int32_t* c = counts.data_ptr<int32_t>();
  std::mutex guard;
  std::set<std::thread::id> ran;
  std::set<int> cpus;
  const std::thread::id caller = std::this_thread::get_id();
  std::atomic<bool> helped{threads == 1}, held{false};
  pagedserve::WorkPool pool(static_cast<int>(threads));
  for (int64_t j = 0; j < jobs; ++j) {
    pool.run(0, items, 1, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) ++c[i];  // chunks never overlap: no two threads touch one item
      {
        std::lock_guard<std::mutex> lock(guard);
        ran.insert(std::this_thread::get_id());
#if defined(__linux__)
        cpus.insert(sched_getcpu());
#endif
      }
      if (std::this_thread::get_id() != caller) {
        helped.store(true);
      } else if (j == 0 && !held.exchange(true)) {
        const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
        while (!helped.load() && std::chrono::steady_clock::now() < until) std::this_thread::yield();
      }
    });
  }
  return {counts, static_cast<int64_t>(ran.size()), static_cast<int64_t>(cpus.size())};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor(b!)? residual, Tensor weight, float eps) -> ()");
  m.def("rotary_embedding(Tensor(a!) q, Tensor(b!) k, Tensor positions, Tensor cos, Tensor sin) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def("parallel_threads(int items) -> int", &parallel_threads);  // no tensor: one kernel for every key
  m.def("work_pool_counts(int threads, int jobs, int items) -> (Tensor, int, int)", &work_pool_counts);
  m.def("row_argmax(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("rms_norm", [](at::Tensor& out, const at::Tensor& x, const std::optional<at::Tensor>& residual,
                        const at::Tensor& weight, double eps) { pagedserve::ops::rms_norm(out, x, residual, weight, eps); });
  m.impl("rotary_embedding", [](at::Tensor& q, at::Tensor& k, const at::Tensor& positions, const at::Tensor& cos,
                                const at::Tensor& sin) { pagedserve::ops::rotary_embedding(q, k, positions, cos, sin); });
  m.impl("silu_and_mul", [](at::Tensor& out, const at::Tensor& x) { pagedserve::ops::silu_and_mul(out, x); });
  m.impl("row_argmax", &row_argmax);
}
