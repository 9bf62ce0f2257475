"""Reference (specification) of ``grouped_gemm`` and its weight gradient ``grouped_gemm_dw``.

Rows of ``x`` are grouped contiguously by expert: group ``e`` owns rows
``[off_e, off_e + group_sizes[e])`` with ``off_e = sum(group_sizes[:e])``::

    out[off_e + i] = x[off_e + i] @ W_e          W_e = weight[e]      (trans_b=False, [K, N])
                                                 W_e = weight[e].T    (trans_b=True,  [N, K])
    out[r] = 0  for r >= sum(group_sizes)

    grouped_gemm_dw(a, b, group_sizes)[e] = a[off_e : off_e + g_e].T @ b[off_e : off_e + g_e]
                                            (exactly zero when g_e == 0)

Each product is one ``torch.mm`` in the inputs' dtype (PyTorch accumulates low precision in fp32
on CPU). On the CPU the group sizes are read on the host (they live there); on an accelerator the
rows are assigned to groups with ``searchsorted`` and every expert is applied under a row mask, so
nothing is copied to the host (slow, but it is the specification).
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def _weight_of(weight: Tensor, e: int, trans_b: bool) -> Tensor:
    return weight[e].t() if trans_b else weight[e]


def row_groups(group_sizes: Tensor, num_rows: int) -> Tensor:
    """``[M]`` int64 group of each row; ``E`` for rows past ``sum(group_sizes)`` (no host sync)."""
    ends = torch.cumsum(group_sizes.to(torch.int64), 0)
    rows = torch.arange(num_rows, device=group_sizes.device, dtype=torch.int64)
    return torch.searchsorted(ends, rows, right=True)


def grouped_gemm(x: Tensor, weight: Tensor, group_sizes: Tensor, trans_b: bool) -> Tensor:
    M = x.shape[0]
    E = weight.shape[0]
    N = weight.shape[1] if trans_b else weight.shape[2]
    out = x.new_zeros((M, N))
    if group_sizes.device.type == "cpu" and x.device.type == "cpu":
        start = 0
        for e, g in enumerate(group_sizes.tolist()):
            if g:
                torch.mm(x[start:start + g], _weight_of(weight, e, trans_b), out=out[start:start + g])
            start += g
        return out
    gid = row_groups(group_sizes.to(x.device), M)
    for e in range(E):
        mask = (gid == e).unsqueeze(1)
        out = torch.where(mask, torch.mm(x, _weight_of(weight, e, trans_b)), out)
    return out


def grouped_gemm_dw(a: Tensor, b: Tensor, group_sizes: Tensor) -> Tensor:
    E = group_sizes.shape[0]
    out = a.new_zeros((E, a.shape[1], b.shape[1]))
    if group_sizes.device.type == "cpu" and a.device.type == "cpu":
        start = 0
        for e, g in enumerate(group_sizes.tolist()):
            if g:
                torch.mm(a[start:start + g].t(), b[start:start + g], out=out[e])
            start += g
        return out
    gid = row_groups(group_sizes.to(a.device), a.shape[0])
    for e in range(E):
        mask = (gid == e).unsqueeze(1).to(a.dtype)
        out[e] = torch.mm((a * mask).t(), b)
    return out
