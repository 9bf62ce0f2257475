"""Study: dynamic expert placement on synthetic expert-load traces.

Simulates the expert-parallel layout of one MoE layer (256 experts, 32 ranks x 8 slots, 64K routed
slots per step drawn multinomially from a drifting per-expert probability vector) and measures the
device-level imbalance ``max / mean rank load - 1`` per step under

* static placement (expert e on rank e // 8),
* dynamic placement: every ``interval`` steps a predictor (last / window mean / EMA / trend)
  forecasts the per-expert load and a planner (greedy max<->min swap baseline, or
  ``plan_placement``'s bounded local search) re-places at most ``max_moves`` experts,
* dynamic placement with 32 redundant slots (32 x 9) filled with replicas of hot experts,
* an oracle that re-plans every step from the true probabilities without a move limit (the floor
  left by sampling noise alone).

These are simulations, not timings: ``run(ctx)`` returns rows whose ``seconds`` is the planner's
time per re-plan and whose ``extra`` holds the study's figures. ``python bench/bench_balance.py``
prints the full study (``--quick`` for a short one).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

if __name__ == "__main__":  # `python bench/bench_balance.py` from a checkout that is not installed
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ascend_moe_ops.balance import ExpertLoadPredictor, Placement, plan_placement

E, R, S, K = 256, 32, 8, 8
SLOTS_PER_STEP = 65536           # routed (token, expert) slots per step: 8K tokens x top-8


# ----------------------------------------------------------------------------------------------
# traces

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


TRACES = {
    # name: (description, generator)
    "lognormal_slow": "lognormal loads, sigma=0.6 in log space, mean-reverting drift tau=1000 steps",
    "lognormal_fast": "lognormal loads, sigma=0.6 in log space, mean-reverting drift tau=100 steps",
    "zipf": "Zipf(s=1.0) shares over a random expert order (top share capped at 1/K), "
            "slow lognormal drift sigma=0.3 tau=1000",
}


def make_trace(kind: str, steps: int, seed: int = 0):
    """Returns ``(p [steps, E] true probabilities, counts [steps, E] sampled routed slots)``."""
    rng = np.random.default_rng(seed)
    if kind == "lognormal_slow":
        logits = _ar1(rng, steps, E, 0.6, 1000.0)
    elif kind == "lognormal_fast":
        logits = _ar1(rng, steps, E, 0.6, 100.0)
    elif kind == "zipf":
        base = -1.0 * np.log(np.arange(1, E + 1))[rng.permutation(E)]
        logits = base + _ar1(rng, steps, E, 0.3, 1000.0)
    else:
        raise ValueError(kind)
    p = np.exp(logits - logits.max(1, keepdims=True))
    p = np.stack([_cap(row, 1.0 / K) for row in p])
    counts = np.stack([rng.multinomial(SLOTS_PER_STEP, row) for row in p]).astype(np.float64)
    return p, counts


# ----------------------------------------------------------------------------------------------
# simulation

def _imbalance_rows(slot_to_expert: np.ndarray, replica: np.ndarray, counts: np.ndarray):
    """Per-step imbalance of ``counts [n, E]`` under a placement (replicas share load evenly)."""
    per_slot = counts / replica[None, :]
    valid = slot_to_expert >= 0
    w = np.where(valid[None], per_slot[:, slot_to_expert.clip(min=0)], 0.0)   # [n, R, S]
    loads = w.sum(2)
    return loads.max(1) / loads.mean(1) - 1.0


def simulate(p, counts, *, method="ema", strategy="swap", replicas=False, interval=50,
             warmup=100, measure_from=300, max_moves=25, window=32, alpha=None,
             cv_threshold=0.0, min_improvement=0.0, min_gain=0.0, slots=None):
    """Run one dynamic-placement policy over a trace; returns a dict of figures."""
    steps = counts.shape[0]
    slots = slots or (S + 1 if replicas else S)
    placement = Placement.contiguous(E, R, slots)
    pred = ExpertLoadPredictor(E, window, method="ema" if method == "oracle" else method,
                               alpha=alpha, horizon=interval)
    imb = np.empty(steps)
    moves, pred_err = [], []
    s2e = placement.slot_to_expert.numpy()
    rep = placement.replica_count.numpy().astype(np.float64)
    for t in range(steps):
        if t >= warmup and (t - warmup) % interval == 0:
            nxt = counts[t:t + interval].mean(0)
            # "oracle" (diagnostic): the true expected load of the coming interval
            guess = (torch.from_numpy(p[t:t + interval].mean(0) * SLOTS_PER_STEP)
                     if method == "oracle" else pred.predict())
            pred_err.append(np.abs(guess.numpy() - nxt).sum() / nxt.sum())
            new = plan_placement(guess, R, slots, placement, max_moves=max_moves, replicas=replicas,
                                 strategy=strategy, cv_threshold=cv_threshold,
                                 min_improvement=min_improvement, min_gain=min_gain)
            if t >= measure_from:
                moves.append(new.moved)
            if new.changed:
                placement = new
                s2e = placement.slot_to_expert.numpy()
                rep = placement.replica_count.numpy().astype(np.float64)
        imb[t] = _imbalance_rows(s2e, rep, counts[t:t + 1])[0]
        pred.update(torch.from_numpy(counts[t]))
    m = imb[measure_from:]
    return {
        "imbalance": float(m.mean()),
        "moves_mean": float(np.mean(moves)) if moves else 0.0,
        "moves_max": int(np.max(moves)) if moves else 0,
        "replans": len(moves),
        "pred_err": float(np.mean(pred_err)) if pred_err else float("nan"),
    }


def static_imbalance(counts, measure_from=300):
    pl = Placement.contiguous(E, R, S)
    return float(_imbalance_rows(pl.slot_to_expert.numpy(),
                                 pl.replica_count.numpy().astype(np.float64),
                                 counts[measure_from:]).mean())


def drop_rate(counts, capacity_factor=1.5):
    """Fraction of routed slots capacity mode would drop per step with ``C = ceil(cf * T * K / E)``
    (64K slots per step -> C = 384 at cf 1.5), averaged over steps. Placement does not change it:
    capacity is per expert."""
    cap = int(np.ceil(capacity_factor * SLOTS_PER_STEP / E))
    return float((np.clip(counts - cap, 0, None).sum(1) / counts.sum(1)).mean())


def oracle_imbalance(p, counts, *, replicas=False, measure_from=300, every=10):
    """Re-plan from the true probabilities (no move limit) every ``every`` steps; the imbalance
    left is the floor set by multinomial sampling noise."""
    slots = S + 1 if replicas else S
    out = []
    for t in range(measure_from, counts.shape[0], every):
        pl = plan_placement(torch.from_numpy(p[t] * SLOTS_PER_STEP), R, slots, None, replicas=replicas)
        out.append(_imbalance_rows(pl.slot_to_expert.numpy(),
                                   pl.replica_count.numpy().astype(np.float64),
                                   counts[t:t + every]))
    return float(np.concatenate(out).mean())


# ----------------------------------------------------------------------------------------------
# study

PREDICTORS = ("last", "window_mean", "ema", "trend", "adaptive_ema")


def _configs(kind, quick):
    """(label, method, alpha, strategy, replicas) of the policies studied on one trace."""
    base = [("baseline: window mean + greedy swap", "window_mean", None, "greedy_swap", False),
            ("adaptive EMA + greedy swap", "adaptive_ema", None, "greedy_swap", False),
            ("adaptive EMA + swap (ours)", "adaptive_ema", None, "swap", False)]
    if not quick and kind == "lognormal_slow":
        base += [(f"{m} + swap", m, None, "swap", False) for m in ("last", "window_mean", "ema", "trend")]
        base += [("ema alpha=0.3 + swap", "ema", 0.3, "swap", False),
                 ("oracle load + swap", "oracle", None, "swap", False)]
    if not quick or kind == "zipf":
        base += [("baseline + replicas (32x9)", "window_mean", None, "greedy_swap", True),
                 ("adaptive EMA + swap + replicas (32x9)", "adaptive_ema", None, "swap", True)]
    return base


def study(steps=1500, intervals=(10, 50), quick=False, seeds=(0, 1, 2), log=print, max_moves=25,
          min_improvement=0.02):
    """All figures of the study, averaged over ``seeds`` (independent traces); returns a list of
    result dicts (one per trace x interval x policy)."""
    results = []
    kinds = ["lognormal_slow", "zipf"] if quick else list(TRACES)
    for kind in kinds:
        traces = [make_trace(kind, steps, sd) for sd in seeds]
        st = np.mean([static_imbalance(c) for _, c in traces])
        floor = np.mean([oracle_imbalance(p, c) for p, c in traces])
        floor_rep = np.mean([oracle_imbalance(p, c, replicas=True) for p, c in traces])
        log(f"\n== {kind}: {TRACES[kind]}; {steps} steps, measured over steps 300..{steps}, "
            f"mean of {len(seeds)} traces")
        log(f"   static placement (e // 8): imbalance {st:.3f}; capacity mode would drop "
            f"{100 * np.mean([drop_rate(c) for _, c in traces]):.1f}% of slots at capacity factor 1.5")
        log(f"   noise floor (true loads, unlimited moves, re-planned every 10 steps): "
            f"{floor:.3f} (32x8), {floor_rep:.3f} (32x9 with replicas)")
        for interval in intervals:
            log(f"   -- re-plan every {interval} steps, <= {max_moves} experts moved per re-plan, "
                f"applied if the predicted imbalance drops by > {min_improvement}; "
                f"reduction vs static: mean [min, max] over traces")
            for label, method, alpha, strategy, rep in _configs(kind, quick):
                runs, reds = [], []
                for (p, counts) in traces:
                    r = simulate(p, counts, method=method, alpha=alpha, strategy=strategy,
                                 replicas=rep, interval=interval, max_moves=max_moves,
                                 min_improvement=min_improvement)
                    runs.append(r)
                    reds.append(100.0 * (1.0 - r["imbalance"] / static_imbalance(counts)))
                r = {k: float(np.mean([x[k] for x in runs])) for k in runs[0]}
                r["moves_max"] = int(max(x["moves_max"] for x in runs))
                r.update(trace=kind, label=label, method=method, alpha=alpha, strategy=strategy,
                         replicas=rep, static=float(st), floor=float(floor_rep if rep else floor),
                         reduction_pct=float(np.mean(reds)), reduction_min=float(np.min(reds)),
                         reduction_max=float(np.max(reds)), interval=interval,
                         max_moves=max_moves, seeds=len(seeds))
                results.append(r)
                log(f"   {label:<40s} imbalance {r['imbalance']:.3f}  reduction {r['reduction_pct']:5.1f}% "
                    f"[{r['reduction_min']:5.1f}, {r['reduction_max']:5.1f}]  moved/re-plan "
                    f"{r['moves_mean']:4.1f} (max {r['moves_max']:2d})  pred. L1 err {r['pred_err']:.3f}")
    return results


def run(ctx):
    """The planner's time per re-plan (timed), then the study's figures (simulations: rows with no
    time of their own)."""
    from ascend_moe_ops.bench import Row
    rng = np.random.default_rng(0)
    load = torch.from_numpy(np.exp(rng.normal(0, 0.6, E)) * 256)
    cur = Placement.contiguous(E, R, S)
    t = ctx.time(lambda: plan_placement(load, R, S, cur, max_moves=25))
    rows = [Row(op="balance", case=f"plan_placement E={E} R={R}x{S} max_moves=25 lognormal load",
                backend="reference", dtype="fp64", seconds=t, limit="none",
                path="expert placement re-plan (balance.plan_placement, every re-plan interval)")]
    if ctx.recording:
        return rows
    steps = 700 if ctx.quick else 1500
    intervals = (10,) if ctx.quick else (10, 50)
    seeds = (0,) if ctx.quick else (0, 1, 2)
    for r in study(steps=steps, intervals=intervals, quick=ctx.quick, seeds=seeds, log=lambda *_: None):
        case = (f"{r['trace']} E={E} R={R}x{S + int(r['replicas'])} re-plan/{r['interval']}: "
                f"{r['label']} -> imbalance {r['imbalance']:.3f} (static {r['static']:.3f}, "
                f"-{r['reduction_pct']:.0f}%), {r['moves_mean']:.1f} moved/re-plan")
        rows.append(Row(op="balance", case=case, backend="reference", dtype="fp64",
                        seconds=float("nan"), limit="none", path="simulation (no timing)",
                        extra={k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()
                               if k not in ("trace", "label")}))
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--interval", type=int, nargs="+", default=[10, 50])
    ap.add_argument("--seeds", type=int, nargs="+", default=None)
    a = ap.parse_args()
    t0 = time.monotonic()
    study(steps=a.steps or (700 if a.quick else 1500), intervals=a.interval, quick=a.quick,
          seeds=a.seeds or ((0,) if a.quick else (0, 1, 2)))
    print(f"\n(study took {time.monotonic() - t0:.1f} s)")
