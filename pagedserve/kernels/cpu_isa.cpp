// The run-time instruction-set choice (cpu_isa.h), visible from Python: which paths this CPU runs
// (the tests run each of them) and which one "auto" takes (the engine logs it).
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("isa_paths() -> str[]", &isa_paths);
  m.def("best_isa() -> str", &best_isa);
}
