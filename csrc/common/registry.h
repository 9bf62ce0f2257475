// The internal pybind11 entries of the CPU extension ascend_moe_ops._C.
//
// AMO_REGISTER(name) { m.def(...); } adds plain pybind11 functions to the module, for internal entry
// points only: the large-output block cache (cpu/large_blocks.cpp) and the op checks alone
// (cpu/checks_bindings.cpp). No kernel has a raw entry: every one is reached through its dispatcher
// kernel, after its op's check. The dispatcher kernels themselves are registered from the op list
// (common/op_registry.h, cpu/module.cpp).
//
// The op checks alone derive from the op list too: every PUBLIC_OP has contract_<op>(m), declared
// here and defined in its own csrc/cpu/<family>.cpp by
//
//   AMO_OP_CONTRACT(op)     binds amo::checks::<op> (common/<family>_checks.h) as _C._check_<op>
//
// so a public op without it does not link, and an internal op or a file of another family does not
// compile (not declared; a static_assert on __FILE__).
#pragma once

#include <torch/extension.h>

#include <vector>

#include "op_registry.h"

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

namespace amo {
namespace op_list {

#define AMO_OP_CONTRACT_DECLARE(op, fam, scope, ascendc, grad) \
  AMO_WHEN(PUBLIC_OP, scope, void contract_##op(pybind11::module& m);)
ASCEND_MOE_OPS_FOR_EACH_OP(AMO_OP_CONTRACT_DECLARE)
#undef AMO_OP_CONTRACT_DECLARE

// Every public op's _C._check_<op>.
inline void register_contracts(pybind11::module& m) {
#define AMO_OP_CONTRACT_CALL(op, fam, scope, ascendc, grad) AMO_WHEN(PUBLIC_OP, scope, contract_##op(m);)
  ASCEND_MOE_OPS_FOR_EACH_OP(AMO_OP_CONTRACT_CALL)
#undef AMO_OP_CONTRACT_CALL
}

}  // namespace op_list
}  // namespace amo

// At namespace scope of csrc/cpu/<family>.cpp, after including common/<family>_checks.h: the op's
// contract alone, amo::checks::<op>, as the internal entry _C._check_<op> (PUBLIC_OP ops).
#define AMO_OP_CONTRACT(op)                                                                               \
  static_assert(::amo::op_list::file_is(__FILE__, ::amo::op_list::family::op, ".cpp"),                   \
                "AMO_OP_CONTRACT(" #op "): belongs in csrc/cpu/<its family>.cpp (common/registry.h)");     \
  void amo::op_list::contract_##op(pybind11::module& m) { m.def("_check_" #op, &::amo::checks::op); }
