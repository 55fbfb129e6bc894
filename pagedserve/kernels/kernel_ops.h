// The kernels' entry points as C++ functions, for kernels that call other kernels directly
// (decode_stack.cpp runs a decode step's layers through them) instead of through the dispatcher.
// Each is also registered as a torch op under the same name (torch.ops.pagedserve.<name>), which is
// what Python calls; both routes run the same function, so both give the same bits.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <optional>
#include <string>

namespace pagedserve {
class WorkPool;  // work_pool.h; `pool` arguments: nullptr runs on torch's threads (at::parallel_for)
}  // namespace pagedserve

namespace pagedserve::ops {

// layer_ops.cpp
void rms_norm(at::Tensor& out, const at::Tensor& x, const std::optional<at::Tensor>& residual,
              const at::Tensor& weight, double eps, WorkPool* pool = nullptr);
void rotary_embedding(at::Tensor& q, at::Tensor& k, const at::Tensor& positions, const at::Tensor& cos,
                      const at::Tensor& sin, WorkPool* pool = nullptr);
void silu_and_mul(at::Tensor& out, const at::Tensor& x, WorkPool* pool = nullptr);

// paged_attention.cpp
void paged_decode_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, double scale, WorkPool* workers,
                            const std::optional<at::Tensor>& firsts = std::nullopt);

// tile_matmul.cpp
void tile_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                 c10::string_view isa_name, WorkPool* pool);

// half_matmul.cpp
void half_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                 const std::string& isa_name, WorkPool* pool);

}  // namespace pagedserve::ops

namespace pagedserve::gguf {

// gguf_matmul.cpp
void gguf_matmul(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, c10::string_view format,
                 const std::optional<at::Tensor>& bias, bool residual, c10::string_view isa_name, WorkPool* pool);

void gguf_matmul16(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, c10::string_view format,
                   const std::optional<at::Tensor>& bias, bool residual, c10::string_view isa_name, WorkPool* pool);

void gguf_gemm(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, c10::string_view format,
               const std::optional<at::Tensor>& bias, bool rows16, c10::string_view isa_name, bool residual,
               WorkPool* pool);
}  // namespace pagedserve::gguf
