// The Launcher concept of the Ascend host glue, and what every per-op host function shares.
//
// Each op's host code is written ONCE, in host/<op>_host.h, as a function template on a Launcher
// type: op-boundary checks (common/checks.h), the Ascend-specific limits, tiling, workspace and
// output allocation, row maps, and the launch sequence. Two launchers instantiate it:
//
//   NpuLauncher (host/npu_common.h)   tensors on the NPU; aclrtlaunch_<kernel>(blockDim, stream, ...)
//                                     inside torch_npu's task queue on the current stream (the glue
//                                     TUs csrc/ascend/{moe_permute,moe_unpermute,grouped_gemm,
//                                     flash_attention}.cpp register it for PrivateUse1)
//   EmuLauncher (host/emu_launcher.h) CPU tensors; the kernel runs on the emulator's blocks with the
//                                     A2 rule models, and the memory each kernel allocated is
//                                     checked against its tiling's plan (emu_bindings.cpp)
//
// so the host code CI runs on the emulator is the host code an NPU runs. A Launcher provides:
//
//   static void check_device(const Tensor& t, const char* name);   // t is on this backend's device
//   static ChipInfo vector_chip(const Tensor& like);               // AIV facts (vector kernels)
//   static ChipInfo cube_chip(const Tensor& like);                 // AIC facts (Cube and mixed kernels)
//   static uint32_t max_tile_cols();    // cap on the H-tile width of the vector tilings, 0 = none
//   static uint32_t cube_max_base();    // cap on the Cube base blocks, 0 = none
//   static Tensor output(IntArrayRef shape, const TensorOptions& o);  // every element is written
//                                       // by a kernel (the emulator fills it with NaN to prove it)
//   template <class T> static Tensor pod(const T& value, const Tensor& like);  // a POD (tiling,
//                                       // argument block) as a byte buffer in global memory
//   template <class K, class... Gm> static void launch(const char* name, K kernel, const LaunchPlan& plan,
//                                       std::vector<Tensor> keep, const Gm&... gm);
//                                       // run `kernel` with the GM arguments `gm` (tensors, in the
//                                       // kernel's argument order); `keep` = tensors the kernel reaches
//                                       // through an argument block, kept alive until it has run
//
// and one static constexpr member per kernel of host/kernel_list.h (the kernel entry on the emulator,
// its aclrtlaunch_ launcher on the NPU).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <cstring>

#include "tiling/tiling_common.h"

// Every AscendC kernel entry of csrc/ascend/kernels/*.cpp; a Launcher has one member per entry.
#define AMO_ASCEND_KERNELS(X)                                                                            \
  X(amo_moe_permute) X(amo_moe_unpermute) X(amo_moe_unpermute_grad) X(amo_grouped_gemm) X(amo_grouped_gemm_dw) \
  X(amo_fa_qk) X(amo_fa_softmax) X(amo_fa_pv) X(amo_fa_update) X(amo_fa_fused) X(amo_fab_delta) X(amo_fab_qk)   \
  X(amo_fab_softmax) X(amo_fab_grad) X(amo_fab_acc) X(amo_fab_dkrope) X(amo_fab_fused)

namespace amo_ascend {
namespace host {

// What one launch runs on and what its tiling planned. The launcher checks blockDim against the
// chip; the emulator also checks the kernel's allocations against the plan ("exact": the kernel must
// allocate exactly the planned bytes, as for a one-kernel tiling; otherwise at most, as for the phase
// kernels that share one plan).
struct LaunchPlan {
  enum class Core { kVector, kCube, kMix } core;
  uint32_t blockDim;
  uint32_t maxBlocks;  // AIV cores (vector), AIC cores (Cube, mixed: one AI Core group each)
  uint64_t ub;         // UB bytes per AIV core (vector, mixed)
  bool ubExact;
  uint64_t l1, l0a, l0b, l0c;  // Cube memories (Cube, mixed)
  bool cubeExact;
};

inline LaunchPlan vector_plan(uint32_t blockDim, const ChipInfo& chip, uint64_t ub, bool exact) {
  return LaunchPlan{LaunchPlan::Core::kVector, blockDim, chip.aivNum, ub, exact, 0, 0, 0, 0, false};
}

inline LaunchPlan cube_plan(uint32_t blockDim, const ChipInfo& chip, uint64_t l1, uint64_t l0a, uint64_t l0b,
                            uint64_t l0c, bool exact) {
  return LaunchPlan{LaunchPlan::Core::kCube, blockDim, chip.aicNum, 0, false, l1, l0a, l0b, l0c, exact};
}

inline LaunchPlan mix_plan(uint32_t groups, const ChipInfo& chip, uint64_t ub, uint64_t l1, uint64_t l0a, uint64_t l0b,
                           uint64_t l0c) {
  return LaunchPlan{LaunchPlan::Core::kMix, groups, chip.aicNum, ub, true, l1, l0a, l0b, l0c, false};
}

inline void check_blocks(const LaunchPlan& p, const char* name) {
  TORCH_CHECK(p.blockDim >= 1 && p.blockDim <= p.maxBlocks, "ascend_moe_ops (AscendC): kernel ", name, ": blockDim ",
              p.blockDim, " outside [1, ", p.maxBlocks, "] ",
              p.core == LaunchPlan::Core::kVector ? "vector (AIV) cores" : "AI Cores (AIC)");
}

// Device address of a tensor for a kernel argument or an argument block (null for an empty tensor).
inline void* gm_ptr(const at::Tensor& t) {
  return t.defined() && t.numel() ? const_cast<void*>(t.data_ptr()) : nullptr;
}
inline uint64_t gm_addr(const at::Tensor& t) { return reinterpret_cast<uint64_t>(gm_ptr(t)); }

// A POD as host bytes (the launchers move them to global memory).
template <class T>
at::Tensor pod_bytes(const T& value, bool pinned) {
  auto host = at::empty({static_cast<int64_t>(sizeof(T))}, at::TensorOptions().dtype(at::kByte).pinned_memory(pinned));
  std::memcpy(host.data_ptr(), &value, sizeof(T));
  return host;
}

// fp16/bf16 only on the Cube kernels (fp32 accumulation in L0C).
inline DType cube_dtype(const at::Tensor& t, const char* op) {
  TORCH_CHECK(t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16, op,
              " (AscendC Cube kernels): the Ascend Cube kernel takes float16/bfloat16 inputs only (fp32 accumulation "
              "in L0C), got ", t.scalar_type(), "; fp32 inputs are not implemented on the Cube path: use the native or "
              "reference backend");
  return t.scalar_type() == at::kHalf ? DType::kF16 : DType::kBF16;
}

}  // namespace host
}  // namespace amo_ascend
