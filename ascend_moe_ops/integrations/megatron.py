"""Megatron-Core drop-in for ``megatron.core.transformer.moe.moe_utils.permute`` / ``unpermute``.

Swap the import and keep the call sites::

    # from megatron.core.transformer.moe.moe_utils import permute, unpermute
    from ascend_moe_ops.integrations.megatron import permute, unpermute

Both functions take Megatron-Core's arguments (checked against megatron-core 0.16.1) and return
what its pure-PyTorch path returns, in the same order and layout:

* ``routing_map`` is a ``[T, E]`` mask (bool, or integers where non-zero = routed); ``probs`` is the
  dense ``[T, E]`` router-probability tensor.
* ``permute`` returns ``(permuted_tokens [N, H], permuted_probs [N] or None, sorted_indices [N])``.
  Rows are expert-major and in token order inside an expert; ``sorted_indices[r]`` (int64) is the
  token that row ``r`` came from.
* ``unpermute`` returns ``[T, H]`` in ``permuted_tokens``' dtype:
  ``out[sorted_indices[r]] += permuted_tokens[r] * (probs of row r, if given)``.
* ``drop_and_pad=True`` with ``num_out_tokens`` (Megatron's capacity mode, ``C = num_out_tokens //
  E``): every expert gets exactly ``C`` rows: first its routed tokens in token order (the first
  ``C`` of them if there are more), then, if it has fewer than ``C``, tokens not routed to it, in
  token order -- exactly Megatron's selection (its router's ``pad_to_capacity`` normally makes every
  column hold ``C`` routed tokens, so the fill is never used).

What differs (by design, never in the returned values' layout):

* The data movement runs in :func:`ascend_moe_ops.moe_permute` / ``moe_unpermute`` (and their
  autograd): one pass, no ``[N, H]`` fp32 temporaries. The weighted sum in ``unpermute`` is
  accumulated in fp32 in a fixed order and rounded once, so low-precision results can differ from
  Megatron's (which rounds after each scatter-add in the token dtype, or returns the fp32 sum when
  ``probs`` is fp32) in the last bits; the gradients likewise.
* ``fused`` is accepted and ignored: this path is always the fused one. (Megatron's ``fused=True``
  path returns TransformerEngine's own index format instead of ``sorted_indices``; here the pair
  ``permute``/``unpermute`` of this module always exchange ``sorted_indices``.)
* ``num_out_tokens`` must equal the number of routed slots when given (it does in every Megatron
  dispatcher); then ``permute`` needs no host synchronization. Without it, ``permute`` counts the
  routed slots with one host sync -- the same one Megatron's ``masked_select`` makes.
* ``unpermute`` without ``routing_map`` (allowed when ``probs`` is ``None``) makes one host sync
  to size its internal map; pass ``routing_map`` to avoid it (every Megatron dispatcher does).
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from .. import _library
from ..ops import _checks
from ..ops.moe_permute import moe_permute
from ..ops.moe_unpermute import moe_unpermute

Tensor = torch.Tensor

__all__ = ["permute", "unpermute", "sorted_indices_from_row_id_map", "row_id_map_from_sorted_indices"]

_MASK_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def _as_mask(routing_map: Tensor, device: torch.device) -> Tensor:
    _checks.check_tensor("routing_map", routing_map, ndim=2, dtypes=_MASK_DTYPES, device=device)
    return routing_map if routing_map.dtype == torch.bool else routing_map != 0


def _as_int(name: str, value) -> int:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype.is_floating_point:
            raise ValueError(f"{name} must be an int or a one-element integer tensor, got a "
                             f"{str(value.dtype).replace('torch.', '')} tensor of shape {tuple(value.shape)}")
        return int(value.item())  # Megatron's dispatchers pass a CPU count here
    return _checks.check_int(name, value, minimum=0)


def sorted_indices_from_row_id_map(row_id_map: Tensor, num_rows: int) -> Tensor:
    """Megatron's ``sorted_indices [num_rows]`` (int64 source token of each row) from our
    ``row_id_map [T, S]`` (destination row of each slot, ``-1`` = not kept). Rows no slot points to
    get token 0. No host synchronization."""
    T, S = row_id_map.shape
    device = row_id_map.device
    rows = row_id_map.reshape(-1).to(torch.int64)
    dest = torch.where(rows >= 0, rows, torch.full_like(rows, num_rows))  # scratch slot num_rows
    src = torch.arange(T, device=device, dtype=torch.int64).repeat_interleave(S)
    out = torch.zeros(num_rows + 1, dtype=torch.int64, device=device)
    out.index_copy_(0, dest, src)
    return out[:num_rows]


def row_id_map_from_sorted_indices(sorted_indices: Tensor, expert_of_row: Tensor, num_tokens: int,
                                   num_experts: int) -> Tensor:
    """Our ``row_id_map [T, E]`` (int32) from Megatron's ``sorted_indices [N]`` and the expert of
    each row (rows whose expert is ``>= num_experts`` are left out). No host synchronization."""
    N = sorted_indices.numel()
    device = sorted_indices.device
    si = sorted_indices.to(torch.int64)
    e = expert_of_row.to(torch.int64)
    scratch = num_tokens * num_experts
    flat = torch.where(e < num_experts, si * num_experts + e, torch.full_like(si, scratch))
    out = torch.full((scratch + 1,), -1, dtype=torch.int32, device=device)
    out.index_copy_(0, flat, torch.arange(N, device=device, dtype=torch.int32))
    return out[:scratch].view(num_tokens, num_experts)


def _row_id_map_by_token(sorted_indices: Tensor, num_tokens: int) -> Tensor:
    """``row_id_map [T, S]`` with ``S`` = the most rows any token has, slots in row order.
    One host sync (for ``S``)."""
    N = sorted_indices.numel()
    device = sorted_indices.device
    si = sorted_indices.to(torch.int64)
    counts = torch.bincount(si, minlength=num_tokens)
    S = int(counts.max()) if N else 0
    order = torch.argsort(si, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.empty_like(si)
    slot[order] = torch.arange(N, device=device) - starts[si[order]]
    out = torch.full((num_tokens, S), -1, dtype=torch.int32, device=device)
    out[si, slot] = torch.arange(N, device=device, dtype=torch.int32)
    return out


def _drop_and_pad_row_id_map(mask: Tensor, capacity: int) -> Tensor:
    """Megatron's drop-and-pad selection as a ``[T, E]`` row map: inside expert ``e`` the routed
    tokens come first (token order), then the unrouted ones (token order); the first ``capacity``
    are kept, at rows ``e * capacity + rank``."""
    T, E = mask.shape
    routed = mask.to(torch.int64)
    before = torch.cumsum(routed, 0) - routed  # routed tokens above t in column e
    count = routed.sum(0, keepdim=True)
    t_idx = torch.arange(T, device=mask.device, dtype=torch.int64).unsqueeze(1)
    rank = torch.where(mask, before, count + (t_idx - before))
    dest = torch.arange(E, device=mask.device, dtype=torch.int64) * capacity + rank
    return torch.where(rank < capacity, dest, torch.full_like(dest, -1)).to(torch.int32)


class _ScatterRows(torch.autograd.Function):
    """``out[row_id_map[t, s]] = tokens[t]`` for an arbitrary row map: the adjoint of an unweighted
    ``moe_unpermute``, so it runs on that op's backward kernel; its own backward is ``moe_unpermute``."""

    @staticmethod
    def forward(ctx, tokens, row_id_map, num_rows):
        ctx.save_for_backward(row_id_map)
        standin = tokens.new_empty((num_rows, 0))
        return _library.op("moe_unpermute_backward")(tokens.contiguous(), standin, row_id_map, None)[0]

    @staticmethod
    def backward(ctx, grad):
        (row_id_map,) = ctx.saved_tensors
        return _library.op("moe_unpermute")(grad.contiguous(), row_id_map, None), None, None


