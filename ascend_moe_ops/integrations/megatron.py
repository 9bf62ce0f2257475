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
  autograd): one pass, no ``[N, H]`` fp32 temporaries. On the CPU the dropless ``permute`` and
  ``sort_chunks_by_idxs`` are one call each into the internal native kernels of
  :mod:`ascend_moe_ops.ops.megatron_paths` (``mask_permute``, ``sort_chunks``). The weighted sum in ``unpermute`` is
  accumulated in fp32 in a fixed order and rounded once, so low-precision results can differ from
  Megatron's (which rounds after each scatter-add in the token dtype, or returns the fp32 sum when
  ``probs`` is fp32) in the last bits; the gradients likewise.
* ``fused`` is accepted and ignored: this path is always the fused one (:func:`patch` also makes
  Megatron's ``moe_permute_fusion=True`` config check pass, see :data:`FUSED_NAMES`). (Megatron's
  ``fused=True`` path returns TransformerEngine's own index format instead of ``sorted_indices``;
  here the pair ``permute``/``unpermute`` of this module always exchange ``sorted_indices``.)
* ``num_out_tokens`` must equal the number of routed slots when given (it does in every Megatron
  dispatcher); then ``permute`` needs no host synchronization. Without it, ``permute`` counts the
  routed slots with one host sync -- the same one Megatron's ``masked_select`` makes.
* ``unpermute`` without ``routing_map`` (allowed when ``probs`` is ``None``) makes one host sync
  to size its internal map; pass ``routing_map`` to avoid it (every Megatron dispatcher does).
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from .. import active_backend
from ..ops import checks as _checks
from ..ops import megatron_paths as _paths
from ..ops.moe_permute import moe_permute
from ..ops.moe_unpermute import moe_unpermute, moe_unpermute_backward

Tensor = torch.Tensor

__all__ = ["permute", "unpermute", "sort_chunks_by_idxs", "sorted_indices_from_row_id_map",
           "row_id_map_from_sorted_indices", "patch", "unpatch", "patched", "is_patched", "PatchReport",
           "call_counts", "PATCHABLE", "SUPPORTED_MEGATRON_CORE", "FUSED_NAMES"]

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


_TOKEN_OF_SLOT = {}  # (T, S) -> int64 [T*S] token of each slot of a [T, S] map (cpu, last shape only)


def _sorted_indices_of_map(row_id_map: Tensor, num_rows: int) -> Tensor:
    """:func:`sorted_indices_from_row_id_map` for a cpu map whose every row is filled (permute's
    dropless output): one scatter, with the slot -> token index cached per shape."""
    T, S = row_id_map.shape
    key = (T, S)
    tok = _TOKEN_OF_SLOT.get(key)
    if tok is None:
        _TOKEN_OF_SLOT.clear()
        tok = _TOKEN_OF_SLOT[key] = torch.arange(T, dtype=torch.int64).repeat_interleave(S)
    rows = row_id_map.reshape(-1).to(torch.int64)
    rows.masked_fill_(rows < 0, num_rows)  # not-routed slots go to a scratch entry
    out = torch.empty(num_rows + 1, dtype=torch.int64)
    out.index_copy_(0, rows, tok)
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
        return moe_unpermute_backward(tokens, standin, row_id_map, None)[0]

    @staticmethod
    def backward(ctx, grad):
        (row_id_map,) = ctx.saved_tensors
        return moe_unpermute(grad, row_id_map, None), None, None


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
    if (type(tokens) is Tensor and type(routing_map) is Tensor and (probs is None or type(probs) is Tensor)
            and not (drop_and_pad and num_out_tokens is not None) and _native_cpu(tokens)):
        # The dropless path on the CPU: one native call (mask compaction, row order, rows, probs,
        # sorted_indices); it checks its arguments itself.
        mask = routing_map if routing_map.dtype == torch.bool else _as_mask(routing_map, tokens.device)
        n = num_out_tokens
        if n is not None and type(n) is not int:
            n = _as_int("num_out_tokens", n)
        out, pp, si, row_id_map, ids = _paths.mask_permute(tokens, mask, probs, n)
        _remember(si, row_id_map, ids, routing_map, False, si.shape[0])
        return out, (pp if probs is not None else None), si

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
        si = sorted_indices_from_row_id_map(row_id_map, N)
        _remember(si, row_id_map, None, routing_map, True, N)
        return out, permuted_probs, si

    if device.type == "cpu" and not _checks.is_fake(mask):
        # On the CPU a host read costs nothing: compact the [T, E] mask to [T, S] expert ids
        # (S = most experts of a token, = top-k), so the kernels touch T*S slots, not T*E (each
        # slot pass over a random mask costs a branch miss: measured at T=256, E=64, the native
        # kernel's fixed cost is ~50 us with [T, 8] ids vs ~350 us with the [T, 64] mask).
        ids, counts = _compact_routing(mask)
        used = int(counts.sum())
        if num_out_tokens is not None:
            n = _as_int("num_out_tokens", num_out_tokens)
            if used != n:
                raise ValueError(f"num_out_tokens={n} must equal the {used} routed slots "
                                 "of routing_map (Megatron's unfused path returns exactly them)")
        S = ids.shape[1]
        full = used == T * S  # no -1 slot (top-k routing): fewer small ops
        if full:
            slot_probs = probs.gather(1, ids) if probs is not None else None
        else:
            slot_probs = _slot_probs(probs, ids)
        res = moe_permute(tokens, ids, slot_probs, num_experts=E, num_out_tokens=used, map_type="index")
        # sorted_indices from the kernel's row map by one scatter (a stable argsort of the ids,
        # as before 2026-12-02, cost ~350 us at T=256)
        si = _sorted_indices_of_map(res.row_id_map, used)
        _remember(si, res.row_id_map, ids, routing_map, False, used)
        return res.tokens, res.probs, si

    if num_out_tokens is None:
        n = int(mask.sum())  # host sync: the one Megatron's masked_select makes
    else:
        n = _as_int("num_out_tokens", num_out_tokens)
        if not _checks.is_fake(mask):
            torch._assert_async(mask.sum() == n, "num_out_tokens must equal the routed slots of routing_map")
    res = moe_permute(tokens, mask, probs, num_out_tokens=n)
    si = sorted_indices_from_row_id_map(res.row_id_map, n)
    _remember(si, res.row_id_map, None, routing_map, False, n)
    return res.tokens, res.probs, si


