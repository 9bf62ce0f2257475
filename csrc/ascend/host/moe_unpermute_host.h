// moe_unpermute and moe_unpermute_backward on Ascend, written once for every launcher (host/launch.h).
//
// Forward: checks -> map as int32, probs as fp32 (tiny [T, S] tensors, converted on the device) ->
// tiling -> one launch of amo_moe_unpermute. Backward: checks -> inverse map (slot of each row, ATen
// on the device) -> tiling -> one launch of amo_moe_unpermute_grad -> grad_probs[t, s] =
// dot[map[t, s]] gathered on the device. Schemas are defined in ascend_moe_ops/_library.py.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

#include "../../common/moe_unpermute_checks.h"
#include "host/launch.h"
#include "host/row_map.h"
#include "tiling/moe_unpermute_tiling.h"

// The AscendC kernels this host code launches (entries of csrc/ascend/kernels; AMO_ASCEND_KERNEL: host/launch.h).
#include AMO_ASCEND_KERNEL_HEADER(amo_moe_unpermute)
AMO_ASCEND_KERNEL(amo_moe_unpermute, 5)
#include AMO_ASCEND_KERNEL_HEADER(amo_moe_unpermute_grad)
AMO_ASCEND_KERNEL(amo_moe_unpermute_grad, 7)

namespace amo_ascend {
namespace host {

template <class L>
at::Tensor moe_unpermute(const at::Tensor& permuted, const at::Tensor& rowIdMap, const c10::optional<at::Tensor>& probs) {
  amo::checks::moe_unpermute(permuted, rowIdMap, probs);
  L::check_device(permuted, "permuted");
  L::check_device(rowIdMap, "row_id_map");
  auto x = permuted.contiguous();
  const ChipInfo chip = L::vector_chip(x);
  const int64_t N = x.size(0), H = x.size(1), T = rowIdMap.size(0), S = rowIdMap.size(1);
  check_rows_fit_int32(N, "permuted");
  auto map = rowIdMap.to(at::kInt).contiguous();
  at::Tensor w = probs.has_value() ? probs->to(at::kFloat).contiguous() : at::empty({0}, x.options().dtype(at::kFloat));
  auto out = L::output({T, H}, x.options());
  const MoeUnpermuteTiling t =
      compute_moe_unpermute_tiling(T, S, N, H, dtype_of(x, "moe_unpermute", "permuted"), probs.has_value(), chip, L::max_tile_cols());
  if (t.key != MoeUnpermuteTilingKey::kEmpty)
    L::launch("amo_moe_unpermute", kernels::amo_moe_unpermute, vector_plan(t.rows.blockDim, chip, t.ubBytes, true), {}, x, map,
              w, out, L::pod(t, x));
  return out;
}

template <class L>
std::tuple<at::Tensor, at::Tensor> moe_unpermute_backward(const at::Tensor& gradOut, const at::Tensor& permuted,
                                                          const at::Tensor& rowIdMap,
                                                          const c10::optional<at::Tensor>& probs) {
  amo::checks::moe_unpermute_backward(gradOut, permuted, rowIdMap, probs);
  L::check_device(gradOut, "grad_out");
  L::check_device(permuted, "permuted");
  L::check_device(rowIdMap, "row_id_map");
  const int64_t N = permuted.size(0), H = gradOut.size(1), T = rowIdMap.size(0), S = rowIdMap.size(1);
  check_rows_fit_int32(N, "permuted");
  const bool withProbs = probs.has_value();
  // grad_out in the permuted dtype or fp32 (an exact upcast covers every other mix)
  auto g = gradOut.scalar_type() == permuted.scalar_type() ? gradOut.contiguous() : gradOut.to(at::kFloat).contiguous();
  auto x = permuted.contiguous();
  const ChipInfo chip = L::vector_chip(g);
  auto map = rowIdMap.to(at::kInt).contiguous();
  auto slot = slot_of_row(map, N);
  at::Tensor w = withProbs ? probs->to(at::kFloat).contiguous() : at::empty({0}, g.options().dtype(at::kFloat));
  auto gradPermuted = L::output({N, H}, g.options().dtype(permuted.scalar_type()));
  const MoeUnpermuteGradTiling t = compute_moe_unpermute_grad_tiling(T, S, N, H, dtype_of(x, "moe_unpermute_backward", "permuted"),
                                                                     dtype_of(g, "moe_unpermute_backward", "grad_out"), withProbs,
                                                                     chip, L::max_tile_cols());
  at::Tensor dots;
  if (t.key != MoeUnpermuteTilingKey::kEmpty) {
    dots = withProbs ? L::output({N}, g.options().dtype(at::kFloat)) : at::empty({0}, g.options().dtype(at::kFloat));
    L::launch("amo_moe_unpermute_grad", kernels::amo_moe_unpermute_grad, vector_plan(t.rows.blockDim, chip, t.ubBytes, true),
              {}, g, x, slot, w, gradPermuted, dots, L::pod(t, g));
  } else {
    dots = at::zeros({N}, g.options().dtype(at::kFloat));  // H == 0: empty dot products
  }
  at::Tensor gradProbs = withProbs ? gather_by_row(dots, map).to(probs->scalar_type())
                                   : at::empty({0}, g.options().dtype(at::kFloat));
  return {gradPermuted, gradProbs};
}

}  // namespace host
}  // namespace amo_ascend
