// NPU registration of moe_permute (dispatch key PrivateUse1, registered by torch_npu): the host code
// of host/moe_permute_host.h, the same the emulated backend runs in CI, instantiated with NpuLauncher.
// The schema is defined in ascend_moe_ops/_library.py.
#include <torch/library.h>

#include "host/moe_permute_host.h"
#include "host/npu_common.h"

TORCH_LIBRARY_IMPL(ascend_moe_ops, PrivateUse1, m) {
  using amo_ascend::npu::NpuLauncher;
  m.impl("moe_permute", TORCH_FN(amo_ascend::host::moe_permute<NpuLauncher>));
}
