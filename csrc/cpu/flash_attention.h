// Blocked flash attention on the CPU (forward and backward), shared by flash_attention.cpp and
// mla_attention.cpp. Layout: packed tokens, q [Tq, Hq, Dq], k [Tk, Hkv, Dk], v [Tk, Hkv, Dv] (any
// token/head strides, unit stride in D), sequences delimited by cu_seqlens_q / cu_seqlens_k [B+1];
// optional shared key part k_rope [Tk, Dr] (one head for all heads: score = q[:, :Dk].k +
// q[:, Dk:].k_rope). The arguments are checked at the op boundary (common/<family>_checks.h).
#pragma once

#include <torch/extension.h>

#include <optional>
#include <tuple>

namespace amo {

// (out [Tq,Hq,Dv] in q's dtype, lse [Hq,Tq] fp32 (fp64 for fp64 inputs))
std::tuple<at::Tensor, at::Tensor> flash_attention_fwd_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& k_rope, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, bool causal,
    double softmax_scale);

// (dq, dk, dv, dk_rope (shape [0] without k_rope)), in q's dtype
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> flash_attention_bwd_cpu(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& k_rope, const at::Tensor& out, const at::Tensor& lse,
    const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
    int64_t max_seqlen_k, bool causal, double softmax_scale);

// Backward into caller-provided gradient buffers dq [Tq,Hq,Dq], dk [Tk,Hkv,Dk], dv [Tk,Hkv,Dv] in the
// accumulation dtype (fp32; fp64 for fp64), any token/head strides (e.g. dk and dv as the two
// halves of one [T, H, Dk+Dv] buffer). Returns dk_rope summed over heads (shape [0] without it).
at::Tensor flash_attention_bwd_into(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& k_rope, const at::Tensor& out, const at::Tensor& lse,
    const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, bool causal,
    double softmax_scale, at::Tensor dq, at::Tensor dk, at::Tensor dv);

}  // namespace amo
