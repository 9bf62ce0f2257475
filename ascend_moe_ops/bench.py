"""Benchmark + parity report: the package's main job.

    python -m ascend_moe_ops.bench            # quick (about a minute on 2 CPU cores)
    python -m ascend_moe_ops.bench --full     # the issue-sized shapes
    python -m ascend_moe_ops.bench --ops moe_permute grouped_gemm

It measures the machine's limits in the same run (memory copy bandwidth with ``dst.copy_(src)`` on
a buffer far larger than the caches; dense ``torch.mm`` FLOP/s per dtype), runs every
``bench/bench_<op>.py`` module's ``run(ctx)`` (and ``parity(ctx)`` where defined), and prints one
table: time, achieved GB/s or TFLOP/s (formula next to it), % of the measured machine limit and
speed-up against each peer timed in the same process. JSON and a PNG chart go to ``--out``.

A bench module writes ``def run(ctx) -> list[Row]``; ``ctx.time(fn)`` gives a median time.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

REPO = Path(__file__).resolve().parents[1]
BENCH_DIR = REPO / "bench"


@dataclasses.dataclass
class Row:
    op: str
    case: str
    backend: str
    dtype: str
    seconds: float
    bytes: Optional[int] = None
    flops: Optional[int] = None
    formula: str = ""
    limit: str = "bandwidth"  # or "flops"
    peers: Dict[str, float] = dataclasses.field(default_factory=dict)
    extra: Dict[str, object] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class ParityRow:
    op: str
    case: str
    backend: str
    dtype: str
    max_err: float
    bound: float

    @property
    def ok(self) -> bool:
        return self.max_err <= self.bound


def parity_row(op: str, case: str, backend: str, out: torch.Tensor, ref64: torch.Tensor,
               lowp: Optional[torch.Tensor] = None) -> ParityRow:
    """Max error of ``out`` vs the fp64 reference and the bound the tests use (see
    ``ascend_moe_ops.testing``): ``ERROR_FACTOR * err(lowp) + atol + rtol * max|ref|``."""
    from .testing import ERROR_FACTOR, TOLERANCES, max_abs_err
    atol, rtol = TOLERANCES[out.dtype] if out.dtype in TOLERANCES else (0.0, 0.0)
    bound = atol + rtol * (ref64.abs().max().item() if ref64.numel() else 0.0)
    if lowp is not None:
        bound += ERROR_FACTOR * max_abs_err(lowp, ref64)
    if not out.dtype.is_floating_point:  # index outputs: exact
        bound = 0.0
    return ParityRow(op, case, backend, str(out.dtype).replace("torch.", ""), max_abs_err(out, ref64), bound)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn: Callable[[], object], device: torch.device, min_time: float = 0.2,
            min_iters: int = 3, max_iters: int = 200, warmup: int = 2) -> float:
    """Median wall time of ``fn()`` after ``warmup`` calls, repeated until ``min_time`` passes."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times: List[float] = []
    start = time.perf_counter()
    while len(times) < min_iters or (time.perf_counter() - start < min_time and len(times) < max_iters):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class Machine:
    """Limits of this machine, measured in this process."""

    def __init__(self, device: torch.device, quick: bool):
        self.device = device
        self.quick = quick
        self._mm: Dict[torch.dtype, float] = {}
        n = 256 * 2**20 // 4  # fp32 elements: 256 MiB buffers, far beyond the last-level cache
        src = torch.randn(n, device=device)
        dst = torch.empty_like(src)
        t = time_fn(lambda: dst.copy_(src), device, min_time=0.3, warmup=2)
        #: bytes moved by a copy: one read + one write of the buffer
        self.copy_gbps = 2 * src.numel() * 4 / t / 1e9
        self.copy_formula = f"2 x {n * 4 / 2**20:.0f} MiB / t (dst.copy_(src), dst preallocated)"
        # The same copy into a freshly allocated tensor, as every op that returns a new tensor
        # must do: on machines where first-touch page faults are expensive (VMs, CPUs without a
        # caching allocator) this is the realistic ceiling for such an op.
        del dst
        t = time_fn(lambda: torch.empty_like(src).copy_(src), device, min_time=0.3, warmup=2)
        self.alloc_copy_gbps = 2 * src.numel() * 4 / t / 1e9

    def mm_tflops(self, dtype: torch.dtype = torch.bfloat16) -> float:
        """Dense ``torch.mm`` throughput for square problems (2048 quick, 4096 full)."""
        if dtype not in self._mm:
            n = 2048 if (self.quick or self.device.type == "cpu") else 8192
            a = torch.randn(n, n, device=self.device).to(dtype)
            b = torch.randn(n, n, device=self.device).to(dtype)
            t = time_fn(lambda: torch.mm(a, b), self.device, min_time=0.5)
            self._mm[dtype] = 2 * n**3 / t / 1e12
        return self._mm[dtype]

    def describe(self) -> Dict[str, object]:
        info = {
            "device": str(self.device),
            "cpu": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "copy_GBps": round(self.copy_gbps, 2),
            "copy_formula": self.copy_formula,
            "alloc_copy_GBps": round(self.alloc_copy_gbps, 2),
            "mm_TFLOPs": {str(k).replace("torch.", ""): round(v, 4) for k, v in self._mm.items()},
        }
        if self.device.type == "cuda":
            info["gpu"] = torch.cuda.get_device_name(self.device)
        try:
            with open("/proc/cpuinfo") as f:
                for line in f:
                    if line.startswith("model name"):
                        info["cpu"] = line.split(":", 1)[1].strip()
                        break
        except OSError:
            pass
        return info


