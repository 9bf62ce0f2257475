// grouped_gemm and grouped_gemm_dw on Ascend, written once for every launcher (host/launch.h).
//
// op-boundary checks (common/grouped_gemm_checks.h, group sizes included) -> the Cube path's limits (fp16/bf16,
// 16-bit copy strides) -> group sizes as int64 on the inputs' device (never read by the host code
// below) -> tiling (tiling/grouped_gemm_tiling.h: base block, K steps, blockDim over the AIC cores) ->
// one launch of the AIC-only kernel amo_grouped_gemm / amo_grouped_gemm_dw (kernels/grouped_gemm.cpp).
// The kernels write every output element (zeros past sum(group_sizes) and for empty groups). fp32
// inputs are refused (not implemented on the Cube path). Schemas are in ascend_moe_ops/_library.py.
#pragma once

#include <ATen/ATen.h>

#include "../../common/grouped_gemm_checks.h"
#include "host/launch.h"
#include "tiling/grouped_gemm_tiling.h"

// The AscendC kernels this host code launches (entries of csrc/ascend/kernels; AMO_ASCEND_KERNEL: host/launch.h).
#include AMO_ASCEND_KERNEL_HEADER(amo_grouped_gemm)
AMO_ASCEND_KERNEL(amo_grouped_gemm, 5)
#include AMO_ASCEND_KERNEL_HEADER(amo_grouped_gemm_dw)
AMO_ASCEND_KERNEL(amo_grouped_gemm_dw, 5)

namespace amo_ascend {
namespace host {

// `what`: the op and the arguments the two sizes come from, e.g. "grouped_gemm: x and weight have K and N".
inline void check_copy_strides(int64_t K, int64_t N, const char* what) {
  TORCH_CHECK_VALUE(K < 65536 && N < 65536, what, " = ", K, " and ", N,
                    "; the AscendC kernels need both < 65536 (16-bit copy strides)");
}

template <class L>
at::Tensor gemm_launch(GroupedGemmLayout layout, const char* name, decltype(kernels::amo_grouped_gemm) kernel,
                       const at::Tensor& a, const at::Tensor& b, const at::Tensor& groupSizes, int64_t M, int64_t K,
                       int64_t N, int64_t E, at::IntArrayRef outShape, DType dt) {
  auto ac = a.contiguous(), bc = b.contiguous();
  auto gs = groupSizes.to(ac.device(), at::kLong, /*non_blocking=*/true).contiguous();
  const ChipInfo chip = L::cube_chip(ac);
  const GroupedGemmTiling t = compute_grouped_gemm_tiling(layout, M, K, N, E, dt, chip, L::cube_max_base());
  if (t.key == GroupedGemmTilingKey::kEmpty) return at::zeros(outShape, ac.options());
  auto out = L::output(outShape, ac.options());
  L::launch(name, kernel, cube_plan(t.blockDim, chip, t.l1Bytes, t.l0aBytes, t.l0bBytes, t.l0cBytes, true), {}, ac, bc,
            gs, out, L::pod(t, ac));
  return out;
}

template <class L>
at::Tensor grouped_gemm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& groupSizes, bool transB) {
  amo::checks::grouped_gemm(x, weight, groupSizes, transB);
  L::check_device(x, "x");
  L::check_device(weight, "weight");
  const DType dt = cube_dtype(x, "grouped_gemm", "x");
  const int64_t M = x.size(0), K = x.size(1), E = weight.size(0), N = transB ? weight.size(1) : weight.size(2);
  check_copy_strides(K, N, "grouped_gemm: x and weight have K and N");
  return gemm_launch<L>(transB ? GroupedGemmLayout::kNT : GroupedGemmLayout::kNN, "amo_grouped_gemm",
                        kernels::amo_grouped_gemm, x, weight, groupSizes, M, K, N, E, {M, N}, dt);
}

template <class L>
at::Tensor grouped_gemm_dw(const at::Tensor& a, const at::Tensor& b, const at::Tensor& groupSizes) {
  amo::checks::grouped_gemm_dw(a, b, groupSizes);
  L::check_device(a, "a");
  L::check_device(b, "b");
  const DType dt = cube_dtype(a, "grouped_gemm_dw", "a");
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1), E = groupSizes.numel();
  check_copy_strides(K, N, "grouped_gemm_dw: a and b have P and Q");
  return gemm_launch<L>(GroupedGemmLayout::kDW, "amo_grouped_gemm_dw", kernels::amo_grouped_gemm_dw, a, b, groupSizes, M, K,
                        N, E, {E, K, N}, dt);
}

}  // namespace host
}  // namespace amo_ascend
