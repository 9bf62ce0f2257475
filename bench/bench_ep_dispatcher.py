"""Benchmark of the expert-parallel dispatcher: flat vs hierarchical (node-deduplicated) vs
hierarchical_allgather dispatch+combine (fwd+bwd), and the MoE layer with/without overlap.

Three ways to run it:

* ``python -m ascend_moe_ops.bench --ops ep_dispatcher`` (suite runner, ``run(ctx)``): 2 nodes x 2
  ranks as 4 gloo processes on loopback. On loopback every link is equally fast, so this measures
  the software cost of the two algorithms, not the benefit of sending fewer inter-node bytes.
* ``python bench/bench_ep_dispatcher.py --netns`` (needs root and iproute2): an emulated two-node
  cluster. Each node is a network namespace; the two are joined by a veth pair whose ends are
  rate-limited with ``tc tbf`` (default 1 Gbit/s each way); ranks of one node talk over their
  namespace's local stack (not limited). Only the namespaces' own addresses (10.231.0.1/.2) and
  loopback are used, and the namespaces are always deleted afterwards. Prints a table and writes
  JSON (``--out``), including the bytes the veth really carried per step.
* ``python bench/bench_ep_dispatcher.py --loopback``: the loopback variant, full sizes.
* ``--layer 2048x1024x128 --chunks 1,4``: also time ``nn.MoELayer(dispatcher=...)`` fwd+bwd
  without (``overlap_chunks=1``) and with the chunked overlap.

Entry points for other harnesses: ``dispatch_case(...)`` / ``layer_case(...)`` build a case,
``run_case(cfg, "netns" | "loopback")`` runs it and returns a dict (timings, per-rank stats,
exact inter-node row counts), ``summarize(res, label)`` renders it.

Timing: each step is ``dispatch -> toy expert (y = 2x) -> combine -> backward`` (or a MoE layer
fwd+bwd); every rank starts a step after a barrier, a step's time is the slowest rank's, the
variants of a case run interleaved (one step of each per round) and the table shows the median
(and min) over the rounds. The machine this ran on is shared: times are noisy; compare ratios
within one run.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PYTEST_CASES = False  # run() starts 4 processes: not a pytest-benchmark case (see the single-rank one)
ALGOS = ("flat", "hierarchical", "hierarchical_allgather")
# (T tokens per rank, H hidden): the target range is T, H in 1024..4096
NETNS_CASES = [(1024, 1024), (2048, 2048)]


# ----------------------------------------------------------------------------- worker (one rank)
def _timed(dist, torch, steps, warmup, iters, link_bytes):
    """Interleaved timing of several variants: ``steps`` maps a name to a step function; every
    round runs each variant once (so load changes on a shared machine hit all variants alike).
    Per variant: median/min over ``iters`` rounds (after ``warmup``), a step's time is the
    slowest rank's, and the veth bytes its steps moved."""
    from ascend_moe_ops.benchmark.timing import measure
    for _ in range(warmup):
        for step in steps.values():
            step()
    per = {k: [] for k in steps}
    moved = {k: 0 for k in steps}
    for _ in range(iters):
        for name, step in steps.items():
            b0 = link_bytes()
            # the package's harness: one timed call, after an untimed barrier (every rank makes
            # the same calls)
            one = measure(step, runs=1, warmup=0, setup=dist.barrier)
            t = torch.tensor([one.times[0]], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            per[name].append(float(t))
            # veth bytes of the step (both directions, summed over nodes; the time all-reduce
            # adds a few hundred bytes)
            lb = torch.tensor([link_bytes() - b0], dtype=torch.int64)
            dist.all_reduce(lb)
            moved[name] += int(lb)
    return {k: dict(median_s=statistics.median(v), min_s=min(v), all_s=v,
                    link_bytes_per_step=moved[k] / iters) for k, v in per.items()}


def _exact_rows(ids, E, world, local_size, node):
    """This rank's exact inter-node rows: flat (remote slots) and dedup (remote nodes hosting
    >= 1 of each token's experts)."""
    import torch
    owner_node = ids // (E // world) // local_size
    N = world // local_size
    remote_slots = int(((owner_node != node) & (ids >= 0)).sum())
    hit = torch.zeros(ids.shape[0], N, dtype=torch.bool)
    hit.scatter_(1, owner_node.clamp(min=0), ids >= 0)
    hit[:, node] = False
    return remote_slots, int(hit.sum())


# ----------------------------------------------------------------------------- phase timeline
def _clock():
    """The harness's wall clock (the one ``measure`` reads) for the ``--phases`` diagnostics."""
    from ascend_moe_ops.benchmark.timing import clock_for
    return clock_for("cpu")


def _install_phase_timers(C, dispatcher_mod):
    """Wrap the package's collectives (and the local permute/unpermute calls of the dispatcher)
    with wall-clock timers: returns ``(log, reset)``; ``log`` gets ``(what, t0, t1, thread)``.
    Diagnostic only (``--phases``): it adds a few microseconds per call."""
    import threading
    now = _clock()
    log = []

    def wrap(mod, name, label=None):
        fn = getattr(mod, name)

        def timed(*args, **kwargs):
            t0 = now()
            try:
                return fn(*args, **kwargs)
            finally:
                what = label or kwargs.get("what") or (args[-1] if args and isinstance(args[-1], str) else name)
                log.append((what, t0, now(), threading.current_thread().name))
        setattr(mod, name, timed)

    wrap(C, "_a2a")
    wrap(C, "_all_gather")
    wrap(C, "_reduce_scatter")
    wrap(C, "gather_ints")
    orig_wait = C.Pending.wait

    def pwait(self):
        t0 = now()
        try:
            return orig_wait(self)
        finally:
            log.append(("Pending.wait (async collectives)", t0, now(),
                        threading.current_thread().name))
    C.Pending.wait = pwait
    return log


def _time_autograd_nodes(root, log):
    """Register timing hooks on every node of the graph under ``root`` (a grad_fn): each run
    of a node appends ``(name, t0, t1)`` to ``log``. Diagnostic only (``--phases``)."""
    now = _clock()
    seen, stack = set(), [root]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        box = {}

        def pre(grad_outputs, box=box):
            box["t0"] = now()

        def post(grad_inputs, grad_outputs, box=box, name=node.name()):
            t1 = now()
            log.append((name, box.get("t0", t1), t1))

        node.register_prehook(pre)
        node.register_hook(post)
        stack.extend(n for n, _ in node.next_functions)


def _node_table(log, t_start, t_end):
    import collections
    tot = collections.defaultdict(float)
    short = {"GeneratedBackwardFor_ascend_moe_ops_": "", "_defaultBackward": " bwd"}
    for i, (name, t0, t1) in enumerate(sorted(log, key=lambda e: e[1])):
        for a, b in short.items():
            name = name.replace(a, b)
        tot[f"{i:02d} {name}"] += t1 - t0  # execution order: the same on every rank
    tot["(autograd engine, between nodes)"] = (t_end - t_start) - sum(tot.values())
    return {k: (v, 1) for k, v in tot.items()}


def _layer_profile(ev, log, t0, t1):
    """One recorded step of the chunked layer: seconds of the calling thread in expert forward /
    backward and elsewhere (router, waits, glue), of the communication thread busy in its tasks,
    inside collectives (incl. waiting on the link and on peers) and in local work."""
    main = next((e["thread"] for e in ev if e["event"] == "expert_start"), None)
    out = dict(wall=t1 - t0, expert_fwd=0.0, expert_bwd=0.0, comm_busy=0.0, comm_collectives=0.0)
    open_ = {}
    for e in ev:
        key = (e["phase"], e["chunk"], e["event"].rsplit("_", 1)[0])
        kind = e["event"].rsplit("_", 1)[1]
        if kind in ("start",):
            open_[key] = e["t"]
        elif kind in ("end", "done") and key in open_:
            d = e["t"] - open_.pop(key)
            if e["event"] == "expert_end":
                out["expert_fwd"] += d
            elif e["event"] == "expert_bwd_end":
                out["expert_bwd"] += d
            else:
                out["comm_busy"] += d
    last = 0.0
    for what, a, b, th in sorted(log, key=lambda r: r[1]):
        if th != main and a >= last:
            out["comm_collectives"] += b - a
            last = b
    out["main_other"] = out["wall"] - out["expert_fwd"] - out["expert_bwd"]
    out["comm_local"] = out["comm_busy"] - out["comm_collectives"]
    return out


def _phase_table(log, t_start, t_end):
    """Per label: summed seconds inside [t_start, t_end] on the main thread (nested wrappers:
    only the outermost counts); plus 'local (not in a collective)' = the rest of the interval."""
    import collections
    ev = sorted((e for e in log if e[1] >= t_start and e[2] <= t_end), key=lambda e: e[1])
    tot = collections.defaultdict(float)
    cnt = collections.Counter()
    covered, last_end = 0.0, t_start
    for what, t0, t1, th in ev:
        if t0 < last_end:  # nested inside the previous one
            continue
        tot[what] += t1 - t0
        cnt[what] += 1
        covered += t1 - t0
        last_end = t1
    tot["local (not in a collective)"] = (t_end - t_start) - covered
    cnt["local (not in a collective)"] = 1
    return {k: (v, cnt[k]) for k, v in tot.items()}


STAT_KEYS = ("inter_node_rows", "inter_node_bytes", "intra_node_rows", "intra_node_bytes",
             "combine_inter_node_rows", "combine_inter_node_bytes")


def _worker(a) -> None:
    import warnings
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo", init_method=a.init, rank=a.rank, world_size=a.world,
                            timeout=datetime.timedelta(seconds=a.pg_timeout))
    from ascend_moe_ops.distributed import EPTopology, MoEDispatcher
    cfg = json.loads(a.config)
    T, H, K, E = cfg["T"], cfg["H"], cfg["K"], cfg["E"]
    dtype = getattr(torch, cfg["dtype"])
    topo = EPTopology(local_size=a.local_size)
    g = torch.Generator().manual_seed(1000 + a.rank)
    x = torch.randn(T, H, generator=g).to(dtype).requires_grad_(True)
    top = torch.rand(T, E, generator=g).topk(K, dim=1)  # K distinct experts per token, uniform
    ids = top.indices
    probs = torch.softmax(top.values, dim=1).requires_grad_(True)
    gy = torch.randn(T, H, generator=g).to(dtype)
    iface = os.environ.get("AMO_BENCH_IFACE")  # set in --netns mode: this node's veth

    def link_bytes():
        if not iface or topo.local_rank != 0:
            return 0
        with open(f"/sys/class/net/{iface}/statistics/tx_bytes") as f:
            return int(f.read())

    def gather(values):
        t = torch.tensor(values, dtype=torch.int64)
        out = [torch.zeros_like(t) for _ in range(a.world)]
        dist.all_gather(out, t)
        return [r.tolist() for r in out]

    result = {"kind": cfg.get("kind", "dispatch"), "algos": cfg.get("algos", []), "T": T, "H": H, "K": K, "E": E,
              "dtype": cfg["dtype"], "world": a.world, "local_size": a.local_size,
              "nodes": topo.num_nodes}
    remote, dedup = _exact_rows(ids, E, a.world, a.local_size, topo.node)
    result["exact_rows_per_rank"] = [dict(flat=r[0], hierarchical=r[1]) for r in gather([remote, dedup])]
    if result["kind"] == "layer":  # whole MoE layer fwd+bwd, without / with chunked overlap
        from ascend_moe_ops.nn import MoELayer
        disp = MoEDispatcher(topo, E, algorithm=cfg["layer_algo"])
        torch.manual_seed(0)
        layer = MoELayer(H, E, cfg["F"], K, dispatcher=disp, dtype=dtype,
                         shared_expert_ffn_hidden_size=cfg.get("shared") or None)
        def make(chunks):
            def step():
                layer.overlap_chunks = chunks
                layer(x).backward(gy)
                x.grad = None
                layer.zero_grad(set_to_none=True)
            return step

        timed = _timed(dist, torch, {f"chunks={c}": make(c) for c in cfg["chunks"]},
                       cfg["warmup"], cfg["iters"], link_bytes)
        result.update(timed)
        if cfg.get("phases"):  # where the two threads spend a step (--phases)
            from ascend_moe_ops.distributed import _autograd as C
            from ascend_moe_ops.distributed import dispatcher as D
            from ascend_moe_ops.distributed.overlap import record_schedule
            log = _install_phase_timers(C, D)
            now = _clock()
            prof = {f"chunks={c}": [] for c in cfg["chunks"]}
            for _ in range(cfg["phases"]):
                for c in cfg["chunks"]:
                    dist.barrier()
                    log.clear()
                    with record_schedule(now) as ev:
                        t0 = now()
                        make(c)()
                        t1 = now()
                    prof[f"chunks={c}"].append(_layer_profile(ev, log, t0, t1))
            everyone = [None] * a.world
            dist.all_gather_object(everyone, prof)
            result["layer_profile_per_rank"] = everyone
    else:
        # "<algo>@sliced": the algorithm with the full-range slices of the permute outputs that
        # the dispatcher had before 2026-12-02 (their backward zero-fills and copies each
        # gradient), for a same-run A/B of that change
        disps = {algo: MoEDispatcher(topo, E, algorithm=algo.split("@")[0]) for algo in cfg["algos"]}
        box = {}
        from ascend_moe_ops.distributed import dispatcher as D
        first_rows = D._first_rows

        def make(algo, backward):
            def step():
                if algo.endswith("@sliced"):
                    D._first_rows = lambda t, n: t[:n]
                try:
                    with torch.set_grad_enabled(backward):
                        et, tpe, h = disps[algo].dispatch(x, ids, probs)
                        out = disps[algo].combine(et * 2, h)
                        if backward:
                            out.backward(gy)
                            x.grad = probs.grad = None
                finally:
                    D._first_rows = first_rows
                box[algo] = h
            return step

        entries = {algo: {} for algo in cfg["algos"]}
        for mode in ("fwd", "fwd_bwd"):
            timed = _timed(dist, torch, {algo: make(algo, mode == "fwd_bwd") for algo in cfg["algos"]},
                           cfg["warmup"], cfg["iters"], link_bytes)
            for algo, e in timed.items():
                if not iface:
                    e["link_bytes_per_step"] = None
                entries[algo][mode] = e
        if cfg.get("phases"):  # per-phase wall time of fwd and bwd (--phases)
            from ascend_moe_ops.distributed import _autograd as C
            from ascend_moe_ops.distributed import dispatcher as D
            log = _install_phase_timers(C, D)
            now = _clock()
            phases = {algo: {"fwd": [], "bwd": [], "bwd nodes": []} for algo in cfg["algos"]}
            for _ in range(cfg["phases"]):
                for algo in cfg["algos"]:
                    dist.barrier()
                    t0 = now()
                    et, tpe, h = disps[algo].dispatch(x, ids, probs)
                    out = disps[algo].combine(et * 2, h)
                    nodes = []
                    _time_autograd_nodes(out.grad_fn, nodes)
                    t1 = now()
                    out.backward(gy)
                    t2 = now()
                    x.grad = probs.grad = None
                    phases[algo]["fwd"].append(_phase_table(log, t0, t1))
                    phases[algo]["bwd"].append(_phase_table(log, t1, t2))
                    phases[algo]["bwd nodes"].append(_node_table(nodes, t1, t2))
                    log.clear()
            everyone = [None] * a.world
            dist.all_gather_object(everyone, phases)
            result["phases_per_rank"] = everyone
        for algo in cfg["algos"]:
            h = box[algo]
            entries[algo]["stats_per_rank"] = [dict(zip(STAT_KEYS, r)) for r in
                                               gather([h.stats[k] for k in STAT_KEYS])]
            result[algo] = entries[algo]
    if a.rank == 0:
        with open(a.out, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- launching
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_group(procs, timeout, what):
    """Wait for every process of a group (one shared deadline of ``timeout`` seconds); raise naming
    the ranks that failed, with the tail of their output. The caller kills what is left."""
    deadline = time.monotonic() + timeout
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{what} group did not finish within {timeout} s") from None
    if any(p.returncode for p in procs):
        raise RuntimeError(f"a {what} rank failed:\n" + "\n".join(
            f"--- rank {i} (rc {p.returncode}) ---\n{(lg or '')[-3000:]}"
            for i, (p, lg) in enumerate(zip(procs, logs)) if p.returncode))
    return logs


def _launch(specs, world, local_size, init, cfg, timeout, threads=1):
    """Start one worker per entry of ``specs`` (``(rank, command prefix, extra env)``) and return
    rank 0's JSON. Every process is killed if the group does not finish within ``timeout``."""
    fd, out = tempfile.mkstemp(suffix=".json", prefix="amo_ep_bench_")
    os.close(fd)
    procs = []
    try:
        for rank, prefix, extra in specs:
            # the workers import the package the way this process did (its sys.path), from any cwd
            env = dict(os.environ, OMP_NUM_THREADS=str(threads),
                       PYTHONPATH=os.pathsep.join(p for p in sys.path if p), **extra)
            cmd = list(prefix) + [sys.executable, str(Path(__file__).resolve()), "--worker",
                                  "--rank", str(rank), "--world", str(world), "--local-size",
                                  str(local_size), "--init", init, "--config", json.dumps(cfg),
                                  "--out", out, "--threads", str(threads)]
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
        wait_group(procs, timeout, "benchmark")
        with open(out) as f:
            return json.load(f)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(5)
        with contextlib.suppress(OSError):
            os.unlink(out)


def run_loopback(cfg, nodes=2, local_size=2, timeout=600):
    world = nodes * local_size
    init = f"tcp://127.0.0.1:{_free_port()}"
    return _launch([(r, [], {}) for r in range(world)], world, local_size, init, cfg, timeout)


def _sh(*cmd):
    subprocess.run(list(cmd), check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def netns_unavailable() -> str:
    """Why the namespace emulation cannot run here ('' if it can)."""
    if os.name != "posix" or os.geteuid() != 0:
        return "needs root (network namespaces)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"'{tool}' not found (install iproute2)"
    return ""


@contextlib.contextmanager
def two_node_netns(rate="1gbit"):
    """Two namespaces joined by a rate-limited veth pair; yields ``[(ns, iface, addr), ...]``.
    Everything is removed on exit, also after errors and SIGTERM."""
    tag = f"amoep{os.getpid() % 100000}"
    ns = [f"{tag}n0", f"{tag}n1"]
    ifs = [f"{tag}v0", f"{tag}v1"]  # <= 15 characters
    addrs = ["10.231.0.1", "10.231.0.2"]
    old = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        for n in ns:
            _sh("ip", "netns", "add", n)
        _sh("ip", "link", "add", ifs[0], "type", "veth", "peer", "name", ifs[1])
        for n, i, addr in zip(ns, ifs, addrs):
            _sh("ip", "link", "set", i, "netns", n)
            _sh("ip", "-n", n, "addr", "add", f"{addr}/24", "dev", i)
            _sh("ip", "-n", n, "link", "set", "lo", "up")
            _sh("ip", "-n", n, "link", "set", i, "up")
            _sh("ip", "netns", "exec", n, "tc", "qdisc", "add", "dev", i, "root", "tbf", "rate", rate,
                "burst", "256kb", "latency", "50ms")
        yield list(zip(ns, ifs, addrs))
    finally:
        for n in ns:
            subprocess.run(["ip", "netns", "del", n], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        subprocess.run(["ip", "link", "del", ifs[0]], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        signal.signal(signal.SIGTERM, old)


def run_netns(cfg, local_size=2, rate="1gbit", timeout=600):
    world = 2 * local_size
    with two_node_netns(rate) as nodes:
        port = random.randint(20000, 40000)  # fresh namespace: nothing else listens there
        init = f"tcp://{nodes[0][2]}:{port}"
        specs = []
        for r in range(world):
            n, iface, _ = nodes[r // local_size]
            specs.append((r, ["ip", "netns", "exec", n],
                          {"GLOO_SOCKET_IFNAME": iface, "AMO_BENCH_IFACE": iface}))
        return _launch(specs, world, local_size, init, cfg, timeout)


# ----------------------------------------------------------------------------- reporting
def formula_rows(res, algo):
    """Inter-node rows of one dispatch summed over ranks: the issue's formula (expected value for
    flat under uniform routing) and the exact count from the routing."""
    T, K, N, W = res["T"], res["K"], res["nodes"], res["world"]
    exact = res["exact_rows_per_rank"]
    algo = algo.split("@")[0]
    if algo == "flat":
        return W * T * K * (N - 1) / N, sum(r["flat"] for r in exact)
    if algo == "hierarchical":
        # expected, uniform routing over E experts with K distinct per token: a remote node is
        # hit unless all K experts avoid its E/N experts
        E = res["E"]
        miss = 1.0
        for j in range(K):
            miss *= (E - E / N - j) / (E - j)
        return W * T * (N - 1) * (1 - miss), sum(r["hierarchical"] for r in exact)
    return W * T * (N - 1), W * T * (N - 1)  # AllGather: every token to every other node


def _per_row_bytes(res, algo):
    es = {"bfloat16": 2, "float16": 2, "float32": 4}[res["dtype"]]
    if algo == "flat":
        return res["H"] * es
    return res["H"] * es + res["K"] * 4 + res["K"] * 4  # + int32 slot ids + fp32 probs


def summarize(res, label):
    if res.get("kind") == "layer":
        return summarize_layer(res, label)
    lines = [f"## {label}: {res['nodes']} nodes x {res['local_size']} ranks, T={res['T']} per rank, "
             f"H={res['H']}, K={res['K']}, E={res['E']}, {res['dtype']}"]
    lines.append("| algorithm | fwd (s) | fwd+bwd (s) | inter-node rows / dispatch (all ranks) | "
                 "formula | exact | inter-node bytes / dispatch | intra-node rows | "
                 "veth bytes / fwd+bwd step |")
    lines.append("|---|---|---|---|---|---|---|---|---|")
    algos = [a for a in ALGOS if a in res] + [a for a in res.get("algos", []) if a not in ALGOS]
    for algo in algos:
        if algo not in res:
            continue
        e = res[algo]
        rows = sum(s["inter_node_rows"] for s in e["stats_per_rank"])
        meas = sum(s["inter_node_bytes"] for s in e["stats_per_rank"])
        intra = sum(s["intra_node_rows"] for s in e["stats_per_rank"])
        form, exact = formula_rows(res, algo)
        lb = e["fwd_bwd"]["link_bytes_per_step"]
        lines.append(f"| {algo} | {e['fwd']['median_s']:.4f} | {e['fwd_bwd']['median_s']:.4f} | "
                     f"{rows:,} | {form:,.0f} | {exact:,} | {meas:,} | {intra:,} | "
                     f"{'-' if lb is None else f'{lb:,.0f}'} |")
    if "flat" in res:
        for algo in algos:
            if algo != "flat" and algo in res:
                r1 = res[algo]["fwd_bwd"]["median_s"] / res["flat"]["fwd_bwd"]["median_s"]
                r0 = res[algo]["fwd"]["median_s"] / res["flat"]["fwd"]["median_s"]
                lines.append(f"\nratio {algo}/flat: fwd+bwd {r1:.3f}, fwd {r0:.3f}")
                res[f"ratio_{algo}_fwd_bwd"], res[f"ratio_{algo}_fwd"] = r1, r0
    return "\n".join(lines)


def summarize_phases(res):
    """The ``--phases`` tables: per algorithm and direction, seconds per label (median over the
    profiled steps, averaged over ranks) and calls per step."""
    if not res.get("phases_per_rank"):
        return ""
    lines = []
    ranks = res["phases_per_rank"]
    for algo in ranks[0]:
        for d in ranks[0][algo]:
            labels = []
            for r in ranks:
                for step in r[algo][d]:
                    labels += [k for k in step if k not in labels]
            rows = []
            for k in labels:
                meds, calls = [], 0
                for r in ranks:
                    vals = [step.get(k, (0.0, 0))[0] for step in r[algo][d]]
                    meds.append(statistics.median(vals))
                    calls = max(calls, max(step.get(k, (0.0, 0))[1] for step in r[algo][d]))
                rows.append((sum(meds) / len(meds), k, calls, min(meds), max(meds)))
            total = sum(r[0] for r in rows)
            lines.append(f"\n### phases: {algo} {d} (total {total:.4f} s, mean over ranks of the median step)")
            lines.append("| s | share | calls | min..max over ranks | phase |")
            lines.append("|---|---|---|---|---|")
            order = (lambda r: r[1]) if d == "bwd nodes" else (lambda r: -r[0])  # nodes: run order
            for v, k, c, lo, hi in sorted(rows, key=order):
                lines.append(f"| {v:.4f} | {v / total:.0%} | {c} | {lo:.4f}..{hi:.4f} | {k} |")
    return "\n".join(lines)


def summarize_layer_profile(res):
    if not res.get("layer_profile_per_rank"):
        return ""
    ranks = res["layer_profile_per_rank"]
    keys = ["wall", "expert_fwd", "expert_bwd", "main_other", "comm_busy", "comm_collectives",
            "comm_local"]
    lines = ["\n### where a step goes (seconds; mean over ranks of the median profiled step)",
             "| overlap_chunks | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for c in res["chunks"]:
        vals = []
        for k in keys:
            vals.append(sum(statistics.median(s[k] for s in r[f"chunks={c}"]) for r in ranks) / len(ranks))
        lines.append(f"| {c} | " + " | ".join(f"{v:.3f}" for v in vals) + " |")
    lines.append("(main_other: the calling thread outside the expert fwd/bwd (router, waits for the "
                 "communication thread, glue); comm_collectives: the communication thread inside "
                 "collectives, i.e. on the link or waiting for peers)")
    return "\n".join(lines)


def summarize_layer(res, label):
    lines = [f"## {label}: MoE layer fwd+bwd ({res['layer_algo']} dispatch), {res['nodes']} nodes x "
             f"{res['local_size']} ranks, T={res['T']} per rank, H={res['H']}, F={res['F']}, "
             f"K={res['K']}, E={res['E']}, {res['dtype']}"
             + (f", one shared expert of F={res['shared']}" if res.get("shared") else ""),
             "| overlap_chunks | fwd+bwd (s), median | min | veth bytes / step |", "|---|---|---|---|"]
    base = None
    for c in res["chunks"]:
        e = res[f"chunks={c}"]
        base = base or e["median_s"]
        lb = e["link_bytes_per_step"]
        lines.append(f"| {c} | {e['median_s']:.4f} | {e['min_s']:.4f} | "
                     f"{'-' if not lb else f'{lb:,.0f}'} |")
    for c in res["chunks"][1:]:
        r = res[f"chunks={c}"]["median_s"] / base
        res[f"ratio_chunks{c}"] = r
        lines.append(f"\nratio overlap_chunks={c} / 1: {r:.3f}")
    return "\n".join(lines)


def run_case(cfg, mode="loopback", local_size=2, rate="1gbit", timeout=900):
    """One benchmark case (``cfg`` as built by :func:`dispatch_case` / :func:`layer_case`) on the
    emulated two-node setup (``mode="netns"``, root) or on loopback; returns the result dict."""
    if mode == "netns":
        why = netns_unavailable()
        if why:
            raise RuntimeError(f"the emulated two-node benchmark cannot run here: {why}")
        res = run_netns(cfg, local_size=local_size, rate=rate, timeout=timeout)
    else:
        res = run_loopback(cfg, local_size=local_size, timeout=timeout)
    for k in ("layer_algo", "F", "chunks", "shared"):
        if k in cfg:
            res[k] = cfg[k]
    return res


def dispatch_case(T, H, *, K=8, E=32, dtype="bfloat16", algos=ALGOS, warmup=1, iters=3,
                  phases=0):
    return dict(kind="dispatch", T=T, H=H, K=K, E=E, dtype=dtype, algos=list(algos),
                warmup=warmup, iters=iters, phases=phases)


def layer_case(T, H, F, *, K=8, E=32, dtype="float32", algo="hierarchical", chunks=(1, 4),
               warmup=1, iters=3, phases=0, shared=0):
    """``shared``: FFN size of one shared expert (0 = none; DeepSeek-V3 / Pangu Ultra MoE use F)."""
    return dict(kind="layer", T=T, H=H, F=F, K=K, E=E, dtype=dtype, layer_algo=algo,
                chunks=list(chunks), algos=[], warmup=warmup, iters=iters, phases=phases,
                shared=shared)


# ----------------------------------------------------------------------------- suite runner
def _timing(m):
    """A worker's per-variant figures as the harness's Timing (median, IQR, runs)."""
    from ascend_moe_ops.benchmark.timing import Timing
    v = m["all_s"]
    q = statistics.quantiles(v, n=4, method="inclusive") if len(v) > 1 else [v[0]] * 3
    return Timing(m["median_s"], q[2] - q[0], len(v), v, 1,
                  "slowest rank per step, one harness run after a barrier, variants interleaved")


def run(ctx):
    """Loopback 2x2 (suite runner). Loopback links are all equal: this shows the software
    overhead of each algorithm; the emulated two-node numbers come from ``--netns``."""
    from ascend_moe_ops.bench import Row
    T, H = (256, 512) if ctx.quick else (1024, 1024)
    res = run_case(dispatch_case(T, H, iters=3 if ctx.quick else 5), "loopback", timeout=300)
    rows = []
    for algo in ALGOS:
        e = res[algo]
        meas = sum(s["inter_node_bytes"] for s in e["stats_per_rank"]) // res["world"]
        comb = sum(s["combine_inter_node_bytes"] for s in e["stats_per_rank"]) // res["world"]
        peers = {} if algo == "flat" else {"flat": _timing(res["flat"]["fwd_bwd"])}
        rows.append(Row(op="ep_dispatcher", case=f"2x2 loopback T={T} H={H} K=8 E=32 fwd+bwd",
                        backend=algo, dtype="bf16", seconds=_timing(e["fwd_bwd"]),
                        bytes=2 * (meas + comb),
                        formula="bytes = inter-node bytes one rank sends per step "
                                "(2 x (dispatch + combine), from the split sizes used)",
                        limit="link", peers=peers,
                        path=f"EP dispatch + combine fwd+bwd, MoEDispatcher(algorithm='{algo}')",
                        extra=dict(fwd_s=e["fwd"]["median_s"], inter_node_bytes_dispatch=meas,
                                   link="loopback (all links equal)", link_GBps=None)))
    return rows


def test_bench_ep_dispatcher_single_rank(benchmark):
    """pytest-benchmark: dispatch+combine fwd+bwd on a 1-rank gloo group (local work only)."""
    import torch
    import torch.distributed as dist
    from ascend_moe_ops.distributed import EPTopology, MoEDispatcher
    if dist.is_initialized():
        import pytest
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        disp = MoEDispatcher(EPTopology(local_size=1), 32, algorithm="flat")
        x = torch.randn(256, 512, dtype=torch.bfloat16, requires_grad=True)
        top = torch.rand(256, 32).topk(8, dim=1)
        probs = top.values.softmax(1).requires_grad_(True)

        def step():
            et, _, h = disp.dispatch(x, top.indices, probs)
            disp.combine(et * 2, h).sum().backward()

        benchmark(step)
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--local-size", type=int, default=2, help="ranks per node (default 2)")
    ap.add_argument("--init", default="", help=argparse.SUPPRESS)
    ap.add_argument("--config", default="{}", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--pg-timeout", type=int, default=300, help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help="JSON results file")
    ap.add_argument("--netns", action="store_true", help="emulated two-node cluster (root)")
    ap.add_argument("--loopback", action="store_true", help="2 nodes x local-size ranks on loopback")
    ap.add_argument("--rate", default="1gbit", help="inter-node link rate for --netns (tc tbf)")
    ap.add_argument("--cases", default=",".join(f"{t}x{h}" for t, h in NETNS_CASES),
                    help="comma-separated TxH cases (tokens per rank x hidden)")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--layer", default="",
                    help="also time the MoE layer fwd+bwd: comma-separated TxHxF cases")
    ap.add_argument("--layer-algo", default="hierarchical", help="dispatch algorithm of the layer")
    ap.add_argument("--layer-dtype", default="float32", choices=("float32", "bfloat16"),
                    help="dtype of the layer cases (default float32, as in the earlier figures)")
    ap.add_argument("--layer-shared", type=int, default=0,
                    help="FFN size of one shared expert in the layer cases (0 = none, the default)")
    ap.add_argument("--chunks", default="1,4", help="overlap_chunks values of the layer runs")
    ap.add_argument("--algos", default=",".join(ALGOS), help="dispatch algorithms to time")
    ap.add_argument("--phases", type=int, default=0,
                    help="after the timed rounds, N more steps per algorithm with per-phase timers "
                         "(every collective, async waits, the local work in between), fwd and bwd")
    ap.add_argument("--skip-dispatch", action="store_true", help="only the layer cases")
    a = ap.parse_args(argv)
    if a.worker:
        _worker(a)
        return 0
    if not (a.netns or a.loopback):
        ap.error("choose --netns or --loopback (the suite runner calls run(ctx))")
    if a.netns:
        why = netns_unavailable()
        if why:
            print(f"skipping the emulated two-node benchmark: {why}")
            return 0
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "mode": "netns" if a.netns else "loopback", "rate": a.rate if a.netns else None,
              "cpus": os.cpu_count(), "cases": []}
    mode = "netns" if a.netns else "loopback"
    label = f"emulated 2 nodes (netns, veth {a.rate} each way)" if a.netns else "loopback"
    cfgs = []
    if not a.skip_dispatch:
        for case in a.cases.split(","):
            T, H = (int(v) for v in case.split("x"))
            cfgs.append(dispatch_case(T, H, dtype=a.dtype, iters=a.iters, phases=a.phases,
                                      algos=a.algos.split(",")))
    for case in filter(None, a.layer.split(",")):
        T, H, F = (int(v) for v in case.split("x"))
        cfgs.append(layer_case(T, H, F, dtype=a.layer_dtype, shared=a.layer_shared, algo=a.layer_algo,
                               iters=a.iters, phases=a.phases,
                               chunks=[int(c) for c in a.chunks.split(",")]))
    for cfg in cfgs:
        res = run_case(cfg, mode, local_size=a.local_size, rate=a.rate)
        print(summarize(res, label), flush=True)
        if res.get("phases_per_rank"):
            print(summarize_phases(res), flush=True)
        if res.get("layer_profile_per_rank"):
            print(summarize_layer_profile(res), flush=True)
        report["cases"].append(res)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
