"""MFU audit of a reported training throughput: the MFU each FLOPs convention gives, and the peak
each convention would need to give the reported MFU.

``MFU = tokens/s * FLOPs_per_token / (devices * peak)``; the report's figures (Pangu Ultra MoE,
arXiv 2505.04519): 30.0 % at 1.46M tokens/s on "6K" NPUs and 18.9 % at 0.61M tokens/s on "4K".
Which convention reproduces them depends on the peak; the implied peak per convention is printed
next to each MFU so that a reader can check it against the chip's public figure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence

from .model import CONVENTIONS, ModelSpec, flops_per_token

__all__ = ["REPORTED", "Reported", "audit", "format_audit"]


@dataclass(frozen=True)
class Reported:
    label: str
    tokens_per_s: float
    devices: int
    mfu: float


#: the report's two figures; "6K" / "4K" read as 6144 / 4096 NPUs (an assumption: the report
#: rounds; 6000 / 4000 would raise every MFU below by 2.4 %)
REPORTED = (Reported("6K NPUs, 1.46M tokens/s (report: MFU 30.0 %)", 1.46e6, 6144, 0.300),
            Reported("4K NPUs, 0.61M tokens/s (report: MFU 18.9 %)", 0.61e6, 4096, 0.189))


def audit(model: ModelSpec, peak: float, reported: Sequence[Reported] = REPORTED) -> List[Dict]:
    """One row per (reported figure, convention): MFU at ``peak`` and the peak implied by the
    reported MFU."""
    if not peak > 0:
        raise ValueError(f"audit: peak must be a positive FLOP/s figure, got {peak!r}")
    rows = []
    for r in reported:
        for name, (desc, formula) in CONVENTIONS.items():
            fpt = flops_per_token(model, name)
            achieved = r.tokens_per_s * fpt / r.devices
            rows.append(dict(figure=r.label, convention=name, formula=formula, flops_per_token=fpt,
                             mfu=achieved / peak, reported_mfu=r.mfu, implied_peak=achieved / r.mfu,
                             matches=abs(achieved / peak - r.mfu) < 0.005))
    return rows


def format_audit(rows: List[Dict], peak: float) -> str:
    out = [f"peak used: {peak / 1e12:.1f} TFLOP/s per device", "",
           "| figure | convention | FLOPs/token | MFU at this peak | reported | peak that gives the reported MFU |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['figure']} | {r['convention']} (`{r['formula']}`) | {r['flops_per_token']:.4g} | "
                   f"{100 * r['mfu']:.1f} %{' ✓' if r['matches'] else ''} | {100 * r['reported_mfu']:.1f} % | "
                   f"{r['implied_peak'] / 1e12:.0f} TFLOP/s |")
    return "\n".join(out)
