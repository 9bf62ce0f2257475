"""``mla_attention``: multi-head latent attention for training (DeepSeek-V3 / Pangu Ultra MoE),
with the KV-only recompute memory policy."""

from __future__ import annotations

from typing import Optional

import torch

from .. import _library
from . import _contracts, checks
from .flash_attention import pack_layout

OP = "mla_attention_fwd"
BWD = "mla_attention_bwd"
Tensor = torch.Tensor
__all__ = ["mla_attention"]


# ----------------------------------------------------------------------------- Ascend composition
# MLA on the Ascend kernels: the up-projection kv = c_kv . w_kv_up^T and its two gradients are the
# grouped GEMM Cube kernels with one group (grouped_gemm, grouped_gemm_dw), the attention is the
# AscendC flash attention with k_pe as the shared rope key (never expanded per head). The kernels are
# those of one namespace: ascend_moe_ops_emu (the emulated kernels, on CPU tensors) or, on an NPU,
# the public ascend_moe_ops (PrivateUse1 kernels; ascend_moe_ops._npu). The per-head K_nope / V are
# split out of kv with one copy each (the attention kernels take [T, H, D] rows); they live only
# inside the call (recompute="kv" saves none of them). fp16/bf16 only, as the Cube kernels.
def _ascend_dtype(q, op):
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"{op}: q must have dtype in (float16, bfloat16) on the Ascend path (the Cube kernels "
                        f"take fp16/bf16 and accumulate in fp32), got {str(q.dtype).replace('torch.', '')}; use the "
                        "native or reference backend for float32/float64")


def _ascend_sizes(c_kv, w_kv_up, op):
    """The up-projection is a grouped GEMM on the Cube kernels, whose copy strides are 16-bit: the
    latent dim and the rows of ``w_kv_up`` (``num_heads * (qk_nope_dim + v_dim)``) must be < 65536.
    Said here in MLA's terms (the GEMM's own check would name its x and weight)."""
    rows, dc = w_kv_up.shape
    if rows >= 65536 or dc >= 65536:
        raise ValueError(f"{op}: w_kv_up has shape {tuple(w_kv_up.shape)} (num_heads * (qk_nope_dim + v_dim), latent "
                         "dim); the Ascend path needs both < 65536 (16-bit copy strides of the Cube kernels)")


def _split(kv, H, Dn, Dv):
    kvh = kv.view(kv.shape[0], H, Dn + Dv)
    return kvh[..., :Dn].contiguous(), kvh[..., Dn:].contiguous()


def ascend_kernels(ns: str):
    """``(fwd, bwd)`` kernels of MLA composed of namespace ``ns``'s AscendC kernels (after the
    op-boundary check, as every kernel)."""
    ops = _library.ops_of(ns)

    def up_project(c_kv, w_kv_up):
        sizes = torch.full((1,), c_kv.shape[0], dtype=torch.int64, device=c_kv.device)
        return ops("grouped_gemm")(c_kv, w_kv_up.unsqueeze(0), sizes, True)

    def fwd(q, c_kv, k_pe, w_kv_up, cu_seqlens, max_seqlen, num_heads, qk_nope_dim, v_dim,
            softmax_scale, causal, save_kv):
        _contracts.mla_attention_fwd(q, c_kv, k_pe, w_kv_up, cu_seqlens, max_seqlen, num_heads,
                                     qk_nope_dim, v_dim, softmax_scale, causal, save_kv)
        _ascend_dtype(q, OP)
        _ascend_sizes(c_kv, w_kv_up, OP)
        # a composite is the op's whole kernel (python_kernel adds nothing to it): the op's own
        # empty case (T = 0) here, as every other kernel does after its check
        empty = _empty(q, c_kv, k_pe, w_kv_up, cu_seqlens, max_seqlen, num_heads, qk_nope_dim, v_dim,
                       softmax_scale, causal, save_kv)
        if empty is not None:
            return empty
        kv = up_project(c_kv, w_kv_up)
        k_nope, v = _split(kv, num_heads, qk_nope_dim, v_dim)
        # Sq = Sk and Hkv = Hq: the one cu_seqlens passed for q and k alike
        out, lse = ops("flash_attention_fwd")(q, k_nope, v, k_pe, cu_seqlens, cu_seqlens, max_seqlen,
                                              max_seqlen, causal, softmax_scale)
        return out, lse, (kv if save_kv else kv.new_empty((0,)))

    def bwd(grad_out, q, c_kv, k_pe, w_kv_up, out, lse, kv, cu_seqlens, max_seqlen, num_heads,
            qk_nope_dim, v_dim, softmax_scale, causal):
        _contracts.mla_attention_bwd(grad_out, q, c_kv, k_pe, w_kv_up, out, lse, kv, cu_seqlens,
                                     max_seqlen, num_heads, qk_nope_dim, v_dim, softmax_scale, causal)
        _ascend_dtype(q, BWD)
        _ascend_sizes(c_kv, w_kv_up, BWD)
        empty = _empty_bwd(grad_out, q, c_kv, k_pe, w_kv_up)   # T = 0: zero gradients
        if empty is not None:
            return empty
        if kv.numel() == 0:  # recompute="kv": the same kernel as the forward, so bitwise the same kv
            kv = up_project(c_kv, w_kv_up)
        k_nope, v = _split(kv, num_heads, qk_nope_dim, v_dim)
        dq, dk_nope, dv, dk_pe = ops("flash_attention_bwd")(grad_out, q, k_nope, v, k_pe, out, lse,
                                                            cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                                            causal, softmax_scale)
        T = c_kv.shape[0]
        dkv = torch.cat((dk_nope, dv), dim=-1).reshape(T, -1)
        sizes = torch.full((1,), T, dtype=torch.int64, device=c_kv.device)
        dc_kv = ops("grouped_gemm")(dkv, w_kv_up.unsqueeze(0), sizes, False)
        dw = ops("grouped_gemm_dw")(dkv, c_kv, sizes)[0]
        return dq, dc_kv, dk_pe, dw

    return fwd, bwd




