// moe_permute on Ascend, written once for every launcher (host/launch.h: NpuLauncher, EmuLauncher).
//
// op-boundary checks (common/moe_permute_checks.h) -> row map (ATen ops on the tensors' device, host/row_map.h)
// -> inverse map (+ the row map itself for the token-major loop) -> tiling (tiling/moe_permute_tiling.h)
// -> one launch of amo_moe_permute
// (kernels/moe_permute.cpp) -> probs gathered to the rows (ATen). The schema is defined in
// ascend_moe_ops/_library.py.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

#include "../../common/moe_permute_checks.h"
#include "host/launch.h"
#include "host/row_map.h"
#include "tiling/moe_permute_tiling.h"

// The AscendC kernels this host code launches (entries of csrc/ascend/kernels; AMO_ASCEND_KERNEL: host/launch.h).
#include AMO_ASCEND_KERNEL_HEADER(amo_moe_permute)
AMO_ASCEND_KERNEL(amo_moe_permute, 4)

namespace amo_ascend {
namespace host {

template <class L>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_permute(
    const at::Tensor& tokens, const at::Tensor& routing, const c10::optional<at::Tensor>& probs, int64_t numExperts,
    std::optional<int64_t> capacity, int64_t align, std::optional<int64_t> numOutTokens) {
  const int64_t rows = amo::checks::moe_permute(tokens, routing, probs, numExperts, capacity, align, numOutTokens);
  L::check_device(tokens, "tokens");
  L::check_device(routing, "routing");
  auto x = tokens.contiguous();
  const ChipInfo chip = L::vector_chip(x);
  auto m = compute_row_id_map(routing.contiguous(), probs, numExperts, capacity, align, numOutTokens, rows);
  const int64_t N = m.numRows, T = x.size(0), H = x.size(1), S = routing.size(1);
  check_rows_fit_int32(N, "the permuted output");
  check_rows_fit_int32(T, "tokens");
  auto slot = slot_of_row(m.rowIdMap, N);
  auto index = token_of_row(slot, S);
  auto out = L::output({N, H}, x.options());  // every row is written by the kernel (zeros for padding)
  // token-major (each token read once, stored to its S rows) whenever the map fits the kernel's slot
  // array; the kernel then reads the row map right after `index`
  const int64_t slots = S >= 1 && S <= kPermuteMaxSlots && T > 0 ? S : 0;
  const MoePermuteTiling t = compute_moe_permute_tiling(N, T, H, dtype_of(x, "moe_permute", "tokens"), chip, L::max_tile_cols(), slots);
  if (t.tokenMajor) index = at::cat({index, m.rowIdMap.reshape({-1}).to(at::kInt)}).contiguous();
  if (t.key != MoePermuteTilingKey::kEmpty)
    L::launch("amo_moe_permute", kernels::amo_moe_permute, vector_plan(t.blockDim, chip, t.ubBytes, true), {}, x, index,
              out, L::pod(t, x));
  at::Tensor outProbs = probs.has_value() ? gather_by_slot(probs->contiguous(), slot)
                                          : at::empty({0}, x.options().dtype(at::kFloat));
  return {out, outProbs, m.rowIdMap, m.tokensPerExpert, m.groupSizes};
}

}  // namespace host
}  // namespace amo_ascend
