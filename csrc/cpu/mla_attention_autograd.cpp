// C++ autograd of mla_attention_fwd (cpu/autograd.h; registered from the op list, common/op_list.h).
#include "cpu/autograd.h"

namespace {

using namespace amo::autograd;

AMO_OP_HANDLE(mla_attention_fwd, Tensor3(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t,
                      int64_t, int64_t, int64_t, double, bool, bool))
AMO_OP_HANDLE(mla_attention_bwd, Tensor4(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                      const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t, int64_t, int64_t,
                      int64_t, double, bool))

// ------------------------------------------------------------------ mla_attention_fwd
// Saves q, c_kv, k_pe, w_kv_up, out, lse, kv (shape [0] for recompute="kv") and cu_seqlens; lse and
// kv are not differentiable.
struct MlaAttention : public torch::autograd::Function<MlaAttention> {
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& c_kv, const Tensor& k_pe,
                               const Tensor& w_kv_up, const Tensor& cu_seqlens, int64_t max_seqlen,
                               int64_t num_heads, int64_t qk_nope_dim, int64_t v_dim, double softmax_scale,
                               bool causal, bool save_kv) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, lse, kv] = mla_attention_fwd_op().call(q, c_kv, k_pe, w_kv_up, cu_seqlens, max_seqlen, num_heads,
                                                      qk_nope_dim, v_dim, softmax_scale, causal, save_kv);
    auto& d = ctx->saved_data;
    d["max_seqlen"] = max_seqlen;
    d["num_heads"] = num_heads;
    d["qk_nope_dim"] = qk_nope_dim;
    d["v_dim"] = v_dim;
    d["scale"] = softmax_scale;
    d["causal"] = causal;
    ctx->save_for_backward({q, c_kv, k_pe, w_kv_up, out, lse, kv, cu_seqlens});
    ctx->mark_non_differentiable({lse, kv});
    return {out, lse, kv};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    auto& d = ctx->saved_data;
    auto [dq, dc, dkpe, dw] = mla_attention_bwd_op().call(
        grads[0].contiguous(), s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7], d["max_seqlen"].toInt(),
        d["num_heads"].toInt(), d["qk_nope_dim"].toInt(), d["v_dim"].toInt(), d["scale"].toDouble(),
        d["causal"].toBool());
    variable_list grads_in(12);
    grads_in[0] = dq;
    grads_in[1] = dc;
    grads_in[2] = dkpe;
    grads_in[3] = dw;
    return grads_in;
  }
};

Tensor3 mla_attention_fwd_autograd(const Tensor& q, const Tensor& c_kv, const Tensor& k_pe, const Tensor& w_kv_up,
                                   const Tensor& cu_seqlens, int64_t max_seqlen, int64_t num_heads,
                                   int64_t qk_nope_dim, int64_t v_dim, double softmax_scale, bool causal,
                                   bool save_kv) {
  if (!needs_autograd(q, c_kv, k_pe, w_kv_up, cu_seqlens)) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return mla_attention_fwd_op().call(q, c_kv, k_pe, w_kv_up, cu_seqlens, max_seqlen, num_heads, qk_nope_dim,
                                       v_dim, softmax_scale, causal, save_kv);
  }
  auto out = MlaAttention::apply(q, c_kv, k_pe, w_kv_up, cu_seqlens, max_seqlen, num_heads, qk_nope_dim, v_dim,
                                 softmax_scale, causal, save_kv);
  return {out[0], out[1], out[2]};
}

}  // namespace

AMO_CXX_AUTOGRAD(mla_attention_fwd, mla_attention_fwd_autograd)
