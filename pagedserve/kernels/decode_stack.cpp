// A decode step's decoder layers in one native call: the Llama block (RMSNorm, fused QKV, rotary
// embedding, the KV write, paged decode attention, the output projection, RMSNorm, gate/up,
// SiLU-and-multiply, down) for every layer, over the rows of a decode batch; and Gemma 3's
// (use_gemma3_math: the attention and MLP outputs normed before they join the residual stream,
// QK-norm by the row kernel, GeGLU, each layer's own RoPE table and KV group, sliding windows).
//
// Why: the Python model makes about a dozen calls per layer, each costing microseconds of
// interpreter and dispatcher work, and between two kernels torch's worker threads idle long enough
// to go back to sleep; on the default model (30 layers, ~15 ms of kernels per token) that overhead
// was as large as the kernels themselves. Here the same kernels run back to back from C++.
//
// The arithmetic is the Python path's, call for call (models/llama.py, models/attention.py,
// kv/cache.py, kv/quant.py, kv/int4.py): the same kernel functions (kernel_ops.h) on the same
// tensors with the same dtype conversions, so the two paths give the same bits (tested). The KV
// pools are the model dtype's (head-major), int8 / fp8 ones (token-major, a float16 scale per token
// and head) or int4 ones (keys as bit planes per block, values rotated, open blocks in float16
// tails; each step's write planned by the host, kv/int4.py's WritePlan). The Python path stays the
// reference and runs whatever this does not take: prompt chunks, other linear layer kinds.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/InferenceMode.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include "convert.h"
#include "kernel_ops.h"
#include "work_pool.h"

#include <omp.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace pagedserve::decode_stack {

// How a linear layer holds its weight (models/native_decode.py maps each layer class to one).
enum class Kind { gguf, half, tile, onednn, dense };

Kind parse_kind(const std::string& name) {
  if (name == "gguf") return Kind::gguf;
  if (name == "half") return Kind::half;
  if (name == "tile") return Kind::tile;
  if (name == "onednn") return Kind::onednn;
  if (name == "dense") return Kind::dense;
  TORCH_CHECK(false, "DecodeStack: unknown linear kind '", name, "' (gguf, half, tile, onednn, dense)");
}

struct Linear {
  Kind kind = Kind::dense;
  std::vector<at::Tensor> weights;   // gguf: one per segment of output rows; otherwise one
  std::vector<std::string> formats;  // gguf: each segment's block format
  std::vector<int64_t> widths;       // gguf: each segment's output rows
  std::optional<at::Tensor> bias;
  bool residual = false;             // gguf: activations as int8 + the int8 of the residual
  int64_t out_features = 0;
  bool float_output = false;         // gguf: float32 out whatever x is (an LM head's logits)
  std::vector<bool> rows16;          // gguf: each segment in the rows16 layout or not (set_linear reads it
                                     // from a format named "Q4_1:rows16")
  int64_t gemm_above = 0;            // gguf: more rows than this go through gguf_gemm; 0: never
};

// How a layer's KV pools store their rows (models/native_decode.py's _pool_parts names them).
enum class KvKind { model, int8, fp8, int4 };

struct KvPools {
  KvKind kind = KvKind::model;
  std::string name;  // "int8" / "fp8", as the quantized kernels take it; empty for the model dtype's
  // int8 / fp8: k_scales, v_scales, float16 per token and head. int4 (kv/int4.py): k_scales the keys'
  // float8 steps, k_zeros and k_bits their zero points and channel widths, v_scales the values'
  // float16 scales, the float16 tails, the values' rotation; no_zeros / no_bits the empty tensors
  // int4_kv_write takes for values, made once.
  at::Tensor k_scales, v_scales, k_zeros, k_bits, k_tail, v_tail, rotation, no_zeros, no_bits;
};

struct Layer {
  at::Tensor input_norm, post_norm;          // post_norm: the residual-adding norm before the MLP
  std::optional<at::Tensor> q_norm, k_norm;  // Qwen3's and Gemma 3's per-head norms
  at::Tensor k_pool, v_pool;                 // the pools' data: [kv_heads, blocks, block_size, head_dim] in
                                             // the model dtype's; as kv/quant.py and kv/int4.py lay out theirs
  KvPools kv;                                // the pools' kind and, quantized, their other tensors
  int64_t group = 0;                         // its KV group: which slots, tables and lengths it takes
  int64_t rope = 0;                          // its RoPE table (add_rope)
  std::optional<at::Tensor> attn_out_norm, mlp_out_norm;  // Gemma 3's norms of each output
  Linear qkv, o, gate_up, down;
};

// A step's int4 write plan per KV group: full_blocks, full_slots, full_rows, full_tokens,
// tail_rows, tail_tokens (int4_kv_write's), then decode_slots (each block's tail slot as the step's
// decodes read it).
constexpr size_t kInt4Plan = 7, kInt4DecodeSlots = 6;

