// C++ autograd of grouped_gemm and grouped_gemm_dw (cpu/autograd.h; registered from the op list, common/op_list.h).
#include "cpu/autograd.h"

namespace {

using namespace amo::autograd;

AMO_OP_HANDLE(grouped_gemm, Tensor(const Tensor&, const Tensor&, const Tensor&, bool))
AMO_OP_HANDLE(grouped_gemm_dw, Tensor(const Tensor&, const Tensor&, const Tensor&))

// ------------------------------------------------------------------ grouped_gemm
// dx = grouped_gemm(dy, weight, group_sizes, !trans_b); dweight = grouped_gemm_dw(x, dy) (trans_b:
// grouped_gemm_dw(dy, x)). Both are differentiable ops, so double backward works.
struct GroupedGemm : public torch::autograd::Function<GroupedGemm> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight, const Tensor& group_sizes,
                        bool trans_b) {
    at::AutoDispatchBelowADInplaceOrView guard;
    Tensor out = grouped_gemm_op().call(x, weight, group_sizes, trans_b);
    ctx->saved_data["trans_b"] = trans_b;
    ctx->save_for_backward({x, weight, group_sizes});
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    const Tensor &x = s[0], &weight = s[1], &group_sizes = s[2];
    const bool trans_b = ctx->saved_data["trans_b"].toBool();
    const Tensor dy = grads[0].contiguous();
    Tensor dx, dw;
    if (ctx->needs_input_grad(0)) dx = grouped_gemm_op().call(dy, weight, group_sizes, !trans_b);
    if (ctx->needs_input_grad(1)) {
      dw = trans_b ? grouped_gemm_dw_op().call(dy, x, group_sizes) : grouped_gemm_dw_op().call(x, dy, group_sizes);
    }
    return {dx, dw, Tensor(), Tensor()};
  }
};

Tensor grouped_gemm_autograd(const Tensor& x, const Tensor& weight, const Tensor& group_sizes, bool trans_b) {
  if (!needs_autograd(x, weight, group_sizes)) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return grouped_gemm_op().call(x, weight, group_sizes, trans_b);
  }
  return GroupedGemm::apply(x, weight, group_sizes, trans_b);
}

// ------------------------------------------------------------------ grouped_gemm_dw
// out[e] = a_e^T b_e  =>  da_e = b_e dout_e^T (grouped_gemm(b, g, trans_b=True)),
//                          db_e = a_e dout_e   (grouped_gemm(a, g, trans_b=False)).
struct GroupedGemmDw : public torch::autograd::Function<GroupedGemmDw> {
  static Tensor forward(AutogradContext* ctx, const Tensor& a, const Tensor& b, const Tensor& group_sizes) {
    at::AutoDispatchBelowADInplaceOrView guard;
    Tensor out = grouped_gemm_dw_op().call(a, b, group_sizes);
    ctx->save_for_backward({a, b, group_sizes});
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    const Tensor g = grads[0].contiguous();
    Tensor da, db;
    if (ctx->needs_input_grad(0)) da = grouped_gemm_op().call(s[1], g, s[2], true);
    if (ctx->needs_input_grad(1)) db = grouped_gemm_op().call(s[0], g, s[2], false);
    return {da, db, Tensor()};
  }
};

Tensor grouped_gemm_dw_autograd(const Tensor& a, const Tensor& b, const Tensor& group_sizes) {
  if (!needs_autograd(a, b, group_sizes)) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return grouped_gemm_dw_op().call(a, b, group_sizes);
  }
  return GroupedGemmDw::apply(a, b, group_sizes);
}

}  // namespace

AMO_CXX_AUTOGRAD(grouped_gemm, grouped_gemm_autograd)
AMO_CXX_AUTOGRAD(grouped_gemm_dw, grouped_gemm_dw_autograd)
