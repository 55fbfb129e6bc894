// What the kernels share: float32 <-> model dtype conversions, written as plain bit arithmetic so
// the loops around them vectorize (c10's own carry a NaN branch that stops the compiler), and the
// one switch from a tensor's dtype to its C++ type.
// bf16 -> float is a shift; float -> bf16 rounds to nearest even, the same result as c10 for every
// non-NaN value.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace pagedserve {

inline float to_float(float x) { return x; }
inline float to_float(c10::Half x) { return static_cast<float>(x); }
inline float to_float(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

template <typename T>
inline T from_float(float x) { return static_cast<T>(x); }
template <>
inline c10::BFloat16 from_float(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return c10::BFloat16(static_cast<uint16_t>(bits >> 16), c10::BFloat16::from_bits());
}

// Rounds to T, as each separate torch op on a T tensor does (a no-op for float).
template <typename T>
inline float round_to(float x) { return to_float(from_float<T>(x)); }

// n values from src to dst's dtype, as torch's .to() rounds them: the same bits copied where the
// dtypes match.
template <typename D, typename S>
inline void convert_row(D* dst, const S* src, int64_t n) {
  if constexpr (std::is_same_v<D, S>) {
    std::memcpy(dst, src, n * sizeof(D));
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = from_float<D>(to_float(src[i]));
  }
}

// Whether x is finite, from its bits: the kernels build with -ffast-math, under which the compiler
// may assume every float is finite and fold std::isfinite to true.
inline bool is_finite_bits(double x) {
  uint64_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return ((bits >> 52) & 0x7FF) != 0x7FF;
}

// Calls f(T{}) with T the C++ type of a model dtype (float32, bfloat16, float16); any other dtype
// is refused with `op`'s name. Every kernel entry point dispatches through this one switch.
template <typename F>
void dispatch_model_dtype(c10::ScalarType dtype, const char* op, F&& f) {
  switch (dtype) {
    case c10::ScalarType::Float: return f(float{});
    case c10::ScalarType::BFloat16: return f(c10::BFloat16{});
    case c10::ScalarType::Half: return f(c10::Half{});
    default: TORCH_CHECK(false, op, ": unsupported dtype ", dtype);
  }
}

}  // namespace pagedserve
