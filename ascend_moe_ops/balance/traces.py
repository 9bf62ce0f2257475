"""Synthetic expert-load traces and a replay loop that scores a placement policy against its oracle.

Used by ``bench/bench_balance.py`` (the study in docs/ops/balance.md) and by the quality test in
``tests/test_balance.py``; pure numpy + the package's own predictor and planner, no collectives.

A trace is ``(p [steps, E], counts [steps, E])``: the true per-step expert probabilities and the
routed (token, expert) slots actually drawn from them (multinomial, ``slots_per_step`` per step).

:func:`replay` runs one policy over a trace: every ``interval`` steps it plans a new placement
with :func:`plan_placement` from a forecast (the predictor, which has seen the counts of all
earlier steps) and measures the per-step imbalance ``max / mean rank load − 1`` on the sampled
counts. With ``oracle="next_step"`` the same planner is fed the true expected load of the first
step the placement serves (``p[t] * slots_per_step``) instead of a forecast; with
``oracle="interval"`` the true expected load averaged over the whole coming interval (a
clairvoyant bound that also knows the drift to come); with ``oracle="previous_step"`` the true
expected load of the last step already observed (``p[t - 1]``): what a perfect, noise-free
estimate of the present could reach without seeing the future (the ceiling of any causal
predictor that does not anticipate changes). The *cut* is
``1 − mean dynamic imbalance / mean static imbalance`` over the measured steps.
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import torch

from .planner import MoveCost, Placement, plan_placement
from .predictor import ExpertLoadPredictor

TRACES = {
    "lognormal_slow": "lognormal loads, sigma=0.6 in log space, mean-reverting drift tau=1000 steps",
    "lognormal_fast": "lognormal loads, sigma=0.6 in log space, mean-reverting drift tau=100 steps",
    "zipf": "Zipf(s=1.0) shares over a random expert order (top share capped at 1/K), "
            "slow lognormal drift sigma=0.3 tau=1000",
    "bursty": "lognormal_slow plus bursts: an expert's share jumps x2-x4 for 5-200 steps "
              "(onsets Poisson, ~6 % of experts bursting at a time) and 1-2 step spikes x3",
}


def _ar1(rng, steps, n, sigma, tau):
    """Mean-reverting (AR(1)) log-loads: stationary std ``sigma``, correlation time ``tau`` steps."""
    phi = 1.0 - 1.0 / tau
    x = np.empty((steps, n))
    x[0] = rng.normal(0.0, sigma, n)
    innov = sigma * np.sqrt(1.0 - phi * phi)
    for t in range(1, steps):
        x[t] = phi * x[t - 1] + innov * rng.normal(size=n)
    return x


def _cap(p, cap):
    """Water-fill: no expert gets more than ``cap`` of the slots (top-K routing picks K distinct
    experts per token, so one expert can take at most 1/K of all slots)."""
    p = p / p.sum()
    for _ in range(50):
        over = p > cap
        if not over.any():
            break
        excess = (p[over] - cap).sum()
        p[over] = cap
        p[~over] += excess * p[~over] / p[~over].sum()
    return p


def _bursts(rng, steps, n):
    """Additive log-factors of bursts: sustained ones (x2..x4 for 5..200 steps, about 6 % of the
    experts at a time) and short spikes (x3 for 1..2 steps, ~1 per 4 steps over all experts)."""
    out = np.zeros((steps, n))
    mean_len = 60.0
    rate = 0.06 / mean_len                    # onsets per expert per step -> ~6 % bursting
    for e in range(n):
        t = int(rng.exponential(1.0 / rate))
        while t < steps:
            d = int(np.clip(rng.exponential(mean_len), 5, 200))
            out[t:t + d, e] += np.log(rng.uniform(2.0, 4.0))
            t += d + int(rng.exponential(1.0 / rate))
    n_spikes = rng.poisson(steps / 4.0)
    for _ in range(n_spikes):
        t, e, d = int(rng.integers(steps)), int(rng.integers(n)), int(rng.integers(1, 3))
        out[t:t + d, e] += np.log(3.0)
    return out


def make_trace(kind: str, steps: int, seed: int = 0, *, num_experts: int = 256, topk: int = 8,
               slots_per_step: int = 65536):
    """``(p [steps, E] true probabilities, counts [steps, E] fp64 sampled routed slots)`` of one
    trace kind of :data:`TRACES`, deterministic in ``seed``."""
    if kind not in TRACES:
        raise ValueError(f"kind must be one of {tuple(TRACES)}, got {kind!r}")
    rng = np.random.default_rng(seed)
    E = num_experts
    if kind == "lognormal_slow":
        logits = _ar1(rng, steps, E, 0.6, 1000.0)
    elif kind == "lognormal_fast":
        logits = _ar1(rng, steps, E, 0.6, 100.0)
    elif kind == "zipf":
        base = -1.0 * np.log(np.arange(1, E + 1))[rng.permutation(E)]
        logits = base + _ar1(rng, steps, E, 0.3, 1000.0)
    else:  # bursty
        logits = _ar1(rng, steps, E, 0.6, 1000.0) + _bursts(rng, steps, E)
    p = np.exp(logits - logits.max(1, keepdims=True))
    p = np.stack([_cap(row, 1.0 / topk) for row in p])
    counts = np.stack([rng.multinomial(slots_per_step, row) for row in p]).astype(np.float64)
    return p, counts


def imbalance_rows(slot_to_expert: np.ndarray, replica: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Per-step imbalance ``max / mean − 1`` of ``counts [n, E]`` under a placement (replicas
    share their expert's load evenly)."""
    per_slot = counts / replica[None, :]
    valid = slot_to_expert >= 0
    w = np.where(valid[None], per_slot[:, slot_to_expert.clip(min=0)], 0.0)   # [n, R, S]
    loads = w.sum(2)
    return loads.max(1) / np.maximum(loads.mean(1), 1e-300) - 1.0


