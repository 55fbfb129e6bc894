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

// paged_attention_quantized.cpp: the same kernel over kv/quant.py's int8 / fp8 pools
void paged_decode_attention_quantized(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_data,
                                      const at::Tensor& v_data, const at::Tensor& k_scales,
                                      const at::Tensor& v_scales, const at::Tensor& block_tables,
                                      const at::Tensor& context_lens, double scale, c10::string_view kind,
                                      WorkPool* workers, const std::optional<at::Tensor>& firsts = std::nullopt);

// ... and over kv/int4.py's pools (tail_of: each block's tail slot as this step's decodes read it)
void paged_decode_attention_int4(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_data,
                                 const at::Tensor& v_data, const at::Tensor& k_steps, const at::Tensor& k_zeros,
                                 const at::Tensor& k_bits, const at::Tensor& v_scales, const at::Tensor& k_tail,
                                 const at::Tensor& v_tail, const at::Tensor& tail_of, const at::Tensor& block_tables,
                                 const at::Tensor& context_lens, double scale, c10::string_view isa_name,
                                 WorkPool* workers, const std::optional<at::Tensor>& firsts = std::nullopt);

// kv_write.cpp: a step's K or V rows into an int8 / fp8 pool; into an int4 one as its plan says
// (kv/int4.py's WritePlan)
void quantized_kv_write(at::Tensor& data, at::Tensor& scales, const at::Tensor& slots, const at::Tensor& x,
                        c10::string_view kind);
void int4_kv_write(const at::Tensor& x, at::Tensor& tail, at::Tensor& data, at::Tensor& scales,
                   at::Tensor& zero_points, const at::Tensor& key_bits, const at::Tensor& full_blocks,
                   const at::Tensor& full_slots, const at::Tensor& full_rows, const at::Tensor& full_tokens,
                   const at::Tensor& tail_rows, const at::Tensor& tail_tokens);
// int4 values' rotation (kv/int4.py), rows in float32, each row's sums in one fixed order
at::Tensor int4_rotate(const at::Tensor& x, const at::Tensor& rotation, WorkPool* pool);

// tile_matmul.cpp
void tile_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                 c10::string_view isa_name, WorkPool* pool);

// half_matmul.cpp
void half_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                 const std::string& isa_name, WorkPool* pool);

// head_screen.cpp
at::Tensor screened_logits(const at::Tensor& h, const at::Tensor& q, const at::Tensor& scale, const at::Tensor& bound,
                           const at::Tensor& weight, const std::string& out_dtype, const std::string& isa,
                           WorkPool* pool = nullptr);

}  // namespace pagedserve::ops

namespace pagedserve::gguf {

// gguf_matmul.cpp. `rounded`, where given (the decode stack's bf16 / f16 outputs): also receives
// out's values rounded to its dtype, as torch's .to() rounds, each task its own columns.
void gguf_matmul(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, c10::string_view format,
                 const std::optional<at::Tensor>& bias, bool residual, c10::string_view isa_name, WorkPool* pool,
                 at::Tensor* rounded = nullptr);

void gguf_matmul16(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, c10::string_view format,
                   const std::optional<at::Tensor>& bias, bool residual, c10::string_view isa_name, WorkPool* pool,
                   at::Tensor* rounded = nullptr);

void gguf_matmul16_pairs(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, c10::string_view format,
                         const at::Tensor& pairs, bool residual, c10::string_view isa_name, WorkPool* pool);

void gguf_gemm(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, c10::string_view format,
               const std::optional<at::Tensor>& bias, bool rows16, c10::string_view isa_name, bool residual,
               WorkPool* pool);

// x [rows, K] float32 -> int8 q, the scales d and the runs' sums s (with `low`, int16 activations)
void gguf_quantize_activations(at::Tensor& q, at::Tensor& d, at::Tensor& s, const at::Tensor& x,
                               c10::string_view isa_name, const std::optional<at::Tensor>& low);

// gguf_head_screen.cpp
at::Tensor gguf_screened_logits16(const at::Tensor& x, const at::Tensor& w, c10::string_view format,
                                  const at::Tensor& row_norms, c10::string_view isa, WorkPool* pool);
}  // namespace pagedserve::gguf
