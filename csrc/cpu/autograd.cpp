// C++ autograd of the ops, registered from the op list (common/op_list.h): every CXX_GRAD op gets its
// kernel (csrc/cpu/<family>_autograd.cpp, AMO_CXX_AUTOGRAD) at the Autograd alias key of its home
// namespace, so a call goes dispatcher -> that kernel -> the backend kernel of the input's device
// (CPU, CUDA or PrivateUse1, whatever _backends.bind_public / _npu.py registered) with no Python in
// between, and so does its backward. The alias key covers AutogradCPU, AutogradCUDA and
// AutogradPrivateUse1.
//
// The public ops (ascend_moe_ops) are registered when the extension is loaded (_library imports it
// before the op modules register their formulas, and register_op then leaves the public namespace's
// Python formula out); the backend namespaces keep the Python formulas (each backend differentiable
// on its own). The internal ops' home is ascend_moe_ops_native. Ops without a formula (the *_bwd ops,
// moe_unpermute_backward, swiglu_probs_backward) get no C++ kernel: _library.py registers one Python
// guard for them in every namespace (exact second derivatives on the reference, a NotImplementedError
// naming the op and backend elsewhere; until 2026-12-07 torch's fallback gave zeros).
#include <torch/library.h>

#include "common/op_registry.h"

#define AMO_OP_AUTOGRAD_IF(want, op, fam, scope, ascendc, grad) \
  AMO_WHEN(want, scope, AMO_WHEN(CXX_GRAD, grad, amo::op_list::autograd_##op(m);))
#define AMO_OP_AUTOGRAD_PUBLIC(...) AMO_OP_AUTOGRAD_IF(PUBLIC_OP, __VA_ARGS__)
#define AMO_OP_AUTOGRAD_INTERNAL(...) AMO_OP_AUTOGRAD_IF(INTERNAL_OP, __VA_ARGS__)

TORCH_LIBRARY_IMPL(ascend_moe_ops, Autograd, m) { ASCEND_MOE_OPS_FOR_EACH_OP(AMO_OP_AUTOGRAD_PUBLIC) }

TORCH_LIBRARY_IMPL(ascend_moe_ops_native, Autograd, m) { ASCEND_MOE_OPS_FOR_EACH_OP(AMO_OP_AUTOGRAD_INTERNAL) }
