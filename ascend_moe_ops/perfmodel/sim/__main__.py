"""``python -m ascend_moe_ops.perfmodel.sim``: simulate a plan (or search plans) and write JSON + PNG.

Examples::

    python -m ascend_moe_ops.perfmodel.sim --cluster a2 --tp 8 --pp 16 --vpp 2 --ep 4 --dp 48 \\
        --microbatches 32 --recompute selective --out results/sim
    python -m ascend_moe_ops.perfmodel.sim --cluster h100 --search --devices 1024 --global-batch 1024
    python -m ascend_moe_ops.perfmodel.sim --audit --peak-tflops 313

Every figure printed is a model, labelled with the hardware table it came from.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _chart(result, path: Path, title: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    ev = result.timeline
    fig, ax = plt.subplots(figsize=(11, 0.35 * result.plan.pp + 1.8))
    colors = {"F": "#4c72b0", "B": "#dd8452"}
    for e in ev:
        ax.barh(e["stage"], e["end"] - e["start"], left=e["start"], color=colors[e["kind"]],
                edgecolor="white", linewidth=0.3, alpha=0.6 + 0.4 * (e["chunk"] % 2))
    ax.set_yticks(range(result.plan.pp))
    ax.set_yticklabels([f"stage {s}" for s in range(result.plan.pp)], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("seconds (model)")
    ax.set_title(title, fontsize=9)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main(argv=None) -> int:
    from .audit import audit, format_audit
    from .clusters import a2_cluster, gpu_cluster
    from .model import CONVENTIONS, PANGU_ULTRA_MOE, ModelSpec
    from ... import _cli
    from .step import SEARCH_PP, SEARCH_TP, Plan, layouts, search, simulate
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cluster", default="a2", choices=("h100", "h200", "a2"),
                    help="h100, h200 or a2 (needs the a2 and cluster_a2 tables)")
    ap.add_argument("--chip-table", default="", type=lambda t: t and _cli.existing_file(t),
                    help="A2 chip table JSON (default: the shipped 'a2'); with --cluster a2 only")
    ap.add_argument("--model", default="pangu", help="'pangu' or a JSON file of ModelSpec fields")
    for k, d in (("tp", 8), ("pp", 16), ("vpp", 2), ("ep", 4), ("dp", 48), ("micro-batch", 1), ("microbatches", 32)):
        ap.add_argument(f"--{k}", type=_cli.positive_int, default=d)
    ap.add_argument("--recompute", default="selective", choices=("none", "selective", "full"))
    ap.add_argument("--swap", default="none", choices=("none", "activations"))
    ap.add_argument("--no-overlap", action="store_true")
    ap.add_argument("--a2a", default="hierarchical", choices=("flat", "hierarchical", "allgather"))
    ap.add_argument("--imbalance", type=_cli.finite_float, default=1.0,
                    help="busiest device's expert load / mean (>= 1)")
    ap.add_argument("--convention", default="6N+attn", choices=list(CONVENTIONS))
    ap.add_argument("--search", action="store_true", help="rank plans for --devices and --global-batch")
    ap.add_argument("--devices", type=_cli.positive_int, default=6144)
    ap.add_argument("--global-batch", type=_cli.positive_int, default=1536, help="sequences per step")
    ap.add_argument("--audit", action="store_true", help="the MFU audit of the report's figures")
    ap.add_argument("--peak-tflops", type=_cli.non_negative_float, default=0.0,
                    help="peak for --audit (default: the cluster's)")
    ap.add_argument("--out", default="", type=lambda t: t and _cli.output_dir(t),
                    help="folder for sim.json and sim.png (search.json with --search)")
    a = ap.parse_args(argv)
    if a.imbalance < 1:
        ap.error(f"argument --imbalance: must be >= 1 (busiest device / mean load), got {a.imbalance:g}")
    chip = None
    if a.chip_table:
        if a.cluster != "a2":
            ap.error(f"argument --chip-table: applies to --cluster a2 only (the GPU clusters use their own "
                     f"table), got --cluster {a.cluster}")
        from ..hardware import load_table
        from .clusters import CHIP_KEYS
        try:
            chip = load_table(a.chip_table).require(CHIP_KEYS, "the A2 cluster's chip")
        except (ValueError, OSError) as exc:  # TableError is a ValueError
            ap.error(f"argument --chip-table: {exc}")
    if a.model == "pangu":
        model = PANGU_ULTRA_MOE
    else:
        if not Path(a.model).is_file():
            ap.error(f"argument --model: 'pangu' or a JSON file of ModelSpec fields; no such file {a.model!r}")
        try:
            model = ModelSpec(**json.loads(Path(a.model).read_text()))
        except (ValueError, TypeError) as exc:  # bad JSON, unknown or bad fields
            ap.error(f"argument --model: {a.model}: {exc}")
    if a.search and not layouts(a.devices, a.global_batch, a.micro_batch):
        ap.error(f"--search: no plan for --devices {a.devices} and --global-batch {a.global_batch}: no "
                 f"tp in {SEARCH_TP} x pp in {SEARCH_PP} divides the devices with the data-parallel size "
                 f"dp = devices / (tp * pp) times --micro-batch {a.micro_batch} dividing the global batch")
    if a.audit and a.peak_tflops:
        peak = a.peak_tflops * 1e12
        print(format_audit(audit(model, peak), peak))
        return 0
    if a.cluster in ("h100", "h200"):
        cluster = gpu_cluster(a.cluster)
    elif a.cluster == "a2":
        cluster = a2_cluster(chip)
    else:  # unreachable: argparse's choices
        ap.error(f"--cluster must be h100, h200 or a2, got {a.cluster!r}")
    if a.audit:
        peak = cluster.costs.peak_flops("bfloat16")
        print(format_audit(audit(model, peak), peak))
        return 0
    out = Path(a.out) if a.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    print(f"cluster: {cluster.name}\ncosts: {cluster.costs.label}")
    if a.search:
        ranked = search(model, cluster, a.devices, a.global_batch, micro_batch=a.micro_batch,
                        overlap=not a.no_overlap, imbalance=a.imbalance, convention=a.convention)
        if not ranked:
            print(f"no plan for --devices {a.devices} and --global-batch {a.global_batch} fits in device "
                  f"memory (model) or is valid (ep must divide tp*dp; with vpp > 1 the microbatches must be "
                  f"a multiple of pp; every recompute mode was tried): try more devices or a smaller --micro-batch",
                  file=sys.stderr)
            return 1
        print(f"| rank | plan | step s (model) | tokens/s (model) | MFU {a.convention} (model) | memory GiB (model) |")
        print("|---|---|---|---|---|---|")
        for i, r in enumerate(ranked):
            print(f"| {i + 1} | {r.plan.label()} | {r.step_s:.3f} | {r.tokens_per_s:,.0f} | "
                  f"{100 * r.mfu[a.convention]:.1f} % | {r.memory['total'] / 2**30:.1f} |")
        if out:
            (out / "search.json").write_text(json.dumps([r.as_dict(timeline=False) for r in ranked], indent=1))
        return 0
    try:
        plan = Plan(tp=a.tp, pp=a.pp, vpp=a.vpp, ep=a.ep, dp=a.dp, micro_batch=a.micro_batch,
                    num_microbatches=a.microbatches, recompute=a.recompute, swap=a.swap,
                    overlap=not a.no_overlap, a2a=a.a2a, imbalance=a.imbalance)
    except ValueError as exc:
        ap.error(str(exc))
    try:
        r = simulate(model, cluster, plan, convention=a.convention)
    except ValueError as exc:  # the plan does not suit the model (e.g. ep not dividing the experts)
        ap.error(str(exc))
    print(f"plan: {plan.label()} on {plan.world} devices")
    print(f"step time (model): {r.step_s:.3f} s; tokens/s (model): {r.tokens_per_s:,.0f}; "
          f"pipeline bubble (model): {100 * r.breakdown['bubble_fraction']:.1f} %")
    for name in CONVENTIONS:
        print(f"MFU {name} (model): {100 * r.mfu[name]:.1f} %   [{r.mfu_formula[name]}]")
    print("memory per device (model, GiB): " + ", ".join(
        f"{k} {v / 2**30:.1f}" for k, v in r.memory.items() if k not in ("in_flight_chunks",)))
    print("traffic per device per step (model, GB): " + ", ".join(
        f"{k} {v / 1e9:.2f}" for k, v in r.traffic.items() if k.endswith("bytes")))
    for n in r.notes:
        print("note:", n)
    if out:
        d = r.as_dict()
        d.update(cluster=cluster.name, costs=cluster.costs.describe(), model=model.__dict__)
        (out / "sim.json").write_text(json.dumps(d, indent=1))
        _chart(r, out / "sim.png", f"{model.name}, {plan.label()} (model): step {r.step_s:.2f} s")
        print(f"wrote {out / 'sim.json'} and {out / 'sim.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
