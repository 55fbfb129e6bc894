// y = x W^T (+ bias) in bfloat16 on AMX-BF16 tiles, for every row count a step has, over weights
// packed once at load into the layout the tile instruction reads.
//
// Why: oneDNN's prepacked bf16 linears (models/packed.py) run a decode step's rows on OpenMP's team
// and, between 16 and ~1,300 rows, well under the tiles' rate (docs/BENCHMARKS.md: 64 rows of
// `small`'s gate_up at 1.5 TFLOP/s; 512-1,280 rows on one thread's rate). A kernel of the project's
// own runs on the decode stack's pool as well as on torch's threads, and streams a decode step's
// weights once.
//
// Layout: W [N, K] becomes [N/16][K/32][16][32]: for each 16 output features and 32 inputs, one
// 1 KB B tile in the instruction's pair order (row r holds inputs 2r, 2r + 1 of each of the 16
// features), so the weights stream front to back. x's rows are tile A as they lie (16 rows x 32
// inputs, any row stride); C (16 rows x 16 features, float32) goes out through one conversion.
// N must be a multiple of 16 and K of 32 (models/packed.py keeps other shapes on oneDNN).
//
// Blocking: up to 64 rows, each 16 features' B tile is loaded once per 32 inputs and meets the
// rows' four A tiles (a step reads every weight once); above that, two B tiles meet two A tiles
// (a 32 x 32 block of C), over 256-row blocks of x so that a block stays in L2 while the weights
// stream past it. Every C element sums the same tile products in the same order in both, so a row's
// result does not depend on the rows beside it.
//
// Paths (cpu_isa.h): scalar (the reference: the same packed bytes, float32 sums), avx512 (AVX512-BF16's
// vdpbf16ps, where the CPU has it and no AMX-BF16 tiles: a Zen 4 / Zen 5) and amx (AMX-BF16, where the
// CPU and Linux allow tiles); the tests run each where they can.
//
// The avx512 path reads the same bytes as 16-feature columns: the tiles of features 16t..16t + 15
// lie one after another, row r of tile c holding pair 16c + r of the 16 features, so a column is
// [K/2][16] dwords front to back, one 64-byte vector a pair, which is what vdpbf16ps takes against
// one row's pair of x values broadcast. Up to 12 rows, two columns at a time meet every row (the
// weights stream once); above that four columns (64 features) meet 6 rows at a time, the columns'
// 4 x K x 32 bytes staying in L2 while the row blocks pass (oneDNN's packed bf16 linear on a Zen 4,
// `small`'s 49 matrices from memory, 2 threads: 1.9x its speed at 1 row, 1.3x at 16, 1.1x at 48-64,
// 1.05-1.14x at 512-2,048; docs/BENCHMARKS.md). Each output is one chain of vdpbf16ps over the
// pairs in order, whatever the kernel's shape, so a row's bits do not depend on the rows beside it.
// gguf_gemm.inc's micro-kernel does the same arithmetic over panels it lays out itself ([K/2][32]:
// both columns' pair in one 128-byte run, one pointer); one set of blocks for both, its panels laid
// as these columns, ran it 5-12 % slower at 512 rows, so the two stay apart.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "convert.h"
#include "cpu_isa.h"
#include "kernel_ops.h"
#include "work_pool.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kFeatures = 16;   // output features per B tile
constexpr int64_t kInputs = 32;     // inputs per tile (16 pairs of bf16)
constexpr int64_t kTileBytes = 1024;
constexpr int64_t kRows = 16;       // rows of x per A tile
constexpr int64_t kDecodeRows = 64; // up to here one B tile meets every row's A tile
constexpr int64_t kRowBlock = 256;  // rows of x per pass over the weights above that

struct Problem {
  const c10::BFloat16* x;   // [M, K], rows ldx apart
  int64_t ldx;
  const c10::BFloat16* w;   // packed
  const c10::BFloat16* bias;  // [N] or null
  c10::BFloat16* y;         // [M, N], rows ldy apart
  int64_t ldy, M, N, K;
};

// ---- scalar: the reference -------------------------------------------------------------------

