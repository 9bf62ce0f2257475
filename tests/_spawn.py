"""Multi-process test harness shared by the distributed tests: free ports, spawning a group of
rank processes with a join deadline (a deadlock fails the test instead of hanging CI), running a
list of scenarios in each rank with one result per scenario (``rank{r}.json`` in ``outdir``), and
reading those results back."""

import json
import os
import socket
import time
import traceback


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(target, world: int, args: tuple, outdir: str, timeout: float):
    """Run ``target(rank, *args)`` in ``world`` spawned processes; returns ``(per_rank, hung)``:
    the parsed ``rank{r}.json`` of each rank (``{}`` if it wrote none) and the ranks still alive
    at the deadline (they are killed)."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=(r,) + tuple(args), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.time() + timeout
    for p in procs:
        p.join(max(0.1, deadline - time.time()))
    hung = [i for i, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    per_rank = []
    for r in range(world):
        path = os.path.join(outdir, f"rank{r}.json")
        per_rank.append(json.load(open(path)) if os.path.exists(path) else {})
    return per_rank, hung


def dump_results(results: dict, outdir: str, rank: int) -> None:
    """Write ``rank{rank}.json`` atomically: a killed rank leaves no torn file."""
    tmp = os.path.join(outdir, f".rank{rank}.json")
    with open(tmp, "w") as f:
        json.dump(results, f)
    os.replace(tmp, os.path.join(outdir, f"rank{rank}.json"))


def run_scenarios(calls, results: dict, outdir: str, rank: int, *, after_each=None, log=False) -> None:
    """In a rank process: run ``fn()`` for each ``(name, fn)`` of ``calls`` in order (seed 1234
    first), record ``["ok", seconds]`` or ``[traceback, seconds]`` in ``results[name]``, and dump
    the results after every scenario (so a later hang still reports the earlier ones).
    ``after_each()`` runs after each dump (e.g. a barrier)."""
    import torch
    for name, fn in calls:
        if log:
            print(f"rank {rank}: {name}", flush=True)
        t0 = time.time()
        torch.manual_seed(1234)
        try:
            fn()
            results[name] = ["ok", time.time() - t0]
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException:  # also pytest.raises' "DID NOT RAISE" (a BaseException)
            results[name] = [traceback.format_exc(), time.time() - t0]
        dump_results(results, outdir, rank)
        if after_each is not None:
            after_each()


def setup_failure(results: dict, outdir: str, rank: int) -> None:
    """In a rank process, inside ``except``: record the traceback as ``__setup__`` and dump."""
    results["__setup__"] = [traceback.format_exc(), 0]
    dump_results(results, outdir, rank)


def problems(per_rank, hung, names) -> list:
    """One line per rank and scenario of ``names`` that did not report ``ok`` (setup failures,
    missing results with the hung ranks, tracebacks)."""
    out = []
    for r, res in enumerate(per_rank):
        if "__setup__" in res:
            out.append(f"rank {r}: process group setup failed:\n{res['__setup__'][0]}")
        for name in names:
            item = res.get(name)
            if item is None:
                out.append(f"rank {r} {name}: no result (hung ranks: {hung})")
            elif item[0] != "ok":
                out.append(f"rank {r} {name}:\n{item[0]}")
    return out
