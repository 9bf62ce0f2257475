"""``flash_attention``: training attention with ``d_qk >= d_v`` (e.g. 192 / 128 for MLA), batch or
packed varlen layout, forward and backward without materializing the ``S x S`` score matrix."""

from __future__ import annotations

from typing import Optional

import torch

from .. import _backends, _library
from ..reference.flash_attention import lse_dtype
from . import _checks

OP = "flash_attention_fwd"
BWD = "flash_attention_bwd"
Tensor = torch.Tensor

for _op in (OP, BWD):
    _backends.register_impl(_op, "reference", "ascend_moe_ops.reference.flash_attention", _op)
    _backends.register_impl(_op, "native", "ascend_moe_ops._C", _op)
    _backends.register_impl(_op, "triton", "ascend_moe_ops.triton_ref.flash_attention", _op)
# The AscendC kernels (csrc/ascend/kernels/flash_attention_*.cpp, on the CPU emulation layer): forward and
# backward, fp16/bf16 inputs only (fp32 raises: no fp32 Cube path; docs/ascend.md).
for _op in (OP, BWD):
    _backends.register_impl(_op, "ascendc-emu", "ascend_moe_ops._ascendc_emu", _op)


# ----------------------------------------------------------------------------- shared helpers
def check_cu_seqlens(cu_seqlens: Tensor, total: int, max_seqlen: int) -> None:
    """Value checks (real tensors only): starts at 0, non-decreasing, ends at ``total`` tokens,
    no sequence longer than ``max_seqlen``."""
    if _checks.is_fake(cu_seqlens):
        return
    if cu_seqlens.device.type != "cpu":
        c = cu_seqlens
        torch._assert_async((c[0] == 0) & (c[-1] == total) & (c[1:] >= c[:-1]).all()
                            & ((c[1:] - c[:-1]).max() <= max_seqlen),
                            "cu_seqlens must start at 0, be non-decreasing and end at T")
        return
    c = cu_seqlens.tolist()
    if c[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {c[0]}")
    for i in range(len(c) - 1):
        if c[i + 1] < c[i]:
            raise ValueError(f"cu_seqlens must be non-decreasing, got cu_seqlens[{i}]={c[i]} > "
                             f"cu_seqlens[{i + 1}]={c[i + 1]}")
    if c[-1] != total:
        raise ValueError(f"cu_seqlens must end at the number of tokens T={total}, got {c[-1]}")
    longest = max(c[i + 1] - c[i] for i in range(len(c) - 1))
    if longest > max_seqlen:
        raise ValueError(f"max_seqlen={max_seqlen} is smaller than the longest sequence ({longest})")


def pack_layout(name: str, x: Tensor, cu_seqlens: Optional[Tensor], max_seqlen: Optional[int],
                token_dims: int):
    """Turn ``[B, S, ...]`` (no ``cu_seqlens``) or packed ``[T, ...]`` into the kernels' packed
    form. Returns ``(cu_seqlens int32/int64 [B+1], max_seqlen, batch_shape or None)``."""
    if cu_seqlens is None:
        if token_dims != 2:
            raise ValueError(f"{name} must be [B, S, ...] without cu_seqlens (packed [T, ...] needs "
                             f"cu_seqlens), got shape {tuple(x.shape)}")
        B, S = x.shape[0], x.shape[1]
        cu = torch.arange(0, B + 1, dtype=torch.int32, device=x.device) * S
        return cu, S, (B, S)
    if token_dims != 1:
        raise ValueError(f"with cu_seqlens, {name} must be packed [T, ...], got shape "
                         f"{tuple(x.shape)}")
    _checks.check_tensor("cu_seqlens", cu_seqlens, ndim=1, dtypes=_checks.INDEX_DTYPES,
                         device=x.device)
    if cu_seqlens.shape[0] < 2:
        raise ValueError(f"cu_seqlens must have B+1 >= 2 entries, got shape {tuple(cu_seqlens.shape)}")
    if max_seqlen is None:
        # one host synchronization; pass max_seqlen to avoid it (and under torch.compile)
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if cu_seqlens.numel() > 1 else 0
    _checks.check_int("max_seqlen", max_seqlen, minimum=0)
    return cu_seqlens.contiguous(), max_seqlen, None


# ----------------------------------------------------------------------------- op registration
def _check_fwd(q, k, v, k_rope, cu_seqlens, max_seqlen, causal, scale):
    check_cu_seqlens(cu_seqlens, q.shape[0], max_seqlen)


def _check_bwd(grad_out, q, k, v, k_rope, out, lse, cu_seqlens, max_seqlen, causal, scale):
    check_cu_seqlens(cu_seqlens, q.shape[0], max_seqlen)


@torch.library.register_fake(f"{_library.NAMESPACE}::{OP}")
def _fake(q, k, v, k_rope, cu_seqlens, max_seqlen, causal, softmax_scale):
    T, H, _ = q.shape
    return q.new_empty((T, H, v.shape[-1])), q.new_empty((H, T), dtype=lse_dtype(q.dtype))


@torch.library.register_fake(f"{_library.NAMESPACE}::{BWD}")
def _fake_bwd(grad_out, q, k, v, k_rope, out, lse, cu_seqlens, max_seqlen, causal, softmax_scale):
    dkr = k_rope.new_empty(k_rope.shape) if k_rope is not None else q.new_empty((0,))
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dkr


def _setup_context(ctx, inputs, output):
    q, k, v, k_rope, cu_seqlens, max_seqlen, causal, scale = inputs
    out, lse = output
    ctx.has_rope = k_rope is not None
    ctx.args = (max_seqlen, causal, scale)
    ctx.save_for_backward(q, k, v, k_rope, out, lse, cu_seqlens)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_out, _grad_lse):
    q, k, v, k_rope, out, lse, cu_seqlens = ctx.saved_tensors
    max_seqlen, causal, scale = ctx.args
    dq, dk, dv, dkr = _library.op(BWD)(grad_out.contiguous(), q, k, v, k_rope, out, lse,
                                       cu_seqlens, max_seqlen, causal, scale)
    return dq, dk, dv, (dkr if ctx.has_rope else None), None, None, None, None