class Context:
    def __init__(self, device: torch.device, quick: bool):
        self.device = device
        self.quick = quick
        self.machine = Machine(device, quick)

    def time(self, fn: Callable[[], object], min_time: float = 0.2, **kw) -> float:
        return time_fn(fn, self.device, min_time=min_time, **kw)


def _load_module(path: Path):
    spec = importlib.util.spec_from_file_location(f"amo_bench_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(path.parent))
    return mod


def _rate(row: Row, machine: Machine):
    """(value, unit, % of machine limit, % of the allocating copy for bandwidth rows)."""
    if row.limit == "flops" and row.flops:
        tf = row.flops / row.seconds / 1e12
        lim = machine.mm_tflops(getattr(torch, row.dtype, torch.float32))
        return tf, "TFLOP/s", 100 * tf / lim, None
    if row.bytes:
        gb = row.bytes / row.seconds / 1e9
        return gb, "GB/s", 100 * gb / machine.copy_gbps, 100 * gb / machine.alloc_copy_gbps
    return None, "", None, None


def format_table(rows: List[Row], machine: Machine) -> str:
    head = ["op", "case", "backend", "dtype", "time ms", "rate", "% limit", "% alloc-copy",
            "speed-up vs peers"]
    lines = []
    for r in rows:
        val, unit, pct, pct_alloc = _rate(r, machine)
        peers = ", ".join(f"{name} {t / r.seconds:.2f}x" for name, t in r.peers.items())
        lines.append([r.op, r.case, r.backend, r.dtype, f"{r.seconds * 1e3:.3f}",
                      f"{val:.3g} {unit}" if val is not None else "-",
                      f"{pct:.1f}%" if pct is not None else "-",
                      f"{pct_alloc:.1f}%" if pct_alloc is not None else "-", peers or "-"])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines)]
    fmt = "  ".join("{:<%d}" % w for w in widths)
    out = [fmt.format(*head), fmt.format(*["-" * w for w in widths])]
    out += [fmt.format(*line) for line in lines]
    formulas = sorted({f"{r.op}: {r.formula}" for r in rows if r.formula})
    if formulas:
        out.append("")
        out.append("formulas (rate = amount / time; % limit: of dense mm FLOP/s or of the preallocated "
                   "copy bandwidth measured above; % alloc-copy: of a copy into a new tensor):")
        out += ["  " + f for f in formulas]
    return "\n".join(out)


