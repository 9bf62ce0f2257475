// NPU registration of flash_attention_fwd and flash_attention_bwd (PrivateUse1): the host code of
// host/flash_attention_host.h (checks, tiling, workspaces, argument block, launch sequence), the same
// the emulated backend runs in CI, instantiated with NpuLauncher. Schemas are defined in
// ascend_moe_ops/_library.py. UNVERIFIED: type-checked with g++ only (tests/test_ascend_glue.py),
// never compiled with the CANN toolkit nor run on an NPU (docs/ascend.md).
#include <torch/library.h>

#include "host/flash_attention_host.h"
#include "host/npu_common.h"

TORCH_LIBRARY_IMPL(ascend_moe_ops, PrivateUse1, m) {
  using amo_ascend::npu::NpuLauncher;
  m.impl("flash_attention_fwd", TORCH_FN(amo_ascend::host::flash_attention_fwd<NpuLauncher>));
  m.impl("flash_attention_bwd", TORCH_FN(amo_ascend::host::flash_attention_bwd<NpuLauncher>));
}
