"""Triton MLA: the up-projection is one ``torch`` matmul, the attention is the Triton flash kernel
with the per-head nope key (a strided view into the up-projected ``kv``, no copy) and ``k_pe`` as
the shared second key part (head stride 0, never expanded per head). The backward recomputes
``kv`` with the same matmul when it was not saved, so both recompute modes give the same bits."""

from __future__ import annotations

import torch

from ascend_moe_ops.reference.mla_attention import latent_kv, saved_kv

from . import flash_attention as _fa


def mla_attention_fwd(q, c_kv, k_pe, w_kv_up, cu_seqlens, max_seqlen, num_heads, qk_nope_dim,
                      v_dim, softmax_scale, causal, save_kv):
    kv, k_nope, v = latent_kv(c_kv, w_kv_up, num_heads, qk_nope_dim, v_dim)
    out, lse = _fa.flash_attention_fwd(q, k_nope, v, k_pe, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                       causal, softmax_scale)
    return out, lse, saved_kv(kv, save_kv)


def mla_attention_bwd(grad_out, q, c_kv, k_pe, w_kv_up, out, lse, kv, cu_seqlens, max_seqlen,
                      num_heads, qk_nope_dim, v_dim, softmax_scale, causal):
    kv, k_nope, v = latent_kv(c_kv, w_kv_up, num_heads, qk_nope_dim, v_dim, kv)
    dq, dk, dv, dk_pe = _fa.flash_attention_bwd(grad_out, q, k_nope, v, k_pe, out, lse, cu_seqlens,
                                                cu_seqlens, max_seqlen, max_seqlen, causal, softmax_scale)
    dkv = torch.cat([dk, dv], dim=-1).reshape(kv.shape)
    return dq, dkv @ w_kv_up, dk_pe, dkv.t() @ c_kv