void linear_scalar(const Problem& p, int64_t t0, int64_t t1) {
  const int64_t chunks = p.K / kInputs;
  std::vector<float> acc(kFeatures);
  for (int64_t m = 0; m < p.M; ++m) {
    const c10::BFloat16* xm = p.x + m * p.ldx;
    for (int64_t t = t0; t < t1; ++t) {
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t c = 0; c < chunks; ++c) {
        const c10::BFloat16* tile = p.w + (t * chunks + c) * (kTileBytes / 2);
        for (int64_t r = 0; r < kInputs / 2; ++r)
          for (int64_t n = 0; n < kFeatures; ++n)
            for (int e = 0; e < 2; ++e)
              acc[n] += pagedserve::to_float(xm[c * kInputs + 2 * r + e]) * pagedserve::to_float(tile[(r * kFeatures + n) * 2 + e]);
      }
      for (int64_t n = 0; n < kFeatures; ++n) {
        const int64_t f = t * kFeatures + n;
        const float v = acc[n] + (p.bias ? pagedserve::to_float(p.bias[f]) : 0.f);
        p.y[m * p.ldy + f] = pagedserve::from_float<c10::BFloat16>(v);
      }
    }
  }
}

}  // namespace

#if defined(__x86_64__)
// How both fast paths write 16 features of a row: float32 sums + bias, rounded to bf16 to nearest
// even as torch rounds. Compiled for a subset of both paths' targets, so each inlines it.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16")
namespace bf16_out {

// bias[f0, f0 + 16) as float32 (zeros without a bias)
inline __m512 bias16(const Problem& p, int64_t f0) {
  if (p.bias == nullptr) return _mm512_setzero_ps();
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.bias + f0));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

