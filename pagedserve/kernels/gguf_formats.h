// GGUF's quantized block formats, as llama.cpp writes them, and their portable dequantization: the
// reference every SIMD path is tested against (and the tests check it against the `gguf` package's
// own dequantizer). A block covers `elems` consecutive weights of one row in `bytes` bytes; a
// row is its blocks back to back. Scales are float16; K-quants pack 6-bit sub-block scales.
//
//   Q4_0  d, 16 B nibbles                   w = (q - 8) d          q in [0, 15]
//   Q4_1  d, m, 16 B nibbles                w = q d + m
//   Q5_0  d, 4 B high bits, 16 B nibbles    w = (q - 16) d         q in [0, 31]
//   Q5_1  d, m, 4 B high bits, 16 B         w = q d + m
//   Q8_0  d, 32 int8                        w = q d
//   Q4_K  256 weights: d, dmin, 12 B of eight 6-bit (scale, min), 128 B nibbles
//                                           w = d sc_j q - dmin m_j    (sub-blocks j of 32)
//   Q5_K  as Q4_K plus 32 B of high bits    q in [0, 31]
//   Q6_K  256 weights: 128 B low nibbles, 64 B of 2-bit highs, 16 int8 scales, d
//                                           w = d sc_i (q - 32)        (sub-blocks i of 16)
// In the 32-weight formats byte j holds weight j (low nibble) and j + 16 (high nibble); K-quants
// lay each 64 weights out as 32 bytes, low nibbles the first 32, high nibbles the next 32.
#pragma once

#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <string_view>