def _fake(q, c_kv, k_pe, w_kv_up, cu_seqlens, max_seqlen, num_heads, qk_nope_dim, v_dim,
          softmax_scale, causal, save_kv):
    T = q.shape[0]
    out = q.new_empty((T, num_heads, v_dim))
    lse = q.new_empty((num_heads, T), dtype=_contracts.lse_dtype(q.dtype))
    kv = c_kv.new_empty((T, w_kv_up.shape[0]) if save_kv else (0,))
    return out, lse, kv


def _fake_bwd(grad_out, q, c_kv, k_pe, w_kv_up, out, lse, kv, cu_seqlens, max_seqlen, num_heads,
              qk_nope_dim, v_dim, softmax_scale, causal):
    return (q.new_empty(q.shape), c_kv.new_empty(c_kv.shape), k_pe.new_empty(k_pe.shape),
            w_kv_up.new_empty(w_kv_up.shape))


def _empty(q, c_kv, k_pe, w_kv_up, cu_seqlens, max_seqlen, num_heads, qk_nope_dim, v_dim,
           softmax_scale, causal, save_kv):
    """T = 0 (B = 0 too): valid, empty results (as the C++ kernels)."""
    if q.shape[0]:
        return None
    return (q.new_zeros((0, num_heads, v_dim)),
            q.new_empty((num_heads, 0), dtype=_contracts.lse_dtype(q.dtype)),
            q.new_empty((0, w_kv_up.shape[0]) if save_kv else (0,)))


def _empty_bwd(grad_out, q, c_kv, k_pe, w_kv_up, *rest):
    if q.shape[0]:
        return None
    return tuple(torch.zeros_like(t) for t in (q, c_kv, k_pe, w_kv_up))


def _setup_context(ctx, inputs, output):
    q, c_kv, k_pe, w, cu_seqlens, max_seqlen, H, Dn, Dv, scale, causal, save_kv = inputs
    out, lse, kv = output
    ctx.args = (max_seqlen, H, Dn, Dv, scale, causal)
    # recompute="kv": only q, the latent, k_pe, the weight, out and lse (kv has shape [0]);
    # recompute="none": also the up-projected K_nope/V (kv, H*(Dn+Dv) values per token)
    ctx.save_for_backward(q, c_kv, k_pe, w, out, lse, kv, cu_seqlens)
    ctx.mark_non_differentiable(lse, kv)


def _backward(ops, ctx, grad_out, _grad_lse, _grad_kv):
    q, c_kv, k_pe, w, out, lse, kv, cu_seqlens = ctx.saved_tensors
    max_seqlen, H, Dn, Dv, scale, causal = ctx.args
    dq, dc, dkpe, dw = ops(BWD)(grad_out.contiguous(), q, c_kv, k_pe, w, out, lse, kv, cu_seqlens,
                                max_seqlen, H, Dn, Dv, scale, causal)
    return dq, dc, dkpe, dw, None, None, None, None, None, None, None, None


_library.define(_library.OpSpec(
    # (q [T,H,Dn+Dr], c_kv [T,Dc], k_pe [T,Dr], w_kv_up [H*(Dn+Dv),Dc], cu_seqlens [B+1], max_seqlen,
    # num_heads H, qk_nope_dim Dn, v_dim Dv, softmax_scale, causal, save_kv) -> (out [T,H,Dv],
    # lse [H,T] fp32, kv [T,H*(Dn+Dv)] the up-projected latent when save_kv (recompute="none"), else
    # shape [0])
    OP, "(Tensor q, Tensor c_kv, Tensor k_pe, Tensor w_kv_up, Tensor cu_seqlens, int max_seqlen, "
        "int num_heads, int qk_nope_dim, int v_dim, float softmax_scale, bool causal, bool save_kv) "
        "-> (Tensor, Tensor, Tensor)",
    fake=_fake, check_meta=_contracts.mla_attention_fwd_meta, check=_contracts.mla_attention_fwd,
    backward=_backward, setup_context=_setup_context, empty=_empty,
    composite={_library.ASCENDC_EMU.name: lambda ns: ascend_kernels(ns)[0]}), __name__)
