"""Benchmark of a real megatron-core ``MoELayer`` (forward + backward) on CPU, patched by
:func:`ascend_moe_ops.integrations.megatron.patch` vs unpatched, timed in the same process.

Run by ``python -m ascend_moe_ops.bench`` through :func:`run`, or alone:
``python bench/bench_moe_layer.py [--quick] [--profile] [--repeats N]``.

Layer: megatron-core's own ``MoELayer`` (``TopKRouter``, token dispatcher, experts), world size 1
over gloo, bf16, T=2048 tokens (seq 1024 x batch 2), H=1024, E=64, top-8, SwiGLU experts with
F=256 (the fine-grained ratio F/H ~ 1/4 of DeepSeek-V3 / Pangu Ultra MoE); ``--quick`` halves T.
Megatron's CPU obstacles are neutralized by ``bench/_megatron_cpu.py`` (docs/integrations.md).

Configurations (all with the same weights and inputs, timed round-robin so that the load of a
shared machine hits them alike; the reported time is the median of the repeats):

* ``unpatched SequentialMLP``: megatron-core as installed -- ``moe_grouped_gemm=False`` is its
  only CPU option (``GroupedMLP`` needs the CUDA ``grouped_gemm`` package).
* ``unpatched + grouped GEMM``: ``GroupedMLP`` with only the grouped GEMM fed from this package
  (``patch(targets=("grouped_gemm",))``): Megatron's own permute/unpermute/sort-chunks.
* ``patched GroupedMLP``: everything patched (``patch()``).
* ``patched SequentialMLP``: the dispatch ops patched, Megatron's per-expert loop kept.
"""

from __future__ import annotations

import argparse
import sys
import warnings

import torch

from ascend_moe_ops.bench import Row

OP = "moe_layer"
DTYPE = torch.bfloat16
SHAPE = dict(T=2048, H=1024, E=64, K=8, F=256)
QUICK_SHAPE = dict(T=1024, H=1024, E=64, K=8, F=256)
DISPATCHERS = ("alltoall", "allgather")
FORMULA = "flops = 3 GEMMs x 2*T*K*H*F forward, x3 for forward+backward (expert GEMMs only)"


def _cpu_helpers():
    from ascend_moe_ops.benchmark.suite import _megatron_cpu
    return _megatron_cpu


def _layers(shape, dispatcher):
    h = _cpu_helpers()
    kw = dict(hidden=shape["H"], ffn=shape["F"], experts=shape["E"], topk=shape["K"],
              dispatcher=dispatcher, dtype=DTYPE)
    seq = h.make_layer(**kw)
    grp = h.make_layer(grouped_gemm=True, **kw)
    with torch.no_grad():
        grp.router.weight.copy_(seq.router.weight)
        grp.experts.weight1.copy_(torch.cat([e.linear_fc1.weight.t() for e in seq.experts.local_experts], 1))
        grp.experts.weight2.copy_(torch.cat([e.linear_fc2.weight.t() for e in seq.experts.local_experts], 0))
    return seq, grp


def configs(shape, dispatcher):
    """``{name: (layer, patch targets or None)}``."""
    from ascend_moe_ops.integrations import megatron as mg
    seq, grp = _layers(shape, dispatcher)
    return {
        "unpatched SequentialMLP": (seq, None),
        "unpatched + grouped GEMM": (grp, ("grouped_gemm",)),
        "patched GroupedMLP": (grp, mg.PATCHABLE),
        "patched SequentialMLP": (seq, mg.PATCHABLE),
    }


def step_fn(layer, targets, x, g):
    """``(scope, step)``: one forward + backward of ``layer``, to be called inside ``scope()``, the
    patch of the given targets (Megatron's CPU shims only, when ``targets`` is None). The patch is
    applied once around a run of steps, as a training script applies it once, not inside the timed
    step: :func:`~ascend_moe_ops.integrations.megatron.patch` scans every loaded module (tens of
    milliseconds with torch and megatron-core loaded), a cost a user pays once per process."""
    import contextlib
    from ascend_moe_ops.integrations import megatron as mg
    h = _cpu_helpers()

    @contextlib.contextmanager
    def scope():
        with contextlib.ExitStack() as stack:
            if targets is not None:
                stack.enter_context(mg.patched(targets=targets))
            stack.enter_context(h.cpu_shims())
            yield

    def step():
        layer.zero_grad(set_to_none=True)
        xi = x.detach().requires_grad_()
        out, _ = layer(xi)
        out.backward(g)
    return scope, step


