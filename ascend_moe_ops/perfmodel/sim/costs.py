"""Per-op cost providers of the step simulator.

An op is an :class:`Op`: a kind (``"gemm"``, ``"grouped_gemm"``, ``"permute"``, ...), its FLOPs
and the bytes it moves, a dtype and the few shape numbers a provider may use. A provider turns an
op into seconds (``provider.time(op)``); communication is priced by :class:`LinkModel`
(``latency + bytes / bandwidth`` per message, the alpha-beta model).

Providers:

* :class:`RooflineCosts`: ``max(flops / (peak * eff_compute), bytes / (bw * eff_memory))`` plus a
  fixed launch overhead, from a hardware table (GPU: ``h100`` / ``h200``; A2: ``a2``, the peak
  derived from its cube cores, MACs per cycle and clock). The efficiencies are stated assumptions
  (arguments, printed with every result). ``per_launch`` takes measured or predicted per-launch
  seconds (e.g. the A2 kernel timeline's records) that override the roofline for the ops it knows.
* :class:`FittedCosts`: per op kind and dtype, ``t = c0 + c1 * flops + c2 * bytes + c3 * groups``
  fitted (non-negative least squares, relative error) to microbenchmark samples; what
  :mod:`ascend_moe_ops.perfmodel.validate` calibrates on this CPU. It can also be loaded from and
  saved to JSON.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from ..hardware import HardwareTable
from ...ops.checks import check_float, check_int

__all__ = ["Op", "CostProvider", "RooflineCosts", "FittedCosts", "LayerGlue", "LinkModel", "peak_flops",
           "DTYPE_BYTES"]

DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "fp8": 1}
COMPUTE_KINDS = ("gemm", "grouped_gemm", "grouped_gemm_dw", "attention")


@dataclass(frozen=True)
class Op:
    """One kernel launch (or one fused region) of a step."""

    name: str
    kind: str
    flops: float = 0.0
    bytes: float = 0.0
    dtype: str = "bfloat16"
    groups: int = 1
    rows: int = 0

    def scaled(self, f: float) -> "Op":
        return Op(self.name, self.kind, self.flops * f, self.bytes * f, self.dtype, self.groups,
                  int(self.rows * f))


class CostProvider:
    """Seconds of one op on one device. Subclasses implement :meth:`time`."""

    label = "cost provider"

    def time(self, op: Op) -> float:  # pragma: no cover - interface
        raise NotImplementedError

    def peak_flops(self, dtype: str) -> float:
        """Dense matmul peak (FLOP/s) used for MFU."""
        raise NotImplementedError

    def describe(self) -> dict:
        return {"label": self.label}


def peak_flops(table: HardwareTable, dtype: str = "bfloat16") -> float:
    """Dense matmul peak of a table: ``peak_<dtype>_flops`` if the table has it (GPU tables), else
    ``cube_cores * cube_macs_per_cycle_fp16 * 2 * clock_hz`` (A2: fp16/bf16 cube MACs per cycle,
    2 FLOPs per MAC; fp32 at a quarter, an assumption stated in the docs)."""
    key = f"peak_{_canon(dtype)}_flops"
    if key in table:
        return table[key]
    if "cube_cores" in table:
        p = table["cube_cores"] * table["cube_macs_per_cycle_fp16"] * 2 * table["clock_hz"]
        return p if _canon(dtype) in ("bf16", "fp16") else p / 4
    raise KeyError(f"hardware table {table.name!r} gives no matmul peak for {dtype} (needs {key!r} "
                   f"or cube_cores/cube_macs_per_cycle_fp16/clock_hz)")


def _canon(dtype: str) -> str:
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(dtype, dtype)


def memory_bandwidth(table: HardwareTable) -> float:
    for k in ("hbm_bandwidth", "gm_bandwidth"):
        if k in table:
            return table[k]
    raise KeyError(f"hardware table {table.name!r} has no memory bandwidth (hbm_bandwidth or gm_bandwidth)")


def _check_records(records: Mapping[str, float], known: Optional[Sequence[str]] = None) -> Dict[str, float]:
    """Per-launch seconds by op name: finite and >= 0; with ``known``, every name one of them."""
    if not isinstance(records, Mapping):
        raise TypeError(f"launch records must be a mapping of op name -> seconds, got {type(records).__name__}")
    out = {}
    for k, v in records.items():
        if not isinstance(k, str):
            raise TypeError(f"launch records: op names must be str, got {k!r}")
        out[k] = check_float(f"launch records[{k!r}]", v, finite=True, minimum=0, why=" (seconds)")
    if known is not None:
        bad = sorted(set(out) - set(known))
        if bad:
            raise ValueError(f"launch records: unknown op name {', '.join(map(repr, bad))} (it would be "
                             f"ignored); the simulator's ops: {', '.join(known)}")
    return out


class RooflineCosts(CostProvider):
    """Roofline per op from a hardware table, with stated efficiencies."""

    def __init__(self, table: HardwareTable, *, eff_compute: float = 0.6, eff_memory: float = 0.7,
                 launch_s: float = 5e-6, per_launch: Optional[Mapping[str, float]] = None):
        for name, v in (("eff_compute", eff_compute), ("eff_memory", eff_memory)):
            if not (0 < v <= 1):
                raise ValueError(f"RooflineCosts: {name} must be in (0, 1], got {v!r}")
        check_float("RooflineCosts: launch_s", launch_s, finite=True, minimum=0)
        self.table = table
        self.eff_compute, self.eff_memory, self.launch_s = eff_compute, eff_memory, launch_s
        self.per_launch = _check_records(per_launch or {})
        self.label = (f"roofline of {table.label}, eff_compute={eff_compute}, eff_memory={eff_memory} "
                      f"(assumptions)" + (f", {len(self.per_launch)} ops from per-launch records"
                                          if self.per_launch else ""))

    def with_launch_records(self, records: Mapping[str, float], known: Optional[Sequence[str]] = None) -> "RooflineCosts":
        """A copy that takes ``records[op.name]`` seconds for the ops named there (the hook for
        per-launch predictions, e.g. the A2 kernel timeline). Seconds must be finite and >= 0; with
        ``known`` (the op names of the caller's model), a name outside it is a ValueError."""
        records = _check_records(records, known)
        return RooflineCosts(self.table, eff_compute=self.eff_compute, eff_memory=self.eff_memory,
                             launch_s=self.launch_s, per_launch={**self.per_launch, **records})

    def peak_flops(self, dtype: str) -> float:
        return peak_flops(self.table, dtype)

    def time(self, op: Op) -> float:
        if op.name in self.per_launch:
            return self.per_launch[op.name]
        t_c = op.flops / (self.peak_flops(op.dtype) * self.eff_compute) if op.flops else 0.0
        t_m = op.bytes / (memory_bandwidth(self.table) * self.eff_memory) if op.bytes else 0.0
        return self.launch_s + max(t_c, t_m)

    def describe(self) -> dict:
        return {"label": self.label, "table": self.table.name, "version": self.table.version,
                "eff_compute": self.eff_compute, "eff_memory": self.eff_memory, "launch_s": self.launch_s}


# ----------------------------------------------------------------------------- fitted (CPU)
FEATURES = ("c0", "flops", "bytes", "groups")


def _features(op: Op) -> List[float]:
    return [1.0, op.flops, op.bytes, float(op.groups)]


def nnls_relative(X: Sequence[Sequence[float]], y: Sequence[float]) -> List[float]:
    """Non-negative least squares of ``X c ~ y`` in relative error (rows divided by ``y``), by
    active-set elimination: small, exact, no SciPy."""
    import torch
    A = torch.tensor([[v / t for v in row] for row, t in zip(X, y)], dtype=torch.float64)
    b = torch.ones(len(y), dtype=torch.float64)
    scale = A.abs().amax(0).clamp_min(1e-300)
    A = A / scale
    active = list(range(A.shape[1]))
    while active:
        sol = torch.linalg.lstsq(A[:, active], b.unsqueeze(1), driver="gelsd").solution.squeeze(1)
        if (sol >= 0).all():
            c = [0.0] * A.shape[1]
            for i, j in enumerate(active):
                c[j] = float(sol[i]) / float(scale[j])
            return c
        active.pop(int(torch.argmin(sol)))
    return [0.0] * A.shape[1]


def leave_out_select(groups: Sequence[Sequence], forms: Sequence[str], fit: Callable, accuracy: Callable):
    """Model selection by leaving one group out: for each form, fit on all groups but one
    (``fit(samples, form)``) and score the left-out group's samples (``accuracy(model, sample)``);
    returns ``(best form, {form: mean accuracy})``, ties (within 1e-9) to the earlier form."""
    scores = {}
    for f in forms:
        acc = []
        for i in range(len(groups)):
            model = fit([x for j, g in enumerate(groups) if j != i for x in g], f)
            acc += [accuracy(model, x) for x in groups[i]]
        scores[f] = statistics.mean(acc)
    best = forms[0]
    for f in forms[1:]:
        if scores[f] > scores[best] + 1e-9:
            best = f
    return best, scores


def _curve_time(points: Sequence[Sequence[float]], nbytes: float) -> float:
    """Seconds for ``nbytes`` from a measured ``(bytes, seconds)`` curve: the cost per byte is
    interpolated linearly in ``log(bytes)`` between the neighbouring points and held at the ends."""
    pts = sorted((float(b), float(t)) for b, t in points)
    if nbytes <= 0:
        return 0.0
    x = math.log(nbytes)
    xs = [math.log(b) for b, _ in pts]
    rs = [t / b for b, t in pts]
    if x <= xs[0]:
        return rs[0] * nbytes
    if x >= xs[-1]:
        return rs[-1] * nbytes
    for i in range(1, len(xs)):
        if x <= xs[i]:
            w = (x - xs[i - 1]) / (xs[i] - xs[i - 1]) if xs[i] > xs[i - 1] else 1.0
            return (rs[i - 1] + w * (rs[i] - rs[i - 1])) * nbytes
    return rs[-1] * nbytes


#: the smallest sample count at which :meth:`FittedCosts.fit` considers a per-byte curve
CURVE_MIN_SAMPLES = 4


@dataclass
class FittedCosts(CostProvider):
    """Per ``(kind, dtype)`` key one of two forms (``forms[key]``):

    * ``linear`` (default): ``t(op) = c0 + c1*flops + c2*bytes + c3*groups``;
    * ``curve`` (data-movement kinds only, no FLOPs): the measured cost per byte as a function of
      the bytes moved, interpolated in ``log(bytes)`` between the calibration points
      (``curves[key]``) -- what a working set falling out of a cache level does to a streaming op,
      which no single per-byte rate describes.

    :meth:`fit` chooses the form per key by leave-one-out over the calibration samples."""

    coefs: Dict[str, List[float]] = field(default_factory=dict)
    peaks: Dict[str, float] = field(default_factory=dict)
    note: str = ""
    label: str = "fitted to microbenchmarks of this machine"
    forms: Dict[str, str] = field(default_factory=dict)
    curves: Dict[str, List[List[float]]] = field(default_factory=dict)
    loo: Dict[str, Dict[str, float]] = field(default_factory=dict)

    @staticmethod
    def key(op: Op) -> str:
        return f"{op.kind}/{op.dtype}"

    @staticmethod
    def _linear(rows, k: str, features) -> List[float]:
        use = list((features or {}).get(k.split("/")[0], FEATURES))
        # a feature that is zero in every sample (FLOPs of a data-movement op) is left out
        use = [f for f in use if any(_features(op)[FEATURES.index(f)] for op, _ in rows)]
        if len(rows) < len(use):
            use = ["flops"] if rows[0][0].flops else ["bytes"]
        idx = [FEATURES.index(f) for f in use]
        X = [[_features(op)[i] for i in idx] for op, _ in rows]
        c = nnls_relative(X, [t for _, t in rows])
        full = [0.0] * len(FEATURES)
        for i, v in zip(idx, c):
            full[i] = v
        return full

    @classmethod
    def fit(cls, samples: Iterable[Tuple[Op, float]], *, features: Optional[Mapping[str, Sequence[str]]] = None,
            note: str = "", curves: bool = True) -> "FittedCosts":
        """Fit from ``(op, seconds)`` samples. ``features[kind]`` restricts the linear terms of a
        kind (default: all four); a kind with one sample gets ``c1 * flops`` or ``c2 * bytes`` only.
        With ``curves`` (default), a key whose samples have no FLOPs and at least
        :data:`CURVE_MIN_SAMPLES` distinct byte counts gets the form -- ``linear`` or ``curve`` --
        with the better leave-one-out mean accuracy ``1 - |p - t| / t`` over its samples (fit on
        all but one, predict it; ties to ``linear``); the scores are kept in ``loo``."""
        by: Dict[str, List[Tuple[Op, float]]] = {}
        for op, t in samples:
            if not (t > 0 and math.isfinite(t)):
                raise ValueError(f"FittedCosts.fit: sample time for {op.name} must be positive, got {t!r}")
            by.setdefault(cls.key(op), []).append((op, t))
        coefs, forms, crv, loo = {}, {}, {}, {}
        for k, rows in by.items():
            coefs[k] = cls._linear(rows, k, features)
            forms[k] = "linear"
            if not (curves and not any(op.flops for op, _ in rows)
                    and len({op.bytes for op, _ in rows}) >= CURVE_MIN_SAMPLES):
                continue
            def fit_form(rest, form, k=k):
                if form == "curve":
                    return lambda op: _curve_time([(o.bytes, s) for o, s in rest], op.bytes)
                c = cls._linear(rest, k, features)
                return lambda op: sum(a * b for a, b in zip(c, _features(op)))
            best, loo[k] = leave_out_select([[r] for r in rows], ("linear", "curve"), fit_form,
                                            lambda model, r: 1 - abs(model(r[0]) - r[1]) / r[1])
            if best == "curve":
                forms[k] = "curve"
                crv[k] = [[float(o.bytes), float(s)] for o, s in sorted(rows, key=lambda r: r[0].bytes)]
        return cls(coefs=coefs, note=note, forms=forms, curves=crv, loo=loo)

    def time(self, op: Op) -> float:
        k = self.key(op)
        c = self.coefs.get(k)
        if c is None:
            raise KeyError(f"FittedCosts has no calibration for {k!r} (op {op.name}); "
                           f"calibrated: {', '.join(sorted(self.coefs))}")
        if self.forms.get(k) == "curve":
            return _curve_time(self.curves[k], op.bytes)
        return sum(a * b for a, b in zip(c, _features(op)))

    def peak_flops(self, dtype: str) -> float:
        if dtype in self.peaks:
            return self.peaks[dtype]
        c = self.coefs.get(f"gemm/{dtype}")
        if not c or not c[1]:
            raise KeyError(f"FittedCosts: no dense gemm calibration for {dtype} to take a peak from")
        return 1.0 / c[1]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "FittedCosts":
        d = json.loads(text)
        return cls(coefs={k: list(map(float, v)) for k, v in d["coefs"].items()},
                   peaks=d.get("peaks", {}), note=d.get("note", ""), label=d.get("label", cls.label),
                   forms=d.get("forms", {}), curves=d.get("curves", {}), loo=d.get("loo", {}))


@dataclass
class LayerGlue:
    """Per-layer framework overhead that component microbenchmarks miss, per dtype, added once to
    a layer's summed op times ``s``: ``glue = g0 + g2 * sum(op.bytes) + gs * s``.

    What it stands for (on the CPU): the autograd engine's bookkeeping between the components,
    the gradient sums where two paths meet (``dx`` from the router and from the permute), the
    layer's small reshapes and allocations, caches colder or warmer than in a microbenchmark --
    none of them is inside a component's timed call. Fitted on whole layers at the *calibration*
    shapes: ``(dtype, summed op seconds, op bytes, measured layer seconds)`` per sample. All
    coefficients are fitted, not taken from a source; any may be negative.

    The terms used are the dtype's ``form`` (:data:`FORMS`): :meth:`fit` takes one form for every
    dtype; :meth:`select` chooses it per dtype by leave-one-out over the calibration layers
    themselves (fit on all but one, predict the one left out; the form with the best mean accuracy
    wins, ties to the simpler), so the choice never looks at a validation layer."""

    coefs: Dict[str, List[float]] = field(default_factory=dict)
    forms: Dict[str, str] = field(default_factory=dict)
    loo: Dict[str, Dict[str, float]] = field(default_factory=dict)

    #: the candidate forms, simplest first: which of ``g0`` (a constant), ``g2`` (per byte of the
    #: layer's ops) and ``gs`` (a fraction of the summed op time) are fitted
    FORMS = {"none": (), "const": (0,), "scale": (2,), "bytes": (1,), "const+bytes": (0, 1)}

    @staticmethod
    def _check(samples):
        by: Dict[str, List[Tuple[float, float, float]]] = {}
        for dtype, s, b, m in samples:
            if not (m > 0 and math.isfinite(m)) or not math.isfinite(s) or b < 0:
                raise ValueError(f"LayerGlue.fit: bad sample for {dtype}: summed={s!r}, bytes={b!r}, measured={m!r}")
            by.setdefault(dtype, []).append((s, b, m))
        return by

    @classmethod
    def _solve(cls, rows, form: str) -> List[float]:
        """``[g0, g2, gs]`` of ``form`` by least squares in relative error of the whole layer."""
        import torch
        terms = cls.FORMS[form]
        out = [0.0, 0.0, 0.0]
        if not terms:
            return out
        if len(rows) < len(terms):  # too few samples: the constant alone (the mean residual)
            out[0] = statistics.mean(m - s for s, _, m in rows)
            return out
        bscale = max(b for _, b, _ in rows) or 1.0
        cols = {0: lambda s, b, m: 1.0 / m, 1: lambda s, b, m: (b / bscale) / m, 2: lambda s, b, m: s / m}
        A = torch.tensor([[cols[t](s, b, m) for t in terms] for s, b, m in rows], dtype=torch.float64)
        y = torch.tensor([(m - s) / m for s, b, m in rows], dtype=torch.float64)
        sol = torch.linalg.lstsq(A, y.unsqueeze(1), driver="gelsd").solution.squeeze(1).tolist()
        for t, v in zip(terms, sol):
            out[t] = v / bscale if t == 1 else v
        return out

    @classmethod
    def fit(cls, samples: Iterable[Tuple[str, float, float, float]], form: str = "const+bytes") -> "LayerGlue":
        """``samples``: ``(dtype, summed_op_seconds, layer_op_bytes, measured_seconds)``; every
        dtype gets ``form``. With fewer samples than the form's terms a dtype gets ``g0`` only
        (the mean residual)."""
        if form not in cls.FORMS:
            raise ValueError(f"LayerGlue.fit: form must be one of {', '.join(cls.FORMS)}, got {form!r}")
        by = cls._check(samples)
        return cls({d: cls._solve(rows, form) for d, rows in by.items()}, {d: form for d in by})

    @classmethod
    def select(cls, samples: Iterable[Tuple[str, float, float, float]], forms: Sequence[str] = tuple(FORMS)) -> "LayerGlue":
        """Per dtype, the form of ``forms`` with the best leave-one-out mean accuracy
        ``1 - |p - m| / m`` over the samples (ties, within 1e-9, to the earlier form), fitted on
        all of them. A dtype with fewer than 3 samples gets the first form."""
        forms = tuple(forms)
        if not forms or any(f not in cls.FORMS for f in forms):
            raise ValueError(f"LayerGlue.select: forms must list at least one of {', '.join(cls.FORMS)}, got {forms!r}")
        by = cls._check(samples)
        coefs, chosen, loo = {}, {}, {}
        for d, rows in by.items():
            scores = {}
            if len(rows) >= 3:
                def acc(c, r):
                    s, b, m = r
                    return 1 - abs(s + c[0] + c[1] * b + c[2] * s - m) / m
                best, scores = leave_out_select([[r] for r in rows], list(forms), cls._solve, acc)
            else:
                best = forms[0]
            coefs[d], chosen[d], loo[d] = cls._solve(rows, best), best, scores
        return cls(coefs, chosen, loo)

    def time(self, dtype: str, op_bytes: float, summed: float = 0.0) -> float:
        """The glue of a ``dtype`` layer whose ops move ``op_bytes`` and take ``summed`` seconds."""
        c = self.coefs.get(dtype)
        if c is None:
            raise KeyError(f"LayerGlue has no calibration for dtype {dtype!r}; calibrated: {', '.join(sorted(self.coefs))}")
        g0, g2 = c[0], c[1]
        gs = c[2] if len(c) > 2 else 0.0
        return g0 + g2 * op_bytes + gs * summed

    def layer_time(self, costs: "CostProvider", ops: Sequence[Op]) -> float:
        """Summed op seconds under ``costs`` plus the glue (dtype of the first op)."""
        s = sum(costs.time(o) for o in ops)
        return s + self.time(ops[0].dtype, sum(o.bytes for o in ops), s)


# ----------------------------------------------------------------------------- communication
@dataclass(frozen=True)
class LinkModel:
    """Alpha-beta links: ``t = latency + bytes / bandwidth`` per message, per link class.

    ``intra_bw`` / ``inter_bw`` are the bytes per second one device can push into the node fabric
    and into the inter-node network (per direction); latencies are per message."""

    intra_bw: float
    inter_bw: float
    intra_latency: float = 0.0
    inter_latency: float = 0.0
    devices_per_node: int = 8

    def __post_init__(self):
        for k in ("intra_bw", "inter_bw"):
            check_float(f"LinkModel.{k}", getattr(self, k), finite=True)
            if not getattr(self, k) > 0:
                raise ValueError(f"LinkModel.{k} must be > 0, got {getattr(self, k)!r}")
        for k in ("intra_latency", "inter_latency"):
            check_float(f"LinkModel.{k}", getattr(self, k), finite=True, minimum=0)
        check_int("LinkModel.devices_per_node", self.devices_per_node, minimum=1)

    @classmethod
    def from_table(cls, table: HardwareTable) -> "LinkModel":
        return cls(intra_bw=table["intra_node_bandwidth"], inter_bw=table["inter_node_bandwidth"],
                   intra_latency=table["intra_node_latency"], inter_latency=table["inter_node_latency"],
                   devices_per_node=int(table["devices_per_node"]))

    def transfer(self, intra_bytes: float, inter_bytes: float, intra_msgs: int = 1, inter_msgs: int = 1) -> float:
        """One collective step: the intra- and inter-node parts go out concurrently."""
        ti = (self.intra_latency * intra_msgs + intra_bytes / self.intra_bw) if intra_bytes else 0.0
        te = (self.inter_latency * inter_msgs + inter_bytes / self.inter_bw) if inter_bytes else 0.0
        return max(ti, te)

    def ring(self, kind: str, nbytes: float, n: int, inter: bool) -> float:
        """Ring all-reduce / all-gather / reduce-scatter of ``nbytes`` (the full buffer) over ``n``
        devices: ``(n-1)/n * nbytes`` per device per pass (x2 for all-reduce), ``n-1`` (``2(n-1)``)
        latency steps."""
        if n <= 1 or nbytes <= 0:
            return 0.0
        passes = 2 if kind == "all_reduce" else 1
        bw, lat = (self.inter_bw, self.inter_latency) if inter else (self.intra_bw, self.intra_latency)
        return passes * ((n - 1) * lat + (n - 1) / n * nbytes / bw)
