"""Validation of the step simulator on this machine: calibrate on microbenchmarks of the component
ops, predict whole MoE layers (forward + backward), compare with their measured wall time.

``python -m ascend_moe_ops.perfmodel.validate --out DIR [--rounds 5] [--threads 1] [--clock wall|process] [--no-glue] [--tiny] [--no-ep]``
``python -m ascend_moe_ops.perfmodel.validate --out DIR --device cuda`` (the same on a GPU; adds the
uncalibrated prediction from the GPU's public spec table, ``--spec h200``, as a second model column)

(then, as root, the expert-parallel layer on the emulated two-node cluster: :mod:`.validate_ep`)

Method (docs/perfmodel/training_sim.md):

* **calibration** (microbenchmarks only): each component of ``nn.MoELayer`` -- router, permute,
  fc1/fc2 grouped GEMM, SwiGLU, unpermute, each forward and backward -- timed alone at the
  calibration shapes :data:`CALIBRATION` (none of them a validation shape); per op kind and dtype
  ``t = c0 + c1*flops + c2*bytes + c3*groups`` is fitted (:class:`~.sim.costs.FittedCosts`; for the
  data-movement kinds a measured cost-per-byte curve competes, chosen by leave-one-out);
* **layer glue** (a documented departure from component-only calibration): whole ``nn.MoELayer``
  fwd+bwd at the calibration shapes (:func:`calibration_layers`, recompute options cycled),
  to which the per-dtype glue of :class:`~.sim.costs.LayerGlue` is fitted (the framework work
  between the components that no component microbenchmark contains); its form (none, a constant,
  a fraction of the summed ops, per byte, constant + per byte) is chosen per dtype by
  leave-one-out over those calibration layers (:meth:`~.sim.costs.LayerGlue.select`);
* **validation**: ``nn.MoELayer`` forward + backward at the shapes :data:`VALIDATION` (vary T, H,
  F, E, top-k, dtype and recompute), predicted as the sum of its ops
  (:func:`~.sim.layers.moe_layer_ops`) priced by the fit plus the glue, and measured;
* the two alternate in ``rounds`` (calibrate, validate, calibrate, ...) in one process, so that
  the drift of a shared machine hits both alike; within a round the layers are measured in a
  shuffled order. Every timing is the median of its runs (a minimum, or a ratio to a reference
  op timed beside it, were tried on the loaded VM and biased the comparison: docs); each layer's
  figures are medians over the rounds (the glue is fitted to those). Reported: per configuration
  the prediction (components and glue), the measurement, its spread over the rounds
  (``(max - min) / median``), accuracy ``1 - |p - m| / m``, the mean and worst accuracy, and the
  same for the components alone. ``--clock process`` times CPU seconds of the process instead of
  wall seconds (one thread: the same on an idle core; not inflated by other jobs).

Every timing goes through the package's harness (:func:`ascend_moe_ops.benchmark.timing.measure`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Tuple

from .. import _cli

__all__ = ["CALIBRATION", "VALIDATION", "calibration_layers", "component_steps", "layer_step", "run", "main"]

#: (T, H, F, E, K) of the calibration microbenchmarks, each in both dtypes
CALIBRATION = [(512, 256, 128, 8, 2), (2048, 256, 256, 32, 8), (512, 1024, 512, 8, 2),
               (1024, 896, 192, 64, 4), (3072, 384, 448, 16, 2), (256, 640, 640, 4, 1),
               (1536, 1024, 128, 48, 6)]
#: validation configurations: (T, H, F, E, K, dtype, recompute_permute, recompute_activation)
VALIDATION = [
    (1024, 512, 256, 16, 4, "float32", False, False),
    (2048, 512, 256, 16, 4, "float32", False, False),
    (1024, 768, 384, 32, 8, "float32", False, False),
    (768, 1024, 512, 8, 2, "float32", False, False),
    (1536, 384, 192, 64, 6, "float32", False, False),
    (1024, 512, 256, 16, 4, "bfloat16", False, False),
    (2048, 768, 256, 32, 8, "bfloat16", False, False),
    (768, 1024, 384, 16, 2, "bfloat16", False, False),
    (1024, 512, 256, 16, 4, "float32", True, False),
    (1024, 512, 256, 16, 4, "float32", False, True),
    (2048, 512, 256, 32, 8, "bfloat16", True, True),
    (1536, 768, 512, 24, 4, "float32", True, True),
    (1024, 640, 320, 16, 4, "bfloat16", False, True),
]
#: a few seconds' worth, for CI (plumbing only)
TINY_CALIBRATION = [(64, 32, 16, 4, 2), (128, 64, 32, 8, 2), (96, 48, 24, 4, 1)]
TINY_VALIDATION = [(80, 40, 20, 4, 2, "float32", False, False), (80, 40, 20, 4, 2, "float32", True, True)]


def _dtype(name):
    import torch
    return getattr(torch, name)


def _routing(T, E, K, gen):
    import torch
    return torch.rand(T, E, generator=gen).topk(K, dim=1).indices


def component_steps(T, H, F, E, K, dtype, device="cpu") -> Dict[str, Callable[[], object]]:
    """One callable per component op of the MoE layer (forward and backward separately), keyed by
    the op names of :func:`~.sim.layers.moe_layer_ops`. Backward callables re-run one autograd
    node (``torch.autograd.grad(..., retain_graph=True)``) on tensors built once."""
    import torch
    from ..nn.moe import GroupedMLP, TopKRouter, swiglu
    from ..ops.grouped_gemm import grouped_gemm
    from ..ops.moe_permute import moe_permute
    from ..ops.moe_unpermute import moe_unpermute
    dt = _dtype(dtype)
    gen = torch.Generator().manual_seed(T * 7 + H)
    torch.manual_seed(T + H + F)
    x = torch.randn(T, H, generator=gen).to(device=device, dtype=dt).requires_grad_()
    router = TopKRouter(H, E, K, dtype=dt, device=device)
    mlp = GroupedMLP(E, H, F, dtype=dt, device=device)
    ids, probs, _ = router(x)
    gp = torch.randn(probs.shape, generator=gen).to(device)
    ids = _routing(T, E, K, gen).to(device)  # uniform routing for the rest (the validation layer's router is random too)
    pr = torch.rand(T, K, generator=gen).to(device).requires_grad_()
    xd = x.detach().requires_grad_()
    perm = moe_permute(xd, ids, pr.detach(), num_experts=E, map_type="index")
    rows = perm.tokens.detach().requires_grad_()
    sizes = perm.group_sizes
    N = rows.shape[0]
    g_rows = torch.randn(N, H, generator=gen).to(device=device, dtype=dt)
    w1, w2 = mlp.w1(), mlp.w2()
    h = grouped_gemm(rows, w1, sizes)
    gh = torch.randn(h.shape, generator=gen).to(device=device, dtype=dt)
    hd = h.detach().requires_grad_()
    a = swiglu(hd)
    ga = torch.randn(a.shape, generator=gen).to(device=device, dtype=dt)
    ad = a.detach().requires_grad_()
    y = grouped_gemm(ad, w2, sizes)
    yd = y.detach().requires_grad_()
    out = moe_unpermute(yd, perm.row_id_map, pr)
    g_out = torch.randn(T, H, generator=gen).to(device=device, dtype=dt)
    permuted = moe_permute(xd, ids, pr.detach(), num_experts=E, map_type="index").tokens
    grad = torch.autograd.grad
    return {
        "router": lambda: router(x),
        "router_bwd": lambda: grad(probs, [x, router.weight], gp, retain_graph=True),
        "permute": lambda: moe_permute(xd, ids, pr, num_experts=E, map_type="index"),
        "permute_bwd": lambda: grad(permuted, xd, g_rows, retain_graph=True),
        "fc1": lambda: grouped_gemm(rows, w1, sizes),
        "fc1_bwd": lambda: grad(h, [rows, w1], gh, retain_graph=True),
        "swiglu": lambda: swiglu(hd),
        "swiglu_bwd": lambda: grad(a, hd, ga, retain_graph=True),
        "fc2": lambda: grouped_gemm(ad, w2, sizes),
        "fc2_bwd": lambda: grad(y, [ad, w2], g_rows, retain_graph=True),
        "unpermute": lambda: moe_unpermute(yd, perm.row_id_map, pr),
        "unpermute_bwd": lambda: grad(out, [yd, pr], g_out, retain_graph=True),
    }


def layer_step(T, H, F, E, K, dtype, recompute_permute, recompute_activation, device="cpu") -> Callable[[], None]:
    """``nn.MoELayer`` forward + backward (what the simulator predicts), random weights and inputs."""
    import torch
    from ..nn.moe import MoELayer
    dt = _dtype(dtype)
    torch.manual_seed(T + 3 * H)
    layer = MoELayer(H, E, F, K, dtype=dt, recompute_permute=recompute_permute,
                     recompute_activation=recompute_activation, device=device)
    gen = torch.Generator().manual_seed(T * 3 + H)
    x = torch.randn(T, H, generator=gen).to(device=device, dtype=dt)
    g = torch.randn(T, H, generator=gen).to(device=device, dtype=dt)

    def step():
        layer.zero_grad(set_to_none=True)
        xi = x.detach().requires_grad_()
        layer(xi).backward(g)
    return step


def _ops(T, H, F, E, K, dtype, rp=False, ra=False):
    from .sim.layers import moe_layer_ops
    f, b = moe_layer_ops(T, H, F, E, K, dtype=dtype, recompute_permute=rp, recompute_activation=ra)
    return f + b


#: ``--clock``: wall seconds (the goal's figure), or this process's CPU seconds (what a shared
#: machine's time slicing does not inflate; equal to wall time for one thread on an idle core)
CLOCKS = {"wall": None, "process": time.process_time}


def calibrate_round(shapes, dtypes, min_run_time, threads, device="cpu", clock=None) -> Tuple[list, List[dict]]:
    """Time every component op at every calibration shape; returns ``(samples, rows)``."""
    from ..benchmark.timing import measure
    samples, rows = [], []
    for dtype in dtypes:
        for (T, H, F, E, K) in shapes:
            steps = component_steps(T, H, F, E, K, dtype, device)
            ops = {op.name: op for op in _ops(T, H, F, E, K, dtype)}
            for name, fn in steps.items():
                t = measure(fn, device=device, min_run_time=min_run_time, min_runs=3, warmup=1, threads=threads,
                            clock=clock)
                samples.append((ops[name], float(t)))
                rows.append(dict(op=name, shape=[T, H, F, E, K], dtype=dtype, seconds=float(t), iqr_s=t.iqr, n=t.n))
            del steps
    return samples, rows


def calibration_layers(cal, dtypes) -> list:
    """Whole layers at the calibration shapes (each dtype; the recompute options cycled through
    the shapes so the glue sees every code path): what :class:`~.sim.costs.LayerGlue` is fitted on."""
    flags = [(False, False), (True, False), (False, True), (True, True)]
    out = []
    for d, dtype in enumerate(dtypes):
        for i, shape in enumerate(cal):
            rp, ra = flags[(i + d) % len(flags)]
            out.append((*shape, dtype, rp, ra))
    return out


def _spread(xs) -> float:
    """``(max - min) / median`` of the per-round values: how much the rounds disagreed."""
    return (max(xs) - min(xs)) / statistics.median(xs) if len(xs) > 1 else 0.0


def run(out_dir: Path, *, rounds: int = 5, threads: int = 1, min_run_time: float = 0.04,
        layer_min_run_time: float = 0.2, tiny: bool = False, log=print, device: str = "cpu",
        spec: str = None, glue: bool = True, clock: str = "wall") -> dict:
    """Calibrate and validate in alternating rounds; writes ``validation.json`` (and a chart) in
    ``out_dir`` and returns the report."""
    import random
    import torch
    from .. import active_backend
    from .sim.costs import FittedCosts, LayerGlue
    from ..benchmark.timing import measure
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {', '.join(CLOCKS)}, got {clock!r}")
    if clock != "wall" and str(device) != "cpu":
        raise ValueError(f"clock={clock!r} is for device='cpu' only, got device={device!r}")
    if clock != "wall" and threads != 1:  # CPU seconds of n threads add up: no longer a wall-time proxy
        raise ValueError(f"clock={clock!r} needs threads=1, got threads={threads}")
    clk = CLOCKS[clock]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cal, val = (TINY_CALIBRATION, TINY_VALIDATION) if tiny else (CALIBRATION, VALIDATION)
    cal_keys = {tuple(c) for c in cal}
    for v in val:
        if tuple(v[:5]) in cal_keys:  # never validate on a calibration shape
            raise AssertionError(f"validation shape {v[:5]} is also a calibration shape")
    dtypes = sorted({v[5] for v in val})
    cal_layers = calibration_layers(cal, dtypes) if glue else []
    everything = list(val) + [c for c in cal_layers if c not in val]
    steps = {v: layer_step(*v, device=device) for v in everything}
    spec_costs = None
    if spec:  # an uncalibrated second model: the roofline of a public spec table
        from .hardware import load_table
        from .sim.costs import RooflineCosts
        spec_costs = RooflineCosts(load_table(spec))
    summed = {v: [] for v in everything}  # per round: the layer's ops priced by that round's fit
    meas = {v: [] for v in everything}
    fits, cal_rows = [], []
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    start = time.monotonic()
    rng = random.Random(31)
    try:
        for r in range(rounds):
            samples, rows = calibrate_round(cal, dtypes, min_run_time, threads, device, clk)
            fit = FittedCosts.fit(samples, note=f"round {r}")
            fits.append(json.loads(fit.to_json()))
            cal_rows += [dict(row, round=r) for row in rows]
            order = list(everything)
            rng.shuffle(order)  # interleaved: no layer always sits at the same point of a round
            for v in order:
                summed[v].append(sum(fit.time(op) for op in _ops(*v[:6], rp=v[6], ra=v[7])))
                t = measure(steps[v], device=device, min_run_time=layer_min_run_time, min_runs=3, warmup=1,
                            threads=threads, clock=clk)
                meas[v].append(float(t))
            log(f"round {r + 1}/{rounds} done ({time.monotonic() - start:.0f} s)")
    finally:
        torch.set_num_threads(prev)
    med = lambda xs: statistics.median(xs)  # noqa: E731
    layer_bytes = {v: sum(o.bytes for o in _ops(*v[:6], rp=v[6], ra=v[7])) for v in everything}
    # the glue's form chosen per dtype by leave-one-out over the calibration layers (never a validation one)
    glue_fit = LayerGlue.select([(v[5], med(summed[v]), layer_bytes[v], med(meas[v])) for v in cal_layers]) \
        if glue else None
    table = []
    for v in val:
        s, m = med(summed[v]), med(meas[v])
        g = glue_fit.time(v[5], layer_bytes[v], s) if glue_fit else 0.0
        p = s + g
        table.append(dict(T=v[0], H=v[1], F=v[2], E=v[3], K=v[4], dtype=v[5], recompute_permute=v[6],
                          recompute_activation=v[7], predicted_s=p, measured_s=m,
                          accuracy=1 - abs(p - m) / m, components_s=s, glue_s=g,
                          components_accuracy=1 - abs(s - m) / m,
                          measured_spread=_spread(meas[v]), predicted_spread=_spread(summed[v]),
                          components_per_round=summed[v], measured_per_round=meas[v]))
        if spec_costs is not None:
            ps = sum(spec_costs.time(op) for op in _ops(*v[:6], rp=v[6], ra=v[7]))
            table[-1].update(spec_predicted_s=ps, spec_accuracy=1 - abs(ps - m) / m)
    acc = [row["accuracy"] for row in table]
    cacc = [row["components_accuracy"] for row in table]
    report = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        machine=dict(cpu=platform.processor() or platform.machine(), cpus=os.cpu_count(), threads=threads,
                     device=str(device), gpu=torch.cuda.get_device_name(device) if str(device).startswith("cuda") else None,
                     torch=torch.__version__, load_average=os.getloadavg() if hasattr(os, "getloadavg") else None,
                     backend={op: active_backend(op, str(device).split(":")[0]) for op in
                              ("grouped_gemm", "moe_permute", "moe_unpermute")}),
        rounds=rounds, clock=clock, seconds=time.monotonic() - start, calibration_shapes=cal, validation=table,
        mean_accuracy=statistics.mean(acc), worst_accuracy=min(acc),
        components_mean_accuracy=statistics.mean(cacc), components_worst_accuracy=min(cacc),
        mean_measured_spread=statistics.mean(r["measured_spread"] for r in table),
        glue=glue_fit.coefs if glue_fit else None,
        glue_forms=glue_fit.forms if glue_fit else None, glue_loo=glue_fit.loo if glue_fit else None,
        calibration_layers=[dict(T=c[0], H=c[1], F=c[2], E=c[3], K=c[4], dtype=c[5], recompute_permute=c[6],
                                 recompute_activation=c[7], components_s=med(summed[c]), measured_s=med(meas[c]),
                                 measured_spread=_spread(meas[c])) for c in cal_layers],
        fits=fits, calibration=cal_rows,
        note="predicted_s is a model: the median over rounds of the layer's ops priced by each round's fit "
             "to the component microbenchmarks (components_s), plus the per-dtype layer glue "
             "g0 + g2*bytes + gs*components in the form (glue_forms) chosen by leave-one-out over the whole "
             "layers at the calibration shapes and fitted on them (glue_s); measured_s is the median over "
             "rounds of nn.MoELayer fwd+bwd timed by the harness; measured_spread is (max - min) / median "
             "over the rounds"
             + (f"; spec_predicted_s is a second, uncalibrated model: {spec_costs.label}" if spec_costs else ""))
    if spec_costs is not None:
        sacc = [row["spec_accuracy"] for row in table]
        report.update(spec=spec_costs.describe(), spec_mean_accuracy=statistics.mean(sacc),
                      spec_worst_accuracy=min(sacc))
    (out_dir / "validation.json").write_text(json.dumps(report, indent=1))
    _chart(table, out_dir / "validation.png", report)
    return report


def _chart(table, path, report) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 6))
    xs = [r["measured_s"] * 1e3 for r in table]
    ys = [r["predicted_s"] * 1e3 for r in table]
    ax.scatter(xs, ys)
    lo, hi = min(xs + ys) * 0.9, max(xs + ys) * 1.1
    ax.plot([lo, hi], [lo, hi], "k--", lw=1, label="predicted = measured")
    ax.fill_between([lo, hi], [lo * 0.9, hi * 0.9], [lo * 1.1, hi * 1.1], alpha=0.15, label="±10 %")
    for r, x, y in zip(table, xs, ys):
        ax.annotate(f"T{r['T']} H{r['H']} E{r['E']} K{r['K']} {r['dtype'][:4]}", (x, y), fontsize=6)
    ax.set_xlabel("measured fwd+bwd (ms)")
    ax.set_ylabel("predicted fwd+bwd (ms, model)")
    ax.set_title(f"MoE layer: model vs measurement, mean acc {100 * report['mean_accuracy']:.1f} %, "
                 f"worst {100 * report['worst_accuracy']:.1f} %", fontsize=9)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def format_table(report: dict) -> str:
    lines = ["| T | H | F | E | K | dtype | recompute | components ms (model) | + glue ms (model) | "
             "predicted ms (model) | measured ms | spread over rounds | accuracy |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["validation"]:
        rc = "+".join(n for n, on in (("permute", r["recompute_permute"]), ("activation", r["recompute_activation"])) if on) or "-"
        lines.append(f"| {r['T']} | {r['H']} | {r['F']} | {r['E']} | {r['K']} | {r['dtype']} | {rc} | "
                     f"{1e3 * r['components_s']:.2f} | {1e3 * r['glue_s']:+.2f} | "
                     f"{1e3 * r['predicted_s']:.2f} | {1e3 * r['measured_s']:.2f} | "
                     f"{100 * r['measured_spread']:.0f} % | {100 * r['accuracy']:.1f} % |")
    if "spec" in report:
        lines.append("\nuncalibrated spec-table roofline (model, " + report["spec"]["label"] + "): "
                     + ", ".join(f"{1e3 * r['spec_predicted_s']:.2f} ms ({100 * r['spec_accuracy']:.0f} %)"
                                 for r in report["validation"])
                     + f"; mean {100 * report['spec_mean_accuracy']:.1f} %, worst {100 * report['spec_worst_accuracy']:.1f} %")
    if report.get("glue_forms"):
        lines.append("\nlayer glue per dtype (form chosen by leave-one-out over the calibration layers; "
                     "leave-one-out mean accuracy of each form): "
                     + "; ".join(f"{d}: {f} (" + ", ".join(f"{k} {100 * v:.1f} %" for k, v in report["glue_loo"][d].items())
                                 + ")" for d, f in sorted(report["glue_forms"].items())))
    lines.append(f"\nmean accuracy {100 * report['mean_accuracy']:.1f} %, worst {100 * report['worst_accuracy']:.1f} % "
                 f"(components only: {100 * report['components_mean_accuracy']:.1f} % / "
                 f"{100 * report['components_worst_accuracy']:.1f} %; mean spread of the measurements over "
                 f"rounds {100 * report['mean_measured_spread']:.0f} %; {report.get('clock', 'wall')} clock; "
                 f"{report['rounds']} rounds, "
                 f"{report['machine']['threads']} thread(s), {report['seconds']:.0f} s)")
    return "\n".join(lines)


def _device(text: str) -> str:
    """argparse type of --device: cpu, cuda[:N] or npu[:N] (the timing clocks' devices; the spelling
    is checked at parse time, whether the device is there by torch when the run starts)."""
    kind, colon, index = text.partition(":")
    if text == "cpu" or (kind in ("cuda", "npu") and (not colon or index.isdigit())):
        return text
    raise argparse.ArgumentTypeError(f"must be cpu, cuda, cuda:N, npu or npu:N, got {text!r}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=_cli.output_dir, help="folder for validation.json and validation.png")
    ap.add_argument("--rounds", type=_cli.positive_int, default=5, help="calibrate/validate rounds (default 5)")
    ap.add_argument("--threads", type=_cli.positive_int, default=1, help="torch threads (default 1)")
    ap.add_argument("--min-run-time", type=_cli.positive_float, default=0.04,
                    help="seconds per component microbenchmark")
    ap.add_argument("--layer-min-run-time", type=_cli.positive_float, default=0.2,
                    help="seconds per layer measurement")
    ap.add_argument("--clock", default="wall", choices=sorted(CLOCKS),
                    help="wall (default: the goal's figure) or process (CPU seconds of this process: "
                         "robust to other jobs on a shared machine; CPU only)")
    ap.add_argument("--no-glue", action="store_true",
                    help="components only: no layer-glue term (and no whole layers at calibration shapes)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes: checks the plumbing in seconds")
    ap.add_argument("--device", default="cpu", type=_device,
                    help="cpu (default), cuda (cuda:N) or npu (npu:N): where the ops and the layer run")
    ap.add_argument("--spec", default=None,
                    help="also predict from this hardware table's roofline, uncalibrated (e.g. h200 on an H200)")
    ap.add_argument("--no-ep", action="store_true",
                    help="skip the emulated two-node EP layer (it needs root for network namespaces)")
    ap.add_argument("--ep-rounds", type=_cli.positive_int, default=3,
                    help="calibrate/validate rounds of the EP part (default 3)")
    a = ap.parse_args(argv)
    if a.clock != "wall" and a.device != "cpu":
        ap.error(f"argument --clock: {a.clock} is for --device cpu only, got --device {a.device}")
    if a.clock != "wall" and a.threads != 1:  # the process clock sums every thread's CPU time
        ap.error(f"argument --clock: {a.clock} needs --threads 1, got --threads {a.threads}")
    if a.spec:
        from .hardware import load_table
        try:
            load_table(a.spec)
        except (ValueError, OSError) as exc:  # TableError is a ValueError
            ap.error(f"argument --spec: {exc}")
    import warnings
    warnings.filterwarnings("ignore", message=".*runs the reference backend.*")
    rep = run(Path(a.out), rounds=a.rounds, threads=a.threads, min_run_time=a.min_run_time,
              layer_min_run_time=a.layer_min_run_time, tiny=a.tiny, device=a.device, spec=a.spec,
              glue=not a.no_glue, clock=a.clock,
              log=lambda s: print(s, file=sys.stderr, flush=True))
    print(format_table(rep))
    if not (a.no_ep or a.tiny or a.device != "cpu"):
        from .validate_ep import format_ep_table, run_ep
        rep["ep"] = run_ep(rounds=a.ep_rounds, log=lambda s: print(s, file=sys.stderr, flush=True))
        rep["ep"].pop("raw", None)
        print()
        print(format_ep_table(rep["ep"]))
        (Path(a.out) / "validation.json").write_text(json.dumps(rep, indent=1))
    print(f"wrote {Path(a.out) / 'validation.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
