"""Triton backend of ``moe_permute`` (specification: ``ascend_moe_ops/reference/moe_permute.py``).

Everything stays on the device and nothing synchronizes with the host: every size comes from the
argument shapes (``output_rows``).

**Row map** (``row_id_map``, ``tokens_per_expert``, ``group_sizes``).

* Dropless / ``align`` / ``num_out_tokens``: three small Triton kernels: per-block expert counts,
  a prefix over blocks and experts, and a stable rank inside each block (the same kind of scheme
  as TransformerEngine's multi-pass row-map kernels):

  1. ``_hist_kernel``: one program per block of ``BLOCK_P`` routing slots (flattened ``[T, K]`` in
     (token, slot) order, or ``[T, E]`` for a mask) counts the slots of each expert
     (``tl.histogram``) into ``counts [blocks, E]``;
  2. ``_scan_kernel``: one program scans ``counts`` over blocks (exclusive prefix per expert =
     where each block's slots of expert ``e`` start inside the expert's group), takes the totals,
     cuts them to the ``num_out_tokens`` budget in expert order (``tokens_per_expert``: what is
     left after the experts before ``e``), rounds those up to ``align`` (``group_sizes``) and
     prefix-sums them into the group starts;
  3. ``_dest_kernel``: one program per block again gives each slot its rank inside its expert,
     ``block_offset[block, e] + rank`` (``rank`` counts the earlier slots of the same expert in the
     block: a pairwise compare), and row ``group_start[e] + that rank`` when the rank is below the
     expert's kept count; ``-1`` for empty slots and for slots past ``num_out_tokens``.

  Every block is at most ``2**20`` elements (Triton's limit) for any ``E`` up to the documented
  ``2**20``: the histogram takes ``HIST_BINS - 1`` experts per program (a second grid dimension
  over the expert tiles) and the scan ``SCAN_TILE`` experts per step of a loop, carrying the
  routed slots and group rows of the earlier tiles as two scalars (one tile each for small ``E``).

  The result is stable (token order inside an expert) by construction, integer-exact and so
  bitwise equal to the reference (checked by the parity tests; no code is shared with it). Why not simply call the reference's torch code (which would
  also be correct and sync-free): it is about thirty small kernels, including a stable argsort of
  all ``T*K`` slots (a multi-pass radix sort on a GPU), in front of a data movement that is a
  single memory-bound pass. At T=4096, K=8, H=7680 bf16 that pass writes ~0.5 GB, i.e. roughly
  0.1 ms at an H200's ~4.8 TB/s (an estimate, not a measurement), so tens of launches of a few
  microseconds each would be a visible fraction; the three kernels here read the ids in two
  passes and a ``[T*K/BLOCK_P, E]`` int32 count table twice.
* ``capacity`` (drop-and-pad): the drop order needs, for each slot, its rank among the slots of
  its expert ordered by prob (highest first, ties by position; by position alone without
  probs). ``_capacity_keep_kernel`` counts it directly: one program per block of ``BLOCK_P``
  slots compares them with every slot (``CH`` at a time) and keeps a slot when fewer than ``C``
  slots of its expert beat it; dropped slots become empty (``-1``). The kept routing then goes
  through the three kernels above, with every group ``C`` rows (``group_start[e] = e * C``).
  This is ``P * P`` compares for ``P = T * K`` slots (a segmented sort would be
  ``P log P``): at T=4096, K=8 about 1.1e9 compares, a few milliseconds on a GPU by
  estimate (not measured); in exchange it is three short kernels, integer-exact, and computed
  here rather than taken from the reference, so the Triton-vs-reference parity test compares
  two independent row maps.

**Data movement** (Triton, rows copied bitwise in the token dtype):

* ``_mark_kernel`` flags the destination rows that some slot fills (``int8 [N]``);
* ``_permute_kernel``: one program per (``BLOCK_T`` source tokens, ``BLOCK_H`` columns) loads that
  tile of tokens once and, slot by slot, stores each token's piece to its kept destination row
  (and its prob, from the first column block): every token row is read once, every used output
  row written once;
* ``_zero_unused_kernel``: one program per (``BLOCK_R`` rows, ``BLOCK_H`` columns) writes zeros
  to the rows nobody fills (alignment/capacity padding, rows past the used ones), so the output
  is allocated with ``torch.empty`` and never written twice.

Row offsets are computed in 64 bits (``row * H`` passes 2**31 at DeepSeek-V3 shapes).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ascend_moe_ops.ops._contracts import output_rows  # the one row-count function

from ._utils import block_h, interpreted, launch, token_tile


@triton.jit
def _slot_experts(routing_ptr, offs, P, S, E, IS_MASK: tl.constexpr):
    """Expert id (int32) of the slots at flat positions ``offs``; -1 if empty, out of range or
    past the ``P`` slots. Mask routing is read as uint8: slot (t, e) of a set bit is expert e."""
    inside = offs < P
    v = tl.load(routing_ptr + offs, mask=inside, other=0)
    if IS_MASK:
        e = tl.where(inside & (v != 0), offs % S, -1)
    else:
        # compare in the id's own width before narrowing (int64 ids may be huge when unchecked)
        e = tl.where(inside & (v >= 0) & (v < E), v, -1)
    return e.to(tl.int32)


@triton.jit
def _hist_kernel(routing_ptr, counts_ptr, P, S, E,
                 IS_MASK: tl.constexpr, BLOCK_P: tl.constexpr, E_BINS: tl.constexpr):
    """Program (block, tile): the counts of the block's slots for the ``E_BINS - 1`` experts of
    the tile (one tile when ``E < E_BINS``)."""
    pid = tl.program_id(0)
    e0 = tl.program_id(1) * (E_BINS - 1)  # this program's experts: [e0, e0 + E_BINS - 1)
    offs = pid.to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
    local = _slot_experts(routing_ptr, offs, P, S, E, IS_MASK) - e0
    # empty slots and the other tiles' experts go to the last bin, which no expert of the tile uses
    hist = tl.histogram(tl.where((local >= 0) & (local < E_BINS - 1), local, E_BINS - 1), E_BINS)
    bins = tl.arange(0, E_BINS)
    tl.store(counts_ptr + pid.to(tl.int64) * E + e0 + bins, hist,
             mask=(bins < E_BINS - 1) & (e0 + bins < E))


@triton.jit
def _prob_key(p):
    """An int32 key ordered as the fp32 probs (-0.0 equal to 0.0), with NaN below every number: the
    reference's stable sort of -probs puts NaN last (ties among NaNs: by position)."""
    b = tl.where(p == 0.0, 0, p.to(tl.int32, bitcast=True))
    k = b ^ ((b >> 31) & 0x7FFFFFFF)
    return tl.where(p != p, -2147483647 - 1, k)


