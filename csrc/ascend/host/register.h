// Registration of the AscendC host code from the op list (common/op_list.h): every ASCENDC op has one
// glue translation unit, csrc/ascend/<family>.cpp, that includes its host code (host/<family>_host.h)
// and this header and says
//
//   AMO_ASCEND_OP(<op>)
//
// for each of its ops: the op's host function instantiated with this build's Launcher (EmuLauncher in
// the emulator extension, -DASCEND_MOE_OPS_EMU; NpuLauncher in the CMake build for the NPU). The shared
// translation units only call register_ascend(m): emu_bindings.cpp for namespace ascend_moe_ops_emu
// (dispatch key CPU), npu_bindings.cpp for ascend_moe_ops (PrivateUse1).
#pragma once

#include <torch/library.h>

#include "../../common/op_registry.h"

#ifdef ASCEND_MOE_OPS_EMU
#include "host/emu_launcher.h"
#else
#include "host/npu_common.h"
#endif

namespace amo_ascend {
namespace op_list {

#ifdef ASCEND_MOE_OPS_EMU
using Launcher = host::EmuLauncher;
#else
using Launcher = npu::NpuLauncher;
#endif

// ascend_<op>(m): m.impl of the op's host code, defined by AMO_ASCEND_OP in csrc/ascend/<family>.cpp.
#define AMO_ASCEND_DECLARE(op, fam, scope, ascendc, grad) AMO_WHEN(ASCENDC, ascendc, void ascend_##op(torch::Library& m);)
ASCEND_MOE_OPS_FOR_EACH_OP(AMO_ASCEND_DECLARE)
#undef AMO_ASCEND_DECLARE

// Every ASCENDC op of the list.
inline void register_ascend(torch::Library& m) {
#define AMO_ASCEND_CALL(op, fam, scope, ascendc, grad) AMO_WHEN(ASCENDC, ascendc, ascend_##op(m);)
  ASCEND_MOE_OPS_FOR_EACH_OP(AMO_ASCEND_CALL)
#undef AMO_ASCEND_CALL
}

}  // namespace op_list
}  // namespace amo_ascend

// At namespace scope of csrc/ascend/<family>.cpp: op's host code, host::<op><Launcher>.
#define AMO_ASCEND_OP(op)                                                                               \
  static_assert(::amo::op_list::file_is(__FILE__, ::amo::op_list::family::op, ".cpp"),                 \
                "AMO_ASCEND_OP(" #op "): belongs in csrc/ascend/<its family>.cpp (common/op_list.h)");  \
  void amo_ascend::op_list::ascend_##op(torch::Library& m) {                                            \
    m.impl(#op, TORCH_FN(::amo_ascend::host::op<::amo_ascend::op_list::Launcher>));                     \
  }
