// The run-time instruction-set choice (cpu_isa.h), visible from Python: which paths this CPU runs
// (the tests run each of them), which one "auto" takes (the engine logs it), and the process's limit
// on it (`--cpu-isa`).
#include <torch/library.h>

#include "cpu_isa.h"

#include <string>
#include <vector>

namespace {

std::vector<std::string> isa_paths() {
  std::vector<std::string> out;
  for (auto isa : pagedserve::kIsas)
    if (pagedserve::cpu_runs(isa)) out.emplace_back(pagedserve::isa_name(isa));
  return out;
}

std::string best_isa() { return pagedserve::isa_name(pagedserve::best_isa()); }

// "auto" takes at most `name`'s path from now on in this process ("amx": no limit).
void limit_isa(const std::string& name) {
  for (auto isa : pagedserve::kIsas) {
    if (name == pagedserve::isa_name(isa)) {
      pagedserve::isa_limit().store(static_cast<int>(isa), std::memory_order_relaxed);
      return;
    }
  }
  TORCH_CHECK(false, "limit_isa: unknown instruction-set path '", name, "' (scalar, avx2, avx512 or amx)");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("isa_paths() -> str[]", &isa_paths);
  m.def("best_isa() -> str", &best_isa);
  m.def("limit_isa(str name) -> ()", &limit_isa);
}
