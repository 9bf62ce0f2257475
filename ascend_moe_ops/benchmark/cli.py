"""Command line of the benchmark + parity report (``python -m ascend_moe_ops.bench``)."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
from pathlib import Path
from typing import List, Optional

import torch

from .. import _cli
from . import chart, report
from .rows import evaluate, row_record
from .runner import PRESETS, Context, available_ops, resolve_ops, run_modules

EPILOG = """\
examples:
  python -m ascend_moe_ops.bench                          # quick preset, every op, CPU
  python -m ascend_moe_ops.bench --preset pangu --ops moe_permute grouped_gemm
  python -m ascend_moe_ops.bench --tokens 2048 --hidden 4096 --threads 2 --backend native
  python -m ascend_moe_ops.bench --ops moe_permute --shape T=4096,H=7680,E=256,K=8
  python -m ascend_moe_ops.bench --ops grouped_gemm --gemm-shape E=256,M=16384,K=512,N=256
  python -m ascend_moe_ops.bench --ops grouped_gemm --gemm-shape E=32,M=8192,K=2048,N=1408,sizes=zipf
  python -m ascend_moe_ops.bench --compare amo-bench/bench-20261201-220000.json --threshold 0.1

exit status: 0 ok; 1 a module failed or a parity check failed; 2 bad arguments or device absent;
3 a row is slower than the --compare baseline by more than --threshold.
"""


def device_problem(name: str) -> Optional[str]:
    """Why ``--device name`` cannot run here, or None."""
    if name == "cpu":
        return None
    if name == "cuda":
        if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
            return f"--device cuda: this torch ({torch.__version__}) is a CPU build without CUDA"
        if not torch.cuda.is_available():
            return "--device cuda: torch has CUDA support but no GPU is visible (torch.cuda.is_available() is False)"
        return None
    if name == "npu":
        npu = getattr(torch, "npu", None)
        if npu is None:
            return ("--device npu: torch_npu is not installed (no Ascend NPU support); "
                    "docs/ascend.md says how to build for a CANN machine")
        try:
            if not npu.is_available():
                return "--device npu: torch_npu is installed but no NPU is visible"
        except Exception as exc:  # driver / runtime errors
            return f"--device npu: torch_npu cannot reach an NPU ({type(exc).__name__}: {exc})"
        return None
    return f"--device {name}: unknown device (cpu, cuda, npu)"


#: keys of ``--shape`` (the permute / unpermute / MoE layer cases; same as the per-dim flags)
SHAPE_KEYS = {"T": "tokens", "H": "hidden", "E": "experts", "K": "topk", "F": "ffn"}
#: keys of ``--gemm-shape`` (one grouped GEMM case: E groups, M total rows, K x N per group)
GEMM_KEYS = ("E", "M", "K", "N")
GEMM_SIZES = ("balanced", "zipf")


def parse_kv(text: str, flag: str, int_keys, str_keys=None) -> dict:
    """``"A=1,B=2"`` -> ``{"A": 1, "B": 2}``; ValueError naming ``flag`` and the valid keys on a
    bad item. ``str_keys``: {key: allowed values} for non-integer keys."""
    str_keys = str_keys or {}
    valid = list(int_keys) + list(str_keys)
    out = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, eq, val = item.partition("=")
        key, val = key.strip(), val.strip()
        if not eq or key not in valid:
            raise ValueError(f"{flag}: bad item {item!r}; expected KEY=VALUE with KEY in {', '.join(valid)}")
        if key in out:
            raise ValueError(f"{flag}: {key} given twice")
        if key in str_keys:
            if val not in str_keys[key]:
                raise ValueError(f"{flag}: {key} must be one of {', '.join(str_keys[key])}, got {val!r}")
            out[key] = val
            continue
        try:
            out[key] = int(val)
        except ValueError:
            raise ValueError(f"{flag}: {key} must be an integer, got {val!r}") from None
        if out[key] < 1:
            raise ValueError(f"{flag}: {key} must be >= 1, got {out[key]}")
    if not out:
        raise ValueError(f"{flag}: empty; expected KEY=VALUE[,KEY=VALUE...] with KEY in {', '.join(valid)}")
    return out


def parse_gemm_shape(text: str) -> dict:
    """One ``--gemm-shape`` value -> {"E", "M", "K", "N", "sizes"} (sizes defaults to balanced)."""
    d = parse_kv(text, "--gemm-shape", GEMM_KEYS, {"sizes": GEMM_SIZES})
    missing = [k for k in GEMM_KEYS if k not in d]
    if missing:
        raise ValueError(f"--gemm-shape {text!r}: missing {', '.join(missing)} (need E, M, K and N)")
    d.setdefault("sizes", "balanced")
    return d


#: backend labels of the peer rows (the comparisons with other projects), besides the package's own
PEER_BACKENDS = ("integrations.megatron", "megatron-core MoELayer", "patched")


def backend_names() -> tuple:
    """The names ``--backend`` accepts: the package's backends, then the peer rows' labels."""
    from .. import _backends
    return tuple(_backends.BACKENDS) + PEER_BACKENDS


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m ascend_moe_ops.bench",
                                 description="Benchmark + parity report of ascend_moe_ops on this machine: "
                                 "median time with IQR and run count, rates, % of limits measured in the "
                                 "same run, speed-up vs peers; JSON and a PNG chart in --out.",
                                 epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--list", action="store_true", help="list the ops that have benchmarks and exit")
    ap.add_argument("--ops", nargs="+", metavar="OP", help="ops to run (default: all; see --list)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="quick",
                    help="shape preset: " + "; ".join(f"{k}: " + " ".join(f"{a}={b}" for a, b in v.items())
                                                      for k, v in PRESETS.items()))
    ap.add_argument("--full", action="store_true", help="same as --preset pangu (issue-sized shapes)")
    for flag, key, what in (("--tokens", "T", "tokens T"), ("--hidden", "H", "hidden size H"),
                            ("--experts", "E", "experts E"), ("--topk", "K", "experts per token K"),
                            ("--ffn", "F", "expert FFN hidden F")):
        ap.add_argument(flag, type=_cli.positive_int, dest=key, metavar="N",
                        help=f"override the preset's {what} (permute/unpermute cases)")
    ap.add_argument("--shape", metavar="T=..,H=..,E=..,K=..,F=..",
                    help="the same overrides in one flag, e.g. T=4096,H=7680,E=256,K=8 (a per-dim flag, "
                    "if also given, wins)")
    ap.add_argument("--gemm-shape", action="append", metavar="E=..,M=..,K=..,N=..[,sizes=balanced|zipf]",
                    help="grouped GEMM case instead of the preset's three: E groups, M rows in all, "
                    "x [M,K] times E weights [K,N]; sizes=balanced (M/E rows each, the default) or zipf "
                    "(Zipf-skewed, alpha 1.2). Repeat the flag for several cases.")
    ap.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16",
                    help="dtype of the permute / grouped GEMM cases (default bf16)")
    ap.add_argument("--threads", type=_cli.positive_int, default=None,
                    help="torch threads, pinned for every measurement (default: torch's current count)")
    ap.add_argument("--backend", nargs="+", metavar="NAME",
                    help="time only these backends: " + ", ".join(backend_names()))
    ap.add_argument("--device", default=None,
                    help="cpu, cuda or npu (default: cuda when a GPU is visible, else cpu)")
    ap.add_argument("--min-run-time", type=_cli.positive_float, default=0.2,
                    help="seconds (finite, > 0) of runs per measurement (torch.utils.benchmark blocked_autorange)")
    ap.add_argument("--no-parity", action="store_true", help="skip the parity checks")
    ap.add_argument("--out", default=None, help="folder for JSON and PNG (default ./amo-bench)")
    ap.add_argument("--a2-model", action="store_true",
                    help="also print the 'A2 (model)' table: every AscendC kernel at this preset's shapes, "
                    "run on the emulator and scheduled on the Atlas A2 timeline model (a MODEL, not a "
                    "measurement; ascend_moe_ops.perfmodel.a2_bench; quick and pangu presets)")
    ap.add_argument("--compare", metavar="BASELINE.json", help="JSON of an earlier run to compare with")
    ap.add_argument("--threshold", type=_cli.non_negative_float, default=0.1,
                    help="with --compare: fail (exit 3) when a row is slower by more than this (0.1 = 10%%)")
    args = ap.parse_args(argv)
    if args.shape is not None:
        try:
            kv = parse_kv(args.shape, "--shape", SHAPE_KEYS)
        except ValueError as exc:
            ap.error(str(exc))
        for key, v in kv.items():
            if getattr(args, key) is None:
                setattr(args, key, v)
    try:
        args.gemm_shapes = [parse_gemm_shape(g) for g in args.gemm_shape or []]
    except ValueError as exc:
        ap.error(str(exc))
    if args.full:
        args.preset = "pangu"
    for key in ("T", "H", "E", "K", "F"):
        v = getattr(args, key)
        if v is not None and v < 1:
            ap.error(f"--{dict(T='tokens', H='hidden', E='experts', K='topk', F='ffn')[key]} must be >= 1")
    if args.backend:
        bad = [b for b in args.backend if b not in backend_names()]
        if bad:
            ap.error(f"--backend: unknown backend {', '.join(map(repr, bad))}; "
                     f"valid: {', '.join(backend_names())}")
    if args.compare and not Path(args.compare).is_file():
        ap.error(f"--compare: no such file {args.compare}")
    try:
        args.modules = resolve_ops(args.ops)
    except ValueError as exc:
        ap.error(f"--ops: {exc}")
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    why = device_problem(args.device)
    if why and not args.list:
        ap.error(why)
    shape = {k: getattr(args, k) for k in ("T", "H", "E", "K", "F") if getattr(args, k) is not None}
    merged = dict(PRESETS[args.preset], **shape)
    if merged["K"] > merged["E"]:
        ap.error(f"--topk ({merged['K']}) must be <= --experts ({merged['E']})")
    args.shape = shape
    return args


def _out_dir(args) -> Path:
    out = Path(args.out) if args.out else Path.cwd() / "amo-bench"
    import ascend_moe_ops
    pkg = Path(ascend_moe_ops.__file__).resolve().parent
    if args.out is None and (out.resolve() == pkg or pkg in out.resolve().parents):
        raise SystemExit("refusing to write results inside the installed package; pass --out")
    return out


def _a2_model(preset: str):
    """The 'A2 (model)' table of every AscendC kernel at ``preset`` (printed; returned for the JSON)."""
    from ..perfmodel import a2_bench
    if preset not in a2_bench.PRESETS:
        print(f"\nA2 (model): no AscendC kernel cases for preset {preset!r} "
              f"(have: {', '.join(sorted(a2_bench.PRESETS))})")
        return None
    try:
        res = a2_bench.run(preset, log=lambda *_: None)
    except RuntimeError as exc:  # the emulated kernels are not built
        print(f"\nA2 (model): skipped, {exc}")
        return None
    models = [m for _, _, m in res]
    print("\n" + a2_bench.format_table(models, f"A2 (model): AscendC kernels at preset {preset}"))
    return {"label": "A2 (model), table a2 v" + (models[0].table_version if models else "?"),
            "models": [m.to_json() for m in models]}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.list:
        ops = available_ops()
        width = max(map(len, ops))
        print("ops with benchmarks (python -m ascend_moe_ops.bench --ops NAME ...):")
        for name, doc in ops.items():
            print(f"  {name:<{width}}  {doc}")
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    ctx = Context(args.device, preset=args.preset, shape=args.shape, dtype=dtype,
                  backends=args.backend, threads=threads, min_run_time=args.min_run_time,
                  gemm_shapes=args.gemm_shapes or None)
    env = report.environment(ctx.device, threads)
    started = _dt.datetime.now(_dt.timezone.utc)
    print(f"ascend_moe_ops {env['version']} benchmark + parity report, preset {args.preset} "
          f"{ctx.shape}, {started:%Y-%m-%d %H:%M} UTC")
    for k in ("git_commit", "torch", "cpu", "threads", "device"):
        print(f"  {k}: {env[k]}")

    records: List[dict] = []

    def on_rows(rows):  # limits of a module's rows are measured right after that module
        for r in rows:
            records.append(row_record(r, evaluate(r, ctx.machine)))

    res = run_modules(ctx, args.modules, with_parity=not args.no_parity, on_rows=on_rows)
    if res.parity:
        print("\nparity vs fp64 reference (max abs error, bound from ascend_moe_ops.testing):")
        for p in res.parity:
            print(f"  {'ok  ' if p.ok else 'FAIL'} {p.op:<22} {p.case:<34} {p.backend:<12} {p.dtype:<9} "
                  f"err {p.max_err:.3e}  bound {p.bound:.3e}")
    print()
    print(report.format_table(records))
    warns = report.noise_warnings(records)
    if warns:
        print("\nWARNING: noisy measurements (the machine may be busy; ratios within a run are still "
              "comparable, absolute numbers less so):")
        for w in warns:
            print(f"  {w}")
    for name in res.failures:
        print(f"\nmodule {name} FAILED (traceback above on stderr)")
    a2 = _a2_model(args.preset) if args.a2_model else None

    out = _out_dir(args)
    out.mkdir(parents=True, exist_ok=True)
    stamp = started.strftime("%Y%m%d-%H%M%S")
    payload = {
        "schema": 2, "started_utc": started.isoformat(timespec="seconds"), "environment": env,
        "preset": args.preset, "shape": ctx.shape, "gemm_shapes": args.gemm_shapes, "dtype": args.dtype, "backends": args.backend,
        "min_run_time_s": args.min_run_time,
        "timer": "torch.utils.benchmark.Timer (blocked_autorange), threads pinned",
        "limits": ctx.machine.describe(), "rows": records,
        "parity": [dict(vars(p), ok=p.ok) for p in res.parity],
        "failed_modules": sorted(res.failures), "noise_warnings": warns,
    }
    if a2 is not None:
        payload["a2_model"] = a2
    jpath = out / f"bench-{stamp}.json"
    jpath.write_text(json.dumps(payload, indent=1, default=str))
    ppath = out / f"bench-{stamp}.png"
    why = chart.render(records, ppath, f"ascend_moe_ops {env['version']} on {env['cpu']} "
                       f"({threads} threads), preset {args.preset}, {started:%Y-%m-%d}")
    print(f"\nwrote {jpath}" + (f" and {ppath}" if why is None else f" ({why})"))
    rc = 1 if res.failures or any(not p.ok for p in res.parity) else 0
    if args.compare:
        text, regress = report.compare(records, args.compare, args.threshold)
        print("\n" + text)
        if regress:
            print(f"\n{len(regress)} row(s) slower than the baseline by more than "
                  f"{100 * args.threshold:.0f}%")
            rc = rc or 3
    return rc


if __name__ == "__main__":
    sys.exit(main())
