// Registration of native CPU functions into the single Python extension ascend_moe_ops._C.
//
// Schemas live in ascend_moe_ops/_library.py; the C++ side only provides implementations, exposed as
// plain functions with the op's positional signature. Each csrc/cpu/<op>.cpp adds its functions with
//     AMO_REGISTER(moe_permute) { m.def("moe_permute", &moe_permute_cpu, "..."); }
// and csrc/cpu/module.cpp (the one PYBIND11_MODULE) runs every registered block, so adding an op never
// touches a shared file.
#pragma once

#include <torch/extension.h>

#include <functional>
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