@triton.jit
def _capacity_keep_kernel(routing_ptr, probs_ptr, kept_ptr, P, S, E, C,
                          IS_MASK: tl.constexpr, HAS_PROBS: tl.constexpr, BLOCK_P: tl.constexpr,
                          CH: tl.constexpr):
    """``kept[i]`` = expert of slot ``i`` if fewer than ``C`` slots of that expert beat it (higher
    prob, or equal prob and earlier position, a NaN prob below every number; without probs: earlier
    position), else -1."""
    pid = tl.program_id(0)
    idx = pid.to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
    e = _slot_experts(routing_ptr, idx, P, S, E, IS_MASK)
    if HAS_PROBS:
        p = _prob_key(tl.load(probs_ptr + idx, mask=idx < P, other=0.0).to(tl.float32))
    beaten = tl.zeros([BLOCK_P], dtype=tl.int32)
    for j0 in range(0, P, CH):
        jdx = j0 + tl.arange(0, CH).to(tl.int64)
        ej = _slot_experts(routing_ptr, jdx, P, S, E, IS_MASK)
        earlier = jdx[None, :] < idx[:, None]
        if HAS_PROBS:
            pj = _prob_key(tl.load(probs_ptr + jdx, mask=jdx < P, other=0.0).to(tl.float32))
            beats = (pj[None, :] > p[:, None]) | ((pj[None, :] == p[:, None]) & earlier)
        else:
            beats = earlier
        beats = beats & (ej[None, :] == e[:, None]) & (ej[None, :] >= 0)
        beaten += tl.sum(beats.to(tl.int32), axis=1)
    keep = (e >= 0) & (beaten < C)
    tl.store(kept_ptr + idx, tl.where(keep, e, -1), mask=idx < P)


