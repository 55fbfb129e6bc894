// Horizontal sums the kernels' AVX2 paths share.
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

namespace pagedserve {

// The sum of v's eight floats. AVX2 code, callable from any avx2 (or wider) target region; each
// kernel's scalar path is compiled without it.
__attribute__((target("avx2"))) inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

}  // namespace pagedserve
#endif
