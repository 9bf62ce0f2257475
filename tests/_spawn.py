"""Multi-process test harness shared by the distributed tests: free ports, spawning a group of
rank processes with a join deadline (a deadlock fails the test instead of hanging CI), and reading
back each rank's JSON results (``rank{r}.json`` in ``outdir``)."""

import json
import os
import socket
import time


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
