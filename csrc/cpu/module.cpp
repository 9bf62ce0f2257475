// The one pybind11 module of the CPU extension, and the registration of the native CPU kernels from
// the op list (common/op_list.h): importing the extension registers every op's kernel for namespace
// ascend_moe_ops_native, dispatch key CPU; _bind_cpu(ns) registers the public ops' kernels (the same
// C++ functions) for another namespace's CPU key (the public ascend_moe_ops, chosen at import), so
// the dispatcher calls the C++ kernel directly, no Python in between. Every kernel starts with its
// op's check (common/<family>_checks.h).
#include <torch/extension.h>
#include <torch/library.h>

#include <memory>
#include <set>
#include <string>
#include <vector>

#include "common/op_registry.h"
#include "common/registry.h"

namespace {

// Once per namespace; the torch::Library objects live until the process exits.
void bind_cpu(const std::string& ns) {
  static std::set<std::string> done;
  static std::vector<std::unique_ptr<torch::Library>> libs;
  if (!done.insert(ns).second) return;
  libs.push_back(std::make_unique<torch::Library>(torch::Library::IMPL, ns, c10::DispatchKey::CPU, __FILE__, __LINE__));
  amo::op_list::register_cpu(*libs.back(), /*public_only=*/true);
}

}  // namespace

TORCH_LIBRARY_IMPL(ascend_moe_ops_native, CPU, m) { amo::op_list::register_cpu(m, /*public_only=*/false); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ascend_moe_ops native CPU kernels (implementations only; schemas are in _library.py)";
  m.def("_bind_cpu", &bind_cpu, "register the native kernels of the public ops for namespace ns, dispatch key CPU",
        pybind11::arg("ns"));
  for (auto fn : amo::registry()) fn(m);
}
