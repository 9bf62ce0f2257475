// C++ autograd of moe_unpermute (cpu/autograd.h; registered from the op list, common/op_list.h).
#include "cpu/autograd.h"

namespace {

using namespace amo::autograd;

AMO_OP_HANDLE(moe_unpermute, Tensor(const Tensor&, const Tensor&, const OptTensor&))
AMO_OP_HANDLE(moe_unpermute_backward, Tensor2(const Tensor&, const Tensor&, const Tensor&, const OptTensor&))

// ------------------------------------------------------------------ moe_unpermute
// Saves (permuted, row_id_map, probs); without probs only an [N, 0] stand-in for permuted (its row
// count and dtype are all moe_unpermute_backward needs), not the activations.
struct MoeUnpermute : public torch::autograd::Function<MoeUnpermute> {
  static Tensor forward(AutogradContext* ctx, const Tensor& permuted, const Tensor& row_id_map,
                        const OptTensor& probs) {
    at::AutoDispatchBelowADInplaceOrView guard;
    Tensor out = moe_unpermute_op().call(permuted, row_id_map, probs);
    const bool has_probs = present(probs);
    ctx->saved_data["has_probs"] = has_probs;
    if (has_probs) {
      ctx->save_for_backward({permuted, row_id_map, *probs});
    } else {
      ctx->save_for_backward({permuted.new_empty({permuted.size(0), 0}), row_id_map});
    }
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const bool has_probs = ctx->saved_data["has_probs"].toBool();
    const OptTensor probs = has_probs ? OptTensor(saved[2]) : OptTensor();
    auto [d_permuted, d_probs] = moe_unpermute_backward_op().call(grads[0].contiguous(), saved[0], saved[1], probs);
    return {ctx->needs_input_grad(0) ? d_permuted : Tensor(), Tensor(),
            has_probs && ctx->needs_input_grad(2) ? d_probs : Tensor()};
  }
};

Tensor moe_unpermute_autograd(const Tensor& permuted, const Tensor& row_id_map, const OptTensor& probs) {
  if (!needs_autograd(permuted, row_id_map, probs)) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return moe_unpermute_op().call(permuted, row_id_map, probs);
  }
  return MoeUnpermute::apply(permuted, row_id_map, probs);
}

}  // namespace

AMO_CXX_AUTOGRAD(moe_unpermute, moe_unpermute_autograd)
