// Host glue of moe_permute for Ascend NPUs (dispatch key PrivateUse1, registered by torch_npu).
//
// checks -> row map (ATen ops on the device, no host sync: host/row_map.h) -> inverse map ->
// tiling (tiling/moe_permute_tiling.h) -> launch of the AscendC kernel amo_moe_permute
// (kernels/moe_permute.cpp) on the current NPU stream inside torch_npu's task queue.
// The schema is defined in ascend_moe_ops/_library.py; this file only adds the implementation.
#include <torch/library.h>

#include "host/npu_common.h"
#include "host/row_map.h"
#include "tiling/moe_permute_tiling.h"

namespace amo_ascend {
namespace npu {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_permute_npu(
    const at::Tensor& tokens, const at::Tensor& routing, const c10::optional<at::Tensor>& probs, int64_t numExperts,
    std::optional<int64_t> capacityOpt, int64_t align, std::optional<int64_t> numOutTokensOpt) {
  const int64_t capacity = capacityOpt.value_or(-1), numOutTokens = numOutTokensOpt.value_or(-1);  // -1 = not given
  check_npu(tokens, "tokens");
  check_npu(routing, "routing");
  TORCH_CHECK(tokens.dim() == 2, "moe_permute: tokens must be 2-D [T, H], got shape ", tokens.sizes());
  TORCH_CHECK(routing.dim() == 2 && routing.size(0) == tokens.size(0), "moe_permute: routing must be [T, K] or [T, E] with T = ",
              tokens.size(0), ", got shape ", routing.sizes());
  TORCH_CHECK(numExperts >= 1 && align >= 1, "moe_permute: num_experts and align must be >= 1");
  if (probs.has_value()) {
    check_npu(*probs, "probs");
    TORCH_CHECK(probs->sizes() == routing.sizes(), "moe_permute: probs must have the shape of routing ", routing.sizes(),
                ", got ", probs->sizes());
  }
  auto x = tokens.contiguous();
  const ChipInfo chip = chip_info(x);
  auto m = host::compute_row_id_map(routing.contiguous(), probs, numExperts, capacity, align, numOutTokens);
  const int64_t N = m.numRows, T = x.size(0), H = x.size(1), S = routing.size(1);
  host::check_rows_fit_int32(N, "the permuted output");
  host::check_rows_fit_int32(T, "tokens");
  auto slot = host::slot_of_row(m.rowIdMap, N);
  auto index = host::token_of_row(slot, S);
  auto out = at::empty({N, H}, x.options());  // every row is written by the kernel (zeros for padding)
  const MoePermuteTiling t = compute_moe_permute_tiling(N, T, H, host::dtype_of(x), chip);
  if (t.key != MoePermuteTilingKey::kEmpty) {
    auto tiling = upload_tiling(t, x);
    const uint32_t blockDim = t.rows.blockDim;
    run_on_stream("amo_moe_permute", [=](aclrtStream stream) {
      return aclrtlaunch_amo_moe_permute(blockDim, stream, ptr(x), ptr(index), ptr(out), ptr(tiling));
    }, {x, index, out, tiling});
  }
  at::Tensor outProbs = probs.has_value() ? host::gather_by_slot(probs->contiguous(), slot)
                                          : at::empty({0}, x.options().dtype(at::kFloat));
  return {out, outProbs, m.rowIdMap, m.tokensPerExpert, m.groupSizes};
}

}  // namespace npu
}  // namespace amo_ascend

TORCH_LIBRARY_IMPL(ascend_moe_ops, PrivateUse1, m) {
  m.impl("moe_permute", &amo_ascend::npu::moe_permute_npu);
}
