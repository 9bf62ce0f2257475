"""Reference (specification) of ``flash_attention_fwd`` / ``flash_attention_bwd``: plain softmax
attention, one sequence and all heads at a time, in the inputs' dtype (fp64 inputs give the test
oracle). It materializes the ``L x L`` score matrix on purpose: it is the readable spec, not a
fast path.

Layout: packed ``[T, H, D]`` tokens, sequence ``b`` is rows ``cu_seqlens[b]:cu_seqlens[b+1]``.
With ``causal`` a query attends to keys at positions ``<=`` its own inside its sequence.
``k_rope`` (``[T, Dr]``, optional) is a key part shared by every head: the key of head ``h`` is
``cat(k[:, h], k_rope)``.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


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


def flash_attention_fwd(q, k, v, k_rope, cu_seqlens, max_seqlen, causal, softmax_scale):
    T, H, _ = q.shape
    kk = full_keys(k, k_rope, H)
    out = q.new_zeros((T, H, v.shape[-1]))
    lse = torch.full((H, T), float("-inf"), dtype=lse_dtype(q.dtype), device=q.device)
    for s, e in _bounds(cu_seqlens):
        qs, ks, vs = (t[s:e].transpose(0, 1) for t in (q, kk, v))  # [H, L, D]
        scores = _scores(qs, ks, causal, softmax_scale)
        lse[:, s:e] = torch.logsumexp(scores.to(lse.dtype), dim=-1)
        p = torch.softmax(scores, dim=-1)
        out[s:e] = torch.matmul(p, vs).transpose(0, 1)
    return out, lse


def flash_attention_bwd(grad_out, q, k, v, k_rope, out, lse, cu_seqlens, max_seqlen, causal,
                        softmax_scale):
    T, H, _ = q.shape
    kk = full_keys(k, k_rope, H)
    dq = torch.zeros_like(q)
    dkk = torch.zeros_like(kk)
    dv = torch.zeros_like(v)
    for s, e in _bounds(cu_seqlens):
        qs, ks, vs, dos = (t[s:e].transpose(0, 1) for t in (q, kk, v, grad_out))
        p = torch.softmax(_scores(qs, ks, causal, softmax_scale), dim=-1)  # [H, L, L]
        dv[s:e] = torch.matmul(p.transpose(1, 2), dos).transpose(0, 1)
        dp = torch.matmul(dos, vs.transpose(1, 2))
        ds = p * (dp - (dp * p).sum(-1, keepdim=True)) * softmax_scale
        dq[s:e] = torch.matmul(ds, ks).transpose(0, 1)
        dkk[s:e] = torch.matmul(ds.transpose(1, 2), qs).transpose(0, 1)
    if k_rope is None:
        return dq, dkk, dv, q.new_zeros((0,))
    dk = dkk[..., :k.shape[-1]].contiguous()
    dk_rope = dkk[..., k.shape[-1]:].sum(dim=1)  # the shared key part: sum over heads
    return dq, dk, dv, dk_rope
