// EmuLauncher: the Launcher (host/launch.h) of the emulated backend. Tensors are CPU tensors; a
// launch runs the kernel source compiled with g++ against the emulation layer (emu/) on the
// emulator's blocks, one after another, with the A2 rule models on, then checks what the kernel
// allocated against its tiling's plan. Only host/register.h includes this file (emulator build). The
// kernels it runs are the entries the host code declares (AMO_ASCEND_KERNEL, host/launch.h).
//
// Environment (tests only): ASCEND_MOE_OPS_EMU_AIV = vector core count (default 48, the 910B2);
// ASCEND_MOE_OPS_EMU_AIC = AI Core (Cube) count (default 24; AIV = 2 x AIC then);
// ASCEND_MOE_OPS_EMU_MAX_TILE_COLS = cap on the H-tile width (default none) to force multi-tile rows;
// ASCEND_MOE_OPS_EMU_CUBE_MAX_BASE = cap on baseM/baseN/baseK*stepK (default none) to force many tiles;
// ASCEND_MOE_OPS_EMU_UB_LIMIT = UB bytes the emulated core really has (default: the tiling's budget),
// to check that a tiling planning more UB than the core has is caught.
// Outputs are pre-filled with NaN, so a row a kernel forgets to write fails the tests.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <vector>

#include "emu/kernel_operator_emu.h"
#include "host/launch.h"

namespace amo_ascend {
namespace host {

struct EmuLauncher {
  static void check_device(const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.device().is_cpu(), "ascendc-emu: ", name, " must be a cpu tensor, got ", t.device());
  }

  static ChipInfo vector_chip(const at::Tensor&) {
    ChipInfo chip = Ascend910B2();
    if (const char* v = std::getenv("ASCEND_MOE_OPS_EMU_AIV")) chip.aivNum = static_cast<uint32_t>(std::max(1, std::atoi(v)));
    return chip;
  }

  static ChipInfo cube_chip(const at::Tensor&) {
    ChipInfo chip = Ascend910B2();
    if (const char* v = std::getenv("ASCEND_MOE_OPS_EMU_AIC")) {
      chip.aicNum = static_cast<uint32_t>(std::max(1, std::atoi(v)));
      chip.aivNum = 2 * chip.aicNum;  // A2/A3 AI Cores: one AIC and two AIVs each
    }
    return chip;
  }

  static uint32_t max_tile_cols() { return env_u32("ASCEND_MOE_OPS_EMU_MAX_TILE_COLS"); }
  static uint32_t cube_max_base() { return env_u32("ASCEND_MOE_OPS_EMU_CUBE_MAX_BASE"); }

  static at::Tensor output(at::IntArrayRef shape, const at::TensorOptions& opts) {
    return at::full(shape, std::numeric_limits<float>::quiet_NaN(), opts);
  }

  template <class T>
  static at::Tensor pod(const T& value, const at::Tensor&) {
    return pod_bytes(value, /*pinned=*/false);
  }

  template <class K, class... Gm>
  static void launch(const char* name, K kernel, const LaunchPlan& p, std::vector<at::Tensor> /*keep*/,
                     const Gm&... gm) {
    check_blocks(p, name);
    const ChipInfo c = Ascend910B2();  // the test knobs change core counts only, not memory sizes
    const ascend_emu::CubeMem caps{c.l1Bytes, c.l0aBytes, c.l0bBytes, c.l0cBytes};
    ascend_emu::set_kernel(name);
    switch (p.core) {
      case LaunchPlan::Core::kVector: {
        const uint64_t used = ascend_emu::launch(p.blockDim, ub_limit(), kernel, gm_arg(gm)...);
        check_ub(used, p, name);
        break;
      }
      case LaunchPlan::Core::kCube:
        check_cube(ascend_emu::launch_cube(p.blockDim, caps, kernel, gm_arg(gm)...), p, name);
        break;
      case LaunchPlan::Core::kMix: {
        const auto used = ascend_emu::launch_mix(p.blockDim, ub_limit(), caps, kernel, gm_arg(gm)...);
        check_cube(used.cube, p, name);
        check_ub(used.ub, p, name);
        break;
      }
    }
  }

 private:
  static uint32_t env_u32(const char* name) {
    const char* v = std::getenv(name);
    return v ? static_cast<uint32_t>(std::max(0, std::atoi(v))) : 0u;
  }
  static uint64_t ub_limit() {
    const char* v = std::getenv("ASCEND_MOE_OPS_EMU_UB_LIMIT");
    return v ? static_cast<uint64_t>(std::max(0, std::atoi(v))) : ub_budget(Ascend910B2());
  }
  static GM_ADDR gm_arg(const at::Tensor& t) { return reinterpret_cast<GM_ADDR>(gm_ptr(t)); }

  // The kernel's real allocations (TPipe::InitBuffer calls) against what its tiling planned and the
  // tiling tests checked against the budget.
  static void check_ub(uint64_t used, const LaunchPlan& p, const char* name) {
    TORCH_CHECK(p.ubExact ? used == p.ub : used <= p.ub, "ascendc-emu: kernel ", name, " allocated ", used,
                " B of UB per AIV but its tiling planned ", p.ub, " B");
  }
  static void check_cube(const ascend_emu::CubeMem& u, const LaunchPlan& p, const char* name) {
    const bool ok = p.cubeExact ? (u.l1 == p.l1 && u.l0a == p.l0a && u.l0b == p.l0b && u.l0c == p.l0c)
                                : (u.l1 <= p.l1 && u.l0a <= p.l0a && u.l0b <= p.l0b && u.l0c <= p.l0c);
    TORCH_CHECK(ok, "ascendc-emu: kernel ", name, " allocated L1/L0A/L0B/L0C ", u.l1, "/", u.l0a, "/", u.l0b, "/", u.l0c,
                " B but its tiling planned ", p.cubeExact ? "" : "at most ", p.l1, "/", p.l0a, "/", p.l0b, "/", p.l0c,
                " B");
  }
};

}  // namespace host
}  // namespace amo_ascend
