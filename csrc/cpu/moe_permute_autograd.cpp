// C++ autograd of moe_permute (cpu/autograd.h; registered from the op list, common/op_list.h).
#include "cpu/autograd.h"

namespace {

using namespace amo::autograd;

AMO_OP_HANDLE(moe_permute, Tensor5(const Tensor&, const Tensor&, const OptTensor&, int64_t, std::optional<int64_t>,
                      int64_t, std::optional<int64_t>))
AMO_OP_HANDLE(moe_unpermute, Tensor(const Tensor&, const Tensor&, const OptTensor&))

// ------------------------------------------------------------------ moe_permute
// Saves row_id_map; row_id_map, tokens_per_expert and group_sizes are not differentiable.
// d tokens = unweighted moe_unpermute of the gradient; d probs = a gather of grad_probs by the row map
// (zero where a slot is not kept).
struct MoePermute : public torch::autograd::Function<MoePermute> {
  static variable_list forward(AutogradContext* ctx, const Tensor& tokens, const Tensor& routing,
                               const OptTensor& probs, int64_t num_experts, std::optional<int64_t> capacity,
                               int64_t align, std::optional<int64_t> num_out_tokens) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto out = to_list(moe_permute_op().call(tokens, routing, probs, num_experts, capacity, align, num_out_tokens));
    ctx->saved_data["has_probs"] = present(probs);
    ctx->save_for_backward({out[2]});
    ctx->mark_non_differentiable({out[2], out[3], out[4]});
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Tensor row_id_map = ctx->get_saved_variables()[0];
    const bool has_probs = ctx->saved_data["has_probs"].toBool();
    const Tensor& grad_tokens = grads[0];
    const Tensor& grad_probs = grads[1];
    Tensor d_tokens, d_probs;
    if (ctx->needs_input_grad(0) && grad_tokens.defined()) {  // edges: tokens 0, routing 1, probs 2
      d_tokens = moe_unpermute_op().call(grad_tokens.contiguous(), row_id_map, std::nullopt);
    }
    if (has_probs && ctx->needs_input_grad(2) && grad_probs.defined()) {
      const Tensor rows = row_id_map.to(at::kLong);
      if (grad_probs.sym_numel() == 0) {  // no output row (num_out_tokens=0): nothing to gather (sym_: traceable)
        d_probs = at::zeros_like(rows, grad_probs.options());
      } else {
        const Tensor gathered = grad_probs.index({rows.clamp_min(0)});
        d_probs = at::where(rows.ge(0), gathered, at::zeros_like(gathered));
      }
    }
    return {d_tokens, Tensor(), d_probs, Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

Tensor5 moe_permute_autograd(const Tensor& tokens, const Tensor& routing, const OptTensor& probs,
                             int64_t num_experts, std::optional<int64_t> capacity, int64_t align,
                             std::optional<int64_t> num_out_tokens) {
  if (!needs_autograd(tokens, routing, probs)) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return moe_permute_op().call(tokens, routing, probs, num_experts, capacity, align, num_out_tokens);
  }
  auto out = MoePermute::apply(tokens, routing, probs, num_experts, capacity, align, num_out_tokens);
  return {out[0], out[1], out[2], out[3], out[4]};
}

}  // namespace

AMO_CXX_AUTOGRAD(moe_permute, moe_permute_autograd)
