// C++ autograd of swiglu_probs (cpu/autograd.h; registered from the op list, common/op_list.h).
#include "cpu/autograd.h"

namespace {

using namespace amo::autograd;

AMO_OP_HANDLE(swiglu_probs, Tensor(const Tensor&, const Tensor&))
AMO_OP_HANDLE(swiglu_probs_backward, Tensor2(const Tensor&, const Tensor&, const Tensor&))

// ------------------------------------------------------------------ swiglu_probs (internal)
// The fused SwiGLU x probs kernel of the Megatron adapter (ascend_moe_ops/ops/swiglu_probs.py): an
// internal op of the native namespace only; its formula in C++ as for the public ops (fixed cost of a
// tiny forward + backward 101 us with the Python formula, 57 us with this one; 2026-12-02,
// docs/benchmarks.md).
struct SwigluProbs : public torch::autograd::Function<SwigluProbs> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& probs) {
    at::AutoDispatchBelowADInplaceOrView guard;
    Tensor out = swiglu_probs_op().call(x, probs);
    ctx->save_for_backward({x, probs});
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    auto [gx, gp] = swiglu_probs_backward_op().call(grads[0], s[0], s[1]);  // the kernel makes it contiguous
    return {ctx->needs_input_grad(0) ? gx : Tensor(), ctx->needs_input_grad(1) ? gp : Tensor()};
  }
};

Tensor swiglu_probs_autograd(const Tensor& x, const Tensor& probs) {
  if (!needs_autograd(x, probs)) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return swiglu_probs_op().call(x, probs);
  }
  return SwigluProbs::apply(x, probs);
}

}  // namespace

AMO_CXX_AUTOGRAD(swiglu_probs, swiglu_probs_autograd)
