"""``moe_unpermute``: combine expert rows back into tokens, weighted by router probs."""

from __future__ import annotations

from typing import Optional

import torch

from .. import _library
from . import _contracts, checks

OP = "moe_unpermute"
BWD = "moe_unpermute_backward"
Tensor = torch.Tensor
__all__ = ["moe_unpermute"]


def _fake(permuted, row_id_map, probs):
    return permuted.new_empty((row_id_map.shape[0], permuted.shape[1]))


def _fake_bwd(grad_out, permuted, row_id_map, probs):
    grad_permuted = grad_out.new_empty((permuted.shape[0], grad_out.shape[1]), dtype=permuted.dtype)
    grad_probs = probs.new_empty(probs.shape) if probs is not None else grad_out.new_empty((0,), dtype=torch.float32)
    return grad_permuted, grad_probs


def _setup_context(ctx, inputs, output):
    permuted, row_id_map, probs = inputs
    ctx.has_probs = probs is not None
    if probs is not None:
        ctx.save_for_backward(permuted, row_id_map, probs)
    else:
        # only N and the dtype are needed: keep an [N, 0] stand-in, not the activations
        ctx.save_for_backward(permuted.new_empty((permuted.shape[0], 0)), row_id_map)


def _backward(ops, ctx, grad_out):
    if ctx.has_probs:
        permuted, row_id_map, probs = ctx.saved_tensors
    else:
        (permuted, row_id_map), probs = ctx.saved_tensors, None
    d_permuted, d_probs = ops(BWD)(grad_out.contiguous(), permuted, row_id_map, probs)
    return (d_permuted if ctx.needs_input_grad[0] else None, None,
            d_probs if ctx.has_probs and ctx.needs_input_grad[2] else None)


_library.define(_library.OpSpec(
    # (permuted [N,H], row_id_map [T,K] int32/int64, probs [T,K] or None) -> [T,H]
    OP, "(Tensor permuted, Tensor row_id_map, Tensor? probs) -> Tensor",
    fake=_fake, check_meta=_contracts.moe_unpermute_meta, check=_contracts.moe_unpermute,
    backward=_backward, setup_context=_setup_context), __name__)
_library.define(_library.OpSpec(
    # backward of moe_unpermute: (grad_permuted [N,H], grad_probs [T,K] (shape [0] without probs))
    BWD, "(Tensor grad_out, Tensor permuted, Tensor row_id_map, Tensor? probs) -> (Tensor, Tensor)",
    fake=_fake_bwd, check_meta=_contracts.moe_unpermute_backward_meta,
    check=_contracts.moe_unpermute_backward, backward_of=OP), __name__)


def moe_unpermute(permuted: Tensor, row_id_map: Tensor, probs: Optional[Tensor] = None) -> Tensor:
    """Inverse of :func:`moe_permute`: ``out[t] = sum_s w[t,s] * permuted[row_id_map[t,s]]``.

    Args:
        permuted: ``[N, H]`` expert outputs in the layout :func:`moe_permute` produced.
        row_id_map: ``[T, K]`` int32/int64 destination rows from :func:`moe_permute` (``-1`` =
            slot not kept; each row referenced at most once).
        probs: optional ``[T, K]`` weights ``w`` (any float dtype); ``None`` means ``w = 1``.

    Returns:
        ``[T, H]`` in ``permuted``'s dtype. The sum runs in fp32 over slots in ascending order,
        so the result is bitwise reproducible. Differentiable w.r.t. ``permuted`` and ``probs``.
    """
    checks.check_tensor("permuted", permuted)
    checks.check_tensor("row_id_map", row_id_map)
    if probs is not None:
        checks.check_tensor("probs", probs)
    return _library.op(OP)(permuted.contiguous(), row_id_map.contiguous(),
                           None if probs is None else probs.contiguous())


def moe_unpermute_backward(grad_out: Tensor, permuted: Tensor, row_id_map: Tensor,
                           probs: Optional[Tensor] = None):
    """The backward op of :func:`moe_unpermute`: ``(grad_permuted [N, H], grad_probs [T, K])``
    (``grad_probs`` has shape ``[0]`` without ``probs``). Only ``permuted``'s row count and dtype
    are read when ``probs`` is ``None`` (an ``[N, 0]`` stand-in will do): with ``probs = None`` it
    is the scatter ``grad_permuted[row_id_map[t, s]] = grad_out[t]``, the adjoint of an
    unweighted :func:`moe_unpermute`."""
    checks.check_tensor("grad_out", grad_out)
    checks.check_tensor("permuted", permuted)
    checks.check_tensor("row_id_map", row_id_map)
    if probs is not None:
        checks.check_tensor("probs", probs)
    return _library.op(BWD)(grad_out.contiguous(), permuted, row_id_map.contiguous(),
                            None if probs is None else probs.contiguous())
