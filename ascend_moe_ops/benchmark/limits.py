"""Machine limits, measured in the same run as the rows they are compared with.

* bandwidth rows: ``dst.copy_(src)`` of the SAME working set (bytes moved = read + write, the copy's
  two buffers together are that size, rounded to a 2^(1/8) step so rows of one shape share one
  measurement), preallocated ``dst``; plus the same copy into a fresh tensor (``empty_like``: what
  an op that returns a new tensor pays in first-touch page faults). Each says whether the working
  set fits the last-level cache ("cache") or not ("DRAM").
* FLOP rows: dense ``torch.mm`` of the same ``M x K x N`` (or a 2048^3 square mm when the row has
  no matmul shape), same dtype.
* link rows (expert parallel): the link rate the row states (e.g. a rate-limited veth); on loopback
  there is none, the flat algorithm is the reference.
"""

from __future__ import annotations

import glob
import math
import os
from typing import Dict, List, Optional, Tuple

import torch

from .timing import Timing, measure, progress


def llc_bytes() -> Optional[int]:
    """Size of the largest CPU cache (sysfs), or None."""
    best = None
    for d in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*"):
        try:
            with open(os.path.join(d, "size")) as f:
                s = f.read().strip()
        except OSError:
            continue
        mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(s[-1:].upper(), 1)
        try:
            v = int(s.rstrip("KMGkmg")) * mult
        except ValueError:
            continue
        best = max(best or 0, v)
    return best


def _bucket(nbytes: int) -> int:
    """Round to a 2^(1/8) step (about +-4 %), a multiple of 4 KiB."""
    if nbytes <= 8192:
        return 8192
    step = 2 ** (round(math.log2(nbytes) * 8) / 8)
    return int(step) // 4096 * 4096


class Machine:
    """Limits of this machine, measured lazily (and once per size) in this process."""

    def __init__(self, device, min_run_time: float = 0.2, threads: Optional[int] = None):
        self.device = torch.device(device)
        self.min_run_time = min_run_time
        self.threads = threads
        self.llc = llc_bytes() if self.device.type == "cpu" else None
        self.measured: List[Dict[str, object]] = []
        self._copy: Dict[Tuple[int, bool], Tuple[float, Timing]] = {}
        self._mm: Dict[Tuple, Tuple[float, Timing]] = {}

    def _time(self, fn) -> Timing:
        return measure(fn, device=self.device, min_run_time=self.min_run_time, threads=self.threads)

    # ---- bandwidth
    def residency(self, working_set: int) -> str:
        if self.device.type != "cpu":
            return "device memory"
        if self.llc is None:
            return "unknown"
        return "cache" if working_set <= self.llc else "DRAM"

    def copy_gbps_for(self, nbytes: int, fresh: bool = False) -> float:
        """GB/s of a copy moving ``nbytes`` (read + write): ``nbytes / 2`` per buffer."""
        size = _bucket(int(nbytes))
        key = (size, fresh)
        if key not in self._copy:
            n = size // 2 // 4  # fp32 elements per buffer
            src = torch.randn(n, device=self.device)
            if fresh:
                t = self._time(lambda: torch.empty_like(src).copy_(src))
            else:
                dst = torch.empty_like(src)
                t = self._time(lambda: dst.copy_(src))
                del dst
            del src
            gbps = 2 * n * 4 / t / 1e9
            self._copy[key] = (gbps, t)
            what = "torch.empty_like(src).copy_(src)" if fresh else "dst.copy_(src), dst preallocated"
            self.measured.append(dict(kind="alloc-copy" if fresh else "copy", working_set_bytes=2 * n * 4,
                                      residency=self.residency(2 * n * 4), GBps=round(gbps, 3),
                                      formula=f"GB/s = 2 x {n * 4} B / t ({what}, fp32)", **t.as_dict()))
            progress(f"  [limits] {'alloc-copy' if fresh else 'copy'} {2 * n * 4 / 2**20:.1f} MiB "
                     f"({self.residency(2 * n * 4)}): {gbps:.1f} GB/s")
        return self._copy[key][0]

    def copy_buffers(self, nbytes: int):
        """``(fn, bytes_moved)``: ``dst.copy_(src)`` of the same working set as
        :meth:`copy_gbps_for` (same rounding), on buffers allocated (and faulted in) once, for
        timings that alternate the copy with the row (:meth:`Context.time_vs_copy`)."""
        n = _bucket(int(nbytes)) // 2 // 4
        src = torch.randn(n, device=self.device)
        dst = torch.empty_like(src)
        dst.copy_(src)
        return (lambda: dst.copy_(src)), 2 * n * 4

    def record_paired_copy(self, nbytes: int, pairs, threads: int) -> None:
        """Record the copy GB/s of each round of an alternated timing (JSON ``limits``)."""
        rates = [nbytes / tc / 1e9 for _, tc in pairs]
        self.measured.append(dict(kind="copy (alternated with a row)", working_set_bytes=nbytes,
                                  residency=self.residency(nbytes),
                                  GBps_per_round=[round(r, 3) for r in rates],
                                  formula=f"GB/s = {nbytes} B / t per round (dst.copy_(src), dst "
                                          f"preallocated, fp32), timed between the row's rounds",
                                  threads=threads))

    # ---- flops
    def mm_tflops_for(self, M: int, K: int, N: int, dtype=torch.bfloat16) -> float:
        """TFLOP/s of dense ``torch.mm([M, K], [K, N], out=c)`` in ``dtype``, ``c`` preallocated:
        the compute limit, without the page faults of a fresh output (on a CPU a fresh
        tens-of-MiB output can cost as much as the mm, and whether the allocator hands back
        faulted-in memory varies from call to call; the dense peer rows keep the allocating call
        a user makes)."""
        key = (int(M), int(K), int(N), dtype)
        if key not in self._mm:
            g = torch.Generator().manual_seed(0)
            a = torch.randn(M, K, generator=g).to(device=self.device, dtype=dtype)
            b = torch.randn(K, N, generator=g).to(device=self.device, dtype=dtype)
            c = torch.empty(M, N, device=self.device, dtype=dtype)
            t = self._time(lambda: torch.mm(a, b, out=c))
            tf = 2 * M * K * N / t / 1e12
            self._mm[key] = (tf, t)
            dt = str(dtype).replace("torch.", "")
            self.measured.append(dict(kind="dense mm", shape=[M, K, N], dtype=dt, TFLOPs=round(tf, 4),
                                      formula=f"TFLOP/s = 2*{M}*{K}*{N} / t (torch.mm(out=) into a "
                                              f"preallocated output, {dt})",
                                      **t.as_dict()))
            progress(f"  [limits] dense mm {M}x{K}x{N} {dt}: {tf:.3f} TFLOP/s")
        return self._mm[key][0]

    def mm_tflops(self, dtype=torch.bfloat16) -> float:
        """Square 2048^3 dense mm (rows that have no matmul shape of their own)."""
        return self.mm_tflops_for(2048, 2048, 2048, dtype)

    # ---- compatibility with bench modules written before same-working-set limits
    @property
    def copy_gbps(self) -> float:
        """Copy bandwidth of a 512 MiB working set (DRAM-resident on every current CPU)."""
        return self.copy_gbps_for(512 * 2**20)

    def describe(self) -> Dict[str, object]:
        return {"device": str(self.device), "llc_bytes": self.llc, "measured": list(self.measured)}
