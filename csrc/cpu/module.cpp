// The one pybind11 module of the CPU extension: runs every AMO_REGISTER block (see common/registry.h).
#include "common/registry.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ascend_moe_ops native CPU kernels (implementations only; schemas are in _library.py)";
  for (auto fn : amo::registry()) fn(m);
}
