"""``MoEDispatcher``: expert-parallel token dispatch and combine, flat or hierarchical.

See docs/ops/ep_dispatcher.md for the algorithms and the inter-node row arithmetic. Everything
here runs on ``torch.distributed`` with collectives that HCCL, NCCL and gloo all provide
(``all_to_all_single``, ``all_gather_into_tensor``, ``reduce_scatter_tensor``); local data movement
uses :func:`ascend_moe_ops.moe_permute` / :func:`ascend_moe_ops.moe_unpermute`.

Layout contract (both algorithms, bitwise the same rows in the same order): ``expert_tokens`` holds
the rows for this rank's local experts, grouped by local expert (ascending global id); inside one
expert the rows are ordered by (source EP rank, source token, top-k slot).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..ops import checks as _checks
from ..ops.moe_permute import moe_permute
from ..ops.moe_unpermute import moe_unpermute
from . import _autograd as C
from ._autograd import Pending, SplitMismatchError
from .topology import EPTopology

Tensor = torch.Tensor
ALGORITHMS = ("auto", "flat", "hierarchical", "hierarchical_allgather")
_DTYPE_CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float64: 4}
# columns 1.. of the metadata row every dispatch exchanges (column 0: "arguments rejected")
_META_NAMES = ["tokens dtype", "hidden size H (tokens.shape[1])", "top-k K (topk_idx.shape[1])",
               "probs (dtype code, -1 = no probs)", "num_experts E", "expert_to_rank (checksum)",
               "algorithm", "autograd (grad enabled and tokens/probs require grad)",
               "chunks (moe_forward_overlapped / MoELayer overlap_chunks; 1 = a plain dispatch)"]
# columns 1.. of the metadata row every combine exchanges (column 0: "arguments rejected")
_COMBINE_META_NAMES = ["expert_output dtype", "hidden size of expert_output (expert_output.shape[1])",
                       "algorithm of the handle",
                       "the dispatch the handle comes from (handle.dispatch_id: a rank combines with "
                       "the handle of another dispatch)"]



def _first_rows(t: Tensor, n: int) -> Tensor:
    """``t[:n]``, but ``t`` itself when it has exactly ``n`` rows: a full-range slice still records
    a SliceBackward that zero-fills and copies the whole gradient in the backward pass."""
    return t if t.shape[0] == n else t[:n]


def _pack_by_destination(rows: Tensor, mask: Tensor, counts, slot_dest: Tensor, slot_ids: Tensor):
    """The send buffer of one leg: ``rows`` [M, H] permuted destination-major by ``mask`` [M, D]
    (row m goes to destination d where ``mask[m, d]``; ``counts[d]`` rows each, host ints) straight
    into the collective's input, plus per sent row its source row and its top-k ids, where a slot
    whose destination (``slot_dest`` [M, K]) is not the row's destination is ``-1``
    (``slot_ids`` [M, K]). Returns ``(permute result, src [S] int64, ids [S, K] int32)``."""
    M, D = mask.shape
    S = sum(counts)
    dev = rows.device
    perm = moe_permute(rows, mask, None, num_out_tokens=max(S, 1))
    rmap = perm.row_id_map.long()
    valid = rmap >= 0
    src = torch.empty(S, dtype=torch.int64, device=dev)
    src[rmap[valid]] = torch.arange(M, device=dev).view(M, 1).expand(M, D)[valid]
    dst = torch.repeat_interleave(torch.arange(D, device=dev),
                                  torch.tensor(counts, dtype=torch.int64, device=dev))
    ids = torch.where(slot_dest[src] == dst.view(-1, 1), slot_ids[src],
                      torch.full((S, slot_ids.shape[1]), -1, dtype=torch.int64, device=dev))
    return perm, src, ids.to(torch.int32)

class DispatchHandle:
    """What :meth:`MoEDispatcher.combine` needs to undo a dispatch, plus traffic statistics.

    Attributes:
        algorithm: ``"flat"``, ``"hierarchical"`` or ``"hierarchical_allgather"`` (what
            ``auto`` resolved to).
        num_tokens: ``T`` of this rank's input.
        dispatch_id: the number of the dispatch call of its dispatcher that made it (1, 2, ...;
            the same on every rank, since every rank makes the same dispatch calls in the same
            order). :meth:`MoEDispatcher.combine` checks that all ranks pass handles of the same
            dispatch.
        tokens_per_local_expert: ``[L]`` int64, rows per local expert in ``expert_tokens``.
        stats: rows/bytes this rank sent in the dispatch, taken from the split sizes actually used
            (padding included; rows a rank sends to itself are not counted):
            ``inter_node_rows``, ``inter_node_bytes`` (token rows plus, for the hierarchical
            schemes, their top-k slots (int32) and probs), ``intra_node_rows``,
            ``intra_node_bytes``, and ``combine_inter_node_rows`` / ``_bytes``,
            ``combine_intra_node_rows`` / ``_bytes`` for the combine.
    """

    def __init__(self, algorithm: str, num_tokens: int):
        self.algorithm = algorithm
        self.num_tokens = num_tokens
        self.dispatch_id = 0  # set by dispatch: the how-many-th dispatch of its dispatcher
        self.tokens_per_local_expert: Optional[Tensor] = None
        self.stats: Dict[str, int] = {}
        self._state: Dict[str, object] = {}

    def __repr__(self) -> str:
        return f"DispatchHandle({self.algorithm}, T={self.num_tokens}, stats={self.stats})"


class _PendingResult:
    """Finishes a call whose main collective is in flight; ``wait()`` returns its result (once
    computed, the same object on every later call)."""

    def __init__(self, finish):
        self._finish = finish
        self._result = None

    def wait(self):
        if self._result is None:
            self._result = self._finish()
            self._finish = None
        return self._result


class PendingDispatch(_PendingResult):
    """Returned by ``dispatch(..., async_op=True)``: the main collective is in flight.
    ``wait()`` finishes the dispatch and returns ``(expert_tokens, tokens_per_local_expert, handle)``."""


class PendingCombine(_PendingResult):
    """Returned by ``combine(..., async_op=True)``; ``wait()`` returns the ``[T, H]`` output."""


def _unpermute(x: Tensor, row_id_map: Tensor, probs: Optional[Tensor]) -> Tensor:
    # moe_unpermute needs at least one source row to index when some slot maps exist
    if x.shape[0] == 0 and row_id_map.numel() > 0:
        x = torch.cat([x, x.new_zeros((1, x.shape[1]))])
    return moe_unpermute(x, row_id_map, probs)


def _segment_sums(counts: Tensor, offsets: List[int]) -> Tensor:
    """``counts [R, X]``; column segments ``[offsets[j], offsets[j+1])`` summed -> ``[R, J]``."""
    cs = torch.nn.functional.pad(counts.cumsum(1), (1, 0))
    idx = torch.tensor(offsets, dtype=torch.int64)
    return cs[:, idx[1:]] - cs[:, idx[:-1]]


def _bincount(keys: Tensor, n: int) -> Tensor:
    """Counts of ``keys`` in ``[0, n)`` (``-1`` ignored), no host sync, ``[n]`` int64."""
    flat = keys.reshape(-1)
    bucket = torch.where(flat >= 0, flat, torch.full_like(flat, n))
    out = torch.zeros(n + 1, dtype=torch.int64, device=keys.device)
    out.scatter_add_(0, bucket, torch.ones_like(bucket))
    return out[:n]


class MoEDispatcher:
    """Dispatch tokens to the ranks that own their experts and combine the expert outputs back.

    Args:
        topology: an :class:`EPTopology` (the EP group split into ``nodes x local_size``).
        num_experts: ``E``, the number of routed experts in the whole EP group.
        algorithm: ``"flat"`` (one all-to-all over the EP group), ``"hierarchical"``
            (node-deduplicated: each token crosses to each remote node hosting one of its experts
            once, to the peer with the same local index, then is forwarded inside the node),
            ``"hierarchical_allgather"`` (inter-node AllGather + intra-node all-to-all, the Pangu
            Ultra MoE scheme: static inter-node shapes, ``T*(N-1)`` rows) or ``"auto"``
            (``"hierarchical"`` when ``nodes > 1`` and ``K > nodes``, else flat; per call).
        expert_to_rank: optional ``[E]`` integer tensor: the EP rank that owns each expert. The
            experts of one rank are its local experts in ascending global id. Default: expert
            ``e`` lives on rank ``e // (E / world)`` (``E`` must then be divisible by the world).
        debug: cross-check the split sizes of every all-to-all between ranks before moving data
            (a few small collectives per call). The metadata (dtypes, H, K, E, the expert map, the
            algorithm, argument errors) are checked on every call anyway: they ride on the first
            count exchange.
        allow_uneven: allow maps where ranks own different numbers of experts (even zero). Off by
            default because a grouped-GEMM weight of shape ``[L, ...]`` usually assumes equal
            ``L`` on every rank.

    Construction is collective (one small all-gather checks ``num_experts`` and ``algorithm``).
    Collective behaviour: every rank of the EP group must call ``dispatch``/``combine`` (and
    their backward) the same number of times in the same order, with the same ``K``, ``H``,
    dtype, presence of ``probs`` and ``requires_grad`` pattern. A rank with zero tokens (``T =
    0``) or with zero routed slots still takes part in every collective, and its outputs stay
    connected to the autograd graph.

    A dispatcher is a handle on process groups (which cannot be copied): ``copy.deepcopy`` of it,
    or of a module holding it (an EMA or "best model" copy of a :class:`~ascend_moe_ops.nn.MoELayer`),
    returns the same dispatcher, so the copy shares its groups and expert placement.
    """

    def __deepcopy__(self, memo):
        return self  # shared, like the process groups it wraps (deepcopy refused ProcessGroup)

    def __init__(self, topology: EPTopology, num_experts: int, *, algorithm: str = "auto",
                 expert_to_rank: Optional[Tensor] = None, debug: bool = False,
                 allow_uneven: bool = False):
        if not isinstance(topology, EPTopology):
            raise TypeError(f"topology must be an EPTopology, got {type(topology).__name__}")
        _checks.check_int("num_experts", num_experts, minimum=1)
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
        self.topology = topology
        self.num_experts = num_experts
        self.algorithm = algorithm
        self.debug = debug
        self.allow_uneven = allow_uneven
        self._device_cache: Dict[tuple, Tensor] = {}
        self._dispatches = 0  # dispatch calls so far: the same on every rank (they are collective)
        if topology.world_size > 1:
            # collective: a different E would make the per-call exchanges differ in size
            # (gloo aborts the process on that), so it is caught here with a clear error
            t = C.gather_ints(torch.tensor([num_experts, ALGORITHMS.index(algorithm),
                                            int(allow_uneven)]), topology.group,
                              "MoEDispatcher construction check (EP group)",
                              device=self._meta_device())
            for col, name in enumerate(("num_experts", "algorithm", "allow_uneven")):
                if bool((t[:, col] != t[0, col]).any()):
                    raise ValueError(f"MoEDispatcher: EP ranks disagree on {name}: per-rank "
                                     f"values {t[:, col].tolist()}")
        if expert_to_rank is None:
            W = topology.world_size
            if num_experts % W:
                raise ValueError(f"num_experts={num_experts} is not divisible by the EP world size "
                                 f"{W}; pass expert_to_rank to place experts explicitly")
            self._install(torch.arange(num_experts, dtype=torch.int64) // (num_experts // W))
        else:
            self.set_expert_to_rank(expert_to_rank)

    # ---------------------------------------------------------------- expert placement
    def set_expert_to_rank(self, expert_to_rank: Tensor) -> None:
        """Replace the expert placement (collective: every rank calls it with the same map).

        ``expert_to_rank`` is an ``[E]`` integer tensor with values in ``[0, world)``; each expert
        is on exactly one rank, and (unless ``allow_uneven``) every rank owns ``E / world``
        experts. The experts on a rank, in ascending global id, are its local experts. The maps
        of all ranks are compared (one all-gather of ``E + 1`` ints) and a difference raises on every
        rank; a rank whose map breaks one of the rules above raises its own error and the others a
        ``ValueError`` naming it, after the same all-gather (none waits for it in a later collective).
        Handles from earlier dispatches stay valid for their combine.
        """
        E, W = self.num_experts, self.topology.world_size
        error, m = None, torch.zeros(E, dtype=torch.int64)
        try:
            m = self._check_map(expert_to_rank)
        except (ValueError, TypeError, IndexError) as e:
            if W == 1:
                raise
            error = e
        # cross-check with the other ranks (a different map on one rank would misroute silently); the
        # first entry flags a rank that rejected its map, so every rank raises, none waits in a later
        # collective for it
        group = self.topology.group
        if W > 1:
            rows = C.gather_ints(torch.cat([torch.tensor([int(error is not None)]), m]), group,
                                 "set_expert_to_rank: map check (EP group)", device=self._meta_device())
            if error is not None:
                raise error
            failed = torch.nonzero(rows[:, 0]).flatten().tolist()
            if failed:
                raise ValueError(f"set_expert_to_rank: EP ranks {failed} rejected their expert_to_rank "
                                 "(the error is raised on those ranks)")
            everyone = rows[:, 1:]
            diff = (everyone != m).any(1)
            if bool(diff.any()):
                bad = torch.nonzero(diff).flatten().tolist()
                raise ValueError(f"expert_to_rank differs between EP ranks: ranks {bad} hold a map "
                                 f"other than rank {self.topology.rank}'s")
        self._install(m)

    def _check_map(self, expert_to_rank) -> Tensor:
        """The local rules of set_expert_to_rank; the map as CPU int64."""
        E, W = self.num_experts, self.topology.world_size
        if not isinstance(expert_to_rank, torch.Tensor):
            expert_to_rank = torch.as_tensor(expert_to_rank)
        _checks.check_tensor("expert_to_rank", expert_to_rank, ndim=1, dtypes=_checks.INDEX_DTYPES)
        _checks.check_shape("expert_to_rank", expert_to_rank, (E,), "one EP rank per expert")
        m = expert_to_rank.detach().to("cpu", torch.int64)
        _checks.check_index_range("expert_to_rank", m, 0, W)
        counts = torch.bincount(m, minlength=W)
        if not self.allow_uneven and bool((counts != counts[0]).any()):
            raise ValueError(f"expert_to_rank gives the EP ranks different numbers of experts "
                             f"({counts.tolist()}); every rank must own {E}/{W} experts "
                             "(or construct the dispatcher with allow_uneven=True)")
        return m

    def _meta_device(self) -> torch.device:
        return self.topology.collective_device()

    def _install(self, m: Tensor) -> None:
        E, W = self.num_experts, self.topology.world_size
        counts = torch.bincount(m, minlength=W)
        self.rank_offsets: List[int] = [0] + torch.cumsum(counts, 0).tolist()
        order = torch.argsort(m * E + torch.arange(E), stable=True)  # rank-major, then global id
        perm_key = torch.empty(E, dtype=torch.int64)
        perm_key[order] = torch.arange(E)
        self.expert_to_rank = m.clone()
        self._perm_key = perm_key  # expert id -> position in rank-major order
        r = self.topology.rank
        self.local_experts = order[self.rank_offsets[r]:self.rank_offsets[r + 1]].clone()
        self.num_local_experts = int(counts[r])
        # node of every rank-major expert position (hierarchical dispatch)
        self._pos_rank = torch.repeat_interleave(torch.arange(W), counts)
        self._pos_node = self._pos_rank // self.topology.local_size
        self._map_checksum = int(torch.sum(m * torch.arange(1, E + 1)) % (2 ** 61))
        self._device_cache = {}

    def _table(self, name: str, device: torch.device) -> Tensor:
        t = self._device_cache.get((name, device))
        if t is None:
            t = getattr(self, "_" + name).to(device)
            self._device_cache[(name, device)] = t
        return t

    def _rank_major_key(self, ids: Tensor) -> Tensor:
        ids = ids.long()
        table = self._table("perm_key", ids.device)
        return torch.where(ids >= 0, table[ids.clamp(min=0)], torch.full_like(ids, -1))

    def resolve_algorithm(self, top_k: int) -> str:
        """The algorithm a call with ``top_k`` slots uses (``auto``: hierarchical iff
        ``nodes > 1 and top_k > nodes``: inter-node rows per rank T*(N-1) < T*K*(N-1)/N)."""
        if self.algorithm != "auto":
            return self.algorithm
        N = self.topology.num_nodes
        return "hierarchical" if N > 1 and top_k > N else "flat"

    # ---------------------------------------------------------------- checks
    def _check_args(self, tokens, topk_idx, probs) -> None:
        _checks.check_tensor("tokens", tokens, ndim=2, dtypes=_checks.FLOAT_DTYPES)
        _checks.check_tensor("topk_idx", topk_idx, ndim=2, dtypes=_checks.INDEX_DTYPES,
                             device=tokens.device)
        if topk_idx.shape[0] != tokens.shape[0]:
            raise ValueError(f"topk_idx must have one row per token: tokens has {tokens.shape[0]} "
                             f"rows, topk_idx has shape {tuple(topk_idx.shape)}")
        if probs is not None:
            _checks.check_tensor("probs", probs, dtypes=_checks.FLOAT_DTYPES, device=tokens.device)
            _checks.check_shape("probs", probs, topk_idx.shape, "the shape of topk_idx")
        _checks.check_index_range("topk_idx (expert ids)", topk_idx, -1, self.num_experts)

    def _meta(self, tokens, topk_idx, probs, error, algorithm, chunks: int = 1) -> List[int]:
        """This rank's metadata row (see ``_META_NAMES``); robust to malformed arguments."""
        def dim(t, d):
            return t.shape[d] if isinstance(t, torch.Tensor) and t.dim() == 2 else -1
        grad = torch.is_grad_enabled() and any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in (tokens, probs))
        return [
            0 if error is None else 1,
            _DTYPE_CODES.get(getattr(tokens, "dtype", None), 0),
            dim(tokens, 1),
            dim(topk_idx, 1),
            -1 if probs is None else _DTYPE_CODES.get(getattr(probs, "dtype", None), 0),
            self.num_experts,
            self._map_checksum,
            ALGORITHMS.index(algorithm),
            int(grad),
            chunks,
        ]

    def _header(self, meta: List[int], payload: Tensor, error: Optional[BaseException], *,
                call: str = "dispatch") -> Tensor:
        """Collective over the EP group: all-gather ``meta + payload`` (int64, the same length on
        every rank), raise on every rank if any rank rejected its arguments or the metadata
        disagree, else return the ``[W, P]`` payload table (CPU). ``call``: ``"dispatch"``
        (columns ``_META_NAMES``) or ``"combine"`` (``_COMBINE_META_NAMES``, no payload)."""
        payload = payload.detach().to("cpu", torch.int64).reshape(-1)
        P = payload.numel()
        # "auto" resolves per rank from its own K, so ranks that disagree on K may have picked
        # different algorithms (payload lengths): pad to the longest possible payload so the
        # exchange has one size on every rank and the K column raises the documented error
        width = self._header_width() if call == "dispatch" else 0
        row = torch.cat([torch.tensor(meta, dtype=torch.int64), payload,
                         torch.zeros(max(width - P, 0), dtype=torch.int64)])
        what = ("dispatch: metadata and count exchange (EP group)" if call == "dispatch"
                else "combine: metadata exchange (EP group)")
        table = C.gather_ints(row, self.topology.group, what, device=self._meta_device())
        if error is not None:
            raise error
        failed = torch.nonzero(table[:, 0]).flatten().tolist()
        if failed:
            raise SplitMismatchError(f"EP ranks {failed} rejected their {call} arguments (the "
                                     "error is raised on those ranks)")
        names = _META_NAMES if call == "dispatch" else _COMBINE_META_NAMES
        for col, name in enumerate(names, start=1):
            vals = table[:, col]
            if bool((vals != vals[0]).any()):
                raise SplitMismatchError(f"EP ranks disagree on {name}: per-rank values "
                                         f"{vals.tolist()}")
        return table[:, len(meta):len(meta) + P]

    def _header_width(self) -> int:
        """Payload length of the metadata exchange: the algorithm's own (every rank runs the same
        one), or with ``"auto"`` the longest of flat's (``E``) and hierarchical's (``N + W``)."""
        if self.algorithm != "auto" or self.topology.num_nodes == 1:
            return 0
        return max(self.num_experts, self.topology.num_nodes + self.topology.world_size)

    # ---------------------------------------------------------------- dispatch
    def dispatch(self, tokens: Tensor, topk_idx: Tensor, probs: Optional[Tensor] = None, *,
                 async_op: bool = False, _chunks: int = 1):
        """Send every (token, slot) to the rank that owns expert ``topk_idx[t, k]``.

        Args:
            tokens: ``[T, H]`` fp32/fp16/bf16 (fp64 allowed) activations; ``T`` may differ
                between ranks and may be 0.
            topk_idx: ``[T, K]`` int32/int64 global expert ids in ``[0, E)``, ``-1`` = empty slot.
            probs: optional ``[T, K]`` router weights; ``combine`` multiplies by them. Gradients
                reach ``tokens`` and ``probs``.
            async_op: return a :class:`PendingDispatch` right after launching the main
                collective (flat: the all-to-all; hierarchical: the inter-node all-to-all of the
                token rows; hierarchical_allgather: the inter-node AllGather of tokens/probs);
                call ``.wait()`` for the result. Compute issued in between overlaps the transfer.

        Returns:
            ``(expert_tokens [R, H], tokens_per_local_expert [L] int64, handle)``: the rows for
            this rank's ``L`` local experts grouped by local expert (ready for ``grouped_gemm``
            with ``group_sizes=tokens_per_local_expert``); inside one expert rows are ordered by
            (source rank, token, slot). ``handle`` goes to :meth:`combine`.

        Errors: invalid arguments raise ``ValueError``/``TypeError`` on the rank that passed them
        and :class:`SplitMismatchError` on every other rank (the first collective carries a
        flag); different dtype / ``H`` / ``K`` / probs / ``E`` / placement / algorithm between
        ranks raise :class:`SplitMismatchError` naming the argument on every rank; a peer that
        fails later, dies or hangs makes every collective raise :class:`CollectiveError` after
        the process group's timeout.
        """
        self._dispatches += 1  # first, whatever happens next: the count stays the same on every rank
        dispatch_id = self._dispatches
        error = None
        try:
            self._check_args(tokens, topk_idx, probs)
        except (ValueError, TypeError) as e:
            error = e
        K = topk_idx.shape[1] if isinstance(topk_idx, torch.Tensor) and topk_idx.dim() == 2 else 0
        algorithm = self.resolve_algorithm(K)
        # _chunks: the pieces of the moe_forward_overlapped call this dispatch belongs to; ranks cutting
        # the tokens differently would issue different numbers of collectives (gloo aborts a rank)
        meta = self._meta(tokens, topk_idx, probs, error, algorithm, _chunks)
        if algorithm == "flat":
            finish = self._dispatch_flat(tokens, topk_idx, probs, async_op, meta, error)
        elif algorithm == "hierarchical":
            finish = self._dispatch_dedup(tokens, topk_idx, probs, async_op, meta, error)
        else:
            finish = self._dispatch_allgather(tokens, topk_idx, probs, async_op, meta, error)

        def tagged():
            expert_tokens, tpe, handle = finish()
            handle.dispatch_id = dispatch_id
            return expert_tokens, tpe, handle

        pending = PendingDispatch(tagged)
        return pending if async_op else pending.wait()

    def _local_sort(self, rows: Tensor, keys: Tensor, pending: Optional[Pending]):
        """Group received rows by local expert: key ``e * W + source_rank`` (stable)."""
        W, L = self.topology.world_size, self.num_local_experts
        if pending is not None:
            pending.wait()
        if L == 0:
            return rows, torch.zeros(0, dtype=torch.int64, device=rows.device), None
        res = moe_permute(rows, keys.unsqueeze(1), None, num_experts=L * W, map_type="index")
        tpe = res.tokens_per_expert.view(L, W).sum(1)
        return res.tokens, tpe, res.row_id_map

    def _recv_keys(self, counts: Tensor, src_rank: Tensor, device) -> Tensor:
        """Sort key of every received row. ``counts [S, L, X]`` rows from sender ``s`` for local
        expert ``e`` and sub-block ``x`` (in arrival order), ``src_rank [S, X]`` the source EP rank
        of each sub-block."""
        W = self.topology.world_size
        S, L, X = counts.shape
        keys = torch.arange(L).view(1, L, 1) * W + src_rank.view(S, 1, X)
        return torch.repeat_interleave(keys.reshape(-1), counts.reshape(-1)).to(device)

    def _dispatch_flat(self, tokens, topk_idx, probs, async_op, meta, error):
        topo = self.topology
        W, E, me, G = topo.world_size, self.num_experts, topo.rank, topo.local_size
        if error is None:
            key = self._rank_major_key(topk_idx)
            counts = _bincount(key, E)
        else:
            counts = torch.zeros(E, dtype=torch.int64)
        table = self._header(meta, counts, error)  # [W src, E]: slots per expert position
        T, H = tokens.shape
        rows = _segment_sums(table, self.rank_offsets)  # [W src, W dst]
        send, recv = rows[me].tolist(), rows[:, me].tolist()
        # moe_permute writes the rank-major rows straight into the all-to-all's send buffer (at
        # least one row: moe_permute's backward cannot unpermute from zero rows)
        perm = moe_permute(tokens, key, None, num_experts=E, num_out_tokens=max(sum(send), 1),
                           map_type="index")
        pending = Pending() if async_op else None
        received = C.all_to_all(_first_rows(perm.tokens, sum(send)), send, recv, topo.group, pending=pending,
                                debug=self.debug, what="dispatch: all-to-all of token rows (EP group)")

        handle = DispatchHandle("flat", T)
        es = tokens.element_size()
        inter = sum(n for d, n in enumerate(send) if d // G != me // G)
        intra = sum(n for d, n in enumerate(send) if d // G == me // G and d != me)
        c_inter = sum(n for s, n in enumerate(recv) if s // G != me // G)
        c_intra = sum(n for s, n in enumerate(recv) if s // G == me // G and s != me)
        handle.stats = dict(inter_node_rows=inter, inter_node_bytes=inter * H * es,
                            intra_node_rows=intra, intra_node_bytes=intra * H * es,
                            combine_inter_node_rows=c_inter,
                            combine_inter_node_bytes=c_inter * H * es,
                            combine_intra_node_rows=c_intra,
                            combine_intra_node_bytes=c_intra * H * es)
        lo, hi = self.rank_offsets[me], self.rank_offsets[me + 1]
        local_counts = table[:, lo:hi].reshape(W, hi - lo, 1)
        keys = self._recv_keys(local_counts, torch.arange(W).view(W, 1), tokens.device)

        def finish():
            expert_tokens, tpe, local_map = self._local_sort(received, keys, pending)
            handle.tokens_per_local_expert = tpe
            handle._state = dict(row_id_map=perm.row_id_map, probs=probs, send=send, recv=recv,
                                 local_map=local_map)
            return expert_tokens, tpe, handle

        return finish

    def _rank_rows(self, pos: Tensor) -> Tensor:
        """``[W]``: how many of this rank's tokens have at least one slot on each EP rank (what
        the owning rank receives of them inside its node, whichever path they take)."""
        W = self.topology.world_size
        slot_rank = torch.where(pos >= 0, self._table("pos_rank", pos.device)[pos.clamp(min=0)],
                                torch.full_like(pos, W))
        hit = torch.zeros(pos.shape[0], W + 1, dtype=torch.bool, device=pos.device)
        hit.scatter_(1, slot_rank, torch.ones_like(slot_rank, dtype=torch.bool))
        return hit[:, :W].sum(0)

    def _intra_splits(self, rank_rows: Tensor, device) -> dict:
        """Splits of the intra-node all-to-all, from the ``[W src, W dst]`` table of
        :meth:`_rank_rows` that rode on the metadata exchange (so no count exchange inside the
        node). Local rank ``g'`` forwards to local rank ``g`` the rows it holds from source rank
        ``(n', g')`` whose token has a slot on ``g``: ``rank_rows[n' * G + g', node * G + g]``
        of them, in source-node order."""
        topo = self.topology
        G, N, node, lme = topo.local_size, topo.num_nodes, topo.node, topo.local_rank
        ci = rank_rows.view(N, G, -1)[:, :, node * G:(node + 1) * G].permute(1, 2, 0)  # [g', g, n']
        send, recv = ci[lme].sum(1).tolist(), ci[:, lme].sum(1).tolist()
        # source EP rank of every row this rank receives: sender g' sends in source-node order
        src_rank = (torch.arange(N).view(1, N) * G + torch.arange(G).view(G, 1)).reshape(-1)
        recv_src = torch.repeat_interleave(src_rank, ci[:, lme].reshape(-1)).to(device)
        return dict(send=send, recv=recv, recv_src=recv_src)

    def _node_masks(self, ids_recv: Tensor, ns: dict) -> None:
        """Shared second stage of both hierarchical schemes, part 1: ``ids_recv [M, K]`` are the
        rank-major expert positions of the rows this rank holds after the inter-node step (``-1``
        = empty, or a slot of another node). Every row goes once to every rank of the node that
        owns at least one of its slots (deduplicated per rank, like the inter-node step per
        node); fills ``ns`` with the slots, their owning local ranks and that ``[M, G]`` mask."""
        topo = self.topology
        G, node = topo.local_size, topo.node
        node_lo, node_hi = self.rank_offsets[node * G], self.rank_offsets[(node + 1) * G]
        pk = ids_recv.long()
        M = pk.shape[0]
        on_node = (pk >= node_lo) & (pk < node_hi)
        owner = torch.where(on_node, self._table("pos_rank", pk.device)[pk.clamp(min=0)] - node * G,
                            torch.full_like(pk, G))  # local rank owning each slot, G = none
        hit = torch.zeros(M, G + 1, dtype=torch.bool, device=pk.device)
        hit.scatter_(1, owner, torch.ones_like(owner, dtype=torch.bool))
        ns.update(pk=pk, owner=owner, mask=hit[:, :G].contiguous())

    def _forward_in_node(self, rows: Tensor, probs_rows: Optional[Tensor], ns: dict):
        """Part 2: one row per (row, owning local rank), written by ``moe_permute`` (mask
        routing) straight into the intra-node all-to-all's send buffer, with its slots for that
        rank and their probs; then each rank expands its rows to one per slot, grouped by local
        expert (key ``local_expert * W + source_rank``, stable: the layout contract)."""
        topo = self.topology
        G, W, me = topo.local_size, topo.world_size, topo.rank
        send, recv, mask, pk, owner = ns["send"], ns["recv"], ns["mask"], ns["pk"], ns["owner"]
        dev = rows.device
        S = sum(send)
        perm, src, ids_send = _pack_by_destination(rows, mask, send, owner, pk)
        rmap = perm.row_id_map.long()  # [M, G]
        g = topo.intra_group
        ids2, probs2 = C.all_to_all_slots(
            ids_send, None if probs_rows is None else probs_rows[src], send, recv, g,
            what="dispatch: all-to-all of top-k slots and probs (intra-node group)")
        ids2 = ids2.long()
        tok2 = C.all_to_all(_first_rows(perm.tokens, S), send, recv, g, debug=self.debug,
                            what="dispatch: all-to-all of token rows (intra-node group)")
        L = self.num_local_experts
        if L == 0:  # owns no expert: receives nothing
            return tok2, torch.zeros(0, dtype=torch.int64, device=dev), None, rmap, probs2
        lo = self.rank_offsets[me]
        key = torch.where(ids2 >= 0, (ids2 - lo) * W + ns["recv_src"].view(-1, 1),
                          torch.full_like(ids2, -1))
        n = int((ids2 >= 0).sum())
        res = moe_permute(tok2, key, None, num_experts=L * W, num_out_tokens=max(n, 1), map_type="index")
        tpe = res.tokens_per_expert.view(L, W).sum(1)
        return _first_rows(res.tokens, n), tpe, res.row_id_map, rmap, probs2

    def _dispatch_dedup(self, tokens, topk_idx, probs, async_op, meta, error):
        topo = self.topology
        G, N = topo.local_size, topo.num_nodes
        me, node, lme = topo.rank, topo.node, topo.local_rank
        if error is None:
            T = tokens.shape[0]
            pos = self._rank_major_key(topk_idx)  # [T, K] rank-major expert position, -1 empty
            slot_node = torch.where(pos >= 0, self._table("pos_node", pos.device)[pos.clamp(min=0)],
                                    torch.full_like(pos, N))
            hit = torch.zeros(T, N + 1, dtype=torch.bool, device=tokens.device)
            hit.scatter_(1, slot_node, torch.ones_like(slot_node, dtype=torch.bool))
            mask = hit[:, :N].contiguous()  # [T, N]: token t has >= 1 expert on node n
            counts = torch.cat([mask.sum(0), self._rank_rows(pos)])
        else:
            counts = torch.zeros(N + topo.world_size, dtype=torch.int64)
        # [W, N + W]: rows each rank sends to each node, then its tokens with a slot on each rank
        table = self._header(meta, counts, error)
        T, H = tokens.shape
        K = topk_idx.shape[1]
        peers = [n * G + lme for n in range(N)]  # the inter-node group, in its rank order
        send1 = table[me, :N].tolist()
        recv1 = [int(table[p, node]) for p in peers]
        R1 = sum(send1)
        dev = tokens.device

        # 1. node-major, deduplicated send buffer: one row per (token, node hosting >= 1 of its
        #    experts), written by moe_permute (mask routing) straight into the all-to-all input
        #    (only the slots of the destination node travel; the others are -1 there)
        perm1, src_tok, ids_send = _pack_by_destination(tokens, mask, send1, slot_node, pos)
        g_inter = topo.inter_group
        # two collectives, both launched asynchronously (finish() waits; with async_op the
        # caller's work runs in between): the slots and probs in one, the token rows
        pending = Pending()
        ids1, probs1 = C.all_to_all_slots(
            ids_send, None if probs is None else probs[src_tok], send1, recv1, g_inter,
            pending=pending, what="dispatch: all-to-all of top-k slots and probs (inter-node group)")
        tok1 = C.all_to_all(_first_rows(perm1.tokens, R1), send1, recv1, g_inter, pending=pending,
                            debug=self.debug,
                            what="dispatch: all-to-all of token rows (inter-node group)")

        # 2. intra-node splits: from the table (no count exchange inside the node)
        ns = self._intra_splits(table[:, N:], dev)
        send, recv = ns["send"], ns["recv"]

        handle = DispatchHandle("hierarchical", T)
        es = tokens.element_size()
        inter = R1 - send1[node]
        per_row = H * es + K * 4 + (0 if probs is None else K * probs.element_size())
        c_inter = sum(recv1) - recv1[node]
        intra, c_intra = sum(send) - send[lme], sum(recv) - recv[lme]
        handle.stats = _node_stats(inter, c_inter, intra, c_intra, per_row, H * es)

        def finish():
            if pending is not None:
                pending.wait()
            self._node_masks(ids1, ns)
            expert_tokens, tpe, local_map, rmap2, probs2 = self._forward_in_node(tok1, probs1, ns)
            handle.tokens_per_local_expert = tpe
            handle._state = dict(row_id_map1=perm1.row_id_map, send1=send1, recv1=recv1,
                                 rmap2=rmap2, probs2=probs2, send=send, recv=recv,
                                 local_map=local_map, rows=expert_tokens.shape[0])
            return expert_tokens, tpe, handle

        return finish

    def _dispatch_allgather(self, tokens, topk_idx, probs, async_op, meta, error):
        topo = self.topology
        G, N = topo.local_size, topo.num_nodes
        me, node, lme = topo.rank, topo.node, topo.local_rank
        T0 = tokens.shape[0] if isinstance(tokens, torch.Tensor) and tokens.dim() == 2 else 0
        W = topo.world_size
        rank_rows = (self._rank_rows(self._rank_major_key(topk_idx)) if error is None
                     else torch.zeros(W, dtype=torch.int64))
        table = self._header(meta, torch.cat([torch.tensor([T0]), rank_rows]), error)  # [W, 1 + W]
        T, H = tokens.shape
        K = topk_idx.shape[1]
        mdev = self._meta_device()

        # 1. pad to the inter-node group's largest T (AllGather needs equal sizes)
        Tmax = max(int(table[n * G + lme, 0]) for n in range(N))
        pad = Tmax - T
        ids = self._rank_major_key(topk_idx).to(torch.int32)
        if pad:
            tokens_p = torch.nn.functional.pad(tokens, (0, 0, 0, pad))
            ids = torch.nn.functional.pad(ids, (0, 0, 0, pad), value=-1)
            probs_p = None if probs is None else torch.nn.functional.pad(probs, (0, 0, 0, pad))
        else:
            tokens_p, probs_p = tokens, probs

        # 2. AllGather the slots (small, now), then tokens and probs (possibly async)
        ids_g = C._all_gather(ids.to(mdev), topo.inter_group, None,
                              what="dispatch: AllGather of top-k slots (inter-node group)")
        ids_g = ids_g.to(tokens.device)
        pending = Pending()
        gathered = C.all_gather([tokens_p] + ([] if probs_p is None else [probs_p]),
                                topo.inter_group, pending=pending,
                                what="dispatch: AllGather of tokens/probs (inter-node group)")
        tokens_g = gathered[0]
        probs_g = gathered[1] if probs_p is not None else None

        # 3. this node's (token, slot) pairs: the intra-node splits come from the table
        ns = self._intra_splits(table[:, 1:], tokens.device)
        self._node_masks(ids_g, ns)
        send, recv = ns["send"], ns["recv"]

        handle = DispatchHandle("hierarchical_allgather", T)
        es = tokens.element_size()
        inter = Tmax * (N - 1)
        per_row = H * es + K * 4 + (0 if probs is None else K * probs.element_size())
        intra, c_intra = sum(send) - send[lme], sum(recv) - recv[lme]
        handle.stats = _node_stats(inter, inter, intra, c_intra, per_row, H * es)

        def finish():
            if pending is not None:
                pending.wait()
            expert_tokens, tpe, local_map, rmap2, probs2 = self._forward_in_node(tokens_g, probs_g, ns)
            handle.tokens_per_local_expert = tpe
            handle._state = dict(rmap2=rmap2, probs2=probs2, send=send, recv=recv,
                                 local_map=local_map, Tmax=Tmax, rows=expert_tokens.shape[0])
            return expert_tokens, tpe, handle

        return finish

    # ---------------------------------------------------------------- combine
    @staticmethod
    def _check_combine_args(expert_output, handle) -> None:
        if not isinstance(handle, DispatchHandle) or not handle._state:
            raise TypeError("handle must be the DispatchHandle returned by a finished dispatch")
        _checks.check_tensor("expert_output", expert_output, ndim=2, dtypes=_checks.FLOAT_DTYPES)
        st = handle._state
        if "rows" in st:  # hierarchical schemes
            expected = st["rows"]
        else:
            expected = sum(st["recv"]) if st["local_map"] is None else st["local_map"].shape[0]
        if expert_output.shape[0] != expected:
            raise ValueError(f"expert_output must have {expected} rows (the rows dispatch "
                             f"delivered to this rank), got {expert_output.shape[0]}")

    def combine(self, expert_output: Tensor, handle: DispatchHandle, *, async_op: bool = False):
        """Return expert outputs to their tokens: ``out[t] = sum_k w[t,k] * y[t,k]``.

        Args:
            expert_output: ``[R, H']`` rows in the layout of ``expert_tokens`` from the matching
                :meth:`dispatch` (``H'`` may differ from ``H``).
            handle: the :class:`DispatchHandle` that dispatch returned. A handle may be combined
                more than once (each combine is a fresh, correct one). A handle of another
                dispatch is a misuse that is caught only in part: ranks that pass handles of
                different dispatches raise :class:`SplitMismatchError` on every rank; one whose
                row count differs from ``expert_output``'s raises ``ValueError``; but when every
                rank passes the same older handle whose row counts happen to match, nothing in
                the rows tells it apart (no check without comparing data), and the result is
                wrong. Combine the rows of a dispatch with that dispatch's handle.
            async_op: return a :class:`PendingCombine` right after launching the last collective
                (flat: the all-to-all back; hierarchical: the inter-node ReduceScatter).

        Returns:
            ``[T, H']`` in ``expert_output``'s dtype, weighted by ``probs`` when dispatch had them
            (else a plain sum over kept slots). Differentiable w.r.t. ``expert_output`` and
            (through the dispatch) ``probs``.

        Errors: one small all-gather over the EP group comes first (5 int64 per rank): bad
        arguments raise ``ValueError``/``TypeError`` on the rank that passed them and
        :class:`SplitMismatchError` on every other rank; an ``expert_output`` dtype or ``H'`` (or
        handle algorithm, or the dispatch the handle comes from) that differs between ranks
        raises :class:`SplitMismatchError` naming it on every rank.
        """
        error = None
        try:
            self._check_combine_args(expert_output, handle)
        except (ValueError, TypeError) as e:
            error = e
        # one tiny all-gather (5 int64 per rank; the combine has no count exchange to carry it):
        # argument errors, dtype, H', algorithm or handle's dispatch differing between ranks raise on every rank
        # before any data moves (gloo aborts the process on an all-to-all of unequal row sizes)
        ok = error is None
        self._header([0 if ok else 1,
                      _DTYPE_CODES.get(expert_output.dtype, 0) if ok else 0,
                      expert_output.shape[1] if ok else -1,
                      ALGORITHMS.index(handle.algorithm) if ok else -1,
                      handle.dispatch_id if ok else -1],
                     torch.zeros(0, dtype=torch.int64), error, call="combine")
        st = handle._state
        topo = self.topology
        y = expert_output
        pending = Pending() if async_op else None
        if handle.algorithm == "flat":
            if st["local_map"] is not None:
                y = _unpermute(y, st["local_map"], None)  # back to arrival order
            back = C.all_to_all(y, st["recv"], st["send"], topo.group, pending=pending,
                                debug=self.debug, what="combine: all-to-all of expert outputs (EP group)")

            def finish():
                if pending is not None:
                    pending.wait()
                return _unpermute(back, st["row_id_map"], st["probs"])
        else:
            # reduce on the expert rank first: one weighted partial sum per received row (its
            # slots on this rank), then inside the node: one per (token, node)
            if st["local_map"] is not None:
                y = _unpermute(y, st["local_map"], st["probs2"])
            elif st["probs2"] is not None:
                # no local expert: no row arrived (y and probs2 have 0 rows), but the probs must
                # stay in the graph so this rank runs the backward all-to-all of the slots and
                # probs that its peers run (and gets its probs' gradient back through it)
                y = y + st["probs2"].sum(1, keepdim=True).to(y.dtype)
            back2 = C.all_to_all(y, st["recv"], st["send"], topo.intra_group, debug=self.debug,
                                 what="combine: all-to-all of partial sums (intra-node group)")
            partial = _unpermute(back2, st["rmap2"], None)
        if handle.algorithm == "hierarchical":
            back1 = C.all_to_all(partial, st["recv1"], st["send1"], topo.inter_group,
                                 pending=pending, debug=self.debug,
                                 what="combine: all-to-all of partial sums (inter-node group)")

            def finish():
                if pending is not None:
                    pending.wait()
                # sum of the per-node partial sums, in node order
                return _unpermute(back1, st["row_id_map1"], None)
        elif handle.algorithm == "hierarchical_allgather":
            reduced = C.reduce_scatter(partial, topo.inter_group, pending=pending,
                                       what="combine: ReduceScatter of partial sums (inter-node group)")
            T = handle.num_tokens

            def finish():
                if pending is not None:
                    pending.wait()
                return reduced[:T]
        p = PendingCombine(finish)
        return p if async_op else p.wait()


def _node_stats(inter, c_inter, intra, c_intra, dispatch_row_bytes, combine_row_bytes) -> dict:
    """Rows and bytes per link class of one hierarchical dispatch (dispatch rows carry the token,
    its ids and probs; combine rows carry the token only)."""
    return dict(inter_node_rows=inter, inter_node_bytes=inter * dispatch_row_bytes,
                intra_node_rows=intra, intra_node_bytes=intra * dispatch_row_bytes,
                combine_inter_node_rows=c_inter, combine_inter_node_bytes=c_inter * combine_row_bytes,
                combine_intra_node_rows=c_intra, combine_intra_node_bytes=c_intra * combine_row_bytes)