_library.define(_library.OpSpec(
    # (grad_out [T,H,Dv], q, c_kv, k_pe, w_kv_up, out, lse, kv ([0] = recompute it from c_kv and
    # w_kv_up), cu_seqlens, max_seqlen, num_heads, qk_nope_dim, v_dim, softmax_scale, causal) ->
    # (dq [T,H,Dn+Dr], dc_kv [T,Dc], dk_pe [T,Dr] (summed over heads), dw_kv_up [H*(Dn+Dv),Dc])
    BWD, "(Tensor grad_out, Tensor q, Tensor c_kv, Tensor k_pe, Tensor w_kv_up, Tensor out, Tensor lse, "
         "Tensor kv, Tensor cu_seqlens, int max_seqlen, int num_heads, int qk_nope_dim, int v_dim, "
         "float softmax_scale, bool causal) -> (Tensor, Tensor, Tensor, Tensor)",
    fake=_fake_bwd, check_meta=_contracts.mla_attention_bwd_meta, check=_contracts.mla_attention_bwd,
    empty=_empty_bwd, composite={_library.ASCENDC_EMU.name: lambda ns: ascend_kernels(ns)[1]},
    backward_of=OP), __name__)


def mla_attention(q: Tensor, c_kv: Tensor, k_pe: Tensor, w_kv_up: Tensor, *, num_heads: int,
                  qk_nope_dim: int, v_dim: int, softmax_scale: float, causal: bool = False,
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
        causal: causal mask within each sequence. Default ``False`` (as flash-attention, SDPA and
            FlashMLA; changed from ``True``: docs/design.md, Changes).
        cu_seqlens, max_seqlen: packed varlen layout, as in :func:`flash_attention`.
        recompute: ``"kv"`` (default, the Pangu Ultra MoE policy) saves only ``q``, ``c_kv``,
            ``k_pe``, ``w_kv_up``, the output and the fp32 LSE for backward and recomputes
            ``K_nope``/``V`` there; ``"none"`` also saves the up-projected ``kv``. Gradients are
            bitwise equal between the two.

    Returns:
        ``[B, S, H, Dv]`` / ``[T, H, Dv]`` in q's dtype. Gradients flow to ``q``, ``c_kv``,
        ``k_pe`` (summed over heads) and ``w_kv_up``.
    """
    for name, t in (("q", q), ("c_kv", c_kv), ("k_pe", k_pe), ("w_kv_up", w_kv_up)):
        checks.check_tensor(name, t)
    for name, val in (("num_heads", num_heads), ("qk_nope_dim", qk_nope_dim), ("v_dim", v_dim)):
        checks.check_int(name, val)
    if recompute not in ("kv", "none"):
        raise ValueError(f"recompute must be 'kv' or 'none', got {recompute!r}")
    checks.check_bool("causal", causal)
    softmax_scale = checks.check_float("softmax_scale", softmax_scale)
    # layout only (what packing needs); heads, dims, dtypes and devices are checked at the op
    if q.dim() not in (3, 4):
        raise ValueError(f"q must be [B, S, H, Dn+Dr] or packed [T, H, Dn+Dr], got shape {tuple(q.shape)}")
    if v_dim > q.shape[-1]:  # the API's rule (the kernels of every backend compute it)
        raise ValueError(f"v_dim={v_dim} > d_qk={q.shape[-1]} is not supported (d_qk >= d_v is required)")
    tok = tuple(q.shape[:-2])
    if k_pe.dim() == q.dim() and k_pe.shape[-2] == 1:
        k_pe = k_pe.squeeze(-2)
    for name, t, what in (("c_kv", c_kv, "Dc"), ("k_pe", k_pe, "Dr")):
        if t.dim() != len(tok) + 1 or tuple(t.shape[:-1]) != tok:
            raise ValueError(f"{name} must have shape {tok} + ({what},) (the tokens of q, then its last "
                             f"dim), got {tuple(t.shape)}")
    cu, max_len, batch = pack_layout("q", q, cu_seqlens, max_seqlen, len(tok))
    T = q.shape[0] * q.shape[1] if batch is not None else q.shape[0]
    qp = q.reshape(T, q.shape[-2], q.shape[-1]).contiguous()
    out, _, _ = _library.op(OP)(qp, c_kv.reshape(T, c_kv.shape[-1]).contiguous(),
                                k_pe.reshape(T, k_pe.shape[-1]).contiguous(), w_kv_up.contiguous(), cu,
                                max_len, num_heads, qk_nope_dim, v_dim, softmax_scale, causal,
                                recompute == "none")
    if batch is not None:
        out = out.view(*batch, num_heads, v_dim)
    return out