// y[m, f0, f0 + 16) = sums + bias, as bf16
inline void put16(const Problem& p, int64_t m, int64_t f0, __m512 sums, __m512 bias) {
  const __m256bh v = _mm512_cvtneps_pbh(_mm512_add_ps(sums, bias));
  std::memcpy(p.y + m * p.ldy + f0, &v, 32);
}

}  // namespace bf16_out
#pragma GCC pop_options
#endif

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")
namespace amx {

// Tile registers (the intrinsics need literals): two A, two B, four C.
#define PS_TA0 0
#define PS_TA1 1
#define PS_TB0 2
#define PS_TB1 3
#define PS_TC0 4
#define PS_TC1 5
#define PS_TC2 6
#define PS_TC3 7

void configure() {
  pagedserve::TileConfig c;
  for (int t = 0; t < 8; ++t) c.rows[t] = kRows, c.colsb[t] = 64;
  pagedserve::publish(c);
  _tile_loadconfig(&c);
}

// Where A tile i (rows 16i..16i + 15 of x) lies: x itself, or for a last partial tile the zero-padded
// copy in `tail`.
struct RowTiles {
  const c10::BFloat16* x;
  int64_t ldx, full;       // full tiles in x
  const c10::BFloat16* tail;    // [16, K] or null
  int64_t K;
  const c10::BFloat16* at(int64_t i, int64_t chunk, int64_t& stride) const {
    if (i < full) {
      stride = ldx * 2;
      return x + i * kRows * ldx + chunk * kInputs;
    }
    stride = K * 2;
    return tail + chunk * kInputs;
  }
};

// C (16 rows x 16 features, float32, just stored from its tile) as bf16 into y, rows [m0, m0 + rows),
// features [f0, f0 + 16).
void store(const Problem& p, const float (*c)[kFeatures], int64_t m0, int64_t rows, int64_t f0) {
  const __m512 bias = bf16_out::bias16(p, f0);
  for (int64_t r = 0; r < rows; ++r) bf16_out::put16(p, m0 + r, f0, _mm512_load_ps(c[r]), bias);
}
// Tile T out through `cbuf` (a 64-byte aligned float[16][16] in scope).
#define PS_STORE(T, m0, rows, f0)   \
  do {                              \
    _tile_stored(T, cbuf, 64);      \
    store(p, cbuf, m0, rows, f0);   \
  } while (0)

// Row tile i of chunk c (in scope) through A register TA, times the B tile in PS_TB0, into C register TC.
#define PS_ROW_TILE(TA, TC, i)                        \
  do {                                                \
    int64_t stride;                                   \
    const c10::BFloat16* row_tile = a.at(i, c, stride);    \
    _tile_loadd(TA, row_tile, stride);                \
    _tile_dpbf16ps(TC, TA, PS_TB0);                   \
  } while (0)

// Up to 64 rows: B tile (t, chunk) loaded once, against every row tile.
void decode_rows(const Problem& p, const RowTiles& a, int64_t t0, int64_t t1) {
  alignas(64) float cbuf[kRows][kFeatures];
  const int64_t chunks = p.K / kInputs, tiles = (p.M + kRows - 1) / kRows;
  for (int64_t t = t0; t < t1; ++t) {
    const c10::BFloat16* b = p.w + t * chunks * (kTileBytes / 2);
    _tile_zero(PS_TC0);
    _tile_zero(PS_TC1);
    _tile_zero(PS_TC2);
    _tile_zero(PS_TC3);
    for (int64_t c = 0; c < chunks; ++c) {
      _tile_loadd(PS_TB0, b + c * (kTileBytes / 2), 64);
      PS_ROW_TILE(PS_TA0, PS_TC0, 0);
      if (tiles > 1) PS_ROW_TILE(PS_TA1, PS_TC1, 1);
      if (tiles > 2) PS_ROW_TILE(PS_TA0, PS_TC2, 2);
      if (tiles > 3) PS_ROW_TILE(PS_TA1, PS_TC3, 3);
    }
    const int64_t f0 = t * kFeatures;
    PS_STORE(PS_TC0, 0, std::min(kRows, p.M), f0);
    if (tiles > 1) PS_STORE(PS_TC1, kRows, std::min(kRows, p.M - kRows), f0);
    if (tiles > 2) PS_STORE(PS_TC2, 2 * kRows, std::min(kRows, p.M - 2 * kRows), f0);
    if (tiles > 3) PS_STORE(PS_TC3, 3 * kRows, std::min(kRows, p.M - 3 * kRows), f0);
  }
}

// Above 64 rows: row tiles [i0, i1) of one 256-row block (at most 16), feature tiles [t0, t1) two at
// a time, 32 x 32 of C per pass, K in runs of kKBlock inputs: a pair's B tiles for one run (16 KB)
// stay in L1 while every row pair of the block passes them, the row pairs' partial sums parked in
// `parked` between runs (without the runs every tile came from L2, 4 KB per 4 tile products).
constexpr int64_t kKBlock = 256;

void batch_rows(const Problem& p, const RowTiles& a, int64_t i0, int64_t i1, int64_t t0, int64_t t1) {
  alignas(64) float cbuf[kRows][kFeatures];
  alignas(64) float parked[kRowBlock / kRows / 2][4][kRows][kFeatures];
  const int64_t chunks = p.K / kInputs, run = kKBlock / kInputs;
  int64_t s0, s1;
  for (int64_t t = t0; t < t1; t += 2) {
    const bool two_t = t + 1 < t1;
    const c10::BFloat16* b0 = p.w + t * chunks * (kTileBytes / 2);
    const c10::BFloat16* b1 = b0 + chunks * (kTileBytes / 2);
    for (int64_t c0 = 0; c0 < chunks; c0 += run) {
      const int64_t c1 = std::min(chunks, c0 + run);
      const bool first = c0 == 0, last = c1 == chunks;
      for (int64_t i = i0; i < i1; i += 2) {
        const bool two_i = i + 1 < i1;
        float (*park)[kRows][kFeatures] = parked[(i - i0) / 2];
        if (first) {
          _tile_zero(PS_TC0);
          _tile_zero(PS_TC1);
          _tile_zero(PS_TC2);
          _tile_zero(PS_TC3);
        } else {
          _tile_loadd(PS_TC0, park[0], 64);
          _tile_loadd(PS_TC1, park[1], 64);
          _tile_loadd(PS_TC2, park[2], 64);
          _tile_loadd(PS_TC3, park[3], 64);
        }
        for (int64_t c = c0; c < c1; ++c) {
          const c10::BFloat16* a0 = a.at(i, c, s0);
          _tile_loadd(PS_TA0, a0, s0);
          _tile_loadd(PS_TB0, b0 + c * (kTileBytes / 2), 64);
          _tile_dpbf16ps(PS_TC0, PS_TA0, PS_TB0);
          if (two_t) {
            _tile_loadd(PS_TB1, b1 + c * (kTileBytes / 2), 64);
            _tile_dpbf16ps(PS_TC1, PS_TA0, PS_TB1);
          }
          if (two_i) {
            const c10::BFloat16* a1 = a.at(i + 1, c, s1);
            _tile_loadd(PS_TA1, a1, s1);
            _tile_dpbf16ps(PS_TC2, PS_TA1, PS_TB0);
            if (two_t) _tile_dpbf16ps(PS_TC3, PS_TA1, PS_TB1);
          }
        }
        if (!last) {
          _tile_stored(PS_TC0, park[0], 64);
          _tile_stored(PS_TC1, park[1], 64);
          _tile_stored(PS_TC2, park[2], 64);
          _tile_stored(PS_TC3, park[3], 64);
          continue;
        }
        const int64_t m0 = i * kRows, m1 = (i + 1) * kRows, f0 = t * kFeatures;
        PS_STORE(PS_TC0, m0, std::min(kRows, p.M - m0), f0);
        if (two_t) PS_STORE(PS_TC1, m0, std::min(kRows, p.M - m0), f0 + kFeatures);
        if (two_i) PS_STORE(PS_TC2, m1, std::min(kRows, p.M - m1), f0);
        if (two_i && two_t) PS_STORE(PS_TC3, m1, std::min(kRows, p.M - m1), f0 + kFeatures);
      }
    }
  }
}

void linear(const Problem& p, pagedserve::WorkPool* pool) {
  const int64_t tiles = p.N / kFeatures, full = p.M / kRows;
  std::vector<c10::BFloat16> tail;
  if (p.M % kRows) {  // the last rows, zero-padded to a whole tile
    tail.assign(kRows * p.K, c10::BFloat16(0.f));
    for (int64_t r = 0; r < p.M % kRows; ++r)
      std::memcpy(tail.data() + r * p.K, p.x + (full * kRows + r) * p.ldx, p.K * 2);
  }
  const RowTiles a{p.x, p.ldx, full, tail.empty() ? nullptr : tail.data(), p.K};
  if (p.M <= kDecodeRows) {
    pagedserve::parallel_for(pool, 0, tiles, 1, [&](int64_t t0, int64_t t1) {
      configure();
      decode_rows(p, a, t0, t1);
      _tile_release();
    });
    return;
  }
  const int64_t row_tiles = (p.M + kRows - 1) / kRows, block = kRowBlock / kRows, pairs = (tiles + 1) / 2;
  for (int64_t i0 = 0; i0 < row_tiles; i0 += block) {
    const int64_t i1 = std::min(row_tiles, i0 + block);
    pagedserve::parallel_for(pool, 0, pairs, 1, [&](int64_t q0, int64_t q1) {
      configure();
      batch_rows(p, a, i0, i1, 2 * q0, std::min(tiles, 2 * q1));
      _tile_release();
    });
  }
}

}  // namespace amx
#pragma GCC pop_options
#endif

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")
namespace bf16dot {

constexpr int kNarrowRows = 12;  // up to here two columns meet every row: 12 x 2 sums in registers
constexpr int kWideRows = 6;     // above, four columns meet 6 rows at a time: 6 x 4 sums
// Up to kNarrowRows rows each column's pairs are asked for this many pairs (1 KB) ahead: at 8-12
// rows the arithmetic between two lines left the hardware prefetcher behind (`small`'s step from
// memory on a Zen 4, 12 rows: 7.6-7.8 ms against 8.5-8.7, 8 rows 6.7-7.2 against 7.2-7.5; at 1-4
// rows no change beyond the noise; above 12 rows, where the columns are read again from L2, it cost
// 3-5 %).
constexpr int64_t kAheadPairs = 16;

// y rows [m0, m0 + MR), features [16t, 16(t + NT)): MR x NT float32 sums in registers.
template <int MR, int NT>
void block(const Problem& p, int64_t m0, int64_t t) {
  const int64_t pairs = p.K / 2, column = pairs * kFeatures;  // dwords per 16-feature column
  const auto* w = reinterpret_cast<const uint32_t*>(p.w) + t * column;
  const c10::BFloat16* x = p.x + m0 * p.ldx;
  const bool ahead = p.M <= kNarrowRows;  // the columns stream from memory in this one pass
  __m512 acc[MR][NT];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NT; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t q = 0; q < pairs; ++q) {
    if (ahead)  // past a column's end harmless: a prefetch never faults
      for (int j = 0; j < NT; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(w + j * column + (q + kAheadPairs) * kFeatures), _MM_HINT_T0);
    __m512bh b[NT];
    for (int j = 0; j < NT; ++j) b[j] = (__m512bh)_mm512_loadu_si512(w + j * column + q * kFeatures);
    for (int r = 0; r < MR; ++r) {
      int32_t pair;  // x[r, 2q], x[r, 2q + 1]
      std::memcpy(&pair, x + r * p.ldx + 2 * q, 4);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < NT; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], a, b[j]);
    }
  }
  for (int j = 0; j < NT; ++j) {
    const int64_t f0 = (t + j) * kFeatures;
    const __m512 bias = bf16_out::bias16(p, f0);
    for (int r = 0; r < MR; ++r) bf16_out::put16(p, m0 + r, f0, acc[r][j], bias);
  }
}