def _native_cpu(t: Tensor) -> bool:
    """Whether the adapter's native kernels run for cpu tensor ``t``: ``moe_permute`` and the
    adapter's internal ops run on the native backend (not another one forced by ``use_backend``)."""
    return (t.device.type == "cpu" and active_backend("moe_permute", "cpu") == "native"
            and active_backend(_paths.PERMUTE, "cpu") == "native")


class _PermuteRecord:
    """What :func:`permute` knew, kept on the ``sorted_indices`` it returned so that
    :func:`unpermute` of the same rows skips rebuilding the row map from ``sorted_indices``."""
    __slots__ = ("row_id_map", "ids", "mask", "drop_and_pad", "num_rows")

    def __init__(self, row_id_map, ids, mask, drop_and_pad, num_rows):
        self.row_id_map, self.ids, self.mask = row_id_map, ids, mask
        self.drop_and_pad, self.num_rows = drop_and_pad, num_rows


def _remember(si: Tensor, row_id_map: Tensor, ids: Optional[Tensor], mask: Tensor, drop_and_pad: bool,
              num_rows: int) -> None:
    try:
        si._amo_permute = _PermuteRecord(row_id_map, ids, mask, drop_and_pad, num_rows)
    except (AttributeError, RuntimeError):  # a tensor subclass without __dict__
        pass


# ATen runs an op on the calling thread when it has at most this many elements (GRAIN_SIZE).
# _compact_routing works on row blocks of that size: waking a second thread costs far more than
# the whole compaction when the cores are shared (measured here, T=2048, E=64, load average ~20:
# mask.nonzero() 48 ms on two threads vs 0.3 ms on one).
_INLINE_ELEMENTS = 32768


