// The op contract of moe_permute: amo::checks::moe_permute, checked first by every C++ kernel of the op
// (csrc/cpu/moe_permute.cpp, the AscendC host code csrc/ascend/host/moe_permute_host.h) and bound alone
// as _C._check_moe_permute (AMO_OP_CONTRACT in csrc/cpu/moe_permute.cpp). Its Python twin, with the same
// rules and messages, is the spec's check (ascend_moe_ops/ops/_contracts.py); the shared rules and
// helpers are in common/checks.h.
#pragma once

#include <cstdint>
#include <limits>
#include <optional>

#include "checks.h"

namespace amo {
namespace checks {

// row_id_map is int32: every row index must fit.
constexpr int64_t kMaxRows = std::numeric_limits<int32_t>::max();
// num_experts bound for id routing (the count outputs are [E] int64; 2^20 covers the
// million-expert designs); a mask routing carries its own E in its shape.
constexpr int64_t kMaxExperts = int64_t(1) << 20;

// The output row count N of moe_permute, from shapes alone: the one C++ definition, used by the check
// below, the native kernel and the AscendC glue (the Python one: ops/_contracts.py::output_rows). T*S
// slots, E experts, capacity / num_out_tokens as the op takes them (nullopt = not given); the
// arguments must have passed moe_permute's checks (which bound every product below).
inline int64_t moe_permute_rows(int64_t T, int64_t S, int64_t E, std::optional<int64_t> capacity, int64_t align,
                                std::optional<int64_t> num_out_tokens) {
  if (capacity.has_value()) return E * *capacity;
  return num_out_tokens.value_or(T * S) + E * (align - 1);
}

// Returns the output row count N (moe_permute_rows). num_out_tokens below the routed slot count is
// valid (the first rows in expert order are kept), so nothing here reads the routing data for it.
inline int64_t moe_permute(const Tensor& tokens, const Tensor& routing, const OptTensor& probs, int64_t num_experts,
                           std::optional<int64_t> capacity, int64_t align, std::optional<int64_t> num_out_tokens) {
  constexpr const char* op = "moe_permute";
  float_tensor(op, "tokens", tokens, 2, "[T, H]");
  ndim(op, "routing", routing, 2, "[T, K] (expert ids) or [T, E] (bool mask)");
  dtype_in(op, "routing", routing, {at::kBool, at::kInt, at::kLong});
  same_device(op, "routing", routing, tokens);
  TORCH_CHECK_VALUE(routing.size(0) == tokens.size(0), op, ": routing must have one row per token: tokens has ",
                    tokens.size(0), " rows, routing has shape ", shape_str(routing.sizes()));
  const bool mask = routing.scalar_type() == at::kBool;
  TORCH_CHECK_VALUE(num_experts >= 1, op, ": num_experts must be >= 1, got ", num_experts);
  if (mask) {
    TORCH_CHECK_VALUE(num_experts == routing.size(1), op, ": num_experts=", num_experts,
                      " does not match the routing mask's ", routing.size(1), " columns");
  } else {
    TORCH_CHECK_VALUE(num_experts <= kMaxExperts, op, ": num_experts=", num_experts,
                      " exceeds the supported maximum of 2^20 experts");
  }
  if (probs.has_value()) {
    dtype_in(op, "probs", *probs, kFloatTypes);
    same_device(op, "probs", *probs, tokens);
    shape_is(op, "probs", *probs, routing.sizes(), "the shape of routing");
  }
  TORCH_CHECK_VALUE(align >= 1, op, ": align must be >= 1, got ", align);
  const int64_t T = routing.size(0), S = routing.size(1), slots = T * S;
  TORCH_CHECK_VALUE(slots <= kMaxRows, op, ": routing has T*K = ", slots,
                    " slots; row_id_map is int32, so at most 2^31-1 are supported");
  if (capacity.has_value()) {
    const int64_t C = *capacity;
    TORCH_CHECK_VALUE(C >= 1, op, ": capacity must be >= 1, got ", C);
    TORCH_CHECK_VALUE(C % align == 0, op, ": align=", align, " must divide capacity=", C);
    TORCH_CHECK_VALUE(!num_out_tokens.has_value(), op,
                      ": num_out_tokens cannot be combined with capacity (the output has exactly num_experts * "
                      "capacity rows)");
    int64_t rows = 0;
    const bool overflow = c10::mul_overflows(num_experts, C, &rows);
    TORCH_CHECK_VALUE(!overflow && rows <= kMaxRows, op, ": capacity=", C, " is too large: num_experts * capacity = ",
                      num_experts, " * ", C, " rows exceeds 2^31-1 (row_id_map is int32)");
  } else {
    int64_t base = slots;
    if (num_out_tokens.has_value()) {
      base = *num_out_tokens;
      TORCH_CHECK_VALUE(base >= 0, op, ": num_out_tokens must be >= 0, got ", base);
      TORCH_CHECK_VALUE(base <= kMaxRows, op, ": num_out_tokens=", base,
                        " exceeds 2^31-1 rows (row_id_map is int32)");
    }
    int64_t pad = 0;
    const bool overflow = c10::mul_overflows(num_experts, align - 1, &pad);
    TORCH_CHECK_VALUE(!overflow && pad <= kMaxRows - base, op, ": align=", align,
                      " is too large: the output would have ", base, " + num_experts * (align - 1) rows, more than "
                      "2^31-1 (row_id_map is int32)");
  }
  if (!mask) index_range(op, "routing (expert ids)", routing, -1, num_experts);
  return moe_permute_rows(T, S, num_experts, capacity, align, num_out_tokens);
}

}  // namespace checks
}  // namespace amo
