// What the C++ autograd kernels of csrc/cpu/<family>_autograd.cpp share (no op of its own). Each
// kernel mirrors its op's Python formula (_setup_context / _backward in ascend_moe_ops/ops/): the same
// saved tensors, the same outputs marked non-differentiable, the same backward ops of the op's
// namespace called through the dispatcher (so backward runs the bound backend, and double backward
// works exactly where the Python formula allowed it). With grad mode off or no input requiring grad,
// the kernel only redispatches below autograd (as torch.library's Python wrapper does). Registered at
// the Autograd alias key from the op list (cpu/autograd.cpp).
//
// Gradients of unused outputs arrive materialized as zeros (the default of both torch::autograd::
// Function and torch.autograd.Function). ctx->needs_input_grad(i) counts tensor inputs only (an
// absent optional tensor has no edge).
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>

#include "common/op_registry.h"

namespace amo {
namespace autograd {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using OptTensor = std::optional<Tensor>;
using Tensor2 = std::tuple<Tensor, Tensor>;
using Tensor3 = std::tuple<Tensor, Tensor, Tensor>;
using Tensor4 = std::tuple<Tensor, Tensor, Tensor, Tensor>;
using Tensor5 = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>;

inline bool requires_grad(const Tensor& t) { return t.defined() && t.requires_grad(); }
inline bool requires_grad(const OptTensor& t) { return t.has_value() && requires_grad(*t); }

// What torch.library's wrapper tests: grad mode on and some tensor argument requiring grad.
template <typename... Ts>
bool needs_autograd(const Ts&... ts) {
  return at::GradMode::is_enabled() && (requires_grad(ts) || ...);
}

inline bool present(const OptTensor& t) { return t.has_value() && t->defined(); }
inline OptTensor optional_of(const Tensor& t) { return t.defined() ? OptTensor(t) : OptTensor(); }

template <typename... Ts>
variable_list to_list(const std::tuple<Ts...>& t) {
  return std::apply([](const auto&... x) { return variable_list{x...}; }, t);
}

}  // namespace autograd
}  // namespace amo

// <op>_op(): the typed handle of `op` in its home namespace (common/op_registry.h), looked up once (the
// schemas are defined from Python before the first call); .typed<> checks the C++ signature `...`
// against the schema.
#define AMO_OP_HANDLE(op, ...)                                                                          \
  const c10::TypedOperatorHandle<__VA_ARGS__>& op##_op() {                                              \
    static const auto handle =                                                                          \
        c10::Dispatcher::singleton()                                                                    \
            .findSchemaOrThrow((std::string(::amo::op_list::home::op) + "::" #op).c_str(), "")          \
            .typed<__VA_ARGS__>();                                                                      \
    return handle;                                                                                      \
  }
