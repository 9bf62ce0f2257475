// The op contracts of mla_attention_fwd and mla_attention_bwd: amo::checks::<op>, checked first by
// every C++ kernel of the ops (csrc/cpu/mla_attention.cpp) and bound alone as _C._check_<op>
// (AMO_OP_CONTRACT in csrc/cpu/mla_attention.cpp). Their Python twins are the specs' checks
// (ascend_moe_ops/ops/_contracts.py); the shared rules and helpers (cu_seqlens and lse included):
// common/checks.h.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "checks.h"

namespace amo {
namespace checks {

inline void mla_common(const char* op, const Tensor& q, const Tensor& c_kv, const Tensor& k_pe, const Tensor& w,
                       const Tensor& cu, int64_t max_seqlen, int64_t H, int64_t Dn, int64_t Dv, double softmax_scale) {
  float_tensor(op, "q", q, 3, "[T, H, Dn + Dr]");
  TORCH_CHECK_VALUE(H >= 1, op, ": num_heads must be >= 1, got ", H);
  TORCH_CHECK_VALUE(Dn >= 1, op, ": qk_nope_dim must be >= 1, got ", Dn);
  TORCH_CHECK_VALUE(Dv >= 1, op, ": v_dim must be >= 1, got ", Dv);
  const int64_t T = q.size(0), Dq = q.size(2);
  TORCH_CHECK_VALUE(q.size(1) == H, op, ": q must have num_heads=", H, " heads (dim 1), got shape ", shape_str(q.sizes()));
  TORCH_CHECK_VALUE(Dq - Dn >= 1, op, ": q head dim ", Dq, " must be qk_nope_dim=", Dn, " + a rope dim >= 1");
  like_tensor(op, "c_kv", c_kv, q, 2, "[T, Dc]");
  TORCH_CHECK_VALUE(c_kv.size(0) == T, op, ": c_kv must have shape (", T, ", Dc) (the tokens of q), got ",
                    shape_str(c_kv.sizes()));
  like_tensor(op, "k_pe", k_pe, q, 2, "[T, Dr]");
  shape_is(op, "k_pe", k_pe, {T, Dq - Dn}, "tokens of q, rope dim = q head dim - qk_nope_dim");
  like_tensor(op, "w_kv_up", w, q, 2, "[H * (Dn + Dv), Dc]");
  int64_t rows = 0;
  TORCH_CHECK_VALUE(!c10::mul_overflows(H, Dn + Dv, &rows), op, ": num_heads * (qk_nope_dim + v_dim) overflows");
  shape_is(op, "w_kv_up", w, {rows, c_kv.size(1)}, "[num_heads*(qk_nope_dim+v_dim), latent dim]");
  softmax_scale_check(op, softmax_scale, q);
  cu_seqlens(op, cu, q, max_seqlen);
}

inline void mla_attention_fwd(const Tensor& q, const Tensor& c_kv, const Tensor& k_pe, const Tensor& w, const Tensor& cu,
                              int64_t max_seqlen, int64_t H, int64_t Dn, int64_t Dv, double softmax_scale,
                              bool /*causal*/ = false, bool /*save_kv*/ = false) {
  mla_common("mla_attention_fwd", q, c_kv, k_pe, w, cu, max_seqlen, H, Dn, Dv, softmax_scale);
}

inline void mla_attention_bwd(const Tensor& grad_out, const Tensor& q, const Tensor& c_kv, const Tensor& k_pe,
                              const Tensor& w, const Tensor& out, const Tensor& l, const Tensor& kv, const Tensor& cu,
                              int64_t max_seqlen, int64_t H, int64_t Dn, int64_t Dv, double softmax_scale,
                              bool /*causal*/ = false) {
  constexpr const char* op = "mla_attention_bwd";
  mla_common(op, q, c_kv, k_pe, w, cu, max_seqlen, H, Dn, Dv, softmax_scale);
  const std::vector<int64_t> o_shape = {q.size(0), H, Dv};
  like_tensor(op, "grad_out", grad_out, q, 3, "[T, H, Dv]");
  shape_is(op, "grad_out", grad_out, o_shape, "[T, H, Dv]");
  like_tensor(op, "out", out, q, 3, "[T, H, Dv]");
  shape_is(op, "out", out, o_shape, "[T, H, Dv]");
  lse(op, l, q);
  if (kv.numel() != 0) {
    like_tensor(op, "kv", kv, q, 2, "[T, H * (Dn + Dv)] (or shape [0] = recompute)");
    shape_is(op, "kv", kv, {q.size(0), w.size(0)}, "[T, H * (Dn + Dv)], or shape [0] = recompute");
  }
}

}  // namespace checks
}  // namespace amo