// block<rows, NT> for a row count known at run time: up to 12 with one or two columns (the narrow
// form and its last column), up to 6 with three or four (the wide form's blocks).
template <int NT, int MR = 1>
void rows_block(const Problem& p, int64_t m0, int rows, int64_t t) {
  if constexpr (MR <= (NT <= 2 ? kNarrowRows : kWideRows)) {
    if (rows == MR) return block<MR, NT>(p, m0, t);
    return rows_block<NT, MR + 1>(p, m0, rows, t);
  }
}

void columns(const Problem& p, int64_t m0, int rows, int64_t t, int cols) {
  switch (cols) {
    case 1: return rows_block<1>(p, m0, rows, t);
    case 2: return rows_block<2>(p, m0, rows, t);
    case 3: return rows_block<3>(p, m0, rows, t);
    default: return rows_block<4>(p, m0, rows, t);
  }
}

void linear(const Problem& p, pagedserve::WorkPool* pool) {
  const int64_t tiles = p.N / kFeatures;
  const bool narrow = p.M <= kNarrowRows;
  const int64_t width = narrow ? 2 : 4, step = narrow ? p.M : kWideRows, groups = (tiles + width - 1) / width;
  pagedserve::parallel_for(pool, 0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int cols = static_cast<int>(std::min(width, tiles - g * width));
      for (int64_t m0 = 0; m0 < p.M; m0 += step)
        columns(p, m0, static_cast<int>(std::min(step, p.M - m0)), g * width, cols);
    }
  });
}

}  // namespace bf16dot
#pragma GCC pop_options
#endif

