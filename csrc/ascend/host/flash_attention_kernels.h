// Which flash attention kernels the host launches. Shared by the NPU glue (csrc/ascend/flash_attention.cpp)
// and the emulator build of the same glue, so both read ASCEND_MOE_OPS_FA_KERNELS alike.
#pragma once

#include <c10/util/Exception.h>

#include <cstdint>
#include <cstdlib>
#include <string>

#include "tiling/flash_attention_tiling.h"

namespace amo_ascend {
namespace host {

// The fused mixed kernels amo_fa_fused / amo_fab_fused ("fused", the default) or the phase kernels
// ("phases": a fallback should the mixed kernels misbehave on a device).
inline bool fa_fused() {
  const char* v = std::getenv("ASCEND_MOE_OPS_FA_KERNELS");
  if (!v || !*v || std::string(v) == "fused") return true;
  TORCH_CHECK(std::string(v) == "phases", "ASCEND_MOE_OPS_FA_KERNELS must be 'fused' or 'phases', got '", v, "'");
  return false;
}

// The fused kernels split a block's query rows between the two AIVs of an AI Core.
inline void check_fused_rows(const FlashAttentionTiling& t, const char* op) {
  TORCH_CHECK(2 * static_cast<int64_t>(t.vecRows) >= t.baseM, op, ": the fused kernel needs the two AIVs of an AI "
              "Core to cover a block (vecRows ", t.vecRows, ", baseM ", t.baseM, ")");
}

}  // namespace host
}  // namespace amo_ascend
