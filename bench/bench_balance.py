"""Study: dynamic expert placement on synthetic expert-load traces.

Simulates the expert-parallel layout of one MoE layer (256 experts, 32 ranks x 8 slots, 64K routed
slots per step drawn multinomially from a drifting per-expert probability vector) and measures the
device-level imbalance ``max / mean rank load - 1`` per step under

* static placement (expert e on rank e // 8),
* dynamic placement: every ``interval`` steps a predictor (last / window mean / EMA / trend /
  adaptive EMA / robust)
  forecasts the per-expert load and a planner (greedy max<->min swap baseline, or
  ``plan_placement``'s bounded local search) re-places at most ``max_moves`` experts,
* dynamic placement with 32 redundant slots (32 x 9) filled with replicas of hot experts,
* an oracle that re-plans every step from the true probabilities without a move limit (the floor
  left by sampling noise alone).

* the same planner fed the true load instead of a forecast (its oracle): the true expected load of
  the first step the placement serves ("next-step oracle", the goal: the forecast's cut >= 95 % of
  this one's) and, as a clairvoyant bound, the true load averaged over the whole coming interval,
  with the bytes of weights + optimizer state the re-plans move (``--oracle``).

``run(ctx)`` returns one timed row, the planner's time per re-plan (``plan_placement`` on a
lognormal load, measured by the bench harness), then the simulations' rows: no time of their own
(``seconds`` is NaN, limit "none"), the study's figures in ``extra``. ``python bench/bench_balance.py``
prints the full study (``--quick`` for a short one); ``--oracle`` the oracle comparison only;
``--persistence`` the default predictor against persistence (the same planner fed the counts of the
last observed step) and the next-step oracle, per trace and seed, with the median / worst over seeds
and the verdicts of issue 33 item 5 (docs/ops/balance.md section 6).
The traces and the replay loop are ``ascend_moe_ops.balance.traces``.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch

from ascend_moe_ops.balance import ExpertLoadPredictor, Placement, plan_placement

from ascend_moe_ops.balance import MoveCost, default_max_moves
from ascend_moe_ops.balance.traces import (TRACES, imbalance_rows, make_trace, replay,
                                           static_imbalance as _static)

E, R, S, K = 256, 32, 8, 8
SLOTS_PER_STEP = 65536           # routed (token, expert) slots per step: 8K tokens x top-8
# bytes per expert copy: a DeepSeek-V3-sized SwiGLU expert (3 x 7168 x 2048 = 44 M parameters),
# bf16 weights + fp32 master weight and Adam m, v (2 + 12 B per parameter)
EXPERT_COST = MoveCost(3 * 7168 * 2048, param_bytes=2, state_bytes=12)


def simulate(p, counts, *, method="adaptive_ema", strategy="swap", replicas=False, interval=50,
             warmup=100, measure_from=300, max_moves=25, window=32, alpha=None,
             cv_threshold=0.0, min_improvement=0.0, min_gain=0.0, slots=None):
    """Run one dynamic-placement policy over a trace; returns a dict of figures. ``method`` is a
    predictor method, or ``"oracle"`` (the true load of the coming interval) / ``"next_step"``
    (the true load of the next step) / ``"previous_step"`` (the true load of the last observed
    step)."""
    oracle = {"oracle": "interval", "next_step": "next_step",
              "previous_step": "previous_step"}.get(method)
    kw = dict(max_moves=max_moves, replicas=replicas, strategy=strategy, cv_threshold=cv_threshold,
              min_improvement=min_improvement, min_gain=min_gain)
    if slots is not None:
        kw["slots"] = slots
    return replay(p, counts, R, S, oracle=oracle, interval=interval, warmup=warmup,
                  measure_from=measure_from, move_cost=EXPERT_COST,
                  predictor=None if oracle else
                  (lambda: ExpertLoadPredictor(E, window, method=method, alpha=alpha, horizon=interval)),
                  **kw)


def static_imbalance(counts, measure_from=300):
    return _static(counts, R, S, measure_from)


def _imbalance_rows(slot_to_expert, replica, counts):
    return imbalance_rows(slot_to_expert, replica, counts)


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


ORACLE_TRACES = ("lognormal_slow", "bursty", "lognormal_fast")


ORACLE_SEEDS = (0, 1, 2, 3, 4, 5)


def oracle_summary(rows, log=print):
    """Per (trace, interval): the min and the median over seeds of the forecast's share of the
    next-step oracle's cut (the goal: min >= 95 %) and of the previous-step truth's share."""
    out = []
    keys = sorted({(r["trace"], r["interval"]) for r in rows}, key=lambda k: (ORACLE_TRACES.index(k[0])
                                                                             if k[0] in ORACLE_TRACES else 99, k[1]))
    for kind, interval in keys:
        rs = [r for r in rows if r["trace"] == kind and r["interval"] == interval]
        ratio = np.array([r["ratio_next"] for r in rs])
        prev = np.array([r["ratio_previous_next"] for r in rs])
        s = dict(trace=kind, interval=interval, seeds=len(rs), ratio_min=float(ratio.min()),
                 ratio_median=float(np.median(ratio)), previous_min=float(prev.min()),
                 previous_median=float(np.median(prev)))
        out.append(s)
        log(f"   {kind:<15s} every {interval:3d}: forecast / next-step oracle min "
            f"{100 * s['ratio_min']:5.1f} %, median {100 * s['ratio_median']:5.1f} % over "
            f"{len(rs)} seeds; previous-step truth / next-step oracle min "
            f"{100 * s['previous_min']:5.1f} %, median {100 * s['previous_median']:5.1f} %")
    return out


def oracle_study(steps=1500, intervals=(10, 50), seeds=ORACLE_SEEDS, kinds=ORACLE_TRACES,
                 method=None, min_improvement=0.02, log=print):
    """Forecast vs oracle at the default move budget (E // 10 = 25 copies per re-plan): per trace,
    interval and seed the cut (1 - imbalance / static) of the predictor, of the same planner fed
    the true next-step load, and of the clairvoyant interval oracle; moved experts and bytes
    (``EXPERT_COST``) per re-plan. Returns one dict per (trace, interval, seed)."""
    budget = default_max_moves(E)
    method = method or ExpertLoadPredictor(E).method
    out = []
    log(f"\n== forecast ({method}) vs oracle: {E} experts on {R} x {S}, <= {budget} copies per "
        f"re-plan, applied if the predicted imbalance drops by > {min_improvement}; one copy = "
        f"{EXPERT_COST.bytes_per_copy / 1e6:.0f} MB (weights + optimizer state)")
    for kind in kinds:
        for interval in intervals:
            for sd in seeds:
                p, counts = make_trace(kind, steps, sd)
                kw = dict(max_moves=budget, min_improvement=min_improvement, interval=interval)
                f = simulate(p, counts, method=method, **kw)
                nx = simulate(p, counts, method="next_step", **kw)
                iv = simulate(p, counts, method="oracle", **kw)
                pv = simulate(p, counts, method="previous_step", **kw)
                r = dict(trace=kind, interval=interval, seed=sd, cut=f["cut"], cut_next=nx["cut"],
                         cut_interval=iv["cut"], ratio_next=f["cut"] / nx["cut"],
                         cut_previous=pv["cut"], ratio_previous_next=pv["cut"] / nx["cut"],
                         ratio_interval=f["cut"] / iv["cut"], static=f["static"],
                         imbalance=f["imbalance"], moves_mean=f["moves_mean"],
                         moves_max=f["moves_max"], moves_next=nx["moves_mean"],
                         gb_mean=f["bytes_mean"] / 1e9, method=method, max_moves=budget)
                out.append(r)
                pc = {k: f"{100 * v:5.1f} %" for k, v in r.items() if isinstance(v, float)}
                log(f"   {kind:<15s} every {interval:3d} seed {sd}: cut {pc['cut']}  "
                    f"next-step oracle {pc['cut_next']} -> {pc['ratio_next']}  "
                    f"interval oracle {pc['cut_interval']} -> {pc['ratio_interval']}  "
                    f"previous-step truth {pc['cut_previous']} ({pc['ratio_previous_next']} of "
                    f"next)  moved {r['moves_mean']:4.1f} (max {r['moves_max']}) = "
                    f"{r['gb_mean']:5.1f} GB/re-plan")
    return out


PERSISTENCE_SEEDS = (0, 1, 2, 3, 4, 5)     # evaluation seeds; predictor parameters were chosen on others


def _persistence_case(args):
    """One (trace, interval, seed) of :func:`persistence_study`: the cuts of the default
    predictor, of persistence (the same planner fed the counts of the last observed step), of the
    noise-free previous-step truth and of the next-step oracle."""
    kind, interval, sd, steps, method, min_improvement = args
    torch.set_num_threads(1)
    p, counts = make_trace(kind, steps, sd)
    kw = dict(max_moves=default_max_moves(E), min_improvement=min_improvement, interval=interval)
    cuts = {name: simulate(p, counts, method=m, **kw)["cut"]
            for name, m in (("cut", method), ("cut_last", "last"),
                            ("cut_previous", "previous_step"), ("cut_next", "next_step"))}
    return dict(trace=kind, interval=interval, seed=sd, method=method, **cuts)


def persistence_summary(rows, log=print):
    """Per (trace, interval): median and worst over seeds of the default predictor's cut, of
    persistence's, of the previous-step truth's and of the next-step oracle's, the predictor's
    share of the oracle's cut, and the two verdicts of issue 33 item 5: the predictor's cut >=
    persistence's on every seed, and >= 95 % of the oracle's on the median over seeds."""
    out = []
    keys = sorted({(r["trace"], r["interval"]) for r in rows},
                  key=lambda k: (ORACLE_TRACES.index(k[0]) if k[0] in ORACLE_TRACES else 99, k[1]))
    log(f"   {'trace':<15s} {'every':>5s}  {'cut: median / worst over seeds (%)':^60s}  "
        f"{'ours / oracle':>14s}  {'ours - last':>12s}  {'ours >= last':>12s}")
    log(f"   {'':<15s} {'':>5s}  {'ours':>14s} {'last (pers.)':>14s} {'prev. truth':>14s} "
        f"{'next oracle':>14s}  {'median  worst':>14s}  {'worst (pts)':>12s}  {'seeds':>12s}")
    for kind, interval in keys:
        rs = [r for r in rows if r["trace"] == kind and r["interval"] == interval]
        col = {k: np.array([r[k] for r in rs]) for k in ("cut", "cut_last", "cut_previous", "cut_next")}
        ratio = col["cut"] / col["cut_next"]
        margin = col["cut"] - col["cut_last"]
        s = dict(trace=kind, interval=interval, seeds=len(rs),
                 **{f"{k}_median": float(np.median(v)) for k, v in col.items()},
                 **{f"{k}_worst": float(v.min()) for k, v in col.items()},
                 ratio_median=float(np.median(ratio)), ratio_worst=float(ratio.min()),
                 margin_worst=float(margin.min()), margin_median=float(np.median(margin)),
                 wins=int((margin >= 0).sum()), beats_last=bool((margin >= 0).all()),
                 oracle_goal=bool(np.median(ratio) >= 0.95))
        out.append(s)
        c = {k: f"{100 * s[k + '_median']:5.1f} / {100 * s[k + '_worst']:4.1f}" for k in col}
        log(f"   {kind:<15s} {interval:5d}  {c['cut']:>14s} {c['cut_last']:>14s} "
            f"{c['cut_previous']:>14s} {c['cut_next']:>14s}  {100 * s['ratio_median']:5.1f} "
            f"{100 * s['ratio_worst']:5.1f} %  {100 * s['margin_worst']:+8.2f}      "
            f"{s['wins']:>4d} / {len(rs)}")
    every = all(s["beats_last"] for s in out)
    median = all(s["oracle_goal"] for s in out)
    log(f"   verdict: cut >= persistence on every trace and seed: {'YES' if every else 'NO'}"
        + ("" if every else " (not on: " + ", ".join(f"{s['trace']}/{s['interval']}" for s in out
                                                   if not s["beats_last"]) + ")"))
    log(f"   verdict: cut >= 95 % of the next-step oracle on the median over seeds: "
        f"{'YES' if median else 'NO'}" + ("" if median else " (not on: " + ", ".join(
            f"{s['trace']}/{s['interval']}" for s in out if not s["oracle_goal"]) + ")"))
    return out


def persistence_study(steps=1500, intervals=(10, 50), seeds=PERSISTENCE_SEEDS, kinds=ORACLE_TRACES,
                      method=None, min_improvement=0.02, workers=2, log=print):
    """Issue 33 item 5: the default predictor against persistence (the same planner fed the
    counts of the last observed step: ``method="last"``) and the next-step oracle, per trace,
    interval and seed at the default move budget, plus the noise-free previous-step truth for
    reference. The cases run in ``workers`` processes. Returns one dict per (trace, interval,
    seed)."""
    method = method or ExpertLoadPredictor(E).method
    tasks = [(k, i, sd, steps, method, min_improvement) for i in intervals for k in kinds
             for sd in seeds]
    log(f"\n== {method} vs persistence vs next-step oracle: {E} experts on {R} x {S}, "
        f"<= {default_max_moves(E)} copies per re-plan, {steps} steps, seeds {list(seeds)}")
    rows = []
    if workers > 1:
        import multiprocessing as mp
        with mp.get_context("spawn").Pool(workers) as pool:
            for r in pool.imap_unordered(_persistence_case, tasks):
                rows.append(r)
                _log_case(r, log)
    else:
        for t in tasks:
            rows.append(_persistence_case(t))
            _log_case(rows[-1], log)
    rows.sort(key=lambda r: (kinds.index(r["trace"]), r["interval"], r["seed"]))
    return rows


def _log_case(r, log):
    log(f"   {r['trace']:<15s} every {r['interval']:3d} seed {r['seed']}: cut {100 * r['cut']:6.2f} %  "
        f"last {100 * r['cut_last']:6.2f} %  previous-step truth {100 * r['cut_previous']:5.1f} %  "
        f"next-step oracle {100 * r['cut_next']:5.1f} % -> {100 * r['cut'] / r['cut_next']:5.1f} %")


def _simulation_row(op, case, r, drop):
    """A row of a simulated figure (no time of its own): the result dict ``r`` in ``extra``
    (floats rounded to 4 places), less its text keys ``drop``."""
    from ascend_moe_ops.bench import Row
    return Row(op=op, case=case, backend="reference", dtype="fp64", seconds=float("nan"), limit="none",
               path="simulation (no timing)",
               extra={k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items() if k not in drop})


def run(ctx):
    """The planner's time per re-plan (timed), then the oracle comparison's and the study's
    figures (simulations: rows with no time of their own)."""
    from ascend_moe_ops.bench import Row
    rng = np.random.default_rng(0)
    load = torch.from_numpy(np.exp(rng.normal(0, 0.6, E)) * 256)
    cur = Placement.contiguous(E, R, S)
    budget = default_max_moves(E)
    t = ctx.time(lambda: plan_placement(load, R, S, cur, max_moves=budget, move_cost=EXPERT_COST))
    rows = [Row(op="balance", case=f"plan_placement E={E} R={R}x{S} max_moves={budget} lognormal load",
                backend="reference", dtype="fp64", seconds=t, limit="none",
                path="expert placement re-plan (balance.plan_placement, every re-plan interval)")]
    if ctx.recording:
        return rows
    steps = 700 if ctx.quick else 1500
    intervals = (10,) if ctx.quick else (10, 50)
    seeds = (0,) if ctx.quick else (0, 1, 2)
    for r in oracle_study(steps=steps, intervals=intervals, seeds=seeds,
                          kinds=("bursty",) if ctx.quick else ORACLE_TRACES, log=lambda *_: None):
        case = (f"{r['trace']} E={E} R={R}x{S} re-plan/{r['interval']} seed {r['seed']}: "
                f"{r['method']} cut {100 * r['cut']:.1f}% = {100 * r['ratio_next']:.1f}% of the "
                f"next-step oracle ({100 * r['cut_next']:.1f}%), {100 * r['ratio_interval']:.1f}% of "
                f"the interval oracle; {r['moves_mean']:.1f} moved/re-plan = {r['gb_mean']:.1f} GB")
        rows.append(_simulation_row("balance_oracle", case, r, ("trace", "method")))
    for r in study(steps=steps, intervals=intervals, quick=ctx.quick, seeds=seeds, log=lambda *_: None):
        case = (f"{r['trace']} E={E} R={R}x{S + int(r['replicas'])} re-plan/{r['interval']}: "
                f"{r['label']} -> imbalance {r['imbalance']:.3f} (static {r['static']:.3f}, "
                f"-{r['reduction_pct']:.0f}%), {r['moves_mean']:.1f} moved/re-plan")
        rows.append(_simulation_row("balance", case, r, ("trace", "label")))
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--interval", type=int, nargs="+", default=[10, 50])
    ap.add_argument("--seeds", type=int, nargs="+", default=None)
    ap.add_argument("--oracle", action="store_true", help="only the forecast-vs-oracle comparison")
    ap.add_argument("--persistence", action="store_true",
                    help="only the predictor vs persistence vs next-step oracle comparison")
    ap.add_argument("--method", default=None, help="predictor method (default: the default)")
    ap.add_argument("--kinds", nargs="+", default=list(ORACLE_TRACES), choices=ORACLE_TRACES)
    ap.add_argument("--workers", type=int, default=2, help="processes for --persistence")
    ap.add_argument("--json", default=None, help="--persistence: also write the rows to this file")
    a = ap.parse_args()
    t0 = time.monotonic()
    if a.persistence:
        rows = persistence_study(steps=a.steps or (700 if a.quick else 1500), intervals=a.interval,
                                 seeds=a.seeds or ((0,) if a.quick else PERSISTENCE_SEEDS),
                                 kinds=a.kinds, method=a.method, workers=a.workers)
        if a.json:
            import json
            with open(a.json, "w") as fh:
                json.dump(rows, fh, indent=1)
        print("\n== median / worst over seeds")
        persistence_summary(rows)
        print(f"\n(took {time.monotonic() - t0:.1f} s)")
        sys.exit(0)
    rows = oracle_study(steps=a.steps or (700 if a.quick else 1500), intervals=a.interval,
                        seeds=a.seeds or ((0,) if a.quick else ORACLE_SEEDS))
    print("\n== min / median over seeds")
    oracle_summary(rows)
    if a.oracle:
        print(f"\n(took {time.monotonic() - t0:.1f} s)")
        sys.exit(0)
    study(steps=a.steps or (700 if a.quick else 1500), intervals=a.interval, quick=a.quick,
          seeds=a.seeds or ((0,) if a.quick else (0, 1, 2)))
    print(f"\n(study took {time.monotonic() - t0:.1f} s)")
