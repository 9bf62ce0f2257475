"""The one measurement harness: every timing in the project goes through :func:`measure`.

It wraps ``torch.utils.benchmark.Timer.blocked_autorange`` (a minimum run time), or, where every
rank of a process group must make exactly the same calls, the standard library's
``timeit.Timer.repeat`` with one call per run (torch's ``Timer.timeit`` adds warm-up calls). The thread
count is pinned for the measurement (``Timer(num_threads=...)``) and reported, and the result keeps
the spread: median, inter-quartile range and the number of runs, as a :class:`Timing` (a ``float``
equal to the median, so existing code that divides by it keeps working).
"""

from __future__ import annotations

import math
import statistics
import sys
import timeit
from typing import Callable, List, Optional, Sequence

import torch
from torch.utils import benchmark as _tb

#: scheduler time slices seen on loaded Linux machines (CFS slices / 250 Hz ticks, 64 Hz timers)
QUANTA_S = (0.004, 0.016)
#: IQR / median above which a timing is reported as noisy
NOISY_IQR = 0.10


class Timing(float):
    """Median seconds of one measured callable, with its spread.

    ``iqr``: inter-quartile range of the per-run times (seconds); ``n``: runs measured;
    ``times``: the per-run times (block averages for fast callables); ``threads``: torch threads
    pinned while measuring; ``method``: how it was timed.
    """

    def __new__(cls, median: float, iqr: float = 0.0, n: int = 0, times: Sequence[float] = (),
                threads: int = 0, method: str = ""):
        self = super().__new__(cls, median)
        self.iqr = float(iqr)
        self.n = int(n)
        self.times = tuple(float(t) for t in times)
        self.threads = int(threads)
        self.method = method
        return self

    @property
    def median(self) -> float:
        return float(self)

    @property
    def rel_iqr(self) -> float:
        return self.iqr / float(self) if float(self) > 0 else math.nan

    def as_dict(self) -> dict:
        return {"median_s": float(self), "iqr_s": self.iqr, "n": self.n, "threads": self.threads}


def placeholder() -> Timing:
    """A Timing without a measurement (NaN), used when cases are only being collected."""
    return Timing(math.nan, math.nan, 0, (), torch.get_num_threads(), "not measured (collect only)")


def clock_for(device) -> Callable[[], float]:
    """The clock ``Timer`` reads: the default timer, after a device synchronize for accelerators
    (torch.utils.benchmark does the CUDA synchronize itself; NPU needs it here)."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "npu":
        def npu_clock() -> float:
            torch.npu.synchronize()
            return timeit.default_timer()
        return npu_clock
    if dev.type == "cuda":
        return _tb.utils.timer.timer  # synchronizes CUDA, then the default timer
    return timeit.default_timer


def _quartiles(times: List[float]):
    if len(times) < 2:
        return (times[0], times[0]) if times else (math.nan, math.nan)
    q = statistics.quantiles(times, n=4, method="inclusive")
    return q[0], q[2]


def measure(fn: Callable[[], object], *, device=None, min_run_time: float = 0.2, min_runs: int = 3,
            warmup: int = 1, threads: Optional[int] = None, runs: Optional[int] = None,
            slow_s: float = 1.0, setup: Optional[Callable[[], object]] = None,
            clock: Optional[Callable[[], float]] = None) -> Timing:
    """Time ``fn()``.

    * ``runs=None``: ``warmup`` untimed calls, then ``Timer.blocked_autorange(min_run_time)``; if
      that gave fewer than ``min_runs`` runs, single-call runs are added (a callable slower than
      ``slow_s`` gets at least 2 runs instead of ``min_runs``).
    * ``runs=N``: exactly ``warmup`` + ``N`` single calls (every rank of a process group must make
      the same calls).
    ``threads``: torch threads pinned for the measurement (default: the current count).
    ``setup``: called, untimed, before every run (e.g. a barrier so that all ranks start together).
    ``clock``: the clock read around the runs (default: wall time, after a device synchronize);
    e.g. ``time.process_time`` for the CPU seconds of this process (CPU only), which a shared
    machine's time slicing does not inflate.
    """
    if clock is not None and not callable(clock):
        raise ValueError(f"measure: clock must be callable, got {clock!r}")
    if clock is not None and device is not None and torch.device(device).type != "cpu":
        raise ValueError(f"measure: clock is for the CPU only (device={device!r} needs its own synchronize)")
    read = clock or clock_for(device)
    nthreads = int(threads or torch.get_num_threads())
    timer = _tb.Timer(stmt="fn()", setup="setup()" if setup else "pass",
                      globals={"fn": fn, "setup": setup}, num_threads=nthreads, timer=read)
    prev = torch.get_num_threads()
    torch.set_num_threads(nthreads)
    try:
        for _ in range(max(0, warmup)):
            if setup:
                setup()
            fn()
    finally:
        torch.set_num_threads(prev)
    if runs is not None:
        # torch's Timer.timeit adds 2 warm-up calls per call; the stdlib Timer it wraps does not
        fixed = timeit.Timer(stmt=fn, setup=setup or "pass", timer=read)
        torch.set_num_threads(nthreads)
        try:
            times = fixed.repeat(repeat=int(runs), number=1)
        finally:
            torch.set_num_threads(prev)
        method = f"timeit.Timer.repeat({runs}, number=1), setup before each run"
    else:
        m = timer.blocked_autorange(min_run_time=min_run_time)
        times = list(m.times)
        need = min_runs if statistics.median(times) < slow_s else min(min_runs, 2)
        while len(times) < need:
            times += list(timer.timeit(1).times)
        method = (f"torch.utils.benchmark.Timer.blocked_autorange(min_run_time={min_run_time}), "
                  f"{m.number_per_run} call(s) per run")
    lo, hi = _quartiles(times)
    return Timing(statistics.median(times), hi - lo, len(times), times, nthreads, method)


def noise_flags(t: Timing) -> List[str]:
    """Why a timing should not be trusted: a large IQR, or per-run times that sit at multiples of
    a scheduler time slice (the machine is busy and the process is being descheduled)."""
    flags = []
    if not isinstance(t, Timing) or t.n == 0 or math.isnan(float(t)):
        return flags
    if t.n >= 3 and t.rel_iqr > NOISY_IQR:
        flags.append(f"IQR {100 * t.rel_iqr:.0f}% of median")
    q = quantum_cluster(t.times)
    if q:
        flags.append(f"run times cluster at multiples of {q * 1e3:.0f} ms (scheduler time slices)")
    return flags


def quantum_cluster(values: Sequence[float], min_count: int = 3) -> Optional[float]:
    """The scheduler quantum the values cluster at (seconds), or None.

    A value ``v >= q`` lies at distance ``|v/q - round(v/q)|`` (0 .. 0.5) from a multiple of ``q``;
    uniformly spread values average 0.25, values sitting on multiples average near 0.
    """
    for q in sorted(QUANTA_S, reverse=True):
        vs = [v for v in values if v >= 0.9 * q and not math.isnan(v)]
        if len(vs) < min_count:
            continue
        dist = statistics.mean(abs(v / q - round(v / q)) for v in vs)
        if dist < 0.06:
            return q
    return None


def progress(msg: str) -> None:
    """One progress line on stderr (the table goes to stdout)."""
    print(msg, file=sys.stderr, flush=True)
