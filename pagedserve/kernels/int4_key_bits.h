// int4 KV's key widths (kv/int4.py): k_bits [kv_heads, head_dim] uint8, checked as check_key_bits
// does, once for the writer (kv_write.cpp) and the decode kernel (paged_attention_quantized.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace pagedserve {

constexpr int64_t kKeyBits = 4, kMaxKeyBits = 8;  // a key channel's bits: 4 on average over a head, 1..8 each

// Each channel's first plane within its head (the planes run channel after channel), after checking
// the widths: 1..8 a channel and 4 * head_dim a head, so a head's planes fill its bytes exactly (a
// wider head would read another head's planes, or past the block). `op` names the caller.
inline std::vector<int32_t> first_key_planes(const at::Tensor& key_bits, int64_t kvh, int64_t hd, const char* op) {
  TORCH_CHECK(key_bits.scalar_type() == at::kByte && key_bits.is_contiguous() &&
                  key_bits.sizes() == at::IntArrayRef({kvh, hd}),
              op, ": key bits must be contiguous uint8 [kvh, head_dim] = [", kvh, ", ", hd, "], got ",
              key_bits.scalar_type(), " ", key_bits.sizes());
  const uint8_t* bits = key_bits.data_ptr<uint8_t>();
  std::vector<int32_t> first(kvh * hd);
  for (int64_t h = 0; h < kvh; ++h) {
    int32_t total = 0;
    for (int64_t d = 0; d < hd; ++d) {
      const int64_t c = h * hd + d;
      TORCH_CHECK(bits[c] >= 1 && bits[c] <= kMaxKeyBits, op, ": key bits must be 1..", kMaxKeyBits,
                  " a channel, got ", int(bits[c]), " for KV head ", h, " channel ", d);
      first[c] = total;
      total += bits[c];
    }
    TORCH_CHECK(total == kKeyBits * hd, op, ": key bits must total ", kKeyBits * hd, " (4 * head_dim) a KV head, got ",
                total, " for KV head ", h);
  }
  return first;
}

}  // namespace pagedserve