def permute(tokens: Tensor, routing_map: Tensor, probs: Optional[Tensor] = None,
            num_out_tokens: Optional[int] = None, fused: bool = False,
            drop_and_pad: bool = False) -> Tuple[Tensor, Optional[Tensor], Tensor]:
    """Megatron-Core's ``moe_utils.permute`` on :func:`ascend_moe_ops.moe_permute`.

    Args:
        tokens: ``[T, H]`` fp32/fp16/bf16.
        routing_map: ``[T, E]`` mask (bool, or integers: non-zero = routed).
        probs: optional ``[T, E]`` router probabilities.
        num_out_tokens: number of routed slots (dropless), or ``E * capacity`` with ``drop_and_pad``.
        fused: ignored (always fused).
        drop_and_pad: Megatron's capacity mode; needs ``num_out_tokens`` (without it Megatron, and
            this function, run the dropless path).

    Returns:
        ``(permuted_tokens [N, H], permuted_probs [N] or None, sorted_indices [N] int64)``.
    """
    del fused
    _checks.check_tensor("tokens", tokens, ndim=2, dtypes=_checks.FLOAT_DTYPES)
    device = tokens.device
    mask = _as_mask(routing_map, device)
    T, E = mask.shape
    if T != tokens.shape[0]:
        raise ValueError(f"routing_map must have one row per token: tokens has {tokens.shape[0]} "
                         f"rows, routing_map has shape {tuple(mask.shape)}")
    if probs is not None:
        _checks.check_tensor("probs", probs, dtypes=_checks.FLOAT_DTYPES, device=device)
        _checks.check_shape("probs", probs, mask.shape, "the shape of routing_map")

    if drop_and_pad and num_out_tokens is not None:
        n = _as_int("num_out_tokens", num_out_tokens)
        capacity = n // E
        if capacity > T:
            raise ValueError(f"drop_and_pad: capacity num_out_tokens // num_experts = {capacity} "
                             f"exceeds the {T} tokens (Megatron cannot fill it either)")
        N = E * capacity
        row_id_map = _drop_and_pad_row_id_map(mask, capacity)
        out = _ScatterRows.apply(tokens, row_id_map, N)
        permuted_probs = None
        if probs is not None:
            rows = row_id_map.reshape(-1).to(torch.int64)
            dest = torch.where(rows >= 0, rows, torch.full_like(rows, N))
            permuted_probs = probs.new_zeros(N + 1).index_copy(0, dest, probs.reshape(-1))[:N]
        return out, permuted_probs, sorted_indices_from_row_id_map(row_id_map, N)

    if num_out_tokens is None:
        n = int(mask.sum())  # host sync: the one Megatron's masked_select makes
    else:
        n = _as_int("num_out_tokens", num_out_tokens)
        if not _checks.is_fake(mask):
            used = mask.sum()
            if device.type == "cpu":
                if int(used) != n:
                    raise ValueError(f"num_out_tokens={n} must equal the {int(used)} routed slots "
                                     "of routing_map (Megatron's unfused path returns exactly them)")
            else:
                torch._assert_async(used == n, "num_out_tokens must equal the routed slots of routing_map")
    res = moe_permute(tokens, mask, probs, num_out_tokens=n)
    return res.tokens, res.probs, sorted_indices_from_row_id_map(res.row_id_map, n)


