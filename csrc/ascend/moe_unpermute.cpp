// Host glue of moe_unpermute and moe_unpermute_backward for Ascend NPUs (PrivateUse1).
//
// Forward: map -> int32, probs -> fp32 (tiny [T, S] tensors, converted on the device), tiling,
// launch of amo_moe_unpermute. Backward: inverse map (slot of each row, ATen on the device), tiling,
// launch of amo_moe_unpermute_grad, then grad_probs[t,s] = dot[map[t,s]] gathered on the device.
// Schemas are defined in ascend_moe_ops/_library.py.
#include <torch/library.h>

#include "host/npu_common.h"
#include "host/row_map.h"
#include "tiling/moe_unpermute_tiling.h"

namespace amo_ascend {
namespace npu {

at::Tensor moe_unpermute_npu(const at::Tensor& permuted, const at::Tensor& rowIdMap, const c10::optional<at::Tensor>& probs) {
  check_npu(permuted, "permuted");
  check_npu(rowIdMap, "row_id_map");
  TORCH_CHECK(permuted.dim() == 2 && rowIdMap.dim() == 2, "moe_unpermute: permuted [N, H] and row_id_map [T, K] expected, got ",
              permuted.sizes(), " and ", rowIdMap.sizes());
  if (probs.has_value())
    TORCH_CHECK(probs->sizes() == rowIdMap.sizes(), "moe_unpermute: probs must have the shape of row_id_map ", rowIdMap.sizes(),
                ", got ", probs->sizes());
  auto x = permuted.contiguous();
  const ChipInfo chip = chip_info(x);
  const int64_t N = x.size(0), H = x.size(1), T = rowIdMap.size(0), S = rowIdMap.size(1);
  host::check_rows_fit_int32(N, "permuted");
  auto map = rowIdMap.to(at::kInt).contiguous();
  at::Tensor w = probs.has_value() ? probs->to(at::kFloat).contiguous() : at::empty({0}, x.options().dtype(at::kFloat));
  auto out = at::empty({T, H}, x.options());
  const MoeUnpermuteTiling t = compute_moe_unpermute_tiling(T, S, N, H, host::dtype_of(x), probs.has_value(), chip);
  if (t.key != MoeUnpermuteTilingKey::kEmpty) {
    auto tiling = upload_tiling(t, x);
    const uint32_t blockDim = t.rows.blockDim;
    run_on_stream("amo_moe_unpermute", [=](aclrtStream stream) {
      return aclrtlaunch_amo_moe_unpermute(blockDim, stream, ptr(x), ptr(map), ptr(w), ptr(out), ptr(tiling));
    }, {x, map, w, out, tiling});
  }
  return out;
}

std::tuple<at::Tensor, at::Tensor> moe_unpermute_backward_npu(const at::Tensor& gradOut, const at::Tensor& permuted,
                                                              const at::Tensor& rowIdMap,
                                                              const c10::optional<at::Tensor>& probs) {
  check_npu(gradOut, "grad_out");
  check_npu(rowIdMap, "row_id_map");
  const int64_t N = permuted.size(0), H = gradOut.size(1), T = rowIdMap.size(0), S = rowIdMap.size(1);
  host::check_rows_fit_int32(N, "permuted");
  const bool withProbs = probs.has_value();
  if (withProbs) TORCH_CHECK(permuted.size(1) == H, "moe_unpermute_backward: permuted must be [N, H] when probs is given");
  auto g = gradOut.scalar_type() == permuted.scalar_type() ? gradOut.contiguous() : gradOut.to(at::kFloat).contiguous();
  auto x = permuted.contiguous();
  const ChipInfo chip = chip_info(g);
  auto map = rowIdMap.to(at::kInt).contiguous();
  auto slot = host::slot_of_row(map, N);
  at::Tensor w = withProbs ? probs->to(at::kFloat).contiguous() : at::empty({0}, g.options().dtype(at::kFloat));
  auto gradPermuted = at::empty({N, H}, g.options().dtype(permuted.scalar_type()));
  const MoeUnpermuteGradTiling t =
      compute_moe_unpermute_grad_tiling(T, S, N, H, host::dtype_of(x), host::dtype_of(g), withProbs, chip);
  at::Tensor dots;
  if (t.key != MoeUnpermuteTilingKey::kEmpty) {
    dots = at::empty({withProbs ? N : 0}, g.options().dtype(at::kFloat));
    auto tiling = upload_tiling(t, g);
    const uint32_t blockDim = t.rows.blockDim;
    run_on_stream("amo_moe_unpermute_grad", [=](aclrtStream stream) {
      return aclrtlaunch_amo_moe_unpermute_grad(blockDim, stream, ptr(g), ptr(x), ptr(slot), ptr(w), ptr(gradPermuted),
                                                ptr(dots), ptr(tiling));
    }, {g, x, slot, w, gradPermuted, dots, tiling});
  } else {
    dots = at::zeros({N}, g.options().dtype(at::kFloat));
  }
  at::Tensor gradProbs = withProbs ? host::gather_by_row(dots, map).to(probs->scalar_type())
                                   : at::empty({0}, g.options().dtype(at::kFloat));
  return {gradPermuted, gradProbs};
}

}  // namespace npu
}  // namespace amo_ascend

TORCH_LIBRARY_IMPL(ascend_moe_ops, PrivateUse1, m) {
  m.impl("moe_unpermute", &amo_ascend::npu::moe_unpermute_npu);
  m.impl("moe_unpermute_backward", &amo_ascend::npu::moe_unpermute_backward_npu);
}
