"""Runs the bench modules (``bench_<op>.py`` of the suite) and reports; used by the CLI
(``python -m ascend_moe_ops.bench``) and the pytest-benchmark suite (``python -m pytest bench/``).

A bench module defines ``run(ctx) -> list[Row]`` (and optionally ``parity(ctx)``); it times every
callable with ``ctx.time(fn)`` (the harness in :mod:`.timing`) and reads its shapes from the
context: ``ctx.preset`` / ``ctx.quick``, ``ctx.shape`` (T, H, E, K, F), ``ctx.gemm_shapes``, ``ctx.dtype``,
``ctx.backends`` (None = every backend present), ``ctx.device``.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import math
import os
import statistics
import time
import traceback
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

from .limits import Machine
from .rows import ParityRow, Row
from .timing import Timing, measure, placeholder, progress

SUITE = "ascend_moe_ops.benchmark.suite"

PRESETS: Dict[str, Dict[str, int]] = {
    # T tokens, H hidden, E experts, K top-k, F expert FFN hidden
    "quick": dict(T=1024, H=1024, E=64, K=8, F=704),            # cache-sized, about a minute on 2 cores
    "pangu": dict(T=4096, H=7680, E=256, K=8, F=2048),          # Pangu Ultra MoE layer
    "deepseek-v3": dict(T=4096, H=7168, E=256, K=8, F=2048),    # DeepSeek-V3 MoE layer
}
#: op names that live in another op's bench module
ALIASES = {"moe_unpermute": "moe_permute", "flash_attention": "mla_attention",
           "grouped_gemm_dw": "grouped_gemm"}


def suite_dir() -> Path:
    import importlib.util
    spec = importlib.util.find_spec(SUITE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"the bench suite ({SUITE}) is not installed with this package")
    return Path(list(spec.submodule_search_locations)[0])


def available_ops() -> Dict[str, str]:
    """op name -> first line of its bench module's docstring (aliases included)."""
    ops = {}
    for f in sorted(suite_dir().glob("bench_*.py")):
        doc = ast.get_docstring(ast.parse(f.read_text())) or ""
        ops[f.stem[len("bench_"):]] = doc.strip().splitlines()[0] if doc.strip() else ""
    for alias, target in ALIASES.items():
        if target in ops:
            ops[alias] = f"(in the {target} module) {ops[target]}"
    return ops


def resolve_ops(names: Optional[List[str]]) -> List[str]:
    """Module names to run for ``names``; ValueError naming the valid ones for unknown names."""
    valid = available_ops()
    if not names:
        return [n for n in valid if n not in ALIASES]
    bad = [n for n in names if n not in valid]
    if bad:
        raise ValueError(f"unknown op(s) {', '.join(map(repr, bad))}; valid: {', '.join(sorted(valid))}")
    out = []
    for n in names:
        m = ALIASES.get(n, n)
        if m not in out:
            out.append(m)
    return out


def load(name: str):
    return importlib.import_module(f"{SUITE}.bench_{name}")


class Context:
    """What a bench module gets: device, shapes, the timer and the machine limits."""

    def __init__(self, device="cpu", preset: str = "quick", shape: Optional[dict] = None,
                 dtype=torch.bfloat16, backends: Optional[List[str]] = None,
                 threads: Optional[int] = None, min_run_time: float = 0.2, recording: bool = False,
                 gemm_shapes: Optional[List[dict]] = None):
        self.device = torch.device(device)
        self.preset = preset
        self.quick = preset == "quick"
        self.shape = dict(PRESETS[preset], **(shape or {}))
        self.gemm_shapes = gemm_shapes  # grouped GEMM cases {E, M, K, N, sizes} (None: the preset's)
        self.dtype = dtype
        self.backends = backends
        self.threads = threads or torch.get_num_threads()
        self.min_run_time = min_run_time
        self.recording = recording
        self.machine = Machine(self.device, min_run_time=min_run_time, threads=self.threads)
        self.module = ""
        self.recorded: List[tuple] = []  # (placeholder Timing, fn) in recording mode
        self._count = 0

    def backend_wanted(self, name: str) -> bool:
        return self.backends is None or name in self.backends

    def limit_now(self, nbytes: Optional[int] = None, mm_shape=None, dtype=None) -> None:
        """Measure the limit a row will be compared with now, next to the row's own timing (the
        machine caches it; under a changing load a limit measured minutes later misleads)."""
        if self.recording:
            return
        if nbytes:
            self.machine.copy_gbps_for(nbytes)
            self.machine.copy_gbps_for(nbytes, fresh=True)
        if mm_shape:
            self.machine.mm_tflops_for(*mm_shape, dtype or self.dtype)

    def time_vs_copy(self, fn: Callable[[], object], nbytes: int, rounds: int = 5) -> Timing:
        """Time ``fn()`` in ``rounds`` rounds alternated with ``dst.copy_(src)`` of the same
        working set (``nbytes`` read + written), each round a :func:`measure` of
        ``min_run_time / rounds`` per side. A bandwidth row timed this way is compared with the
        copy round by round (median of the per-round ratios): on a machine whose memory
        bandwidth drifts (a shared VM: one 540 MiB copy took 13.9-21.9 ms within one process) a
        copy timed once, before or after the row, can land in another phase. The result is the
        pooled per-run times of ``fn``, with ``copy_pairs`` (op median, copy median) per round."""
        if self.recording:
            return self.time(fn)
        self._count += 1
        start = time.monotonic()
        per = max(self.min_run_time / rounds, 0.01)
        copy_fn, copy_bytes = self.machine.copy_buffers(nbytes)
        times, pairs = [], []
        for r in range(rounds):
            w = 1 if r == 0 else 0
            t_op = measure(fn, device=self.device, threads=self.threads, warmup=w, min_run_time=per)
            t_cp = measure(copy_fn, device=self.device, threads=self.threads, warmup=w,
                           min_run_time=per)
            times += list(t_op.times)
            pairs.append((float(t_op), float(t_cp)))
        del copy_fn
        q = statistics.quantiles(times, n=4, method="inclusive") if len(times) > 1 else [times[0]] * 3
        t = Timing(statistics.median(times), q[2] - q[0], len(times), times, self.threads,
                   f"{rounds} rounds of measure(min_run_time={per:.3g}) alternated with dst.copy_(src) "
                   f"of the same {copy_bytes} B working set")
        t.copy_pairs = pairs
        t.copy_bytes = copy_bytes
        self.machine.record_paired_copy(copy_bytes, pairs, self.threads)
        progress(f"  [{self.module} #{self._count}] {t * 1e3:.3f} ms  IQR {100 * t.rel_iqr:.0f}%  "
                 f"n={t.n}, alternated with a {copy_bytes / 2**20:.1f} MiB copy: "
                 + " ".join(f"{1e3 * a:.1f}/{1e3 * b:.1f}" for a, b in pairs)
                 + f" ms  ({time.monotonic() - start:.1f} s)")
        return t

    def time(self, fn: Callable[[], object], min_time: Optional[float] = None, *,
             runs: Optional[int] = None, warmup: int = 1, **_legacy) -> Timing:
        """Median time of ``fn()`` with its spread (:class:`Timing`). ``min_time``: minimum run
        time (default: the run's ``--min-run-time``); ``runs``: an exact number of runs."""
        if self.recording:
            t = placeholder()
            self.recorded.append((t, _replay_under_current_backend(fn)))
            return t
        self._count += 1
        start = time.monotonic()
        t = measure(fn, device=self.device, threads=self.threads, warmup=warmup, runs=runs,
                    min_run_time=self.min_run_time if min_time is None else max(min_time, 0.01))
        progress(f"  [{self.module} #{self._count}] {t * 1e3:.3f} ms  IQR {100 * t.rel_iqr:.0f}%  "
                 f"n={t.n}  ({time.monotonic() - start:.1f} s)")
        return t