namespace pagedserve::ops {

// [N, K] bf16 → the packed [N/16, K/32, 16, 32] (bf16) tile_linear reads.
at::Tensor tile_pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "tile_pack: weight must be a bfloat16 [out, in]");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N % kFeatures == 0 && K % kInputs == 0, "tile_pack: out_features must be a multiple of 16 and "
              "in_features of 32, got ", N, " x ", K);
  const at::Tensor src = w.contiguous();
  at::Tensor out = at::empty({N / kFeatures, K / kInputs, kInputs / 2, 2 * kFeatures}, w.options());
  const auto* s = src.data_ptr<c10::BFloat16>();
  auto* d = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, N / kFeatures, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t c = 0; c < K / kInputs; ++c)
        for (int64_t r = 0; r < kInputs / 2; ++r)
          for (int64_t n = 0; n < kFeatures; ++n)
            for (int e = 0; e < 2; ++e)
              d[(((t * (K / kInputs) + c) * (kInputs / 2) + r) * kFeatures + n) * 2 + e] =
                  s[(t * kFeatures + n) * K + c * kInputs + 2 * r + e];
  });
  return out;
}

// The path "auto" takes: the tiles where the CPU has AMX-BF16 (and the process's limit leaves amx),
// else vdpbf16ps where it has AVX512-BF16, else the reference (models/packed.py packs for this kernel
// only where one of the first two runs).
Isa tile_linear_auto() { return bf16_tiles_usable() ? Isa::amx : bf16_dot_usable() ? Isa::avx512 : Isa::scalar; }

