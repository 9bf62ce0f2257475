"""Triton flash attention, forward and backward, for ``d_qk >= d_v`` without padding 192 to 256.

The score of a (query, key) pair is computed as two dot products: the first ``D1`` dims of q
against the per-head key, and the remaining ``D2`` dims against a second key part. For MLA that
second part is the shared rope key ``k_rope`` (head stride 0: one head for all heads); for plain
192-dim attention it is columns ``128:192`` of ``k`` itself (``D1`` = largest power of two below
``d_qk``). Each part is padded only to its own power of two (128 + 64 here, not 256).

Grid: (query or key blocks of the longest sequence, sequences, heads); packed varlen via
``cu_seqlens``; causal runs stop at the diagonal. The backward is two kernels (dK/dV over key
blocks, dQ over query blocks), so every output element has one writer (no atomics,
deterministic); the rope-key gradient is written per head in fp32 and summed over heads here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ascend_moe_ops.ops._contracts import attention_features
from ascend_moe_ops.reference.flash_attention import lse_dtype


@triton.jit
def _fwd_kernel(Q, K, K2, V, O, LSE, CU, sm_scale,
                s_qt, s_qh, s_kt, s_kh, s_k2t, s_k2h, s_vt, s_vh, s_ot, s_oh, T,
                D1, D2, DV,
                CAUSAL: tl.constexpr, HAS_D2: tl.constexpr, PREC: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BD1: tl.constexpr, BD2: tl.constexpr, BDV: tl.constexpr):
    pid_m = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    start = tl.load(CU + b).to(tl.int64)
    L = tl.load(CU + b + 1).to(tl.int64) - start
    m0 = pid_m * BLOCK_M
    if m0 < L:
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        d1 = tl.arange(0, BD1)
        d2 = tl.arange(0, BD2)
        dv = tl.arange(0, BDV)
        mmask = offs_m < L
        rows = (start + offs_m)[:, None]
        q1 = tl.load(Q + rows * s_qt + h * s_qh + d1[None, :], mask=mmask[:, None] & (d1[None, :] < D1), other=0.0)
        if HAS_D2:
            q2 = tl.load(Q + rows * s_qt + h * s_qh + D1 + d2[None, :], mask=mmask[:, None] & (d2[None, :] < D2), other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BDV], tl.float32)
        hi = L
        if CAUSAL:
            hi = tl.minimum(L, m0 + BLOCK_M)
        for n0 in range(0, hi, BLOCK_N):
            kn = n0 + offs_n
            nmask = kn < hi
            kcols = (start + kn)[None, :]
            k1 = tl.load(K + kcols * s_kt + h * s_kh + d1[:, None], mask=nmask[None, :] & (d1[:, None] < D1), other=0.0)
            s = tl.dot(q1, k1, input_precision=PREC)
            if HAS_D2:
                k2 = tl.load(K2 + kcols * s_k2t + h * s_k2h + d2[:, None], mask=nmask[None, :] & (d2[:, None] < D2), other=0.0)
                s += tl.dot(q2, k2, input_precision=PREC)
            s = s * sm_scale
            valid = nmask[None, :]
            if CAUSAL:
                valid = valid & (kn[None, :] <= offs_m[:, None])
            s = tl.where(valid, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            vv = tl.load(V + (start + kn)[:, None] * s_vt + h * s_vh + dv[None, :], mask=nmask[:, None] & (dv[None, :] < DV), other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(vv.dtype), vv, input_precision=PREC)
            m_i = m_new
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        out = acc / l_safe[:, None]
        tl.store(O + rows * s_ot + h * s_oh + dv[None, :], out.to(O.dtype.element_ty), mask=mmask[:, None] & (dv[None, :] < DV))
        lse = tl.where(l_i > 0, m_i + tl.log(l_safe), float("-inf"))
        tl.store(LSE + h * T + start + offs_m, lse, mask=mmask)


@triton.jit
def _one_key_rows(qm, L, CAUSAL: tl.constexpr):
    """Query rows (positions ``qm`` of a length-``L`` sequence) that see exactly one key: the first
    query of a causal sequence, or any query of a one-token sequence. Their score gradient is
    set to exactly zero, so they add nothing to dQ and dK."""
    if CAUSAL:
        return qm == 0
    return (qm >= 0) & (L == 1)


@triton.jit
def _bwd_dkdv_kernel(Q, K, K2, V, DO, LSE, DELTA, DK, DK2, DV_, CU, sm_scale,
                     s_qt, s_qh, s_kt, s_kh, s_k2t, s_k2h, s_vt, s_vh, s_dot, s_doh,
                     s_dkt, s_dkh, s_dk2t, s_dk2h, s_dvt, s_dvh, T,
                     D1, D2, DV,
                     CAUSAL: tl.constexpr, HAS_D2: tl.constexpr, PREC: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BD1: tl.constexpr, BD2: tl.constexpr, BDV: tl.constexpr):
    pid_n = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    start = tl.load(CU + b).to(tl.int64)
    L = tl.load(CU + b + 1).to(tl.int64) - start
    n0 = pid_n * BLOCK_N
    if n0 < L:
        offs_n = n0 + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        d1 = tl.arange(0, BD1)
        d2 = tl.arange(0, BD2)
        dv = tl.arange(0, BDV)
        nmask = offs_n < L
        krows = (start + offs_n)[:, None]
        k1 = tl.load(K + krows * s_kt + h * s_kh + d1[None, :], mask=nmask[:, None] & (d1[None, :] < D1), other=0.0)
        vv = tl.load(V + krows * s_vt + h * s_vh + dv[None, :], mask=nmask[:, None] & (dv[None, :] < DV), other=0.0)
        dk1 = tl.zeros([BLOCK_N, BD1], tl.float32)
        dvacc = tl.zeros([BLOCK_N, BDV], tl.float32)
        if HAS_D2:
            k2 = tl.load(K2 + krows * s_k2t + h * s_k2h + d2[None, :], mask=nmask[:, None] & (d2[None, :] < D2), other=0.0)
            dk2 = tl.zeros([BLOCK_N, BD2], tl.float32)
        lo = 0
        if CAUSAL:
            lo = (n0 // BLOCK_M) * BLOCK_M
        for m0 in range(lo, L, BLOCK_M):
            qm = m0 + offs_m
            mmask = qm < L
            qrows = (start + qm)[:, None]
            q1 = tl.load(Q + qrows * s_qt + h * s_qh + d1[None, :], mask=mmask[:, None] & (d1[None, :] < D1), other=0.0)
            s = tl.dot(q1, tl.trans(k1), input_precision=PREC)
            if HAS_D2:
                q2 = tl.load(Q + qrows * s_qt + h * s_qh + D1 + d2[None, :], mask=mmask[:, None] & (d2[None, :] < D2), other=0.0)
                s += tl.dot(q2, tl.trans(k2), input_precision=PREC)
            lse = tl.load(LSE + h * T + start + qm, mask=mmask, other=0.0)
            delta = tl.load(DELTA + h * T + start + qm, mask=mmask, other=0.0)
            valid = mmask[:, None] & nmask[None, :]
            if CAUSAL:
                valid = valid & (offs_n[None, :] <= qm[:, None])
            p = tl.where(valid, tl.exp(s * sm_scale - lse[:, None]), 0.0)
            do = tl.load(DO + qrows * s_dot + h * s_doh + dv[None, :], mask=mmask[:, None] & (dv[None, :] < DV), other=0.0)
            dvacc += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PREC)
            dp = tl.dot(do, tl.trans(vv), input_precision=PREC)
            ds = p * (dp - delta[:, None]) * sm_scale
            # a query that sees one key only has dS = 0 exactly (P = 1, dP = delta in exact
            # arithmetic; computed they differ in the last bits): see _one_key_rows
            ds = tl.where(_one_key_rows(qm, L, CAUSAL)[:, None], 0.0, ds).to(q1.dtype)
            dk1 += tl.dot(tl.trans(ds), q1, input_precision=PREC)
            if HAS_D2:
                dk2 += tl.dot(tl.trans(ds), q2, input_precision=PREC)
        tl.store(DK + krows * s_dkt + h * s_dkh + d1[None, :], dk1.to(DK.dtype.element_ty), mask=nmask[:, None] & (d1[None, :] < D1))
        tl.store(DV_ + krows * s_dvt + h * s_dvh + dv[None, :], dvacc.to(DV_.dtype.element_ty), mask=nmask[:, None] & (dv[None, :] < DV))
        if HAS_D2:
            tl.store(DK2 + krows * s_dk2t + h * s_dk2h + d2[None, :], dk2.to(DK2.dtype.element_ty), mask=nmask[:, None] & (d2[None, :] < D2))


@triton.jit
def _bwd_dq_kernel(Q, K, K2, V, DO, LSE, DELTA, DQ, CU, sm_scale,
                   s_qt, s_qh, s_kt, s_kh, s_k2t, s_k2h, s_vt, s_vh, s_dot, s_doh, s_dqt, s_dqh, T,
                   D1, D2, DV,
                   CAUSAL: tl.constexpr, HAS_D2: tl.constexpr, PREC: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BD1: tl.constexpr, BD2: tl.constexpr, BDV: tl.constexpr):
    pid_m = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    start = tl.load(CU + b).to(tl.int64)
    L = tl.load(CU + b + 1).to(tl.int64) - start
    m0 = pid_m * BLOCK_M
    if m0 < L:
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        d1 = tl.arange(0, BD1)
        d2 = tl.arange(0, BD2)
        dv = tl.arange(0, BDV)
        mmask = offs_m < L
        qrows = (start + offs_m)[:, None]
        q1 = tl.load(Q + qrows * s_qt + h * s_qh + d1[None, :], mask=mmask[:, None] & (d1[None, :] < D1), other=0.0)
        if HAS_D2:
            q2 = tl.load(Q + qrows * s_qt + h * s_qh + D1 + d2[None, :], mask=mmask[:, None] & (d2[None, :] < D2), other=0.0)
            dq2 = tl.zeros([BLOCK_M, BD2], tl.float32)
        do = tl.load(DO + qrows * s_dot + h * s_doh + dv[None, :], mask=mmask[:, None] & (dv[None, :] < DV), other=0.0)
        lse = tl.load(LSE + h * T + start + offs_m, mask=mmask, other=0.0)
        delta = tl.load(DELTA + h * T + start + offs_m, mask=mmask, other=0.0)
        dq1 = tl.zeros([BLOCK_M, BD1], tl.float32)
        hi = L
        if CAUSAL:
            hi = tl.minimum(L, m0 + BLOCK_M)
        for n0 in range(0, hi, BLOCK_N):
            kn = n0 + offs_n
            nmask = kn < hi
            krows = (start + kn)[:, None]
            k1 = tl.load(K + krows * s_kt + h * s_kh + d1[None, :], mask=nmask[:, None] & (d1[None, :] < D1), other=0.0)
            s = tl.dot(q1, tl.trans(k1), input_precision=PREC)
            if HAS_D2:
                k2 = tl.load(K2 + krows * s_k2t + h * s_k2h + d2[None, :], mask=nmask[:, None] & (d2[None, :] < D2), other=0.0)
                s += tl.dot(q2, tl.trans(k2), input_precision=PREC)
            valid = mmask[:, None] & nmask[None, :]
            if CAUSAL:
                valid = valid & (kn[None, :] <= offs_m[:, None])
            p = tl.where(valid, tl.exp(s * sm_scale - lse[:, None]), 0.0)
            vv = tl.load(V + krows * s_vt + h * s_vh + dv[None, :], mask=nmask[:, None] & (dv[None, :] < DV), other=0.0)
            dp = tl.dot(do, tl.trans(vv), input_precision=PREC)
            ds = p * (dp - delta[:, None]) * sm_scale
            ds = tl.where(_one_key_rows(offs_m, L, CAUSAL)[:, None], 0.0, ds).to(k1.dtype)
            dq1 += tl.dot(ds, k1, input_precision=PREC)
            if HAS_D2:
                dq2 += tl.dot(ds, k2, input_precision=PREC)
        tl.store(DQ + qrows * s_dqt + h * s_dqh + d1[None, :], dq1.to(DQ.dtype.element_ty), mask=mmask[:, None] & (d1[None, :] < D1))
        if HAS_D2:
            tl.store(DQ + qrows * s_dqt + h * s_dqh + D1 + d2[None, :], dq2.to(DQ.dtype.element_ty), mask=mmask[:, None] & (d2[None, :] < D2))


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(max(int(n), 1)))


def _split(dq: int, k, k_rope):
    """(D1, D2, second key part tensor, its head stride): see the module docstring."""
    if k_rope is not None:
        return k.shape[-1], k_rope.shape[-1], k_rope, 0
    d1 = 1 << (dq.bit_length() - 1)
    if d1 == dq:
        return dq, 0, k, k.stride(1)
    return d1, dq - d1, k[..., d1:], k.stride(1)


def _config(q, max_seqlen):
    on_gpu = q.device.type == "cuda"
    block = 64 if on_gpu else 16
    if on_gpu and max_seqlen <= 16:
        block = 16
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    return block, block, prec


def _dims(q, k, v, k_rope):
    D1, D2, k2, k2h = _split(q.shape[-1], k, k_rope)
    return D1, D2, k2, k2h, _pow2(D1), _pow2(D2), _pow2(v.shape[-1])


# The schema's cu_seqlens_q / cu_seqlens_k pair: these kernels take one cu_seqlens for q and k alike and
# the same heads for both, so seqlen_q != seqlen_k and GQA/MQA raise NotImplementedError.
def flash_attention_fwd(q, k, v, k_rope, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                        softmax_scale):
    attention_features("flash_attention_fwd", "Triton", q, k, cu_seqlens_q, cu_seqlens_k)
    cu_seqlens, max_seqlen = cu_seqlens_q, max(max_seqlen_q, max_seqlen_k)
    T, H, _ = q.shape
    Dv = v.shape[-1]
    B = cu_seqlens.shape[0] - 1
    D1, D2, k2, k2h, BD1, BD2, BDV = _dims(q, k, v, k_rope)
    out = torch.zeros((T, H, Dv), dtype=q.dtype, device=q.device)
    lse = torch.full((H, T), float("-inf"), dtype=lse_dtype(q.dtype), device=q.device)
    BM, BN, prec = _config(q, max_seqlen)
    if T == 0 or max_seqlen == 0:
        return out, lse
    grid = (triton.cdiv(max_seqlen, BM), B, H)
    _fwd_kernel[grid](q, k, k2, v, out, lse, cu_seqlens, float(softmax_scale),
                      q.stride(0), q.stride(1), k.stride(0), k.stride(1), k2.stride(0), k2h,
                      v.stride(0), v.stride(1), out.stride(0), out.stride(1), T,
                      D1, D2, Dv, CAUSAL=bool(causal), HAS_D2=D2 > 0, PREC=prec,
                      BLOCK_M=BM, BLOCK_N=BN, BD1=BD1, BD2=BD2, BDV=BDV)
    return out, lse


def flash_attention_bwd(grad_out, q, k, v, k_rope, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                        max_seqlen_k, causal, softmax_scale):
    attention_features("flash_attention_bwd", "Triton", q, k, cu_seqlens_q, cu_seqlens_k)
    cu_seqlens, max_seqlen = cu_seqlens_q, max(max_seqlen_q, max_seqlen_k)
    T, H, Dq = q.shape
    Dv = v.shape[-1]
    B = cu_seqlens.shape[0] - 1
    D1, D2, k2, k2h, BD1, BD2, BDV = _dims(q, k, v, k_rope)
    dq = torch.zeros_like(q)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    if k_rope is not None:
        dk2 = torch.zeros((H, T, D2), dtype=torch.float32, device=q.device)  # per head, summed below
        s_dk2t, s_dk2h = dk2.stride(1), dk2.stride(0)
    else:
        dk2 = dk[..., D1:] if D2 else dk
        s_dk2t, s_dk2h = dk.stride(0), dk.stride(1)
    BM, BN, prec = _config(q, max_seqlen)
    if T > 0 and max_seqlen > 0:
        delta = (grad_out.float() * out.float()).sum(-1).t().contiguous()  # [H, T]
        lse = lse.float().contiguous()
        common = dict(CAUSAL=bool(causal), HAS_D2=D2 > 0, PREC=prec, BLOCK_M=BM, BLOCK_N=BN,
                      BD1=BD1, BD2=BD2, BDV=BDV)
        _bwd_dkdv_kernel[(triton.cdiv(max_seqlen, BN), B, H)](
            q, k, k2, v, grad_out, lse, delta, dk, dk2, dv, cu_seqlens, float(softmax_scale),
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), k2.stride(0), k2h,
            v.stride(0), v.stride(1), grad_out.stride(0), grad_out.stride(1),
            dk.stride(0), dk.stride(1), s_dk2t, s_dk2h, dv.stride(0), dv.stride(1), T,
            D1, D2, Dv, **common)
        _bwd_dq_kernel[(triton.cdiv(max_seqlen, BM), B, H)](
            q, k, k2, v, grad_out, lse, delta, dq, cu_seqlens, float(softmax_scale),
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), k2.stride(0), k2h,
            v.stride(0), v.stride(1), grad_out.stride(0), grad_out.stride(1),
            dq.stride(0), dq.stride(1), T, D1, D2, Dv, **common)
    if k_rope is None:
        return dq, dk, dv, q.new_zeros((0,))
    dkr = dk2[0].clone()
    for h in range(1, H):  # fixed head order: deterministic
        dkr += dk2[h]
    return dq, dk, dv, dkr.to(q.dtype)
