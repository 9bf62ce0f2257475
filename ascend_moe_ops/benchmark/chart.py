"""PNG chart of a run: one panel per kind of limit (% of the limit measured in the same run, with a
100 % line) and one panel of speed-ups against the peers; bars past the axis are cut and annotated
with their value instead of squashing every other bar."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

PANELS = (("pct_copy", "% of a copy of the same working set"),
          ("pct_mm", "% of dense mm of the same shape"),
          ("pct_link", "% of the link rate"))


def _label(r: dict, width: int = 70) -> str:
    s = f"{r['op']} {r['case']} [{r['backend']}]"
    return s if len(s) <= width else s[:width - 1] + "…"


def _axis_cap(values: List[float], floor: float) -> float:
    """x-axis end: the largest value unless it is an outlier (> 2x the 75th percentile)."""
    vs = sorted(values)
    q3 = vs[int(0.75 * (len(vs) - 1))]
    top = vs[-1]
    cap = top if top <= 2 * max(q3, floor * 0.5) else 2 * max(q3, floor * 0.5)
    return max(cap, floor) * 1.08


def _label_axes(ax, labels: List[str], xlabel: str) -> None:
    """Row labels top to bottom in the records' order, small fonts so long case names fit."""
    ax.set_yticks(list(range(len(labels))))
    ax.set_yticklabels(labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel, fontsize=8)
    ax.tick_params(axis="x", labelsize=7)


def render(records: List[dict], path: Path, title: str) -> Optional[str]:
    """Write the chart; returns None, or why no chart was written."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"no chart: {exc}"
    fig = figure(records, title)
    if fig is None:
        return "no chart: no rows with a rate or a peer"
    fig.savefig(path, dpi=110, bbox_inches="tight", pad_inches=0.2)  # never clip a label
    plt.close(fig)
    return None


def figure(records: List[dict], title: str):
    """The chart's matplotlib figure (the caller closes it); None when no row has a rate or a peer."""
    import matplotlib.pyplot as plt
    panels = []
    for key, xlabel in PANELS:
        rs = [r for r in records if r.get(key) is not None]
        if rs:
            panels.append((xlabel, [_label(r) for r in rs], [r[key] for r in rs], 100.0, "%"))
    peer = [(f"{_label(r, 48)} vs {name[:28]}", p["speedup"]) for r in records
            for name, p in r.get("peers", {}).items() if p.get("speedup")]
    if peer:
        panels.append(("speed-up vs peer timed in the same run (peer time / ours, log scale; "
                       "right of 1x: ours faster)", [p[0] for p in peer], [p[1] for p in peer], 1.0, "x"))
    if not panels:
        return None
    heights = [max(1.2, 0.26 * len(p[1]) + 0.9) for p in panels]
    longest = max(len(lab) for p in panels for lab in p[1])
    width = 7.5 + 0.062 * longest  # inches: the bars get 7.5, the 7-pt labels the rest
    total = sum(heights) + 0.8  # inches
    fig, axes = plt.subplots(len(panels), 1, figsize=(width, total),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    for ax, (xlabel, labels, vals, ref, unit) in zip(axes[:, 0], panels):
        y = range(len(vals))
        if unit == "x":  # ratios: log axis, bars from 1x (slower to the left, faster to the right)
            lo, hi = min(min(vals), 0.5) / 1.5, max(max(vals), 2.0) * 1.5
            ax.barh(y, [v - 1.0 for v in vals], left=1.0, height=0.7,
                    color=["#3b7dd8" if v >= 1 else "#d8843b" for v in vals])
            ax.set_xscale("log")
            ax.set_xlim(lo, hi)
            ax.axvline(1.0, color="black", lw=1, ls="--")
            for i, v in enumerate(vals):
                ax.annotate(f"{v:.3g}x", (v, i), xytext=(3 if v >= 1 else -3, 0),
                            textcoords="offset points", va="center", ha="left" if v >= 1 else "right",
                            fontsize=7)
            _label_axes(ax, labels, xlabel)
            continue
        cap = _axis_cap(vals, 1.5 * ref)  # up to 150 % always shown as is
        shown = [min(v, cap) for v in vals]
        colors = ["#3b7dd8" if v >= ref else "#d8843b" for v in vals]
        ax.barh(y, shown, color=colors, height=0.7)
        ax.axvline(ref, color="black", lw=1, ls="--")
        ax.set_xlim(0, cap)
        for i, (v, s) in enumerate(zip(vals, shown)):
            txt = f"{v:.0f}%" if unit == "%" else f"{v:.2f}x"
            if v > cap:
                ax.annotate(f"{txt} (cut)", (s, i), xytext=(-4, 0), textcoords="offset points",
                            ha="right", va="center", fontsize=7, color="white", fontweight="bold")
            else:
                ax.annotate(txt, (s, i), xytext=(3, 0), textcoords="offset points", va="center",
                            fontsize=7)
        _label_axes(ax, labels, xlabel)
    fig.suptitle(title, fontsize=9, y=1 - 0.12 / total, va="top")
    # the title a fixed 0.12 in from the top and 0.35 in kept free for it: the default suptitle sits
    # at 98 % of the height, 0.8 in down a 38-in chart (the quick preset), on the first labels
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / total))
    return fig
