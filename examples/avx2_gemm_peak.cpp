// What an integer GEMM for prompt chunks could buy on AVX2 (docs/BENCHMARKS.md, "AVX2 on the Zen 5"):
// the peak of three GEMM micro-kernels with every operand in L1, one thread, multiply-adds per second.
//   f32   6 rows x 16 columns of FMA accumulators (the float32 gguf_gemm's shape on AVX2)
//   int16 3 rows x 16 columns: whole int16 activations (254 q + low, the engine's default precision)
//         times int16 weights by `vpmaddwd`, summed in int32 per 32-weight block, then converted and
//         scaled into float accumulators as a block's scale requires
//   int8  3 rows x 16 columns: int8 activations (llama.cpp's precision) times unsigned 4-bit-range
//         weights by `maddubs`, 4 weights a lane summed in int16 over a block, widened once by `madd`
// Build and run: g++ -O3 -mavx2 -mfma examples/avx2_gemm_peak.cpp -o /tmp/avx2_gemm_peak && /tmp/avx2_gemm_peak
#include <immintrin.h>

#include <algorithm>
#include <iterator>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <cstring>
static float wf[64 * 16 * 2], xf[6 * 64];
static int16_t wi[64 * 16], xi[3 * 64];
static uint8_t wb[64 * 16];
static int8_t xb[3 * 64];
static float sc[2 * 16], sx[3 * 2];
__attribute__((noinline)) void f32k(long iters, float* out) {
  __m256 acc[6][2];
  for (int r = 0; r < 6; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (long it = 0; it < iters; ++it)
    for (int k = 0; k < 64; ++k) {
      __m256 w0 = _mm256_loadu_ps(wf + k * 16), w1 = _mm256_loadu_ps(wf + k * 16 + 8);
      for (int r = 0; r < 6; ++r) {
        __m256 x = _mm256_broadcast_ss(xf + r * 64 + k);
        acc[r][0] = _mm256_fmadd_ps(w0, x, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(w1, x, acc[r][1]);
      }
    }
  for (int r = 0; r < 6; ++r) { _mm256_storeu_ps(out + r * 16, acc[r][0]); _mm256_storeu_ps(out + r * 16 + 8, acc[r][1]); }
}
// The integer kernels: 3 rows x 16 columns, each step 64 weight bytes (16 columns x 2 int16 or x 4
// int8) against 4 broadcast activation bytes; a block's int32 sums converted and scaled once.
template <bool Int8>
__attribute__((noinline)) void intk(long iters, float* out) {
  constexpr int kSteps = Int8 ? 8 : 16, kElem = Int8 ? 1 : 2;  // steps per 32-weight block; activation bytes
  const auto* wbytes = Int8 ? wb : reinterpret_cast<const uint8_t*>(wi);
  const auto* xbytes = Int8 ? reinterpret_cast<const uint8_t*>(xb) : reinterpret_cast<const uint8_t*>(xi);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[3][2];
  for (int r = 0; r < 3; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (long it = 0; it < iters; ++it)
    for (int b = 0; b < 2; ++b) {  // two 32-weight blocks = 64 k
      __m256i s[3][2];
      for (int r = 0; r < 3; ++r) s[r][0] = s[r][1] = _mm256_setzero_si256();
      for (int q = 0; q < kSteps; ++q) {
        const uint8_t* w = wbytes + (b * kSteps + q) * 64;
        __m256i w0 = _mm256_loadu_si256((const __m256i*)w), w1 = _mm256_loadu_si256((const __m256i*)(w + 32));
        for (int r = 0; r < 3; ++r) {
          int32_t v; std::memcpy(&v, xbytes + (r * 64 + b * 32) * kElem + 4 * q, 4);
          __m256i x = _mm256_set1_epi32(v);
          if constexpr (Int8) {  // int16 sums within a block (at most 8 x 2 x 15 x 127: no saturation)
            s[r][0] = _mm256_add_epi16(s[r][0], _mm256_maddubs_epi16(w0, x));
            s[r][1] = _mm256_add_epi16(s[r][1], _mm256_maddubs_epi16(w1, x));
          } else {
            s[r][0] = _mm256_add_epi32(s[r][0], _mm256_madd_epi16(w0, x));
            s[r][1] = _mm256_add_epi32(s[r][1], _mm256_madd_epi16(w1, x));
          }
        }
      }
      __m256 d0 = _mm256_loadu_ps(sc + b * 16), d1 = _mm256_loadu_ps(sc + b * 16 + 8);
      for (int r = 0; r < 3; ++r) {
        __m256 xs = _mm256_broadcast_ss(sx + r * 2 + b);
        for (int h = 0; h < 2; ++h) {
          const __m256i sum = Int8 ? _mm256_madd_epi16(s[r][h], ones) : s[r][h];
          acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(h ? d1 : d0, xs), acc[r][h]);
        }
      }
    }
  for (int r = 0; r < 3; ++r) { _mm256_storeu_ps(out + r * 16, acc[r][0]); _mm256_storeu_ps(out + r * 16 + 8, acc[r][1]); }
}

int main() {
  std::fill(std::begin(wf), std::end(wf), 0.001f);
  std::fill(std::begin(xf), std::end(xf), 0.5f);
  std::fill(std::begin(wi), std::end(wi), int16_t{3});
  std::fill(std::begin(xi), std::end(xi), int16_t{5});
  std::fill(std::begin(wb), std::end(wb), uint8_t{7});
  std::fill(std::begin(xb), std::end(xb), int8_t{3});
  std::fill(std::begin(sc), std::end(sc), 0.1f);
  std::fill(std::begin(sx), std::end(sx), 0.2f);
  float out[96];
  const long iters = 2000000;
  for (int rep = 0; rep < 3; ++rep) {
    auto t = std::chrono::steady_clock::now(); f32k(iters, out);
    double a = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
    t = std::chrono::steady_clock::now(); intk<false>(iters, out);
    double b = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
    t = std::chrono::steady_clock::now(); intk<true>(iters, out);
    double c = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
    const double f32 = iters * 6.0 * 16 * 64 / a, i16 = iters * 3.0 * 16 * 64 / b, i8 = iters * 3.0 * 16 * 64 / c;
    std::printf("f32 FMA 6x16 %.1f GMAC/s, int16 madd 3x16 %.1f (%.2fx), int8 maddubs 3x16 %.1f (%.2fx)  [%g]\n",
                f32 / 1e9, i16 / 1e9, i16 / f32, i8 / 1e9, i8 / f32, out[5]);
  }
}
