// Which instruction-set path a kernel takes, chosen at run time from CPUID. Every path is compiled
// on every x86 machine (each ISA's code sits in its own `#pragma GCC target` region), so one build
// serves the CPU it runs on and the tests can run every path that CPU can execute, the scalar
// reference always:
//   scalar  portable C++, the reference the others are tested against
//   avx2    AVX2 + FMA + F16C (Haswell, Zen 1 and later)
//   avx512  AVX-512 F/BW/VL + VNNI (Ice Lake, Sapphire Rapids, Zen 4/5)
// Entry points take the path's name: "auto" is the best this CPU runs; naming one it cannot run is
// an error, so a test never silently measures another path.
#pragma once

#include <c10/util/Exception.h>

#include <string_view>

namespace pagedserve {

enum class Isa : int { scalar = 0, avx2 = 1, avx512 = 2 };

inline const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::avx2: return "avx2";
    case Isa::avx512: return "avx512";
    default: return "scalar";
  }
}

inline bool cpu_runs(Isa isa) {
#if defined(__x86_64__) || defined(__i386__)
  switch (isa) {
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

inline Isa best_isa() {
  static const Isa best = cpu_runs(Isa::avx512) ? Isa::avx512 : cpu_runs(Isa::avx2) ? Isa::avx2 : Isa::scalar;
  return best;
}

// "auto" → best_isa(); otherwise the named path, which this CPU must be able to run.
inline Isa parse_isa(std::string_view name, const char* op) {
  if (name == "auto") return best_isa();
  for (Isa isa : {Isa::scalar, Isa::avx2, Isa::avx512}) {
    if (name == isa_name(isa)) {
      TORCH_CHECK(cpu_runs(isa), op, ": this CPU cannot run the ", name, " path");
      return isa;
    }
  }
  TORCH_CHECK(false, op, ": unknown instruction-set path '", name, "' (auto, scalar, avx2 or avx512)");
}

}  // namespace pagedserve
