// NPU registration of grouped_gemm and grouped_gemm_dw (PrivateUse1): the host code of
// host/grouped_gemm_host.h, the same the emulated backend runs in CI, instantiated with NpuLauncher.
// Schemas are defined in ascend_moe_ops/_library.py.
#include <torch/library.h>

#include "host/grouped_gemm_host.h"
#include "host/npu_common.h"

TORCH_LIBRARY_IMPL(ascend_moe_ops, PrivateUse1, m) {
  using amo_ascend::npu::NpuLauncher;
  m.impl("grouped_gemm", TORCH_FN(amo_ascend::host::grouped_gemm<NpuLauncher>));
  m.impl("grouped_gemm_dw", TORCH_FN(amo_ascend::host::grouped_gemm_dw<NpuLauncher>));
}
