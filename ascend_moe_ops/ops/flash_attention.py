"""``flash_attention``: training attention with ``d_qk >= d_v`` (e.g. 192 / 128 for MLA), batch or
packed varlen layout, forward and backward without materializing the ``S x S`` score matrix."""

from __future__ import annotations

from typing import Optional

import torch

from .. import _library
from . import _checks, _contracts

OP = "flash_attention_fwd"
BWD = "flash_attention_bwd"
Tensor = torch.Tensor

for _op in (OP, BWD):
    _library.PYTHON_IMPLS["reference"][_op] = ("ascend_moe_ops.reference.flash_attention", _op)
    _library.PYTHON_IMPLS["triton"][_op] = ("ascend_moe_ops.triton_ref.flash_attention", _op)
# The AscendC kernels (csrc/ascend/kernels/flash_attention_*.cpp, on the CPU emulation layer) register
# themselves under ascend_moe_ops_emu: forward and backward, fp16/bf16 inputs only (fp32 raises: no
# fp32 Cube path; docs/ascend.md).


# ----------------------------------------------------------------------------- shared helpers
def pack_layout(name: str, x: Tensor, cu_seqlens: Optional[Tensor], max_seqlen: Optional[int],
                token_dims: int):
    """Turn ``[B, S, ...]`` (no ``cu_seqlens``) or packed ``[T, ...]`` into the kernels' packed
    form. Returns ``(cu_seqlens int32/int64 [B+1], max_seqlen, batch_shape or None)``. The values
    of ``cu_seqlens`` are checked at the op boundary."""
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
    _checks.check_tensor("cu_seqlens", cu_seqlens)
    if max_seqlen is None:
        # one host synchronization; pass max_seqlen to avoid it (and under torch.compile)
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if cu_seqlens.numel() > 1 else 0
    _checks.check_int("max_seqlen", max_seqlen)
    return cu_seqlens.contiguous(), max_seqlen, None


# ----------------------------------------------------------------------------- op registration
def _fake(q, k, v, k_rope, cu_seqlens, max_seqlen, causal, softmax_scale):
    T, H, _ = q.shape
    return q.new_empty((T, H, v.shape[-1])), q.new_empty((H, T), dtype=_contracts.lse_dtype(q.dtype))


def _fake_bwd(grad_out, q, k, v, k_rope, out, lse, cu_seqlens, max_seqlen, causal, softmax_scale):
    dkr = k_rope.new_empty(k_rope.shape) if k_rope is not None else q.new_empty((0,))
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dkr


def _empty(q, k, v, k_rope, cu_seqlens, max_seqlen, causal, softmax_scale):
    """T = 0 (B = 0 too) or H = 0: valid, empty results (as the C++ kernels)."""
    if q.shape[0] and q.shape[1]:
        return None
    T, H, _ = q.shape
    return (q.new_zeros((T, H, v.shape[-1])),
            q.new_full((H, T), float("-inf"), dtype=_contracts.lse_dtype(q.dtype)))


def _empty_bwd(grad_out, q, k, v, k_rope, *rest):
    if q.shape[0] and q.shape[1]:
        return None
    return (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v),
            torch.zeros_like(k_rope) if k_rope is not None else q.new_empty((0,)))


def _setup_context(ctx, inputs, output):
    q, k, v, k_rope, cu_seqlens, max_seqlen, causal, scale = inputs
    out, lse = output
    ctx.has_rope = k_rope is not None
    ctx.args = (max_seqlen, causal, scale)
    ctx.save_for_backward(q, k, v, k_rope, out, lse, cu_seqlens)
    ctx.mark_non_differentiable(lse)


def _backward(ops, ctx, grad_out, _grad_lse):
    q, k, v, k_rope, out, lse, cu_seqlens = ctx.saved_tensors
    max_seqlen, causal, scale = ctx.args
    dq, dk, dv, dkr = ops(BWD)(grad_out.contiguous(), q, k, v, k_rope, out, lse, cu_seqlens, max_seqlen,
                               causal, scale)
    return dq, dk, dv, (dkr if ctx.has_rope else None), None, None, None, None


_library.register_op(OP, fake=_fake, check_meta=_contracts.flash_attention_fwd_meta,
                     check=_contracts.flash_attention_fwd, backward=_backward, setup_context=_setup_context,
                     empty=_empty)
_library.register_op(BWD, fake=_fake_bwd, check_meta=_contracts.flash_attention_bwd_meta,
                     check=_contracts.flash_attention_bwd, empty=_empty_bwd)


def _check_layout(q, k, v):
    """Layout checks the packing needs (the op boundary checks dtypes, devices and head dims)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _checks.check_tensor(name, t)
    if q.dim() not in (3, 4):
        raise ValueError(f"q must be [B, S, H, D] or packed [T, H, D], got shape {tuple(q.shape)}")
    for name, t in (("k", k), ("v", v)):
        if t.dim() != q.dim():
            raise ValueError(f"{name} must be {q.dim()}-D like q, got shape {tuple(t.shape)}")
        if tuple(t.shape[:-1]) != tuple(q.shape[:-1]):
            raise ValueError(f"{name} must have shape {tuple(q.shape[:-1])} + (D,) (tokens and heads "
                             f"of q; no GQA), got {tuple(t.shape)}")
    if v.shape[-1] > q.shape[-1]:  # the API's rule (the kernels of every backend compute it)
        raise ValueError(f"v head dim d_v={v.shape[-1]} > d_qk={q.shape[-1]} is not supported "
                         "(d_qk >= d_v is required)")


def flash_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False,
                    softmax_scale: Optional[float] = None, cu_seqlens: Optional[Tensor] = None,
                    max_seqlen: Optional[int] = None, return_lse: bool = False):
    """Softmax attention ``softmax(q k^T * scale) v`` with online-softmax tiling.

    Args:
        q: ``[B, S, H, D_qk]``, or packed ``[T, H, D_qk]`` together with ``cu_seqlens``;
            fp32/fp16/bf16 (fp64 runs on the reference and native backends).
        k: same shape as ``q`` (same heads: no GQA).
        v: ``[B, S, H, D_v]`` / ``[T, H, D_v]`` with ``D_v <= D_qk`` (192/128 for MLA; no padding).
        causal: query ``i`` sees keys ``<= i`` of its own sequence. Default ``False`` (as
            flash-attention and SDPA; changed from ``True``: docs/design.md, Changes).
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
    _check_layout(q, k, v)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    token_dims = q.dim() - 2
    cu, max_len, batch = pack_layout("q", q, cu_seqlens, max_seqlen, token_dims)
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5 if q.shape[-1] > 0 else 1.0  # D = 0 is refused at the op
    softmax_scale = _checks.check_float("softmax_scale", softmax_scale)
    H = q.shape[-2]
    T = q.shape[0] * q.shape[1] if batch is not None else q.shape[0]
    qp, kp, vp = (t.reshape(T, H, t.shape[-1]) for t in (q, k, v))  # explicit T: H = 0 is valid
    out, lse = _library.op(OP)(qp.contiguous(), kp.contiguous(), vp.contiguous(), None, cu,
                               max_len, causal, softmax_scale)
    if batch is not None:
        out = out.view(*batch, H, v.shape[-1])
        lse = lse.view(H, *batch).transpose(0, 1)
    return (out, lse) if return_lse else out