def _chart(rows: List[Row], machine: Machine, path: Path) -> Optional[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"no chart: {exc}"
    labels, pcts = [], []
    for r in rows:
        _, _, pct, _ = _rate(r, machine)
        if pct is not None:
            labels.append(f"{r.op} {r.case} [{r.backend}]")
            pcts.append(pct)
    if not pcts:
        return "no chart: no rows with a rate"
    fig, ax = plt.subplots(figsize=(10, 0.35 * len(pcts) + 1.5))
    ax.barh(range(len(pcts)), pcts, color="#3b7dd8")
    ax.set_yticks(range(len(pcts)))
    ax.set_yticklabels(labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("% of the machine limit measured in the same run "
                  f"(copy {machine.copy_gbps:.1f} GB/s; dense mm)")
    ax.set_title(f"ascend_moe_ops on {machine.device} - {_dt.date.today().isoformat()}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def discover(ops: Optional[List[str]] = None) -> List[Path]:
    files = sorted(BENCH_DIR.glob("bench_*.py"))
    if ops:
        files = [f for f in files if f.stem[len("bench_"):] in ops]
    return files


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ascend_moe_ops.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", default=True, help="small shapes (default)")
    mode.add_argument("--full", action="store_true", help="the issue-sized shapes")
    ap.add_argument("--ops", nargs="*", help="bench modules to run (e.g. moe_permute grouped_gemm)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=str(REPO / "results"), help="folder for JSON and PNG")
    args = ap.parse_args(argv)
    quick = not args.full
    device = torch.device(args.device)
    if not BENCH_DIR.is_dir():
        print(f"no bench/ folder next to the package ({BENCH_DIR}); run from a source checkout")
        return 2

    ctx = Context(device, quick)
    ctx.machine.mm_tflops(torch.bfloat16)
    ctx.machine.mm_tflops(torch.float32)
    info = ctx.machine.describe()
    print(f"ascend_moe_ops benchmark + parity report ({'quick' if quick else 'full'}), "
          f"{_dt.datetime.now(_dt.timezone.utc):%Y-%m-%d %H:%M} UTC")
    for k, v in info.items():
        print(f"  {k}: {v}")

    rows: List[Row] = []
    parity: List[ParityRow] = []
    failures = []
    for path in discover(args.ops):
        name = path.stem[len("bench_"):]
        t0 = time.perf_counter()
        try:
            mod = _load_module(path)
            if hasattr(mod, "parity"):
                parity += list(mod.parity(ctx))
            if hasattr(mod, "run"):
                rows += list(mod.run(ctx))
        except Exception:
            failures.append(name)
            print(f"\n[{name}] FAILED:\n{traceback.format_exc()}")
        print(f"  [{name}] done in {time.perf_counter() - t0:.1f} s", flush=True)

    if parity:
        print("\nparity vs fp64 reference (max abs error, bound from ascend_moe_ops.testing):")
        for p in parity:
            print(f"  {'ok  ' if p.ok else 'FAIL'} {p.op:<22} {p.case:<28} {p.backend:<12} {p.dtype:<9} "
                  f"err {p.max_err:.3e}  bound {p.bound:.3e}")
    print()
    print(format_table(rows, ctx.machine))

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    payload = {
        "machine": ctx.machine.describe(), "quick": quick,
        "rows": [dict(dataclasses.asdict(r), **dict(zip(("rate", "unit", "pct_limit", "pct_alloc_copy"),
                                                        _rate(r, ctx.machine))))
                 for r in rows],
        "parity": [dict(dataclasses.asdict(p), ok=p.ok) for p in parity],
        "failed_modules": failures,
    }
    jpath = out / f"bench-{stamp}.json"
    jpath.write_text(json.dumps(payload, indent=1, default=str))
    ppath = out / f"bench-{stamp}.png"
    why = _chart(rows, ctx.machine, ppath)
    print(f"\nwrote {jpath}" + (f" and {ppath}" if why is None else f" ({why})"))
    bad_parity = [p for p in parity if not p.ok]
    return 1 if failures or bad_parity else 0


if __name__ == "__main__":
    sys.exit(main())
