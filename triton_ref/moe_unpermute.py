"""Triton backend of ``moe_unpermute`` and its backward op (specification:
``ascend_moe_ops/reference/moe_unpermute.py``).

* ``_unpermute_kernel``: one program per (``BLOCK_T`` tokens, ``BLOCK_H`` columns) sums each
  token's slots in ascending slot order in fp32 registers (fp64 for fp64 inputs) and stores once
  in the dtype of ``permuted``. No atomics, a fixed order: bitwise reproducible run to run. A slot
  that is not kept (``row_id_map < 0``) is skipped with a mask: its row is never read and its prob
  never used, so NaN in unused rows (or in the prob of a dropped slot) cannot leak.
* ``_unpermute_bwd_kernel``: one program per ``BLOCK_T`` tokens walks the columns in ``BLOCK_H``
  blocks, scatters each token's ``w * grad_out[t]`` (cast to the dtype of ``permuted``) to its
  kept destination rows and, with probs, accumulates ``dot(permuted[row], grad_out[t])`` per slot
  in fp32 in a fixed order (per-block tree sums, blocks in ascending order): deterministic, no
  atomics. Rows that no slot points to are zeroed by ``moe_permute``'s ``_zero_unused_kernel``
  (the gradient buffer is allocated with ``torch.empty`` and written exactly once).

Row offsets are 64-bit. The kernels are launched with ``enable_fp_fusion=False``: ``acc + x*w``
stays a rounded multiply then a rounded add (no FMA contraction), the same fp32 operations in the
same order as the reference, so the forward output and the row gradients are meant to be bitwise
equal to the reference's on a GPU too (only ``grad_probs``, a tree sum over H, differs in the last
bits). Under the interpreter, fp32 -> bf16 stores are rounded by hand (``_utils.cast_out``)
because the interpreter truncates; with that the CPU results are bitwise equal to the reference's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import acc_dtype, cast_out, launch, rtne_bf16_workaround, token_tile
from .moe_permute import used_rows, zero_unused_rows


@triton.jit
def _unpermute_kernel(perm_ptr, map_ptr, probs_ptr, out_ptr, N, T, S, H,
                      HAS_PROBS: tl.constexpr, ACC: tl.constexpr, RTNE_OUT: tl.constexpr,
                      BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    toks = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    tm = toks < T
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = cols < H
    acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=ACC)
    for s in range(S):  # ascending slot order: a fixed summation order
        rows = tl.load(map_ptr + toks * S + s, mask=tm, other=-1).to(tl.int64)
        kept = (rows >= 0) & (rows < N)
        x = tl.load(perm_ptr + rows[:, None] * H + cols[None, :],
                    mask=kept[:, None] & hm[None, :], other=0.0).to(ACC)
        if HAS_PROBS:
            w = tl.load(probs_ptr + toks * S + s, mask=kept, other=0.0).to(ACC)
            x = x * w[:, None]
        acc += tl.where(kept[:, None], x, 0.0)
    tl.store(out_ptr + toks[:, None] * H + cols[None, :], cast_out(acc, out_ptr.dtype.element_ty, RTNE_OUT),
             mask=tm[:, None] & hm[None, :])


@triton.jit
def _unpermute_bwd_kernel(g_ptr, perm_ptr, map_ptr, probs_ptr, gperm_ptr, gprobs_ptr,
                          N, T, S, H, HP,
                          HAS_PROBS: tl.constexpr, ACC: tl.constexpr, RTNE_GRAD: tl.constexpr,
                          RTNE_GPROBS: tl.constexpr, BLOCK_T: tl.constexpr,
                          BLOCK_H: tl.constexpr, S_PAD: tl.constexpr):
    toks = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    tm = toks < T
    sidx = tl.arange(0, S_PAD)
    dots = tl.zeros([BLOCK_T, S_PAD], dtype=ACC)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        hm = cols < H
        g = tl.load(g_ptr + toks[:, None] * H + cols[None, :], mask=tm[:, None] & hm[None, :],
                    other=0.0).to(ACC)
        for s in range(S):
            rows = tl.load(map_ptr + toks * S + s, mask=tm, other=-1).to(tl.int64)
            kept = (rows >= 0) & (rows < N)
            m2 = kept[:, None] & hm[None, :]
            if HAS_PROBS:
                w = tl.load(probs_ptr + toks * S + s, mask=kept, other=0.0).to(ACC)
                v = g * w[:, None]
            else:
                v = g
            tl.store(gperm_ptr + rows[:, None] * H + cols[None, :],
                     cast_out(v, gperm_ptr.dtype.element_ty, RTNE_GRAD), mask=m2)
            if HAS_PROBS:
                x = tl.load(perm_ptr + rows[:, None] * HP + cols[None, :], mask=m2,
                            other=0.0).to(ACC)
                d = tl.sum(tl.where(m2, x * g, 0.0), axis=1)
                dots = tl.where(sidx[None, :] == s, dots + d[:, None], dots)
    if HAS_PROBS:
        m2 = tm[:, None] & (sidx < S)[None, :]
        offs = toks[:, None] * S + sidx[None, :]
        rows = tl.load(map_ptr + offs, mask=m2, other=-1).to(tl.int64)
        kept = (rows >= 0) & (rows < N)
        tl.store(gprobs_ptr + offs, cast_out(tl.where(kept, dots, 0.0), gprobs_ptr.dtype.element_ty, RTNE_GPROBS),
                 mask=m2)


def moe_unpermute(permuted: torch.Tensor, row_id_map: torch.Tensor, probs) -> torch.Tensor:
    """Positional signature of ``torch.ops.ascend_moe_ops.moe_unpermute``: ``[T, H]`` in the
    dtype of ``permuted``."""
    permuted = permuted.contiguous()
    row_id_map = row_id_map.contiguous()
    probs = probs.contiguous() if probs is not None else None
    N, H = permuted.shape
    T, S = row_id_map.shape
    out = torch.empty(T, H, dtype=permuted.dtype, device=permuted.device)
    bt, bh = token_tile(H, permuted)
    launch(_unpermute_kernel, (triton.cdiv(T, bt), triton.cdiv(H, bh)), permuted, row_id_map,
           probs if probs is not None else permuted, out, N, T, S, H,
           HAS_PROBS=probs is not None, ACC=acc_dtype(permuted.dtype),
           RTNE_OUT=rtne_bf16_workaround(out.dtype, out), BLOCK_T=bt, BLOCK_H=bh,
           enable_fp_fusion=False)
    return out


def moe_unpermute_backward(grad_out: torch.Tensor, permuted: torch.Tensor, row_id_map: torch.Tensor,
                           probs):
    """Positional signature of ``torch.ops.ascend_moe_ops.moe_unpermute_backward``: returns
    ``(grad_permuted [N, H] in permuted's dtype, grad_probs [T, S] in probs' dtype or [0] fp32)``.
    Without probs only ``permuted.shape[0]`` and its dtype are used (it may be an [N, 0] stand-in)."""
    grad_out = grad_out.contiguous()
    row_id_map = row_id_map.contiguous()
    has_probs = probs is not None
    if has_probs:
        probs = probs.contiguous()
        permuted = permuted.contiguous()
    N = permuted.shape[0]
    T, H = grad_out.shape
    S = row_id_map.shape[1]
    dev = grad_out.device
    grad_perm = torch.empty(N, H, dtype=permuted.dtype, device=dev)
    if has_probs:
        grad_probs = torch.empty(T, S, dtype=probs.dtype, device=dev)
    else:
        grad_probs = torch.empty(0, dtype=torch.float32, device=dev)
    bt, bh = token_tile(H, grad_out)
    launch(_unpermute_bwd_kernel, (triton.cdiv(T, bt),), grad_out, permuted, row_id_map,
           probs if has_probs else grad_out, grad_perm, grad_probs if has_probs else grad_perm,
           N, T, S, H, permuted.shape[1],
           HAS_PROBS=has_probs, ACC=acc_dtype(permuted.dtype),
           RTNE_GRAD=rtne_bf16_workaround(grad_perm.dtype, grad_perm),
           RTNE_GPROBS=rtne_bf16_workaround(grad_probs.dtype, grad_probs), BLOCK_T=bt, BLOCK_H=bh,
           S_PAD=triton.next_power_of_2(max(S, 1)), enable_fp_fusion=False)
    zero_unused_rows(used_rows(row_id_map, N), grad_perm, None)
    return grad_perm, grad_probs
