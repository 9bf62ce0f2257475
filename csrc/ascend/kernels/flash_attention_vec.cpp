// AscendC flash attention: the vector (AIV_ONLY) phase kernels of the fallback path, and amo_fab_delta / amo_fab_dkrope
// (used by both paths).
// One kernel type per source file (see kernels/flash_attention_common.h for the layout and the math).
// Nothing here has been compiled with bisheng or run on an NPU (see docs/ascend.md).
#include "kernels/flash_attention_common.h"

// Same argument blocks as the Cube phase kernels (flash_attention_cube.cpp).
extern "C" __global__ __aicore__ void amo_fa_softmax(GM_ADDR gmArgs, GM_ADDR tiling) {
  KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_AIV_ONLY);
  amo_ascend::kernels::FaRun<amo_ascend::kernels::FaSoftmax>(gmArgs, tiling);
}
extern "C" __global__ __aicore__ void amo_fa_update(GM_ADDR gmArgs, GM_ADDR tiling) {
  KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_AIV_ONLY);
  amo_ascend::kernels::FaRun<amo_ascend::kernels::FaUpdate>(gmArgs, tiling);
}
extern "C" __global__ __aicore__ void amo_fab_delta(GM_ADDR gmArgs, GM_ADDR tiling) {
  KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_AIV_ONLY);
  amo_ascend::kernels::FaRun<amo_ascend::kernels::FabDelta, amo_ascend::FlashAttentionBwdArgs>(gmArgs, tiling);
}
extern "C" __global__ __aicore__ void amo_fab_softmax(GM_ADDR gmArgs, GM_ADDR tiling) {
  KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_AIV_ONLY);
  amo_ascend::kernels::FaRun<amo_ascend::kernels::FabSoftmax, amo_ascend::FlashAttentionBwdArgs>(gmArgs, tiling);
}
extern "C" __global__ __aicore__ void amo_fab_acc(GM_ADDR gmArgs, GM_ADDR tiling) {
  KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_AIV_ONLY);
  amo_ascend::kernels::FaRun<amo_ascend::kernels::FabAcc, amo_ascend::FlashAttentionBwdArgs>(gmArgs, tiling);
}
extern "C" __global__ __aicore__ void amo_fab_dkrope(GM_ADDR gmArgs, GM_ADDR tiling) {
  KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_AIV_ONLY);
  amo_ascend::kernels::FaRun<amo_ascend::kernels::FabDkRope, amo_ascend::FlashAttentionBwdArgs>(gmArgs, tiling);
}
