// AscendC flash attention: the Cube (AIC_ONLY) phase kernels of the fallback path (ASCEND_MOE_OPS_FA_KERNELS=phases).
// One kernel type per source file (see kernels/flash_attention_common.h for the layout and the math).
// Nothing here has been compiled with bisheng or run on an NPU (see docs/ascend.md).
#include "kernels/flash_attention_common.h"

// Every phase kernel takes a GM block of the workspace/tensor addresses (struct FaGm, or FlashAttentionBwdArgs
// for the backward) and the tiling (pass and step set by the host). Written out one by one: CANN generates a
// launcher per kernel entry, so no macro hides them.
extern "C" __global__ __aicore__ void amo_fa_qk(GM_ADDR gmArgs, GM_ADDR tiling) {
  KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_AIC_ONLY);
  amo_ascend::kernels::FaRun<amo_ascend::kernels::FaQk>(gmArgs, tiling);
}
extern "C" __global__ __aicore__ void amo_fa_pv(GM_ADDR gmArgs, GM_ADDR tiling) {
  KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_AIC_ONLY);
  amo_ascend::kernels::FaRun<amo_ascend::kernels::FaPv>(gmArgs, tiling);
}
extern "C" __global__ __aicore__ void amo_fab_qk(GM_ADDR gmArgs, GM_ADDR tiling) {
  KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_AIC_ONLY);
  amo_ascend::kernels::FaRun<amo_ascend::kernels::FabQk, amo_ascend::FlashAttentionBwdArgs>(gmArgs, tiling);
}
extern "C" __global__ __aicore__ void amo_fab_grad(GM_ADDR gmArgs, GM_ADDR tiling) {
  KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_AIC_ONLY);
  amo_ascend::kernels::FaRun<amo_ascend::kernels::FabGrad, amo_ascend::FlashAttentionBwdArgs>(gmArgs, tiling);
}
