// Which instruction-set path a kernel takes, chosen at run time from CPUID. Every path is compiled
// on every x86 machine (each ISA's code sits in its own `#pragma GCC target` region), so one build
// serves the CPU it runs on and the tests can run every path that CPU can execute, the scalar
// reference always:
//   scalar  portable C++, the reference the others are tested against
//   avx2    AVX2 + FMA + F16C (Haswell, Zen 1 and later)
//   avx512  AVX-512 F/BW/VL + VNNI (Ice Lake, Sapphire Rapids, Zen 4/5)
//   amx     avx512 plus AMX-INT8's tiles (Sapphire Rapids and later), where Linux grants this
//           process the tile state; the GGUF matmul (gguf_amx.inc) and, with AMX-BF16, the bf16
//           linear (tile_matmul.cpp) have tile code, every other kernel runs its avx512 form there
//           (vector_isa)
// Entry points take the path's name: "auto" is the best this CPU runs, under the process's limit
// (isa_limit: `--cpu-isa`, set once by the engine, so that a newer CPU runs and is measured as an
// older one); naming one it cannot run is an error, so a test never silently measures another path.
#pragma once

#include <c10/util/Exception.h>

#if defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string_view>

namespace pagedserve {

enum class Isa : int { scalar = 0, avx2 = 1, avx512 = 2, amx = 3 };
constexpr Isa kIsas[] = {Isa::scalar, Isa::avx2, Isa::avx512, Isa::amx};

inline const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::avx2: return "avx2";
    case Isa::avx512: return "avx512";
    case Isa::amx: return "amx";
    default: return "scalar";
  }
}

// The vector path of a kernel without tile code: amx runs the avx512 one.
inline Isa vector_isa(Isa isa) { return isa == Isa::amx ? Isa::avx512 : isa; }

#if defined(__x86_64__)
// AMX-TILE and AMX-INT8 in CPUID (leaf 7: EDX bits 24, 25), and Linux's leave to use the tile
// state: its 8 KB are not in a thread's signal frame until the process asks (arch_prctl
// ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); a tile instruction before that is SIGILL. Asked
// once per process (the grant is process-wide and permanent); oneDNN asks the same for its own.
inline bool amx_int8_usable() {
  static const bool usable = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 25))) return false;
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return usable;
}

// AVX512-BF16 (leaf 7 subleaf 1 EAX bit 5): vdpbf16ps and the bf16 conversions. Asked once: CPUID
// traps to the hypervisor in a VM (measured: 11 % of a one-row linear's time when asked per call).
inline bool avx512_bf16_in_cpuid() {
  static const bool present = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    return __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a & (1u << 5)) != 0;
  }();
  return present;
}

// AMX-BF16 (leaf 7 EDX bit 22) and AVX512-BF16 besides the tiles: bf16 tile products and the
// conversions around them (tile_matmul.cpp).
inline bool amx_bf16_usable() {
  static const bool usable = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    return amx_int8_usable() && __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 22)) && avx512_bf16_in_cpuid();
  }();
  return usable;
}
#else
inline bool avx512_bf16_in_cpuid() { return false; }
inline bool amx_bf16_usable() { return false; }
#endif

// The tile shapes, as LDTILECFG reads them (palette 1): rows and bytes per row of each register.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Call before LDTILECFG reads `config`: GCC's _tile_loadconfig names only 8 bytes of its operand as
// read, and dropped the stores of the rest (seen: a fault on a half-written configuration).
inline void publish(const TileConfig& config) { asm volatile("" : : "r"(&config) : "memory"); }

inline bool cpu_runs(Isa isa) {
#if defined(__x86_64__) || defined(__i386__)
  switch (isa) {
    case Isa::amx:
#if defined(__x86_64__)
      return cpu_runs(Isa::avx512) && amx_int8_usable();
#else
      return false;
#endif
    case Isa::scalar: return true;
    case Isa::avx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    case Isa::avx512:
      return cpu_runs(Isa::avx2) && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  }
  return false;
#else
  return isa == Isa::scalar;
#endif
}

// The most "auto" takes in this process (all paths: amx). One per process, as the CPU is: the
// engine sets it from its config before it loads a model (the engine core is a process of its own).
inline std::atomic<int>& isa_limit() {
  static std::atomic<int> limit{static_cast<int>(Isa::amx)};
  return limit;
}

inline Isa best_isa() {
  static const Isa best = cpu_runs(Isa::amx)      ? Isa::amx
                          : cpu_runs(Isa::avx512) ? Isa::avx512
                          : cpu_runs(Isa::avx2)   ? Isa::avx2
                                                  : Isa::scalar;
  return static_cast<Isa>(std::min(static_cast<int>(best), isa_limit().load(std::memory_order_relaxed)));
}

// The AVX-512 path plus AVX512-BF16, and no AMX-BF16: the GGUF GEMM's bf16 kernel (gguf_gemm.inc)
// runs here. Where Linux grants AMX-BF16 tiles torch's bf16 GEMM runs on them (oneDNN), whose
// products per cycle no vector kernel reaches, so prompt chunks keep dequantize + that GEMM.
inline bool bf16_gemm_usable() {
  return avx512_bf16_in_cpuid() && (best_isa() == Isa::avx512 || (best_isa() == Isa::amx && !amx_bf16_usable()));
}

// AMX-BF16 tiles for the bf16 linear (tile_matmul.cpp), where the limit leaves the amx path.
inline bool bf16_tiles_usable() { return best_isa() == Isa::amx && amx_bf16_usable(); }

// vdpbf16ps for the bf16 linear (tile_matmul.cpp's avx512 path), where the limit leaves an AVX-512 path.
inline bool bf16_dot_usable() { return best_isa() >= Isa::avx512 && avx512_bf16_in_cpuid(); }

// "auto" → best_isa(); otherwise the named path, which this CPU must be able to run. A kernel
// without tile code (`tiles` false, all but the GGUF matmul) gets amx as avx512 (vector_isa), so
// none of them has to map it itself and a new one cannot fall through to its scalar path there.
inline Isa parse_isa(std::string_view name, const char* op, bool tiles = false) {
  if (name == "auto") return tiles ? best_isa() : vector_isa(best_isa());
  for (Isa isa : kIsas) {
    if (name == isa_name(isa)) {
      TORCH_CHECK(cpu_runs(isa), op, ": this CPU cannot run the ", name, " path");
      return tiles ? isa : vector_isa(isa);
    }
  }
  TORCH_CHECK(false, op, ": unknown instruction-set path '", name, "' (auto, scalar, avx2, avx512 or amx)");
}

}  // namespace pagedserve
