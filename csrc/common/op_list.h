// The one C++ list of the ops of ascend_moe_ops. Every C++ registration derives from it
// (common/op_registry.h, csrc/ascend/host/register.h): the native CPU kernels and their binding to the
// public namespace, the op-contract bindings (cpu/checks_bindings.cpp), the C++ autograd kernels
// (cpu/autograd.cpp), the emulated AscendC kernels (ascend/emu_bindings.cpp) and the NPU ones
// (ascend/npu_bindings.cpp). The schemas stay in ascend_moe_ops/_library.py; an op's code stays in its
// own files, named after its family:
//
//   csrc/cpu/<family>.cpp               AMO_CPU_KERNEL(<op>, fn)       (every op)
//                                       AMO_OP_CONTRACT(<op>)          (PUBLIC_OP ops: _C._check_<op>)
//   csrc/common/<family>_checks.h       amo::checks::<op>(...)         (PUBLIC_OP ops: the op's contract)
//   csrc/cpu/<family>_autograd.cpp      AMO_CXX_AUTOGRAD(<op>, fn)     (CXX_GRAD ops)
//   csrc/ascend/<family>.cpp            AMO_ASCEND_OP(<op>)            (ASCENDC ops)
//   csrc/ascend/host/<family>_host.h    template <class L> <op>(...)   (ASCENDC ops) and the
//                                       AMO_ASCEND_KERNEL(<entry>, <GM args>) of its AscendC kernels
//   csrc/ascend/kernels/*.cpp           the kernel entries
//
// Columns: X(op, family, scope, ascendc, autograd)
//   op        schema name (ascend_moe_ops/_library.py)
//   family    stem of the files above (an op and its backward share one)
//   scope     PUBLIC_OP: defined in ascend_moe_ops and every backend namespace; its contract is
//             amo::checks::<op> (common/<family>_checks.h, on the shared helpers of common/checks.h).
//             INTERNAL_OP: ascend_moe_ops_native only.
//   ascendc   ASCENDC: host code and AscendC kernels (emulator + NPU); NO_ASCENDC: none
//   autograd  CXX_GRAD: a C++ autograd formula, registered at the Autograd key of the op's namespace
//             (ascend_moe_ops for PUBLIC_OP, ascend_moe_ops_native for INTERNAL_OP); NO_CXX_GRAD: none
// tests/test_cxx_op_list.py checks this list against the files and the registered schemas.
#pragma once

// clang-format off
#define ASCEND_MOE_OPS_FOR_EACH_OP(X)                                                 \
  X(moe_permute,            moe_permute,     PUBLIC_OP,   ASCENDC,    CXX_GRAD)     \
  X(moe_unpermute,          moe_unpermute,   PUBLIC_OP,   ASCENDC,    CXX_GRAD)     \
  X(moe_unpermute_backward, moe_unpermute,   PUBLIC_OP,   ASCENDC,    NO_CXX_GRAD)  \
  X(grouped_gemm,           grouped_gemm,    PUBLIC_OP,   ASCENDC,    CXX_GRAD)     \
  X(grouped_gemm_dw,        grouped_gemm,    PUBLIC_OP,   ASCENDC,    CXX_GRAD)     \
  X(flash_attention_fwd,    flash_attention, PUBLIC_OP,   ASCENDC,    CXX_GRAD)     \
  X(flash_attention_bwd,    flash_attention, PUBLIC_OP,   ASCENDC,    NO_CXX_GRAD)  \
  X(mla_attention_fwd,      mla_attention,   PUBLIC_OP,   NO_ASCENDC, CXX_GRAD)     \
  X(mla_attention_bwd,      mla_attention,   PUBLIC_OP,   NO_ASCENDC, NO_CXX_GRAD)  \
  X(swiglu_probs,           swiglu_probs,    INTERNAL_OP, NO_ASCENDC, CXX_GRAD)     \
  X(swiglu_probs_backward,  swiglu_probs,    INTERNAL_OP, NO_ASCENDC, NO_CXX_GRAD)  \
  X(mask_permute,           mask_permute,    INTERNAL_OP, NO_ASCENDC, NO_CXX_GRAD)  \
  X(sort_chunks,            mask_permute,    INTERNAL_OP, NO_ASCENDC, NO_CXX_GRAD)
// clang-format on
