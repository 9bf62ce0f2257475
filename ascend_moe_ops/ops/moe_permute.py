"""``moe_permute``: route tokens to experts (expert-major, stable), dropless or drop-and-pad."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .. import _backends, _library
from ..reference import moe_permute as _ref
from . import _checks

OP = "moe_permute"
Tensor = torch.Tensor

_backends.register_impl(OP, "reference", "ascend_moe_ops.reference.moe_permute", "moe_permute")
_backends.register_impl(OP, "native", "ascend_moe_ops._C", "moe_permute")
_backends.register_impl(OP, "triton", "ascend_moe_ops.triton_ref.moe_permute", "moe_permute")
_backends.register_impl(OP, "ascendc-emu", "ascend_moe_ops._ascendc_emu", "moe_permute")


class PermuteResult(NamedTuple):
    """Result of :func:`moe_permute`.

    tokens:            ``[N, H]`` rows grouped by expert; padding and unused rows are zero.
    probs:             ``[N]`` the prob of each row (zero on padding), or ``None`` without probs.
    row_id_map:        ``[T, K]`` (``[T, E]`` for mask routing) int32: destination row of each
                       routing slot, ``-1`` if the slot is empty or dropped.
    tokens_per_expert: ``[E]`` int64: real (kept) tokens per expert.
    group_sizes:       ``[E]`` int64: rows per expert including padding (feed to ``grouped_gemm``).
    """

    tokens: Tensor
    probs: Optional[Tensor]
    row_id_map: Tensor
    tokens_per_expert: Tensor
    group_sizes: Tensor


def _check_values(tokens, routing, probs, num_experts, capacity, align, num_out_tokens):
    if routing.dtype != torch.bool:
        _checks.check_index_range("routing (expert ids)", routing, -1, num_experts)
    if num_out_tokens >= 0 and capacity < 0 and not _checks.is_fake(routing):
        used = (routing != 0).sum() if routing.dtype == torch.bool else (routing >= 0).sum()
        if routing.device.type == "cpu":
            if int(used) > num_out_tokens:
                raise ValueError(f"num_out_tokens={num_out_tokens} is smaller than the {int(used)} "
                                 "routed slots in routing")
        else:
            torch._assert_async(used <= num_out_tokens,
                                "num_out_tokens is smaller than the number of routed slots")


@torch.library.register_fake(f"{_library.NAMESPACE}::{OP}")
def _fake(tokens, routing, probs, num_experts, capacity, align, num_out_tokens):
    T, S = routing.shape
    N = _ref.output_rows(T, S, num_experts, capacity, align, num_out_tokens)
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


def _backward(ctx, grad_tokens, grad_probs, *_):
    (row_id_map,) = ctx.saved_tensors
    d_tokens = d_probs = None
    if ctx.needs_input_grad[0] and grad_tokens is not None:
        # permute's adjoint is an unweighted unpermute of the gradient
        d_tokens = _library.op("moe_unpermute")(grad_tokens.contiguous(), row_id_map, None)
    if ctx.has_probs and ctx.needs_input_grad[2] and grad_probs is not None:
        rows = row_id_map.long()
        gathered = grad_probs[rows.clamp(min=0)]
        d_probs = torch.where(rows >= 0, gathered, torch.zeros_like(gathered))
    return d_tokens, None, d_probs, None, None, None, None


torch.library.register_autograd(f"{_library.NAMESPACE}::{OP}", _backward, setup_context=_setup_context)
_library.register_router(OP, check=_check_values)


def moe_permute(tokens: Tensor, routing: Tensor, probs: Optional[Tensor] = None, *,
                num_experts: Optional[int] = None, capacity: Optional[int] = None, align: int = 1,
                num_out_tokens: Optional[int] = None) -> PermuteResult:
    """Group token rows by expert.

    Args:
        tokens: ``[T, H]`` fp32/fp16/bf16 activations (non-contiguous input is copied).
        routing: ``[T, K]`` int32/int64 expert ids (``-1`` = empty slot; duplicates allowed), or a
            ``[T, E]`` bool routing mask.
        probs: optional router weights, same shape as ``routing``, any float dtype.
        num_experts: ``E``; required for id routing, ``routing.shape[1]`` for a mask.
        capacity: ``C`` rows per expert (drop-and-pad: lowest prob dropped first, ties by position;
            short groups padded with zero rows). ``None`` = dropless.
        align: pad every expert group to a multiple of ``align`` rows (dropless mode; with
            ``capacity`` it must divide ``capacity``).
        num_out_tokens: exact number of routed slots, to size the output tightly (dropless only).
            Without it the row count is the static bound ``T*K + E*(align-1)`` (``E*C`` with
            capacity), so no host synchronization is needed.

    Returns:
        :class:`PermuteResult`. Rows are expert-major; inside an expert they follow
        ``(token, slot)`` order. Differentiable w.r.t. ``tokens`` and ``probs``.
    """
    _checks.check_tensor("tokens", tokens, ndim=2, dtypes=_checks.FLOAT_DTYPES)
    device = tokens.device
    _checks.check_tensor("routing", routing, ndim=2, dtypes=(torch.bool,) + _checks.INDEX_DTYPES,
                         device=device)
    if routing.shape[0] != tokens.shape[0]:
        raise ValueError(f"routing must have one row per token: tokens has {tokens.shape[0]} rows, "
                         f"routing has shape {tuple(routing.shape)}")
    if routing.dtype == torch.bool:
        if num_experts is not None and num_experts != routing.shape[1]:
            raise ValueError(f"num_experts={num_experts} does not match the routing mask's "
                             f"{routing.shape[1]} columns")
        num_experts = routing.shape[1]
    elif num_experts is None:
        raise ValueError("num_experts is required when routing holds expert ids")
    _checks.check_int("num_experts", num_experts, minimum=1)
    if probs is not None:
        _checks.check_tensor("probs", probs, dtypes=_checks.FLOAT_DTYPES, device=device)
        _checks.check_shape("probs", probs, routing.shape, "the shape of routing")
    _checks.check_int("align", align, minimum=1)
    if capacity is not None:
        _checks.check_int("capacity", capacity, minimum=1)
        if capacity % align:
            raise ValueError(f"align={align} must divide capacity={capacity}")
        if num_out_tokens is not None:
            raise ValueError("num_out_tokens cannot be combined with capacity (the output has "
                             "exactly num_experts * capacity rows)")
    if num_out_tokens is not None:
        _checks.check_int("num_out_tokens", num_out_tokens, minimum=0)
    out = _library.op(OP)(tokens.contiguous(), routing.contiguous(),
                          None if probs is None else probs.contiguous(), num_experts,
                          -1 if capacity is None else capacity, align,
                          -1 if num_out_tokens is None else num_out_tokens)
    return PermuteResult(out[0], out[1] if probs is not None else None, out[2], out[3], out[4])