def _inputs(shape):
    gen = torch.Generator().manual_seed(0)
    T, H = shape["T"], shape["H"]
    x = torch.randn(T // 2, 2, H, generator=gen).to(DTYPE)
    g = torch.randn(T // 2, 2, H, generator=gen).to(DTYPE)
    return x, g


def measure(ctx, shape, dispatcher, repeats=5):
    """Median fwd+bwd seconds per configuration, round-robin repeats (same run)."""
    x, g = _inputs(shape)
    cfgs = configs(shape, dispatcher)
    steps = {name: step_fn(layer, t, x, g) for name, (layer, t) in cfgs.items()}
    for scope, s in steps.values():  # warm-up
        with scope():
            s()
    times = {name: [] for name in steps}
    for _ in range(repeats):
        for name, (scope, s) in steps.items():
            with scope():  # patched (or not) outside the timed step
                times[name].append(ctx.time(s, min_time=0.0, min_iters=1, warmup=0))
    return {name: sorted(v)[len(v) // 2] for name, v in times.items()}, times


# ---------------------------------------------------------------- saved activation bytes
def saved_bytes(fn, params=()):
    """Bytes of the distinct storages autograd saves for backward while ``fn()`` runs
    (``torch.autograd.graph.saved_tensors_hooks``), leaving out ``params`` (they are kept anyway):
    the activation memory a training step holds between forward and backward."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip and st.nbytes():
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


MEMORY_OPTIONS = {
    "none": {},
    "recompute_permute": dict(recompute_permute=True),
    "recompute_activation": dict(recompute_activation=True),
    "recompute_permute + recompute_activation": dict(recompute_permute=True, recompute_activation=True),
    "score_before_experts": dict(score_before_experts=True),
    "score_before_experts + recompute_permute": dict(score_before_experts=True, recompute_permute=True),
}


def memory_rows(shape=None):
    """Saved bytes of ``ascend_moe_ops.nn.MoELayer`` per memory option (bf16, one forward)."""
    from ascend_moe_ops.nn import MoELayer
    shape = shape or SHAPE
    T, H, E, K, F = (shape[k] for k in "THEKF")
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(0)).to(DTYPE)
    out = {}
    for name, kw in MEMORY_OPTIONS.items():
        torch.manual_seed(0)
        layer = MoELayer(H, E, F, K, dtype=DTYPE, init_std=0.02, **kw)
        xi = x.clone().requires_grad_()
        out[name], _ = saved_bytes(lambda: layer(xi), list(layer.parameters()))
    return out


# ---------------------------------------------------------------- the ops on Megatron's call paths
OP_TOKENS = (256, 2048)  # small and large T (H=1024, E=64, top-8, bf16, fp32 probs)


def _path_ops(fn, T, H=1024, E=64, K=8):
    """The calls Megatron-Core 0.16.1's dispatchers make, on module ``fn`` (megatron-core's
    moe_utils or ascend_moe_ops.integrations.megatron): ``{path: step}``."""
    gen = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=gen).to(DTYPE)
    scores = torch.rand(T, E, generator=gen)
    mask = torch.zeros(T, E, dtype=torch.bool).scatter_(1, scores.topk(K, -1).indices, True)
    probs = scores * mask
    N = T * K
    rows, pp, si = fn.permute(x, mask, probs=probs, num_out_tokens=N)
    sizes = mask.sum(0)
    order = torch.randperm(E, generator=gen)  # EP>1 reorders chunks; EP=1 keeps them in order
    xg, prg = x.clone().requires_grad_(), probs.clone().requires_grad_()
    go = torch.randn(T, H, generator=gen).to(DTYPE)

    def trip():  # the alltoall dispatcher's forward+backward data path, probs applied in between
        xg.grad = prg.grad = None
        r, p2, s2 = fn.permute(xg, mask, probs=prg, num_out_tokens=N)
        r, p2 = fn.sort_chunks_by_idxs(r, sizes, torch.arange(E), probs=p2)
        # stand-in for the experts (Megatron applies probs in the activation): one bf16 multiply, so
        # that the row times the data path (an fp32-promoting multiply took ~170 of its 180 ms)
        r = r * p2.to(r.dtype).unsqueeze(1)
        r, _ = fn.sort_chunks_by_idxs(r, sizes, torch.arange(E))
        fn.unpermute(r, s2, x.shape, routing_map=mask).backward(go)

    return {
        "permute with probs (alltoall dispatcher)": lambda: fn.permute(x, mask, probs=probs, num_out_tokens=N),
        "permute, no probs, tensor num_out_tokens (allgather dispatcher)":
            lambda: fn.permute(x, mask, num_out_tokens=sizes.sum()),
        "unpermute with routing_map, no probs (both dispatchers)":
            lambda: fn.unpermute(rows, si, x.shape, routing_map=mask),
        "sort_chunks_by_idxs with probs (alltoall, EP>1 order)":
            lambda: fn.sort_chunks_by_idxs(rows, sizes, order, probs=pp),
        "sort_chunks_by_idxs, no probs (alltoall combine)": lambda: fn.sort_chunks_by_idxs(rows, sizes, order),
        "dispatch+combine round trip fwd+bwd (alltoall, EP=1)": trip,
    }


def _activation_ops(T, K=8, F=256):
    """GroupedMLP's SwiGLU x probs (fwd+bwd) at N = T*K rows: megatron-core 0.16.1's closure (the
    two functions GroupedMLP.__init__ builds, under megatron.core.jit.jit_fuser = torch.compile on
    this torch) vs the fused kernel that patch() gives it."""
    import torch.nn.functional as Fn
    from megatron.core.jit import jit_fuser
    from ascend_moe_ops.integrations import megatron as mg

    @jit_fuser
    def glu(x):
        x = torch.chunk(x, 2, dim=-1)
        return Fn.silu(x[0]) * x[1]

    @jit_fuser
    def megatron_closure(x, probs):
        dtype = x.dtype
        return (glu(x) * probs).to(dtype)

    gen = torch.Generator().manual_seed(T)
    N = T * K
    x = torch.randn(N, 2 * F, generator=gen).to(DTYPE).requires_grad_()
    p = torch.rand(N, 1, generator=gen).requires_grad_()
    g = torch.randn(N, F, generator=gen).to(DTYPE)

    def step(fn):
        def run():
            x.grad = p.grad = None
            fn(x, p).backward(g)
        return run
    return step(mg._activation_with_probs), step(megatron_closure)


def _spread(ts):
    """(q3 - q1) / median of a list of times."""
    v = sorted(float(t) for t in ts)
    q = lambda f: v[min(len(v) - 1, int(round(f * (len(v) - 1))))]
    return (q(0.75) - q(0.25)) / q(0.5) if q(0.5) > 0 else float("nan")


def op_rows(ctx, repeats=5, tokens=OP_TOKENS):
    """Each op on Megatron's call path: this package vs megatron-core's own, round-robin (the two
    sides of a row alternate, so the machine's load hits them alike); median of the repeats and the
    spread (IQR / median) of each side."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.transformer.moe import moe_utils as mcore
    from ascend_moe_ops.integrations import megatron as mg
    rows = []
    for T in tokens:
        ours, theirs = _path_ops(mg, T), _path_ops(mcore, T)
        key = "activation_func_with_probs fwd+bwd (GroupedMLP, SwiGLU, N=T*K, F=256)"
        ours[key], theirs[key] = _activation_ops(T)
        t_ours = {k: [] for k in ours}
        t_theirs = {k: [] for k in ours}
        for k in ours:
            ours[k](), theirs[k](), ours[k](), theirs[k]()  # warm-up (and torch.compile of Megatron's closure)
        for _ in range(repeats):
            for k in ours:
                t_theirs[k].append(ctx.time(theirs[k], min_time=0.1, warmup=0))
                t_ours[k].append(ctx.time(ours[k], min_time=0.1, warmup=0))
        for k in ours:
            a, b = sorted(t_ours[k])[repeats // 2], sorted(t_theirs[k])[repeats // 2]
            rows.append(Row(op="megatron call path", case=f"{k} T{T} H1024 E64 K8", backend="integrations.megatron",
                            dtype="bfloat16", seconds=a, peers={"megatron-core 0.16.1": b},
                            extra={"repeats": repeats, "speedup_vs_megatron": round(b / a, 3),
                                   "spread_ours": round(_spread(t_ours[k]), 3),
                                   "spread_megatron": round(_spread(t_theirs[k]), 3),
                                   "threads": torch.get_num_threads()}))
    return rows


PANGU = dict(T=4096, H=7680, E=256, K=8)  # Pangu Ultra MoE's MoE layer (bench_moe_permute's preset)


def pangu_rows(ctx, repeats=5, routings=("balanced", "skewed")):
    """The Megatron drop-in at the Pangu shape: ``permute`` with probs (alltoall dispatcher) and
    ``unpermute`` with ``routing_map``, no probs (both dispatchers), this package vs megatron-core,
    the two sides alternating; the inputs of bench_moe_permute (balanced and Zipf-skewed routing)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.transformer.moe import moe_utils as mcore
    from ascend_moe_ops.integrations import megatron as mg
    from ascend_moe_ops.benchmark.suite.bench_moe_permute import make_inputs
    T, H, E, K = (PANGU[k] for k in "THEK")
    rows = []
    for routing in routings:
        tokens, _, _, mask, dense = make_inputs(T, H, E, K, routing, torch.device("cpu"), dtype=DTYPE)
        N = T * K
        ops = {}
        for name, fn in (("ours", mg), ("megatron", mcore)):
            r, _, si = fn.permute(tokens, mask, probs=dense, num_out_tokens=N)
            ops[name] = {
                "permute with probs (alltoall dispatcher)":
                    lambda fn=fn: fn.permute(tokens, mask, probs=dense, num_out_tokens=N),
                "unpermute with routing_map, no probs (both dispatchers)":
                    lambda fn=fn, r=r, si=si: fn.unpermute(r, si, tokens.shape, routing_map=mask),
            }
        times = {(k, side): [] for k in ops["ours"] for side in ops}
        for _ in range(repeats):
            for k in ops["ours"]:
                for side in ("megatron", "ours"):
                    times[(k, side)].append(ctx.time(ops[side][k], runs=1, warmup=0))
        for k in ops["ours"]:
            a = sorted(times[(k, "ours")])[repeats // 2]
            b = sorted(times[(k, "megatron")])[repeats // 2]
            rows.append(Row(op="megatron call path", case=f"{k} {routing} T{T} H{H} E{E} K{K}",
                            backend="integrations.megatron", dtype="bfloat16", seconds=a,
                            peers={"megatron-core 0.16.1": b},
                            extra={"repeats": repeats, "speedup_vs_megatron": round(b / a, 3),
                                   "spread_ours": round(_spread(times[(k, "ours")]), 3),
                                   "spread_megatron": round(_spread(times[(k, "megatron")]), 3),
                                   "threads": torch.get_num_threads()}))
        del ops, tokens, mask, dense
    return rows


def run(ctx, repeats=None, dispatchers=DISPATCHERS):
    if ctx.device.type != "cpu":
        return []  # the Megatron CPU shims are for CPU runs; on a GPU megatron-core runs as is
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import megatron.core.transformer.moe.moe_layer  # noqa: F401
    except Exception as exc:  # megatron-core not installed: nothing to compare against
        print(f"bench_moe_layer: skipped, megatron-core unavailable ({type(exc).__name__}: {exc})")
        return []
    if getattr(ctx, "recording", False):
        # pytest replays a recorded case later, outside the Megatron world (process group and
        # model-parallel state) and the CPU shims / patch scope that each layer step runs in here,
        # so only the call-path ops are recorded; the layer rows are timed by the CLI
        return op_rows(ctx)
    h = _cpu_helpers()
    shape = QUICK_SHAPE if ctx.quick else SHAPE
    repeats = repeats or (3 if ctx.quick else 5)
    T, H, E, K, F = (shape[k] for k in "THEKF")
    flops = 3 * 3 * 2 * T * K * H * F
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with h.megatron_world():
            for dispatcher in dispatchers:
                med, _ = measure(ctx, shape, dispatcher, repeats)
                base = med["unpatched SequentialMLP"]
                case = f"fwd+bwd {dispatcher} T{T} H{H} E{E} K{K} F{F}"
                for name, t in med.items():
                    peers = {k: v for k, v in med.items() if k != name}
                    rows.append(Row(op=OP, case=f"{case} [{name}]", backend="megatron-core MoELayer",
                                    dtype="bfloat16", seconds=t, flops=flops, formula=FORMULA,
                                    limit="flops", peers=peers,
                                    extra={"repeats": repeats, "speedup_vs_unpatched_default": round(base / t, 3),
                                           "speedup_vs_grouped_gemm_only": round(med["unpatched + grouped GEMM"] / t, 3)}))
    return rows + op_rows(ctx)


def profile(shape, dispatcher, name, row_limit=25):
    """torch.profiler table of one configuration (self CPU time)."""
    from torch.profiler import ProfilerActivity, profile as tprofile
    x, g = _inputs(shape)
    layer, targets = configs(shape, dispatcher)[name]
    scope, step = step_fn(layer, targets, x, g)
    with scope():
        step()
        with tprofile(activities=[ProfilerActivity.CPU]) as prof:
            step()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=row_limit)


def main(argv=None):
    from ascend_moe_ops.bench import Context
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--dispatcher", choices=DISPATCHERS, default=None)
    ap.add_argument("--profile", default=None, help="a configuration name to profile instead of timing")
    ap.add_argument("--ops-only", action="store_true", help="only the ops on Megatron's call paths")
    ap.add_argument("--memory", action="store_true", help="saved bytes of nn.MoELayer per memory option")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads before timing")
    ap.add_argument("--pangu", action="store_true", help="the drop-in permute/unpermute at the Pangu shape")
    ap.add_argument("--tokens", type=int, nargs="*", default=None, help="T of the --ops-only rows (default 256 2048)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    shape = QUICK_SHAPE if args.quick else SHAPE
    h = _cpu_helpers()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if args.profile:
            with h.megatron_world():
                print(profile(shape, args.dispatcher or "alltoall", args.profile))
            return 0
        ctx = Context(torch.device("cpu"), "quick")
        ctx.quick = args.quick  # the layer shapes are this module's own (SHAPE / QUICK_SHAPE)
        if args.memory:
            mem = memory_rows(shape)
            for k, v in mem.items():
                print(f"{k:45s} {v / 2**20:9.1f} MiB saved  x{v / mem['none']:.2f} of none")
            return 0
        if args.pangu:
            for r in pangu_rows(ctx, args.repeats or 5):
                print(f"{r.case:90s} {r.seconds * 1e3:8.1f} ms  x{r.extra['speedup_vs_megatron']:.2f} vs megatron-core "
                      f"(spread {100 * r.extra['spread_ours']:.0f}% / {100 * r.extra['spread_megatron']:.0f}%, "
                      f"{r.extra['threads']} threads)", flush=True)
            return 0
        if args.ops_only:
            tokens = tuple(args.tokens) if args.tokens else OP_TOKENS
            for r in op_rows(ctx, args.repeats or 5, tokens):
                print(f"{r.case:90s} {r.seconds * 1e3:8.2f} ms  x{r.extra['speedup_vs_megatron']:.2f} vs megatron-core "
                      f"(spread {100 * r.extra['spread_ours']:.0f}% / {100 * r.extra['spread_megatron']:.0f}%, "
                      f"{r.extra['threads']} threads)", flush=True)
            return 0
        disp = (args.dispatcher,) if args.dispatcher else DISPATCHERS
        for r in run(ctx, args.repeats, disp):
            if r.op != OP:
                print(f"{r.case:82s} {r.seconds * 1e3:8.2f} ms  x{r.extra['speedup_vs_megatron']:.2f} vs megatron-core")
                continue
            print(f"{r.case:70s} {r.seconds * 1e3:9.1f} ms  x{r.extra['speedup_vs_unpatched_default']:.2f} "
                  f"vs unpatched default, x{r.extra['speedup_vs_grouped_gemm_only']:.2f} vs grouped-GEMM-only")
    return 0


if __name__ == "__main__":
    sys.exit(main())
