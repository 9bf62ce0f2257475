// Host-side index math shared by the AscendC glue (csrc/ascend/*.cpp, tensors on the NPU) and the
// emulated backend (csrc/ascend/emu_bindings.cpp, CPU tensors). ATen ops only, so on an NPU every
// step runs on the device through torch_npu's kernels, with no host synchronization: all shapes are
// static (the output row count N comes from argument shapes: the op's check returns it).
//
// This is the C++ twin of reference/moe_permute.py::compute_row_id_map (same algorithm, step by
// step); the parity tests compare its results with the reference bit for bit.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>

#include "tiling/tiling_common.h"

namespace amo_ascend {
namespace host {

inline at::Tensor exclusive_cumsum(const at::Tensor& x) { return x.cumsum(0) - x; }

// rank of each position inside its bucket, for positions visited in `order` (a stable sort on key)
inline at::Tensor rank_within_bucket(const at::Tensor& key, int64_t buckets, const at::Tensor& order) {
  auto opts = key.options().dtype(at::kLong);
  auto counts = at::zeros({buckets}, opts).scatter_add_(0, key, at::ones_like(key));
  auto starts = exclusive_cumsum(counts);
  auto sortedRank = at::arange(key.numel(), opts) - starts.index_select(0, key.index_select(0, order));
  return at::empty_like(sortedRank).index_copy_(0, order, sortedRank);
}

struct RowMap {
  at::Tensor rowIdMap;         // [T, S] int32, -1 = not kept
  at::Tensor tokensPerExpert;  // [E] int64
  at::Tensor groupSizes;       // [E] int64
  int64_t numRows;             // N
};

// capacity / numOutTokens as the op takes them (nullopt = not given), already checked by the op's
// check, which returned the output row count N (the one C++ row count, from shapes alone).
inline RowMap compute_row_id_map(const at::Tensor& routing, const c10::optional<at::Tensor>& probs, int64_t E,
                                 std::optional<int64_t> capacity, int64_t align, std::optional<int64_t> numOutTokens,
                                 int64_t N) {
  const int64_t T = routing.size(0), S = routing.size(1);
  auto lopts = routing.options().dtype(at::kLong);
  at::Tensor ids;
  if (routing.scalar_type() == at::kBool) {
    auto ar = at::arange(S, lopts);
    ids = at::where(routing, ar, at::full_like(ar, -1));
  } else {
    auto r = routing.to(at::kLong);
    ids = at::where((r >= 0) & (r < E), r, at::full_like(r, -1));
  }
  ids = ids.reshape({-1});
  auto valid = ids >= 0;
  auto bucket = at::where(valid, ids, at::full_like(ids, E));
  if (capacity.has_value()) {
    at::Tensor order;
    if (probs.has_value()) {
      auto byProb = at::argsort(-probs->reshape({-1}).to(at::kFloat), /*stable=*/true, 0);
      order = byProb.index_select(0, at::argsort(bucket.index_select(0, byProb), /*stable=*/true, 0));
    } else {
      order = at::argsort(bucket, /*stable=*/true, 0);
    }
    auto keepRank = rank_within_bucket(bucket, E + 1, order);
    valid = valid & (keepRank < *capacity);
    bucket = at::where(valid, ids, at::full_like(ids, E));
  }
  auto counts = at::zeros({E + 1}, lopts).scatter_add_(0, bucket, at::ones_like(bucket));
  auto routed = counts.narrow(0, 0, E);
  // num_out_tokens: the first numOutTokens routed slots in (expert, position) order are kept
  auto tpe = numOutTokens.has_value()
                 ? at::minimum(routed, (*numOutTokens - exclusive_cumsum(routed)).clamp_min(0))
                 : routed.clone();
  at::Tensor groupSizes =
      capacity.has_value() ? at::full_like(tpe, *capacity) : at::floor_divide(tpe + (align - 1), align) * align;
  auto groupStart = exclusive_cumsum(groupSizes);
  auto order = at::argsort(bucket, /*stable=*/true, 0);
  auto rank = rank_within_bucket(bucket, E + 1, order);
  auto expert = bucket.clamp_max(E - 1);  // E >= 1 (op contract); empty slots are masked by `valid`
  auto dest = groupStart.index_select(0, expert) + rank;
  auto keep = valid & (rank < tpe.index_select(0, expert));
  auto map = at::where(keep, dest, at::full_like(dest, -1)).to(at::kInt).reshape({T, S});
  return RowMap{map, tpe, groupSizes, N};
}

// Inverse of a row map: for each of the N rows the flat slot t*S+s that maps to it, or -1. Rows are
// referenced at most once (the op contract); slots not kept write to a scratch row that is dropped.
inline at::Tensor slot_of_row(const at::Tensor& rowIdMap, int64_t N) {
  auto flat = rowIdMap.reshape({-1}).to(at::kLong);
  auto kept = (flat >= 0) & (flat < N);
  auto dest = at::where(kept, flat, at::full_like(flat, N));
  auto inv = at::full({N + 1}, -1, rowIdMap.options().dtype(at::kInt));
  inv.index_copy_(0, dest, at::arange(flat.numel(), rowIdMap.options().dtype(at::kInt)));
  return inv.narrow(0, 0, N).contiguous();
}

// Source token of each output row (slot / S), -1 where no slot maps to it.
inline at::Tensor token_of_row(const at::Tensor& slotOfRow, int64_t S) {
  if (S == 0) return at::full_like(slotOfRow, -1);
  return at::where(slotOfRow >= 0, at::floor_divide(slotOfRow, S), at::full_like(slotOfRow, -1)).contiguous();
}

// values[t*S+s] at the rows' slots (zero where no slot maps to the row); keeps values' dtype.
inline at::Tensor gather_by_slot(const at::Tensor& values, const at::Tensor& slotOfRow) {
  auto flat = values.reshape({-1});
  if (flat.numel() == 0) return at::zeros({slotOfRow.size(0)}, values.options());
  auto g = flat.index_select(0, slotOfRow.clamp_min(0).to(at::kLong));
  return at::where(slotOfRow >= 0, g, at::zeros_like(g));
}

// per-slot values of a per-row tensor: out[t,s] = rows[map[t,s]] (zero where the slot is not kept)
inline at::Tensor gather_by_row(const at::Tensor& rows, const at::Tensor& rowIdMap) {
  const int64_t N = rows.size(0);
  auto m = rowIdMap.to(at::kLong);
  auto kept = (m >= 0) & (m < N);
  if (N == 0) return at::zeros(rowIdMap.sizes(), rows.options());
  auto g = rows.index_select(0, at::where(kept, m, at::zeros_like(m)).reshape({-1})).reshape(rowIdMap.sizes());
  return at::where(kept, g, at::zeros_like(g));
}

// The vector kernels' element type: a TypeError naming the argument for any other dtype (float64
// passes the op contract but has no AscendC kernel).
inline DType dtype_of(const at::Tensor& t, const char* op, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kF32;
    case at::kHalf: return DType::kF16;
    case at::kBFloat16: return DType::kBF16;
    default:
      TORCH_CHECK_TYPE(false, op, ": ", name, " must have dtype in (float32, float16, bfloat16) on the AscendC path, got ",
                       amo::checks::dtype_name(t.scalar_type()), "; float64 runs on the native and reference backends");
  }
}

inline void check_rows_fit_int32(int64_t rows, const char* what) {
  TORCH_CHECK(rows < std::numeric_limits<int32_t>::max(), "ascend_moe_ops (AscendC): ", what, " has ", rows,
              " rows; the kernels index rows with int32 (at most 2^31 - 2)");
}

}  // namespace host
}  // namespace amo_ascend
