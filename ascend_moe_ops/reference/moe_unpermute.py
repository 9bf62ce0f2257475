"""Reference (specification) of ``moe_unpermute`` and its backward.

``out[t] = sum_s w[t, s] * permuted[row_id_map[t, s]]`` over slots with ``row_id_map >= 0``, with
``w = probs`` (or 1), accumulated in fp32 in ascending slot order and stored in the dtype of
``permuted``. A slot that is not kept contributes nothing, even if its row holds NaN.
"""

from __future__ import annotations

from typing import Optional

import torch

Tensor = torch.Tensor


def _acc_dtype(t: Tensor) -> torch.dtype:
    """fp32 accumulation, fp64 for fp64 inputs (the oracle runs)."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _kept(row_id_map: Tensor, num_rows: int):
    rows = row_id_map.to(torch.int64)
    kept = (rows >= 0) & (rows < num_rows)
    return kept, torch.where(kept, rows, torch.zeros_like(rows))


def moe_unpermute(permuted: Tensor, row_id_map: Tensor, probs: Optional[Tensor]) -> Tensor:
    N, H = permuted.shape
    T, S = row_id_map.shape
    if N == 0:  # no permuted row (num_out_tokens=0): every token sums nothing
        return torch.zeros(T, H, dtype=permuted.dtype, device=permuted.device)
    kept, rows = _kept(row_id_map, N)
    acc_t = _acc_dtype(permuted)
    acc = torch.zeros(T, H, dtype=acc_t, device=permuted.device)
    for s in range(S):  # fixed order: deterministic
        x = permuted.index_select(0, rows[:, s]).to(acc_t)
        if probs is not None:
            x = x * probs[:, s].to(acc_t).unsqueeze(1)
        acc = acc + torch.where(kept[:, s].unsqueeze(1), x, torch.zeros_like(x))
    return acc.to(permuted.dtype)


def moe_unpermute_backward(grad_out: Tensor, permuted: Tensor, row_id_map: Tensor,
                           probs: Optional[Tensor]):
    """``(grad_permuted [N,H], grad_probs [T,S])``; rows no slot points to get exactly zero.

    Only ``permuted.shape[0]`` (N) and its dtype are used unless ``probs`` is given, so autograd
    passes an ``[N, 0]`` stand-in when there are no probs instead of keeping ``permuted`` alive."""
    N = permuted.shape[0]
    H = grad_out.shape[1]
    T, S = row_id_map.shape
    kept, rows = _kept(row_id_map, N)
    acc_t = _acc_dtype(grad_out)
    g = grad_out.to(acc_t)
    w = probs.to(acc_t) if probs is not None else torch.ones(T, S, dtype=acc_t, device=grad_out.device)
    contrib = (w.unsqueeze(2) * g.unsqueeze(1)).reshape(T * S, H)
    dest = torch.where(kept, rows, torch.full_like(rows, N)).reshape(-1)  # scratch row N
    grad_permuted = torch.zeros(N + 1, H, dtype=acc_t, device=grad_out.device)
    grad_permuted.index_copy_(0, dest, contrib)
    grad_permuted = grad_permuted[:N].to(permuted.dtype)
    if probs is None:
        return grad_permuted, torch.empty(0, dtype=torch.float32, device=grad_out.device)
    if N == 0:  # no permuted row: no slot is kept, nothing to gather
        return grad_permuted, torch.zeros(T, S, dtype=probs.dtype, device=grad_out.device)
    x = permuted.index_select(0, rows.reshape(-1)).to(acc_t).reshape(T, S, H)
    dots = (x * g.unsqueeze(1)).sum(-1)
    grad_probs = torch.where(kept, dots, torch.zeros_like(dots)).to(probs.dtype)
    return grad_permuted, grad_probs
