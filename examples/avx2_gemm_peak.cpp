// What an integer GEMM for prompt chunks could buy on AVX2 (docs/BENCHMARKS.md, "AVX2 on the Zen 5"):
// the peak of two GEMM micro-kernels with every operand in L1, one thread, multiply-adds per second.
//   f32   6 rows x 16 columns of FMA accumulators (the float32 gguf_gemm's shape on AVX2)
//   int16 3 rows x 16 columns: whole int16 activations (254 q + low, the engine's default precision)
//         times int16 weights by `vpmaddwd`, summed in int32 per 32-weight block, then converted and
//         scaled into float accumulators as a block's scale requires
//   int8  3 rows x 16 columns: int8 activations (llama.cpp's precision) times unsigned 4-bit-range
//         weights by `maddubs`, 4 weights a lane summed in int16 over a block, widened once by `madd`
// Build and run: g++ -O3 -mavx2 -mfma examples/avx2_gemm_peak.cpp -o /tmp/avx2_gemm_peak && /tmp/avx2_gemm_peak
#include <immintrin.h>
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
__attribute__((noinline)) void i16k(long iters, float* out) {
  __m256 acc[3][2];
  for (int r = 0; r < 3; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (long it = 0; it < iters; ++it)
    for (int b = 0; b < 2; ++b) {  // two 32-k blocks = 64 k
      __m256i s[3][2];
      for (int r = 0; r < 3; ++r) s[r][0] = s[r][1] = _mm256_setzero_si256();
      for (int p = 0; p < 16; ++p) {  // k pairs
        const int16_t* w = wi + (b * 16 + p) * 32;  // 16 cols x 2 k
        __m256i w0 = _mm256_loadu_si256((const __m256i*)w), w1 = _mm256_loadu_si256((const __m256i*)(w + 16));
        for (int r = 0; r < 3; ++r) {
          int32_t v; std::memcpy(&v, xi + r * 64 + b * 32 + 2 * p, 4);
          __m256i x = _mm256_set1_epi32(v);
          s[r][0] = _mm256_add_epi32(s[r][0], _mm256_madd_epi16(w0, x));
          s[r][1] = _mm256_add_epi32(s[r][1], _mm256_madd_epi16(w1, x));
        }
      }
      __m256 d0 = _mm256_loadu_ps(sc + b * 16), d1 = _mm256_loadu_ps(sc + b * 16 + 8);
      for (int r = 0; r < 3; ++r) {
        __m256 xs = _mm256_broadcast_ss(sx + r * 2 + b);
        acc[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r][0]), _mm256_mul_ps(d0, xs), acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r][1]), _mm256_mul_ps(d1, xs), acc[r][1]);
      }
    }
  for (int r = 0; r < 3; ++r) { _mm256_storeu_ps(out + r * 16, acc[r][0]); _mm256_storeu_ps(out + r * 16 + 8, acc[r][1]); }
}
__attribute__((noinline)) void i8k(long iters, float* out) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[3][2];
  for (int r = 0; r < 3; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (long it = 0; it < iters; ++it)
    for (int b = 0; b < 2; ++b) {
      __m256i s[3][2];
      for (int r = 0; r < 3; ++r) s[r][0] = s[r][1] = _mm256_setzero_si256();
      for (int q = 0; q < 8; ++q) {  // groups of 4 weights: 16 columns x 4 bytes = 2 vectors
        const uint8_t* w = wb + (b * 8 + q) * 64;
        __m256i w0 = _mm256_loadu_si256((const __m256i*)w), w1 = _mm256_loadu_si256((const __m256i*)(w + 32));
        for (int r = 0; r < 3; ++r) {
          int32_t v; std::memcpy(&v, xb + r * 64 + b * 32 + 4 * q, 4);
          __m256i x = _mm256_set1_epi32(v);
          s[r][0] = _mm256_add_epi16(s[r][0], _mm256_maddubs_epi16(w0, x));
          s[r][1] = _mm256_add_epi16(s[r][1], _mm256_maddubs_epi16(w1, x));
        }
      }
      __m256 d0 = _mm256_loadu_ps(sc + b * 16), d1 = _mm256_loadu_ps(sc + b * 16 + 8);
      for (int r = 0; r < 3; ++r) {
        __m256 xs = _mm256_broadcast_ss(sx + r * 2 + b);
        acc[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(s[r][0], ones)), _mm256_mul_ps(d0, xs), acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(s[r][1], ones)), _mm256_mul_ps(d1, xs), acc[r][1]);
      }
    }
  for (int r = 0; r < 3; ++r) { _mm256_storeu_ps(out + r * 16, acc[r][0]); _mm256_storeu_ps(out + r * 16 + 8, acc[r][1]); }
}

int main() {
  for (auto& v : wf) v = 0.001f; for (auto& v : xf) v = 0.5f; for (auto& v : wi) v = 3; for (auto& v : xi) v = 5;
  for (auto& v : sc) v = 0.1f; for (auto& v : sx) v = 0.2f; for (auto& v : wb) v = 7; for (auto& v : xb) v = 3;
  float out[96];
  const long iters = 2000000;
  for (int rep = 0; rep < 3; ++rep) {
    auto t = std::chrono::steady_clock::now(); f32k(iters, out);
    double a = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
    t = std::chrono::steady_clock::now(); i16k(iters, out);
    double b = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
    t = std::chrono::steady_clock::now(); i8k(iters, out);
    double c = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
    const double f32 = iters * 6.0 * 16 * 64 / a, i16 = iters * 3.0 * 16 * 64 / b, i8 = iters * 3.0 * 16 * 64 / c;
    std::printf("f32 FMA 6x16 %.1f GMAC/s, int16 madd 3x16 %.1f (%.2fx), int8 maddubs 3x16 %.1f (%.2fx)  [%g]\n",
                f32 / 1e9, i16 / 1e9, i16 / f32, i8 / 1e9, i8 / f32, out[5]);
  }
}