@triton.jit
def _scan_kernel(counts_ptr, offsets_ptr, tpe_ptr, gs_ptr, gstart_ptr, num_blocks, E, align,
                 group_rows, limit, FIXED_GROUPS: tl.constexpr, E_TILE: tl.constexpr,
                 CH: tl.constexpr):
    """Per expert: where each block's slots start inside the expert (``offsets``), the kept count
    (``tpe``: the first ``limit`` slots in expert order are kept), the group size (kept rounded up
    to ``align``, or ``group_rows`` for every group when ``FIXED_GROUPS``) and the group start.
    The experts are taken ``E_TILE`` at a time, in order; what crosses tiles (the routed slots and
    the group rows of the experts before the tile) is carried as two scalars."""
    zero = tl.sum(tl.zeros([E_TILE], dtype=tl.int32), axis=0)
    slots_before = zero  # routed slots of the experts of the earlier tiles
    rows_before = zero   # group rows of the experts of the earlier tiles
    for e0 in range(0, E, E_TILE):
        cols = e0 + tl.arange(0, E_TILE)
        cmask = cols < E
        run = tl.zeros([E_TILE], dtype=tl.int32)
        for b0 in range(0, num_blocks, CH):
            blk = b0 + tl.arange(0, CH)
            m = (blk < num_blocks)[:, None] & cmask[None, :]
            ptrs = blk.to(tl.int64)[:, None] * E + cols[None, :]
            c = tl.load(counts_ptr + ptrs, mask=m, other=0)
            tl.store(offsets_ptr + ptrs, tl.cumsum(c, axis=0) - c + run[None, :], mask=m)
            run += tl.sum(c, axis=0)
        # num_out_tokens: expert e keeps what is left of the budget after the experts before it
        kept = tl.minimum(run, tl.maximum(limit - (slots_before + tl.cumsum(run, axis=0) - run), 0))
        gs = (kept + (align - 1)) // align * align
        if FIXED_GROUPS:  # drop-and-pad: every group is exactly `capacity` rows
            gs = tl.zeros([E_TILE], dtype=tl.int32) + group_rows
        gs = tl.where(cmask, gs, 0)  # columns past E carry nothing into the next tile
        tl.store(tpe_ptr + cols, kept.to(tl.int64), mask=cmask)
        tl.store(gs_ptr + cols, gs.to(tl.int64), mask=cmask)
        tl.store(gstart_ptr + cols, rows_before + tl.cumsum(gs, axis=0) - gs, mask=cmask)
        slots_before += tl.sum(run, axis=0)
        rows_before += tl.sum(gs, axis=0)


@triton.jit
def _dest_kernel(routing_ptr, offsets_ptr, tpe_ptr, gstart_ptr, map_ptr, P, S, E,
                 IS_MASK: tl.constexpr, BLOCK_P: tl.constexpr, CH: tl.constexpr):
    pid = tl.program_id(0)
    base = pid.to(tl.int64) * BLOCK_P
    idx = tl.arange(0, BLOCK_P)
    e = _slot_experts(routing_ptr, base + idx, P, S, E, IS_MASK)
    # rank of each slot among the earlier slots of the same expert in this block
    rank = tl.zeros([BLOCK_P], dtype=tl.int32)
    for j0 in range(0, BLOCK_P, CH):
        jdx = j0 + tl.arange(0, CH)
        ej = _slot_experts(routing_ptr, base + jdx, P, S, E, IS_MASK)
        same = (e[:, None] == ej[None, :]) & (jdx[None, :] < idx[:, None])
        rank += tl.sum(same.to(tl.int32), axis=1)
    valid = e >= 0
    start = tl.load(gstart_ptr + e, mask=valid, other=0)
    off = tl.load(offsets_ptr + pid.to(tl.int64) * E + e, mask=valid, other=0)
    kept = tl.load(tpe_ptr + e, mask=valid, other=0)
    keep = valid & (off + rank < kept)  # its rank inside the expert is within the kept count
    tl.store(map_ptr + base + idx, tl.where(keep, start + off + rank, -1), mask=base + idx < P)


