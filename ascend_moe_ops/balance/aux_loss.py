"""Auxiliary load-balancing losses, the auxiliary-loss-free bias update, and token-drop accounting.

All functions take the router's output as plain tensors:

* ``scores``  ``[T, E]`` float: the router's normalized scores (softmax or sigmoid-normalized)
  for every token and expert; the loss is differentiable w.r.t. it.
* ``routing`` ``[T, K]`` int32/int64 expert ids (``-1`` = empty slot), or a ``[T, E]`` bool mask:
  which experts each token was sent to. Counts taken from it never carry a gradient.

Formulas (``coeff`` = α, ``K`` = ``topk``, ``c_e`` = routed slots to expert e)::

    f_e = c_e / (K · T)             fraction of routed slots that went to expert e
    P_e = (1/T) Σ_t scores[t, e]    mean router score of expert e
    L   = α · E · Σ_e f_e · P_e      (= α when routing and scores are perfectly uniform)

``level`` says over which tokens ``c_e`` and ``T`` are counted (see :func:`aux_loss`).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from ..ops import checks as _checks
from .executor import ArgumentCheck, check_consistent

Tensor = torch.Tensor

LEVELS = ("micro_batch", "sequence", "ep_group", "dp_group", "global")
_GROUP_LEVELS = LEVELS[2:]


def expert_counts(routing: Tensor, num_experts: int) -> Tensor:
    """``[E]`` int64 number of routed slots per expert (``-1`` slots ignored), no gradient.

    ``routing`` is checked as :func:`aux_loss` and :func:`drop_stats` check it: ``[T, K]`` int
    ids in ``[-1, E)`` or a ``[T, E]`` bool mask (a ``ValueError`` / ``TypeError`` naming
    ``routing`` otherwise; on an accelerator the id range is a device-side assert)."""
    _checks.check_int("num_experts", num_experts, minimum=1)
    _check_routing(routing, num_experts)
    return _counts(routing, num_experts)


def _counts(routing: Tensor, num_experts: int) -> Tensor:
    """:func:`expert_counts` of a routing already checked."""
    if routing.dtype == torch.bool:
        return routing.sum(0, dtype=torch.int64)
    ids = routing.reshape(-1).long()
    ids = ids[ids >= 0]
    return torch.bincount(ids, minlength=num_experts)[:num_experts].to(torch.int64)


def _check_routing(routing: Tensor, num_experts: int, num_tokens: Optional[int] = None,
                   device=None) -> None:
    """The one check of a ``routing`` argument of this module: 2-D, int ids in ``[-1, E)`` or a
    bool mask of ``E`` columns; with ``num_tokens``, one row per token of ``scores``."""
    _checks.check_tensor("routing", routing, ndim=2, dtypes=(torch.bool,) + _checks.INDEX_DTYPES,
                         device=device)
    if num_tokens is not None and routing.shape[0] != num_tokens:
        raise ValueError(f"routing must have one row per token: scores has {num_tokens} rows, "
                         f"routing has shape {tuple(routing.shape)}")
    if routing.dtype == torch.bool:
        if routing.shape[1] != num_experts:
            raise ValueError(f"routing: a mask must have num_experts={num_experts} columns, got "
                             f"shape {tuple(routing.shape)}")
    else:
        _checks.check_index_range("routing (expert ids)", routing, -1, num_experts)


def _check_num_experts(num_experts: Optional[int], group, what: str, device=None, *,
                       args: ArgumentCheck, caller: str) -> None:
    """Collective over ``group``: the same ``ValueError`` on every rank if the ranks' ``E``
    differ (the count all-reduce that follows would differ in size: gloo aborts the process on
    that), and an error on every rank if any rank's argument checks (``args``) failed: that rank
    raises its own, the others one naming the rejecting ranks and ``caller``. One tiny
    all-gather (:func:`check_consistent`), before the counts are reduced."""
    check_consistent(None if args.error is not None else torch.tensor([num_experts]), group, what,
                     device=device, hint="every rank of the group must count the same experts",
                     error=args.error, caller=caller)


def _device_of(*objs):
    """Device of the first tensor among ``objs`` (``None``: the CPU), for the check all-gather of
    a rank whose arguments may be invalid."""
    return next((o.device for o in objs if isinstance(o, torch.Tensor)), None)


def _resolve_group(level: str, group):
    if level in ("ep_group", "dp_group"):
        if group is None:
            raise ValueError(f"level={level!r} needs group= (the {level.split('_')[0].upper()} "
                             "process group whose counts are summed)")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"level={level!r} all-reduces expert counts, but torch.distributed is "
                           "not initialized")
    return group if group is not None else dist.group.WORLD


def aux_loss(scores: Tensor, routing: Tensor, *, level: str = "micro_batch", group=None,
             seq_len: Optional[int] = None, coeff: float = 1e-2,
             topk: Optional[int] = None) -> Tensor:
    """Switch-style load-balancing loss ``coeff · E · Σ_e f_e · P_e`` at a chosen level.

    Args:
        scores: ``[T, E]`` float router scores (fp32/fp16/bf16/fp64; computed in fp32 or fp64).
        routing: ``[T, K]`` expert ids (``-1`` = empty) or ``[T, E]`` bool mask.
        level: where the balance is enforced:

            * ``"micro_batch"`` — ``f`` and ``P`` over this rank's ``T`` tokens.
            * ``"sequence"`` — ``T = B · seq_len`` tokens are ``B`` sequences (sequence-major); the
              loss is computed per sequence and averaged over sequences (strictest).
            * ``"ep_group"`` / ``"dp_group"`` / ``"global"`` — the counts ``c_e`` and the token
              count ``T`` are summed with one ``all_reduce`` over ``group`` (the EP group, the DP
              group, or the whole world; ``group`` is required for the first two) before the
              product; ``P_e`` stays the local mean. Only ``E + 1`` integers cross the network
              (after one tiny all-gather checking that the ranks agree on ``E``: a ``ValueError``
              naming it on every rank otherwise) and nothing is differentiated through the
              collective. Averaging the per-rank losses over
              the group (what data-parallel gradient averaging does) gives
              ``coeff · E · Σ_e f_e^group · P_e^group`` for equal per-rank token counts.
        group: process group for the group levels (``None`` = world for ``"global"``).
        seq_len: tokens per sequence, required for ``level="sequence"``; must divide ``T``.
        coeff: α.
        topk: ``K``, the routed slots per token used in ``f_e``'s denominator. Defaults to
            ``routing.shape[1]`` for id routing; required for a mask.

    Returns:
        0-d fp32 tensor (fp64 if scores are fp64). Gradient flows only into ``scores``. Over
        zero tokens (``T = 0``, or no token on any rank of the group) the loss is 0 (not NaN)
        and so is its gradient.
        Every rank of ``group`` must call it (it is a collective for the group levels). At the
        group levels an argument one rank rejects raises there and a ``ValueError`` naming that
        rank on the others (the flag rides on the ``E`` all-gather): never a hang.
    """
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    g = _resolve_group(level, group) if level in _GROUP_LEVELS else None
    with ArgumentCheck() as args:      # collective levels: the error reaches every rank
        coeff = _checks.check_float("coeff", coeff, finite=True)
        _checks.check_tensor("scores", scores, ndim=2, dtypes=_checks.FLOAT_DTYPES)
        T, E = scores.shape
        _check_routing(routing, E, T, scores.device)
        if topk is None:
            if routing.dtype == torch.bool:
                raise ValueError("topk is required when routing is a [T, E] mask")
            topk = routing.shape[1]
        _checks.check_int("topk", topk, minimum=1)
    if g is not None:
        _check_num_experts(None if args.error else E, g, "num_experts E (scores.shape[1])",
                           _device_of(scores, routing), args=args, caller="aux_loss")
    args.raise_error()
    acc = torch.float64 if scores.dtype == torch.float64 else torch.float32
    s = scores.to(acc)

    if level == "sequence":
        if seq_len is None:
            raise ValueError("level='sequence' needs seq_len= (tokens per sequence)")
        _checks.check_int("seq_len", seq_len, minimum=1)
        if T % seq_len:
            raise ValueError(f"seq_len={seq_len} must divide the number of tokens T={T}")
        B = T // seq_len
        if B == 0:                       # no tokens: no imbalance to penalize (0, not 0/0)
            return coeff * E * s.sum()
        if routing.dtype == torch.bool:
            counts = routing.view(B, seq_len, E).sum(1).to(acc)                       # [B, E]
        else:
            ids = routing.long().view(B, -1)
            valid = ids >= 0
            counts = torch.zeros(B, E + 1, dtype=acc, device=s.device)
            counts.scatter_add_(1, torch.where(valid, ids, E), valid.to(acc))
            counts = counts[:, :E]
        f = counts / (topk * seq_len)                                                  # [B, E]
        P = s.view(B, seq_len, E).mean(1)                                              # [B, E]
        return coeff * E * (f * P).sum(1).mean()

    counts = _counts(routing, E)
    n_tokens = torch.tensor([T], dtype=torch.int64, device=counts.device)
    if g is not None:
        buf = torch.cat([counts, n_tokens])
        dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=g)
        counts, n_tokens = buf[:E], buf[E:]
    # zero tokens (locally, or over the whole group): f = 0 and the loss is 0, not 0/0 = NaN
    f = counts.to(acc) / (topk * n_tokens.clamp(min=1).to(acc))
    P = s.mean(0) if T > 0 else s.sum(0)
    return coeff * E * (f * P).sum()


def z_loss(logits: Tensor, *, coeff: float = 1e-3) -> Tensor:
    """Router z-loss ``coeff · mean_t (log Σ_e exp(logits[t, e]))²`` (keeps router logits small).

    ``logits`` ``[T, E]`` are the pre-softmax router logits; computed in fp32 (fp64 stays fp64).
    """
    _checks.check_tensor("logits", logits, ndim=2, dtypes=_checks.FLOAT_DTYPES)
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    lse = torch.logsumexp(logits.to(acc), dim=1)
    return coeff * (lse * lse).mean() if lse.numel() else lse.sum() * coeff


@torch.no_grad()
def update_expert_bias(bias: Tensor, tokens_per_expert: Tensor, *, rate: float = 1e-3,
                       group=None) -> Tensor:
    """Auxiliary-loss-free balancing: nudge a per-expert routing bias against the load.

    ``bias[e] += rate · sign(mean_load − load_e)`` in place: overloaded experts get a lower bias,
    underloaded ones a higher bias. The bias is added to the scores only to *select* the top-k
    experts (see :func:`biased_topk`); the gating weights use the unbiased scores, so no gradient
    is involved. ``tokens_per_expert`` ``[E]`` is this rank's count; with ``group`` it is summed over
    that group first (one ``all_reduce``, after one tiny all-gather that raises the same
    ``ValueError`` on every rank if the ranks' ``E`` differ, and an error on every rank if one
    rank's arguments are rejected), so every rank applies the same update.

    Returns ``bias`` (updated in place).
    """
    with ArgumentCheck() as args:      # with group: the error reaches every rank
        # fp32 / fp64 only: a 1e-3 step next to a bias of 1 vanishes in bf16 / fp16 (the update
        # returned the bias unchanged)
        _checks.check_tensor("bias", bias, ndim=1, dtypes=(torch.float32, torch.float64))
        _check_bias_finite(bias)
        _checks.check_tensor("tokens_per_expert", tokens_per_expert, ndim=1)
        _checks.check_shape("tokens_per_expert", tokens_per_expert, bias.shape, "one count per expert")
        rate = _checks.check_float("rate", rate, finite=True, minimum=0,
                                   why=" (a NaN or infinite rate makes every bias NaN or infinite for the "
                                       "rest of training)")
        _check_counts(tokens_per_expert)
    if group is not None:
        _check_num_experts(None if args.error else bias.shape[0], group,
                           "num_experts E (bias.shape[0])", _device_of(tokens_per_expert, bias),
                           args=args, caller="update_expert_bias")
    args.raise_error()
    load = tokens_per_expert.to(torch.float64 if bias.dtype == torch.float64 else torch.float32)
    if group is not None:
        load = load.clone()
        dist.all_reduce(load, op=dist.ReduceOp.SUM, group=group)
    bias.add_(rate * torch.sign(load.mean() - load).to(bias.dtype))
    return bias


def _check_counts(counts: Tensor) -> None:
    """Load counts are finite and >= 0: a NaN, an infinity or a negative count would turn every
    expert's bias update into NaN or push it the wrong way, silently and for the rest of training."""
    _checks.check_values("tokens_per_expert", counts, lambda c: (c < 0) | ~torch.isfinite(c),
                         ": counts must be finite and >= 0", "has counts that are not finite and >= 0")


def _check_bias_finite(bias: Tensor) -> None:
    _checks.check_values("bias", bias, lambda b: ~torch.isfinite(b), ": biases must be finite",
                         "has a bias that is not finite")


def biased_topk(scores: Tensor, bias: Tensor, k: int):
    """Top-k selection on ``scores + bias``; weights are gathered from the unbiased ``scores``.

    The sum is taken in fp32 (fp64 if either is fp64), whatever the scores' dtype: a small bias
    next to bf16 scores must still break their ties. ``bias`` must be finite (a NaN bias made the
    selection pick arbitrary experts).

    Returns ``(topk_idx [T, k] int64, topk_weight [T, k])``.
    """
    _checks.check_tensor("scores", scores, ndim=2, dtypes=_checks.FLOAT_DTYPES)
    _checks.check_tensor("bias", bias, ndim=1, dtypes=_checks.FLOAT_DTYPES, device=scores.device)
    _checks.check_shape("bias", bias, (scores.shape[1],), "one bias per expert")
    _checks.check_int("k", k, minimum=1)
    if k > scores.shape[1]:
        raise ValueError(f"k must be <= the number of experts (columns of scores) {scores.shape[1]}, got {k}")
    _check_bias_finite(bias)
    acc = torch.float64 if torch.float64 in (scores.dtype, bias.dtype) else torch.float32
    idx = torch.topk(scores.detach().to(acc) + bias.to(acc), k, dim=1).indices
    return idx, scores.gather(1, idx)


class DropStats(NamedTuple):
    """Token-drop accounting for capacity (drop-and-pad) mode.

    routed:        ``[E]`` int64 routed slots per expert (before dropping).
    dropped:       ``[E]`` int64 slots dropped per expert.
    rate_per_expert: ``[E]`` fp32 ``dropped / routed`` (0 where nothing was routed).
    rate:          0-d fp32 overall ``Σ dropped / Σ routed``.
    capacity:      rows per expert that were allowed.
    """

    routed: Tensor
    dropped: Tensor
    rate_per_expert: Tensor
    rate: Tensor
    capacity: int


def check_capacity_factor(capacity_factor) -> None:
    """A finite number > 0 (comparisons rather than math.isfinite, which a symbolic float under
    ``torch.compile(dynamic=True)`` cannot trace; NaN fails both)."""
    if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)) \
            or not 0 < capacity_factor < math.inf:
        raise ValueError(f"capacity_factor must be a finite number > 0, got {capacity_factor!r}")


