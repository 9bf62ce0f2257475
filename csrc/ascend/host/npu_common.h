// The NPU side of the host glue: chip facts from the ACL runtime, the launch inside torch_npu's task
// queue on the current stream, and NpuLauncher, the Launcher (host/launch.h) that the glue TUs
// csrc/ascend/<family>.cpp instantiate the per-op host code of host/<family>_host.h with (through
// host/register.h). The kernels' launchers aclrtlaunch_<kernel> come from the headers CANN generates,
// included by the host code that launches them (AMO_ASCEND_KERNEL_HEADER, host/launch.h).
// Built only on a CANN machine (see docs/ascend.md); type-checked in CI against the headers of the
// torch_npu wheel (tests/test_ascend_glue.py).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstring>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>
#include <unordered_map>

#include "acl/acl.h"
#include "torch_npu/csrc/core/npu/NPUStream.h"
#include "torch_npu/csrc/framework/OpCommand.h"

#include "host/launch.h"
#include "tiling/tiling_common.h"


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

// The Launcher (host/launch.h) of the NPU: the host code of host/<family>_host.h instantiated with it
// is what the glue TUs register for PrivateUse1.
struct NpuLauncher {
  static void check_device(const at::Tensor& t, const char* name) { check_npu(t, name); }
  static ChipInfo vector_chip(const at::Tensor& like) { return chip_info(like); }
  static ChipInfo cube_chip(const at::Tensor& like) { return chip_info(like); }
  static uint32_t max_tile_cols() { return 0; }  // no cap: the tiling's own choice
  static uint32_t cube_max_base() { return 0; }

  // Uninitialized: the kernels write every element (the emulator proves it with NaN-filled outputs).
  static at::Tensor output(at::IntArrayRef shape, const at::TensorOptions& opts) { return at::empty(shape, opts); }

  // Pinned host staging + asynchronous copy on the current stream (the caching host allocator keeps
  // the staging buffer alive until the copy has run).
  template <class T>
  static at::Tensor pod(const T& value, const at::Tensor& like) {
    return host::pod_bytes(value, /*pinned=*/true).to(like.device(), /*non_blocking=*/true);
  }

  // aclrtlaunch_<kernel>(blockDim, stream, GM pointers...) as one task on the current stream.
  template <class K, class... Gm>
  static void launch(const char* name, K kernel, const host::LaunchPlan& p, std::vector<at::Tensor> keep,
                     const Gm&... gm) {
    host::check_blocks(p, name);
    const uint32_t blockDim = p.blockDim;
    const auto args = std::make_tuple(host::gm_ptr(gm)...);
    keep.insert(keep.end(), {gm...});
    run_on_stream(name, [=](aclrtStream stream) {
      return std::apply([&](auto... a) { return kernel(blockDim, stream, a...); }, args);
    }, std::move(keep));
  }
};

}  // namespace npu
}  // namespace amo_ascend
