// The one pybind11 module of the CPU extension. Importing it registers every native kernel with the
// dispatcher (namespace ascend_moe_ops_native, see common/registry.h); _bind_cpu(ns) registers the
// same C++ kernels for another namespace's CPU key (the public ascend_moe_ops, chosen at import).
#include "common/registry.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ascend_moe_ops native CPU kernels (implementations only; schemas are in _library.py)";
  m.def("_bind_cpu", &amo::bind_cpu, "register the native kernels for namespace ns, dispatch key CPU",
        pybind11::arg("ns"));
  for (auto fn : amo::registry()) fn(m);
}
