// The internal pybind11 entries of the CPU extension ascend_moe_ops._C.
//
// AMO_REGISTER(name) { m.def(...); } adds plain pybind11 functions to the module, for internal entry
// points only: the large-output block cache (cpu/large_blocks.cpp) and the op checks alone
// (cpu/checks_bindings.cpp). No kernel has a raw entry: every one is reached through its dispatcher
// kernel, after its op's check. The dispatcher kernels themselves are registered from the op list
// (common/op_registry.h, cpu/module.cpp).
#pragma once

#include <torch/extension.h>

#include <vector>

namespace amo {

using RegisterFn = void (*)(pybind11::module&);

inline std::vector<RegisterFn>& registry() {
  static std::vector<RegisterFn> fns;
  return fns;
}

struct Registrar {
  explicit Registrar(RegisterFn fn) { registry().push_back(fn); }
};

}  // namespace amo

#define AMO_REGISTER(name)                                            \
  static void amo_register_##name(pybind11::module& m);               \
  static ::amo::Registrar amo_registrar_##name(&amo_register_##name); \
  static void amo_register_##name(pybind11::module& m)