class DecodeStack : public torch::CustomClassHolder {
 public:
  // `threads`: the step's threads, in a WorkPool of this stack's own (work_pool.h: a worker the
  // scheduler has not put on a core never holds a step up); 0 runs the kernels on torch's OpenMP
  // threads instead.
  DecodeStack(int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t intermediate, double eps, double scale,
              at::Tensor cos, at::Tensor sin, at::Tensor final_norm, int64_t threads)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), intermediate_(intermediate), eps_(eps),
        scale_(scale), final_norm_(std::move(final_norm)),
        pool_(threads > 0 ? std::make_unique<WorkPool>(static_cast<int>(threads)) : nullptr) {
    add_rope(std::move(cos), std::move(sin));
  }

  // Another RoPE table (Gemma 3's local one); its index for add_layer.
  int64_t add_rope(at::Tensor cos, at::Tensor sin) {
    ropes_.emplace_back(std::move(cos), std::move(sin));
    return static_cast<int64_t>(ropes_.size()) - 1;
  }

  // Gemma 3's layer arithmetic (models/gemma3.py): QK-norm through the row kernel over [rows x
  // heads, head_dim] (Qwen3's stays torch's float32 path), GeGLU (gelu_tanh(gate) x up, torch's
  // ops) instead of SiLU-and-multiply.
  void use_gemma3_math() { gemma3_ = true; }

  // k_pool and v_pool: the pools' data. `kv_kind` empty: the model dtype's head-major pools;
  // "int8" / "fp8": kv/quant.py's, kv_parts their scales {k_scales, v_scales}; "int4": kv/int4.py's,
  // kv_parts {k_steps, k_zero_points, k_bits, v_scales, k_tail, v_tail, v_rotation}. The kernels
  // check the quantized pools' shapes as they run.
  void add_layer(at::Tensor input_norm, at::Tensor post_norm, std::optional<at::Tensor> q_norm,
                 std::optional<at::Tensor> k_norm, at::Tensor k_pool, at::Tensor v_pool, int64_t group, int64_t rope,
                 std::optional<at::Tensor> attn_out_norm, std::optional<at::Tensor> mlp_out_norm, std::string kv_kind,
                 std::vector<at::Tensor> kv_parts) {
    KvPools kv = parse_kv(std::move(kv_kind), kv_parts, v_pool);
    TORCH_CHECK(kv.kind != KvKind::model || (k_pool.dim() == 4 && k_pool.sizes() == v_pool.sizes() &&
                                             k_pool.size(0) == kv_heads_ && k_pool.size(3) == head_dim_),
                "DecodeStack: pools must be [kv_heads, blocks, block_size, head_dim]");
    TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous(), "DecodeStack: pools must be contiguous");
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "DecodeStack: q_norm and k_norm go together");
    TORCH_CHECK(group >= 0 && rope >= 0 && rope < static_cast<int64_t>(ropes_.size()),
                "DecodeStack: a layer's group must be >= 0 and its RoPE table one added");
    layers_.push_back(Layer{std::move(input_norm), std::move(post_norm), std::move(q_norm), std::move(k_norm),
                            std::move(k_pool), std::move(v_pool), std::move(kv), group, rope,
                            std::move(attn_out_norm), std::move(mlp_out_norm),
                            {}, {}, {}, {}});
  }

  // Layer `layer`'s linear `name` (qkv, o, gate_up, down), or with layer -1 the LM head (`head`).
  void set_linear(int64_t layer, const std::string& name, const std::string& kind, std::vector<at::Tensor> weights,
                  std::vector<std::string> formats, std::vector<int64_t> widths, std::optional<at::Tensor> bias,
                  bool residual, int64_t gemm_above) {
    const bool head = layer == -1 && name == "head";
    TORCH_CHECK(head || (layer >= 0 && layer < static_cast<int64_t>(layers_.size())), "DecodeStack: no layer ", layer);
    Linear l{parse_kind(kind), std::move(weights), std::move(formats), std::move(widths), std::move(bias), residual, 0,
             head};
    TORCH_CHECK(gemm_above >= 0 && (gemm_above == 0 || l.kind == Kind::gguf),
                "DecodeStack: only a GGUF linear takes gemm_above (>= 0)");
    l.gemm_above = gemm_above;
    TORCH_CHECK(!l.weights.empty(), "DecodeStack: a linear needs a weight");
    if (l.kind == Kind::gguf) {
      TORCH_CHECK(l.formats.size() == l.weights.size() && l.widths.size() == l.weights.size(),
                  "DecodeStack: a GGUF linear has one format and one width per segment");
      for (int64_t w : l.widths) l.out_features += w;
      for (std::string& format : l.formats) {  // "Q4_1:rows16": a segment in the rows16 layout (gguf_linear.py)
        const size_t colon = format.find(':');
        TORCH_CHECK(colon == std::string::npos || format.substr(colon) == ":rows16",
                    "DecodeStack: unknown GGUF layout in '", format, "' (rows16)");
        l.rows16.push_back(colon != std::string::npos);
        format = format.substr(0, colon);
      }
    } else {
      TORCH_CHECK(l.weights.size() == 1, "DecodeStack: only GGUF linears have segments");
      const bool packed = l.kind == Kind::onednn || l.kind == Kind::tile;
      l.out_features = packed ? (l.widths.empty() ? -1 : l.widths[0]) : l.weights[0].size(0);
      TORCH_CHECK(l.out_features > 0, "DecodeStack: a packed linear's width must be given (its weight's shape is not)");
    }
    if (l.kind == Kind::onednn && !onednn_linear_) {
      onednn_linear_ = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
    }
    if (head) {
      head_ = std::move(l);
      return;
    }
    Layer& L = layers_[layer];
    if (name == "qkv") L.qkv = std::move(l);
    else if (name == "o") L.o = std::move(l);
    else if (name == "gate_up") L.gate_up = std::move(l);
    else if (name == "down") L.down = std::move(l);
    else TORCH_CHECK(false, "DecodeStack: no linear named '", name, "' (qkv, o, gate_up, down)");
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // Have the stack's pool count where its threads' time goes from now on (work_pool.h's
  // PoolTimes), or stop; nothing without a pool. Between steps.
  void count_pool_times(bool on) {
    if (pool_) pool_->count_times(on);
  }

  // The stack's pool's time counted so far (count_pool_times; in ticks) and `now`, the tick count at
  // this call, so a reader can turn ticks into seconds against its own clock; every field 0 without
  // a pool (a stack on torch's threads) or before it counts. Read between steps.
  c10::Dict<std::string, int64_t> pool_times() const {
    c10::Dict<std::string, int64_t> out;
    const PoolTimes none;
    const PoolTimes& t = pool_ ? pool_->times() : none;
    out.insert("threads", pool_ ? pool_->threads() : 1);
    out.insert("now", static_cast<int64_t>(pool_ticks()));
    out.insert("jobs", t.jobs);
    out.insert("chunks", t.chunks);
    out.insert("alone_jobs", t.alone_jobs);
    out.insert("job", static_cast<int64_t>(t.job));
    out.insert("caller_wait", static_cast<int64_t>(t.caller_wait));
    out.insert("alone", static_cast<int64_t>(t.alone));
    out.insert("between", static_cast<int64_t>(t.between));
    out.insert("worker_busy", static_cast<int64_t>(t.worker_busy.load(std::memory_order_relaxed)));
    return out;
  }

  // Float32 logits of hidden states [rows, hidden] through the LM head (set_linear(-1, "head", ...)),
  // as compute_logits in models/llama.py: the head's output, then .float().
  at::Tensor logits(at::Tensor x) const {
    TORCH_CHECK(head_.has_value(), "DecodeStack: no LM head was set");
    const OneOpenMPThread serial(pool_ != nullptr);  // as forward
    return converted(apply(*head_, x), at::kFloat);
  }

  // The LM head's screen for a greedy pick (models/head_screen.py: its tensors), on the stack's
  // threads: the same bits as the registered op, without waking OpenMP's team beside the pool.
  at::Tensor screened_logits(at::Tensor h, at::Tensor q, at::Tensor scale, at::Tensor bound, at::Tensor weight,
                             std::string out_dtype) const {
    const OneOpenMPThread serial(pool_ != nullptr);  // as forward
    return ops::screened_logits(h, q, scale, bound, weight, out_dtype, "auto", pool_.get());
  }

  // A GGUF Q8_0 head's screen for a greedy pick of several rows (models/head_screen.py,
  // GGUFHeadScreen; gguf_head_screen.cpp), on the stack's threads: the registered op's bits.
  at::Tensor screened_head_logits(at::Tensor h, at::Tensor row_norms) const {
    TORCH_CHECK(head_.has_value() && head_->kind == Kind::gguf && head_->weights.size() == 1 && head_->rows16[0] &&
                    head_->residual && !head_->bias,
                "DecodeStack: a screened head is one rows16 GGUF segment at int16 activations, without a bias");
    const OneOpenMPThread serial(pool_ != nullptr);  // as forward
    return gguf::gguf_screened_logits16(h, head_->weights[0], head_->formats[0], row_norms, "auto", pool_.get());
  }

  // Hidden states [rows, hidden] after the final norm, for x [rows, hidden] (the token embeddings),
  // each row one decode token at `positions`. Per KV group g (one for a model without groups): the
  // rows' `slots[g]`, and the `block_tables[g]` through which they attend to `context_lens[g]`
  // tokens, from `firsts[g]` on where given (a sliding window's view); over int4 pools, the step's
  // write plan for g, made by the host for every layer: kInt4Plan tensors from
  // int4_plans[kInt4Plan * g], in kInt4Plan's order (kv/int4.py's WritePlan fields).
  at::Tensor forward(at::Tensor x, at::Tensor positions, std::vector<at::Tensor> slots,
                     std::vector<at::Tensor> block_tables, std::vector<at::Tensor> context_lens,
                     std::vector<std::optional<at::Tensor>> firsts, std::vector<at::Tensor> int4_plans) {
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "DecodeStack: x must be a contiguous [rows, hidden]");
    const OneOpenMPThread serial(pool_ != nullptr);
    const size_t groups = slots.size();
    TORCH_CHECK(block_tables.size() == groups && context_lens.size() == groups && firsts.size() == groups,
                "DecodeStack: one slot mapping, table, length and start list per KV group");
    for (const Layer& L : layers_) {
      TORCH_CHECK(L.group < static_cast<int64_t>(groups), "DecodeStack: no metadata for KV group ", L.group);
      TORCH_CHECK(L.kv.kind != KvKind::int4 || int4_plans.size() == kInt4Plan * groups,
                  "DecodeStack: int4 KV pools take a write plan of ", kInt4Plan, " tensors per KV group");
    }
    const int64_t t = x.size(0), q_size = heads_ * head_dim_;
    // Every layer's intermediates have the same shapes: allocated by the first layer and reused by
    // the rest, so a token makes a dozen allocations, not ~400, and writes the same cache lines.
    Outputs qkv_out, o_out, gate_up_out, down_out;
    at::Tensor h = at::empty_like(x), h2 = at::empty_like(x);
    at::Tensor act, attended, q_rows;
    QkvViews qkv_views;
    at::Tensor residual;  // the residual stream: the embeddings, then each layer's sum, in place
    for (Layer& L : layers_) {
      if (!residual.defined()) {
        residual = x;
        ops::rms_norm(h, x, std::nullopt, L.input_norm, eps_, pool_.get());
      } else {
        ops::rms_norm(h, x, residual, L.input_norm, eps_, pool_.get());
      }
      const at::Tensor qkv = apply(L.qkv, h, &qkv_out);
      if (!qkv.is_same(qkv_views.of)) qkv_views = QkvViews(qkv, heads_, kv_heads_, head_dim_);
      at::Tensor q = qkv_views.q, k = qkv_views.k;
      const at::Tensor& v = qkv_views.v;
      if (L.q_norm) {
        q = gemma3_ ? row_norm(q, *L.q_norm) : head_norm(q, *L.q_norm);
        k = gemma3_ ? row_norm(k, *L.k_norm) : head_norm(k, *L.k_norm);
      }
      const auto& [cos, sin] = ropes_[L.rope];
      ops::rotary_embedding(q, k, positions, cos, sin, pool_.get());
      const int64_t g = L.group;
      const at::Tensor* plan = L.kv.kind == KvKind::int4 ? &int4_plans[kInt4Plan * g] : nullptr;
      write_kv(L, slots[g], plan, k, v, pool_.get());
      const at::Tensor attention =
          attend(L, contiguous_rows(q, q_rows), block_tables[g], context_lens[g], firsts[g], plan, attended);
      at::Tensor a = apply(L.o, attention.reshape({t, q_size}), &o_out);
      if (L.attn_out_norm) a = normed(a, *L.attn_out_norm);
      ops::rms_norm(h2, a, residual, L.post_norm, eps_, pool_.get());
      const at::Tensor gate_up = apply(L.gate_up, h2, &gate_up_out);
      if (!act.defined()) act = at::empty({t, intermediate_}, gate_up.options());
      if (gemma3_) {
        geglu(act, gate_up);
      } else {
        ops::silu_and_mul(act, gate_up, pool_.get());
      }
      x = apply(L.down, act, &down_out);
      if (L.mlp_out_norm) x = normed(x, *L.mlp_out_norm);
    }
    at::Tensor out = at::empty_like(x);
    ops::rms_norm(out, x, residual, final_norm_, eps_, pool_.get());
    return out;
  }

 private:
  // With a pool, the torch ops a thread runs between the kernels (q made contiguous, the q/k
  // norms, Gemma's GELU on the pool's workers) stay on it: from 16-32k values torch splits them over
  // OpenMP's team, whose worker then spins on a core the pool computes on (64 streams of the default
  // file, q's copy alone: 0.63x the rate). OpenMP's thread count is each thread's own setting (its
  // nthreads ICV), so it is 1 for the call and restored after; c10::ParallelGuard did not stop
  // torch's TensorIterator loops from forking on the calling thread.
  struct OneOpenMPThread {
    int saved = 0;
    explicit OneOpenMPThread(bool on) {
      if (on) {
        saved = omp_get_max_threads();
        omp_set_num_threads(1);
      }
    }
    ~OneOpenMPThread() {
      if (saved > 0) omp_set_num_threads(saved);
    }
    OneOpenMPThread(const OneOpenMPThread&) = delete;
    OneOpenMPThread& operator=(const OneOpenMPThread&) = delete;
  };

  // q, k and v [rows, heads, head_dim]: views into a fused QKV output `of`. Made once a step where
  // the layers share one output buffer (GGUF linears: Outputs), since four view ops a layer cost
  // ~6 us of dispatch at 16 rows.
  struct QkvViews {
    at::Tensor of, q, k, v;
    QkvViews() = default;
    QkvViews(const at::Tensor& qkv, int64_t heads, int64_t kv_heads, int64_t head_dim) : of(qkv) {
      const int64_t t = qkv.size(0), q_size = heads * head_dim, kv_size = kv_heads * head_dim;
      const auto parts = qkv.split_with_sizes({q_size, kv_size, kv_size}, -1);
      q = parts[0].view({t, heads, head_dim});
      k = parts[1].view({t, kv_heads, head_dim});
      v = parts[2].view({t, kv_heads, head_dim});
    }
  };

  // A GGUF linear's outputs in one step, kept from layer to layer (forward): the kernel's float32
  // and its conversion to the compute dtype. Empty until the first layer allocates them.
  struct Outputs {
    at::Tensor y, converted;
  };

  // y = x W^T + b as the layer's Python class computes it (models/gguf_linear.py, half_linear.py,
  // packed.py, nn.Linear); a GGUF linear writes into `reuse` where given (allocated there once).
  at::Tensor apply(const Linear& l, const at::Tensor& x, Outputs* reuse = nullptr) const {
    switch (l.kind) {
      case Kind::gguf: {
        const at::Tensor rows = x.contiguous();
        Outputs fresh;
        Outputs& o = reuse ? *reuse : fresh;
        // A batch past the integer kernels' rows goes through GGUFLinear's GEMM (gguf_gemm.inc in bf16,
        // gguf_gemm_f32.inc in float32, gguf_gemm_int.inc in float32 on AVX2), which writes the
        // compute dtype (an LM head's float32) itself;
        // the integer kernels write float32, converted below.
        const bool gemm = l.gemm_above > 0 && rows.size(0) > l.gemm_above;
        const bool direct = gemm && !l.float_output;
        at::Tensor& y = direct ? o.converted : o.y;
        if (!y.defined() || y.size(1) != l.out_features) {
          y = at::empty({rows.size(0), l.out_features}, rows.options().dtype(direct ? rows.scalar_type() : at::kFloat));
          if (!direct) o.converted = at::Tensor();
        }
        // The integer kernels' float32 rounded to the compute dtype by the kernels' own tasks, each
        // its columns while they are in its cache (a pass after them ran on this thread alone:
        // 0.9 ms of a 16-stream step; and torch's .to() splits anything over 32k values across
        // OpenMP's team, whose worker then spins on the core the pool computes on).
        const bool round = !gemm && !l.float_output && x.scalar_type() != at::kFloat;
        if (round && !o.converted.defined()) o.converted = at::empty(y.sizes(), y.options().dtype(x.scalar_type()));
        int64_t offset = 0;
        for (size_t i = 0; i < l.weights.size(); ++i) {
          const bool whole = l.weights.size() == 1;
          at::Tensor part = whole ? y : y.narrow(1, offset, l.widths[i]);
          const std::optional<at::Tensor> bias = l.bias && !whole
              ? std::optional<at::Tensor>(l.bias->narrow(0, offset, l.widths[i])) : l.bias;
          if (gemm) {
            gguf::gguf_gemm(part, rows, l.weights[i], l.formats[i], bias, l.rows16[i], "auto", l.residual, pool_.get());
          } else {
            at::Tensor rounded =
                !round ? at::Tensor() : whole ? o.converted : o.converted.narrow(1, offset, l.widths[i]);
            const auto matmul = l.rows16[i] ? &gguf::gguf_matmul16 : &gguf::gguf_matmul;
            matmul(part, rows, l.weights[i], l.formats[i], bias, l.residual, "auto", pool_.get(),
                   round ? &rounded : nullptr);
          }
          offset += l.widths[i];
        }
        return round ? o.converted : y;
      }
      case Kind::half: {
        const at::Tensor rows = x.stride(-1) == 1 ? x : x.contiguous();
        at::Tensor y = at::empty({rows.size(0), l.out_features}, rows.options().dtype(at::kFloat));
        ops::half_linear(y, rows, l.weights[0], l.bias, "auto", pool_.get());
        return y;
      }
      case Kind::tile: {
        const at::Tensor rows = x.stride(-1) == 1 && x.stride(0) >= x.size(1) ? x : x.contiguous();
        at::Tensor y = at::empty({rows.size(0), l.out_features}, rows.options());
        ops::tile_linear(y, rows, l.weights[0], l.bias, "auto", pool_.get());
        return y;
      }
      case Kind::onednn: {
        std::vector<c10::IValue> stack{x, l.weights[0], l.bias, std::string("none"),
                                       c10::List<std::optional<at::Scalar>>(), std::string("")};
        onednn_linear_->callBoxed(stack);
        return stack[0].toTensor();
      }
      case Kind::dense:
        return at::linear(x, l.weights[0], l.bias);
    }
    TORCH_CHECK(false, "DecodeStack: unreachable");
  }

  // RMSNorm of contiguous rows [n, dim] into a new tensor, by the native kernel (models/llama.py's
  // RMSNorm on 2-D rows).
  at::Tensor normed(const at::Tensor& x, const at::Tensor& weight) const {
    at::Tensor out = at::empty_like(x);
    ops::rms_norm(out, x, std::nullopt, weight, eps_, pool_.get());
    return out;
  }

  // Gemma 3's q/k norm: each head's row through the native kernel ([rows x heads, head_dim]), the
  // heads of x [rows, heads, head_dim] (a view into the fused QKV output) copied together first
  // (on this thread: forward's OneOpenMPThread).
  at::Tensor row_norm(const at::Tensor& x, const at::Tensor& weight) const {
    return normed(x.contiguous().view({-1, head_dim_}), weight).view(x.sizes());
  }

  // Gemma 3's GeGLU, out = gelu_tanh(gate) x up (gate_up [rows, 2 x intermediate]): torch's ops,
  // as models/gemma3.py's Gemma3MLP computes them (elementwise: the same bits in any split). On the
  // stack's pool, its rows split over the pool's threads, each worker's torch ops kept on it
  // (OneOpenMPThread): torch's GELU forks OpenMP's team from 16k values, whose workers then spun
  // on the cores the pool computes on (16 streams of Gemma 3 270M at 0.7x the Python model's rate).
  void geglu(at::Tensor& out, const at::Tensor& gate_up) const {
    const auto rows = [&](int64_t r0, int64_t r1) {
      c10::InferenceMode inference;  // as the engine's step thread: a pool worker's mode is its own
      const OneOpenMPThread serial(pool_ != nullptr);
      const at::Tensor x = gate_up.narrow(0, r0, r1 - r0);
      at::Tensor dst = out.narrow(0, r0, r1 - r0);
      at::mul_out(dst, at::gelu(x.narrow(1, 0, intermediate_), "tanh"), x.narrow(1, intermediate_, intermediate_));
    };
    if (pool_ == nullptr) return rows(0, gate_up.size(0));  // torch's own threads
    pagedserve::parallel_for(pool_.get(), 0, gate_up.size(0), 1, rows);
  }

  // Qwen3's q/k norm over each head: RMSNorm's torch path (the native one takes 2-D rows only),
  // in float32 and cast back, as transformers computes it.
  at::Tensor head_norm(const at::Tensor& x, const at::Tensor& weight) const {
    at::Tensor xf = x.to(at::kFloat);
    xf = xf * at::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps_);
    return weight * xf.to(x.scalar_type());
  }

  // The layer's K and V rows into its pools, as the pool classes' write() stores them: the model
  // dtype's (HeadMajorKVCache, write_head_major); int8 / fp8 (QuantizedKVCache: quantized_kv_write);
  // int4 (Int4KVCache: float16 rows, the values rotated first, written as the step's `plan` says).
  static void write_kv(Layer& L, const at::Tensor& slots, const at::Tensor* plan, const at::Tensor& k,
                       const at::Tensor& v, WorkPool* pool) {
    KvPools& kv = L.kv;
    switch (kv.kind) {
      case KvKind::model:
        write_head_major(L.k_pool, slots, k, pool);
        write_head_major(L.v_pool, slots, v, pool);
        return;
      case KvKind::int8:
      case KvKind::fp8:
        ops::quantized_kv_write(L.k_pool, kv.k_scales, slots, k, kv.name);
        ops::quantized_kv_write(L.v_pool, kv.v_scales, slots, v, kv.name);
        return;
      case KvKind::int4: {
        const at::Tensor keys = k.to(at::kHalf).contiguous();
        const at::Tensor values = ops::int4_rotate(v, kv.rotation, pool).to(at::kHalf);
        ops::int4_kv_write(keys, kv.k_tail, L.k_pool, kv.k_scales, kv.k_zeros, kv.k_bits, plan[0], plan[1], plan[2],
                           plan[3], plan[4], plan[5]);
        ops::int4_kv_write(values, kv.v_tail, L.v_pool, kv.v_scales, kv.no_zeros, kv.no_bits, plan[0], plan[1],
                           plan[2], plan[3], plan[4], plan[5]);
        return;
      }
    }
  }

  // add_layer's kv_kind and kv_parts, checked and named.
  static KvPools parse_kv(std::string kind, std::vector<at::Tensor>& parts, const at::Tensor& v_pool) {
    KvPools kv;
    const auto expect_parts = [&](size_t count) {
      TORCH_CHECK(parts.size() == count, "DecodeStack: ", kind.empty() ? "the model dtype's" : kind, " KV pools take ",
                  count, " more tensors, got ", parts.size());
    };
    if (kind.empty()) {
      expect_parts(0);
    } else if (kind == "int8" || kind == "fp8") {
      expect_parts(2);
      kv.kind = kind == "int8" ? KvKind::int8 : KvKind::fp8;
      kv.k_scales = parts[0];
      kv.v_scales = parts[1];
    } else if (kind == "int4") {
      expect_parts(7);
      kv.kind = KvKind::int4;
      kv.k_scales = parts[0];
      kv.k_zeros = parts[1];
      kv.k_bits = parts[2];
      kv.v_scales = parts[3];
      kv.k_tail = parts[4];
      kv.v_tail = parts[5];
      kv.rotation = parts[6];
      // values carry no zero points or key bits: empty, as Int4KVCache.write passes them
      kv.no_zeros = at::empty({0}, v_pool.options().dtype(at::kChar));
      kv.no_bits = at::empty({0}, v_pool.options());
    } else {
      TORCH_CHECK(false, "DecodeStack: KV pools are the model dtype's, int8, fp8 or int4, not ", kind);
    }
    kv.name = std::move(kind);
    return kv;
  }

  // HeadMajorKVCache.write: token i's [kv_heads, head_dim] (x's rows may be strided, a view into
  // the fused QKV output) to flat slot slots[i] of every head, converted to the pool's dtype as
  // torch's .to() rounds. A plain loop: the torch ops it replaces (a conversion and an index_copy_)
  // cost microseconds each of dispatch for a few hundred values, twice per layer. Its rows split
  // over the stack's threads: each row's slots are cache lines the step has not touched, and one
  // thread writing 16 rows' waited on their misses (14 us a layer, the pool's worker idle).
  static void write_head_major(at::Tensor& kv_pool, const at::Tensor& slots, const at::Tensor& x, WorkPool* pool) {
    const int64_t t = x.size(0), heads = x.size(1), hd = x.size(2), per_head = kv_pool.size(1) * kv_pool.size(2);
    TORCH_CHECK(x.stride(2) == 1 && slots.scalar_type() == at::kLong && slots.numel() == t,
                "DecodeStack: KV rows must have contiguous head_dim and one int64 slot each");
    const int64_t* slot = slots.data_ptr<int64_t>();
    for (int64_t i = 0; i < t; ++i)  // here, not in the tasks: a pool's worker cannot throw
      TORCH_CHECK(slot[i] >= 0 && slot[i] < per_head, "DecodeStack: slot ", slot[i], " out of range");
    dispatch_model_dtype(x.scalar_type(), "DecodeStack", [&](auto src_tag) {
      using S = decltype(src_tag);
      dispatch_model_dtype(kv_pool.scalar_type(), "DecodeStack", [&](auto dst_tag) {
        using D = decltype(dst_tag);
        const S* src = x.data_ptr<S>();
        D* dst = kv_pool.data_ptr<D>();
        const int64_t row_stride = x.stride(0), head_stride = x.stride(1);
        pagedserve::parallel_rows(pool, t, heads * hd, [&](int64_t i0, int64_t i1) {
          for (int64_t i = i0; i < i1; ++i)
            for (int64_t h = 0; h < heads; ++h)
              convert_row(dst + (h * per_head + slot[i]) * hd, src + i * row_stride + h * head_stride, hd);
        });
      });
    });
  }

  // q [rows, heads, head_dim] contiguous: q itself where it is, else copied into `rows` (made by
  // the first layer, reused by the rest), a memcpy per row where its heads lie side by side (a view
  // into the fused QKV output): torch's strided copy took ~8 us a layer at 16 rows.
  static at::Tensor contiguous_rows(const at::Tensor& q, at::Tensor& rows) {
    if (q.is_contiguous()) return q;
    if (q.dim() != 3 || q.stride(2) != 1 || q.stride(1) != q.size(2)) return q.contiguous();
    if (!rows.defined()) rows = at::empty(q.sizes(), q.options());
    const int64_t size = q.element_size(), bytes = q.size(1) * q.size(2) * size, stride = q.stride(0) * size;
    const auto* src = static_cast<const std::byte*>(q.data_ptr());
    auto* dst = static_cast<std::byte*>(rows.data_ptr());
    for (int64_t i = 0; i < q.size(0); ++i) std::memcpy(dst + i * bytes, src + i * stride, bytes);
    return rows;
  }

  // x [rows, ...] (contiguous) in `dtype`, converted as torch's .to() rounds; x itself if it has it.
  static at::Tensor converted(const at::Tensor& x, at::ScalarType dtype) {
    if (x.scalar_type() == dtype) return x;
    at::Tensor out = at::empty(x.sizes(), x.options().dtype(dtype));
    convert_into(out, x);
    return out;
  }

  // out = x converted to out's dtype (both contiguous, the same number of values).
  static void convert_into(at::Tensor& out, const at::Tensor& x) {
    dispatch_model_dtype(x.scalar_type(), "DecodeStack", [&](auto src_tag) {
      using S = decltype(src_tag);
      dispatch_model_dtype(out.scalar_type(), "DecodeStack", [&](auto dst_tag) {
        using D = decltype(dst_tag);
        convert_row(out.data_ptr<D>(), x.data_ptr<S>(), x.numel());
      });
    });
  }

  // The fused decode kernel in the pools' dtype (bf16 pools under float32 compute: q converted in,
  // the output converted back); over int8 / fp8 pools, its quantized entry point, in q's dtype;
  // over int4 pools, in float32 in the values' stored basis, its output rotated back (models/
  // attention.py's _attention), each block read from its tail slot as the step's `plan` says.
  at::Tensor attend(const Layer& L, const at::Tensor& q, const at::Tensor& tables, const at::Tensor& lens,
                    const std::optional<at::Tensor>& firsts, const at::Tensor* plan, at::Tensor& out) const {
    const KvPools& kv = L.kv;
    if (kv.kind == KvKind::int4) {
      const at::Tensor qf = q.to(at::kFloat);
      at::Tensor stored = at::empty_like(qf);
      ops::paged_decode_attention_int4(stored, qf, L.k_pool, L.v_pool, kv.k_scales, kv.k_zeros, kv.k_bits, kv.v_scales,
                                       kv.k_tail, kv.v_tail, plan[kInt4DecodeSlots], tables, lens, scale_, "auto",
                                       pool_.get(), firsts);
      return ops::int4_rotate(stored, kv.rotation, pool_.get()).to(q.scalar_type());
    }
    if (kv.kind != KvKind::model) {
      if (!out.defined()) out = at::empty_like(q);
      ops::paged_decode_attention_quantized(out, q, L.k_pool, L.v_pool, kv.k_scales, kv.v_scales, tables, lens, scale_,
                                            kv.name, pool_.get(), firsts);
      return out;
    }
    if (!out.defined()) out = at::empty_like(q, q.options().dtype(L.k_pool.scalar_type()));
    ops::paged_decode_attention(out, converted(q, L.k_pool.scalar_type()), L.k_pool, L.v_pool, tables, lens, scale_,
                                pool_.get(), firsts);
    return converted(out, q.scalar_type());
  }

  int64_t heads_, kv_heads_, head_dim_, intermediate_;
  double eps_, scale_;
  at::Tensor final_norm_;
  std::vector<std::pair<at::Tensor, at::Tensor>> ropes_;  // (cos, sin) tables; 0 the constructor's
  bool gemma3_ = false;
  std::vector<Layer> layers_;
  std::optional<Linear> head_;
  std::optional<c10::OperatorHandle> onednn_linear_;
  std::unique_ptr<WorkPool> pool_;
};

}  // namespace pagedserve::decode_stack

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  using pagedserve::decode_stack::DecodeStack;
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<int64_t, int64_t, int64_t, int64_t, double, double, at::Tensor, at::Tensor, at::Tensor, int64_t>())
      .def("add_rope", &DecodeStack::add_rope)
      .def("use_gemma3_math", &DecodeStack::use_gemma3_math)
      .def("add_layer", &DecodeStack::add_layer)
      .def("set_linear", &DecodeStack::set_linear)
      .def("num_layers", &DecodeStack::num_layers)
      .def("count_pool_times", &DecodeStack::count_pool_times)
      .def("pool_times", &DecodeStack::pool_times)
      .def("logits", &DecodeStack::logits)
      .def("screened_logits", &DecodeStack::screened_logits)
      .def("screened_head_logits", &DecodeStack::screened_head_logits)
      .def("forward", &DecodeStack::forward);
}
