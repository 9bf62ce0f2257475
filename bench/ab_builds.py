"""A/B timing of two builds of the package in one run: the grouped GEMM, the permute and the unpermute
(forward and backward).

Each build is a directory holding an ``ascend_moe_ops`` package with its compiled extension (a source
checkout after ``python setup.py build_ext --inplace``, or a folder an install went to). Two builds of
one extension cannot share a process (both register the same ops), so each runs in its own worker
process, started once; the driver sends every case to both workers in turn, alternating which goes
first (A B, B A, ...), for several rounds. A worker times ``--reps`` calls after a warm-up and reports
the median; per round the driver takes the ratio B / A of the medians, and reports the median ratio
over the rounds with its range. On a shared machine the range says how much to trust it.

    python bench/ab_builds.py --a PORTABLE_TREE --b NATIVE_TREE --rounds 7 --json out.json

Both workers run with the same thread count (``--threads``) and inputs (fixed seeds).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

# name -> (kind, params); shapes in the range the kernels are tuned for, small enough for a few
# seconds per round on 2 cores
CASES = {
    "gg_bf16_fwd_fine": ("gg", dict(E=64, rows=64, K=512, N=256, dtype="bfloat16", trans_b=False)),
    "gg_bf16_fwd": ("gg", dict(E=8, rows=256, K=1024, N=512, dtype="bfloat16", trans_b=False)),
    "gg_bf16_dx_fine": ("gg", dict(E=64, rows=64, K=256, N=512, dtype="bfloat16", trans_b=True)),
    "gg_bf16_dw_fine": ("gg_dw", dict(E=64, rows=64, K=512, N=256, dtype="bfloat16")),
    "gg_fp32_fwd_fine": ("gg", dict(E=64, rows=64, K=512, N=256, dtype="float32", trans_b=False)),
    "permute_bf16": ("permute", dict(T=2048, H=2048, E=64, K=8, dtype="bfloat16")),
    "unpermute_bf16": ("unpermute", dict(T=2048, H=2048, E=64, K=8, dtype="bfloat16")),
    "unpermute_bwd_bf16": ("unpermute_bwd", dict(T=2048, H=2048, E=64, K=8, dtype="bfloat16")),
}


# ------------------------------------------------------------------------------------------ worker
def _worker(threads: int) -> None:
    import torch
    import ascend_moe_ops as amo
    from ascend_moe_ops.benchmark.timing import measure

    torch.set_num_threads(threads)
    info = {"package": os.path.dirname(amo.__file__), "torch": torch.__version__,
            "backend": amo.active_backend("grouped_gemm", "cpu")}
    try:
        from ascend_moe_ops import _native
        info["cpu_capability"] = _native.cpu_capability()
        bi = _native.build_info()
        # an editable install's import hook may resolve the submodule in another tree: only a record
        # next to this tree's package describes this tree's build
        own = bi is not None and os.path.dirname(os.path.realpath(bi.__file__)) == \
            os.path.dirname(os.path.realpath(amo.__file__))
        info["build_flags"] = getattr(bi, "CPU_FLAGS", None) if own else None
    except ImportError:  # a build older than the build record
        info["cpu_capability"] = None
    prepared = {}

    def prepare(name):
        kind, p = CASES[name]
        g = torch.Generator().manual_seed(0)
        dt = getattr(torch, p["dtype"])
        if kind in ("gg", "gg_dw"):
            E, rows, K, N = p["E"], p["rows"], p["K"], p["N"]
            gs = torch.full((E,), rows, dtype=torch.int64)
            x = torch.randn(E * rows, K, generator=g).to(dt)
            if kind == "gg_dw":
                dy = torch.randn(E * rows, N, generator=g).to(dt)
                return lambda: amo.grouped_gemm_dw(x, dy, gs)
            w = torch.randn(E, N, K, generator=g).to(dt) if p["trans_b"] else torch.randn(E, K, N, generator=g).to(dt)
            return lambda: amo.grouped_gemm(x, w, gs, trans_b=p["trans_b"])
        T, H, E, K = p["T"], p["H"], p["E"], p["K"]
        tok = torch.randn(T, H, generator=g).to(dt)
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
        if kind == "permute":
            return lambda: amo.moe_permute(tok, idx, num_experts=E)
        res = amo.moe_permute(tok, idx, num_experts=E)
        probs = torch.rand(T, K, generator=g)
        if kind == "unpermute_bwd":
            grad_out = torch.randn(T, H, generator=g).to(dt)
            bwd = torch.ops.ascend_moe_ops.moe_unpermute_backward.default
            return lambda: bwd(grad_out, res.tokens, res.row_id_map, probs)
        return lambda: amo.moe_unpermute(res.tokens, res.row_id_map, probs)

    print(json.dumps(info), flush=True)
    for line in sys.stdin:
        name, reps = line.split()
        if name not in prepared:
            prepared[name] = prepare(name)
            for _ in range(2):
                prepared[name]()  # warm-up: workspaces, page faults
        fn = prepared[name]
        with torch.inference_mode():
            t = measure(fn, runs=int(reps), warmup=0)  # the package's one timer (this tree's copy)
        print(json.dumps({"median_s": float(t), "min_s": min(t.times)}), flush=True)


# ------------------------------------------------------------------------------------------ driver
class Worker:
    def __init__(self, tree: str, threads: int):
        env = dict(os.environ, PYTHONPATH=os.path.abspath(tree), OMP_NUM_THREADS=str(threads))
        self.p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", "--threads", str(threads)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                  cwd=os.path.abspath(tree))
        self.info = json.loads(self.p.stdout.readline())
        if os.path.realpath(self.info["package"]) != os.path.realpath(os.path.join(tree, "ascend_moe_ops")):
            raise SystemExit(f"--tree {tree!r} did not provide the package (got {self.info['package']})")

    def run(self, name: str, reps: int) -> float:
        self.p.stdin.write(f"{name} {reps}\n")
        self.p.stdin.flush()
        return json.loads(self.p.stdout.readline())["median_s"]

    def close(self):
        self.p.stdin.close()
        self.p.wait(timeout=60)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--a", help="folder holding build A's ascend_moe_ops package")
    ap.add_argument("--b", help="folder holding build B's ascend_moe_ops package")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=5, help="timed calls per case per round and build")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated subset of " + ", ".join(CASES))
    ap.add_argument("--json", help="write the per-round times here")
    args = ap.parse_args(argv)
    if args.worker:
        _worker(args.threads)
        return 0
    if not args.a or not args.b:
        ap.error("--a and --b are required (two folders, each holding an ascend_moe_ops package)")
    cases = [c for c in args.cases.split(",") if c]
    bad = [c for c in cases if c not in CASES]
    if bad:
        ap.error(f"--cases: unknown {bad}; expected names from {list(CASES)}")
    if args.rounds < 1 or args.reps < 1:
        ap.error("--rounds and --reps must be >= 1")
    wa, wb = Worker(args.a, args.threads), Worker(args.b, args.threads)
    print(f"A: {args.a}  {wa.info}\nB: {args.b}  {wb.info}")
    rows = {c: [] for c in cases}
    try:
        for r in range(args.rounds):
            for i, c in enumerate(cases):
                order = [("a", wa), ("b", wb)] if (r + i) % 2 == 0 else [("b", wb), ("a", wa)]
                t = {k: w.run(c, args.reps) for k, w in order}
                rows[c].append(t)
    finally:
        wa.close()
        wb.close()
    print(f"\n{'case':20s} {'A ms':>9s} {'B ms':>9s} {'B/A median':>11s} {'B/A range':>15s}   ({args.rounds} rounds, "
          f"{args.reps} calls each, {args.threads} threads)")
    summary = {}
    for c in cases:
        ratios = [t["b"] / t["a"] for t in rows[c]]
        a_ms = statistics.median(t["a"] for t in rows[c]) * 1e3
        b_ms = statistics.median(t["b"] for t in rows[c]) * 1e3
        summary[c] = {"a_ms": a_ms, "b_ms": b_ms, "ratio_median": statistics.median(ratios),
                      "ratio_min": min(ratios), "ratio_max": max(ratios)}
        print(f"{c:20s} {a_ms:9.2f} {b_ms:9.2f} {statistics.median(ratios):11.3f} "
              f"{min(ratios):7.3f}-{max(ratios):.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"a": {"tree": args.a, **wa.info}, "b": {"tree": args.b, **wb.info},
                       "rounds": rows, "summary": summary, "threads": args.threads, "reps": args.reps}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
