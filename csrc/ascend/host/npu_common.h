// Shared pieces of the NPU host glue (csrc/ascend/moe_*.cpp, grouped_gemm.cpp, flash_attention.cpp): chip
// facts from the ACL runtime, tiling (and argument block) upload, and the launch inside torch_npu's task
// queue on the current stream.
// Built only on a CANN machine (see docs/ascend.md); type-checked in CI against the headers of the
// torch_npu wheel (tests/test_ascend_glue.py).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>

#include "acl/acl.h"
#include "torch_npu/csrc/core/npu/NPUStream.h"
#include "torch_npu/csrc/framework/OpCommand.h"

#include "tiling/tiling_common.h"

#ifdef AMO_ASCEND_GLUE_TYPECHECK
#include "host/stubs/aclrtlaunch_amo_kernels.h"  // stand-ins for the CANN-generated launch headers
#else
#include "aclrtlaunch_amo_moe_permute.h"
#include "aclrtlaunch_amo_moe_unpermute.h"
#include "aclrtlaunch_amo_moe_unpermute_grad.h"
#include "aclrtlaunch_amo_grouped_gemm.h"
#include "aclrtlaunch_amo_grouped_gemm_dw.h"
#include "aclrtlaunch_amo_fa_qk.h"
#include "aclrtlaunch_amo_fa_softmax.h"
#include "aclrtlaunch_amo_fa_pv.h"
#include "aclrtlaunch_amo_fa_update.h"
#include "aclrtlaunch_amo_fa_fused.h"
#include "aclrtlaunch_amo_fab_delta.h"
#include "aclrtlaunch_amo_fab_qk.h"
#include "aclrtlaunch_amo_fab_softmax.h"
#include "aclrtlaunch_amo_fab_grad.h"
#include "aclrtlaunch_amo_fab_acc.h"
#include "aclrtlaunch_amo_fab_dkrope.h"
#include "aclrtlaunch_amo_fab_fused.h"
#endif

namespace amo_ascend {
namespace npu {

// Core counts of the current device from the ACL runtime; memory sizes stay the 910B defaults of
// tiling_common.h (all A2/A3 parts have 192 KiB UB per AIV core).
inline ChipInfo chip_info(const at::Tensor& like) {
  static std::mutex mu;
  static std::unordered_map<int, ChipInfo> cache;
  const int dev = like.device().index();
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(dev);
  if (it != cache.end()) return it->second;
  ChipInfo chip = Ascend910B2();
  int64_t v = 0;
  if (aclGetDeviceCapability(static_cast<uint32_t>(dev), ACL_DEVICE_INFO_VECTOR_CORE_NUM, &v) == ACL_SUCCESS && v > 0)
    chip.aivNum = static_cast<uint32_t>(v);
  if (aclGetDeviceCapability(static_cast<uint32_t>(dev), ACL_DEVICE_INFO_AI_CORE_NUM, &v) == ACL_SUCCESS && v > 0)
    chip.aicNum = static_cast<uint32_t>(v);
  cache.emplace(dev, chip);
  return chip;
}

// The POD tiling struct as a device tensor: pinned host staging + asynchronous copy on the current
// stream (the caching host allocator keeps the staging buffer alive until the copy has run).
template <typename Tiling>
at::Tensor upload_tiling(const Tiling& t, const at::Tensor& like) {
  auto host = at::empty({static_cast<int64_t>(sizeof(Tiling))}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  std::memcpy(host.data_ptr(), &t, sizeof(Tiling));
  return host.to(like.device(), /*non_blocking=*/true);
}

inline void* ptr(const at::Tensor& t) { return t.defined() && t.numel() ? const_cast<void*>(t.data_ptr()) : nullptr; }

// Run `launch(stream)` as one task of torch_npu's queue on the current NPU stream. `keep` holds the
// tensors the kernel reads or writes, so they outlive the queued task.
template <typename F>
void run_on_stream(const char* name, F launch, std::vector<at::Tensor> keep) {
  aclrtStream stream = c10_npu::getCurrentNPUStream().stream(false);
  at_npu::native::OpCommand cmd;
  cmd.Name(name).SetCustomHandler([launch, stream, keep]() -> int {
    const uint32_t rc = launch(stream);
    TORCH_CHECK(rc == 0, "ascend_moe_ops: launch of an AscendC kernel failed with ", rc);
    return 0;
  });
  cmd.Run();
}

inline void check_npu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().type() == c10::DeviceType::PrivateUse1, "ascend_moe_ops (AscendC): ", name,
              " must be on the NPU, got ", t.device());
}

}  // namespace npu
}  // namespace amo_ascend
