"""Table, environment record and baseline comparison of a benchmark run."""

from __future__ import annotations

import json
import math
import os
import platform
import shutil
import subprocess
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

from .timing import quantum_cluster

COLUMNS = ["op", "case", "backend", "dtype", "median ms", "IQR", "n", "rate", "% copy (same WS)",
           "% alloc-copy", "% dense mm", "% roofline", "% link", "vs peers", "framework path"]


def _pct(v) -> str:
    return "-" if v is None else f"{v:.0f}%" if v >= 10 else f"{v:.1f}%"


def _roof(r: dict) -> str:
    v = r.get("pct_roofline")
    return "-" if v is None else f"{_pct(v)} [{r.get('roofline_bound')}]"


def format_table(records: List[dict]) -> str:
    lines = []
    for r in records:
        med = r["median_s"]
        if med is None or (isinstance(med, float) and math.isnan(med)):
            ms, iqr = "-", "-"
        else:
            ms = f"{med * 1e3:.3f}"
            iqr = "-" if not r.get("iqr_s") and r.get("n") in (None, 0, 1) else \
                f"{100 * (r['iqr_s'] or 0) / med:.0f}%" if med else "-"
        pc = _pct(r["pct_copy"])
        if r["pct_copy"] is not None and r.get("residency"):
            pc += f" [{r['residency']}]"
        peers = ", ".join(f"{n} {p['speedup']:.2f}x" for n, p in r["peers"].items()
                          if p.get("speedup") is not None) or "-"
        rate = f"{r['rate']:.3g} {r['unit']}" if r.get("rate") is not None else "-"
        lines.append([r["op"], r["case"], r["backend"], r["dtype"], ms, iqr, str(r.get("n") or "-"),
                      rate, pc, _pct(r["pct_alloc_copy"]), _pct(r["pct_mm"]), _roof(r), _pct(r["pct_link"]),
                      peers, r.get("path") or "-"])
    widths = [max(len(str(x)) for x in col) for col in zip(COLUMNS, *lines)] if lines else \
        [len(c) for c in COLUMNS]
    fmt = "  ".join("{:<%d}" % w for w in widths)
    out = [fmt.format(*COLUMNS), fmt.format(*["-" * w for w in widths])]
    out += [fmt.format(*line) for line in lines]
    formulas = sorted({f"{r['op']}: {r['formula']}" for r in records if r.get("formula")})
    if formulas:
        out += ["", "formulas (rate = amount / median time):"] + ["  " + f for f in formulas]
    out += ["", "limits, each measured in this run: % copy = of dst.copy_(src) moving the same number "
            "of bytes (the working set) [cache / DRAM: whether that fits the last-level cache]; "
            "% alloc-copy = of the same copy into a fresh tensor (first-touch page faults); "
            "% dense mm = of torch.mm(out=) of the same M x K x N into a preallocated output (2048^3 where a row has no matmul "
            "shape); % roofline = of max(FLOPs / that dense-mm rate, least bytes moved / the copy rate of "
            "that working set) [which bound]; % link = of the stated link rate. vs peers: peer median / ours (> 1: ours faster)."]
    return "\n".join(out)


def noise_warnings(records: List[dict]) -> List[str]:
    warns = [f"{r['key']}: {'; '.join(r['noise'])}" for r in records if r.get("noise")]
    meds = [r["median_s"] for r in records if r.get("median_s") and not math.isnan(r["median_s"])]
    q = quantum_cluster(meds, min_count=5)
    if q:
        warns.append(f"the medians of this run cluster at multiples of {q * 1e3:.0f} ms: the process "
                     "was descheduled in time slices (machine busy); rerun on a quiet machine")
    return warns


# ------------------------------------------------------------------------------- environment
def _git_commit() -> Optional[str]:
    """The commit of the source tree the package runs from (a checkout or an editable install), or
    None for an installed copy: git finds the work tree around the package folder, and it counts only
    if that tree holds this very package (nothing here walks up the folders itself)."""
    import ascend_moe_ops
    pkg = Path(ascend_moe_ops.__file__).resolve().parent
    if not shutil.which("git"):
        return None
    try:
        top = subprocess.run(["git", "-C", str(pkg), "rev-parse", "--show-toplevel"], capture_output=True,
                             text=True, timeout=5)
        if top.returncode or (Path(top.stdout.strip()) / pkg.name).resolve() != pkg:
            return None
        root = pkg.parent
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=5)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode:
        return None
    return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _compilers() -> Dict[str, str]:
    info = {"python": platform.python_compiler()}
    for line in torch.__config__.show().splitlines():
        s = line.strip().lstrip("- ").strip()
        if s.startswith(("GCC", "clang", "MSVC", "Clang")):
            info["torch"] = s
            break
    cxx = os.environ.get("CXX") or shutil.which("c++")
    if cxx:
        try:
            v = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=5)
            info["c++ on PATH (builds the extension)"] = v.stdout.splitlines()[0] if v.stdout else "?"
        except (OSError, subprocess.SubprocessError):
            pass
    return info


def environment(device, threads: int) -> Dict[str, object]:
    from .. import __version__
    info = {"package": "ascend_moe_ops", "version": __version__, "git_commit": _git_commit(),
            "torch": torch.__version__, "python": platform.python_version(),
            "compilers": _compilers(), "cpu": _cpu_model(), "logical_cpus": os.cpu_count(),
            "threads": threads, "device": str(device), "platform": platform.platform()}
    if torch.device(device).type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


# ------------------------------------------------------------------------------- compare
def compare(current: List[dict], baseline_path: str, threshold: float) -> Tuple[str, List[str]]:
    """Ratio current / baseline median per row key; rows slower by more than ``threshold``
    (0.1 = 10 %) are regressions. Returns (text, regressions)."""
    base = json.loads(Path(baseline_path).read_text())
    brows = {r["key"]: r for r in base.get("rows", []) if "key" in r}
    lines = [f"compare with {baseline_path} (threshold {100 * threshold:.0f}% slower):",
             f"  {'ratio':>7}  {'now ms':>10}  {'base ms':>10}  row"]
    regress = []
    for r in current:
        b = brows.get(r["key"])
        if b is None or not b.get("median_s") or not r.get("median_s") or math.isnan(r["median_s"]):
            continue
        ratio = r["median_s"] / b["median_s"]
        mark = ""
        if ratio > 1 + threshold:
            mark = "  SLOWER"
            regress.append(f"{r['key']}: {ratio:.2f}x the baseline time")
        elif ratio < 1 - threshold:
            mark = "  faster"
        lines.append(f"  {ratio:7.3f}  {r['median_s'] * 1e3:10.3f}  {b['median_s'] * 1e3:10.3f}  {r['key']}{mark}")
    missing = sorted(set(brows) - {r["key"] for r in current})
    if missing:
        lines.append(f"  ({len(missing)} baseline rows not in this run)")
    if len(lines) == 2:
        lines.append("  no row of this run is in the baseline")
    return "\n".join(lines), regress
