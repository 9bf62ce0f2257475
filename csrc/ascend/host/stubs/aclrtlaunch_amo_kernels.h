// STUB DECLARATIONS FOR TYPE-CHECKING ONLY (tests/test_ascend_glue.py, -DAMO_ASCEND_GLUE_TYPECHECK).
//
// On a CANN machine the ascendc_library() CMake function compiles csrc/ascend/kernels/*.cpp with
// bisheng and GENERATES one header per kernel, aclrtlaunch_<kernel>.h, declaring a host launcher
// aclrtlaunch_<kernel>(blockDim, stream, <kernel's GM_ADDR arguments as void*>) (and the macro
// ACLRT_LAUNCH_KERNEL(kernel) that expands to it). Those generated headers do not exist here, so the
// glue's syntax check uses these hand-written declarations of the same shape instead. They are not
// compiled into anything and say nothing about the real generated code beyond this shape.
#pragma once

#include <cstdint>

#include "acl/acl.h"

extern "C" {
uint32_t aclrtlaunch_amo_moe_permute(uint32_t blockDim, aclrtStream stream, void* tokens, void* index, void* out,
                                     void* tiling);
uint32_t aclrtlaunch_amo_moe_unpermute(uint32_t blockDim, aclrtStream stream, void* permuted, void* rowMap, void* probs,
                                       void* out, void* tiling);
uint32_t aclrtlaunch_amo_moe_unpermute_grad(uint32_t blockDim, aclrtStream stream, void* gradOut, void* permuted,
                                            void* slotOfRow, void* probs, void* gradPermuted, void* dots, void* tiling);
uint32_t aclrtlaunch_amo_grouped_gemm(uint32_t blockDim, aclrtStream stream, void* x, void* weight, void* groupSizes,
                                      void* out, void* tiling);
uint32_t aclrtlaunch_amo_grouped_gemm_dw(uint32_t blockDim, aclrtStream stream, void* a, void* b, void* groupSizes,
                                         void* out, void* tiling);
// flash attention phase kernels (kernels/flash_attention_*.cpp), launched by csrc/ascend/flash_attention.cpp:
// forward (amo_fa_*) and backward (amo_fab_*), each taking the uint64 argument block and the tiling
uint32_t aclrtlaunch_amo_fa_qk(uint32_t blockDim, aclrtStream stream, void* gmArgs, void* tiling);
uint32_t aclrtlaunch_amo_fa_softmax(uint32_t blockDim, aclrtStream stream, void* gmArgs, void* tiling);
uint32_t aclrtlaunch_amo_fa_pv(uint32_t blockDim, aclrtStream stream, void* gmArgs, void* tiling);
uint32_t aclrtlaunch_amo_fa_update(uint32_t blockDim, aclrtStream stream, void* gmArgs, void* tiling);
uint32_t aclrtlaunch_amo_fa_fused(uint32_t blockDim, aclrtStream stream, void* gmArgs, void* tiling);  // mixed AIC+AIV
uint32_t aclrtlaunch_amo_fab_delta(uint32_t blockDim, aclrtStream stream, void* gmArgs, void* tiling);
uint32_t aclrtlaunch_amo_fab_qk(uint32_t blockDim, aclrtStream stream, void* gmArgs, void* tiling);
uint32_t aclrtlaunch_amo_fab_softmax(uint32_t blockDim, aclrtStream stream, void* gmArgs, void* tiling);
uint32_t aclrtlaunch_amo_fab_grad(uint32_t blockDim, aclrtStream stream, void* gmArgs, void* tiling);
uint32_t aclrtlaunch_amo_fab_acc(uint32_t blockDim, aclrtStream stream, void* gmArgs, void* tiling);
uint32_t aclrtlaunch_amo_fab_dkrope(uint32_t blockDim, aclrtStream stream, void* gmArgs, void* tiling);
uint32_t aclrtlaunch_amo_fab_fused(uint32_t blockDim, aclrtStream stream, void* gmArgs, void* tiling);  // mixed AIC+AIV
}
