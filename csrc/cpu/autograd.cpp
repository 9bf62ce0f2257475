// Autograd of the public ops (namespace ascend_moe_ops), in C++: one kernel per op at the Autograd
// alias key, so a call goes dispatcher -> this kernel -> the backend kernel of the input's device
// (CPU, CUDA or PrivateUse1, whatever _backends.bind_public / _npu.py registered) with no Python in
// between, and so does its backward.
//
// Each kernel mirrors the op's Python formula (_setup_context / _backward in ascend_moe_ops/ops/):
// the same saved tensors, the same outputs marked non-differentiable, the same backward ops of the
// public namespace called through the dispatcher (so backward runs the bound backend, and double
// backward works exactly where the Python formula allowed it: through moe_permute's, grouped_gemm's
// and grouped_gemm_dw's backward; the *_bwd ops and moe_unpermute_backward have no formula, so
// differentiating them hits torch's "autograd not implemented" fallback, as before). With grad mode
// off or no input requiring grad, the kernel only redispatches below autograd (as torch.library's
// Python wrapper does). The schemas stay in _library.py; the backend namespaces keep the Python
// formulas (each backend differentiable on its own), and _library.register_op uses the Python formula
// for the public namespace only when this extension is absent.
//
// Gradients of unused outputs arrive materialized as zeros (the default of both torch::autograd::
// Function and torch.autograd.Function). ctx->needs_input_grad(i) counts tensor inputs only (an
// absent optional tensor has no edge), hence the edge indices below.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using OptTensor = std::optional<Tensor>;

// ------------------------------------------------------------------ the public ops, by handle
// Looked up once (the schemas are defined from Python before the first call); .typed<> checks the
// C++ signature against the schema.
#define AMO_PUBLIC_OP(fn, name, ...)                                                                    \
  const c10::TypedOperatorHandle<__VA_ARGS__>& fn() {                                                   \
    static const auto handle =                                                                          \
        c10::Dispatcher::singleton().findSchemaOrThrow("ascend_moe_ops::" name, "").typed<__VA_ARGS__>(); \
    return handle;                                                                                      \
  }

using Tensor2 = std::tuple<Tensor, Tensor>;
using Tensor3 = std::tuple<Tensor, Tensor, Tensor>;
using Tensor4 = std::tuple<Tensor, Tensor, Tensor, Tensor>;
using Tensor5 = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>;

AMO_PUBLIC_OP(moe_permute_op, "moe_permute",
              Tensor5(const Tensor&, const Tensor&, const OptTensor&, int64_t, std::optional<int64_t>,
                      int64_t, std::optional<int64_t>))
AMO_PUBLIC_OP(moe_unpermute_op, "moe_unpermute", Tensor(const Tensor&, const Tensor&, const OptTensor&))
AMO_PUBLIC_OP(moe_unpermute_backward_op, "moe_unpermute_backward",
              Tensor2(const Tensor&, const Tensor&, const Tensor&, const OptTensor&))
AMO_PUBLIC_OP(flash_attention_fwd_op, "flash_attention_fwd",
              Tensor2(const Tensor&, const Tensor&, const Tensor&, const OptTensor&, const Tensor&,
                      const Tensor&, int64_t, int64_t, bool, double))
AMO_PUBLIC_OP(flash_attention_bwd_op, "flash_attention_bwd",
              Tensor4(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const OptTensor&,
                      const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t, int64_t, bool,
                      double))
AMO_PUBLIC_OP(mla_attention_fwd_op, "mla_attention_fwd",
              Tensor3(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t,
                      int64_t, int64_t, int64_t, double, bool, bool))
AMO_PUBLIC_OP(mla_attention_bwd_op, "mla_attention_bwd",
              Tensor4(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                      const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t, int64_t, int64_t,
                      int64_t, double, bool))
AMO_PUBLIC_OP(grouped_gemm_op, "grouped_gemm", Tensor(const Tensor&, const Tensor&, const Tensor&, bool))
AMO_PUBLIC_OP(grouped_gemm_dw_op, "grouped_gemm_dw", Tensor(const Tensor&, const Tensor&, const Tensor&))

#undef AMO_PUBLIC_OP

// ------------------------------------------------------------------ helpers
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

// ------------------------------------------------------------------ swiglu_probs (internal)
// The fused SwiGLU x probs kernel of the Megatron adapter (ascend_moe_ops/ops/swiglu_probs.py): an
// internal op of the native namespace only; its formula in C++ as for the public ops (fixed cost of a
// tiny forward + backward 101 us with the Python formula, 57 us with this one; 2026-12-02,
// docs/benchmarks.md).
using SwigluSig = Tensor(const Tensor&, const Tensor&);
using SwigluBwdSig = Tensor2(const Tensor&, const Tensor&, const Tensor&);
const c10::TypedOperatorHandle<SwigluSig>& swiglu_probs_op() {
  static const auto handle =
      c10::Dispatcher::singleton().findSchemaOrThrow("ascend_moe_ops_native::swiglu_probs", "").typed<SwigluSig>();
  return handle;
}
const c10::TypedOperatorHandle<SwigluBwdSig>& swiglu_probs_backward_op() {
  static const auto handle = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("ascend_moe_ops_native::swiglu_probs_backward", "")
                                 .typed<SwigluBwdSig>();
  return handle;
}

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

// Registered when the extension is loaded (_library imports it before the op modules register their
// formulas). The Autograd alias key covers AutogradCPU, AutogradCUDA and AutogradPrivateUse1.
TORCH_LIBRARY_IMPL(ascend_moe_ops, Autograd, m) {
  m.impl("moe_permute", TORCH_FN(moe_permute_autograd));
  m.impl("moe_unpermute", TORCH_FN(moe_unpermute_autograd));
  m.impl("flash_attention_fwd", TORCH_FN(flash_attention_fwd_autograd));
  m.impl("mla_attention_fwd", TORCH_FN(mla_attention_fwd_autograd));
  m.impl("grouped_gemm", TORCH_FN(grouped_gemm_autograd));
  m.impl("grouped_gemm_dw", TORCH_FN(grouped_gemm_dw_autograd));
}

TORCH_LIBRARY_IMPL(ascend_moe_ops_native, Autograd, m) {
  m.impl("swiglu_probs", TORCH_FN(swiglu_probs_autograd));
}
