"""``mla_attention``: multi-head latent attention for training (DeepSeek-V3 / Pangu Ultra MoE),
with the KV-only recompute memory policy."""

from __future__ import annotations

from typing import Optional

import torch

from .. import _backends, _library
from ..reference.flash_attention import lse_dtype
from . import _checks
from .flash_attention import check_cu_seqlens, pack_layout

OP = "mla_attention_fwd"
BWD = "mla_attention_bwd"
Tensor = torch.Tensor

for _op in (OP, BWD):
    _backends.register_impl(_op, "reference", "ascend_moe_ops.reference.mla_attention", _op)
    _backends.register_impl(_op, "native", "ascend_moe_ops._C", _op)
    _backends.register_impl(_op, "triton", "ascend_moe_ops.triton_ref.mla_attention", _op)
# The Ascend path composes the AscendC kernels (see ascend_fwd / ascend_bwd below): ascendc-emu runs
# them on the CPU emulation layer; on an NPU the same functions serve PrivateUse1 (ascend_moe_ops._npu).
_backends.register_impl(OP, "ascendc-emu", "ascend_moe_ops.ops.mla_attention", "ascend_fwd")
_backends.register_impl(BWD, "ascendc-emu", "ascend_moe_ops.ops.mla_attention", "ascend_bwd")


# ----------------------------------------------------------------------------- Ascend composition
# MLA on the Ascend kernels: the up-projection kv = c_kv . w_kv_up^T and its two gradients are the
# grouped GEMM Cube kernels with one group (grouped_gemm, grouped_gemm_dw), the attention is the
# AscendC flash attention with k_pe as the shared rope key (never expanded per head). Each op is
# called through its router, so the active backend's kernels run (ascendc-emu on CPU tensors, the
# PrivateUse1 kernels on NPU tensors). The per-head K_nope / V are split out of kv with one copy each
# (the attention kernels take [T, H, D] rows); they live only inside the call (recompute="kv" saves
# none of them). fp16/bf16 only, as the Cube kernels.
def _ascend_dtype(q, op):
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError(f"{op} on the Ascend path takes float16/bfloat16 inputs only (the Cube kernels "
                           f"accumulate in fp32); got {q.dtype}. Use the native or reference backend for fp32")


def _up_project(c_kv, w_kv_up):
    T = c_kv.shape[0]
    sizes = torch.full((1,), T, dtype=torch.int64, device=c_kv.device)
    return _library.op("grouped_gemm")(c_kv, w_kv_up.unsqueeze(0), sizes, True)


def _split(kv, H, Dn, Dv):
    kvh = kv.view(kv.shape[0], H, Dn + Dv)
    return kvh[..., :Dn].contiguous(), kvh[..., Dn:].contiguous()


def ascend_fwd(q, c_kv, k_pe, w_kv_up, cu_seqlens, max_seqlen, num_heads, qk_nope_dim, v_dim,
               softmax_scale, causal, save_kv):
    _ascend_dtype(q, OP)
    kv = _up_project(c_kv, w_kv_up)
    k_nope, v = _split(kv, num_heads, qk_nope_dim, v_dim)
    out, lse = _library.op("flash_attention_fwd")(q, k_nope, v, k_pe, cu_seqlens, max_seqlen, causal,
                                                  softmax_scale)
    return out, lse, (kv if save_kv else kv.new_empty((0,)))


def ascend_bwd(grad_out, q, c_kv, k_pe, w_kv_up, out, lse, kv, cu_seqlens, max_seqlen, num_heads,
               qk_nope_dim, v_dim, softmax_scale, causal):
    _ascend_dtype(q, BWD)
    if kv.numel() == 0:  # recompute="kv": the same kernel as the forward, so bitwise the same kv
        kv = _up_project(c_kv, w_kv_up)
    k_nope, v = _split(kv, num_heads, qk_nope_dim, v_dim)
    dq, dk_nope, dv, dk_pe = _library.op("flash_attention_bwd")(grad_out, q, k_nope, v, k_pe, out, lse,
                                                                cu_seqlens, max_seqlen, causal,
                                                                softmax_scale)
    T = c_kv.shape[0]
    dkv = torch.cat((dk_nope, dv), dim=-1).reshape(T, -1)
    sizes = torch.full((1,), T, dtype=torch.int64, device=c_kv.device)
    dc_kv = _library.op("grouped_gemm")(dkv, w_kv_up.unsqueeze(0), sizes, False)
    dw = _library.op("grouped_gemm_dw")(dkv, c_kv, sizes)[0]
    return dq, dc_kv, dk_pe, dw


