"""Carry out a placement change: move expert weights and optimizer state between EP ranks.

Layout assumed: every expert weight of the layer is one tensor per rank of shape ``[S, ...]``
(``S`` = slots per rank); row ``i`` on EP rank ``r`` holds the expert in slot ``(r, i)`` of the
current :class:`Placement`. Two ways to route tokens to the slots:

* **expert mode** (no replicas, every rank full: ``E = R * S``) — the dispatcher is built with
  ``num_experts = E`` and routes global expert ids itself; a rank's local experts are its experts
  in ascending global id, so the executor keeps every rank's slots sorted by expert id and calls
  ``dispatcher.set_expert_to_rank(placement.expert_to_rank)`` after moving the weights.
* **slot mode** (replicas or empty slots) — the dispatcher is built with ``num_experts = R * S``
  physical slots and its default map (slot ``p`` on rank ``p // S``), which never changes. Before
  dispatch, :meth:`PlacementExecutor.route` maps global expert ids to physical slot ids
  (:meth:`Placement.physical_slots`: replica ``token_index % c`` of a ``c``-replica expert), so the
  dispatcher needs no knowledge of replicas. After backward, :meth:`sync_replica_grads` sums each
  replicated expert's gradient over its replicas so the replicas stay identical.

Router ids stay global expert ids in both modes, so a placement change leaves the model's outputs
unchanged (up to summation order where replicas split an expert's tokens).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from ..ops import checks as _checks
from .planner import Placement

Tensor = torch.Tensor


_HEAD = 4  # values small enough to ride on check_consistent's first (size) all-gather
_DEFAULT_HINT = ("every rank must pass the same loads / placement, e.g. predict from counts "
                 "summed over the group")


class ArgumentCheck:
    """Local argument checks of a collective function, run before its first collective::

        with ArgumentCheck() as args:
            ...checks that raise ValueError / TypeError...
        check_consistent(values if args.error is None else None, group, what,
                         error=args.error, caller="fn")

    A ``ValueError`` / ``TypeError`` raised inside the block is kept in ``error`` (and the block
    ends there) instead of leaving the function before the collective, which would leave the
    group's other ranks waiting in it until the process-group timeout. :func:`check_consistent`
    carries the flag on its first all-gather and raises on every rank. ``raise_error()``
    re-raises it where no collective follows (a rank-local call)."""

    def __init__(self):
        self.error: Optional[BaseException] = None

    def __enter__(self) -> "ArgumentCheck":
        return self

    def __exit__(self, tp, exc, tb) -> bool:
        if tp is not None and issubclass(tp, (ValueError, TypeError)):
            self.error = exc
            return True
        return False

    def raise_error(self) -> None:
        if self.error is not None:
            raise self.error


def check_consistent(values: Optional[Tensor], group=None, what: str = "value", *, device=None,
                     hint: str = _DEFAULT_HINT, error: Optional[BaseException] = None,
                     caller: Optional[str] = None) -> None:
    """Raise the same ``ValueError`` on every rank of ``group`` if ``values`` (an integer or float
    tensor) differs between ranks, in size or in value. Collective: one all-gather of the size
    (and, for up to 4 values, the values themselves, so a scalar check such as ``num_experts``
    costs one tiny all-gather), then for larger tensors one all-gather of the values.
    ``device``: where the all-gathers run (default the CPU; pass the device the group's backend
    works on, e.g. the one its other collectives use). ``hint`` ends the message.

    ``error``: the argument error this rank's own checks raised (see :class:`ArgumentCheck`;
    ``values`` is then ignored and may be ``None``). The first all-gather carries it as a flag:
    this rank re-raises ``error``, every other rank raises ``ValueError("<caller>: ranks [...]
    rejected their arguments (the error is raised on those ranks)")``, before any value is
    compared, so a bad argument on one rank is a clear error on all of them, not a hang."""
    W = dist.get_world_size(group)
    if W == 1:
        if error is not None:
            raise error
        return
    dev = torch.device("cpu") if device is None else torch.device(device)
    if error is None:
        flat = values.detach().reshape(-1).to(torch.float64).cpu()
    else:
        flat = torch.zeros(0, dtype=torch.float64)
    n = flat.numel()
    head = torch.zeros(2 + _HEAD, dtype=torch.float64)
    head[0] = n
    head[1] = 0 if error is None else 1
    if n <= _HEAD:
        head[2:2 + n] = flat
    heads = torch.empty(W * (2 + _HEAD), dtype=torch.float64, device=dev)
    dist.all_gather_into_tensor(heads, head.to(dev), group=group)
    heads = heads.view(W, 2 + _HEAD).cpu()
    if error is not None:
        raise error
    rejected = torch.nonzero(heads[:, 1]).flatten().tolist()
    if rejected:
        raise ValueError(f"{caller or what}: ranks {rejected} rejected their arguments (the error "
                         "is raised on those ranks)")
    sizes = heads[:, 0].long()
    if bool((sizes != sizes[0]).any()):
        raise ValueError(f"{what} has different sizes on the ranks: {sizes.tolist()}")
    if n <= _HEAD:
        everyone = heads[:, 2:2 + n]
    else:
        everyone = torch.empty(W * n, dtype=torch.float64, device=dev)
        dist.all_gather_into_tensor(everyone, flat.to(dev), group=group)
        everyone = everyone.view(W, n).cpu()
    diff = ~torch.all(everyone == everyone[0], dim=1)
    if bool(diff.any()):
        bad = torch.nonzero(diff).flatten().tolist()
        shown = ""
        if n <= _HEAD:
            vals = everyone if values.is_floating_point() else everyone.long()
            vals = vals[:, 0].tolist() if n == 1 else vals.tolist()
            shown = f": per-rank values {vals}"
        raise ValueError(f"{what} differs between ranks: ranks {bad} disagree with rank 0{shown} "
                         f"({hint})")


def canonical(placement: Placement) -> Placement:
    """Same placement with each rank's experts in ascending id (empty slots last): the local
    expert order of a dispatcher in expert mode."""
    if not isinstance(placement, Placement):
        raise TypeError(f"placement must be a Placement (Placement.from_expert_to_rank makes one from an "
                        f"[E] expert -> rank tensor), got {type(placement).__name__}")
    s2e = placement.slot_to_expert.clone()
    key = torch.where(s2e >= 0, s2e, torch.full_like(s2e, placement.num_experts))
    s2e = torch.gather(s2e, 1, torch.argsort(key, dim=1, stable=True))
    return Placement(s2e, placement.num_experts)


class PlacementExecutor:
    """Applies placements to one MoE layer's expert weights (and their optimizer state).

    Args:
        placement: the placement the weights are laid out in now.
        params: the layer's expert tensors on this rank, each ``[S, ...]`` (``nn.Parameter`` or
            tensor), row ``i`` = local slot ``i``. Every rank passes the same list (same shapes).
        optimizer: optional ``torch.optim.Optimizer``; every per-parameter state tensor with the
            parameter's shape (Adam's ``exp_avg``/``exp_avg_sq``, SGD's ``momentum_buffer``, ...)
            moves with its rows. Scalar state (``step``) is per tensor and stays.
        dispatcher: optional ``MoEDispatcher``. With ``num_experts == E`` it is driven in expert
            mode, with ``num_experts == R * S`` in slot mode (see module docs).
        group: the EP process group (default: the dispatcher's group, else the world).
        mode: ``"expert"`` or ``"slot"``; default from the dispatcher, else ``"expert"`` when the
            placement has no replicas and no empty slots.

    Every method that moves data is collective over ``group``.
    """

    def __init__(self, placement: Placement, params: Sequence[Tensor], *, optimizer=None,
                 dispatcher=None, group=None, mode: Optional[str] = None):
        if not isinstance(placement, Placement):
            raise TypeError(f"placement must be a Placement, got {type(placement).__name__}")
        if group is None and dispatcher is not None:
            group = dispatcher.topology.group
        self.group = group
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("PlacementExecutor needs torch.distributed to be initialized")
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        R, S, E = placement.num_ranks, placement.slots_per_rank, placement.num_experts
        if R != self.world:
            raise ValueError(f"placement has {R} ranks but the EP group has {self.world}")
        self.params: List[Tensor] = list(params)
        if not self.params:
            raise ValueError("params must contain at least one expert tensor")
        for i, p in enumerate(self.params):
            _checks.check_tensor(f"params[{i}]", p)
            if p.dim() < 1 or p.shape[0] != S:
                raise ValueError(f"params[{i}] must have one row per local slot: leading dim "
                                 f"{S} (slots_per_rank), got shape {tuple(p.shape)}")
        full = not bool((placement.slot_to_expert < 0).any())
        if mode is None:
            if dispatcher is not None:
                mode = "expert" if dispatcher.num_experts == E else "slot"
            else:
                mode = "expert" if (full and not placement.has_replicas) else "slot"
        if mode not in ("expert", "slot"):
            raise ValueError(f"mode must be 'expert' or 'slot', got {mode!r}")
        if dispatcher is not None:
            want = E if mode == "expert" else R * S
            if dispatcher.num_experts != want:
                raise ValueError(f"{mode} mode needs a dispatcher with num_experts={want}, "
                                 f"got {dispatcher.num_experts}")
        self.mode = mode
        self.optimizer = optimizer
        self.dispatcher = dispatcher
        self._check_mode(placement)
        self.placement = canonical(placement) if mode == "expert" else placement
        if mode == "expert" and not torch.equal(self.placement.slot_to_expert, placement.slot_to_expert):
            raise ValueError("in expert mode each rank's slots must hold its experts in ascending "
                             "id (the dispatcher's local order); pass canonical(placement)")
        if dispatcher is not None and mode == "expert":
            dispatcher.set_expert_to_rank(self.placement.expert_to_rank)

    def _check_mode(self, placement: Placement) -> None:
        if self.mode == "expert":
            if placement.has_replicas:
                raise ValueError("expert mode cannot hold replicas; use slot mode (a dispatcher "
                                 "over num_ranks * slots_per_rank physical slots)")
            if bool((placement.slot_to_expert < 0).any()):
                raise ValueError("expert mode needs every slot filled (E = ranks * slots_per_rank); "
                                 "use slot mode for placements with empty slots")

    # ---------------------------------------------------------------------------------------
    def route(self, topk_idx: Tensor, token_index: Optional[Tensor] = None) -> Tensor:
        """Ids to hand the dispatcher: global ids in expert mode, physical slot ids in slot mode."""
        if self.mode == "expert":
            return topk_idx
        return self.placement.physical_slots(topk_idx, token_index)

    def _state_tensors(self) -> List[Tensor]:
        out = []
        for p in self.params:
            out.append(p.data if isinstance(p, torch.nn.Parameter) else p)
            if isinstance(p, torch.nn.Parameter) and p.grad is not None:
                out.append(p.grad)
            if self.optimizer is not None and p in self.optimizer.state:
                st = self.optimizer.state[p]
                for k in sorted(st):
                    v = st[k]
                    if isinstance(v, torch.Tensor) and v.shape == p.shape:
                        out.append(v)
        return out

    @property
    def bytes_per_copy(self) -> int:
        """Bytes one expert copy moves now: one row of every parameter, of its gradient (if
        set) and of every optimizer state tensor of the parameter's shape. Adam state exists
        only after the first ``step()``; the figure a :class:`MoveCost` should match."""
        S = self.placement.slots_per_rank
        return sum(t.numel() // S * t.element_size() for t in self._state_tensors())

    @torch.no_grad()
    def apply(self, new: Placement) -> Dict[str, int]:
        """Move weights, gradients and optimizer state from the current placement to ``new``.

        Collective over the group: every rank passes the same ``new`` (checked; a difference
        raises on every rank, and so does a ``new`` that one rank rejects: that rank raises its
        own error, the others a ``ValueError`` naming it). The rows travel with one ``all_to_all_single`` per dtype (all
        tensors of one dtype packed side by side). In expert mode the dispatcher's map is
        updated. Returns ``{"copies": rows moved between ranks (= the planner's ``moved``),
        "local": rows moved inside a rank, "bytes": bytes sent between ranks over the whole
        group (= copies * bytes_per_copy), "sent_bytes": bytes this rank sent}``.
        """
        old = self.placement
        with ArgumentCheck() as args:
            if not isinstance(new, Placement):
                raise TypeError(f"new must be a Placement, got {type(new).__name__}")
            if (new.num_ranks, new.slots_per_rank, new.num_experts) != (
                    old.num_ranks, old.slots_per_rank, old.num_experts):
                raise ValueError(f"new placement is {new.num_ranks} ranks x {new.slots_per_rank} "
                                 f"slots for {new.num_experts} experts; the layer has "
                                 f"{old.num_ranks} x {old.slots_per_rank} for {old.num_experts}")
            self._check_mode(new)
            if self.mode == "expert":
                new = canonical(new)
        check_consistent(new.slot_to_expert if args.error is None else None, self.group,
                         "the new placement", error=args.error, caller="PlacementExecutor.apply")
        tensors = self._state_tensors()
        check_consistent(torch.tensor([len(tensors)] + [t.numel() for t in tensors]), self.group,
                         "the set of expert tensors to move (params, grads, optimizer state)")

        R, S = old.num_ranks, old.slots_per_rank
        me = self.rank
        old_s2e = old.slot_to_expert
        holders: Dict[int, List[int]] = {}
        for r in range(R):
            for i in range(S):
                e = int(old_s2e[r, i])
                if e >= 0:
                    holders.setdefault(e, []).append(r * S + i)
        # source of every destination slot: the old copy on the same rank if any, else the first
        send_lists = [[] for _ in range(R)]    # my old local slots to send to rank d, in order
        recv_lists = [[] for _ in range(R)]    # my new local slots filled from rank s, in order
        copies = local = 0
        for r in range(R):
            for i in range(S):
                e = int(new.slot_to_expert[r, i])
                if e < 0:
                    continue
                srcs = holders[e]
                same = [p for p in srcs if p // S == r]
                src = same[0] if same else srcs[0]
                sr, si = divmod(src, S)
                if sr != r:
                    copies += 1
                elif si != i:
                    local += 1
                if sr == me:
                    send_lists[r].append(si)
                if r == me:
                    recv_lists[sr].append(i)
        send_idx = torch.tensor([i for lst in send_lists for i in lst], dtype=torch.int64)
        recv_idx = torch.tensor([i for lst in recv_lists for i in lst], dtype=torch.int64)
        in_splits = [len(x) for x in recv_lists]
        out_splits = [len(x) for x in send_lists]
        row_bytes = sum(t.numel() // S * t.element_size() for t in tensors)
        sent_bytes = (send_idx.numel() - len(send_lists[me])) * row_bytes
        # one collective per (dtype, device): the tensors' rows side by side; the order of the
        # groups and of the tensors in them is the same on every rank (checked above)
        groups: Dict[tuple, List[Tensor]] = {}
        for t in tensors:
            groups.setdefault((t.dtype, t.device), []).append(t)
        for (dtype, device), ts in groups.items():
            rows = [t.reshape(S, -1) for t in ts]
            widths = [r.shape[1] for r in rows]
            si = send_idx.to(device)
            send = torch.cat([r.index_select(0, si) for r in rows], dim=1).contiguous()
            recv = torch.empty(recv_idx.numel(), sum(widths), dtype=dtype, device=device)
            if R > 1:
                dist.all_to_all_single(recv, send, in_splits, out_splits, group=self.group)
            else:
                recv.copy_(send)
            ri = recv_idx.to(device)
            for t, r, part in zip(ts, rows, torch.split(recv, widths, dim=1)):
                out = torch.zeros_like(r)
                out.index_copy_(0, ri, part)
                t.copy_(out.view(t.shape))          # in place, also for a non-contiguous t
        self.placement = new
        if self.dispatcher is not None and self.mode == "expert":
            self.dispatcher.set_expert_to_rank(new.expert_to_rank)
        return {"copies": copies, "local": local, "bytes": copies * row_bytes,
                "sent_bytes": sent_bytes}

    @torch.no_grad()
    def sync_replica_grads(self) -> None:
        """Sum each replicated expert's gradient over its replicas (slot mode), so that identical
        replicas receive identical updates equal to the unreplicated expert's. Collective; a
        no-op without replicas. Call after backward, before the optimizer step."""
        pl = self.placement
        rc = pl.replica_count
        rep = torch.nonzero(rc > 1).flatten()
        if rep.numel() == 0:
            return
        # my local slots holding a replicated expert, and that expert's row in the reduce buffer
        row_of = torch.full((pl.num_experts,), -1, dtype=torch.int64)
        row_of[rep] = torch.arange(rep.numel())
        rows = row_of[pl.slot_to_expert[self.rank].clamp(min=0)]
        rows = torch.where(pl.slot_to_expert[self.rank] >= 0, rows, torch.full_like(rows, -1))
        local = torch.nonzero(rows >= 0).flatten()
        rows = rows[local]
        for p in self.params:
            if not isinstance(p, torch.nn.Parameter):
                continue
            g = p.grad
            buf = torch.zeros((rep.numel(),) + tuple(p.shape[1:]), dtype=torch.float32
                              if p.dtype in (torch.float16, torch.bfloat16) else p.dtype,
                              device=p.device)
            li, ri = local.to(p.device), rows.to(p.device)
            if g is not None:
                buf.index_add_(0, ri, g.index_select(0, li).to(buf.dtype))
            dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.group)
            if local.numel():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                p.grad.index_copy_(0, li, buf.index_select(0, ri).to(p.dtype))