def forced_backend() -> Optional[str]:
    """The backend a ``with amo.use_backend(name):`` around the caller forces (None: default).
    The only place the harness reads the backend registry's state."""
    from .. import _backends
    return _backends.forced_backend()


def _replay_under_current_backend(fn):
    """``fn`` wrapped so that, called later (pytest), it runs under the backend forced now."""
    from .. import use_backend
    name = forced_backend()

    def replay():
        with use_backend(name):
            return fn()
    return replay


@dataclasses.dataclass
class Result:
    rows: List[Row]
    parity: List[ParityRow]
    failures: Dict[str, str]


def run_modules(ctx: Context, names: List[str], with_parity: bool = True,
                on_rows: Optional[Callable[[List[Row]], None]] = None) -> Result:
    rows, parity, failures = [], [], {}
    for i, name in enumerate(names):
        ctx.module = name
        progress(f"[{i + 1}/{len(names)}] {name}")
        start = time.monotonic()
        try:
            mod = load(name)
            if with_parity and hasattr(mod, "parity"):
                parity += list(mod.parity(ctx))
            got = list(mod.run(ctx)) if hasattr(mod, "run") else []
            got = [r for r in got if ctx.backend_wanted(r.backend) or r.backend == "default"]
            if on_rows:
                on_rows(got)
            rows += got
        except Exception:
            failures[name] = traceback.format_exc()
            progress(f"[{name}] FAILED:\n{failures[name]}")
        progress(f"[{i + 1}/{len(names)}] {name} done in {time.monotonic() - start:.1f} s")
    return Result(rows, parity, failures)


# ----------------------------------------------------------------------------- pytest suite
@dataclasses.dataclass
class Case:
    id: str
    fn: Callable[[], object]


def collect_cases(preset: str = "quick", ops: Optional[List[str]] = None, device="cpu") -> List[Case]:
    """Every callable the CLI would time for ``preset``, named after its table row (peers: the row
    plus ``peer:<name>``), without timing anything. Modules whose cases cannot run in one process
    (``PYTEST_CASES = False``, e.g. the multi-process EP benchmark) are left out."""
    ctx = Context(device, preset=preset, recording=True)
    cases: List[Case] = []
    for name in resolve_ops(ops):
        mod = load(name)
        if not getattr(mod, "PYTEST_CASES", True):
            continue
        ctx.module, ctx.recorded = name, []
        rows = list(mod.run(ctx))
        ids = {}
        for r in rows:
            ids.setdefault(id(r.seconds), f"{r.op}[{r.case}][{r.backend}]")
            for pname, pt in r.peers.items():
                ids.setdefault(id(pt), f"{r.op}[{r.case}][peer:{pname}]")
        seen = set()
        for k, (t, fn) in enumerate(ctx.recorded):
            cid = ids.get(id(t), f"{name}[unlabelled #{k}]")
            if cid in seen:
                continue
            seen.add(cid)
            cases.append(Case(cid, fn))
    return cases


def nan_safe(x) -> Optional[float]:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else x


def default_threads() -> int:
    return int(os.environ.get("OMP_NUM_THREADS") or torch.get_num_threads())