def _check_fwd(q, c_kv, k_pe, w, cu_seqlens, max_seqlen, *rest):
    check_cu_seqlens(cu_seqlens, q.shape[0], max_seqlen)


def _check_bwd(grad_out, q, c_kv, k_pe, w, out, lse, kv, cu_seqlens, max_seqlen, *rest):
    check_cu_seqlens(cu_seqlens, q.shape[0], max_seqlen)


@torch.library.register_fake(f"{_library.NAMESPACE}::{OP}")
def _fake(q, c_kv, k_pe, w_kv_up, cu_seqlens, max_seqlen, num_heads, qk_nope_dim, v_dim,
          softmax_scale, causal, save_kv):
    T = q.shape[0]
    out = q.new_empty((T, num_heads, v_dim))
    lse = q.new_empty((num_heads, T), dtype=lse_dtype(q.dtype))
    kv = c_kv.new_empty((T, w_kv_up.shape[0]) if save_kv else (0,))
    return out, lse, kv


@torch.library.register_fake(f"{_library.NAMESPACE}::{BWD}")
def _fake_bwd(grad_out, q, c_kv, k_pe, w_kv_up, out, lse, kv, cu_seqlens, max_seqlen, num_heads,
              qk_nope_dim, v_dim, softmax_scale, causal):
    return (q.new_empty(q.shape), c_kv.new_empty(c_kv.shape), k_pe.new_empty(k_pe.shape),
            w_kv_up.new_empty(w_kv_up.shape))


def _setup_context(ctx, inputs, output):
    q, c_kv, k_pe, w, cu_seqlens, max_seqlen, H, Dn, Dv, scale, causal, save_kv = inputs
    out, lse, kv = output
    ctx.args = (max_seqlen, H, Dn, Dv, scale, causal)
    # recompute="kv": only q, the latent, k_pe, the weight, out and lse (kv has shape [0]);
    # recompute="none": also the up-projected K_nope/V (kv, H*(Dn+Dv) values per token)
    ctx.save_for_backward(q, c_kv, k_pe, w, out, lse, kv, cu_seqlens)
    ctx.mark_non_differentiable(lse, kv)


def _backward(ctx, grad_out, _grad_lse, _grad_kv):
    q, c_kv, k_pe, w, out, lse, kv, cu_seqlens = ctx.saved_tensors
    max_seqlen, H, Dn, Dv, scale, causal = ctx.args
    dq, dc, dkpe, dw = _library.op(BWD)(grad_out.contiguous(), q, c_kv, k_pe, w, out, lse, kv,
                                        cu_seqlens, max_seqlen, H, Dn, Dv, scale, causal)
    return dq, dc, dkpe, dw, None, None, None, None, None, None, None, None


torch.library.register_autograd(f"{_library.NAMESPACE}::{OP}", _backward, setup_context=_setup_context)
_library.register_router(OP, check=_check_fwd)
_library.register_router(BWD, check=_check_bwd)


