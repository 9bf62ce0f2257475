"""Reference (specification) of ``moe_permute``: readable PyTorch, no host synchronization.

This docstring is the one written spec of the row map; the other backends, the op docs and the
schema comment point here.

Layout of the output (``N`` rows, see ``ops._contracts.output_rows``)::

    [ expert 0: kept slots in (token, slot) order | zero padding ] [ expert 1: ... ] ... [ zeros ]

Which slots are kept:

* dropless (``capacity=None``): every slot with an id in ``[0, E)``;
* ``num_out_tokens=n`` (dropless only): the first ``n`` routed slots in (expert, token, slot)
  order, i.e. the order of the output rows; with fewer than ``n`` routed slots all are kept and the
  rows past them are zero, with more the tail of the highest experts is dropped
  (TransformerEngine's rule: its index-map permute keeps the first ``num_out_tokens`` entries of
  the stable expert sort). Empty (``-1``) slots never count. ``tokens_per_expert`` counts the
  kept slots, ``group_sizes`` pads those to ``align``;
* ``capacity=C``: each expert keeps at most ``C`` slots, dropping the lowest ``probs`` first (ties:
  the later ``(token, slot)`` position is dropped first; a NaN prob ranks below every number, so
  NaN slots are dropped first; without ``probs`` the first ``C`` in position order are kept); the
  probs are compared as float32 values (fp64 probs rounded to nearest float32: values equal in
  float32 tie, ``-0.0`` ties ``0.0``), as every backend's kernel compares them;
  every expert group has exactly ``C`` rows;
* ``align=A``: each expert group is padded with zero rows to a multiple of ``A``.

``row_id_map[t, s]`` is the destination row of slot ``(t, s)``, or ``-1`` when the slot is not kept
(empty, dropped by ``capacity``, or past ``num_out_tokens``). Every backend computes its own row
map and must match this one exactly.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..ops._contracts import output_rows  # the one row-count function

Tensor = torch.Tensor


def slot_expert_ids(routing: Tensor, num_experts: int) -> Tensor:
    """``[T, S]`` int64 expert id per slot, ``-1`` for an empty slot (mask routing: ``S = E``)."""
    if routing.dtype == torch.bool:
        ar = torch.arange(routing.shape[1], device=routing.device, dtype=torch.int64)
        return torch.where(routing, ar, torch.full_like(ar, -1))
    ids = routing.to(torch.int64)
    # ids outside [-1, E) are rejected by the op's checks; treat them as empty here so that even
    # an unchecked call never writes out of bounds.
    return torch.where((ids >= 0) & (ids < num_experts), ids, torch.full_like(ids, -1))


def _exclusive_cumsum(x: Tensor) -> Tensor:
    return torch.cumsum(x, 0) - x


def _rank_within_bucket(key: Tensor, num_buckets: int, order: Tensor) -> Tensor:
    """For positions sorted by ``order`` (stable sort on ``key``), each position's rank inside its
    bucket, scattered back to position order."""
    counts = torch.zeros(num_buckets, dtype=torch.int64, device=key.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    starts = _exclusive_cumsum(counts)
    sorted_rank = torch.arange(key.numel(), device=key.device) - starts[key[order]]
    rank = torch.empty_like(sorted_rank)
    rank[order] = sorted_rank
    return rank


def compute_row_id_map(routing: Tensor, probs: Optional[Tensor], num_experts: int,
                       capacity: Optional[int], align: int, num_out_tokens: Optional[int]
                       ) -> Tuple[Tensor, Tensor, Tensor, int]:
    """Returns ``(row_id_map [T,S] int32, tokens_per_expert [E] int64, group_sizes [E] int64, N)``."""
    T, S = routing.shape
    E = num_experts
    N = output_rows(T, S, E, capacity, align, num_out_tokens)
    ids = slot_expert_ids(routing, E).reshape(-1)
    valid = ids >= 0
    bucket = torch.where(valid, ids, torch.full_like(ids, E))  # empty slots go to bucket E

    if capacity is not None:
        if probs is not None:
            # Within an expert: highest prob first, ties by position (stable sorts).
            by_prob = torch.argsort(-probs.reshape(-1).float(), stable=True)
            order = by_prob[torch.argsort(bucket[by_prob], stable=True)]
        else:
            order = torch.argsort(bucket, stable=True)
        keep_rank = _rank_within_bucket(bucket, E + 1, order)
        valid = valid & (keep_rank < capacity)
        bucket = torch.where(valid, ids, torch.full_like(ids, E))

    counts = torch.zeros(E + 1, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))
    routed = counts[:E]
    if num_out_tokens is not None:
        # the first num_out_tokens routed slots in (expert, position) order: expert e keeps what is
        # left of the budget after the experts before it
        left = (num_out_tokens - _exclusive_cumsum(routed)).clamp(min=0)
        tokens_per_expert = torch.minimum(routed, left)
    else:
        tokens_per_expert = routed.clone()
    if capacity is not None:
        group_sizes = torch.full_like(tokens_per_expert, capacity)
    else:
        group_sizes = (tokens_per_expert + (align - 1)) // align * align
    group_start = _exclusive_cumsum(group_sizes)

    order = torch.argsort(bucket, stable=True)  # (expert, position) order
    rank = _rank_within_bucket(bucket, E + 1, order)
    expert = bucket.clamp(max=E - 1)  # E >= 1 (op contract); empty slots are masked by `valid`
    keep = valid & (rank < tokens_per_expert[expert])
    dest = group_start[expert] + rank  # < N: the groups of kept slots fit the static bound
    row_id_map = torch.where(keep, dest, torch.full_like(dest, -1)).to(torch.int32).reshape(T, S)
    return row_id_map, tokens_per_expert, group_sizes, N


def moe_permute(tokens: Tensor, routing: Tensor, probs: Optional[Tensor], num_experts: int,
                capacity: Optional[int], align: int, num_out_tokens: Optional[int]):
    """The op's positional signature (``torch.ops.<ns>.moe_permute``; ``None`` = not given)."""
    T, H = tokens.shape
    row_id_map, tokens_per_expert, group_sizes, N = compute_row_id_map(
        routing, probs, num_experts, capacity, align, num_out_tokens)
    flat_rows = row_id_map.reshape(-1).to(torch.int64)
    kept = flat_rows >= 0
    S = row_id_map.shape[1]
    src_token = torch.arange(T * S, device=tokens.device) // max(S, 1)

    # Dropped/empty slots are sent to a scratch row N (no boolean indexing: no host sync).
    dest = torch.where(kept, flat_rows, torch.full_like(flat_rows, N))
    out = torch.zeros(N + 1, H, dtype=tokens.dtype, device=tokens.device)
    out.index_copy_(0, dest, tokens.index_select(0, src_token))
    out = out[:N].clone()
    if probs is not None:
        out_probs = torch.zeros(N + 1, dtype=probs.dtype, device=probs.device)
        out_probs.index_copy_(0, dest, probs.reshape(-1))
        out_probs = out_probs[:N].clone()
    else:
        out_probs = torch.empty(0, dtype=torch.float32, device=tokens.device)
    return out, out_probs, row_id_map, tokens_per_expert, group_sizes
