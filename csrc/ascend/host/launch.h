// The Launcher concept of the Ascend host glue, and what every per-op host function shares.
//
// Each op's host code is written ONCE, in host/<op>_host.h, as a function template on a Launcher
// type: op-boundary checks (common/checks.h), the Ascend-specific limits, tiling, workspace and
// output allocation, row maps, and the launch sequence. Two launchers instantiate it:
//
//   NpuLauncher (host/npu_common.h)   tensors on the NPU; aclrtlaunch_<kernel>(blockDim, stream, ...)
//                                     inside torch_npu's task queue on the current stream (the glue
//                                     TUs csrc/ascend/<family>.cpp register it for PrivateUse1)
//   EmuLauncher (host/emu_launcher.h) CPU tensors; the kernel runs on the emulator's blocks with the
//                                     A2 rule models, and the memory each kernel allocated is
//                                     checked against its tiling's plan (the same glue TUs, emulator build)
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
// The kernels themselves are declared by the host code of their op, once each, next to the code that
// launches them (host/<family>_host.h):
//
//   #include AMO_ASCEND_KERNEL_HEADER(amo_k)   // on an NPU build: CANN's generated aclrtlaunch_amo_k.h
//   AMO_ASCEND_KERNEL(amo_k, 4)                // the entry amo_k takes 4 GM addresses
//
// which makes kernels::amo_k the function a launch calls in this translation unit's build:
//   emulator (-DASCEND_MOE_OPS_EMU)       the kernel entry of kernels/*.cpp itself, compiled with g++
//                                         into the same extension: void(GM_ADDR x 4)
//   NPU (CMake with CANN)                 aclrtlaunch_amo_k(blockDim, stream, void* x 4) from
//                                         the header ascendc_library() generates for the kernel
//   glue type-check (-DAMO_ASCEND_GLUE_TYPECHECK, no CANN)
//                                         a declaration of that launcher of the same shape (a stand-in:
//                                         the generated headers do not exist without CANN)
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "tiling/tiling_common.h"
#ifdef ASCEND_MOE_OPS_EMU
#include "emu/kernel_operator_emu.h"  // GM_ADDR
#else
#include "acl/acl.h"  // aclrtStream
#endif

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

// fp16/bf16 only on the Cube kernels (fp32 accumulation in L0C): a TypeError naming the argument.
inline DType cube_dtype(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16, op, ": ", name,
                   " must have dtype in (float16, bfloat16) on the AscendC Cube path: the Ascend Cube kernel takes "
                   "float16/bfloat16 inputs only (fp32 accumulation in L0C), got ", t.scalar_type(),
                   "; fp32 inputs are not implemented on the Cube path: use the native or reference backend");
  return t.scalar_type() == at::kHalf ? DType::kF16 : DType::kBF16;
}

// The type of a kernel's entry with `N` GM arguments on this build (see AMO_ASCEND_KERNEL above).
template <class T, std::size_t>
using Rep = T;
template <class Seq>
struct KernelEntryOf;
template <std::size_t... I>
struct KernelEntryOf<std::index_sequence<I...>> {
#ifdef ASCEND_MOE_OPS_EMU
  using type = void(Rep<GM_ADDR, I>...);
#else
  using type = uint32_t(uint32_t, aclrtStream, Rep<void*, I>...);  // aclrtlaunch_<kernel>(blockDim, stream, ...)
  template <class F>
  static constexpr bool launchable = std::is_invocable_r_v<uint32_t, F, uint32_t, aclrtStream, Rep<void*, I>...>;
#endif
};
template <std::size_t N>
using KernelEntry = typename KernelEntryOf<std::make_index_sequence<N>>::type;

}  // namespace host
}  // namespace amo_ascend

#define AMO_ASCEND_STR_(x) #x
#define AMO_ASCEND_STR(x) AMO_ASCEND_STR_(x)
#if defined(ASCEND_MOE_OPS_EMU)
#define AMO_ASCEND_KERNEL_HEADER(k) "host/launch.h"  // nothing more to include
#define AMO_ASCEND_KERNEL(k, n_gm)                           \
  extern "C" ::amo_ascend::host::KernelEntry<n_gm> k;        \
  namespace amo_ascend {                                     \
  namespace kernels {                                        \
  inline constexpr auto k = &::k;                            \
  }                                                          \
  }
#else
#if defined(AMO_ASCEND_GLUE_TYPECHECK)
// STAND-IN for type-checking only: the declaration CANN would generate, of the same shape; compiled into
// nothing and says nothing about the generated code beyond this shape.
#define AMO_ASCEND_KERNEL_HEADER(k) "host/launch.h"
#define AMO_ASCEND_LAUNCHER_DECL(k, n_gm) extern "C" ::amo_ascend::host::KernelEntry<n_gm> aclrtlaunch_##k;
#else
#define AMO_ASCEND_KERNEL_HEADER(k) AMO_ASCEND_STR(aclrtlaunch_##k.h)
#define AMO_ASCEND_LAUNCHER_DECL(k, n_gm)
#endif
#define AMO_ASCEND_KERNEL(k, n_gm)                                                                             \
  AMO_ASCEND_LAUNCHER_DECL(k, n_gm)                                                                            \
  static_assert(::amo_ascend::host::KernelEntryOf<std::make_index_sequence<n_gm>>::launchable<                 \
                    decltype(&::aclrtlaunch_##k)>,                                                             \
                "aclrtlaunch_" #k " is not callable as (blockDim, stream, " #n_gm " GM addresses)");          \
  namespace amo_ascend {                                                                                       \
  namespace kernels {                                                                                          \
  inline constexpr auto k = &::aclrtlaunch_##k;                                                                \
  }                                                                                                            \
  }
#endif