// out [M, N] bf16 (rows may be strided) = x [M, K] bf16 (rows with unit stride) . W^T + bias, W
// packed by tile_pack, bias bf16 [N].
void tile_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                 c10::string_view isa_name, WorkPool* pool) {
  constexpr const char* op = "tile_linear";
  const Isa isa = isa_name == "auto" ? tile_linear_auto() : parse_isa(isa_name, op, true);
  TORCH_CHECK(isa == Isa::scalar || (isa == Isa::avx512 && avx512_bf16_in_cpuid()) ||
                  (isa == Isa::amx && amx_bf16_usable()),
              op, ": the paths are scalar, avx512 (AVX512-BF16) and amx (AMX-BF16), got ", isa_name);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1 && x.stride(0) >= x.size(1), op,
              ": x must be bfloat16 [rows, in_features] with contiguous rows");
  TORCH_CHECK(w.dim() == 4 && w.is_contiguous() && w.scalar_type() == at::kBFloat16 && w.size(2) == kInputs / 2 &&
                  w.size(3) == 2 * kFeatures && w.size(1) * kInputs == x.size(1),
              op, ": weight must be tile_pack's [out / 16, in / 32, 16, 32] matching x");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0) * kFeatures;
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kBFloat16 && out.stride(1) == 1 && out.size(0) == M &&
                  out.size(1) == N && out.stride(0) >= N,
              op, ": out must be bfloat16 [rows, out_features] with contiguous rows");
  if (bias) {
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == N && bias->scalar_type() == at::kBFloat16, op,
                ": bias must be a contiguous bfloat16 [out_features]");
  }
  if (M == 0) return;
  const Problem p{x.data_ptr<c10::BFloat16>(), x.stride(0), w.data_ptr<c10::BFloat16>(),
                  bias ? bias->data_ptr<c10::BFloat16>() : nullptr, out.data_ptr<c10::BFloat16>(), out.stride(0), M, N, K};
#if defined(__x86_64__)
  if (isa == Isa::amx) return amx::linear(p, pool);
  if (isa == Isa::avx512) return bf16dot::linear(p, pool);
#endif
  pagedserve::parallel_for(pool, 0, N / kFeatures, 1, [&](int64_t t0, int64_t t1) { linear_scalar(p, t0, t1); });
}

// The registered op: torch's threads.
void tile_linear_op(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                    c10::string_view isa) {
  tile_linear(out, x, w, bias, isa, nullptr);
}

}  // namespace pagedserve::ops

namespace {

// Whether tile_linear's amx or avx512 path runs here (models/packed.py packs for it only then), and
// which (the engine's log names it).
bool tile_linear_usable() { return pagedserve::ops::tile_linear_auto() != pagedserve::Isa::scalar; }
std::string tile_linear_path() { return pagedserve::isa_name(pagedserve::ops::tile_linear_auto()); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("tile_pack(Tensor w) -> Tensor");
  m.def("tile_linear(Tensor(a!) out, Tensor x, Tensor w, Tensor? bias, str isa='auto') -> ()");
  m.def("tile_linear_usable() -> bool", &tile_linear_usable);
  m.def("tile_linear_path() -> str", &tile_linear_path);
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("tile_pack", &pagedserve::ops::tile_pack);
  m.impl("tile_linear", &pagedserve::ops::tile_linear_op);
}
