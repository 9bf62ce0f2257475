"""Reference (specification) of ``flash_attention_fwd`` / ``flash_attention_bwd``: plain softmax
attention, one sequence and all heads at a time. It materializes the ``L x L`` score matrix on
purpose: it is the readable spec, not a fast path.

Precision: whatever the input dtype, everything is computed in fp32 (fp64 for fp64 inputs, the
test oracle): the inputs are converted once, the scores, the softmax, the LSE (from the fp32
scores) and every product of the forward and backward run in that dtype, and only the results
``out``, ``dq``, ``dk``, ``dv``, ``dk_rope`` are rounded to the input dtype, once, at the end. The
LSE stays fp32 (fp64 for fp64 inputs). So an fp16/bf16 result differs from the exact one by
about one rounding of the result.

Layout: packed ``[T, H, D]`` tokens, sequence ``b`` is rows ``cu_seqlens[b]:cu_seqlens[b+1]``.
With ``causal`` a query attends to keys at positions ``<=`` its own inside its sequence.
``k_rope`` (``[T, Dr]``, optional) is a key part shared by every head: the key of head ``h`` is
``cat(k[:, h], k_rope)``.

A query row that sees one key only (a one-token sequence, or the first query of a causal
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


def _bounds(cu_seqlens: Tensor):
    b = [int(x) for x in cu_seqlens.tolist()]
    return [(s, e) for s, e in zip(b[:-1], b[1:]) if e > s]


def _scores(qs, ks, causal, scale):
    """[H, L, L] scaled scores with the causal mask applied (-inf above the diagonal)."""
    s = torch.matmul(qs, ks.transpose(1, 2)) * scale
    if causal:
        L = s.shape[-1]
        mask = torch.ones(L, L, dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(mask, float("-inf"))
    return s


def _acc(t, acc):
    return None if t is None else t.to(acc)


def flash_attention_fwd(q, k, v, k_rope, cu_seqlens, max_seqlen, causal, softmax_scale):
    T, H, _ = q.shape
    acc = acc_dtype(q.dtype)
    qa, va = q.to(acc), v.to(acc)
    kk = full_keys(k.to(acc), _acc(k_rope, acc), H)
    out = torch.zeros((T, H, v.shape[-1]), dtype=acc, device=q.device)
    lse = torch.full((H, T), float("-inf"), dtype=acc, device=q.device)
    for s, e in _bounds(cu_seqlens):
        qs, ks, vs = (t[s:e].transpose(0, 1) for t in (qa, kk, va))  # [H, L, D]
        scores = _scores(qs, ks, causal, softmax_scale)
        lse[:, s:e] = torch.logsumexp(scores, dim=-1)
        p = torch.softmax(scores, dim=-1)
        out[s:e] = torch.matmul(p, vs).transpose(0, 1)
    return out.to(q.dtype), lse


def flash_attention_bwd(grad_out, q, k, v, k_rope, out, lse, cu_seqlens, max_seqlen, causal,
                        softmax_scale):
    T, H, _ = q.shape
    acc = acc_dtype(q.dtype)
    qa, va, doa = q.to(acc), v.to(acc), grad_out.to(acc)
    kk = full_keys(k.to(acc), _acc(k_rope, acc), H)
    dq = torch.zeros_like(qa)
    dkk = torch.zeros_like(kk)
    dv = torch.zeros_like(va)
    for s, e in _bounds(cu_seqlens):
        qs, ks, vs, dos = (t[s:e].transpose(0, 1) for t in (qa, kk, va, doa))
        p = torch.softmax(_scores(qs, ks, causal, softmax_scale), dim=-1)  # [H, L, L]
        dv[s:e] = torch.matmul(p.transpose(1, 2), dos).transpose(0, 1)
        dp = torch.matmul(dos, vs.transpose(1, 2))
        ds = p * (dp - (dp * p).sum(-1, keepdim=True)) * softmax_scale
        dq[s:e] = torch.matmul(ds, ks).transpose(0, 1)
        dkk[s:e] = torch.matmul(ds.transpose(1, 2), qs).transpose(0, 1)
    dt = q.dtype
    if k_rope is None:
        return dq.to(dt), dkk.to(dt), dv.to(dt), q.new_zeros((0,))
    dk = dkk[..., :k.shape[-1]].to(dt).contiguous()
    dk_rope = dkk[..., k.shape[-1]:].sum(dim=1).to(dt)  # the shared key part: sum over heads
    return dq.to(dt), dk, dv.to(dt), dk_rope