namespace pagedserve::gguf {

enum class Format : int { q4_0, q4_1, q5_0, q5_1, q8_0, q4_k, q5_k, q6_k };

struct FormatInfo {
  const char* name;
  int elems;  // weights per block
  int bytes;  // bytes per block
};

constexpr FormatInfo info(Format f) {
  switch (f) {
    case Format::q4_0: return {"Q4_0", 32, 18};
    case Format::q4_1: return {"Q4_1", 32, 20};
    case Format::q5_0: return {"Q5_0", 32, 22};
    case Format::q5_1: return {"Q5_1", 32, 24};
    case Format::q8_0: return {"Q8_0", 32, 34};
    case Format::q4_k: return {"Q4_K", 256, 144};
    case Format::q5_k: return {"Q5_K", 256, 176};
    case Format::q6_k: return {"Q6_K", 256, 210};
  }
  return {"?", 1, 1};
}

inline Format parse_format(std::string_view name, const char* op) {
  for (Format f : {Format::q4_0, Format::q4_1, Format::q5_0, Format::q5_1, Format::q8_0, Format::q4_k,
                   Format::q5_k, Format::q6_k})
    if (name == info(f).name) return f;
  TORCH_CHECK(false, op, ": unsupported GGUF format '", name, "' (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)");
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// K-quants' j-th (scale, min) of eight, 6 bits each, packed into 12 bytes: the first four in the
// low 6 bits of bytes 0-3 / 4-7, the last four split between bytes 8-11 and the top bits of 0-7.
inline void k_scale_min(const uint8_t* s, int j, int& scale, int& min) {
  if (j < 4) {
    scale = s[j] & 63;
    min = s[j + 4] & 63;
  } else {
    scale = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// The kernels' layout of a row of a 32-weight format ("planes"): every block's integer bytes back
// to back (Q5's 4 high-bit bytes, then its 16 nibble bytes), then every block's d, then every
// block's m (Q4_1, Q5_1). The same bytes as GGUF's, regrouped so that a kernel converts eight blocks'
// scales with one instruction instead of one at a time. K-quants keep GGUF's layout.
constexpr bool planar(Format f) { return f != Format::q4_k && f != Format::q5_k && f != Format::q6_k; }
// The SIMD paths read Q4_0 / Q4_1 two blocks at a time (gguf_simd.inc's planar_pair), against
// activations whose runs are swizzled to match: in each pair of 32-value runs, values 16-31 of the
// first and 0-15 of the second trade places. The scalar path reads them in their own order.
constexpr bool pairs_swizzled(Format f) { return f == Format::q4_0 || f == Format::q4_1; }
constexpr bool with_min(Format f) { return f == Format::q4_1 || f == Format::q5_1; }
constexpr int quant_bytes(Format f) {
  return f == Format::q8_0 ? 32 : (f == Format::q5_0 || f == Format::q5_1) ? 20 : 16;
}

// Activations are quantized per 32 values to int8 with scale d = max|x| / 127 (llama.cpp's Q8
// activations): these two give d and the multiplier 1 / d, shared by every path so they all see the
// same integers.
inline float activation_scale(float amax) { return amax / 127.f; }
inline float activation_inverse(float amax) { return amax > 0.f ? 127.f / amax : 0.f; }
// Int16 activations: the int8 value's remainder (at most d / 2) in steps of d / 254, so it fits an
// int8 without clamping; a value is (254 q + low) x d / 254 and a kernel joins the two integer
// sums exactly in int32.
constexpr int kLowSteps = 254;

// One block's weights as floats, in row order.
inline void dequantize_block(Format f, const uint8_t* b, float* y) {
  switch (f) {
    case Format::q4_0:
    case Format::q4_1: {
      const float d = half_at(b);
      const float m = f == Format::q4_1 ? half_at(b + 2) : -8.f * d;
      const uint8_t* qs = b + (f == Format::q4_1 ? 4 : 2);
      for (int j = 0; j < 16; ++j) {
        y[j] = static_cast<float>(qs[j] & 0x0F) * d + m;
        y[j + 16] = static_cast<float>(qs[j] >> 4) * d + m;
      }
      return;
    }
    case Format::q5_0:
    case Format::q5_1: {
      const bool with_min = f == Format::q5_1;
      const float d = half_at(b);
      const float m = with_min ? half_at(b + 2) : -16.f * d;
      uint32_t qh;
      std::memcpy(&qh, b + (with_min ? 4 : 2), 4);
      const uint8_t* qs = b + (with_min ? 8 : 6);
      for (int j = 0; j < 16; ++j) {
        const int lo = (qs[j] & 0x0F) | (((qh >> j) & 1) << 4);
        const int hi = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
        y[j] = static_cast<float>(lo) * d + m;
        y[j + 16] = static_cast<float>(hi) * d + m;
      }
      return;
    }
    case Format::q8_0: {
      const float d = half_at(b);
      const int8_t* qs = reinterpret_cast<const int8_t*>(b + 2);
      for (int j = 0; j < 32; ++j) y[j] = static_cast<float>(qs[j]) * d;
      return;
    }
    case Format::q4_k:
    case Format::q5_k: {
      const bool five = f == Format::q5_k;
      const float d = half_at(b), dmin = half_at(b + 2);
      const uint8_t* scales = b + 4;
      const uint8_t* qh = b + 16;
      const uint8_t* qs = b + (five ? 48 : 16);
      for (int c = 0; c < 4; ++c) {  // 64 weights: sub-blocks 2c (low nibbles) and 2c + 1 (high)
        int sc0, m0, sc1, m1;
        k_scale_min(scales, 2 * c, sc0, m0);
        k_scale_min(scales, 2 * c + 1, sc1, m1);
        const float d0 = d * sc0, d1 = d * sc1, n0 = dmin * m0, n1 = dmin * m1;
        for (int l = 0; l < 32; ++l) {
          int lo = qs[32 * c + l] & 0x0F, hi = qs[32 * c + l] >> 4;
          if (five) {
            lo |= ((qh[l] >> (2 * c)) & 1) << 4;
            hi |= ((qh[l] >> (2 * c + 1)) & 1) << 4;
          }
          y[64 * c + l] = d0 * static_cast<float>(lo) - n0;
          y[64 * c + 32 + l] = d1 * static_cast<float>(hi) - n1;
        }
      }
      return;
    }
    case Format::q6_k: {
      const uint8_t* ql = b;
      const uint8_t* qh = b + 128;
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
      const float d = half_at(b + 208);
      for (int h = 0; h < 2; ++h) {  // two halves of 128: four runs of 32 from 64 low bytes, 32 high bytes
        for (int l = 0; l < 32; ++l) {
          const int is = l / 16;
          const int q0 = ((ql[l] & 0x0F) | (((qh[l] >> 0) & 3) << 4)) - 32;
          const int q1 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) - 32;
          const int q2 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
          const int q3 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
          y[128 * h + l] = d * sc[is] * q0;
          y[128 * h + l + 32] = d * sc[is + 2] * q1;
          y[128 * h + l + 64] = d * sc[is + 4] * q2;
          y[128 * h + l + 96] = d * sc[is + 6] * q3;
        }
        ql += 64;
        qh += 32;
        sc += 8;
      }
      return;
    }
  }
}

// The rows16 layout: a VNNI dot product's shape, 16 weight rows at a time. A block's float16
// fields (d; Q4_1's / Q5_1's m, the K-quants' dmin) move behind its other bytes, the "body", which
// are laid out four bytes of each row at a time: per group of 16 rows and block b, 64-byte vectors,
// vector j holding for each row r (4 bytes at 4r) its body's bytes 4j..4j+3; then the 16 rows' d
// (float16), then their m or dmin. The body is GGUF's block less those fields, Q8_0's weights with
// the sign bit flipped (w + 128: unsigned, as vpdpbusd wants them). So Q4_0 / Q4_1 hold in vector j
// weights 4j..4j+3 in the low nibbles and 16+4j..19+4j in the high ones, Q5_0 / Q5_1 their 32 fifth
// bits (vector 0) before those; Q4_K's body is its 12 scale bytes (vectors 0-2) and 128 nibble bytes
// (3-34), Q5_K's the same with its 32 high-bit bytes between (3-10, nibbles 11-42), Q6_K's its 128
// low-nibble bytes (0-31), 64 high-bit bytes (32-47) and 16 scales (48-51). A group is its `blocks`
// such runs back to back, and rows past the matrix's end are zeros. A decode kernel reads one
// stream and sums 16 rows per instruction with no horizontal reduction (gguf_simd.inc's
// rows16_group, rows16_kquant and rows16_q6k).
constexpr bool five_bit(Format f) { return f == Format::q5_0 || f == Format::q5_1; }
// The float16 fields each block holds: d, and m or dmin.
constexpr int rows16_halves(Format f) {
  return with_min(f) || f == Format::q4_k || f == Format::q5_k ? 2 : 1;
}
// Where they lie in GGUF's block: first, except Q6_K's d, last.
constexpr int rows16_halves_at(Format f) { return f == Format::q6_k ? info(f).bytes - 2 : 0; }
constexpr int rows16_vectors(Format f) { return (info(f).bytes - 2 * rows16_halves(f)) / 4; }
constexpr int rows16_block_bytes(Format f) { return 64 * rows16_vectors(f) + 32 * rows16_halves(f); }

// Where the body lies in GGUF's block: after the float16 fields, or before Q6_K's d.
constexpr int rows16_body_at(Format f) { return rows16_halves_at(f) == 0 ? 2 * rows16_halves(f) : 0; }

// A row's float16 fields into its GGUF block at `block`, from a group's (`fields`: the row's d; its
// m or dmin 32 bytes on).
inline void rows16_put_halves(Format f, const uint8_t* fields, uint8_t* block) {
  for (int h = 0; h < rows16_halves(f); ++h) std::memcpy(block + rows16_halves_at(f) + 2 * h, fields + 32 * h, 2);
}

// Row r (0-15) of a rows16 group's block b in GGUF's layout (info(f).bytes at `out`).
inline void rows16_gguf_block(Format f, const uint8_t* group, int64_t b, int r, uint8_t* out) {
  const uint8_t* g = group + b * rows16_block_bytes(f);
  const int V = rows16_vectors(f);
  uint8_t* body = out + rows16_body_at(f);
  const uint8_t flip = f == Format::q8_0 ? 0x80 : 0;
  for (int j = 0; j < V; ++j)
    for (int t = 0; t < 4; ++t) body[4 * j + t] = g[64 * j + 4 * r + t] ^ flip;
  rows16_put_halves(f, g + 64 * V + 2 * r, out);
}

// Row r (0-15) of a rows16 group's block b as floats (32, or a K-quant's 256), straight from the
// group: dequantize_block's arithmetic, so the planar row's values (tested bit for bit).
// Reassembling each 32-weight block for dequantize_block instead measured Q4_1 3,072 x 576 into bf16
// at 709-729 against 476 us; a K-quant's 256 weights take their block reassembled.
inline void dequantize_rows16_block(Format f, const uint8_t* group, int64_t b, int r, float* y) {
  if (!planar(f)) {
    uint8_t block[210];
    rows16_gguf_block(f, group, b, r, block);
    return dequantize_block(f, block, y);
  }
  const int V = rows16_vectors(f);
  const uint8_t* g = group + b * rows16_block_bytes(f);
  const float d = half_at(g + 64 * V + 2 * r);
  if (f == Format::q8_0) {
    for (int j = 0; j < 8; ++j)
      for (int t = 0; t < 4; ++t) y[4 * j + t] = static_cast<float>(static_cast<int8_t>(g[64 * j + 4 * r + t] ^ 0x80)) * d;
    return;
  }
  const bool five = five_bit(f);
  const float m = with_min(f) ? half_at(g + 64 * V + 32 + 2 * r) : (five ? -16.f : -8.f) * d;
  uint32_t qh = 0;
  if (five) std::memcpy(&qh, g + 4 * r, 4);
  const uint8_t* nibbles = g + (five ? 64 : 0);
  for (int j = 0; j < 4; ++j)
    for (int t = 0; t < 4; ++t) {
      const uint8_t q = nibbles[64 * j + 4 * r + t];
      const int i = 4 * j + t;
      y[i] = static_cast<float>((q & 0x0F) | (((qh >> i) & 1) << 4)) * d + m;
      y[16 + i] = static_cast<float>((q >> 4) | (((qh >> (16 + i)) & 1) << 4)) * d + m;
    }
}

// A rows16 group (`blocks` blocks) as 16 rows of the kernels' layout (planar, or GGUF's for the
// K-quants), `out` [16, blocks x GGUF block bytes].
inline void rows16_to_planar(Format f, const uint8_t* group, int64_t blocks, uint8_t* out) {
  const int64_t row_bytes = blocks * info(f).bytes;
  if (!planar(f)) {
    for (int r = 0; r < 16; ++r)
      for (int64_t b = 0; b < blocks; ++b) rows16_gguf_block(f, group, b, r, out + r * row_bytes + b * info(f).bytes);
    return;
  }
  const int bb = rows16_block_bytes(f), qb = quant_bytes(f), scales = 64 * rows16_vectors(f);
  const uint8_t flip = f == Format::q8_0 ? 0x80 : 0;
  for (int r = 0; r < 16; ++r) {
    uint8_t* o = out + r * row_bytes;
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* g = group + b * bb;
      for (int j = 0; j < rows16_vectors(f); ++j)
        for (int t = 0; t < 4; ++t) o[qb * b + 4 * j + t] = g[64 * j + 4 * r + t] ^ flip;
      std::memcpy(o + qb * blocks + 2 * b, g + scales + 2 * r, 2);
      if (with_min(f)) std::memcpy(o + (qb + 2) * blocks + 2 * b, g + scales + 32 + 2 * r, 2);
    }
  }
}

// Block b of a planar row (`blocks` blocks of a 32-weight format): where its integer bytes, its d
// and (with_min) its m lie.
struct PlanarBlock {
  const uint8_t* q;
  const uint8_t* d;
  const uint8_t* m;  // null without one
};
inline PlanarBlock planar_block(Format f, const uint8_t* row, int64_t blocks, int64_t b) {
  const int qb = quant_bytes(f);
  return {row + qb * b, row + blocks * qb + 2 * b, with_min(f) ? row + (qb + 2) * blocks + 2 * b : nullptr};
}

// Block b of a row (`blocks` blocks) in the kernels' layout, as floats.
inline void dequantize_row_block(Format f, const uint8_t* row, int64_t blocks, int64_t b, float* y) {
  if (!planar(f)) return dequantize_block(f, row + b * info(f).bytes, y);
  uint8_t block[34];  // reassembled in GGUF's order: d, m (with_min), then the integer bytes
  const PlanarBlock p = planar_block(f, row, blocks, b);
  std::memcpy(block, p.d, 2);
  if (p.m) std::memcpy(block + 2, p.m, 2);
  std::memcpy(block + (p.m ? 4 : 2), p.q, quant_bytes(f));
  dequantize_block(f, block, y);
}

}  // namespace pagedserve::gguf
