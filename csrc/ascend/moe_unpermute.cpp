// NPU registration of moe_unpermute and moe_unpermute_backward (PrivateUse1): the host code of
// host/moe_unpermute_host.h, the same the emulated backend runs in CI, instantiated with NpuLauncher.
// Schemas are defined in ascend_moe_ops/_library.py.
#include <torch/library.h>

#include "host/moe_unpermute_host.h"
#include "host/npu_common.h"

TORCH_LIBRARY_IMPL(ascend_moe_ops, PrivateUse1, m) {
  using amo_ascend::npu::NpuLauncher;
  m.impl("moe_unpermute", TORCH_FN(amo_ascend::host::moe_unpermute<NpuLauncher>));
  m.impl("moe_unpermute_backward", TORCH_FN(amo_ascend::host::moe_unpermute_backward<NpuLauncher>));
}
