// The op contracts of flash_attention_fwd and flash_attention_bwd: amo::checks::<op>, checked first by
// every C++ kernel of the ops (csrc/cpu/flash_attention.cpp, csrc/ascend/host/flash_attention_host.h)
// and bound alone as _C._check_<op> (AMO_OP_CONTRACT in csrc/cpu/flash_attention.cpp), and the valid
// empty cases those kernels answer without a launch. Their Python twins are the specs' checks
// (ascend_moe_ops/ops/_contracts.py); the shared rules and helpers (cu_seqlens and lse included):
// common/checks.h.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

#include "checks.h"

namespace amo {
namespace checks {

// Shapes: q [Tq, Hq, Dq], k [Tk, Hkv, Dk], v [Tk, Hkv, Dv], k_rope [Tk, Dr] (optional), cu_seqlens_q and
// cu_seqlens_k [B+1] (the same B), lse [Hq, Tq]. Hkv divides Hq (GQA/MQA). d_v > d_qk is valid.
inline void attention_common(const char* op, const Tensor& q, const Tensor& k, const Tensor& v, const OptTensor& k_rope,
                             const Tensor& cu_q, const Tensor& cu_k, int64_t max_q, int64_t max_k,
                             double softmax_scale) {
  float_tensor(op, "q", q, 3, "[Tq, Hq, D_qk]");
  like_tensor(op, "k", k, q, 3, "[Tk, Hkv, D_k]");
  like_tensor(op, "v", v, q, 3, "[Tk, Hkv, D_v]");
  const int64_t Hq = q.size(1), Dq = q.size(2), Tk = k.size(0), Hkv = k.size(1);
  TORCH_CHECK_VALUE((Hkv == 0 && Hq == 0) || (Hkv >= 1 && Hq % Hkv == 0), op, ": k must have a number of heads Hkv ",
                    "that divides the Hq=", Hq, " heads of q (GQA/MQA), got shape ", shape_str(k.sizes()));
  TORCH_CHECK_VALUE(v.size(0) == Tk && v.size(1) == Hkv, op, ": v must have shape (", Tk, ", ", Hkv,
                    ", D) (the tokens and heads of k), got ", shape_str(v.sizes()));
  int64_t dr = 0;
  if (k_rope.has_value()) {
    like_tensor(op, "k_rope", *k_rope, q, 2, "[Tk, D_r]");
    TORCH_CHECK_VALUE(k_rope->size(0) == Tk, op, ": k_rope must have shape (", Tk, ", D_r) (the tokens of k), got ",
                      shape_str(k_rope->sizes()));
    dr = k_rope->size(1);
  }
  TORCH_CHECK_VALUE(Dq >= 1 && v.size(2) >= 1, op, ": head dims must be positive, got d_qk=", Dq, ", d_v=", v.size(2));
  TORCH_CHECK_VALUE(k.size(2) + dr == Dq, op, ": k head dim must equal q head dim ", Dq, " minus the k_rope dim ", dr,
                    ", got ", k.size(2));
  softmax_scale_check(op, softmax_scale, q);
  cu_seqlens(op, "cu_seqlens_q", "max_seqlen_q", cu_q, q.size(0), "q", max_q, q);
  cu_seqlens(op, "cu_seqlens_k", "max_seqlen_k", cu_k, Tk, "k", max_k, q, cu_q.numel());
}

inline void flash_attention_fwd(const Tensor& q, const Tensor& k, const Tensor& v, const OptTensor& k_rope,
                                const Tensor& cu_q, const Tensor& cu_k, int64_t max_q, int64_t max_k,
                                bool /*causal*/, double softmax_scale) {
  attention_common("flash_attention_fwd", q, k, v, k_rope, cu_q, cu_k, max_q, max_k, softmax_scale);
}

inline void flash_attention_bwd(const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
                                const OptTensor& k_rope, const Tensor& out, const Tensor& l, const Tensor& cu_q,
                                const Tensor& cu_k, int64_t max_q, int64_t max_k, bool /*causal*/,
                                double softmax_scale) {
  constexpr const char* op = "flash_attention_bwd";
  attention_common(op, q, k, v, k_rope, cu_q, cu_k, max_q, max_k, softmax_scale);
  const std::vector<int64_t> o_shape = {q.size(0), q.size(1), v.size(2)};
  like_tensor(op, "grad_out", grad_out, q, 3, "[Tq, Hq, D_v]");
  shape_is(op, "grad_out", grad_out, o_shape, "[Tq, Hq, D_v]");
  like_tensor(op, "out", out, q, 3, "[Tq, Hq, D_v]");
  shape_is(op, "out", out, o_shape, "[Tq, Hq, D_v]");
  lse(op, l, q);
}

// ---------------------------------------------------------------- valid empty cases (no kernel launch)
// Tq = 0 (also B = 0: cu_seqlens = [0]) or Hq = 0: empty outputs of the right shapes and dtypes; Tk = 0 (no
// keys at all): every query row sees no key, so out = 0, lse = -inf and every gradient is zero.
inline bool attention_is_empty(const Tensor& q) { return q.size(0) == 0 || q.size(1) == 0; }
inline bool attention_is_empty(const Tensor& q, const Tensor& k) { return attention_is_empty(q) || k.size(0) == 0; }

inline std::tuple<Tensor, Tensor> empty_attention_fwd(const Tensor& q, const Tensor& v) {
  return {at::zeros({q.size(0), q.size(1), v.size(2)}, q.options()),
          at::full({q.size(1), q.size(0)}, -std::numeric_limits<double>::infinity(),
                   q.options().dtype(lse_dtype(q.scalar_type())))};
}

}  // namespace checks
}  // namespace amo
