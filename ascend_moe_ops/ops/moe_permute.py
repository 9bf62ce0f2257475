"""``moe_permute``: route tokens to experts (expert-major, stable), dropless or drop-and-pad."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .. import _library
from . import _contracts, checks

OP = "moe_permute"
Tensor = torch.Tensor
__all__ = ["PermuteResult", "moe_permute"]


class PermuteResult(NamedTuple):
    """Result of :func:`moe_permute`.

    tokens:            ``[N, H]`` rows grouped by expert; padding and unused rows are zero.
    probs:             ``[N]`` the prob of each row (zero on padding), or ``None`` without probs.
    row_id_map:        ``[T, K]`` (``[T, E]`` for mask routing) int32: destination row of each
                       routing slot, ``-1`` if the slot is not kept (empty, dropped by
                       ``capacity`` or past ``num_out_tokens``).
    tokens_per_expert: ``[E]`` int64: real (kept) tokens per expert.
    group_sizes:       ``[E]`` int64: rows per expert including padding (feed to ``grouped_gemm``).
    """

    tokens: Tensor
    probs: Optional[Tensor]
    row_id_map: Tensor
    tokens_per_expert: Tensor
    group_sizes: Tensor


def _fake(tokens, routing, probs, num_experts, capacity, align, num_out_tokens):
    T, S = routing.shape
    N = _contracts.output_rows(T, S, num_experts, capacity, align, num_out_tokens)
    out = tokens.new_empty((N, tokens.shape[1]))
    out_probs = probs.new_empty((N,)) if probs is not None else tokens.new_empty((0,), dtype=torch.float32)
    row_id_map = routing.new_empty((T, S), dtype=torch.int32)
    counts = routing.new_empty((num_experts,), dtype=torch.int64)
    return out, out_probs, row_id_map, counts, counts.new_empty((num_experts,))


def _setup_context(ctx, inputs, output):
    _, _, probs, *_ = inputs
    ctx.has_probs = probs is not None
    ctx.save_for_backward(output[2])
    ctx.mark_non_differentiable(output[2], output[3], output[4])


def _backward(ops, ctx, grad_tokens, grad_probs, *_):
    (row_id_map,) = ctx.saved_tensors
    d_tokens = d_probs = None
    if ctx.needs_input_grad[0] and grad_tokens is not None:
        # permute's adjoint is an unweighted unpermute of the gradient
        d_tokens = ops("moe_unpermute")(grad_tokens.contiguous(), row_id_map, None)
    if ctx.has_probs and ctx.needs_input_grad[2] and grad_probs is not None:
        rows = row_id_map.long()
        if grad_probs.numel() == 0:  # no output row (num_out_tokens=0): nothing to gather
            d_probs = grad_probs.new_zeros(rows.shape)
        else:
            gathered = grad_probs[rows.clamp(min=0)]
            d_probs = torch.where(rows >= 0, gathered, torch.zeros_like(gathered))
    return d_tokens, None, d_probs, None, None, None, None


_library.define(_library.OpSpec(
    OP,
    # (tokens [T,H], routing [T,K] int ids (-1 = empty) | [T,E] bool, probs same shape as routing or
    # None, num_experts, capacity (None = dropless), align (>=1), num_out_tokens (None = static bound
    # T*K; n >= 0, dropless only: N = n + E*(align-1) rows, and only the first n routed slots in
    # (expert, token, slot) order are kept, TransformerEngine's rule: below the routed count the tail
    # of the highest experts is dropped)) -> (permuted_tokens [N,H], permuted_probs [N] (shape [0]
    # without probs), row_id_map [T,K] int32 (-1 = not kept: empty, over capacity or past
    # num_out_tokens), tokens_per_expert [E] int64 (kept slots), group_sizes [E] int64). The row map
    # spec: reference/moe_permute.py's docstring.
    "(Tensor tokens, Tensor routing, Tensor? probs, int num_experts, int? capacity, int align, "
    "int? num_out_tokens) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    fake=_fake, check_meta=_contracts.moe_permute_meta, check=_contracts.moe_permute,
    backward=_backward, setup_context=_setup_context), __name__)


def moe_permute(tokens: Tensor, routing: Tensor, probs: Optional[Tensor] = None, *,
                num_experts: Optional[int] = None, capacity: Optional[int] = None, align: int = 1,
                num_out_tokens: Optional[int] = None, map_type: Optional[str] = None) -> PermuteResult:
    """Group token rows by expert.

    Args:
        tokens: ``[T, H]`` fp32/fp16/bf16 activations (non-contiguous input is copied).
        routing: ``[T, K]`` int32/int64 expert ids (``-1`` = empty slot; duplicates allowed), or a
            ``[T, E]`` bool routing mask (``True`` = routed).
        probs: optional router weights, same shape as ``routing``, any float dtype.
        num_experts: ``E``; required for id routing, ``routing.shape[1]`` for a mask.
        capacity: ``C`` rows per expert (drop-and-pad: lowest prob dropped first, ties by position;
            short groups padded with zero rows). ``None`` = dropless. The probs are ranked as
            float32 values on every backend: fp64 probs are rounded to the nearest float32 first,
            so two that are equal in float32 tie and the earlier ``(token, slot)`` is kept even if
            its fp64 prob is lower; ``-0.0`` ties ``0.0``; NaN ranks below every number.
        align: pad every expert group to a multiple of ``align`` rows (dropless mode; with
            ``capacity`` it must divide ``capacity``).
        num_out_tokens: ``n >= 0`` output token rows (dropless only): the output has
            ``n + E*(align-1)`` rows and keeps the first ``n`` routed slots in (expert, token,
            slot) order, TransformerEngine's rule: below the routed count the tail of the highest
            experts is dropped (``row_id_map = -1``, not counted in ``tokens_per_expert``); above
            it the extra rows are zero. Without it the row count is the static bound
            ``T*K + E*(align-1)`` (``E*C`` with capacity). No host synchronization either way.
        map_type: how to read an integer ``routing``: ``"index"`` (expert ids) or ``"mask"`` (a
            ``[T, E]`` 0/1 routing map of any integer dtype, TransformerEngine's
            ``map_type='mask'`` format; 1 = routed). ``None`` (default): a bool tensor is a mask,
            an integer one is ids, except that an integer ``[T, E]`` tensor with
            ``num_experts = E`` columns is refused as ambiguous rather than guessed.

    Returns:
        :class:`PermuteResult`. Rows are expert-major; inside an expert they follow
        ``(token, slot)`` order. Differentiable w.r.t. ``tokens`` and ``probs``.
    """
    checks.check_tensor("tokens", tokens)
    checks.check_tensor("routing", routing)
    if probs is not None:
        checks.check_tensor("probs", probs)
    routing = _contracts.routing_kind(routing, num_experts, map_type)
    if routing.dtype == torch.bool and num_experts is None:
        num_experts = routing.shape[-1] if routing.dim() else 0  # the mask's E (shape checked at the op)
    elif num_experts is None:
        raise ValueError("num_experts is required when routing holds expert ids (for a [T, E] 0/1 routing "
                         "map pass map_type='mask' or a bool mask)")
    checks.check_int("num_experts", num_experts)
    checks.check_int("align", align)
    if capacity is not None:
        checks.check_int("capacity", capacity)
    if num_out_tokens is not None:
        checks.check_int("num_out_tokens", num_out_tokens)
    out = _library.op(OP)(tokens.contiguous(), routing.contiguous(),
                          None if probs is None else probs.contiguous(), num_experts, capacity, align,
                          num_out_tokens)
    return PermuteResult(out[0], out[1] if probs is not None else None, out[2], out[3], out[4])
