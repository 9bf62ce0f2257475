"""What a bench module returns: :class:`Row` (a timing) and :class:`ParityRow` (an error check)."""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Dict, List, Optional, Tuple

import torch

from .timing import Timing, noise_flags

#: the kinds of limit a row is compared with (one table column and one chart panel each)
LIMIT_KINDS = ("bandwidth", "flops", "link")


@dataclasses.dataclass
class Row:
    """One timed case.

    ``seconds`` / peer values: a :class:`Timing` from ``ctx.time`` (a plain float is accepted, with
    no spread). ``limit``: "bandwidth" (``bytes``; compared with a copy of the same working set),
    "flops" (``flops``; compared with dense mm of ``mm_shape`` = (M, K, N), else a 2048^3 mm; when
    ``bytes`` is also given, the least bytes the case must move, the row also gets its roofline:
    ``max(flops / dense-mm rate, bytes / copy rate)``, both measured in the same run),
    "link" (``bytes`` over the link rate in ``extra["link_GBps"]``) or "none".
    ``path``: which framework call this row corresponds to (e.g. "unpermute, with probs -
    torch_npu/TE path").
    """

    op: str
    case: str
    backend: str
    dtype: str
    seconds: float
    bytes: Optional[int] = None
    flops: Optional[int] = None
    formula: str = ""
    limit: str = "bandwidth"
    peers: Dict[str, float] = dataclasses.field(default_factory=dict)
    extra: Dict[str, object] = dataclasses.field(default_factory=dict)
    path: str = ""
    mm_shape: Optional[Tuple[int, int, int]] = None

    @property
    def key(self) -> str:
        return f"{self.op} | {self.case} | {self.backend}"


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
    from ..testing import ERROR_FACTOR, TOLERANCES, max_abs_err
    atol, rtol = TOLERANCES[out.dtype] if out.dtype in TOLERANCES else (0.0, 0.0)
    bound = atol + rtol * (ref64.abs().max().item() if ref64.numel() else 0.0)
    if lowp is not None:
        bound += ERROR_FACTOR * max_abs_err(lowp, ref64)
    if not out.dtype.is_floating_point:  # index outputs: exact
        bound = 0.0
    return ParityRow(op, case, backend, str(out.dtype).replace("torch.", ""), max_abs_err(out, ref64), bound)


def _dtype(name: str):
    name = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(name, name)
    dt = getattr(torch, name, None)
    return dt if isinstance(dt, torch.dtype) else torch.float32


def _t(x) -> dict:
    if isinstance(x, Timing):
        return x.as_dict()
    return {"median_s": float(x), "iqr_s": None, "n": None, "threads": None}


def evaluate(row: Row, machine) -> Dict[str, object]:
    """Rates and limits of ``row`` (measuring the limits it needs in ``machine``)."""
    sec = float(row.seconds)
    out: Dict[str, object] = dict(rate=None, unit="", pct_copy=None, residency=None,
                                  pct_alloc_copy=None, pct_mm=None, pct_link=None, limit_note="",
                                  pct_roofline=None, roofline_bound=None)
    if not sec or math.isnan(sec):
        return out
    if row.limit == "flops" and row.flops:
        tf = row.flops / sec / 1e12
        if row.mm_shape:
            lim = machine.mm_tflops_for(*row.mm_shape, _dtype(row.dtype))
            out["limit_note"] = "dense mm {}x{}x{}".format(*row.mm_shape)
        else:
            lim = machine.mm_tflops(_dtype(row.dtype))
            out["limit_note"] = "dense mm 2048^3"
        out.update(rate=tf, unit="TFLOP/s", pct_mm=100 * tf / lim)
        if row.bytes:  # roofline: the slower of the compute and the memory limit, both measured
            t_flops = row.flops / (lim * 1e12)
            t_bytes = row.bytes / (machine.copy_gbps_for(row.bytes) * 1e9)
            out.update(pct_roofline=100 * max(t_flops, t_bytes) / sec,
                       roofline_bound="compute" if t_flops >= t_bytes else "memory")
            out["limit_note"] += (f"; roofline max({row.flops:.3g} FLOP / dense mm, "
                                  f"{row.bytes / 2**20:.1f} MiB / copy of that working set): "
                                  f"{out['roofline_bound']}-bound")
    elif row.limit == "bandwidth" and row.bytes:
        gb = row.bytes / sec / 1e9
        out.update(rate=gb, unit="GB/s", residency=machine.residency(row.bytes),
                   pct_alloc_copy=100 * gb / machine.copy_gbps_for(row.bytes, fresh=True),
                   limit_note=f"copy of the same {row.bytes / 2**20:.1f} MiB working set")
        pairs = getattr(row.seconds, "copy_pairs", None)
        if pairs:  # timed alternately with the copy (ctx.time_vs_copy): compare round by round
            cb = row.seconds.copy_bytes
            per_round = [100 * (row.bytes / to) / (cb / tc) for to, tc in pairs]
            out.update(pct_copy=statistics.median(per_round),
                       pct_copy_rounds=[round(v, 1) for v in per_round])
            out["limit_note"] += (f", timed alternately with the row ({len(pairs)} rounds, "
                                  f"{min(per_round):.0f}-{max(per_round):.0f} % per round)")
        else:
            out["pct_copy"] = 100 * gb / machine.copy_gbps_for(row.bytes)
    elif row.limit == "link" and row.bytes:
        gb = row.bytes / sec / 1e9
        link = row.extra.get("link_GBps")
        out.update(rate=gb, unit="GB/s")
        if link:
            out["pct_link"] = 100 * gb / float(link)
            out["limit_note"] = f"link {float(link):.3g} GB/s"
        else:
            out["limit_note"] = "no link limit (loopback: every link equally fast); compare with flat"
    return out


def row_record(row: Row, ev: Dict[str, object]) -> Dict[str, object]:
    """The JSON form of one row."""
    d = {k: v for k, v in dataclasses.asdict(row).items() if k not in ("seconds", "peers")}
    d["key"] = row.key
    d.update(_t(row.seconds))
    d["noise"] = noise_flags(row.seconds)
    d["peers"] = {name: dict(_t(t), speedup=(float(t) / float(row.seconds))
                             if float(row.seconds) > 0 else None)
                  for name, t in row.peers.items()}
    d.update(ev)
    return d


def rows_from_records(records: List[dict]) -> List[dict]:
    return [r for r in records if "key" in r]
