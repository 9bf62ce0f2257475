"""Reference (specification) of ``mla_attention_fwd`` / ``mla_attention_bwd``: the naive MLA.

Up-project the latent (``kv = c_kv @ w_kv_up^T``, viewed ``[T, H, Dn + Dv]`` and split into
``K_nope`` and ``V``), append the shared rope key ``k_pe`` to every head's key, and run plain
softmax attention (:mod:`ascend_moe_ops.reference.flash_attention`). The backward recomputes the
up-projection when ``kv`` is not given (shape ``[0]``).

Precision: the up-projection is computed in fp32 (fp64 for fp64 inputs) and rounded once to the
input dtype: ``kv`` is a tensor of the model's dtype, the one ``recompute="none"`` saves, so both
recompute modes see the same bits. The attention then runs in fp32 (see the flash_attention
reference); ``d kv`` stays fp32 and the two gradient products ``d c_kv = d kv @ w_kv_up`` and
``d w_kv_up = d kv^T @ c_kv`` are computed in fp32 and rounded once at the end.
"""

from __future__ import annotations

import torch

from . import flash_attention as _fa


def up_project(c_kv, w_kv_up):
    acc = _fa.acc_dtype(c_kv.dtype)
    return torch.nn.functional.linear(c_kv.to(acc), w_kv_up.to(acc)).to(c_kv.dtype)


def _split(kv, num_heads, qk_nope_dim, v_dim):
    kvh = kv.view(kv.shape[0], num_heads, qk_nope_dim + v_dim)
    return kvh[..., :qk_nope_dim], kvh[..., qk_nope_dim:]


def latent_kv(c_kv, w_kv_up, num_heads, qk_nope_dim, v_dim, kv=None):
    """``(kv, k_nope, v)``: the up-projected latent (``kv`` as given, recomputed with
    :func:`up_project` when it is ``None`` or empty, i.e. not saved) and its per-head nope key and
    value (views of ``kv``, no copy)."""
    if kv is None or kv.numel() == 0:
        kv = up_project(c_kv, w_kv_up)
    return (kv,) + _split(kv, num_heads, qk_nope_dim, v_dim)


def saved_kv(kv, save_kv):
    """What the forward returns as ``kv``: the tensor itself, or an empty one when not saved."""
    return kv if save_kv else kv.new_empty((0,))


def _attention_bwd_acc(grad_out, q, k_nope, v, k_pe, causal, softmax_scale, cu_seqlens, max_seqlen):
    """The attention backward with the gradients left in the accumulation dtype (fp32 inputs)."""
    acc = _fa.acc_dtype(q.dtype)
    return _fa.flash_attention_bwd(grad_out.to(acc), q.to(acc), k_nope.to(acc), v.to(acc),
                                   k_pe.to(acc), None, None, cu_seqlens, cu_seqlens, max_seqlen,
                                   max_seqlen, causal, softmax_scale)


def mla_attention_fwd(q, c_kv, k_pe, w_kv_up, cu_seqlens, max_seqlen, num_heads, qk_nope_dim,
                      v_dim, softmax_scale, causal, save_kv):
    kv, k_nope, v = latent_kv(c_kv, w_kv_up, num_heads, qk_nope_dim, v_dim)
    k = _fa.full_keys(k_nope, k_pe, num_heads)
    out, lse = _fa.flash_attention_fwd(q, k, v, None, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, causal,
                                      softmax_scale)
    return out, lse, saved_kv(kv, save_kv)


def mla_attention_bwd(grad_out, q, c_kv, k_pe, w_kv_up, out, lse, kv, cu_seqlens, max_seqlen,
                      num_heads, qk_nope_dim, v_dim, softmax_scale, causal):
    kv, k_nope, v = latent_kv(c_kv, w_kv_up, num_heads, qk_nope_dim, v_dim, kv)
    dq, dk_nope, dv, dk_pe = _attention_bwd_acc(grad_out, q, k_nope, v, k_pe, causal,
                                                softmax_scale, cu_seqlens, max_seqlen)
    acc = dq.dtype
    dkv = torch.cat([dk_nope, dv], dim=-1).reshape(kv.shape)
    dc_kv = dkv @ w_kv_up.to(acc)
    dw = dkv.t() @ c_kv.to(acc)
    dt = q.dtype
    return dq.to(dt), dc_kv.to(c_kv.dtype), dk_pe.to(k_pe.dtype), dw.to(w_kv_up.dtype)