def static_imbalance(counts: np.ndarray, num_ranks: int, slots_per_rank: int,
                     measure_from: int = 300) -> float:
    pl = Placement.contiguous(counts.shape[1], num_ranks, slots_per_rank)
    return float(imbalance_rows(pl.slot_to_expert.numpy(), pl.replica_count.numpy().astype(np.float64),
                                counts[measure_from:]).mean())


def replay(p: np.ndarray, counts: np.ndarray, num_ranks: int, slots_per_rank: int, *,
           predictor: Optional[Callable[[], ExpertLoadPredictor]] = None,
           oracle: Optional[str] = None, interval: int = 10, warmup: int = 100,
           measure_from: int = 300, move_cost: Optional[MoveCost] = None, **plan_kw) -> dict:
    """Run one dynamic-placement policy over a trace (see the module docs).

    Args:
        p, counts: a trace (:func:`make_trace`).
        predictor: factory of the :class:`ExpertLoadPredictor` that forecasts (default: the
            predictor's default method with ``horizon=interval``). Ignored with ``oracle``.
        oracle: ``None`` (forecast), ``"next_step"``, ``"interval"`` or ``"previous_step"``.
        interval: steps between re-plans; the first at ``warmup``.
        measure_from: first step whose imbalance counts.
        move_cost, **plan_kw: passed to :func:`plan_placement` (``max_moves``, ``replicas``, ...).

    Returns a dict: ``imbalance`` (mean over measured steps), ``static``, ``cut``, ``moves_mean``
    / ``moves_max`` (expert copies per re-plan point from ``measure_from`` on, a rejected plan
    counting 0), ``bytes_mean`` (with ``move_cost``), ``replans``,
    ``pred_err`` (L1 error of the forecast vs the interval's realised mean counts, relative).
    """
    if oracle not in (None, "next_step", "interval", "previous_step"):
        raise ValueError("oracle must be None, 'next_step', 'interval' or 'previous_step', "
                         f"got {oracle!r}")
    steps, E = counts.shape
    N = counts[0].sum()
    R = num_ranks
    slots = slots_per_rank + (1 if plan_kw.get("replicas") and "slots" not in plan_kw else 0)
    slots = plan_kw.pop("slots", slots)
    placement = Placement.contiguous(E, R, slots)
    if predictor is None:
        pred = ExpertLoadPredictor(E, horizon=interval)
    else:
        pred = predictor()
    imb = np.empty(steps)
    moves, nbytes, pred_err = [], [], []
    s2e = placement.slot_to_expert.numpy()
    rep = placement.replica_count.numpy().astype(np.float64)
    for t in range(steps):
        if t >= warmup and (t - warmup) % interval == 0:
            nxt = counts[t:t + interval].mean(0)
            if oracle == "next_step":
                guess = torch.from_numpy(p[t] * N)
            elif oracle == "previous_step":
                guess = torch.from_numpy(p[max(t - 1, 0)] * N)
            elif oracle == "interval":
                guess = torch.from_numpy(p[t:t + interval].mean(0) * N)
            else:
                guess = pred.predict()
            pred_err.append(np.abs(guess.numpy() - nxt).sum() / nxt.sum())
            new = plan_placement(guess, R, slots, placement, move_cost=move_cost, **plan_kw)
            if t >= measure_from:
                moves.append(new.moved)
                nbytes.append(new.moved_bytes)
            if new.changed:
                placement = new
                s2e = placement.slot_to_expert.numpy()
                rep = placement.replica_count.numpy().astype(np.float64)
        imb[t] = imbalance_rows(s2e, rep, counts[t:t + 1])[0]
        if oracle is None:
            pred.update(torch.from_numpy(counts[t]))
    m = float(imb[measure_from:].mean())
    st = static_imbalance(counts, R, slots_per_rank, measure_from)
    return {
        "imbalance": m,
        "static": st,
        "cut": 1.0 - m / st if st > 0 else 0.0,
        "moves_mean": float(np.mean(moves)) if moves else 0.0,
        "moves_max": int(np.max(moves)) if moves else 0,
        "bytes_mean": float(np.mean(nbytes)) if nbytes else 0.0,
        "replans": len(moves),
        "pred_err": float(np.mean(pred_err)) if pred_err else float("nan"),
    }