def _compact_routing(mask: Tensor) -> Tuple[Tensor, Tensor]:
    """``[T, E]`` mask -> ``(ids [T, S] int64, counts [T])``: the routed experts of each token in
    ascending order (the mask's slot order), ``-1``-padded to ``S = counts.max()``."""
    T, E = mask.shape
    block = max(1, _INLINE_ELEMENTS // max(E, 1))
    if T <= block:
        return _compact_block(mask)
    parts = [_compact_block(mask[i:i + block]) for i in range(0, T, block)]
    S = max(p[0].shape[1] for p in parts)
    ids = [p[0] if p[0].shape[1] == S else torch.nn.functional.pad(p[0], (0, S - p[0].shape[1]), value=-1)
           for p in parts]
    return torch.cat(ids), torch.cat([p[1] for p in parts])


def _compact_block(mask: Tensor) -> Tuple[Tensor, Tensor]:
    T, E = mask.shape
    nz = mask.nonzero()  # row-major: token order, ascending expert inside a token
    n = nz.shape[0]
    counts = torch.bincount(nz[:, 0], minlength=T) if n else torch.zeros(T, dtype=torch.int64, device=mask.device)
    S = int(counts.max()) if n else 0
    if S == 0:
        return torch.empty((T, 0), dtype=torch.int64, device=mask.device), counts
    if n == S * T:  # every token has S experts (top-k routing): a plain reshape
        return nz[:, 1].reshape(T, S), counts
    t, e = nz[:, 0], nz[:, 1]
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.arange(n, device=mask.device) - starts.index_select(0, t)
    ids = torch.full((T, S), -1, dtype=torch.int64, device=mask.device)
    ids[t, slot] = e
    return ids, counts


def _slot_probs(probs: Optional[Tensor], ids: Tensor) -> Optional[Tensor]:
    """Dense ``[T, E]`` probs -> ``[T, S]`` probs of the slots of ``ids`` (0 for ``-1`` slots)."""
    if probs is None:
        return None
    if ids.shape[1] == 0:
        return probs[:, :0]
    g = probs.gather(1, ids.clamp_min(0))
    return torch.where(ids >= 0, g, torch.zeros((), dtype=g.dtype))


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
    rec = getattr(sorted_indices, "_amo_permute", None)
    if (rec is not None and rec.num_rows == N and rec.row_id_map.shape[0] == T
            and rec.drop_and_pad == bool(drop_and_pad)
            and (routing_map is rec.mask or (routing_map is None and probs is None))):
        # the rows permute() produced, with the routing it saw: reuse its row map
        if probs is not None:
            _checks.check_tensor("probs", probs, dtypes=_checks.FLOAT_DTYPES, device=device)
            _checks.check_shape("probs", probs, rec.mask.shape, "the shape of routing_map")
            probs = probs if rec.ids is None else _slot_probs(probs, rec.ids)
        return moe_unpermute(permuted_tokens, rec.row_id_map, probs)

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


class _SortChunks(torch.autograd.Function):
    """``out = input[index]`` for a row permutation ``index``; backward scatters the gradient back
    (``grad_in[index] = grad``: every row is written once, as ``index`` is a permutation)."""

    @staticmethod
    def forward(ctx, inp, index):
        ctx.save_for_backward(index)
        return inp.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        return torch.empty_like(grad).index_copy_(0, index, grad), None


def _gather_rows(t: Tensor, index: Tensor) -> Tensor:
    if t.requires_grad and torch.is_grad_enabled():
        return _SortChunks.apply(t, index)
    return t.index_select(0, index)  # no graph to record: skip the autograd.Function


def _chunk_index_host(sizes, order, num_rows: int) -> Tensor:
    """The gather index of the chunk permutation from host lists (cpu: reading the sizes is free)."""
    src_start, run = [], 0
    for n in sizes:
        src_start.append(run)
        run += n
    out_sizes = [sizes[j] for j in order]
    shift, run = [], 0
    for j, n in zip(order, out_sizes):
        shift.append(src_start[j] - run)
        run += n
    index = torch.arange(num_rows, dtype=torch.int64)
    if any(shift):
        index += torch.repeat_interleave(torch.tensor(shift, dtype=torch.int64),
                                         torch.tensor(out_sizes, dtype=torch.int64), output_size=num_rows)
    return index


def _chunk_index(split_sizes: Tensor, sorted_idxs: Tensor, num_rows: int, device) -> Tensor:
    sizes = split_sizes.to(device=device, dtype=torch.int64)
    order = sorted_idxs.to(device=device, dtype=torch.int64)
    src_start = torch.cumsum(sizes, 0) - sizes
    out_sizes = sizes.index_select(0, order)
    out_start = torch.cumsum(out_sizes, 0) - out_sizes
    shift = (src_start.index_select(0, order) - out_start)
    index = torch.arange(num_rows, device=device, dtype=torch.int64) + torch.repeat_interleave(
        shift, out_sizes, output_size=num_rows)
    return index


def sort_chunks_by_idxs(input: Tensor, split_sizes: Tensor, sorted_idxs: Tensor,
                        probs: Optional[Tensor] = None, fused: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
    """Megatron-Core's ``moe_utils.sort_chunks_by_idxs``: split ``input`` (and ``probs``) into
    chunks of ``split_sizes`` rows and concatenate them in the order ``sorted_idxs``.

    One gather (no per-chunk split/cat); its backward is one scatter. On the CPU the gather index is
    built from the sizes read on the host (free there; Megatron's own path reads them too), on other
    devices with tensor ops (no host sync). ``fused`` is accepted and ignored. ``split_sizes`` must add up to the
    rows of ``input`` and ``sorted_idxs`` must be a permutation of the chunks (as in every
    Megatron dispatcher).

    Returns:
        ``(output [N, ...], permuted probs or None)``.
    """
    del fused
    if (type(input) is Tensor and type(split_sizes) is Tensor and type(sorted_idxs) is Tensor
            and (probs is None or type(probs) is Tensor) and _native_cpu(input)
            and split_sizes.device.type == "cpu" and sorted_idxs.device.type == "cpu"):
        # one native call: a memcpy per chunk (it checks its arguments itself); backward: the same
        # kernel with the inverse order
        out, pp = _paths.sort_chunks(input, split_sizes, sorted_idxs, probs, False)
        return out, (pp if probs is not None else None)
    _checks.check_tensor("input", input)
    if input.dim() < 1:
        raise ValueError("input must have at least one dimension")
    _checks.check_tensor("split_sizes", split_sizes, ndim=1, dtypes=_checks.INDEX_DTYPES)
    _checks.check_tensor("sorted_idxs", sorted_idxs, ndim=1, dtypes=_checks.INDEX_DTYPES)
    if sorted_idxs.numel() != split_sizes.numel():
        raise ValueError(f"sorted_idxs must have one entry per chunk ({split_sizes.numel()}), "
                         f"got {sorted_idxs.numel()}")
    N = input.shape[0]
    if probs is not None:
        _checks.check_tensor("probs", probs, device=input.device)
        if probs.shape[0] != N:
            raise ValueError(f"probs must have one entry per row of input ({N}), got shape {tuple(probs.shape)}")
    host = (input.device.type == "cpu" and split_sizes.device.type == "cpu" and sorted_idxs.device.type == "cpu"
            and not (_checks.is_fake(split_sizes) or _checks.is_fake(sorted_idxs) or _checks.is_fake(input)))
    if host:
        sizes, order = split_sizes.tolist(), sorted_idxs.tolist()
        if sum(sizes) != N or min(sizes, default=0) < 0:
            raise ValueError(f"split_sizes must add up to the {N} rows of input (none negative), got {sizes}")
        if sorted(order) != list(range(len(sizes))):
            raise ValueError(f"sorted_idxs must be a permutation of the {len(sizes)} chunks, got {order}")
        index = _chunk_index_host(sizes, order, N)
    else:
        if split_sizes.device.type == "cpu" and not _checks.is_fake(split_sizes):
            total = int(split_sizes.sum())
            if total != N:
                raise ValueError(f"split_sizes must add up to the {N} rows of input, got {total}")
        index = _chunk_index(split_sizes, sorted_idxs, N, input.device)
    out = _gather_rows(input, index)
    permuted_probs = _gather_rows(probs, index) if probs is not None else None
    return out, permuted_probs


# ================================================================ patch(): rebind Megatron-Core
import contextlib as _contextlib
import importlib as _importlib
import importlib.abc as _importlib_abc
import inspect as _inspect
import sys as _sys
import threading as _threading

_MOE_UTILS = "megatron.core.transformer.moe.moe_utils"
_GG_UTIL = "megatron.core.transformer.moe.grouped_gemm_util"

# parameter lists of the functions this module replaces, as of the megatron-core versions checked
_KNOWN_SIGNATURES = {
    "permute": ("tokens", "routing_map", "probs", "num_out_tokens", "fused", "drop_and_pad"),
    "unpermute": ("permuted_tokens", "sorted_indices", "restore_shape", "probs", "routing_map",
                  "fused", "drop_and_pad"),
    "sort_chunks_by_idxs": ("input", "split_sizes", "sorted_idxs", "probs", "fused"),
}
#: the one megatron-core version :func:`patch` accepts (Megatron-LM's main branch already changes
#: ``permute`` / ``unpermute``); every other version is refused with this in the message
SUPPORTED_MEGATRON_CORE = "0.16.1"
PATCHABLE = ("permute", "unpermute", "sort_chunks_by_idxs", "grouped_gemm", "activation")
_EXPERTS = "megatron.core.transformer.moe.experts"
# GroupedMLP.forward parameters as of the checked megatron-core versions
_GROUPED_MLP_FORWARD = ("self", "permuted_local_hidden_states", "tokens_per_expert", "permuted_probs")

#: calls into this package made through the patched names, by target (reset by :func:`patch`)
call_counts = {name: 0 for name in PATCHABLE}


def _counted(name, fn):
    def wrapper(*args, **kwargs):
        call_counts[name] += 1
        return fn(*args, **kwargs)
    wrapper.__name__ = getattr(fn, "__name__", name)
    wrapper.__qualname__ = getattr(fn, "__qualname__", name)
    wrapper.__doc__ = fn.__doc__
    wrapper.__wrapped__ = fn
    wrapper._amo_patch_of = name
    return wrapper


def _counted_gg():
    from . import grouped_gemm as gg
    mod = type(gg)("ascend_moe_ops.integrations.grouped_gemm (counted)")
    mod.ops = type(gg)(gg.ops.__name__)
    mod.ops.gmm = _counted("grouped_gemm", gg.gmm)
    mod.backend = gg.backend
    mod.__file__ = getattr(gg, "__file__", None)
    return mod


class PatchReport(dict):
    """``{target: ["module.attribute", ...]}`` of the names :func:`patch` rebound (also those
    rebound later in modules imported after the call)."""

    def __str__(self):
        lines = [f"megatron-core {megatron_core_version()}: patched"]
        for k, v in self.items():
            lines.append(f"  {k}: {', '.join(v) if v else '(nothing held it)'}")
        return "\n".join(lines)


class _State:
    lock = _threading.RLock()
    active = False
    replacements = {}        # id(original) -> (target, original, replacement)
    gg_original = None       # (had_attr, grouped_gemm attr, ops attr) of grouped_gemm_util
    gg_replacement = None
    undo = []                # (module, attribute, original value)
    report = PatchReport()
    hook = None
    targets = ()
    by_replacement = {}      # id(replacement) -> (target, original, replacement)
    grouped_mlp = None       # (GroupedMLP class, its original forward) while "activation" is patched
    act_instances = None     # GroupedMLP instance -> its own activation_func_with_probs closure
    recorded = set()         # (id(module), attribute) already in undo
    fused_undo = []          # (name, had it, value) of the TransformerEngine names set in moe_utils
    watched = set()          # ids of every original and replacement (the scan's quick test)


def megatron_core_version() -> str:
    try:
        import importlib.metadata as md
        return md.version("megatron-core")
    except Exception:  # not installed as a distribution (a source checkout)
        mod = _sys.modules.get("megatron.core.package_info")
        return getattr(mod, "__version__", "unknown")


def _check_version() -> None:
    installed = megatron_core_version()
    if installed.split("+")[0] != SUPPORTED_MEGATRON_CORE:  # a local build tag (+...) is the same release
        raise RuntimeError(
            f"ascend_moe_ops.integrations.megatron.patch() supports megatron-core {SUPPORTED_MEGATRON_CORE} "
            f"only, but megatron-core {installed!r} is installed (other versions change the functions it "
            "replaces: Megatron-LM's main branch already changes permute/unpermute); refusing to patch. "
            f"Install the supported version: pip install megatron-core=={SUPPORTED_MEGATRON_CORE}")


def _check_signature(name: str, fn) -> None:
    try:
        params = tuple(_inspect.signature(fn).parameters)
    except (TypeError, ValueError) as exc:
        raise RuntimeError(f"cannot read the signature of megatron-core's {name} ({exc})") from exc
    want = _KNOWN_SIGNATURES[name]
    if params != want:
        raise RuntimeError(
            f"megatron-core {megatron_core_version()}: moe_utils.{name} has parameters {params}, but "
            f"ascend_moe_ops.integrations.megatron knows {want} (checked against megatron-core "
            f"{SUPPORTED_MEGATRON_CORE}); refusing to patch. Use the functions of this "
            "module directly, or pin a checked megatron-core version.")


def _rebind_in(module) -> None:
    """Rebind every attribute of ``module`` that is one of the originals, and record (for the
    report and for :func:`unpatch`) attributes that already hold a replacement (a module that ran
    ``from moe_utils import permute`` after the patch got the replacement from the patched
    ``moe_utils``)."""
    d = getattr(module, "__dict__", None)
    if not isinstance(d, dict):
        return
    mname = getattr(module, "__name__", "?")
    if mname == _GG_UTIL and _State.gg_replacement is not None and _State.gg_original is None:
        _patch_gg_util(module)
    # Most modules hold none of the objects: test that at C speed (the scan of every loaded module
    # with torch and megatron-core imported took ~70 ms per patch()+unpatch() in a Python loop).
    if _State.watched.isdisjoint(map(id, list(d.values()))):
        return
    for attr, value in list(d.items()):
        try:
            entry = _State.replacements.get(id(value))
            if entry is not None and entry[1] is not value:
                entry = None
            if entry is None:
                entry = _State.by_replacement.get(id(value))
                if entry is None or entry[2] is not value or (id(module), attr) in _State.recorded:
                    continue
        except Exception:
            continue
        target, original, replacement = entry
        if value is original:
            setattr(module, attr, replacement)
        _State.recorded.add((id(module), attr))
        _State.undo.append((module, attr, original))
        _State.report.setdefault(target, []).append(f"{mname}.{attr}")


def _patch_gg_util(module) -> None:
    _State.gg_original = (getattr(module, "grouped_gemm", None), getattr(module, "ops", None))
    module.grouped_gemm = _State.gg_replacement
    module.ops = _State.gg_replacement.ops
    _State.report.setdefault("grouped_gemm", []).append(f"{_GG_UTIL}.grouped_gemm, {_GG_UTIL}.ops")


class _ImportHook(_importlib_abc.MetaPathFinder):
    """Applies the active patch to every module imported while it is on ``sys.meta_path``."""

    def __init__(self):
        self._local = _threading.local()

    def find_spec(self, fullname, path, target=None):
        if getattr(self._local, "busy", False) or not _State.active:
            return None
        self._local.busy = True
        try:
            spec = None
            for finder in _sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        finally:
            self._local.busy = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _PatchingLoader(spec.loader)
        return spec


class _PatchingLoader(_importlib_abc.Loader):
    def __init__(self, loader):
        self._loader = loader

    def __getattr__(self, name):
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        with _State.lock:
            if _State.active:
                _rebind_in(module)


def patch(*, targets: Sequence[str] = PATCHABLE) -> PatchReport:
    """Make Megatron-Core's MoE layers use this package.

    Rebinds, in every loaded module that holds the original object (compared by identity, so the
    token dispatcher's ``from ...moe_utils import permute`` is covered) and in every module imported
    afterwards (an import hook):

    * ``moe_utils.permute`` -> :func:`permute`, ``moe_utils.unpermute`` -> :func:`unpermute`,
      ``moe_utils.sort_chunks_by_idxs`` -> :func:`sort_chunks_by_idxs`;
    * ``grouped_gemm_util.grouped_gemm`` / ``.ops`` (what ``GroupedMLP`` calls as
      ``gg.ops.gmm``) -> :mod:`ascend_moe_ops.integrations.grouped_gemm`, so
      ``moe_grouped_gemm=True`` works without the CUDA ``grouped_gemm`` package;
    * ``GroupedMLP.forward`` (target ``"activation"``) -> a wrapper that gives each SwiGLU
      ``GroupedMLP`` the fused native ``silu(x1) * x2 * probs`` (fwd + bwd in one pass each) in place
      of its ``activation_func_with_probs`` closure. Its results equal Megatron's within the
      tolerance of the low-precision dtype, not bitwise (Megatron rounds after each step; the
      fused kernel rounds once). Leave it out (``targets=PATCHABLE[:4]``) for bitwise results;
    * with ``permute``, ``unpermute`` and ``sort_chunks_by_idxs`` all patched: the TransformerEngine
      names ``moe_utils`` lacks (:data:`FUSED_NAMES`), so that ``moe_permute_fusion=True`` passes
      Megatron's config check; the ``fused=True`` calls then run this module's functions.

    Args:
        targets: a subset of :data:`PATCHABLE` (e.g. ``("grouped_gemm",)`` to feed only the
            grouped GEMM).

    Idempotent (a second call with the same targets, or a subset, changes nothing and returns the
    same report);
    :func:`unpatch` restores every rebound name. Refuses (``RuntimeError``, nothing changed) any
    megatron-core version but :data:`SUPPORTED_MEGATRON_CORE` and one whose function signatures
    differ from the checked ones; raises ``ImportError`` when megatron-core is not installed. Calls
    through the patched names are counted in :data:`call_counts`.

    Returns:
        a :class:`PatchReport`: ``{target: ["module.attribute", ...]}``.
    """
    if isinstance(targets, str) or not isinstance(targets, (list, tuple, set, frozenset)):
        raise TypeError(f"targets must be a sequence of names from {PATCHABLE} (a tuple or list, not a "
                        f"single string), got {targets!r}")
    targets = tuple(targets)
    bad = [t for t in targets if t not in PATCHABLE]
    if bad:
        raise ValueError(f"targets must be a subset of {PATCHABLE}, got unknown {bad}")
    if not targets:
        raise ValueError(f"targets must name at least one of {PATCHABLE} (an empty patch would only mark "
                         f"the module patched)")
    with _State.lock:
        if _State.active:
            if not set(targets) <= set(_State.targets):
                raise RuntimeError(f"already patched with targets {_State.targets}; call unpatch() "
                                   f"before patching {targets}")
            return _State.report
        moe_utils = _importlib.import_module(_MOE_UTILS)
        _check_version()
        originals = {}
        for name in ("permute", "unpermute", "sort_chunks_by_idxs"):
            if name in targets:
                fn = getattr(moe_utils, name)
                if getattr(fn, "_amo_patch_of", None) is not None:
                    raise RuntimeError(f"moe_utils.{name} is already this package's (patched by "
                                       "another copy of this module?)")
                _check_signature(name, fn)
                originals[name] = fn
        ours = {"permute": permute, "unpermute": unpermute, "sort_chunks_by_idxs": sort_chunks_by_idxs}
        for k in call_counts:
            call_counts[k] = 0
        _State.replacements = {id(fn): (name, fn, _counted(name, ours[name])) for name, fn in originals.items()}
        _State.by_replacement = {id(r): (t, o, r) for t, o, r in _State.replacements.values()}
        _State.watched = set(_State.replacements) | set(_State.by_replacement)
        _State.recorded = set()
        _State.gg_replacement = _counted_gg() if "grouped_gemm" in targets else None
        _State.gg_original = None
        _State.undo = []
        _State.report = PatchReport({t: [] for t in targets})
        _State.targets = targets
        if "grouped_gemm" in targets:
            gg_util = _importlib.import_module(_GG_UTIL)
            real = getattr(gg_util, "grouped_gemm", None)
            if real is not None and getattr(real, "ops", None) is not None:
                # the real package is installed: its ``ops`` object may be held elsewhere too
                _State.replacements[id(real.ops)] = ("grouped_gemm", real.ops, _State.gg_replacement.ops)
                _State.watched.add(id(real.ops))
        if "activation" in targets:
            _patch_activation()
        if all(t in targets for t in _FUSED_NEEDS):
            _patch_fused(moe_utils)
        _State.active = True
        for module in list(_sys.modules.values()):
            if module is not None:
                _rebind_in(module)
        if _State.hook is None:
            _State.hook = _ImportHook()
        if _State.hook not in _sys.meta_path:
            _sys.meta_path.insert(0, _State.hook)
        return _State.report


def unpatch() -> PatchReport:
    """Undo :func:`patch` (restores every rebound name, removes the import hook). Returns the
    report of what had been patched; a no-op (empty report) when nothing is patched."""
    with _State.lock:
        if not _State.active:
            return PatchReport()
        for module in list(_sys.modules.values()):  # holders the import hook did not see
            if module is not None:
                _rebind_in(module)
        for module, attr, original in reversed(_State.undo):
            if getattr(module, attr, None) is not original:
                setattr(module, attr, original)
        gg_util = _sys.modules.get(_GG_UTIL)
        if _State.gg_original is not None and gg_util is not None:
            gg_util.grouped_gemm, gg_util.ops = _State.gg_original
        _unpatch_activation()
        _unpatch_fused()
        if _State.hook in _sys.meta_path:
            _sys.meta_path.remove(_State.hook)
        report = _State.report
        _State.active = False
        _State.replacements = {}
        _State.gg_original = None
        _State.gg_replacement = None
        _State.undo = []
        _State.by_replacement = {}
        _State.watched = set()
        _State.recorded = set()
        _State.report = PatchReport()
        return report


# ---------------------------------------------------------------- moe_permute_fusion=True
# With ``moe_permute_fusion=True`` megatron-core 0.16.1 checks at config time
# (TransformerConfig.__post_init__) that moe_utils holds the five TransformerEngine functions below
# (without TransformerEngine they are not even defined there: ImportError) and then passes
# ``fused=True`` to permute / unpermute / sort_chunks_by_idxs. Once those three are this module's
# (which ignore ``fused`` and always run the fused kernels), patch() puts these stand-ins under the
# missing names so that the config is accepted. They take Megatron's calling convention for the TE
# functions and run on this module's functions (so they exchange ``sorted_indices``, not
# TransformerEngine's row map); megatron-core 0.16.1 itself only calls them when TransformerEngine
# is installed.


def _fused_num_out(num_out_tokens):
    return None if num_out_tokens is None or (isinstance(num_out_tokens, int) and num_out_tokens < 0) \
        else num_out_tokens


def _fused_permute(inp, routing_map, num_out_tokens=None, max_token_num=-1, map_type="mask"):
    del max_token_num
    _fused_mask_only(map_type)
    out, _, si = permute(inp, routing_map, num_out_tokens=_fused_num_out(num_out_tokens))
    return out, si


def _fused_permute_with_probs(inp, probs, routing_map, num_out_tokens=None):
    return permute(inp, routing_map, probs, num_out_tokens=_fused_num_out(num_out_tokens))


def _fused_unpermute(inp, row_id_map, merging_probs=None, restore_shape=None, map_type="mask", probs=None):
    _fused_mask_only(map_type)
    if probs is not None:
        merging_probs = probs  # TransformerEngine's older name for merging_probs
    rec = getattr(row_id_map, "_amo_permute", None)
    if rec is None and (merging_probs is not None or restore_shape is None):
        raise ValueError("row_id_map must be the sorted_indices returned by this module's permute (its "
                         "routing map is needed for merging_probs / restore_shape)")
    if restore_shape is None:
        restore_shape = (rec.row_id_map.shape[0], inp.shape[-1])
    return unpermute(inp, row_id_map, restore_shape, probs=merging_probs,
                     routing_map=rec.mask if rec is not None else None)


def _fused_sort_chunks(inp, split_sizes, sorted_index):
    return sort_chunks_by_idxs(inp, split_sizes, sorted_index)[0]


def _fused_sort_chunks_with_probs(inp, probs, split_sizes, sorted_index):
    return sort_chunks_by_idxs(inp, split_sizes, sorted_index, probs=probs)


def _fused_mask_only(map_type):
    if map_type != "mask":
        raise ValueError(f"map_type must be 'mask' (Megatron's routing map), got {map_type!r}")


#: moe_utils names megatron-core 0.16.1 requires for ``moe_permute_fusion=True`` -> their stand-ins
FUSED_NAMES = {
    "fused_permute": _fused_permute,
    "fused_permute_with_probs": _fused_permute_with_probs,
    "fused_unpermute": _fused_unpermute,
    "fused_sort_chunks_by_index": _fused_sort_chunks,
    "fused_sort_chunks_by_index_with_probs": _fused_sort_chunks_with_probs,
}
_FUSED_NEEDS = ("permute", "unpermute", "sort_chunks_by_idxs")  # targets the fused flag goes through


def _patch_fused(moe_utils) -> None:
    """Fill the TransformerEngine names moe_utils lacks (absent, or None for an old TE)."""
    d = vars(moe_utils)
    for name, fn in FUSED_NAMES.items():
        if d.get(name) is None:
            _State.fused_undo.append((name, name in d, d.get(name)))
            setattr(moe_utils, name, fn)
            _State.report.setdefault("fused", []).append(f"{_MOE_UTILS}.{name}")


def _unpatch_fused() -> None:
    moe_utils = _sys.modules.get(_MOE_UTILS)
    for name, had, value in reversed(_State.fused_undo):
        if moe_utils is None:
            break
        if had:
            setattr(moe_utils, name, value)
        else:
            vars(moe_utils).pop(name, None)
    _State.fused_undo = []


# ---------------------------------------------------------------- probs applied in the activation
# Megatron-Core's GroupedMLP computes ``activation_func(fc1_output) * probs`` between its grouped
# GEMMs through a closure it stores on each instance in __init__ (``activation_func_with_probs``).
# patch() wraps GroupedMLP.forward (the class attribute): on each call it swaps that instance's
# closure for the fused native kernel :func:`ascend_moe_ops.ops.swiglu_probs.swiglu_probs` when the
# instance computes SwiGLU (gated_linear_unit with silu, no fp8/fp4), then runs Megatron's own
# forward; unpatch() restores the class attribute and every swapped closure. Any other activation
# keeps Megatron's closure.


def _activation_with_probs(x: Tensor, probs: Tensor) -> Tensor:
    """What GroupedMLP's closure computes for SwiGLU (``silu(x1) * x2 * probs``, ``probs [N, 1]``),
    fused; its inputs are those of Megatron's call."""
    from ..ops.swiglu_probs import swiglu_probs
    call_counts["activation"] += 1
    lead, width = x.shape[:-1], x.shape[-1]
    out = swiglu_probs(x.reshape(-1, width), probs.reshape(-1))
    return out.view(*lead, width // 2)


def _fusable(module) -> bool:
    import torch.nn.functional as F
    cfg = getattr(module, "config", None)
    return (cfg is not None and getattr(cfg, "gated_linear_unit", False) and cfg.activation_func is F.silu
            and not getattr(cfg, "fp8", None) and not getattr(cfg, "fp4", None)
            and callable(vars(module).get("activation_func_with_probs")))


def _patch_activation() -> None:
    experts = _importlib.import_module(_EXPERTS)
    cls = experts.GroupedMLP
    original = cls.forward
    try:
        params = tuple(_inspect.signature(original).parameters)
    except (TypeError, ValueError) as exc:
        raise RuntimeError(f"cannot read the signature of megatron-core's GroupedMLP.forward ({exc})") from exc
    if params != _GROUPED_MLP_FORWARD:
        raise RuntimeError(
            f"megatron-core {megatron_core_version()}: GroupedMLP.forward has parameters {params}, but "
            f"ascend_moe_ops.integrations.megatron knows {_GROUPED_MLP_FORWARD} (checked against "
            f"megatron-core {SUPPORTED_MEGATRON_CORE}); refusing to patch the activation. "
            "Patch the other targets only (patch(targets=...)).")
    import weakref
    instances = weakref.WeakKeyDictionary()

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        if self not in instances and _fusable(self):
            instances[self] = self.activation_func_with_probs
            self.activation_func_with_probs = _activation_with_probs
        return original(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs)

    forward.__wrapped__ = original
    forward.__doc__ = original.__doc__
    forward._amo_patch_of = "activation"
    cls.forward = forward
    _State.grouped_mlp = (cls, original)
    _State.act_instances = instances
    _State.report.setdefault("activation", []).append(f"{_EXPERTS}.GroupedMLP.forward")


def _unpatch_activation() -> None:
    if _State.grouped_mlp is None:
        return
    cls, original = _State.grouped_mlp
    cls.forward = original
    for module, closure in list(_State.act_instances.items()):
        if vars(module).get("activation_func_with_probs") is _activation_with_probs:
            module.activation_func_with_probs = closure
    _State.grouped_mlp = None
    _State.act_instances = None


def is_patched() -> bool:
    return _State.active


@_contextlib.contextmanager
def patched(*, targets: Sequence[str] = PATCHABLE):
    """``with patched(): ...`` -- :func:`patch` on entry, :func:`unpatch` on exit (also on error).
    Yields the :class:`PatchReport`. Nested use with the same targets (or a subset) is allowed
    (the inner one does nothing)."""
    was_active = _State.active
    report = patch(targets=targets)
    try:
        yield report
    finally:
        if not was_active:
            unpatch()
