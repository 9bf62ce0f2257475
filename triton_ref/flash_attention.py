"""Triton flash attention, forward and backward: packed varlen with separate query and key lengths
(causal aligned bottom-right), GQA/MQA, ``d_v`` independent of ``d_qk``, and 192-dim heads
without padding 192 to 256.

Shapes: q ``[Tq, Hq, Dqk]``, k ``[Tk, Hkv, Dk]``, v ``[Tk, Hkv, Dv]``, optional k_rope ``[Tk, Dr]``;
sequence ``b`` is query rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` (length Lq) and key rows
``cu_seqlens_k[b]:cu_seqlens_k[b+1]`` (length Lk). Query head ``h`` reads kv head
``h // (Hq // Hkv)``. With ``causal`` query ``i`` sees keys ``j <= i + Lk - Lq`` (flash-attention
>= 2.1's bottom-right alignment); a query that sees no key (``i + Lk - Lq < 0``, or ``Lk = 0``)
gets out = 0, lse = -inf and zero gradients.

The score of a (query, key) pair is computed as two dot products: the first ``D1`` dims of q
against the per-head key, and the remaining ``D2`` dims against a second key part. For MLA that
second part is the shared rope key ``k_rope`` (head stride 0: one head for all heads); for plain
192-dim attention it is columns ``128:192`` of ``k`` itself (``D1`` = largest power of two below
``d_qk``). Each part is padded only to its own power of two (128 + 64 here, not 256); ``d_v`` has
its own block (``d_v > d_qk`` is just a wider output tile).

Grid: (query or key blocks of the longest sequence, sequences, heads). Causal runs stop at the
(shifted) diagonal. The backward is two kernels, so every output element has one writer (no
atomics, deterministic): dK/dV over key blocks of one kv head, looping over the ``Hq // Hkv``
query heads of its group (the GQA sum is a loop in a fixed order), and dQ over query blocks of
one query head. The rope-key gradient is written per kv head and summed over heads here.
Accumulation is fp32 (fp64 for fp64 inputs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ascend_moe_ops.reference.flash_attention import lse_dtype

from ._utils import bf16_dot_in_interpreter, to_fp32


@triton.jit
def _seq(CUQ, CUK, b):
    """(first query row, query length, first key row, key length) of sequence ``b``."""
    sq = tl.load(CUQ + b).to(tl.int64)
    sk = tl.load(CUK + b).to(tl.int64)
    return sq, tl.load(CUQ + b + 1).to(tl.int64) - sq, sk, tl.load(CUK + b + 1).to(tl.int64) - sk


@triton.jit
def _load(P, t, s_t, off, d, tmask, ND):
    """The tile ``P[t * s_t + off + d]`` (``t``: token rows, ``d``: head-dim columns, broadcast
    against each other, either way round), 0 where ``tmask`` is false or ``d >= ND``."""
    return tl.load(P + t * s_t + off + d, mask=tmask & (d < ND), other=0.0)


@triton.jit
def _store(P, t, s_t, off, d, tmask, ND, x):
    """Store ``x`` (cast to ``P``'s dtype) into the tile of :func:`_load`."""
    tl.store(P + t * s_t + off + d, x.to(P.dtype.element_ty), mask=tmask & (d < ND))


@triton.jit
def _key_end(m0, Lq, Lk, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr):
    """One past the last key the query block at ``m0`` sees: with causal the block's last query
    sees keys up to ``m0 + BLOCK_M - 1 + Lk - Lq``."""
    hi = Lk
    if CAUSAL:
        hi = tl.maximum(tl.minimum(Lk, m0 + BLOCK_M + Lk - Lq), 0)
    return hi


@triton.jit
def _visible(valid, qm, kn, Lq, Lk, CAUSAL: tl.constexpr):
    """``valid`` ([queries, keys]) and, with causal, key ``kn <= qm + Lk - Lq`` (bottom-right)."""
    if CAUSAL:
        valid = valid & (kn[None, :] <= qm[:, None] + (Lk - Lq))
    return valid


@triton.jit
def _query_block(CUQ, CUK, GROUP, BLOCK_M: tl.constexpr):
    """The query block of a forward or dQ program (grid: query blocks, sequences, query heads):
    ``(h, kv head, sq, Lq, sk, Lk, m0, query positions, their mask, their rows)``."""
    h = tl.program_id(2)
    sq, Lq, sk, Lk = _seq(CUQ, CUK, tl.program_id(1))
    m0 = tl.program_id(0) * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    return h, h // GROUP, sq, Lq, sk, Lk, m0, offs_m, offs_m < Lq, (sq + offs_m)[:, None]


@triton.jit
def _head_cols(BD1: tl.constexpr, BD2: tl.constexpr, BDV: tl.constexpr):
    """Column indices of the three head-dim tiles: first key part, second key part, value."""
    return tl.arange(0, BD1), tl.arange(0, BD2), tl.arange(0, BDV)


@triton.jit
def _two_part_rows(P, rows, s_t, off, d1, d2, tmask, D1, D2, HAS_D2: tl.constexpr):
    """Rows of a tensor whose head dim is split in two parts (q, or k for plain 192-dim heads):
    columns ``:D1`` and, with ``HAS_D2``, ``D1:D1 + D2`` (else the first part again, unused)."""
    x1 = _load(P, rows, s_t, off, d1[None, :], tmask[:, None], D1)
    x2 = x1
    if HAS_D2:
        x2 = _load(P, rows, s_t, off + D1, d2[None, :], tmask[:, None], D2)
    return x1, x2


@triton.jit
def _fwd_kernel(Q, K, K2, V, O, LSE, CUQ, CUK, sm_scale,
                s_qt, s_qh, s_kt, s_kh, s_k2t, s_k2h, s_vt, s_vh, s_ot, s_oh, s_lh, GROUP,
                D1, D2, DV,
                CAUSAL: tl.constexpr, HAS_D2: tl.constexpr, PREC: tl.constexpr, ACC: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BD1: tl.constexpr, BD2: tl.constexpr, BDV: tl.constexpr):
    h, hk, sq, Lq, sk, Lk, m0, offs_m, mmask, rows = _query_block(CUQ, CUK, GROUP, BLOCK_M)
    if m0 < Lq:
        offs_n = tl.arange(0, BLOCK_N)
        d1, d2, dv = _head_cols(BD1, BD2, BDV)
        q1, q2 = _two_part_rows(Q, rows, s_qt, h * s_qh, d1, d2, mmask, D1, D2, HAS_D2)
        m_i = tl.full([BLOCK_M], float("-inf"), ACC)
        l_i = tl.zeros([BLOCK_M], ACC)
        acc = tl.zeros([BLOCK_M, BDV], ACC)
        hi = _key_end(m0, Lq, Lk, CAUSAL, BLOCK_M)
        for n0 in range(0, hi, BLOCK_N):
            kn = n0 + offs_n
            nmask = kn < hi
            kcols = (sk + kn)[None, :]
            k1 = _load(K, kcols, s_kt, hk * s_kh, d1[:, None], nmask[None, :], D1)
            s = tl.dot(q1, k1, input_precision=PREC, out_dtype=ACC)
            if HAS_D2:
                k2 = _load(K2, kcols, s_k2t, hk * s_k2h, d2[:, None], nmask[None, :], D2)
                s += tl.dot(q2, k2, input_precision=PREC, out_dtype=ACC)
            s = s * sm_scale
            valid = _visible(nmask[None, :], offs_m, kn, Lq, Lk, CAUSAL)
            s = tl.where(valid, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            vv = _load(V, (sk + kn)[:, None], s_vt, hk * s_vh, dv[None, :], nmask[:, None], DV)
            acc = acc * alpha[:, None] + tl.dot(p.to(vv.dtype), vv, input_precision=PREC, out_dtype=ACC)
            m_i = m_new
        # l = 0 only for a row that saw no key: out 0, lse -inf. A NaN l (a NaN or +inf score) stays:
        # out and lse NaN, never the no-key marker -inf
        l_safe = tl.where(l_i == 0, 1.0, l_i)
        out = acc / l_safe[:, None]  # 0 for a row that saw no key
        _store(O, rows, s_ot, h * s_oh, dv[None, :], mmask[:, None], DV, out)
        # a +inf score (row max +inf): lse = +inf, the reference's logsumexp (m + log(NaN) is NaN)
        lse = tl.where(l_i == 0, float("-inf"), tl.where(m_i == float("inf"), m_i, m_i + tl.log(l_safe)))
        tl.store(LSE + h * s_lh + sq + offs_m, lse.to(LSE.dtype.element_ty), mask=mmask)


@triton.jit
def _one_key_rows(qm, Lq, Lk, CAUSAL: tl.constexpr):
    """Query rows (positions ``qm`` of a sequence with ``Lq`` queries and ``Lk`` keys) that see
    exactly one key: with causal the query at ``qm = Lq - Lk`` (bottom-right alignment: it sees
    key 0 only), without causal every query of a one-key sequence. Their score gradient is set
    to exactly zero (softmax weight 1), so they add nothing to dQ and dK."""
    if CAUSAL:
        return qm + (Lk - Lq) == 0
    return (qm >= 0) & (Lk == 1)


@triton.jit
def _bwd_dkdv_kernel(Q, K, K2, V, DO, LSE, DELTA, DK, DK2, DV_, CUQ, CUK, sm_scale,
                     s_qt, s_qh, s_kt, s_kh, s_k2t, s_k2h, s_vt, s_vh, s_dot, s_doh,
                     s_dkt, s_dkh, s_dk2t, s_dk2h, s_dvt, s_dvh, s_lh, GROUP,
                     D1, D2, DV,
                     CAUSAL: tl.constexpr, HAS_D2: tl.constexpr, PREC: tl.constexpr, ACC: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BD1: tl.constexpr, BD2: tl.constexpr, BDV: tl.constexpr):
    pid_n = tl.program_id(0)
    b = tl.program_id(1)
    hk = tl.program_id(2)  # kv head; the loop below visits the GROUP query heads that read it
    sq, Lq, sk, Lk = _seq(CUQ, CUK, b)
    n0 = pid_n * BLOCK_N
    if n0 < Lk:
        offs_n = n0 + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        d1, d2, dv = _head_cols(BD1, BD2, BDV)
        nmask = offs_n < Lk
        krows = (sk + offs_n)[:, None]
        k1 = _load(K, krows, s_kt, hk * s_kh, d1[None, :], nmask[:, None], D1)
        vv = _load(V, krows, s_vt, hk * s_vh, dv[None, :], nmask[:, None], DV)
        dk1 = tl.zeros([BLOCK_N, BD1], ACC)
        dvacc = tl.zeros([BLOCK_N, BDV], ACC)
        if HAS_D2:
            k2 = _load(K2, krows, s_k2t, hk * s_k2h, d2[None, :], nmask[:, None], D2)
            dk2 = tl.zeros([BLOCK_N, BD2], ACC)
        lo = 0
        if CAUSAL:  # the first query that sees key n0 is n0 - (Lk - Lq)
            lo = (tl.maximum(n0 - (Lk - Lq), 0) // BLOCK_M) * BLOCK_M
        for g in range(0, GROUP):
            h = hk * GROUP + g
            for m0 in range(lo, Lq, BLOCK_M):
                qm = m0 + offs_m
                mmask = qm < Lq
                qrows = (sq + qm)[:, None]
                q1, q2 = _two_part_rows(Q, qrows, s_qt, h * s_qh, d1, d2, mmask, D1, D2, HAS_D2)
                s = tl.dot(q1, tl.trans(k1), input_precision=PREC, out_dtype=ACC)
                if HAS_D2:
                    s += tl.dot(q2, tl.trans(k2), input_precision=PREC, out_dtype=ACC)
                lse = tl.load(LSE + h * s_lh + sq + qm, mask=mmask, other=0.0)
                delta = tl.load(DELTA + h * s_lh + sq + qm, mask=mmask, other=0.0)
                valid = _visible(mmask[:, None] & nmask[None, :], qm, offs_n, Lq, Lk, CAUSAL)
                # a row that sees no key (lse = -inf) has no valid entry: p = 0 there
                p = tl.where(valid, tl.exp(s * sm_scale - lse[:, None]), 0.0)
                do = _load(DO, qrows, s_dot, h * s_doh, dv[None, :], mmask[:, None], DV)
                dvacc += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PREC, out_dtype=ACC)
                dp = tl.dot(do, tl.trans(vv), input_precision=PREC, out_dtype=ACC)
                ds = p * (dp - delta[:, None]) * sm_scale
                # a query that sees one key only has dS = 0 exactly (P = 1, dP = delta in exact
                # arithmetic; computed they differ in the last bits): see _one_key_rows
                ds = tl.where(_one_key_rows(qm, Lq, Lk, CAUSAL)[:, None], 0.0, ds).to(q1.dtype)
                dk1 += tl.dot(tl.trans(ds), q1, input_precision=PREC, out_dtype=ACC)
                if HAS_D2:
                    dk2 += tl.dot(tl.trans(ds), q2, input_precision=PREC, out_dtype=ACC)
        _store(DK, krows, s_dkt, hk * s_dkh, d1[None, :], nmask[:, None], D1, dk1)
        _store(DV_, krows, s_dvt, hk * s_dvh, dv[None, :], nmask[:, None], DV, dvacc)
        if HAS_D2:
            _store(DK2, krows, s_dk2t, hk * s_dk2h, d2[None, :], nmask[:, None], D2, dk2)


@triton.jit
def _bwd_dq_kernel(Q, K, K2, V, DO, LSE, DELTA, DQ, CUQ, CUK, sm_scale,
                   s_qt, s_qh, s_kt, s_kh, s_k2t, s_k2h, s_vt, s_vh, s_dot, s_doh, s_dqt, s_dqh,
                   s_lh, GROUP, D1, D2, DV,
                   CAUSAL: tl.constexpr, HAS_D2: tl.constexpr, PREC: tl.constexpr, ACC: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BD1: tl.constexpr, BD2: tl.constexpr, BDV: tl.constexpr):
    h, hk, sq, Lq, sk, Lk, m0, offs_m, mmask, qrows = _query_block(CUQ, CUK, GROUP, BLOCK_M)
    if m0 < Lq:
        offs_n = tl.arange(0, BLOCK_N)
        d1, d2, dv = _head_cols(BD1, BD2, BDV)
        q1, q2 = _two_part_rows(Q, qrows, s_qt, h * s_qh, d1, d2, mmask, D1, D2, HAS_D2)
        if HAS_D2:
            dq2 = tl.zeros([BLOCK_M, BD2], ACC)
        do = _load(DO, qrows, s_dot, h * s_doh, dv[None, :], mmask[:, None], DV)
        lse = tl.load(LSE + h * s_lh + sq + offs_m, mask=mmask, other=0.0)
        delta = tl.load(DELTA + h * s_lh + sq + offs_m, mask=mmask, other=0.0)
        dq1 = tl.zeros([BLOCK_M, BD1], ACC)
        one_key = _one_key_rows(offs_m, Lq, Lk, CAUSAL)
        hi = _key_end(m0, Lq, Lk, CAUSAL, BLOCK_M)
        for n0 in range(0, hi, BLOCK_N):
            kn = n0 + offs_n
            nmask = kn < hi
            krows = (sk + kn)[:, None]
            k1 = _load(K, krows, s_kt, hk * s_kh, d1[None, :], nmask[:, None], D1)
            s = tl.dot(q1, tl.trans(k1), input_precision=PREC, out_dtype=ACC)
            if HAS_D2:
                k2 = _load(K2, krows, s_k2t, hk * s_k2h, d2[None, :], nmask[:, None], D2)
                s += tl.dot(q2, tl.trans(k2), input_precision=PREC, out_dtype=ACC)
            valid = _visible(mmask[:, None] & nmask[None, :], offs_m, kn, Lq, Lk, CAUSAL)
            p = tl.where(valid, tl.exp(s * sm_scale - lse[:, None]), 0.0)
            vv = _load(V, krows, s_vt, hk * s_vh, dv[None, :], nmask[:, None], DV)
            dp = tl.dot(do, tl.trans(vv), input_precision=PREC, out_dtype=ACC)
            ds = p * (dp - delta[:, None]) * sm_scale
            ds = tl.where(one_key[:, None], 0.0, ds).to(k1.dtype)
            dq1 += tl.dot(ds, k1, input_precision=PREC, out_dtype=ACC)
            if HAS_D2:
                dq2 += tl.dot(ds, k2, input_precision=PREC, out_dtype=ACC)
        _store(DQ, qrows, s_dqt, h * s_dqh, d1[None, :], mmask[:, None], D1, dq1)
        if HAS_D2:
            _store(DQ, qrows, s_dqt, h * s_dqh + D1, d2[None, :], mmask[:, None], D2, dq2)


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


def _block(q, max_seqlen: int) -> int:
    """Query/key block on a GPU: 64, or 32 for 4-byte inputs. fp32 at MLA's head dims with 64-row
    blocks asked for 263,168 B of shared memory on an H200 (limit 232,448 B per block;
    2026-12-04): the 4-byte tiles of q, k, v and dO double what bf16 needs."""
    on_gpu = q.device.type == "cuda"
    if on_gpu:
        return 16 if max_seqlen <= 16 else (32 if q.element_size() >= 4 else 64)
    return 16


def _config(q, max_seqlen_q: int, max_seqlen_k: int):
    """(BLOCK_M, BLOCK_N, input precision, accumulation type)."""
    prec = "ieee" if q.dtype in (torch.float32, torch.float64) else "tf32"
    acc = tl.float64 if q.dtype == torch.float64 else tl.float32
    return _block(q, max_seqlen_q), _block(q, max_seqlen_k), prec, acc


def _warps(q, BD1: int, BD2: int, BDV: int) -> int:
    """Warps per program on a GPU: 8 when the head-dim tiles add up to >= 256 columns (MLA's
    128 + 64 + 128: the fp32 accumulators of the dK/dV kernel alone are 64 x 320), else 4. Not
    tuned on a GPU (none was available when this was written); the interpreter ignores it."""
    return 8 if q.device.type == "cuda" and BD1 + BD2 + BDV >= 256 else 4


def _dims(q, k, v, k_rope):
    D1, D2, k2, k2h = _split(q.shape[-1], k, k_rope)
    return D1, D2, k2, k2h, _pow2(D1), _pow2(D2), _pow2(v.shape[-1])


def _unit(t):
    """``t`` with unit stride in its last dim (the kernels index the head dim with stride 1; any
    other stride, e.g. a direct op call with a transposed view, is copied once)."""
    if t is None or t.numel() == 0 or t.stride(-1) == 1:
        return t
    return t.contiguous()


def _grid_lengths(max_seqlen_q, max_seqlen_k, Tq, Tk):
    """The longest sequences for the grid: no sequence is longer than its tensor's tokens, so a
    ``max_seqlen`` above that (valid: it is an upper bound) launches no more programs than needed."""
    return min(int(max_seqlen_q), Tq), min(int(max_seqlen_k), Tk)


def flash_attention_fwd(q, k, v, k_rope, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                        causal, softmax_scale):
    if bf16_dot_in_interpreter(q):
        out, lse = flash_attention_fwd(*to_fp32(q, k, v, k_rope), cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                       max_seqlen_k, causal, softmax_scale)
        return out.to(q.dtype), lse
    q, k, v, k_rope = (_unit(t) for t in (q, k, v, k_rope))
    max_seqlen_q, max_seqlen_k = _grid_lengths(max_seqlen_q, max_seqlen_k, q.shape[0], k.shape[0])
    cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    Tq, Hq, _ = q.shape
    Tk, Hkv, Dv = v.shape
    B = cu_seqlens_q.shape[0] - 1
    D1, D2, k2, k2h, BD1, BD2, BDV = _dims(q, k, v, k_rope)
    out = torch.zeros((Tq, Hq, Dv), dtype=q.dtype, device=q.device)
    lse = torch.full((Hq, Tq), float("-inf"), dtype=lse_dtype(q.dtype), device=q.device)
    if Tq == 0 or Hq == 0 or B <= 0 or max_seqlen_q == 0 or Tk == 0 or max_seqlen_k == 0:
        return out, lse  # no query, or no key anywhere: out 0, lse -inf
    BM, BN, prec, acc = _config(q, max_seqlen_q, max_seqlen_k)
    grid = (triton.cdiv(max_seqlen_q, BM), B, Hq)
    _fwd_kernel[grid](q, k, k2, v, out, lse, cu_seqlens_q, cu_seqlens_k, float(softmax_scale),
                      q.stride(0), q.stride(1), k.stride(0), k.stride(1), k2.stride(0), k2h,
                      v.stride(0), v.stride(1), out.stride(0), out.stride(1), lse.stride(0), Hq // Hkv,
                      D1, D2, Dv, CAUSAL=bool(causal), HAS_D2=D2 > 0, PREC=prec, ACC=acc,
                      BLOCK_M=BM, BLOCK_N=BN, BD1=BD1, BD2=BD2, BDV=BDV,
                      num_warps=_warps(q, BD1, BD2, BDV))
    return out, lse


def flash_attention_bwd(grad_out, q, k, v, k_rope, out, lse, cu_seqlens_q, cu_seqlens_k,
                        max_seqlen_q, max_seqlen_k, causal, softmax_scale):
    if bf16_dot_in_interpreter(q):
        grads = flash_attention_bwd(*to_fp32(grad_out, q, k, v, k_rope, out), lse, cu_seqlens_q, cu_seqlens_k,
                                    max_seqlen_q, max_seqlen_k, causal, softmax_scale)
        return tuple(g.to(q.dtype) for g in grads)
    grad_out, q, k, v, k_rope, out = (_unit(t) for t in (grad_out, q, k, v, k_rope, out))
    max_seqlen_q, max_seqlen_k = _grid_lengths(max_seqlen_q, max_seqlen_k, q.shape[0], k.shape[0])
    cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    Tq, Hq, _ = q.shape
    Tk, Hkv, Dv = v.shape
    B = cu_seqlens_q.shape[0] - 1
    D1, D2, k2, k2h, BD1, BD2, BDV = _dims(q, k, v, k_rope)
    acc_t = lse_dtype(q.dtype)
    dq = torch.zeros_like(q)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    if k_rope is not None:
        dk2 = torch.zeros((Hkv, Tk, D2), dtype=acc_t, device=q.device)  # per kv head, summed below
        s_dk2t, s_dk2h = dk2.stride(1), dk2.stride(0)
    else:
        dk2 = dk[..., D1:] if D2 else dk
        s_dk2t, s_dk2h = dk.stride(0), dk.stride(1)
    if Tq > 0 and Tk > 0 and Hq > 0 and B > 0 and max_seqlen_q > 0 and max_seqlen_k > 0:
        BM, BN, prec, acc = _config(q, max_seqlen_q, max_seqlen_k)
        delta = (grad_out.to(acc_t) * out.to(acc_t)).sum(-1).t().contiguous()  # [Hq, Tq]
        lse = lse.to(acc_t).contiguous()
        common = dict(CAUSAL=bool(causal), HAS_D2=D2 > 0, PREC=prec, ACC=acc, BLOCK_M=BM, BLOCK_N=BN,
                      BD1=BD1, BD2=BD2, BDV=BDV, num_warps=_warps(q, BD1, BD2, BDV))
        _bwd_dkdv_kernel[(triton.cdiv(max_seqlen_k, BN), B, Hkv)](
            q, k, k2, v, grad_out, lse, delta, dk, dk2, dv, cu_seqlens_q, cu_seqlens_k, float(softmax_scale),
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), k2.stride(0), k2h,
            v.stride(0), v.stride(1), grad_out.stride(0), grad_out.stride(1),
            dk.stride(0), dk.stride(1), s_dk2t, s_dk2h, dv.stride(0), dv.stride(1),
            lse.stride(0), Hq // Hkv, D1, D2, Dv, **common)
        _bwd_dq_kernel[(triton.cdiv(max_seqlen_q, BM), B, Hq)](
            q, k, k2, v, grad_out, lse, delta, dq, cu_seqlens_q, cu_seqlens_k, float(softmax_scale),
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), k2.stride(0), k2h,
            v.stride(0), v.stride(1), grad_out.stride(0), grad_out.stride(1),
            dq.stride(0), dq.stride(1), lse.stride(0), Hq // Hkv, D1, D2, Dv, **common)
    if k_rope is None:
        return dq, dk, dv, q.new_zeros((0,))
    dkr = dk2[0].clone() if Hkv else dk2.new_zeros((Tk, D2))
    for h in range(1, Hkv):  # fixed head order: deterministic
        dkr += dk2[h]
    return dq, dk, dv, dkr.to(q.dtype)

