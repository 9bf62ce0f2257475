"""Atlas A2 timeline of AscendC kernel launches (a MODEL), from the emulator's pipe model.

The emulator (csrc/ascend/emu) runs every AscendC kernel of the package on the CPU; its pipe model
orders every instruction of every core (pipes S, V, M, MTE1, MTE2, MTE3, FIX) by happens-before
edges (flags, queues, barriers, the compiler's auto-sync). With recording on (csrc/ascend/emu/
timeline.h) it hands back, per launch and core, each instruction's pipe, what it moves or computes,
and its predecessors. This module gives each instruction a duration from one hardware table
(``hardware/a2.json``: every figure cites a public source or is marked as an assumption) and
schedules all cores of a launch together:

- each pipe of a core runs its instructions in issue order, one at a time;
- an instruction starts when its predecessors have finished (plus ``flag_latency_cycles`` for an
  edge from another pipe) and the scalar unit has dispatched it (``issue_cycles`` per instruction;
  a scalar instruction or a cross-core wait holds dispatch until it completes);
- a DMA (MTE2 GM -> UB/L1, MTE3 UB -> GM, Fixpipe L0C -> GM) first goes through the **L2 model**: one
  L2 of ``l2_bytes`` shared by all cores, LRU over GM lines of ``l2_line_bytes``, looked up in the
  order the DMAs start in the schedule (cold at the start of each launch), **write-back and
  write-allocate** (since table v2026-12-07.2; CANN's "Setting a Proper L2 CacheMode": data moved out
  by MTE3 / Fixpipe go through the L2, and a replaced line's old data are written back to GM, using GM
  bandwidth). Every byte a read DMA moves passes the core's L2 port at ``l2_read_bytes_per_cycle``,
  every byte a write DMA moves the L2 at its pipe's rate (at most ``l2_write_bytes_per_cycle``); the
  read misses and the dirty lines an access evicts are also a flow through HBM, shared by all cores at
  ``gm_bandwidth`` (max-min fair share; each flow capped at its pipe's per-core rate), concurrently
  with the L2 part (the DMA's requests are pipelined: an assumption); the DMA ends when both have; its
  data are visible ``dma_latency_cycles`` later, which does not hold the pipe. The lines left dirty
  when the last core finishes are charged to the launch: their bytes join its HBM bytes and the launch
  ends no earlier than all its HBM bytes / ``gm_bandwidth`` (their write-back overlaps the time the
  HBM was idle: an assumption; the next launch starts with a clean, cold L2). A recording without GM
  address runs charges every byte to HBM;
- Mmad takes MACs / ``cube_macs_per_cycle_fp16`` (operands padded to 16), vector instructions their
  largest operand / ``vector_bytes_per_cycle``, LoadData its bytes / the L1 -> L0A / L0B rate, each
  plus a start-up cost per instruction; a LoadData's data are usable ``mte1_latency_cycles`` after
  the pipe is done with it (pipelined like the DMA latency; since table v2026-12-07.4).

Per launch it returns a :class:`LaunchModel`: predicted time (the schedule's makespan, at least the
launch's HBM bytes -- the dirty L2 lines at its end included -- over the HBM bandwidth, plus the launch
latency), each pipe's busy fraction, the bounding resource, the roofline time for the work recorded
(max of FLOPs / Cube peak and GM bytes / HBM bandwidth) and its percentage, the **pipe floor** (the
busiest pipe of any core: the sum of its instructions' least durations, a DMA's with the L2 hits and
misses of the schedule, plus the launch latency; no schedule of the same instructions is faster, so roofline / floor is the ceiling that buffering and
synchronisation alone can reach), the table version; and on request a Chrome / Perfetto trace
(``chrome://tracing``, ui.perfetto.dev).

Not modelled: the L2's partitions and set associativity (one fully associative LRU), write-backs of
dirty lines in the next launches (they are charged to the launch that wrote them), bank conflicts, pipe queue depths (dispatch never stalls on a full queue), the data cache, GM address
alignment and burst efficiency, clock throttling. Every number it produces is labelled "(model)".
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
import json
import math
from collections import OrderedDict
from typing import Callable, Dict, Iterable, List, Optional, Sequence

from pathlib import Path

from .hardware import HardwareTable, load_table

__all__ = ["PIPES", "LaunchModel", "recording", "record", "simulate", "model_launches", "chrome_trace",
           "roofline_seconds", "peak_flops", "pipe_floor"]

PIPES = ("S", "V", "M", "MTE1", "MTE2", "MTE3", "FIX")
S, V, M, MTE1, MTE2, MTE3, FIX = range(7)
SET, WAIT = 7, 8  # side records of cross-core flags (csrc/ascend/emu/timeline.h)
_REC_FIELDS = 9   # pipe, name, count, seq, gm, local, macs, flops, l0b; then the clock (7)
CORE_TYPES = ("aiv", "aic")

#: the hardware-table entries the timeline reads (a table without one of them is refused up front)
TABLE_KEYS = ("clock_hz", "cube_cores", "vector_cores", "cube_macs_per_cycle_fp16", "gm_bandwidth", "l2_bytes",
              "l2_line_bytes", "l2_read_bytes_per_cycle", "l2_write_bytes_per_cycle", "mte2_gm_bytes_per_cycle",
              "mte3_gm_bytes_per_cycle", "fixpipe_gm_bytes_per_cycle", "l1_to_l0a_bytes_per_cycle",
              "l1_to_l0b_bytes_per_cycle", "vector_bytes_per_cycle", "vector_instr_cycles", "mmad_instr_cycles",
              "mte1_instr_cycles", "mte1_latency_cycles", "dma_instr_cycles", "dma_latency_cycles",
              "scalar_instr_cycles", "issue_cycles", "flag_latency_cycles", "cross_core_flag_latency_cycles",
              "launch_latency_s")


#: the entries the roofline reads (peak_flops, roofline_seconds): a chip table with only these will do
ROOFLINE_KEYS = ("cube_cores", "cube_macs_per_cycle_fp16", "clock_hz", "gm_bandwidth")


def _table(table, keys=TABLE_KEYS) -> HardwareTable:
    """``table``: None (the shipped ``a2``), a HardwareTable, or a shipped table's name / a JSON path;
    it must hold every entry of ``keys`` (the scheduler's: :data:`TABLE_KEYS`)."""
    if table is None:
        t = load_table("a2")
    elif isinstance(table, HardwareTable):
        t = table
    elif isinstance(table, (str, Path)):
        t = load_table(table)
    else:
        raise TypeError(f"table must be a HardwareTable, a shipped table's name or a JSON path, "
                        f"got {type(table).__name__}")
    return t.require(keys, "the A2 timeline" if keys is TABLE_KEYS else "the A2 roofline")


def check_launch(launch) -> dict:
    """``launch`` if it is a recorded launch the model can schedule, else a ValueError / TypeError
    naming the field: a dict with ``kernel`` and ``kind`` (str) and ``cores``, a list of cores, each
    a dict with ``type`` (one of :data:`CORE_TYPES`), ``block`` (int) and ``recs``, a list of records
    of at least 16 numbers whose first (the pipe) is 0..8. A launch with no cores is modelled as its
    launch latency alone (as a core with no records adds nothing)."""
    if not isinstance(launch, dict):
        raise TypeError(f"launch must be a dict (one recorded launch), got {type(launch).__name__}")
    for k, typ in (("kernel", str), ("kind", str), ("cores", list)):
        if k not in launch:
            raise ValueError(f"launch has no {k!r} field (fields: {', '.join(map(repr, launch)) or 'none'})")
        if not isinstance(launch[k], typ):
            raise TypeError(f"launch[{k!r}] must be a {typ.__name__}, got {type(launch[k]).__name__}")
    need = _REC_FIELDS + 7
    for ci, c in enumerate(launch["cores"]):
        where = f"launch {launch['kernel']!r} cores[{ci}]"
        if not isinstance(c, dict):
            raise TypeError(f"{where} must be a dict, got {type(c).__name__}")
        for k in ("type", "block", "recs"):
            if k not in c:
                raise ValueError(f"{where} has no {k!r} field")
        if c["type"] not in CORE_TYPES:
            raise ValueError(f"{where}['type'] must be one of {', '.join(CORE_TYPES)}, got {c['type']!r}")
        if isinstance(c["block"], bool) or not isinstance(c["block"], int):
            raise TypeError(f"{where}['block'] must be an int, got {type(c['block']).__name__}")
        if not isinstance(c["recs"], list):
            raise TypeError(f"{where}['recs'] must be a list, got {type(c['recs']).__name__}")
        for ri, r in enumerate(c["recs"]):
            if not isinstance(r, (list, tuple)) or len(r) < need:
                raise ValueError(f"{where}['recs'][{ri}] must be a list of at least {need} numbers (pipe, name, "
                                 f"count, seq, gm, local, macs, flops, l0b, then 7 clocks), got {r!r}")
            if not (isinstance(r[0], int) and 0 <= r[0] <= WAIT):
                raise ValueError(f"{where}['recs'][{ri}][0] (the pipe) must be an int in 0..{WAIT} "
                                 f"({', '.join(PIPES)}, cross-core set, wait), got {r[0]!r}")
    return launch


def peak_flops(table=None) -> float:
    """Cube peak of the chip (fp16 / bf16), FLOP/s: cores x MACs/cycle x 2 x clock."""
    t = _table(table, ROOFLINE_KEYS)
    return t["cube_cores"] * t["cube_macs_per_cycle_fp16"] * 2 * t["clock_hz"]


def roofline_seconds(flops: float, gm_bytes: float, table=None) -> float:
    """The A2 roofline time of a piece of work: max(FLOPs / Cube peak, bytes / HBM bandwidth)."""
    t = _table(table, ROOFLINE_KEYS)
    return max(flops / peak_flops(t), gm_bytes / t["gm_bandwidth"])


# ---- recording ------------------------------------------------------------------------------------------

def _emu():
    try:
        from .. import _ascendc_emu
    except ImportError as e:  # pragma: no cover - depends on the build
        raise RuntimeError("the A2 timeline needs the emulated AscendC kernels (ascend_moe_ops._ascendc_emu); "
                           f"build the package's native extensions first ({e})") from None
    return _ascendc_emu


@contextlib.contextmanager
def recording(skip_compute: bool = False):
    """Record every AscendC launch of the block (the ``ascendc-emu`` kernels, e.g.
    ``torch.ops.ascend_moe_ops_emu.<op>``); the yielded list holds the launches (dicts) afterwards.

    ``skip_compute=True``: Cube instructions skip their arithmetic (timing-only; results are garbage),
    so that Pangu-size GEMMs record in seconds."""
    emu = _emu()
    out: list = []
    emu._timeline_start(bool(skip_compute))
    try:
        yield out
    finally:
        data = json.loads(emu._timeline_take())
        out.extend(data["launches"])


def record(fn: Callable, *args, skip_compute: bool = False, **kwargs):
    """``fn(*args, **kwargs)`` with recording on: returns (result, launches)."""
    with recording(skip_compute) as launches:
        res = fn(*args, **kwargs)
    return res, launches


def load_recording(text: str) -> List[dict]:
    """The launches of a recording printed by a C++ driver (``timeline::take_json()``)."""
    data = json.loads(text)
    if not isinstance(data, dict) or not isinstance(data.get("launches"), list):
        raise ValueError("load_recording: expected a JSON object with a 'launches' list (timeline::take_json()), "
                         f"got {text[:80]!r}")
    return data["launches"]


# ---- the model -------------------------------------------------------------------------------------------

@dataclasses.dataclass
class LaunchModel:
    """The modelled A2 execution of one kernel launch. Every time here is a model, not a measurement."""

    kernel: str
    kind: str
    blocks: int
    predicted_s: float
    busy: Dict[str, float]          # pipe -> busy fraction (busy time / (cores having it x makespan))
    utilization: Dict[str, float]   # resource -> fraction of the whole chip's capacity used
    bound: str
    roofline_s: float
    pct_roofline: float
    gm_bytes: int
    flops: int
    instructions: int
    records: int
    table_version: str
    trace: Optional[dict] = None
    hbm_bytes: int = 0              # GM bytes charged to HBM (L2 read misses + dirty lines written back)
    l2_hit_bytes: int = 0           # GM read bytes served by L2
    l2_writeback_bytes: int = 0     # dirty L2 bytes written back to HBM (evictions + the end-of-launch flush)
    l2_flush_s: float = 0.0         # of predicted_s: what the write-back of the lines dirty at the end adds
    l2_dirty_end_bytes: int = 0     # the lines dirty when the last core finishes (in hbm_bytes)
    #: where the time of the critical path goes (seconds per cause, summing to predicted_s): see
    #: :func:`critical_path`
    critical_path: Dict[str, float] = dataclasses.field(default_factory=dict)
    #: the pipe floor (see :func:`pipe_floor`): launch latency + the busiest pipe's own work, and which
    #: pipe of which core that is; no schedule of this instruction stream is faster (model)
    floor_s: float = 0.0
    busiest_pipe: str = ""
    #: pipe -> (its busiest core's least work, the mean over the cores using it), seconds, no launch latency
    pipe_floors: Dict[str, tuple] = dataclasses.field(default_factory=dict)

    @property
    def pct_ceiling(self) -> float:
        """The % of the roofline this launch could reach at most by reordering, buffering or
        synchronising its instructions differently: roofline / pipe floor, at most 100 (a MODEL)."""
        return 100.0 * self.roofline_s / max(self.floor_s, self.roofline_s) if self.floor_s > 0 else 0.0

    @property
    def label(self) -> str:
        return f"A2 (model, table a2 v{self.table_version})"

    def summary(self) -> str:
        return (f"{self.kernel}: {self.predicted_s * 1e6:.1f} us (model), bound {self.bound}, "
                f"{self.pct_roofline:.0f} % of roofline (ceiling {self.pct_ceiling:.0f} %: {self.busiest_pipe}), "
                f"table v{self.table_version}")


class L2Cache:
    """The timeline's L2: one LRU over GM lines of ``line`` bytes, ``capacity`` bytes in all, write-back
    and write-allocate.

    :meth:`access` takes a record's GM runs (address, bytes, stride, count, write) and returns
    (read bytes that hit, read bytes that missed, bytes written, dirty bytes written back to HBM by the
    lines this access evicted). A read moves only the bytes it touches (sectored lines: a line keeps
    the mask of the bytes it holds, and a read hits only for those; the others are fetched from HBM
    and join the mask); a write
    allocates its lines without fetching them (sectored: the bytes it writes become the line's dirty
    bytes) and reaches HBM only when its line is evicted: a line rewritten before its eviction costs
    one write-back of the union of the bytes written to it. :meth:`dirty_bytes` is what is left dirty
    (written back by the caller at the end of the launch). An L2 of zero lines writes through."""

    def __init__(self, capacity: float, line: float):
        self.line = max(1, int(round(line)))
        self.cap = max(0, int(capacity // self.line))
        self.lines: "OrderedDict[int, int]" = OrderedDict()  # line -> dirty byte mask (0: clean)
        self.valid: Dict[int, int] = {}  # line -> mask of the bytes it holds (read or written)

    def _insert(self, ln: int, mask: int, valid: int) -> int:
        """Allocate line ln (absent) with dirty ``mask`` holding the ``valid`` bytes; the dirty bytes
        of the line it evicts, if any."""
        lines = self.lines
        lines[ln] = mask
        self.valid[ln] = valid
        if len(lines) > self.cap:
            old, m = lines.popitem(last=False)
            del self.valid[old]
            return m.bit_count()
        return 0

    def access(self, runs) -> tuple:
        hit = miss = wr = wb = 0
        L, lines, cap = self.line, self.lines, self.cap
        for addr, n, stride, count, write in runs:
            for k in range(count):
                a = addr + k * stride
                e = a + n
                ln = a // L
                while True:
                    lo = ln * L
                    if lo >= e:
                        break
                    b0 = max(a, lo)
                    ov = min(e, lo + L) - b0
                    if write:
                        wr += ov
                        if not cap:
                            wb += ov  # no L2: straight to HBM
                        else:
                            bits = ((1 << ov) - 1) << (b0 - lo)
                            if ln in lines:
                                lines.move_to_end(ln)
                                lines[ln] |= bits
                                self.valid[ln] |= bits
                            else:
                                wb += self._insert(ln, bits, bits)
                    elif ln in lines:
                        lines.move_to_end(ln)
                        bits = ((1 << ov) - 1) << (b0 - lo)
                        have = (self.valid[ln] & bits).bit_count()
                        hit += have
                        miss += ov - have
                        self.valid[ln] |= bits
                    else:
                        miss += ov
                        if cap:
                            wb += self._insert(ln, 0, ((1 << ov) - 1) << (b0 - lo))
                    ln += 1
        return hit, miss, wr, wb

    def dirty_bytes(self) -> int:
        return sum(m.bit_count() for m in self.lines.values() if m)


class _Flows:
    """HBM shared by all cores: max-min fair share of ``bw`` among active flows, each capped at its
    class's per-core rate. Flows of one class progress at one rate, so each class keeps a virtual
    clock (bytes served per flow) and a heap of finishing virtual times."""

    def __init__(self, bw: float):
        self.bw = bw
        self.cls: Dict[float, list] = {}  # cap -> [virtual bytes, rate, heap of (vfinish, id)]

    def add(self, cap: float, nbytes: float, fid: int):
        c = self.cls.setdefault(cap, [0.0, 0.0, []])
        heapq.heappush(c[2], (c[0] + nbytes, fid))

    def rates(self):
        left_bw = self.bw
        left_n = sum(len(c[2]) for c in self.cls.values())
        for cap in sorted(self.cls):
            c = self.cls[cap]
            n = len(c[2])
            if n == 0:
                c[1] = 0.0
                continue
            fair = left_bw / left_n
            c[1] = min(cap, fair)
            left_bw -= c[1] * n
            left_n -= n

    def next_finish(self, now: float) -> float:
        best = math.inf
        for c in self.cls.values():
            if c[2] and c[1] > 0:
                best = min(best, now + max(0.0, c[2][0][0] - c[0]) / c[1])
        return best

    def advance(self, dt: float):
        if dt > 0:
            for c in self.cls.values():
                if c[2]:
                    c[0] += c[1] * dt

    def pop_done(self) -> List[int]:
        done = []
        for c in self.cls.values():
            h = c[2]
            while h and h[0][0] - c[0] <= 1e-9 * max(1.0, h[0][0]):
                done.append(heapq.heappop(h)[1])
        return done


class _Core:
    __slots__ = ("type", "block", "recs", "gmr", "n", "deps", "xdeps", "end", "start", "busy_end", "ip", "t_issue",
                 "issue", "fifo", "head", "pipe_free", "pipe_open", "waiters")

    def __init__(self, c: dict):
        self.type = c["type"]
        self.block = c["block"]
        self.recs = c["recs"]
        self.n = len(self.recs)
        self.gmr: Optional[Dict[int, list]] = None  # record -> GM runs (recordings that have them)
        if "gmr" in c:
            self.gmr = {}
            for ri, addr, n, stride, count, write in c["gmr"]:
                self.gmr.setdefault(ri, []).append((addr, n, stride, count, write))
        self.end = [None] * self.n
        self.start = [0.0] * self.n
        self.busy_end = [0.0] * self.n
        self.issue = [0.0] * self.n
        self.ip = 0
        self.t_issue = 0.0
        self.fifo = [[] for _ in range(9)]
        self.head = [0] * 9
        self.pipe_free = [0.0] * 9
        self.pipe_open = [True] * 9   # False while a DMA flow of that pipe is in flight
        self.xdeps: Dict[int, list] = {}
        for w, core, rec in c.get("cross", ()):
            self.xdeps.setdefault(w, []).append((core, rec))
        # happens-before predecessors: the record holding seq clock[q] of each other pipe q
        seqrec = [[] for _ in range(7)]
        for i, r in enumerate(self.recs):
            p = r[0]
            if p < 7:
                seqrec[p].extend([i] * r[2])
        deps = []
        for r in self.recs:
            p = r[0]
            d = []
            for q in range(7):
                k = r[_REC_FIELDS + q]
                if k > 0 and q != p and k <= len(seqrec[q]):
                    d.append(seqrec[q][k - 1])
            deps.append(d)
        self.deps = deps


class _Sim:
    def __init__(self, launch: dict, t: HardwareTable, want_trace: bool):
        self.t = t
        hz = t["clock_hz"]
        self.cyc = 1.0 / hz
        self.cores = [_Core(c) for c in launch["cores"]]
        self.names = launch.get("names", [])
        self.flows = _Flows(t["gm_bandwidth"])
        self.l2 = L2Cache(t["l2_bytes"], t["l2_line_bytes"])
        self.l2_rate = t["l2_read_bytes_per_cycle"] * hz
        self.l2_wrate = t["l2_write_bytes_per_cycle"] * hz
        self.l2_hit = self.hbm = self.l2_wb = 0
        self.caps = {MTE2: t["mte2_gm_bytes_per_cycle"] * hz, MTE3: t["mte3_gm_bytes_per_cycle"] * hz,
                     FIX: t["fixpipe_gm_bytes_per_cycle"] * hz}
        self.flag_lat = t["flag_latency_cycles"] * self.cyc
        self.x_lat = t["cross_core_flag_latency_cycles"] * self.cyc
        self.dma_lat = t["dma_latency_cycles"] * self.cyc
        # a LoadData's data reach L0A/L0B this long after the pipe is done with it (pipelined)
        self.lat_after = [0.0] * (WAIT + 1)  # per record kind
        self.lat_after[MTE1] = t["mte1_latency_cycles"] * self.cyc
        self.issue_dt = t["issue_cycles"] * self.cyc
        self.dma_min: Dict[tuple, float] = {}  # (core, rec) -> a DMA's least transfer time (pipe_floor)
        self.events: list = []   # (time, counter, core, rec, phase): 0 the DMA starts (L2 lookup), 1 it ends
        self.counter = 0
        self.flow_of: Dict[int, tuple] = {}
        self.now = 0.0
        # who waits on a cross-core set: (core, rec) -> waiting cores
        self.set_waiters: Dict[tuple, set] = {}
        for ci, c in enumerate(self.cores):
            for w, lst in c.xdeps.items():
                for key in lst:
                    self.set_waiters.setdefault(tuple(key), set()).add(ci)
        self.want_trace = want_trace

    # duration of the non-GM part of a record (seconds)
    def fixed(self, r) -> float:
        t, p, cnt = self.t, r[0], r[2]
        if p == S:
            cyc = cnt * t["scalar_instr_cycles"]
        elif p == V:
            cyc = cnt * t["vector_instr_cycles"] + r[5] / t["vector_bytes_per_cycle"]
        elif p == M:
            cyc = cnt * t["mmad_instr_cycles"] + r[6] / t["cube_macs_per_cycle_fp16"]
        elif p == MTE1:
            l0b = min(r[8], r[5])
            cyc = cnt * t["mte1_instr_cycles"] + (r[5] - l0b) / t["l1_to_l0a_bytes_per_cycle"] \
                + l0b / t["l1_to_l0b_bytes_per_cycle"]
        elif p in (MTE2, MTE3, FIX):
            cyc = cnt * t["dma_instr_cycles"]
            if r[4] == 0:  # a local-only transfer (an L1 fill on MTE2)
                cyc += r[5] / t["mte2_gm_bytes_per_cycle"]
        else:
            cyc = 0.0
        return cyc * self.cyc

    def min_busy(self, ci: int, i: int) -> float:
        """The least time record i of core ci could hold its pipe: its fixed cost, and for a DMA its
        transfer with the L2 hits and misses it had in this schedule, alone on the HBM (its bytes
        through the L2 port, its misses and write-backs at its pipe's rate)."""
        return self.fixed(self.cores[ci].recs[i]) + self.dma_min.get((ci, i), 0.0)

    def deps_ready(self, c: _Core, i: int) -> Optional[float]:
        """Latest predecessor end (+ flag latency) or None while one is unknown."""
        p = c.recs[i][0]
        ready = 0.0
        for j in c.deps[i]:
            e = c.end[j]
            if e is None:
                return None
            if c.recs[j][0] != p:
                e += self.flag_lat
            ready = e if e > ready else ready
        for core, rec in c.xdeps.get(i, ()):
            e = self.cores[core].end[rec]
            if e is None:
                return None
            ready = max(ready, e)
        return ready

    def advance(self, ci: int) -> List[int]:
        """Place whatever core ci can place now; returns the cores waiting on sets placed here."""
        c = self.cores[ci]
        woken = []
        progress = True
        while progress:
            progress = False
            # the scalar unit's dispatch
            while c.ip < c.n:
                i = c.ip
                r = c.recs[i]
                p = r[0]
                if p == S or p == WAIT:
                    ready = self.deps_ready(c, i)
                    if ready is None:
                        break
                    st = max(c.t_issue, ready, c.pipe_free[p])
                    en = st + self.fixed(r)
                    c.start[i], c.end[i], c.busy_end[i] = st, en, en
                    c.pipe_free[p] = en
                    c.t_issue = en
                    c.ip += 1
                    progress = True
                else:
                    c.issue[i] = c.t_issue
                    c.t_issue += self.issue_dt * r[2]
                    c.fifo[p].append(i)
                    c.ip += 1
                    progress = True
            # the pipes, in order
            for p in (V, M, MTE1, MTE2, MTE3, FIX, SET):
                q = c.fifo[p]
                while c.head[p] < len(q) and c.pipe_open[p]:
                    i = q[c.head[p]]
                    ready = self.deps_ready(c, i)
                    if ready is None:
                        break
                    r = c.recs[i]
                    st = max(c.issue[i], ready, c.pipe_free[p] if p != SET else 0.0)
                    c.head[p] += 1
                    progress = True
                    if p == SET:
                        c.start[i] = st
                        c.end[i] = c.busy_end[i] = st + self.x_lat
                        woken.extend(self.set_waiters.get((ci, i), ()))
                        continue
                    fx = self.fixed(r)
                    if r[4] > 0 and p in self.caps:  # a DMA: its GM bytes go through HBM after the issue cost
                        c.start[i] = st
                        c.pipe_open[p] = False
                        self.counter += 1
                        heapq.heappush(self.events, (max(st + fx, self.now), self.counter, ci, i, 0))
                        break
                    en = st + fx
                    c.start[i], c.end[i], c.busy_end[i] = st, en + self.lat_after[p], en
                    c.pipe_free[p] = en
        return woken

    def _dma_done(self, ci: int, i: int):
        c = self.cores[ci]
        p = c.recs[i][0]
        c.busy_end[i] = self.now
        c.end[i] = self.now + self.dma_lat
        c.pipe_free[p] = self.now
        c.pipe_open[p] = True

    def run(self) -> float:
        todo = list(range(len(self.cores)))
        while todo:
            nxt = []
            for ci in todo:
                nxt.extend(self.advance(ci))
            todo = sorted(set(nxt))
        fid = 0
        self.l2_end: Dict[tuple, float] = {}
        while True:
            te = self.events[0][0] if self.events else math.inf
            tf = self.flows.next_finish(self.now)
            if te == math.inf and tf == math.inf:
                break
            touched = set()
            if tf <= te:
                self.flows.advance(tf - self.now)
                self.now = tf
                for f in self.flows.pop_done():
                    ci, i = self.flow_of.pop(f)
                    l2_end = self.l2_end.pop((ci, i))
                    if l2_end > self.now * (1 + 1e-12):  # the L2 part of the DMA is still running
                        self.counter += 1
                        heapq.heappush(self.events, (l2_end, self.counter, ci, i, 1))
                        continue
                    self._dma_done(ci, i)
                    touched.add(ci)
            else:
                self.flows.advance(te - self.now)
                self.now = te
                while self.events and self.events[0][0] <= self.now:
                    _, _, ci, i, phase = heapq.heappop(self.events)
                    c = self.cores[ci]
                    r = c.recs[i]
                    if phase == 0:  # the L2 lookup, in schedule order
                        runs = c.gmr.get(i) if c.gmr is not None else None
                        if runs:
                            hit, miss, wr, wb = self.l2.access(runs)
                        elif r[0] == MTE2:
                            hit, miss, wr, wb = 0, r[4], 0, 0
                        else:  # a write without its address runs: charged to HBM as it goes
                            hit, miss, wr, wb = 0, 0, 0, r[4]
                        self.l2_hit += hit
                        self.l2_wb += wb if runs else 0
                        nb = miss + wb
                        self.hbm += nb
                        # every read byte passes the core's L2 port, every written byte the L2's write
                        # port (at the pipe's rate, at most the L2 write rate); the read misses and the
                        # dirty lines this access evicts also flow through HBM (concurrently: the DMA's
                        # requests are pipelined)
                        if r[0] == MTE2:
                            l2_end = self.now + (hit + miss) / self.l2_rate
                        else:
                            l2_end = self.now + wr / min(self.caps[r[0]], self.l2_wrate)
                        # its least transfer time with these hits and misses (no other flow on HBM)
                        self.dma_min[(ci, i)] = max(l2_end - self.now, nb / self.caps[r[0]])
                        if nb > 0:
                            fid += 1
                            self.flow_of[fid] = (ci, i)
                            self.l2_end[(ci, i)] = l2_end
                            self.flows.add(self.caps[r[0]], float(nb), fid)
                            continue
                        if l2_end > self.now:
                            self.counter += 1
                            heapq.heappush(self.events, (l2_end, self.counter, ci, i, 1))
                            continue
                    self._dma_done(ci, i)
                    touched.add(ci)
            todo = sorted(touched)
            while todo:
                nxt = []
                for ci in todo:
                    nxt.extend(self.advance(ci))
                todo = sorted(set(nxt))
            self.flows.rates()
        for ci, c in enumerate(self.cores):
            if c.ip < c.n or any(c.head[p] < len(c.fifo[p]) for p in range(9)):
                raise RuntimeError(f"a2_timeline: core {ci} ({c.type} block {c.block}) could not finish its "
                                   f"schedule (a wait whose set was never recorded?)")
        return max((max(e for e in c.end if e is not None) if c.n else 0.0) for c in self.cores) \
            if self.cores else 0.0


def simulate(launch: dict, table=None, *, trace: bool = False, max_trace_events: int = 200_000) -> LaunchModel:
    """Schedule one recorded launch on the A2 model (see the module docstring). ``launch`` is checked
    first (:func:`check_launch`); one with no cores is its launch latency alone."""
    t = _table(table)
    check_launch(launch)
    sim = _Sim(launch, t, trace)
    makespan = sim.run()
    # the lines still dirty in L2 when the last core finishes are charged to this launch: their bytes
    # join its HBM traffic, and the launch is not done before the HBM has carried all of it (their
    # write-back overlaps whatever left the HBM idle; on the chip it happens as later accesses evict
    # them). What this adds past the cores' last instruction is l2_flush_s.
    flush = sim.l2.dirty_bytes()
    sim.hbm += flush
    sim.l2_wb += flush
    end = max(makespan, sim.hbm / t["gm_bandwidth"])
    flush_s = end - makespan
    sim.run_end, sim.flush_s, sim.flush_bytes = makespan, flush_s, flush
    makespan = end
    predicted = makespan + t["launch_latency_s"]
    ntype = {"aiv": t["vector_cores"], "aic": t["cube_cores"]}
    busy_t = [0.0] * 7
    have = [0] * 7
    used_types = {}
    gm = flops = instr = nrec = 0
    for c in sim.cores:
        used_types[c.type] = used_types.get(c.type, 0) + 1
        pipes_here = (S, V, MTE2, MTE3) if c.type == "aiv" else (S, M, MTE1, MTE2, FIX)
        for p in pipes_here:
            have[p] += 1
        for i, r in enumerate(c.recs):
            nrec += 1
            if r[0] < 7:
                busy_t[r[0]] += c.busy_end[i] - c.start[i]
                instr += r[2]
            gm += r[4]
            flops += r[7]
    span = makespan if makespan > 0 else 1.0
    busy = {PIPES[p]: busy_t[p] / (have[p] * span) for p in range(7) if have[p]}
    # what fraction of the whole chip's capacity each resource used
    util = {"HBM bandwidth": sim.hbm / (t["gm_bandwidth"] * span)}
    chip_aic, chip_aiv = t["cube_cores"], t["vector_cores"]
    # the L2's read rate of every core of the chip that has an MTE2 in this launch's core types
    l2_cores = (chip_aiv if used_types.get("aiv") else 0) + (chip_aic if used_types.get("aic") else 0)
    util["L2 read"] = sim.l2_hit / (sim.l2_rate * l2_cores * span) if l2_cores else 0.0
    util["Cube (M)"] = busy_t[M] / (chip_aic * span)
    util["vector (V)"] = busy_t[V] / (chip_aiv * span)
    util["L1->L0 (MTE1)"] = busy_t[MTE1] / (chip_aic * span)
    util["scalar (S)"] = busy_t[S] / ((chip_aiv if used_types.get("aiv") else chip_aic) * span)
    bound = max(util, key=util.get)
    if util[bound] < 0.5:
        bound = "latency / dependencies" + (f" (most used: {bound} {util[bound]:.0%})" if util[bound] > 0 else "")
    roof = roofline_seconds(flops, gm, t)
    floor, busiest, per_pipe = pipe_floor(sim)
    tr = chrome_trace(sim, launch, max_trace_events) if trace else None
    return LaunchModel(kernel=launch["kernel"], kind=launch["kind"], blocks=len(sim.cores), predicted_s=predicted,
                       busy=busy, utilization=util, bound=bound, roofline_s=roof,
                       pct_roofline=100.0 * roof / predicted if predicted > 0 else 0.0, gm_bytes=gm, flops=flops,
                       instructions=instr, records=nrec, table_version=t.version, trace=tr,
                       hbm_bytes=int(sim.hbm), l2_hit_bytes=int(sim.l2_hit), l2_writeback_bytes=int(sim.l2_wb),
                       l2_flush_s=flush_s, l2_dirty_end_bytes=int(sim.flush_bytes),
                       critical_path=critical_path(sim, t["launch_latency_s"]),
                       floor_s=floor + t["launch_latency_s"], busiest_pipe=busiest, pipe_floors=per_pipe)


def pipe_floor(sim: "_Sim") -> tuple:
    """The busiest pipe of a launch: (seconds, "PIPE of CORE", per-pipe floors) -- the largest sum, over
    one pipe of one core, of its instructions' least durations (:meth:`_Sim.min_busy`: a DMA with the
    L2 hits and misses of the modelled schedule, without the other cores' HBM traffic). A pipe runs one
    instruction at a time, so no reordering, buffering or flag change of the same instructions finishes
    the launch sooner (a MODEL: with the table's rates). To go past it a kernel must give that pipe
    less work (fewer bytes or instructions) or deal the work more evenly over the cores. The per-pipe
    floors map each pipe a core has to (busiest core's sum, mean over the cores that use it): the
    second is the floor a perfect deal of the same work would leave."""
    best, who = 0.0, ""
    hi = [0.0] * 7
    tot = [0.0] * 7
    users = [0] * 7
    for ci, c in enumerate(sim.cores):
        own = [0.0] * 7
        for i, r in enumerate(c.recs):
            if r[0] < 7:
                own[r[0]] += sim.min_busy(ci, i)
        for q in range(7):
            if own[q] > 0:
                hi[q] = max(hi[q], own[q])
                tot[q] += own[q]
                users[q] += 1
        p = max(range(7), key=lambda q: own[q])
        if own[p] > best:
            best, who = own[p], f"{PIPES[p]} of {c.type.upper()} block {c.block}"
    per = {PIPES[q]: (hi[q], tot[q] / users[q]) for q in range(7) if users[q]}
    return best, who, per


def critical_path(sim: "_Sim", launch_latency_s: float = 0.0) -> Dict[str, float]:
    """Where the time of a scheduled launch goes along its critical path (a MODEL).

    Walks back from the instruction that ends last: each instruction contributes its pipe's busy
    time (``"V busy"``, ``"MTE2 busy"``, ...; a DMA's busy time includes its HBM / L2 transfer) and
    the latency after it (``"MTE2 latency"``: the GM round trip; ``"MTE1 latency"``; a cross-core
    flag's propagation is ``"cross-core flag"``); then the walk moves to what released it last: a
    predecessor on another pipe (plus ``"flag latency"``), the core that set the flag it waited for,
    the previous instruction of its own pipe, or the scalar unit's in-order dispatch
    (``"dispatch"``: issue slots, and a cross-core wait or scalar instruction holding every
    instruction behind it until it completes). Any time an instruction sat ready but unstarted is
    ``"other"`` (none in this model's rules). ``"L2 write-back at the end"`` and ``"launch
    latency"`` complete the sum, so the causes add up to the predicted time."""
    out: Dict[str, float] = {}

    def add(k, v):
        if v > 0:
            out[k] = out.get(k, 0.0) + v

    names = PIPES + ("cross-core set", "cross-core wait")
    last = None
    for ci, c in enumerate(sim.cores):
        for i in range(c.n):
            if c.end[i] is not None and (last is None or c.end[i] > sim.cores[last[0]].end[last[1]]):
                last = (ci, i)
    add("L2 write-back at the end", getattr(sim, "flush_s", 0.0))
    add("launch latency", launch_latency_s)
    if last is None:
        return out
    prev_in_pipe = []
    for c in sim.cores:
        pp = [None] * c.n
        for q in c.fifo:
            for k in range(1, len(q)):
                pp[q[k]] = q[k - 1]
        last_s = {}
        for i, r in enumerate(c.recs):  # S and cross-core waits run in dispatch order on their own
            if r[0] in (S, WAIT):
                pp[i] = last_s.get(r[0])
                last_s[r[0]] = i
        prev_in_pipe.append(pp)

    def dispatched(c, i):  # when the scalar unit dispatched record i (the in-order issue cursor)
        if i == 0:
            return 0.0, None
        k = i - 1
        rk = c.recs[k]
        if rk[0] in (S, WAIT):
            return c.end[k], k
        return c.issue[k] + sim.issue_dt * rk[2], k

    ci, i = last
    with_latency = True  # False when the walk came through the pipe (freed before the latency ended)
    guard = sum(c.n for c in sim.cores) * 4 + 16
    while guard > 0:
        guard -= 1
        c = sim.cores[ci]
        r = c.recs[i]
        p = r[0]
        if p == SET:
            add("cross-core flag", c.end[i] - c.start[i])
        else:
            add(f"{names[p]} busy", c.busy_end[i] - c.start[i])
            if with_latency:
                add(f"{names[p]} latency", c.end[i] - c.busy_end[i])
        # what released record i: (time, kind, core, record, flag latency part)
        cands = []
        for j in c.deps[i]:
            fl = sim.flag_lat if c.recs[j][0] != p else 0.0
            cands.append((c.end[j] + fl, "dep", ci, j, fl))
        for core, rec in c.xdeps.get(i, ()):
            cands.append((sim.cores[core].end[rec], "x", core, rec, 0.0))
        j = prev_in_pipe[ci][i]
        if j is not None and p != SET:
            cands.append((c.busy_end[j] if c.recs[j][0] not in (S, WAIT) else c.end[j], "pipe", ci, j, 0.0))
        d, k = dispatched(c, i)
        cands.append((d, "disp", ci, k, 0.0))
        t_rel, kind, cj, j, fl = max(cands, key=lambda x: x[0])
        add("other", c.start[i] - t_rel)
        if kind == "disp":
            # the issue cursor: pipe instructions dispatched back to back, each taking issue slots,
            # back to an S / wait record (its end released them) or the start of the core
            while j is not None and c.recs[j][0] not in (S, WAIT):
                add("dispatch", sim.issue_dt * c.recs[j][2])
                j = dispatched(c, j)[1]
            if j is None:
                break
            i, with_latency = j, True
            continue
        add("flag latency", fl)
        ci, i, with_latency = cj, j, kind != "pipe"
    return out


def model_launches(launches: Iterable[dict], table=None, *, trace: bool = False) -> List[LaunchModel]:
    return [simulate(l, table, trace=trace) for l in launches]


def chrome_trace(sim: "_Sim", launch: dict, max_events: int = 200_000) -> dict:
    """The schedule as Chrome trace-event JSON (one process per core, one thread per pipe; times in
    microseconds of MODELLED A2 time). Launches with more records than ``max_events`` keep the first
    ones and say so in ``metadata``."""
    ev = []
    names = launch.get("names", [])
    pipe_names = PIPES + ("cross-core set", "cross-core wait")
    total = 0
    for ci, c in enumerate(sim.cores):
        ev.append({"ph": "M", "name": "process_name", "pid": ci, "args": {"name": f"{c.type.upper()} block {c.block}"}})
        for p in range(9):
            ev.append({"ph": "M", "name": "thread_name", "pid": ci, "tid": p, "args": {"name": pipe_names[p]}})
        for i, r in enumerate(c.recs):
            total += 1
            if len(ev) >= max_events:
                continue
            nm = names[r[1]] if r[1] < len(names) else "?"
            dur = (c.end[i] if r[0] in (SET,) else c.busy_end[i]) - c.start[i]
            args = {"count": r[2]}
            if r[4]:
                args["gm_bytes"] = r[4]
            if r[6]:
                args["macs"] = r[6]
            ev.append({"ph": "X", "name": nm, "pid": ci, "tid": r[0], "ts": c.start[i] * 1e6,
                       "dur": max(dur, 0.0) * 1e6, "args": args})
    flush = getattr(sim, "flush_s", 0.0)
    if flush > 0:  # the end-of-launch write-back of the dirty L2 lines
        pid = len(sim.cores)
        ev.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": "L2"}})
        ev.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": 0, "args": {"name": "write-back to HBM"}})
        ev.append({"ph": "X", "name": "L2 write-back of the dirty lines", "pid": pid, "tid": 0,
                   "ts": sim.run_end * 1e6, "dur": flush * 1e6, "args": {"dirty_bytes": sim.flush_bytes}})
    return {"traceEvents": ev, "displayTimeUnit": "ns",
            "metadata": {"kernel": launch["kernel"], "model": f"A2 (model, table a2 v{sim.t.version})",
                         "records": total, "truncated": total + 10 * len(sim.cores) > max_events}}


def write_trace(path: str, model: LaunchModel):
    """Write a LaunchModel's trace (simulate(..., trace=True)) to a .json file Perfetto opens."""
    if model.trace is None:
        raise ValueError("write_trace: the model has no trace; simulate it with trace=True")
    with open(path, "w") as f:
        json.dump(model.trace, f)