@triton.jit
def _mark_kernel(map_ptr, used_ptr, P, N, BLOCK_P: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
    inside = offs < P
    row = tl.load(map_ptr + offs, mask=inside, other=-1).to(tl.int64)
    ok = inside & (row >= 0) & (row < N)
    tl.store(used_ptr + row, tl.full([BLOCK_P], 1, tl.int8), mask=ok)


@triton.jit
def _permute_kernel(tok_ptr, map_ptr, probs_ptr, out_ptr, out_probs_ptr, T, S, H,
                    HAS_PROBS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    toks = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    tm = toks < T
    hb = tl.program_id(1)
    cols = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = cols < H
    x = tl.load(tok_ptr + toks[:, None] * H + cols[None, :], mask=tm[:, None] & hm[None, :])
    for s in range(S):
        rows = tl.load(map_ptr + toks * S + s, mask=tm, other=-1).to(tl.int64)
        keep = rows >= 0
        tl.store(out_ptr + rows[:, None] * H + cols[None, :], x, mask=keep[:, None] & hm[None, :])
        if HAS_PROBS:
            if hb == 0:
                p = tl.load(probs_ptr + toks * S + s, mask=keep)
                tl.store(out_probs_ptr + rows, p, mask=keep)


@triton.jit
def _zero_unused_kernel(used_ptr, out_ptr, out_probs_ptr, N, H,
                        HAS_PROBS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    hb = tl.program_id(1)
    cols = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    inside = rows < N
    unused = inside & (tl.load(used_ptr + rows, mask=inside, other=1) == 0)
    zeros = tl.zeros([BLOCK_R, BLOCK_H], dtype=out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows[:, None] * H + cols[None, :], zeros,
             mask=unused[:, None] & (cols < H)[None, :])
    if HAS_PROBS:
        if hb == 0:
            tl.store(out_probs_ptr + rows,
                     tl.zeros([BLOCK_R], dtype=out_probs_ptr.dtype.element_ty), mask=unused)


def _block_p(t: torch.Tensor, num_experts: int = 0) -> int:
    # GPU: 128 slots per program keeps the pairwise rank tile at 128 x 32; interpreter: one or
    # two programs for the test shapes. Above 4096 experts (GPU) 1024 slots per program, so the
    # [blocks, E] int32 count and offset tables stay smaller (P / 1024 * E * 4 bytes each:
    # 128 MiB at P = 32768 slots, E = 2**20).
    if interpreted(t):
        return 1024
    return 128 if num_experts <= 4096 else 1024


# Expert tiles of the row-map kernels (every block at most 2**20 elements, Triton's limit, for
# any E up to the documented 2**20): the histogram takes HIST_BINS - 1 experts per program (a
# second grid dimension over the tiles), the scan SCAN_TILE experts per step of its loop.
HIST_BINS = 4096
SCAN_TILE = 2048
SCAN_TILE_INTERPRETED = 4096


def used_rows(row_id_map: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``int8 [num_rows]``: 1 where some slot of ``row_id_map`` points."""
    used = torch.zeros(num_rows, dtype=torch.int8, device=row_id_map.device)
    P = row_id_map.numel()
    bp = _block_p(row_id_map)
    launch(_mark_kernel, (triton.cdiv(P, bp),), row_id_map, used, P, num_rows, BLOCK_P=bp)
    return used


def zero_unused_rows(used: torch.Tensor, out: torch.Tensor, out_probs) -> None:
    """Write zeros to the rows of ``out`` [N, H] (and entries of ``out_probs`` [N]) not ``used``."""
    N, H = out.shape
    bh = block_h(H, out)
    # GPU: 4 x 1024 elements per program; interpreter: few programs
    br = 64 if interpreted(out) else max(1, 4096 // bh)
    has_probs = out_probs is not None
    launch(_zero_unused_kernel, (triton.cdiv(N, br), max(1, triton.cdiv(H, bh))), used, out,
           out_probs if has_probs else out, N, H, HAS_PROBS=has_probs, BLOCK_R=br, BLOCK_H=bh)


def _row_map_dropless(routing: torch.Tensor, E: int, align: int, limit: int,
                      capacity: Optional[int] = None):
    """Row map of the slots of ``routing`` (ids or mask): the first ``limit`` slots in expert order
    are kept, groups rounded up to ``align`` (or exactly ``capacity`` rows each)."""
    T, S = routing.shape
    P = T * S
    dev = routing.device
    is_mask = routing.dtype == torch.bool
    r = routing.view(torch.uint8) if is_mask else routing
    bp = _block_p(routing, E)
    nb = triton.cdiv(P, bp)
    counts = torch.empty(nb, E, dtype=torch.int32, device=dev)
    # at least 64 bins: Triton's GPU histogram gives every lane of a (32- or 64-wide) warp a bin;
    # at most HIST_BINS, the experts then split over a second grid dimension (one tile when E < 4096)
    e_bins = min(max(64, triton.next_power_of_2(E + 1)), HIST_BINS)
    launch(_hist_kernel, (nb, triton.cdiv(E, e_bins - 1)), r, counts, P, S, E, IS_MASK=is_mask,
           BLOCK_P=bp, E_BINS=e_bins)
    offsets = torch.empty(nb, E, dtype=torch.int32, device=dev)
    tpe = torch.empty(E, dtype=torch.int64, device=dev)
    gs = torch.empty(E, dtype=torch.int64, device=dev)
    gstart = torch.empty(E, dtype=torch.int32, device=dev)
    if interpreted(routing):
        e_tile, ch = min(triton.next_power_of_2(E), SCAN_TILE_INTERPRETED), 64
    else:
        e_tile = min(triton.next_power_of_2(E), SCAN_TILE)
        ch = max(2, min(64, 2048 // e_tile))  # a CH x E_TILE chunk of <= 2048 counts: no spill on sm_80
    _scan_kernel[(1,)](counts, offsets, tpe, gs, gstart, nb, E, align, capacity or 0, limit,
                       FIXED_GROUPS=capacity is not None, E_TILE=e_tile, CH=ch)
    row_id_map = torch.empty(T, S, dtype=torch.int32, device=dev)
    launch(_dest_kernel, (nb,), r, offsets, tpe, gstart, row_id_map, P, S, E, IS_MASK=is_mask,
           BLOCK_P=bp, CH=min(bp, 256 if interpreted(routing) else max(1, 4096 // bp)))  # GPU: 4096-pair tiles
    return row_id_map, tpe, gs


def _row_map_capacity(routing: torch.Tensor, probs, E: int, capacity: int):
    """Capacity mode: drop the slots that lose their expert's top-``capacity`` (Triton), then the
    dropless row map of the kept slots with ``capacity`` rows per group."""
    T, S = routing.shape
    P = T * S
    is_mask = routing.dtype == torch.bool
    r = routing.view(torch.uint8) if is_mask else routing
    kept = torch.empty(T, S, dtype=torch.int32, device=routing.device)
    bp = _block_p(routing)
    has_probs = probs is not None
    launch(_capacity_keep_kernel, (triton.cdiv(P, bp),), r, probs if has_probs else r, kept, P, S,
           E, capacity, IS_MASK=is_mask, HAS_PROBS=has_probs, BLOCK_P=bp,
           CH=min(bp, 256 if interpreted(routing) else 32))
    return _row_map_dropless(kept, E, 1, P, capacity=capacity)


def moe_permute(tokens: torch.Tensor, routing: torch.Tensor, probs, num_experts: int,
                capacity: Optional[int], align: int, num_out_tokens: Optional[int]):
    """Positional signature of ``torch.ops.ascend_moe_ops.moe_permute``; returns
    ``(tokens [N,H], probs [N] or [0], row_id_map [T,S] int32, tokens_per_expert [E] int64,
    group_sizes [E] int64)``, bitwise equal to the reference."""
    tokens = tokens.contiguous()
    routing = routing.contiguous()
    probs = probs.contiguous() if probs is not None else None
    T, H = tokens.shape
    S = routing.shape[1]
    E = num_experts
    N = output_rows(T, S, E, capacity, align, num_out_tokens)
    if capacity is not None:
        row_id_map, tpe, gs = _row_map_capacity(routing, probs, E, capacity)
    else:
        limit = T * S if num_out_tokens is None else min(num_out_tokens, T * S)
        row_id_map, tpe, gs = _row_map_dropless(routing, E, align, limit)

    out = torch.empty(N, H, dtype=tokens.dtype, device=tokens.device)
    if probs is not None:
        out_probs = torch.empty(N, dtype=probs.dtype, device=tokens.device)
    else:
        out_probs = torch.empty(0, dtype=torch.float32, device=tokens.device)
    has_probs = probs is not None
    bt, bh = token_tile(H, tokens)
    launch(_permute_kernel, (triton.cdiv(T, bt), max(1, triton.cdiv(H, bh))), tokens, row_id_map,
           probs if has_probs else tokens, out, out_probs if has_probs else out, T, S, H,
           HAS_PROBS=has_probs, BLOCK_T=bt, BLOCK_H=bh)
    zero_unused_rows(used_rows(row_id_map, N), out, out_probs if has_probs else None)
    return out, out_probs, row_id_map, tpe, gs