torch.library.register_autograd(f"{_library.NAMESPACE}::{OP}", _backward, setup_context=_setup_context)
_library.register_router(OP, check=_check_fwd)
_library.register_router(BWD, check=_check_bwd)


def _check_qkv(q, k, v):
    _checks.check_tensor("q", q, dtypes=_checks.FLOAT_DTYPES)
    device = q.device
    _checks.check_tensor("k", k, dtypes=(q.dtype,), device=device)
    _checks.check_tensor("v", v, dtypes=(q.dtype,), device=device)
    if q.dim() not in (3, 4):
        raise ValueError(f"q must be [B, S, H, D] or packed [T, H, D], got shape {tuple(q.shape)}")
    for name, t in (("k", k), ("v", v)):
        if t.dim() != q.dim():
            raise ValueError(f"{name} must be {q.dim()}-D like q, got shape {tuple(t.shape)}")
        if tuple(t.shape[:-1]) != tuple(q.shape[:-1]):
            raise ValueError(f"{name} must have shape {tuple(q.shape[:-1])} + (D,) (tokens and heads "
                             f"of q; no GQA), got {tuple(t.shape)}")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k head dim must equal q head dim {q.shape[-1]}, got {k.shape[-1]}")
    if v.shape[-1] > q.shape[-1]:
        raise ValueError(f"v head dim d_v={v.shape[-1]} > d_qk={q.shape[-1]} is not supported "
                         "(d_qk >= d_v is required)")
    if q.shape[-1] == 0 or v.shape[-1] == 0:
        raise ValueError(f"head dims must be positive, got d_qk={q.shape[-1]}, d_v={v.shape[-1]}")


def flash_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True,
                    softmax_scale: Optional[float] = None, cu_seqlens: Optional[Tensor] = None,
                    max_seqlen: Optional[int] = None, return_lse: bool = False):
    """Softmax attention ``softmax(q k^T * scale) v`` with online-softmax tiling.

    Args:
        q: ``[B, S, H, D_qk]``, or packed ``[T, H, D_qk]`` together with ``cu_seqlens``;
            fp32/fp16/bf16 (fp64 runs on the reference and native backends).
        k: same shape as ``q`` (same heads: no GQA).
        v: ``[B, S, H, D_v]`` / ``[T, H, D_v]`` with ``D_v <= D_qk`` (192/128 for MLA; no padding).
        causal: query ``i`` sees keys ``<= i`` of its own sequence.
        softmax_scale: defaults to ``D_qk ** -0.5``; pass it explicitly for YaRN.
        cu_seqlens: ``[B+1]`` int32/int64 cumulative sequence starts of packed sequences
            (``0 = c[0] <= c[1] <= ... <= c[B] = T``); empty sequences are allowed.
        max_seqlen: longest sequence; computed from ``cu_seqlens`` (one host sync) when omitted.
        return_lse: also return the logsumexp of the scaled scores (natural log, fp32; not
            differentiable): ``[B, H, S]`` for batch input, ``[H, T]`` for packed input.

    Returns:
        ``out`` with ``v``'s head dim in ``q``'s dtype (and ``lse`` if asked). Differentiable
        w.r.t. ``q``, ``k`` and ``v``; accumulation is fp32.
    """
    _check_qkv(q, k, v)
    token_dims = q.dim() - 2
    cu, max_len, batch = pack_layout("q", q, cu_seqlens, max_seqlen, token_dims)
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    softmax_scale = _checks.check_float("softmax_scale", softmax_scale)
    H = q.shape[-2]
    qp, kp, vp = (t.reshape(-1, H, t.shape[-1]) for t in (q, k, v))
    out, lse = _library.op(OP)(qp.contiguous(), kp.contiguous(), vp.contiguous(), None, cu,
                               max_len, bool(causal), softmax_scale)
    if batch is not None:
        out = out.view(*batch, H, v.shape[-1])
        lse = lse.view(H, *batch).transpose(0, 1)
    return (out, lse) if return_lse else out