def mla_attention(q: Tensor, c_kv: Tensor, k_pe: Tensor, w_kv_up: Tensor, *, num_heads: int,
                  qk_nope_dim: int, v_dim: int, softmax_scale: float, causal: bool = True,
                  cu_seqlens: Optional[Tensor] = None, max_seqlen: Optional[int] = None,
                  recompute: str = "kv") -> Tensor:
    """Multi-head latent attention (training): up-project the latent, attend, optionally
    recompute K and V in backward.

    ``kv = c_kv @ w_kv_up^T`` viewed ``[.., H, Dn + Dv]`` gives ``K_nope = kv[..., :Dn]`` and
    ``V = kv[..., Dn:]``; head ``h`` attends with key ``[K_nope_h | k_pe]`` (``k_pe`` is one rope
    key shared by every head, never expanded per head by the fast backends).

    Args:
        q: ``[B, S, H, Dn + Dr]`` (rope already applied to the last ``Dr`` dims) or packed
            ``[T, H, Dn + Dr]`` with ``cu_seqlens``; fp32/fp16/bf16.
        c_kv: latent ``[B, S, Dc]`` / ``[T, Dc]`` (after its norm), q's dtype.
        k_pe: shared rope key ``[B, S, Dr]`` / ``[T, Dr]`` (a singleton head dim is accepted).
        w_kv_up: up-projection weight ``[H * (Dn + Dv), Dc]`` (``nn.Linear`` layout, head-major:
            rows ``h*(Dn+Dv) : h*(Dn+Dv)+Dn`` give head ``h``'s K_nope, the next ``Dv`` its V).
        num_heads, qk_nope_dim, v_dim: ``H``, ``Dn``, ``Dv`` (128, 128, 128 in the real models).
        softmax_scale: required (YaRN changes it; DeepSeek-V3 uses 0.1352, not 192**-0.5).
        causal: causal mask within each sequence.
        cu_seqlens, max_seqlen: packed varlen layout, as in :func:`flash_attention`.
        recompute: ``"kv"`` (default, the Pangu Ultra MoE policy) saves only ``q``, ``c_kv``,
            ``k_pe``, ``w_kv_up``, the output and the fp32 LSE for backward and recomputes
            ``K_nope``/``V`` there; ``"none"`` also saves the up-projected ``kv``. Gradients are
            bitwise equal between the two.

    Returns:
        ``[B, S, H, Dv]`` / ``[T, H, Dv]`` in q's dtype. Gradients flow to ``q``, ``c_kv``,
        ``k_pe`` (summed over heads) and ``w_kv_up``.
    """
    _checks.check_tensor("q", q, dtypes=_checks.FLOAT_DTYPES)
    device, dtype = q.device, q.dtype
    for name, t in (("c_kv", c_kv), ("k_pe", k_pe), ("w_kv_up", w_kv_up)):
        _checks.check_tensor(name, t, dtypes=(dtype,), device=device)
    _checks.check_int("num_heads", num_heads, minimum=1)
    _checks.check_int("qk_nope_dim", qk_nope_dim, minimum=1)
    _checks.check_int("v_dim", v_dim, minimum=1)
    if recompute not in ("kv", "none"):
        raise ValueError(f"recompute must be 'kv' or 'none', got {recompute!r}")
    softmax_scale = _checks.check_float("softmax_scale", softmax_scale)
    if q.dim() not in (3, 4):
        raise ValueError(f"q must be [B, S, H, Dn+Dr] or packed [T, H, Dn+Dr], got shape {tuple(q.shape)}")
    if q.shape[-2] != num_heads:
        raise ValueError(f"q must have num_heads={num_heads} heads (dim -2), got shape {tuple(q.shape)}")
    rope_dim = q.shape[-1] - qk_nope_dim
    if rope_dim < 1:
        raise ValueError(f"q head dim {q.shape[-1]} must be qk_nope_dim={qk_nope_dim} + a rope dim >= 1")
    if v_dim > q.shape[-1]:
        raise ValueError(f"v_dim={v_dim} > d_qk={q.shape[-1]} is not supported (d_qk >= d_v is required)")
    tok = tuple(q.shape[:-2])
    if k_pe.dim() == q.dim() and k_pe.shape[-2] == 1:
        k_pe = k_pe.squeeze(-2)
    if c_kv.dim() != len(tok) + 1 or tuple(c_kv.shape[:-1]) != tok:
        raise ValueError(f"c_kv must have shape {tok} + (Dc,) (the tokens of q, then the latent dim), "
                         f"got {tuple(c_kv.shape)}")
    _checks.check_shape("k_pe", k_pe, tok + (rope_dim,), f"tokens of q, rope dim = q head dim - qk_nope_dim")
    latent = c_kv.shape[-1]
    _checks.check_shape("w_kv_up", w_kv_up, (num_heads * (qk_nope_dim + v_dim), latent),
                        "[num_heads*(qk_nope_dim+v_dim), latent dim]")
    cu, max_len, batch = pack_layout("q", q, cu_seqlens, max_seqlen, len(tok))
    qp = q.reshape(-1, num_heads, q.shape[-1]).contiguous()
    out, _, _ = _library.op(OP)(qp, c_kv.reshape(-1, latent).contiguous(),
                                k_pe.reshape(-1, rope_dim).contiguous(), w_kv_up.contiguous(), cu,
                                max_len, num_heads, qk_nope_dim, v_dim, softmax_scale,
                                bool(causal), recompute == "none")
    if batch is not None:
        out = out.view(*batch, num_heads, v_dim)
    return out
