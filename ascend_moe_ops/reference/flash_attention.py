"""Reference (specification) of ``flash_attention_fwd`` / ``flash_attention_bwd``: plain softmax
attention, one sequence and all heads at a time. It materializes the ``L x L`` score matrix on
purpose: it is the readable spec, not a fast path.

Precision: whatever the input dtype, everything is computed in fp32 (fp64 for fp64 inputs, the
test oracle): the inputs are converted once, the scores, the softmax, the LSE (from the fp32
scores) and every product of the forward and backward run in that dtype, and only the results
``out``, ``dq``, ``dk``, ``dv``, ``dk_rope`` are rounded to the input dtype, once, at the end. The
LSE stays fp32 (fp64 for fp64 inputs). So an fp16/bf16 result differs from the exact one by
about one rounding of the result.

Layout: packed tokens, q ``[Tq, Hq, D]``, k ``[Tk, Hkv, D]``, v ``[Tk, Hkv, Dv]``; sequence ``b``
has queries ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` and keys ``cu_seqlens_k[b]:cu_seqlens_k[b+1]``.
GQA/MQA: ``Hkv`` divides ``Hq`` and q head ``h`` uses kv head ``h // (Hq // Hkv)``; the gradients
of a kv head are the sums over the q heads of its group. With ``causal`` the mask is aligned
bottom-right (flash-attention >= 2.1): in a sequence of ``Lq`` queries and ``Lk`` keys, query ``i``
attends to keys ``j <= i + Lk - Lq`` (``j <= i`` when ``Lq = Lk``). A query that sees no key (a
causal row with ``i + Lk - Lq < 0``, or a sequence without keys) gets ``out = 0``, ``lse = -inf``
and contributes nothing to any gradient. ``k_rope`` (``[Tk, Dr]``, optional) is a key part shared
by every head: the key of head ``h`` is ``cat(k[:, h // group], k_rope)``.

A query row that sees one key only (a one-key sequence, or the first visible query of a causal
sequence) has softmax weight exactly 1, and the backward below gives exactly zero for its score
gradient (``dp - sum(dp * p)`` with ``p = [1, 0, ...]`` is ``dp - dp``), so such rows add exactly
nothing to ``dq`` and ``dk``.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the reference computes in: fp64 for fp64 inputs, fp32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


lse_dtype = acc_dtype  # the LSE is returned in the accumulation dtype


def full_keys(k: Tensor, k_rope, num_heads: int) -> Tensor:
    """``[T, H, Dk (+Dr)]``: the per-head keys, with the shared part appended to every head."""
    if k_rope is None:
        return k
    return torch.cat([k, k_rope[:, None, :].expand(-1, num_heads, -1)], dim=-1)


def expand_heads(x: Tensor, num_heads: int) -> Tensor:
    """``[T, Hkv, D] -> [T, num_heads, D]``: kv head ``g`` serves q heads ``g*group .. g*group+group-1``."""
    hkv = x.shape[1]
    return x if hkv == num_heads else x.repeat_interleave(num_heads // hkv, dim=1)


def reduce_heads(dx: Tensor, num_kv_heads: int) -> Tensor:
    """``[T, Hq, D] -> [T, Hkv, D]``: the sum over the q heads of each group (the adjoint of expand)."""
    T, hq, D = dx.shape
    return dx if hq == num_kv_heads else dx.view(T, num_kv_heads, hq // num_kv_heads, D).sum(2)


def _bounds(cu_q: Tensor, cu_k: Tensor):
    """``(sq, eq, sk, ek)`` of each sequence with at least one query and one key (the others add
    nothing: their outputs stay 0 / -inf and their gradients 0)."""
    bq = [int(x) for x in cu_q.tolist()]
    bk = [int(x) for x in cu_k.tolist()]
    return [(sq, eq, sk, ek) for sq, eq, sk, ek in zip(bq[:-1], bq[1:], bk[:-1], bk[1:]) if eq > sq and ek > sk]


def _scores(qs, ks, causal, scale):
    """[H, Lq, Lk] scaled scores with the bottom-right causal mask applied (-inf where
    j > i + Lk - Lq)."""
    s = torch.matmul(qs, ks.transpose(1, 2)) * scale
    if causal:
        Lq, Lk = s.shape[-2], s.shape[-1]
        mask = torch.ones(Lq, Lk, dtype=torch.bool, device=s.device).triu(Lk - Lq + 1)
        s = s.masked_fill(mask, float("-inf"))
    return s


def _probs(scores):
    """softmax over keys; a row that sees no key (all -inf) gets zeros instead of NaN."""
    p = torch.softmax(scores, dim=-1)
    return p.masked_fill(torch.isneginf(scores).all(-1, keepdim=True), 0.0)


def _acc(t, acc):
    return None if t is None else t.to(acc)


def flash_attention_fwd(q, k, v, k_rope, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                        softmax_scale):
    T, H, _ = q.shape
    acc = acc_dtype(q.dtype)
    qa = q.to(acc)
    kk = expand_heads(full_keys(k.to(acc), _acc(k_rope, acc), k.shape[1]), H)
    va = expand_heads(v.to(acc), H)
    out = torch.zeros((T, H, v.shape[-1]), dtype=acc, device=q.device)
    lse = torch.full((H, T), float("-inf"), dtype=acc, device=q.device)
    for sq, eq, sk, ek in _bounds(cu_seqlens_q, cu_seqlens_k):
        qs = qa[sq:eq].transpose(0, 1)                                    # [H, Lq, D]
        ks, vs = (t[sk:ek].transpose(0, 1) for t in (kk, va))             # [H, Lk, D]
        scores = _scores(qs, ks, causal, softmax_scale)
        lse[:, sq:eq] = torch.logsumexp(scores, dim=-1)
        out[sq:eq] = torch.matmul(_probs(scores), vs).transpose(0, 1)
    return out.to(q.dtype), lse


def flash_attention_bwd(grad_out, q, k, v, k_rope, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                        max_seqlen_k, causal, softmax_scale):
    T, H, _ = q.shape
    Hkv = k.shape[1]
    acc = acc_dtype(q.dtype)
    qa, doa = q.to(acc), grad_out.to(acc)
    kk = expand_heads(full_keys(k.to(acc), _acc(k_rope, acc), Hkv), H)
    va = expand_heads(v.to(acc), H)
    dq = torch.zeros_like(qa)
    dkk = torch.zeros_like(kk)   # per q head; summed over each group below
    dv = torch.zeros_like(va)
    for sq, eq, sk, ek in _bounds(cu_seqlens_q, cu_seqlens_k):
        qs, dos = (t[sq:eq].transpose(0, 1) for t in (qa, doa))
        ks, vs = (t[sk:ek].transpose(0, 1) for t in (kk, va))
        p = _probs(_scores(qs, ks, causal, softmax_scale))  # [H, Lq, Lk]
        dv[sk:ek] = torch.matmul(p.transpose(1, 2), dos).transpose(0, 1)
        dp = torch.matmul(dos, vs.transpose(1, 2))
        ds = p * (dp - (dp * p).sum(-1, keepdim=True)) * softmax_scale
        dq[sq:eq] = torch.matmul(ds, ks).transpose(0, 1)
        dkk[sk:ek] = torch.matmul(ds.transpose(1, 2), qs).transpose(0, 1)
    dt = q.dtype
    dv = reduce_heads(dv, Hkv)
    Dk = k.shape[-1]
    dk = reduce_heads(dkk[..., :Dk], Hkv)
    if k_rope is None:
        return dq.to(dt), dk.to(dt).contiguous(), dv.to(dt), q.new_zeros((0,))
    dk_rope = dkk[..., Dk:].sum(dim=1).to(dt)  # the shared key part: sum over heads
    return dq.to(dt), dk.to(dt).contiguous(), dv.to(dt), dk_rope