def unpermute(permuted_tokens: Tensor, sorted_indices: Tensor, restore_shape: Sequence[int],
              probs: Optional[Tensor] = None, routing_map: Optional[Tensor] = None,
              fused: bool = False, drop_and_pad: bool = False) -> Tensor:
    """Megatron-Core's ``moe_utils.unpermute`` on :func:`ascend_moe_ops.moe_unpermute`.

    Args:
        permuted_tokens: ``[N, H]`` rows in the layout :func:`permute` produced.
        sorted_indices: ``[N]`` source token of each row, from :func:`permute`.
        restore_shape: ``(T, H)`` of the output.
        probs: optional ``[T, E]`` router probabilities (needs ``routing_map``, as in Megatron).
        routing_map: the ``[T, E]`` mask given to :func:`permute`.
        fused: ignored (always fused).
        drop_and_pad: as given to :func:`permute` (rows are then ``E`` blocks of ``N // E``).

    Returns:
        ``[T, H]`` in ``permuted_tokens``' dtype, summed in fp32 in row order (deterministic).
    """
    del fused
    _checks.check_tensor("permuted_tokens", permuted_tokens, ndim=2, dtypes=_checks.FLOAT_DTYPES)
    device = permuted_tokens.device
    N, H = permuted_tokens.shape
    _checks.check_tensor("sorted_indices", sorted_indices, ndim=1, dtypes=_checks.INDEX_DTYPES,
                         device=device)
    if sorted_indices.numel() != N:
        raise ValueError(f"sorted_indices must have one entry per row of permuted_tokens ({N}), "
                         f"got {sorted_indices.numel()}")
    shape = tuple(int(s) for s in restore_shape)
    if len(shape) != 2 or shape[1] != H:
        raise ValueError(f"restore_shape must be (num_tokens, {H}) to match permuted_tokens, got {shape}")
    T = shape[0]
    _checks.check_index_range("sorted_indices", sorted_indices, 0, T)
    if probs is not None and routing_map is None:
        raise ValueError("routing_map is required when probs is given (as in Megatron-Core)")

    if routing_map is None:
        row_id_map = _row_id_map_by_token(sorted_indices, T)
    else:
        mask = _as_mask(routing_map, device)
        if mask.shape[0] != T:
            raise ValueError(f"routing_map must have restore_shape[0]={T} rows, got shape {tuple(mask.shape)}")
        E = mask.shape[1]
        rows = torch.arange(N, device=device, dtype=torch.int64)
        if drop_and_pad:
            if N % E:
                raise ValueError(f"drop_and_pad: permuted_tokens has {N} rows, not a multiple of the "
                                 f"{E} experts")
            expert_of_row = rows // max(N // E, 1)
        else:
            ends = torch.cumsum(mask.sum(0), 0)
            expert_of_row = torch.searchsorted(ends, rows, right=True)
        row_id_map = row_id_map_from_sorted_indices(sorted_indices, expert_of_row, T, E)
        if probs is not None:
            _checks.check_tensor("probs", probs, dtypes=_checks.FLOAT_DTYPES, device=device)
            _checks.check_shape("probs", probs, mask.shape, "the shape of routing_map")
    return moe_unpermute(permuted_tokens, row_id_map, probs)
