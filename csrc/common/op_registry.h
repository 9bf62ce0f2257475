// What derives from the op list (common/op_list.h) on the C++ side: one registration function per op
// and per place, declared here from the list and defined in the op's own files with
//
//   AMO_CPU_KERNEL(op, fn)     in csrc/cpu/<family>.cpp           the native CPU kernel
//   AMO_CXX_AUTOGRAD(op, fn)   in csrc/cpu/<family>_autograd.cpp  the C++ autograd kernel (CXX_GRAD ops)
//   AMO_ASCEND_OP(op)          in csrc/ascend/<family>.cpp        the AscendC host code (host/register.h)
//   AMO_OP_CONTRACT(op)        in csrc/cpu/<family>.cpp           _C._check_<op>, the contract alone
//                                                                 (PUBLIC_OP ops; common/registry.h)
//
// The shared translation units only expand the list (cpu/module.cpp, cpu/autograd.cpp,
// cpu/checks_bindings.cpp, ascend/emu_bindings.cpp, ascend/npu_bindings.cpp). So an op missing from
// the list does not compile in its own file (its function is not declared), an op of the list
// without its definition does not link, and a definition in a file of another family fails a
// static_assert on the file name.
#pragma once

#include <torch/library.h>

#include <cstddef>

#include "op_list.h"

// AMO_WHEN(COLUMN_VALUE, value, code...): `code` when `value` (a column of the list) is COLUMN_VALUE.
#define AMO_SEL_PUBLIC_OP_PUBLIC_OP(...) __VA_ARGS__
#define AMO_SEL_PUBLIC_OP_INTERNAL_OP(...)
#define AMO_SEL_INTERNAL_OP_PUBLIC_OP(...)
#define AMO_SEL_INTERNAL_OP_INTERNAL_OP(...) __VA_ARGS__
#define AMO_SEL_ASCENDC_ASCENDC(...) __VA_ARGS__
#define AMO_SEL_ASCENDC_NO_ASCENDC(...)
#define AMO_SEL_CXX_GRAD_CXX_GRAD(...) __VA_ARGS__
#define AMO_SEL_CXX_GRAD_NO_CXX_GRAD(...)
#define AMO_WHEN(want, value, ...) AMO_SEL_##want##_##value(__VA_ARGS__)

namespace amo {
namespace op_list {

// family::<op>: the stem of the op's files
namespace family {
#define AMO_OP_FAMILY(op, fam, scope, ascendc, grad) inline constexpr char op[] = #fam;
ASCEND_MOE_OPS_FOR_EACH_OP(AMO_OP_FAMILY)
#undef AMO_OP_FAMILY
}  // namespace family

// home::<op>: the namespace that defines the op and holds its C++ autograd kernel
namespace home {
#define AMO_OP_HOME(op, fam, scope, ascendc, grad)                  \
  AMO_WHEN(PUBLIC_OP, scope, inline constexpr char op[] = "ascend_moe_ops";) \
  AMO_WHEN(INTERNAL_OP, scope, inline constexpr char op[] = "ascend_moe_ops_native";)
ASCEND_MOE_OPS_FOR_EACH_OP(AMO_OP_HOME)
#undef AMO_OP_HOME
}  // namespace home

// Whether `file` (a __FILE__) is <dir>/<family><suffix>.
constexpr std::size_t length(const char* s) {
  std::size_t n = 0;
  while (s[n]) ++n;
  return n;
}
constexpr bool file_is(const char* file, const char* fam, const char* suffix) {
  const std::size_t f = length(file), a = length(fam), b = length(suffix);
  if (f < a + b) return false;
  for (std::size_t i = 0; i < b; ++i)
    if (file[f - b + i] != suffix[i]) return false;
  for (std::size_t i = 0; i < a; ++i)
    if (file[f - b - a + i] != fam[i]) return false;
  return f == a + b || file[f - b - a - 1] == '/' || file[f - b - a - 1] == '\\';
}

// cpu_<op>(m): m.impl of the op's native CPU kernel; autograd_<op>(m): of its C++ autograd kernel.
#define AMO_OP_DECLARE(op, fam, scope, ascendc, grad) \
  void cpu_##op(torch::Library& m);                   \
  AMO_WHEN(CXX_GRAD, grad, void autograd_##op(torch::Library& m);)
ASCEND_MOE_OPS_FOR_EACH_OP(AMO_OP_DECLARE)
#undef AMO_OP_DECLARE

// Every op's CPU kernel (the native namespace), or the public ops' only (another namespace's CPU key).
inline void register_cpu(torch::Library& m, bool public_only) {
#define AMO_OP_CPU(op, fam, scope, ascendc, grad) \
  AMO_WHEN(PUBLIC_OP, scope, cpu_##op(m);)        \
  AMO_WHEN(INTERNAL_OP, scope, if (!public_only) cpu_##op(m);)
  ASCEND_MOE_OPS_FOR_EACH_OP(AMO_OP_CPU)
#undef AMO_OP_CPU
}

}  // namespace op_list
}  // namespace amo

// At namespace scope of csrc/cpu/<family>.cpp: `fn` is the native CPU kernel of `op`.
#define AMO_CPU_KERNEL(op, fn)                                                                           \
  static_assert(::amo::op_list::file_is(__FILE__, ::amo::op_list::family::op, ".cpp"),                   \
                "AMO_CPU_KERNEL(" #op "): belongs in csrc/cpu/<its family>.cpp (common/op_list.h)");       \
  void amo::op_list::cpu_##op(torch::Library& m) { m.impl(#op, TORCH_FN(fn)); }

// At namespace scope of csrc/cpu/<family>_autograd.cpp: `fn` is the C++ autograd kernel of `op`.
#define AMO_CXX_AUTOGRAD(op, fn)                                                                         \
  static_assert(::amo::op_list::file_is(__FILE__, ::amo::op_list::family::op, "_autograd.cpp"),          \
                "AMO_CXX_AUTOGRAD(" #op "): belongs in csrc/cpu/<its family>_autograd.cpp (common/op_list.h)"); \
  void amo::op_list::autograd_##op(torch::Library& m) { m.impl(#op, TORCH_FN(fn)); }
