// C++ autograd of flash_attention_fwd (cpu/autograd.h; registered from the op list, common/op_list.h).
#include "cpu/autograd.h"

namespace {

using namespace amo::autograd;

AMO_OP_HANDLE(flash_attention_fwd, Tensor2(const Tensor&, const Tensor&, const Tensor&, const OptTensor&, const Tensor&,
                      const Tensor&, int64_t, int64_t, bool, double))
AMO_OP_HANDLE(flash_attention_bwd, Tensor4(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const OptTensor&,
                      const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t, int64_t, bool,
                      double))

// ------------------------------------------------------------------ flash_attention_fwd
// Saves q, k, v, k_rope, out, lse and both cu_seqlens (passed on as one tensor when the forward got
// one tensor twice: what backends without varlen q/k accept); lse is not differentiable.
struct FlashAttention : public torch::autograd::Function<FlashAttention> {
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                               const OptTensor& k_rope, const Tensor& cu_q, const Tensor& cu_k, int64_t max_q,
                               int64_t max_k, bool causal, double softmax_scale) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, lse] =
        flash_attention_fwd_op().call(q, k, v, k_rope, cu_q, cu_k, max_q, max_k, causal, softmax_scale);
    ctx->saved_data["has_rope"] = present(k_rope);
    ctx->saved_data["same_cu"] = cu_q.is_same(cu_k);
    ctx->saved_data["max_q"] = max_q;
    ctx->saved_data["max_k"] = max_k;
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["scale"] = softmax_scale;
    ctx->save_for_backward({q, k, v, present(k_rope) ? *k_rope : Tensor(), out, lse, cu_q, cu_k});
    ctx->mark_non_differentiable({lse});
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    auto& d = ctx->saved_data;
    const bool has_rope = d["has_rope"].toBool();
    const Tensor& cu_q = s[6];
    const Tensor& cu_k = d["same_cu"].toBool() ? s[6] : s[7];
    auto [dq, dk, dv, dkr] = flash_attention_bwd_op().call(
        grads[0].contiguous(), s[0], s[1], s[2], optional_of(s[3]), s[4], s[5], cu_q, cu_k, d["max_q"].toInt(),
        d["max_k"].toInt(), d["causal"].toBool(), d["scale"].toDouble());
    return {dq, dk, dv, has_rope ? dkr : Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

Tensor2 flash_attention_fwd_autograd(const Tensor& q, const Tensor& k, const Tensor& v, const OptTensor& k_rope,
                                     const Tensor& cu_q, const Tensor& cu_k, int64_t max_q, int64_t max_k,
                                     bool causal, double softmax_scale) {
  if (!needs_autograd(q, k, v, k_rope, cu_q, cu_k)) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return flash_attention_fwd_op().call(q, k, v, k_rope, cu_q, cu_k, max_q, max_k, causal, softmax_scale);
  }
  auto out = FlashAttention::apply(q, k, v, k_rope, cu_q, cu_k, max_q, max_k, causal, softmax_scale);
  return {out[0], out[1]};
}

}  // namespace

AMO_CXX_AUTOGRAD(flash_attention_fwd, flash_attention_fwd_autograd)
