"""Benchmark of a whole megatron-core ``GPTModel`` training step (MoE layers) on CPU, patched by
:func:`ascend_moe_ops.integrations.megatron.patch` vs unpatched, the two arms interleaved.

Run alone: ``python bench/bench_megatron_gpt.py [--quick] [--profile] [--steps N] [--memory]``
(also run by ``python -m ascend_moe_ops.bench --ops megatron_gpt`` through :func:`run`).

Model: megatron-core's own ``GPTModel`` with Megatron's default local layer spec
(``get_gpt_layer_local_spec``: its own attention and LayerNorm, an MoE MLP in every layer),
4 layers, H=256, 4 heads, 16 experts top-4 with SwiGLU experts of F=256, bf16 parameters and
compute, rope, vocabulary 256 (byte-level tokens), seq 512 x batch 2 (``--quick``: seq 256, 2
layers). Tokens are the bytes of Python standard-library sources (real text that ships with
Python), the same batches for both arms. Optimizer: ``torch.optim.SGD`` (momentum 0.9) on the bf16
parameters, the same for both arms. World size 1 over gloo; Megatron's CPU obstacles are
neutralized by ``bench/_megatron_cpu.py``.

Modes (``moe_grouped_gemm``):

* ``SequentialMLP`` (``moe_grouped_gemm=False``, the default): unpatched = megatron-core as
  installed; patched = ``patch(targets=BITWISE)``.
* ``GroupedMLP`` (``moe_grouped_gemm=True``): megatron-core's ``GroupedMLP`` needs the CUDA
  ``grouped_gemm`` package, so the unpatched arm has only the grouped GEMM fed from this package
  (``patch(targets=("grouped_gemm",))``) and Megatron's own everything else; patched =
  ``patch(targets=BITWISE)``.

``BITWISE`` is every target but ``"activation"`` (the fused SwiGLU x probs rounds once where
Megatron rounds after each step: close, not bitwise). The loss of every step must be bitwise equal
between the arms (checked; a difference is an error).

Each arm has its own model, built from the same seed (so the same initial weights), and its own
optimizer; step ``i`` of both arms runs on batch ``i``, alternating which arm goes first, so that
the load of a shared machine hits both alike. The patch is applied around each arm's step, outside
the timed region (a training script applies it once). Reported: median step time per arm, the
spread (IQR / median), the ratio of the medians, the median of the per-step ratios, the median
thread CPU time per arm (``time.thread_time``: with ``--threads 1`` the whole step runs on the
calling thread, and this is far steadier than wall time on a loaded machine), and (``--memory``)
the peak RSS of each arm measured in a child process of its own (a fair peak: the other arm's
model is not resident) with the bytes autograd saves for backward in one forward.
``--profile`` prints torch.profiler tables of both arms and :func:`dispatch_trip`, the
dispatcher's data path per layer (everything the bitwise targets replace: the ceiling).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import subprocess
import sys
import time
import warnings

import torch

OP = "megatron_gpt"
PYTEST_CASES = False  # whole-model steps: minutes, not a pytest-benchmark case
SHAPE = dict(layers=4, hidden=256, heads=4, experts=16, topk=4, ffn=256, seq=512, batch=2)
QUICK_SHAPE = dict(SHAPE, layers=2, seq=256)
MODES = {"SequentialMLP": False, "GroupedMLP": True}
LR = 1e-2


def _cpu_helpers():
    from ascend_moe_ops.benchmark.suite import _megatron_cpu
    return _megatron_cpu


def bitwise_targets():
    from ascend_moe_ops.integrations import megatron as mg
    return tuple(t for t in mg.PATCHABLE if t != "activation")


def arm_targets(grouped_gemm: bool, patched: bool):
    """Patch targets of an arm (None: nothing patched)."""
    if patched:
        return bitwise_targets()
    return ("grouped_gemm",) if grouped_gemm else None


# ---------------------------------------------------------------- data: real text, byte tokens
def text_tokens(n: int) -> torch.Tensor:
    """``n`` byte tokens (int64, 0..255) of Python standard-library sources, in a fixed order."""
    root = os.path.dirname(os.__file__)
    out, total = [], 0
    for path in sorted(glob.glob(os.path.join(root, "*.py"))):
        with open(path, "rb") as f:
            b = f.read()
        out.append(b)
        total += len(b)
        if total >= n:
            break
    data = b"".join(out)[:n]
    if len(data) < n:
        raise RuntimeError(f"only {len(data)} bytes of standard-library sources found, {n} needed")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)


def batches(shape, steps: int):
    """``steps`` batches ``(tokens [B, S], labels [B, S])``: consecutive windows of the text."""
    B, S = shape["batch"], shape["seq"]
    toks = text_tokens(steps * B * (S + 1))
    toks = toks.view(steps, B, S + 1)
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in toks]


# ---------------------------------------------------------------- the model
def make_model(shape, grouped_gemm: bool, seed: int = 0):
    """A megatron-core ``GPTModel`` (local spec, MoE in every layer, bf16) on CPU; call inside
    :func:`_megatron_cpu.megatron_world`."""
    h = _cpu_helpers()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.tensor_parallel import random as tp_random
        from megatron.core.transformer.transformer_config import TransformerConfig
    from ascend_moe_ops.integrations import megatron as mg
    H = shape["hidden"]
    cfg = TransformerConfig(
        num_layers=shape["layers"], hidden_size=H, num_attention_heads=shape["heads"], ffn_hidden_size=4 * H,
        num_moe_experts=shape["experts"], moe_router_topk=shape["topk"], moe_ffn_hidden_size=shape["ffn"],
        moe_token_dispatcher_type="alltoall", moe_grouped_gemm=grouped_gemm, moe_aux_loss_coeff=0.0,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        use_cpu_initialization=True, bf16=True, params_dtype=torch.bfloat16, hidden_dropout=0.0,
        attention_dropout=0.0, init_method_std=0.02)
    spec = get_gpt_layer_local_spec(num_experts=shape["experts"], moe_grouped_gemm=grouped_gemm)
    torch.manual_seed(seed)
    # GroupedMLP asserts at construction that a grouped GEMM is importable: feed it this package's
    gg = mg.patched(targets=("grouped_gemm",)) if grouped_gemm else contextlib.nullcontext()
    with h.cpu_shims(), gg, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = GPTModel(cfg, spec, vocab_size=256, max_sequence_length=shape["seq"],
                         position_embedding_type="rope")
    del tp_random
    return model


def _position_ids(tokens):
    B, S = tokens.shape
    return torch.arange(S, dtype=torch.int64).unsqueeze(0).expand(B, S)


def _causal_mask(S):
    """Megatron's ``[1, 1, S, S]`` attention mask (True = masked out). Passed explicitly: without
    one, megatron-core 0.16.1 builds its default causal mask on ``device="cuda"``."""
    return torch.triu(torch.ones(S, S, dtype=torch.bool), diagonal=1).view(1, 1, S, S)


class Arm:
    """One side of the comparison: its own model (same seed) and optimizer."""

    def __init__(self, name, shape, grouped_gemm, patched, seed=0):
        self.name = name
        self.targets = arm_targets(grouped_gemm, patched)
        self.model = make_model(shape, grouped_gemm, seed)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=LR, momentum=0.9)
        self.losses, self.times, self.cpu_times = [], [], []

    @contextlib.contextmanager
    def scope(self):
        from ascend_moe_ops.integrations import megatron as mg
        h = _cpu_helpers()
        with contextlib.ExitStack() as st:
            if self.targets is not None:
                st.enter_context(mg.patched(targets=self.targets))
            st.enter_context(h.cpu_shims())
            yield

    def step(self, tokens, labels):
        """One training step (forward, loss, backward, optimizer step); returns the loss (fp32)."""
        self.opt.zero_grad(set_to_none=True)
        loss = self.model(tokens, _position_ids(tokens), _causal_mask(tokens.shape[1]), labels=labels)  # [B, S] per token
        loss = loss.float().mean()
        loss.backward()
        self.opt.step()
        return loss.detach()


def interleaved(shape, grouped_gemm, steps, warmup=2, seed=0, clock=None):
    """Both arms, interleaved on the same batches. Returns ``{arm: Arm}``."""
    from ascend_moe_ops.benchmark.timing import clock_for
    clock = clock or clock_for(torch.device("cpu"))
    arms = [Arm("unpatched", shape, grouped_gemm, False, seed), Arm("patched", shape, grouped_gemm, True, seed)]
    data = batches(shape, steps + warmup)
    for i, (tok, lab) in enumerate(data):
        order = arms if i % 2 == 0 else arms[::-1]
        for arm in order:
            with arm.scope():
                c0, t0 = time.thread_time(), clock()
                loss = arm.step(tok, lab)
                t1, c1 = clock(), time.thread_time()
            if i >= warmup:
                arm.times.append(t1 - t0)
                arm.cpu_times.append(c1 - c0)  # CPU time of this thread: robust to a loaded machine
                                               # when torch runs one thread (--threads 1)
            arm.losses.append(loss)
    return {a.name: a for a in arms}


def _median(v):
    s = sorted(v)
    return s[len(s) // 2] if s else float("nan")


def _spread(v):
    s = sorted(v)
    if not s:
        return float("nan")
    q = lambda f: s[min(len(s) - 1, int(round(f * (len(s) - 1))))]  # noqa: E731
    return (q(0.75) - q(0.25)) / q(0.5)


def losses_equal(arms):
    a, b = arms["unpatched"].losses, arms["patched"].losses
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def summarize(arms):
    u, p = arms["unpatched"], arms["patched"]
    return dict(unpatched_s=_median(u.times), patched_s=_median(p.times), spread_unpatched=_spread(u.times),
                spread_patched=_spread(p.times), speedup=_median(u.times) / _median(p.times),
                unpatched_cpu_s=_median(u.cpu_times), patched_cpu_s=_median(p.cpu_times),
                speedup_cpu=_median(u.cpu_times) / _median(p.cpu_times),
                per_step_ratio_median=_median([a / b for a, b in zip(u.times, p.times)]),
                steps=len(u.times), losses_bitwise_equal=losses_equal(arms),
                loss_first=float(u.losses[0]), loss_last=float(u.losses[-1]))


# ---------------------------------------------------------------- peak memory (child processes)
def _child(mode, patched, shape_name, steps):
    """Runs in a child process: one arm alone, prints its peak RSS (bytes) and losses as JSON."""
    import resource
    h = _cpu_helpers()
    shape = QUICK_SHAPE if shape_name == "quick" else SHAPE
    torch.set_num_threads(int(os.environ.get("AMO_BENCH_THREADS", torch.get_num_threads())))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with h.megatron_world():
            arm = Arm("patched" if patched else "unpatched", shape, MODES[mode], patched)
            for tok, lab in batches(shape, steps):
                with arm.scope():
                    arm.losses.append(arm.step(tok, lab))
            kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # the steps' peak
            with arm.scope():
                saved = saved_bytes(arm, *batches(shape, 1)[0])
    print(json.dumps(dict(peak_rss=kib * 1024, saved_bytes=saved, losses=[float(x) for x in arm.losses])))


def saved_bytes(arm, tokens, labels):
    """Bytes of the distinct storages autograd saves for backward in one forward of the arm's model
    (parameters left out; the MoE layer benchmark's counter): the activation memory a step holds
    between forward and backward, exact where peak RSS is dominated by the libraries."""
    from ascend_moe_ops.benchmark.suite.bench_moe_layer import saved_bytes as _saved
    n, _ = _saved(lambda: arm.model(tokens, _position_ids(tokens), _causal_mask(tokens.shape[1]), labels=labels),
                  list(arm.model.parameters()))
    return n


def peak_rss(mode, shape_name, steps):
    """``{arm: {"peak_rss": bytes, "saved_bytes": bytes}}``, each arm alone in a fresh child process."""
    out = {}
    for patched in (False, True):
        cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, str(int(patched)), shape_name, str(steps)]
        res = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if res.returncode:
            raise RuntimeError(f"memory child failed:\n{res.stderr[-3000:]}")
        got = json.loads(res.stdout.strip().splitlines()[-1])
        out["patched" if patched else "unpatched"] = dict(peak_rss=got["peak_rss"], saved_bytes=got["saved_bytes"])
    return out


# ---------------------------------------------------------------- profile
def profile(shape, grouped_gemm, steps=2, row_limit=25):
    """torch.profiler tables (self CPU time) of ``steps`` steps of each arm."""
    from torch.profiler import ProfilerActivity, profile as tprofile
    out = {}
    arms = [Arm("unpatched", shape, grouped_gemm, False), Arm("patched", shape, grouped_gemm, True)]
    data = batches(shape, steps + 1)
    for arm in arms:
        with arm.scope():
            arm.step(*data[0])  # warm-up
            with tprofile(activities=[ProfilerActivity.CPU]) as prof:
                for tok, lab in data[1:]:
                    arm.step(tok, lab)
        out[arm.name] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=row_limit)
    return out


# ---------------------------------------------------------------- the ceiling: the dispatcher's share
TRIP = "dispatch+combine round trip fwd+bwd (alltoall, EP=1)"


def dispatch_trip(shape, repeats=60):
    """Thread CPU time of the alltoall dispatcher's data path of one layer at this model's shape
    (permute, sort chunks, a bf16 probs multiply standing in for the experts, sort chunks back,
    unpermute; forward + backward: ``bench_moe_layer``'s round trip), megatron-core's functions vs
    this package's, alternated; ``{"megatron-core": s, "patched": s}`` medians. Everything the
    bitwise targets replace in a step is this, once per layer: the step minus ``layers`` times the
    megatron-core figure bounds what any bitwise dispatcher could give."""
    from ascend_moe_ops.benchmark.suite import bench_moe_layer as bm
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.transformer.moe import moe_utils as mcore
    from ascend_moe_ops.integrations import megatron as mg
    T = shape["seq"] * shape["batch"]
    fns = {"megatron-core": bm._path_ops(mcore, T, H=shape["hidden"], E=shape["experts"], K=shape["topk"])[TRIP],
           "patched": bm._path_ops(mg, T, H=shape["hidden"], E=shape["experts"], K=shape["topk"])[TRIP]}
    times = {k: [] for k in fns}
    for fn in fns.values():
        fn(), fn()  # warm-up
    for _ in range(repeats):
        for k, fn in fns.items():
            c0 = time.thread_time()
            fn()
            times[k].append(time.thread_time() - c0)
    return {k: _median(v) for k, v in times.items()}


# ---------------------------------------------------------------- harness entry
def run(ctx, steps=None, modes=tuple(MODES)):
    if ctx.device.type != "cpu":
        return []  # the Megatron CPU shims are for CPU runs
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import megatron.core.models.gpt  # noqa: F401
    except Exception as exc:
        print(f"bench_megatron_gpt: skipped, megatron-core unavailable ({type(exc).__name__}: {exc})")
        return []
    from ascend_moe_ops.bench import Row
    if ctx.recording:
        return []
    h = _cpu_helpers()
    shape = QUICK_SHAPE if ctx.quick else SHAPE
    steps = steps or (4 if ctx.quick else 10)
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with h.megatron_world():
            for mode in modes:
                s = summarize(interleaved(shape, MODES[mode], steps))
                if not s["losses_bitwise_equal"]:
                    raise AssertionError(f"{mode}: patched loss curve differs from the unpatched one")
                case = f"train step {mode} " + " ".join(f"{k}{v}" for k, v in shape.items())
                rows.append(Row(op=OP, case=case, backend="patched", dtype="bfloat16", seconds=s["patched_s"],
                                peers={"unpatched": s["unpatched_s"]},
                                extra={k: (round(v, 4) if isinstance(v, float) else v) for k, v in s.items()}))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller model, fewer steps (a smoke test)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per arm (default 12, quick 3)")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--profile", action="store_true", help="print torch.profiler tables, patched vs unpatched, "
                    "and the dispatcher data path's cost per layer (the bitwise ceiling)")
    ap.add_argument("--memory", action="store_true", help="also measure each arm's peak RSS in a child process")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--json", default=None, help="write the results to this JSON file")
    ap.add_argument("--child", nargs=4, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        ap.error(f"--steps must be >= 1, got {args.steps}")
    if args.threads is not None:
        if args.threads < 1:
            ap.error(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
        os.environ["AMO_BENCH_THREADS"] = str(args.threads)
    if args.child:
        mode, patched, shape_name, steps = args.child
        _child(mode, patched == "1", shape_name, int(steps))
        return 0
    h = _cpu_helpers()
    shape = QUICK_SHAPE if args.quick else SHAPE
    steps = args.steps or (3 if args.quick else 12)
    results = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with h.megatron_world():
            for mode in args.modes:
                if args.profile:
                    for arm, table in profile(shape, MODES[mode]).items():
                        print(f"\n=== {mode}, {arm} (self CPU time, 2 steps) ===\n{table}")
                    continue
                s = summarize(interleaved(shape, MODES[mode], steps))
                results[mode] = s
                print(f"{mode}: unpatched {s['unpatched_s'] * 1e3:.1f} ms (IQR {100 * s['spread_unpatched']:.0f} %), "
                      f"patched {s['patched_s'] * 1e3:.1f} ms (IQR {100 * s['spread_patched']:.0f} %), "
                      f"speedup {s['speedup']:.3f}x (median of per-step ratios {s['per_step_ratio_median']:.3f}x; "
                      f"thread CPU time {s['unpatched_cpu_s'] * 1e3:.1f} vs {s['patched_cpu_s'] * 1e3:.1f} ms, "
                      f"{s['speedup_cpu']:.3f}x) over {s['steps']} steps; loss {s['loss_first']:.4f} -> "
                      f"{s['loss_last']:.4f}; loss curves bitwise equal: {s['losses_bitwise_equal']}", flush=True)
    if args.profile:
        trip = dispatch_trip(shape)
        print(f"\ndispatcher data path per layer (thread CPU time, median of 60): megatron-core "
              f"{trip['megatron-core'] * 1e3:.2f} ms, patched {trip['patched'] * 1e3:.2f} ms; x {shape['layers']} "
              f"layers = {shape['layers'] * trip['megatron-core'] * 1e3:.1f} vs "
              f"{shape['layers'] * trip['patched'] * 1e3:.1f} ms per step", flush=True)
    if args.memory and not args.profile:
        for mode in args.modes:
            rss = peak_rss(mode, "quick" if args.quick else "full", 3)
            results[mode]["peak_rss"] = rss
            u, p = rss["unpatched"], rss["patched"]
            print(f"{mode}: peak RSS unpatched {u['peak_rss'] / 2**20:.1f} MiB, patched {p['peak_rss'] / 2**20:.1f} "
                  f"MiB (each arm alone in a child process, 3 steps); saved for backward in one forward: "
                  f"unpatched {u['saved_bytes'] / 2**20:.2f} MiB, patched {p['saved_bytes'] / 2**20:.2f} MiB", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(shape=shape, threads=torch.get_num_threads(), results=results), f, indent=1)
    bad = [m for m, s in results.items() if not s["losses_bitwise_equal"]]
    if bad:
        print(f"FAIL: loss curves differ in {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
