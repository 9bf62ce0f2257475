// MLA on the CPU: the latent up-projection is one GEMM (at::linear), the attention is the blocked
// flash kernel of flash_attention.cpp with the nope key per head (a strided view into the
// up-projected kv, no copy) and the rope key k_pe as the single shared key part.
// The backward recomputes kv with the very same call when it was not saved, so both recompute
// modes give the same bits.
#include "common/mla_attention_checks.h"
#include "common/op_registry.h"
#include "common/registry.h"
#include "cpu/flash_attention.h"

namespace amo {
namespace {

std::tuple<at::Tensor, at::Tensor> split_kv(const at::Tensor& kv, int64_t H, int64_t Dn, int64_t Dv) {
  auto kvh = kv.view({kv.size(0), H, Dn + Dv});
  return {kvh.narrow(2, 0, Dn), kvh.narrow(2, Dn, Dv)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> mla_attention_fwd_cpu(
    const at::Tensor& q, const at::Tensor& c_kv, const at::Tensor& k_pe, const at::Tensor& w,
    const at::Tensor& cu_seqlens, int64_t max_seqlen, int64_t H, int64_t Dn, int64_t Dv,
    double softmax_scale, bool causal, bool save_kv) {
  auto kv = at::linear(c_kv, w);
  auto [k_nope, v] = split_kv(kv, H, Dn, Dv);
  auto [out, lse] = flash_attention_fwd_cpu(q, k_nope, v, k_pe, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                             causal, softmax_scale);
  return {out, lse, save_kv ? kv : at::empty({0}, kv.options())};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> mla_attention_bwd_cpu(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& c_kv, const at::Tensor& k_pe,
    const at::Tensor& w, const at::Tensor& out, const at::Tensor& lse, const at::Tensor& kv_saved,
    const at::Tensor& cu_seqlens, int64_t max_seqlen, int64_t H, int64_t Dn, int64_t Dv,
    double softmax_scale, bool causal) {
  auto kv = kv_saved.numel() ? kv_saved : at::linear(c_kv, w);
  auto [k_nope, v] = split_kv(kv, H, Dn, Dv);
  // dk_nope and dv land in the two halves of one [T, H, Dn+Dv] buffer: the layout of kv, so
  // d kv is one dtype conversion away (no concatenation)
  const int64_t T = kv.size(0);
  auto fopts = q.options().dtype(q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
  auto dq_f = at::empty(q.sizes(), fopts);
  auto dkv_f = at::empty({T, H, Dn + Dv}, fopts);
  auto dkpe = flash_attention_bwd_into(grad_out, q, k_nope, v, k_pe, out, lse, cu_seqlens, cu_seqlens, causal,
                                       softmax_scale, dq_f, dkv_f.narrow(2, 0, Dn),
                                       dkv_f.narrow(2, Dn, Dv));
  auto dkv = dkv_f.view({T, H * (Dn + Dv)}).to(kv.scalar_type());
  auto dq = dq_f.to(q.scalar_type());
  auto dc = at::mm(dkv, w);
  auto dw = at::mm(dkv.t(), c_kv);
  return {dq, dc, dkpe, dw};
}

}  // namespace
}  // namespace amo

// ---- dispatcher kernels: the op-boundary checks (common/mla_attention_checks.h), the valid empty case (T = 0),
// then the kernels ----
namespace {
std::tuple<at::Tensor, at::Tensor, at::Tensor> mla_attention_fwd_op(
    const at::Tensor& q, const at::Tensor& c_kv, const at::Tensor& k_pe, const at::Tensor& w,
    const at::Tensor& cu_seqlens, int64_t max_seqlen, int64_t H, int64_t Dn, int64_t Dv, double softmax_scale,
    bool causal, bool save_kv) {
  amo::checks::mla_attention_fwd(q, c_kv, k_pe, w, cu_seqlens, max_seqlen, H, Dn, Dv, softmax_scale);
  if (q.size(0) == 0) {
    const int64_t T = 0;
    return {at::zeros({T, H, Dv}, q.options()),
            at::empty({H, T}, q.options().dtype(amo::checks::lse_dtype(q.scalar_type()))),
            save_kv ? at::empty({T, w.size(0)}, q.options()) : at::empty({0}, q.options())};
  }
  return amo::mla_attention_fwd_cpu(q, c_kv, k_pe, w, cu_seqlens, max_seqlen, H, Dn, Dv, softmax_scale, causal,
                                    save_kv);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> mla_attention_bwd_op(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& c_kv, const at::Tensor& k_pe,
    const at::Tensor& w, const at::Tensor& out, const at::Tensor& lse, const at::Tensor& kv,
    const at::Tensor& cu_seqlens, int64_t max_seqlen, int64_t H, int64_t Dn, int64_t Dv, double softmax_scale,
    bool causal) {
  amo::checks::mla_attention_bwd(grad_out, q, c_kv, k_pe, w, out, lse, kv, cu_seqlens, max_seqlen, H, Dn, Dv,
                                 softmax_scale);
  if (q.size(0) == 0)
    return {at::zeros_like(q), at::zeros_like(c_kv), at::zeros_like(k_pe), at::zeros_like(w)};
  return amo::mla_attention_bwd_cpu(grad_out, q, c_kv, k_pe, w, out, lse, kv, cu_seqlens, max_seqlen, H, Dn, Dv,
                                    softmax_scale, causal);
}
}  // namespace

// Registered from the op list (common/op_list.h, common/op_registry.h).
AMO_CPU_KERNEL(mla_attention_fwd, mla_attention_fwd_op)
AMO_CPU_KERNEL(mla_attention_bwd, mla_attention_bwd_op)
AMO_OP_CONTRACT(mla_attention_fwd)
AMO_OP_CONTRACT(mla_attention_bwd)
