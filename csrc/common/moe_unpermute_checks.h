// The op contracts of moe_unpermute and moe_unpermute_backward: amo::checks::<op>, checked first by
// every C++ kernel of the ops (csrc/cpu/moe_unpermute.cpp, csrc/ascend/host/moe_unpermute_host.h) and
// bound alone as _C._check_<op> (AMO_OP_CONTRACT in csrc/cpu/moe_unpermute.cpp). Their Python twins are
// the specs' checks (ascend_moe_ops/ops/_contracts.py); the shared rules and helpers: common/checks.h.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "checks.h"

namespace amo {
namespace checks {

// Every row in [0, num_rows) referenced by at most one slot of `rows` (a row map from moe_permute never
// repeats a row; a repeated one makes the backward's scatter ill-defined). Run after index_range. Host
// tensors: the first slot (in flat order) whose row an earlier slot already references is reported,
// with that earlier slot; device tensors: per-row counts and a device-side assert. O(T*K + N) time,
// N bits (host) or N ints (device) of memory: less than the [N, H] rows themselves.
inline void unique_rows(const char* op, const char* name, const Tensor& rows, int64_t num_rows) {
  if (rows.numel() < 2 || num_rows == 0) return;
  const std::string tail = "; each row may be referenced at most once (the map moe_permute returns)";
  if (!rows.device().is_cpu()) {
    const Tensor flat = rows.reshape({-1}).to(at::kLong);
    // slots not kept (and rows out of range: the range assert does not stop the host) go to a spare bin
    const Tensor bins = at::where(at::logical_and(flat >= 0, flat < num_rows), flat, num_rows);
    const Tensor counts = at::zeros({num_rows + 1}, flat.options().dtype(at::kInt))
                              .scatter_add_(0, bins, at::ones_like(bins, bins.options().dtype(at::kInt)));
    assert_async((counts.slice(0, 0, num_rows) <= 1).all(),
                 std::string(op) + ": " + name + " refers to a row from more than one slot" + tail);
    return;
  }
  const Tensor v = rows.to(at::kLong).contiguous();
  const int64_t* p = v.data_ptr<int64_t>();
  std::vector<bool> seen(static_cast<size_t>(num_rows), false);
  for (int64_t i = 0; i < v.numel(); ++i) {
    if (p[i] < 0) continue;
    if (seen[p[i]]) {
      int64_t first = 0;
      while (p[first] != p[i]) ++first;
      TORCH_CHECK_VALUE(false, op, ": ", name, " refers to row ", p[i], " from more than one slot, at ",
                        where_str(first, v.sizes()), " and ", where_str(i, v.sizes()), tail);
    }
    seen[p[i]] = true;
  }
}

inline void moe_unpermute(const Tensor& permuted, const Tensor& row_id_map, const OptTensor& probs) {
  constexpr const char* op = "moe_unpermute";
  float_tensor(op, "permuted", permuted, 2, "[N, H]");
  ndim(op, "row_id_map", row_id_map, 2, "[T, K]");
  dtype_in(op, "row_id_map", row_id_map, kIndexTypes);
  same_device(op, "row_id_map", row_id_map, permuted);
  if (probs.has_value()) {
    dtype_in(op, "probs", *probs, kFloatTypes);
    same_device(op, "probs", *probs, permuted);
    shape_is(op, "probs", *probs, row_id_map.sizes(), "the shape of row_id_map");
  }
  index_range(op, "row_id_map", row_id_map, -1, permuted.size(0));
  unique_rows(op, "row_id_map", row_id_map, permuted.size(0));
}

inline void moe_unpermute_backward(const Tensor& grad_out, const Tensor& permuted, const Tensor& row_id_map,
                                   const OptTensor& probs) {
  constexpr const char* op = "moe_unpermute_backward";
  float_tensor(op, "grad_out", grad_out, 2, "[T, H]");
  float_tensor(op, "permuted", permuted, 2, "[N, H] (or an [N, 0] stand-in without probs)");
  same_device(op, "permuted", permuted, grad_out);
  ndim(op, "row_id_map", row_id_map, 2, "[T, K]");
  dtype_in(op, "row_id_map", row_id_map, kIndexTypes);
  same_device(op, "row_id_map", row_id_map, grad_out);
  TORCH_CHECK_VALUE(grad_out.size(0) == row_id_map.size(0), op,
                    ": grad_out must have one row per row of row_id_map: grad_out has shape ",
                    shape_str(grad_out.sizes()), ", row_id_map ", shape_str(row_id_map.sizes()));
  if (probs.has_value()) {
    dtype_in(op, "probs", *probs, kFloatTypes);
    same_device(op, "probs", *probs, grad_out);
    shape_is(op, "probs", *probs, row_id_map.sizes(), "the shape of row_id_map");
    TORCH_CHECK_VALUE(permuted.size(1) == grad_out.size(1), op, ": permuted must have shape (N, ", grad_out.size(1),
                      ") with probs (the hidden size of grad_out), got ", shape_str(permuted.sizes()));
  }
  index_range(op, "row_id_map", row_id_map, -1, permuted.size(0));
  unique_rows(op, "row_id_map", row_id_map, permuted.size(0));
}

}  // namespace checks
}  // namespace amo
