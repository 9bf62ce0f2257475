"""Expert placement planning: which physical slot (rank, local index) holds which expert.

A :class:`Placement` is the table ``slot_to_expert [R, S]`` (``-1`` = empty slot) for ``R`` ranks
with ``S`` slots each. Without replicas every expert sits in exactly one slot and
``expert_to_rank [E]`` says where; with redundant slots a hot expert may sit in several slots (on
distinct ranks) and its tokens are split among them (see :meth:`Placement.physical_slots`).

:func:`plan_placement` predicts rank loads from a per-expert load vector and improves the current
placement by a bounded number of weight moves (see docs/ops/balance.md for the algorithm).
"""

from __future__ import annotations

import math
import heapq
from dataclasses import dataclass, field
from typing import Optional, Union

import numpy as np
import torch

from ..ops import checks as _checks

Tensor = torch.Tensor


# ----------------------------------------------------------------------------------------------
# placement object

@dataclass
class Placement:
    """Expert → slot placement.

    slot_to_expert: ``[R, S]`` int64, global expert id held by slot ``(rank, local index)``, -1 empty.
    num_experts:    ``E``.
    Fields filled by :func:`plan_placement` (``None``/0 otherwise): the predicted imbalance
    (``max / mean − 1`` of rank loads) and coefficient of variation before and after, the number
    of (expert, rank) copies the change needs (``moved``), the bytes those copies carry under the
    planner's :class:`MoveCost` (``moved_bytes``, 0 without one), and ``changed``.

    The table is the placement's own: construction takes a copy, and ``slot_to_expert`` returns a
    copy, so changing either tensor in place cannot desynchronise the derived maps
    (``expert_to_rank``, ``expert_slots``, computed once); it cannot be reassigned either. For
    another placement build a new ``Placement``.
    """

    slot_to_expert: Tensor
    num_experts: int
    imbalance_before: Optional[float] = None
    imbalance_after: Optional[float] = None
    cv_before: Optional[float] = None
    cv_after: Optional[float] = None
    moved: int = 0
    changed: bool = False
    moved_bytes: int = 0
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    # -- construction / validation -------------------------------------------------------------
    def __post_init__(self):
        s2e = self._s2e
        _checks.check_tensor("slot_to_expert", s2e, ndim=2, dtypes=_checks.INDEX_DTYPES)
        # a private copy (``.to`` may return the caller's own tensor)
        self._s2e = s2e = s2e.detach().to(torch.int64).cpu().clone()
        E = self.num_experts
        _checks.check_int("num_experts", E, minimum=1)
        _checks.check_index_range("slot_to_expert (expert ids)", s2e, -1, E)
        counts = torch.bincount(s2e[s2e >= 0], minlength=E)
        missing = torch.nonzero(counts == 0).flatten()
        if missing.numel():
            raise ValueError(f"placement loses experts {missing[:8].tolist()}"
                             f"{' ...' if missing.numel() > 8 else ''}: every expert id in "
                             f"[0, {E}) needs at least one slot")
        for r in range(s2e.shape[0]):
            row = s2e[r][s2e[r] >= 0]
            if row.unique().numel() != row.numel():
                raise ValueError(f"placement puts two replicas of one expert on rank {r} "
                                 f"(slots {s2e[r].tolist()}); replicas must be on distinct ranks")

    @classmethod
    def from_expert_to_rank(cls, expert_to_rank: Tensor, num_ranks: int, slots_per_rank: int) -> "Placement":
        """Placement of an ``[E]`` expert→rank map (one copy each); a rank's experts fill its slots
        in ascending expert-id order (the dispatcher's local expert order)."""
        _checks.check_tensor("expert_to_rank", expert_to_rank, ndim=1, dtypes=_checks.INDEX_DTYPES)
        _checks.check_int("num_ranks", num_ranks, minimum=1)
        _checks.check_int("slots_per_rank", slots_per_rank, minimum=1)
        e2r = expert_to_rank.detach().to(torch.int64).cpu()
        E = e2r.numel()
        _checks.check_index_range("expert_to_rank", e2r, 0, num_ranks)
        per_rank = torch.bincount(e2r, minlength=num_ranks)
        if int(per_rank.max()) > slots_per_rank:
            r = int(per_rank.argmax())
            raise ValueError(f"expert_to_rank puts {int(per_rank[r])} experts on rank {r} but "
                             f"slots_per_rank={slots_per_rank}")
        s2e = torch.full((num_ranks, slots_per_rank), -1, dtype=torch.int64)
        for r in range(num_ranks):
            ids = torch.nonzero(e2r == r).flatten()
            s2e[r, :ids.numel()] = ids
        return cls(s2e, E)

    @classmethod
    def contiguous(cls, num_experts: int, num_ranks: int, slots_per_rank: int) -> "Placement":
        """The static placement: expert ``e`` on rank ``e // ceil(E / R)``."""
        check_fits(num_experts, num_ranks, slots_per_rank)
        per = -(-num_experts // num_ranks)
        return cls.from_expert_to_rank(torch.arange(num_experts) // per, num_ranks, slots_per_rank)

    # -- derived views ---------------------------------------------------------------------------
    @property
    def num_ranks(self) -> int:
        return self._s2e.shape[0]

    @property
    def slots_per_rank(self) -> int:
        return self._s2e.shape[1]

    @property
    def replica_count(self) -> Tensor:
        """``[E]`` int64: slots holding each expert (1 without replicas)."""
        s2e = self._s2e
        return torch.bincount(s2e[s2e >= 0], minlength=self.num_experts)

    @property
    def has_replicas(self) -> bool:
        return bool((self.replica_count > 1).any())

    @property
    def expert_to_rank(self) -> Tensor:
        """``[E]`` int64 rank of each expert (its first slot in rank-major order if replicated);
        a copy."""
        if "e2r" not in self._cache:
            flat = self._s2e.flatten()
            S = self.slots_per_rank
            e2r = torch.full((self.num_experts,), -1, dtype=torch.int64)
            pos = torch.nonzero(flat >= 0).flatten().flip(0)          # last write = first slot
            e2r[flat[pos]] = pos // S
            self._cache["e2r"] = e2r
        return self._cache["e2r"].clone()

    def expert_slots(self) -> Tensor:
        """``[E, max_replicas]`` int64 physical slot ids (``rank * S + local``) of each expert in
        ascending order, padded with -1; a copy."""
        return self._expert_slots().clone()

    def _expert_slots(self) -> Tensor:
        if "slots" not in self._cache:
            flat = self._s2e.flatten()
            rc = self.replica_count
            out = torch.full((self.num_experts, int(rc.max())), -1, dtype=torch.int64)
            fill = torch.zeros(self.num_experts, dtype=torch.int64)
            for p in torch.nonzero(flat >= 0).flatten().tolist():
                e = int(flat[p])
                out[e, fill[e]] = p
                fill[e] += 1
            self._cache["slots"] = out
        return self._cache["slots"]

    def physical_slots(self, topk_idx: Tensor, token_index: Optional[Tensor] = None) -> Tensor:
        """Map global expert ids ``[T, K]`` to physical slot ids ``rank * S + local`` (``-1`` stays).

        An expert with ``c`` replicas sends token ``t`` to its replica number
        ``token_index[t] % c`` (replica slots in ascending order); ``token_index`` defaults to
        ``0..T-1``. The mapping is a pure function of its inputs, so it is deterministic and the
        same on every rank; a dispatcher built with ``num_experts = R * S`` and the contiguous
        slot→rank map (slot ``p`` on rank ``p // S``) then needs no knowledge of replicas.
        """
        _checks.check_tensor("topk_idx", topk_idx, ndim=2, dtypes=_checks.INDEX_DTYPES)
        _checks.check_index_range("topk_idx (expert ids)", topk_idx, -1, self.num_experts)
        T = topk_idx.shape[0]
        dev = topk_idx.device
        if token_index is None:
            token_index = torch.arange(T, device=dev)
        else:
            _checks.check_tensor("token_index", token_index, ndim=1, dtypes=_checks.INDEX_DTYPES,
                                 device=dev)
            _checks.check_shape("token_index", token_index, (T,), "one index per row of topk_idx")
        key = ("route", dev)
        if key not in self._cache:  # device copies made once, not on every routing call
            self._cache[key] = (self._expert_slots().to(dev), self.replica_count.to(dev))
        slots, rc = self._cache[key]
        ids = topk_idx.long()
        safe = ids.clamp(min=0)
        rep = token_index.long().view(-1, 1) % rc[safe]
        phys = slots[safe, rep]
        return torch.where(ids >= 0, phys, torch.full_like(phys, -1)).to(topk_idx.dtype)

    def rank_loads(self, expert_load: Tensor) -> Tensor:
        """``[R]`` fp64 load per rank when expert ``e`` brings ``expert_load[e]`` tokens, split
        evenly over its replicas. ``expert_load`` must be finite and non-negative (``ValueError``)."""
        load = torch.as_tensor(expert_load, dtype=torch.float64).cpu()
        _checks.check_shape("expert_load", load, (self.num_experts,), "one load per expert")
        _check_loads("expert_load", load)
        per_slot = load / self.replica_count.to(torch.float64)
        s2e = self._s2e
        w = torch.where(s2e >= 0, per_slot[s2e.clamp(min=0)], torch.zeros((), dtype=torch.float64))
        return w.sum(1)

    def __eq__(self, other):
        return (isinstance(other, Placement) and self.num_experts == other.num_experts
                and torch.equal(self._s2e, other._s2e))


def _get_slot_to_expert(self) -> Tensor:
    return self._s2e.clone()


def _set_slot_to_expert(self, value) -> None:
    if "_s2e" in self.__dict__:
        raise AttributeError("Placement.slot_to_expert cannot be reassigned (the derived maps are "
                             "computed from it once): build a new Placement")
    self._s2e = value  # checked and copied by __post_init__


# defined after @dataclass so that the generated __init__ assigns through it (a property in the
# class body would become the field's default)
Placement.slot_to_expert = property(
    _get_slot_to_expert, _set_slot_to_expert,
    doc="``[R, S]`` int64 expert id of each slot (-1 = empty); a copy of the placement's table.")


DEFAULT_MOVE_FRACTION = 0.1


def default_max_moves(num_experts: int) -> int:
    """The default move budget of :func:`plan_placement`: ``max(1, E // 10)`` expert copies per
    re-plan (25 of 256 experts). ``num_experts`` is an int >= 1."""
    _checks.check_int("num_experts", num_experts, minimum=1)
    return max(1, int(num_experts * DEFAULT_MOVE_FRACTION))


@dataclass(frozen=True)
class MoveCost:
    """Bytes one expert copy moves between ranks: its weights plus its optimizer state.

    Args:
        params_per_expert: parameters of one expert (e.g. a SwiGLU expert with hidden ``H`` and
            FFN size ``F``: ``3 * H * F``).
        param_bytes: bytes per parameter of the weight itself (2 for bf16 weights).
        state_bytes: bytes per parameter of the optimizer state that moves with it (12 for bf16
            training with Adam: fp32 master weight + fp32 ``exp_avg`` + fp32 ``exp_avg_sq``;
            8 for Adam on fp32 weights; 0 for plain SGD without momentum).
        grad_bytes: bytes per parameter of a gradient that moves too (0: re-place between
            steps, after ``zero_grad(set_to_none=True)``).

    ``bytes_per_copy = params_per_expert * (param_bytes + state_bytes + grad_bytes)``; for a
    ``PlacementExecutor`` the exact figure of its tensors is ``executor.bytes_per_copy``.
    """

    params_per_expert: int
    param_bytes: float = 2.0
    state_bytes: float = 12.0
    grad_bytes: float = 0.0

    def __post_init__(self):
        _checks.check_int("params_per_expert", self.params_per_expert, minimum=1)
        for name in ("param_bytes", "state_bytes", "grad_bytes"):
            _checks.check_float(name, getattr(self, name), finite=True, minimum=0)

    @property
    def bytes_per_copy(self) -> int:
        return int(round(self.params_per_expert * (self.param_bytes + self.state_bytes
                                                    + self.grad_bytes)))


def check_fits(num_experts: int, num_ranks: int, slots_per_rank: int) -> None:
    _checks.check_int("num_experts", num_experts, minimum=1)
    _checks.check_int("num_ranks", num_ranks, minimum=1)
    _checks.check_int("slots_per_rank", slots_per_rank, minimum=1)
    if num_experts > num_ranks * slots_per_rank:
        raise ValueError(f"{num_experts} experts do not fit in num_ranks * slots_per_rank = "
                         f"{num_ranks} * {slots_per_rank} = {num_ranks * slots_per_rank} slots")


def _check_loads(name: str, load: Tensor) -> None:
    """Loads are finite and non-negative (a NaN or negative load made the metrics 0.0, "balanced")."""
    _checks.check_values(name, load, lambda t: ~torch.isfinite(t) | (t < 0),
                         ": loads must be finite and non-negative", "has a non-finite or negative load")


def _scaled(rank_loads: Tensor) -> Tensor:
    """The loads as given (integer ones in fp64), divided by their largest magnitude only where
    their sum could overflow the dtype (the two ratios below do not depend on the scale; loads near
    the fp64 maximum gave NaN metrics)."""
    x = torch.as_tensor(rank_loads).detach()
    _check_loads("rank_loads", x)
    if not x.is_floating_point():
        x = x.to(torch.float64)
    if x.numel():
        s = float(x.abs().max())
        if math.isfinite(s) and s > torch.finfo(x.dtype).max / x.numel():
            x = x.to(torch.float64) / s
    return x


def imbalance(rank_loads: Tensor) -> float:
    """``max / mean − 1`` of rank loads (0 = perfectly balanced; also 0 when all are 0). A NaN,
    infinite or negative load is a ``ValueError`` naming ``rank_loads``."""
    x = _scaled(rank_loads)
    m = float(x.mean())
    return float(x.max()) / m - 1.0 if m > 0 else 0.0


def coefficient_of_variation(rank_loads: Tensor) -> float:
    """``std / mean`` of rank loads (0 = perfectly balanced; also 0 when all are 0). A NaN,
    infinite or negative load is a ``ValueError`` naming ``rank_loads``."""
    x = _scaled(rank_loads)
    m = float(x.mean())
    return float(x.std(unbiased=False)) / m if m > 0 else 0.0


# ----------------------------------------------------------------------------------------------
# planning

def _replica_counts(load: np.ndarray, total_slots: int, max_replicas: int) -> np.ndarray:
    """Give every expert one slot, then each spare slot to the expert with the largest per-replica
    load ``load / c`` (ties: lower id), up to ``max_replicas`` each."""
    E = load.shape[0]
    c = np.ones(E, dtype=np.int64)
    heap = [(-load[e], e) for e in range(E)]
    heapq.heapify(heap)
    spare = total_slots - E
    while spare > 0 and heap:
        neg, e = heapq.heappop(heap)
        if c[e] >= max_replicas:
            continue
        c[e] += 1
        spare -= 1
        if c[e] < max_replicas:
            heapq.heappush(heap, (-load[e] / c[e], e))
    return c


def plan_placement(predicted_load: Tensor, num_ranks: int, slots_per_rank: int,
                   current: Union[Tensor, Placement, None] = None, *,
                   max_moves: Union[int, str, None] = "auto", move_cost: Optional[MoveCost] = None,
                   max_move_bytes: Optional[int] = None,
                   replicas: bool = False, max_replicas: Optional[int] = None,
                   cv_threshold: float = 0.0, min_improvement: float = 0.0,
                   min_gain: float = 0.0, strategy: str = "swap") -> Placement:
    """Plan an expert placement that minimizes the maximum predicted rank load.

    Args:
        predicted_load: ``[E]`` non-negative predicted tokens per expert (e.g.
            :meth:`ExpertLoadPredictor.predict`). Every rank must pass the same values (the
            executor checks that the resulting placements agree).
        num_ranks, slots_per_rank: ``R`` ranks with ``S`` expert slots each; ``E <= R * S``.
        current: the placement in use — an ``[E]`` expert→rank tensor or a :class:`Placement`
            (``None``: plan from scratch with LPT, every expert counts as moved).
        max_moves: at most this many (expert, rank) copies to other ranks per re-plan. The
            default ``"auto"`` is :func:`default_max_moves` = ``max(1, E // 10)`` (25 of 256
            experts); ``None`` is the free re-placement without a limit (in the study of
            docs/ops/balance.md it copied ~40 % of all experts per re-plan). Experts are kept where they are unless moving them pays; moving an
            expert back to a rank that holds it in ``current`` is free. The budget applies only
            with ``current`` (a plan from scratch places every expert).
        move_cost: a :class:`MoveCost` (bytes per expert copy: weights + optimizer state); the
            result's ``moved_bytes`` is ``moved * move_cost.bytes_per_copy`` (0 without it).
        max_move_bytes: optional byte budget per re-plan (needs ``move_cost``): the copies are
            capped at ``max_move_bytes // bytes_per_copy`` as well.
        replicas: fill spare slots (``R * S - E``) with replicas of the hottest experts, each
            replica taking an equal share of the expert's tokens. Without it, spare slots stay
            empty and every expert has one copy.
        max_replicas: cap on copies per expert (default ``R``; replicas sit on distinct ranks).
        cv_threshold: trigger. If the coefficient of variation of the predicted rank loads under
            ``current`` is at most this, ``current`` is returned unchanged (no search).
        min_improvement: keep ``current`` unless the plan lowers the predicted imbalance
            (``max/mean − 1``) by more than this (absolute).
        min_gain: a single swap/move must lower the larger of the two rank loads it touches by
            more than this fraction of the mean rank load (hysteresis against chasing noise).
        strategy: ``"swap"`` (default: bounded lexicographic local search — swaps and moves
            between the most loaded rank and *every* other rank; when the top rank cannot be
            improved, the next one — after an LPT placement of new replicas), or
            ``"greedy_swap"`` (the baseline: only swaps between the most and least loaded rank).

    Returns:
        :class:`Placement` with ``imbalance_before/after``, ``cv_before/after``, ``moved``,
        ``moved_bytes`` and ``changed``.
    """
    _checks.check_tensor("predicted_load", predicted_load, ndim=1,
                         dtypes=_checks.FLOAT_DTYPES + _checks.INDEX_DTYPES)  # real numbers (no bool, no complex)
    E = predicted_load.numel()
    R, S = num_ranks, slots_per_rank
    check_fits(E, R, S)
    if strategy not in ("swap", "greedy_swap"):
        raise ValueError(f"strategy must be 'swap' or 'greedy_swap', got {strategy!r}")
    load = predicted_load.detach().to(torch.float64).cpu().numpy().copy()
    _check_load("predicted_load", load)
    if isinstance(max_moves, str):
        if max_moves != "auto":
            raise ValueError(f"max_moves must be an int >= 0, 'auto' or None, got {max_moves!r}")
        max_moves = default_max_moves(E)
    elif max_moves is not None:
        _checks.check_int("max_moves", max_moves, minimum=0)
    if move_cost is not None and not isinstance(move_cost, MoveCost):
        raise TypeError(f"move_cost must be a MoveCost, got {type(move_cost).__name__}")
    if max_move_bytes is not None:
        _checks.check_int("max_move_bytes", max_move_bytes, minimum=0)
        if move_cost is None:
            raise ValueError("max_move_bytes needs move_cost= (the bytes of one expert copy)")
        by_bytes = max_move_bytes // max(move_cost.bytes_per_copy, 1)
        max_moves = by_bytes if max_moves is None else min(max_moves, by_bytes)
    bytes_per_copy = move_cost.bytes_per_copy if move_cost is not None else 0
    for name, v in (("cv_threshold", cv_threshold), ("min_improvement", min_improvement),
                    ("min_gain", min_gain)):
        if not v >= 0:
            raise ValueError(f"{name} must be >= 0, got {v}")
    max_replicas = R if max_replicas is None else _checks.check_int("max_replicas", max_replicas, minimum=1)

    if current is None:
        cur = None
    else:
        if isinstance(current, Placement):
            cur = current
        else:
            try:  # the checks of an expert -> rank tensor, named after this argument
                cur = Placement.from_expert_to_rank(current, R, S)
            except (TypeError, ValueError) as e:
                raise type(e)(f"current (an [E] expert -> rank tensor or a Placement): {e}") from None
        if cur.num_experts != E:
            raise ValueError(f"current placement has {cur.num_experts} experts but predicted_load "
                             f"has {E}")
        if (cur.num_ranks, cur.slots_per_rank) != (R, S):
            raise ValueError(f"current placement is {cur.num_ranks} ranks x {cur.slots_per_rank} "
                             f"slots, expected {R} x {S}")
        if cur.has_replicas and not replicas:
            raise ValueError("current placement has replicas; pass replicas=True")

    if cur is not None:
        loads_before = cur.rank_loads(torch.from_numpy(load))
        imb_before, cv_before = imbalance(loads_before), coefficient_of_variation(loads_before)
        if cv_before <= cv_threshold:
            return _copy_with(cur, imb_before, imb_before, cv_before, cv_before, 0, False)
    else:
        imb_before = cv_before = None
        max_moves = None                      # from scratch: every expert is placed anyway
    budget = np.inf if max_moves is None else max_moves

    if not replicas:
        count = np.ones(E, dtype=np.int64)
    elif cur is None or max_moves is None:
        count = _replica_counts(load, R * S, max_replicas)
    else:
        count = _budgeted_replica_counts(load, cur.replica_count.numpy(), R * S, max_replicas,
                                         max_moves)
    w_of = load / count

    # ---- slots: keep current holders up to the new replica count ---------------------------------
    slot_e = np.full((R, S), -1, dtype=np.int64)
    cur_pairs = np.zeros((E, R), dtype=bool)          # (expert, rank) held by the current placement
    if cur is not None:
        cs = cur.slot_to_expert.numpy()
        kept = np.zeros(E, dtype=np.int64)
        for r in range(R):
            for i in range(S):
                e = cs[r, i]
                if e >= 0:
                    cur_pairs[e, r] = True
                    if kept[e] < count[e]:
                        slot_e[r, i] = e
                        kept[e] += 1
    on_rank = np.zeros((E, R), dtype=bool)
    on_rank[slot_e[slot_e >= 0], np.nonzero(slot_e >= 0)[0]] = True
    rank_load = np.array([w_of[slot_e[r][slot_e[r] >= 0]].sum() for r in range(R)])
    # ---- LPT for items without a slot (new replicas, or everything without `current`) -----------
    placed = on_rank.sum(1)
    todo = [(e, w_of[e]) for e in range(E) for _ in range(count[e] - placed[e])]
    todo.sort(key=lambda x: -x[1])
    free = (slot_e < 0).sum(1)
    for e, w in todo:
        ok = (free > 0) & ~on_rank[e]
        if not ok.any():              # every free slot is on a rank that already holds e:
            continue                  # this replica is not placed (its load goes to the others)
        r = int(np.argmin(np.where(ok, rank_load, np.inf)))
        i = int(np.nonzero(slot_e[r] < 0)[0][0])
        slot_e[r, i] = e
        on_rank[e, r] = True
        free[r] -= 1
        rank_load[r] += w
    if todo:
        count = on_rank.sum(1).astype(np.int64)
        w_of = load / count
        rank_load = np.array([w_of[slot_e[r][slot_e[r] >= 0]].sum() for r in range(R)])
    moved = int((on_rank & ~cur_pairs).sum())

    # ---- bounded local search ----------------------------------------------------------------------
    flat_e = slot_e.reshape(-1)                        # views into slot_e
    slot_rank = np.repeat(np.arange(R), S)
    mean_load = max(load.sum() / R, 1e-300)
    eps = 1e-9 * mean_load + min_gain * mean_load
    state = (flat_e, slot_rank, on_rank, cur_pairs, rank_load)
    for _ in range(4 * R * S):
        order = np.argsort(-rank_load, kind="stable")
        # greedy_swap: only the most loaded rank against the least loaded one.
        # swap: the most loaded rank against every rank; if it cannot be improved, the next most
        # loaded one, and so on (lexicographic min-max: flattens the whole upper tail, which is
        # what the realized, noisy maximum depends on).
        sources = order[:1] if strategy == "greedy_swap" else order
        best = None
        for src in sources:
            dst = order[-1:] if strategy == "greedy_swap" else None
            best = _best_exchange(int(src), dst, w_of, state, moved, budget, eps, strategy)
            if best is not None:
                break
        if best is None:
            break
        sa, sb, new_src, new_dst, gain = best
        r_a, r_b = slot_rank[sa], slot_rank[sb]
        e_a, e_b = flat_e[sa], flat_e[sb]
        flat_e[sa], flat_e[sb] = e_b, e_a
        on_rank[e_a, r_a], on_rank[e_a, r_b] = False, True
        if e_b >= 0:
            on_rank[e_b, r_b], on_rank[e_b, r_a] = False, True
        rank_load[r_a], rank_load[r_b] = new_src, new_dst
        moved += gain

    plan = Placement(torch.from_numpy(slot_e.copy()), E)
    after = plan.rank_loads(torch.from_numpy(load))
    imb_after, cv_after = imbalance(after), coefficient_of_variation(after)
    if cur is not None and (imb_before - imb_after) <= min_improvement:
        return _copy_with(cur, imb_before, imb_before, cv_before, cv_before, 0, False)
    moved = int((on_rank & ~cur_pairs).sum())
    changed = cur is None or not torch.equal(plan.slot_to_expert, cur.slot_to_expert)
    return _copy_with(plan, imb_before, imb_after, cv_before, cv_after, moved, changed,
                      moved * bytes_per_copy)


def _check_load(name: str, load: np.ndarray) -> None:
    bad = ~np.isfinite(load)
    if bad.any():
        i = int(np.nonzero(bad)[0][0])
        raise ValueError(f"{name} must be finite and non-negative: entry {i} is {load[i]}")
    if (load < 0).any():
        i = int(np.nonzero(load < 0)[0][0])
        raise ValueError(f"{name} must be finite and non-negative: entry {i} is {load[i]}")
    if load.size and load.max() > np.finfo(np.float64).max / load.size:  # every sum stays finite in fp64
        raise ValueError(f"{name} is too large: its entries (up to {load.max()}) times their number "
                         f"{load.size} overflow float64 (the load sums would be inf); scale it down")


def _budgeted_replica_counts(load, cur_count, total_slots, max_replicas, budget):
    """Replica counts reachable from ``cur_count`` with at most ``budget`` new copies: start from
    the current counts and move one replica at a time toward :func:`_replica_counts`' target,
    the expert with the largest per-replica load first (it takes an empty slot if there is one,
    else the replica whose loss costs least, ``load / (c - 1)`` smallest)."""
    want = _replica_counts(load, total_slots, max_replicas)
    c = cur_count.astype(np.int64).copy()
    free = total_slots - int(c.sum())
    for _ in range(int(budget)):
        up = np.nonzero(c < want)[0]
        if up.size == 0:
            break
        e_up = int(up[np.argmax(load[up] / c[up])])
        if free > 0:
            free -= 1
        else:
            dn = np.nonzero(c > want)[0]
            if dn.size == 0:
                break
            e_dn = int(dn[np.argmin(load[dn] / (c[dn] - 1))])
            c[e_dn] -= 1
        c[e_up] += 1
    return c


def _best_exchange(src, dst, w_of, state, moved, budget, eps, strategy):
    """Best swap of an expert on rank ``src`` with an expert (or empty slot) on another rank
    (``dst`` ranks only, if given) that lowers the larger of the two rank loads below
    ``load[src] - eps`` within the move budget. Returns ``(slot_a, slot_b, new_src_load,
    new_dst_load, extra_copies)`` or ``None``."""
    flat_e, slot_rank, on_rank, cur_pairs, rank_load = state
    a_slots = np.nonzero((slot_rank == src) & (flat_e >= 0))[0]
    if dst is None:
        b_slots = np.nonzero(slot_rank != src)[0]
    else:
        b_slots = np.nonzero(np.isin(slot_rank, dst) & (slot_rank != src))[0]
    if a_slots.size == 0 or b_slots.size == 0:
        return None
    ea, eb = flat_e[a_slots][:, None], flat_e[b_slots][None, :]
    ebc = eb.clip(min=0)
    wa = w_of[ea]
    wb = np.where(eb >= 0, w_of[ebc], 0.0)
    rb = slot_rank[b_slots][None, :]
    L = rank_load[src]
    new_src = L - wa + wb
    new_dst = rank_load[rb] + wa - wb
    pair_max = np.maximum(new_src, new_dst)
    ok = pair_max < L - eps
    ok &= ~on_rank[ea, rb]                                   # replicas stay on distinct ranks
    ok &= (eb < 0) | ~on_rank[ebc, src]
    # extra copies: (expert, rank) pairs the current placement does not hold
    gain = (~cur_pairs[ea, rb]).astype(np.int64) - (~cur_pairs[ea, src]).astype(np.int64)
    gain = gain + np.where(eb >= 0, (~cur_pairs[ebc, src]).astype(np.int64)
                           - (~cur_pairs[ebc, rb]).astype(np.int64), 0)
    ok &= moved + gain <= budget
    if not ok.any():
        return None
    if strategy == "greedy_swap":
        score = np.abs(new_src - new_dst)
    else:
        # lowest resulting pair maximum; near-ties -> fewer copies, then the more even pair
        score = pair_max + 1e-6 * L * gain + 1e-9 * np.abs(new_src - new_dst)
    score = np.where(ok, score, np.inf)
    ia, ib = np.unravel_index(int(np.argmin(score)), score.shape)
    return (int(a_slots[ia]), int(b_slots[ib]), float(new_src[ia, ib]), float(new_dst[ia, ib]),
            int(gain[ia, ib]))


def _copy_with(p: Placement, ib, ia, cb, ca, moved, changed, moved_bytes=0) -> Placement:
    return Placement(p.slot_to_expert.clone(), p.num_experts, ib, ia, cb, ca, moved, changed,
                     moved_bytes)
