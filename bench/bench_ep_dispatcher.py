"""Benchmark of the expert-parallel dispatcher: flat vs hierarchical dispatch+combine (fwd+bwd).

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

Timing: each step is ``dispatch -> toy expert (y = 2x) -> combine -> backward``; every rank starts
a step after a barrier, a step's time is the slowest rank's, and the table shows the median over
the timed steps. The machine this ran on is shared: times are noisy.
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

REPO = Path(__file__).resolve().parents[1]
PYTEST_CASES = False  # run() starts 4 processes: not a pytest-benchmark case (see the single-rank one)
ALGOS = ("flat", "hierarchical")
# (T tokens per rank, H hidden): the target range is T, H in 1024..4096
NETNS_CASES = [(1024, 1024), (2048, 2048)]


# ----------------------------------------------------------------------------- worker (one rank)
def _worker(a) -> None:
    sys.path.insert(0, str(REPO))
    import warnings
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo", init_method=a.init, rank=a.rank, world_size=a.world,
                            timeout=datetime.timedelta(seconds=a.pg_timeout))
    from ascend_moe_ops.distributed import EPTopology, MoEDispatcher
    from ascend_moe_ops.benchmark.timing import measure
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

    result = {"T": T, "H": H, "K": K, "E": E, "dtype": cfg["dtype"], "world": a.world,
              "local_size": a.local_size, "nodes": topo.num_nodes}
    for algo in cfg["algos"]:
        disp = MoEDispatcher(topo, E, algorithm=algo)

        def step(backward: bool):
            et, tpe, h = disp.dispatch(x, ids, probs)
            out = disp.combine(et * 2, h)
            if backward:
                out.backward(gy)
                x.grad = probs.grad = None
            return h

        entry = {}
        for mode in ("fwd", "fwd_bwd"):
            bwd = mode == "fwd_bwd"
            with torch.set_grad_enabled(bwd):
                dist.barrier()
                b0 = link_bytes()
                # the harness, a fixed number of runs (every rank makes the same calls), each run
                # after an untimed barrier; a step's time is the slowest rank's
                last = {}
                t = measure(lambda: last.__setitem__("h", step(bwd)), runs=cfg["iters"],
                            warmup=cfg["warmup"], threads=a.threads, setup=dist.barrier)
                times = torch.tensor(t.times, dtype=torch.float64)
                dist.all_reduce(times, op=dist.ReduceOp.MAX)
                per = times.tolist()
                h = last["h"]
                dist.barrier()
                # veth bytes of the warm-up and timed steps (both directions, summed over nodes;
                # the barriers and the time all-reduce add a few hundred bytes per step)
                lb = torch.tensor([link_bytes() - b0], dtype=torch.int64)
                dist.all_reduce(lb)
            q = statistics.quantiles(per, n=4, method="inclusive") if len(per) > 1 else [per[0]] * 3
            entry[mode] = dict(median_s=statistics.median(per), iqr_s=q[2] - q[0], min_s=min(per), all_s=per,
                               link_bytes_per_step=int(lb) / (cfg["iters"] + cfg["warmup"]) if iface else None)
        st = torch.tensor([h.stats[k] for k in ("inter_node_rows", "inter_node_bytes",
                                               "intra_node_rows", "intra_node_bytes",
                                               "combine_inter_node_bytes")], dtype=torch.int64)
        per_rank = [torch.zeros_like(st) for _ in range(a.world)]
        dist.all_gather(per_rank, st)
        entry["stats_per_rank"] = [dict(zip(("inter_node_rows", "inter_node_bytes",
                                             "intra_node_rows", "intra_node_bytes",
                                             "combine_inter_node_bytes"), r.tolist()))
                                   for r in per_rank]
        # the exact formula, from this rank's routing (gathered for the table)
        owner = ids // (E // a.world)
        remote = torch.tensor([int(((owner // a.local_size) != topo.node).sum())], dtype=torch.int64)
        rem = [torch.zeros_like(remote) for _ in range(a.world)]
        dist.all_gather(rem, remote)
        entry["remote_slots_per_rank"] = [int(r) for r in rem]
        result[algo] = entry
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


def _launch(specs, world, local_size, init, cfg, timeout, threads=1):
    """Start one worker per entry of ``specs`` (``(rank, command prefix, extra env)``) and return
    rank 0's JSON. Every process is killed if the group does not finish within ``timeout``."""
    fd, out = tempfile.mkstemp(suffix=".json", prefix="amo_ep_bench_")
    os.close(fd)
    procs = []
    try:
        for rank, prefix, extra in specs:
            env = dict(os.environ, OMP_NUM_THREADS=str(threads), **extra)
            cmd = list(prefix) + [sys.executable, str(Path(__file__).resolve()), "--worker",
                                  "--rank", str(rank), "--world", str(world), "--local-size",
                                  str(local_size), "--init", init, "--config", json.dumps(cfg),
                                  "--out", out, "--threads", str(threads)]
            procs.append(subprocess.Popen(cmd, cwd=str(REPO), env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
        deadline = time.monotonic() + timeout
        logs = []
        for p in procs:
            try:
                logs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"benchmark group did not finish within {timeout} s")
        if any(p.returncode for p in procs):
            raise RuntimeError("a benchmark rank failed:\n" + "\n".join(
                f"--- rank {i} (rc {p.returncode}) ---\n{(l or '')[-3000:]}"
                for i, (p, l) in enumerate(zip(procs, logs)) if p.returncode))
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
def formula_bytes(res, algo):
    """Inter-node bytes of one dispatch, summed over ranks, from the issue's arithmetic."""
    T, H, K, N = res["T"], res["H"], res["K"], res["nodes"]
    W = res["world"]
    es = {"bfloat16": 2, "float16": 2, "float32": 4}[res["dtype"]]
    if algo == "flat":  # exactly the slots whose expert sits on another node
        return sum(res["flat"]["remote_slots_per_rank"]) * H * es
    return W * T * (N - 1) * (H * es + K * 4 + K * 4)  # tokens + int32 ids + fp32 probs


def summarize(res, label):
    lines = [f"## {label}: {res['nodes']} nodes x {res['local_size']} ranks, T={res['T']} per rank, "
             f"H={res['H']}, K={res['K']}, E={res['E']}, {res['dtype']}"]
    lines.append("| algorithm | fwd (s) | fwd+bwd (s) | inter-node bytes / dispatch (measured, all ranks)"
                 " | formula | veth bytes / fwd+bwd step |")
    lines.append("|---|---|---|---|---|---|")
    for algo in ALGOS:
        if algo not in res:
            continue
        e = res[algo]
        meas = sum(s["inter_node_bytes"] for s in e["stats_per_rank"])
        lb = e["fwd_bwd"]["link_bytes_per_step"]
        lines.append(f"| {algo} | {e['fwd']['median_s']:.4f} | {e['fwd_bwd']['median_s']:.4f} | "
                     f"{meas:,} | {formula_bytes(res, algo):,} | "
                     f"{'-' if lb is None else f'{lb:,.0f}'} |")
    if all(a in res for a in ALGOS):
        r1 = res["hierarchical"]["fwd_bwd"]["median_s"] / res["flat"]["fwd_bwd"]["median_s"]
        r0 = res["hierarchical"]["fwd"]["median_s"] / res["flat"]["fwd"]["median_s"]
        lines.append(f"\nratio hierarchical/flat: fwd+bwd {r1:.3f}, fwd {r0:.3f}")
        res["ratio_fwd_bwd"], res["ratio_fwd"] = r1, r0
    return "\n".join(lines)


# ----------------------------------------------------------------------------- suite runner
def run(ctx):
    """Loopback 2x2 (suite runner). Loopback links are all equal: this shows the software
    overhead of each algorithm; the emulated two-node numbers come from ``--netns``."""
    from ascend_moe_ops.bench import Row
    from ascend_moe_ops.benchmark.timing import Timing
    T, H = (256, 512) if ctx.quick else (1024, 1024)
    cfg = dict(T=T, H=H, K=8, E=32, dtype="bfloat16", algos=list(ALGOS),
               warmup=1, iters=3 if ctx.quick else 5)
    res = run_loopback(cfg, timeout=300)
    rows = []
    for algo in ALGOS:
        e = res[algo]
        meas = sum(s["inter_node_bytes"] for s in e["stats_per_rank"]) // res["world"]
        comb = sum(s["combine_inter_node_bytes"] for s in e["stats_per_rank"]) // res["world"]
        def timing(m):
            return Timing(m["median_s"], m.get("iqr_s", 0.0), len(m["all_s"]), m["all_s"], 1,
                          "slowest rank per step, harness runs after a barrier")
        peers = {} if algo == "flat" else {"flat": timing(res["flat"]["fwd_bwd"])}
        rows.append(Row(op="ep_dispatcher", case=f"2x2 loopback T={T} H={H} K=8 E=32 fwd+bwd",
                        backend=algo, dtype="bf16", seconds=timing(e["fwd_bwd"]),
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
    sys.path.insert(0, str(REPO))
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
    for case in a.cases.split(","):
        T, H = (int(v) for v in case.split("x"))
        cfg = dict(T=T, H=H, K=8, E=32, dtype=a.dtype, algos=list(ALGOS), warmup=1, iters=a.iters)
        if a.netns:
            res = run_netns(cfg, local_size=a.local_size, rate=a.rate)
            label = f"emulated 2 nodes (netns, veth {a.rate} each way)"
        else:
            res = run_loopback(cfg, local_size=a.local_size)
            label = "loopback"
        print(summarize(res, label), flush=True)
        report["cases"].append(res)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