def capacity_for(num_tokens: int, topk: int, num_experts: int, capacity_factor: float) -> int:
    """``C = ceil(capacity_factor · T · K / E)`` rows per expert (the usual capacity rule).

    ``num_tokens`` ``T >= 0``, ``topk`` ``K >= 1`` and ``num_experts`` ``E >= 1`` are ints (a
    symbolic size under ``torch.compile`` too); anything else is a ``ValueError`` /
    ``TypeError`` naming the argument."""
    for name, value, minimum in (("num_tokens", num_tokens, 0), ("topk", topk, 1),
                                 ("num_experts", num_experts, 1)):
        _checks.check_int(name, value, minimum=minimum)
    check_capacity_factor(capacity_factor)
    return int(math.ceil(capacity_factor * num_tokens * topk / num_experts))


def drop_stats(routing: Tensor, *, num_experts: Optional[int] = None, capacity: Optional[int] = None,
               capacity_factor: Optional[float] = None, row_id_map: Optional[Tensor] = None,
               group=None) -> DropStats:
    """Dropped-slot rate per expert and overall for capacity mode.

    Either give the ``row_id_map`` that :func:`ascend_moe_ops.moe_permute` returned in capacity
    mode (a routed slot with ``row_id_map == -1`` was dropped), or let the drops be computed from
    the counts: expert ``e`` keeps ``min(c_e, C)`` slots. ``C`` is ``capacity`` or, from
    ``capacity_factor``, ``ceil(cf · T · K / E)`` (the rule behind "capacity factor 1.5").
    With ``group`` the per-expert counts are summed over that group (one ``all_reduce``, after one
    tiny all-gather that raises the same ``ValueError`` on every rank if ``num_experts`` differs),
    giving the group-wide rates while capacity is still applied per rank. With ``group``, an
    argument one rank rejects raises there and a ``ValueError`` naming that rank on the others.
    """
    with ArgumentCheck() as args:      # with group: the error reaches every rank
        _checks.check_tensor("routing", routing, ndim=2, dtypes=(torch.bool,) + _checks.INDEX_DTYPES)
        if num_experts is None:
            if routing.dtype != torch.bool:
                raise ValueError("num_experts is required when routing holds expert ids")
            num_experts = routing.shape[1]
        _checks.check_int("num_experts", num_experts, minimum=1)
        _check_routing(routing, num_experts)
        T, K = routing.shape
        topk = K if routing.dtype != torch.bool else max(1, int(routing.sum(1).max()) if T else 1)
        if (capacity is None) == (capacity_factor is None) and row_id_map is None:
            raise ValueError("give exactly one of capacity= or capacity_factor= (or row_id_map=)")
        if capacity is None and capacity_factor is not None:
            if not capacity_factor > 0:
                raise ValueError(f"capacity_factor must be > 0, got {capacity_factor}")
            capacity = capacity_for(T, topk, num_experts, capacity_factor)
        if row_id_map is not None:
            _checks.check_tensor("row_id_map", row_id_map, dtypes=_checks.INDEX_DTYPES)
            _checks.check_shape("row_id_map", row_id_map, routing.shape, "the shape of routing")
        else:
            _checks.check_int("capacity", capacity, minimum=0)
    if group is not None:
        _check_num_experts(None if args.error else num_experts, group, "num_experts",
                           _device_of(routing), args=args, caller="drop_stats")
    args.raise_error()
    routed = _counts(routing, num_experts)
    if row_id_map is not None:
        used = (routing if routing.dtype == torch.bool else routing >= 0)
        lost = used & (row_id_map < 0)
        if routing.dtype == torch.bool:
            dropped = lost.sum(0, dtype=torch.int64)
        else:
            dropped = torch.bincount(routing.long()[lost], minlength=num_experts)[:num_experts]
        capacity = -1 if capacity is None else capacity
    else:
        dropped = (routed - capacity).clamp(min=0)
    if group is not None:
        buf = torch.stack([routed, dropped.to(torch.int64)])
        dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)
        routed, dropped = buf[0], buf[1]
    rate_e = torch.where(routed > 0, dropped.float() / routed.clamp(min=1).float(),
                         torch.zeros((), dtype=torch.float32))
    total = routed.sum()
    rate = dropped.sum().float() / total.clamp(min=1).float()
    return DropStats(routed, dropped.to(torch.int64), rate_e, rate, int(capacity))
