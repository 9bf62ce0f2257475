// Host glue of grouped_gemm and grouped_gemm_dw for Ascend NPUs (dispatch key PrivateUse1).
//
// checks -> group sizes as int64 on the device (a device op; never read on the host, so no
// synchronization) -> tiling (tiling/grouped_gemm_tiling.h: base block, K steps, blockDim over the
// AIC cores) -> launch of the AIC-only AscendC kernels amo_grouped_gemm / amo_grouped_gemm_dw
// (kernels/grouped_gemm.cpp) on the current NPU stream inside torch_npu's task queue. The kernels
// write every output element (zeros past sum(group_sizes) and for empty groups), so the outputs are
// allocated with at::empty. fp16/bf16 only: fp32 inputs are refused (not implemented on the Cube path).
// The schemas are defined in ascend_moe_ops/_library.py; this file only adds the implementations.
#include <torch/library.h>

#include "host/npu_common.h"
#include "tiling/grouped_gemm_tiling.h"

namespace amo_ascend {
namespace npu {

namespace {

DType cube_dtype(const at::Tensor& t, const char* op) {
  TORCH_CHECK(t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16, op,
              " (AscendC Cube kernel): inputs must be float16 or bfloat16 (fp32 accumulation in L0C), got ",
              t.scalar_type(), "; fp32 inputs are not implemented on the NPU path");
  return t.scalar_type() == at::kHalf ? DType::kF16 : DType::kBF16;
}

at::Tensor device_sizes(const at::Tensor& groupSizes, const at::Tensor& like, int64_t E, const char* op) {
  TORCH_CHECK(groupSizes.dim() == 1 && groupSizes.size(0) == E, op, ": group_sizes must be [", E, "], got ",
              groupSizes.sizes());
  TORCH_CHECK(groupSizes.scalar_type() == at::kInt || groupSizes.scalar_type() == at::kLong, op,
              ": group_sizes must be int32 or int64, got ", groupSizes.scalar_type());
  // values (>= 0, sum <= rows) are asserted on the device by the Python wrapper; the kernel clamps
  return groupSizes.to(like.device(), at::kLong, /*non_blocking=*/true).contiguous();
}

}  // namespace

at::Tensor grouped_gemm_npu(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& groupSizes, bool transB) {
  check_npu(x, "x");
  check_npu(weight, "weight");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 3, "grouped_gemm: x must be [M, K] and weight 3-D, got ", x.sizes(), " and ",
              weight.sizes());
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "grouped_gemm: weight dtype ", weight.scalar_type(),
              " differs from x dtype ", x.scalar_type());
  const DType dt = cube_dtype(x, "grouped_gemm");
  const int64_t M = x.size(0), K = x.size(1), E = weight.size(0), N = transB ? weight.size(1) : weight.size(2);
  TORCH_CHECK((transB ? weight.size(2) : weight.size(1)) == K, "grouped_gemm: weight has K=",
              transB ? weight.size(2) : weight.size(1), " but x has K=", K);
  TORCH_CHECK(K < 65536 && N < 65536, "grouped_gemm (AscendC): K and N must be < 65536 (16-bit copy strides)");
  auto xc = x.contiguous(), wc = weight.contiguous();
  auto gs = device_sizes(groupSizes, xc, E, "grouped_gemm");
  const ChipInfo chip = chip_info(xc);
  const GroupedGemmTiling t = compute_grouped_gemm_tiling(transB ? GroupedGemmLayout::kNT : GroupedGemmLayout::kNN, M, K,
                                                          N, E, dt, chip);
  if (t.key == GroupedGemmTilingKey::kEmpty) return at::zeros({M, N}, xc.options());
  auto out = at::empty({M, N}, xc.options());
  auto tiling = upload_tiling(t, xc);
  const uint32_t blockDim = t.blockDim;
  run_on_stream("amo_grouped_gemm", [=](aclrtStream stream) {
    return aclrtlaunch_amo_grouped_gemm(blockDim, stream, ptr(xc), ptr(wc), ptr(gs), ptr(out), ptr(tiling));
  }, {xc, wc, gs, out, tiling});
  return out;
}

at::Tensor grouped_gemm_dw_npu(const at::Tensor& a, const at::Tensor& b, const at::Tensor& groupSizes) {
  check_npu(a, "a");
  check_npu(b, "b");
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(0) == b.size(0), "grouped_gemm_dw: a [M, P] and b [M, Q] expected, got ",
              a.sizes(), " and ", b.sizes());
  TORCH_CHECK(b.scalar_type() == a.scalar_type(), "grouped_gemm_dw: b dtype differs from a dtype");
  const DType dt = cube_dtype(a, "grouped_gemm_dw");
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1), E = groupSizes.numel();
  TORCH_CHECK(K < 65536 && N < 65536, "grouped_gemm_dw (AscendC): P and Q must be < 65536 (16-bit copy strides)");
  auto ac = a.contiguous(), bc = b.contiguous();
  auto gs = device_sizes(groupSizes, ac, E, "grouped_gemm_dw");
  const ChipInfo chip = chip_info(ac);
  const GroupedGemmTiling t = compute_grouped_gemm_tiling(GroupedGemmLayout::kDW, M, K, N, E, dt, chip);
  if (t.key == GroupedGemmTilingKey::kEmpty) return at::zeros({E, K, N}, ac.options());
  auto out = at::empty({E, K, N}, ac.options());  // empty groups get zeros from the kernel
  auto tiling = upload_tiling(t, ac);
  const uint32_t blockDim = t.blockDim;
  run_on_stream("amo_grouped_gemm_dw", [=](aclrtStream stream) {
    return aclrtlaunch_amo_grouped_gemm_dw(blockDim, stream, ptr(ac), ptr(bc), ptr(gs), ptr(out), ptr(tiling));
  }, {ac, bc, gs, out, tiling});
  return out;
}

}  // namespace npu
}  // namespace amo_ascend

TORCH_LIBRARY_IMPL(ascend_moe_ops, PrivateUse1, m) {
  m.impl("grouped_gemm", &amo_ascend::npu::grouped_gemm_npu);
  m.impl("grouped_gemm_dw", &amo_ascend::npu::grouped_gemm_dw_npu);
}
