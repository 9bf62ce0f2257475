// The op contracts of grouped_gemm and grouped_gemm_dw: amo::checks::<op>, checked first by every C++
// kernel of the ops (csrc/cpu/grouped_gemm.cpp, csrc/ascend/host/grouped_gemm_host.h) and bound alone
// as _C._check_<op> (AMO_OP_CONTRACT in csrc/cpu/grouped_gemm.cpp). Their Python twins are the specs'
// checks (ascend_moe_ops/ops/_contracts.py); the shared rules and helpers: common/checks.h.
#pragma once

#include <cstdint>
#include <optional>
#include <sstream>
#include <string>

#include "checks.h"

namespace amo {
namespace checks {

// The one group-size check: 1-D int32/int64, one entry per group, on the input's device or the cpu,
// every entry in [0, rows] and sum <= rows (each entry is bounded first, so the int64 sum cannot
// overflow). `groups`: the required entry count (nullopt: any, grouped_gemm_dw). `values` = false for
// the metadata part only.
inline void group_sizes(const char* op, const Tensor& gs, std::optional<int64_t> groups, const Tensor& x, int64_t rows,
                        bool values) {
  ndim(op, "group_sizes", gs, 1, "[E]");
  dtype_in(op, "group_sizes", gs, kIndexTypes);
  TORCH_CHECK_VALUE(gs.device() == x.device() || gs.device().is_cpu(), op, ": group_sizes is on ", gs.device(),
                    " but the other inputs are on ", x.device(), " (group_sizes may live on their device or the cpu)");
  if (groups)
    TORCH_CHECK_VALUE(gs.size(0) == *groups, op, ": group_sizes must have one entry per expert: weight has ", *groups,
                      " experts, group_sizes has shape ", shape_str(gs.sizes()));
  if (!values || gs.numel() == 0) return;
  if (!gs.device().is_cpu()) {
    const Tensor g = gs.to(at::kLong);
    std::ostringstream m;
    m << op << ": group_sizes must be in [0, " << rows << "]";
    assert_async(at::logical_and(g >= 0, g <= rows).all(), m.str());
    assert_async(g.sum() <= rows, std::string(op) + ": sum(group_sizes) exceeds the number of input rows");
    return;
  }
  const Tensor v = gs.to(at::kLong).contiguous();
  const int64_t* p = v.data_ptr<int64_t>();
  // the first negative entry, then the first one above rows (the Python twin's order)
  for (int64_t e = 0; e < v.numel(); ++e)
    TORCH_CHECK_VALUE(p[e] >= 0, op, ": group_sizes must be non-negative, got ", p[e], " for group ", e);
  int64_t total = 0;
  for (int64_t e = 0; e < v.numel(); ++e) {
    TORCH_CHECK_VALUE(p[e] <= rows, op, ": sum(group_sizes) exceeds the ", rows, " rows of the input (group ", e,
                      " alone has ", p[e], ")");
    total += p[e];
  }
  TORCH_CHECK_VALUE(total <= rows, op, ": sum(group_sizes) = ", total, " exceeds the ", rows, " rows of the input");
}

inline void grouped_gemm(const Tensor& x, const Tensor& weight, const Tensor& gs, bool trans_b) {
  constexpr const char* op = "grouped_gemm";
  float_tensor(op, "x", x, 2, "[M, K]");
  like_tensor(op, "weight", weight, x, 3, trans_b ? "[E, N, K]" : "[E, K, N]");
  const int64_t k_w = trans_b ? weight.size(2) : weight.size(1);
  TORCH_CHECK_VALUE(k_w == x.size(1), op, ": weight ", trans_b ? "[E, N, K]" : "[E, K, N]", " (trans_b=",
                    trans_b ? "True" : "False", ") has K=", k_w, " but x has K=", x.size(1), " (x ", shape_str(x.sizes()),
                    ", weight ", shape_str(weight.sizes()), ")");
  group_sizes(op, gs, weight.size(0), x, x.size(0), true);
}

inline void grouped_gemm_dw(const Tensor& a, const Tensor& b, const Tensor& gs) {
  constexpr const char* op = "grouped_gemm_dw";
  float_tensor(op, "a", a, 2, "[M, P]");
  like_tensor(op, "b", b, a, 2, "[M, Q]");
  TORCH_CHECK_VALUE(b.size(0) == a.size(0), op, ": a and b must have the same rows: a ", shape_str(a.sizes()), ", b ",
                    shape_str(b.sizes()));
  group_sizes(op, gs, std::nullopt, a, a.size(0), true);
}

}  // namespace checks
}  // namespace amo
