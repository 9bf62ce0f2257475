"""The "A2 (model)" column: every AscendC kernel of the package, at the benchmark's quick and Pangu
shapes, run once on the emulator with the timeline recorder on and scheduled on the Atlas A2 model
(:mod:`.a2_timeline`). Every time printed here is a MODEL, labelled with the hardware table's version;
nothing here was measured on an NPU.

Per op case: the predicted time (sum of its launches; one stream), the bound of its longest launch,
the roofline regime of its work (compute or HBM bandwidth) and the % of that roofline
(``roofline time / predicted time``, the roofline from the op's own FLOPs and compulsory bytes,
formulas stated). ``--sensitivity`` re-schedules every recording with each table entry x0.7 and x1.3
and lists which conclusions flip (the bound, or the >= 70 %-of-roofline verdict).

    python -m ascend_moe_ops.perfmodel.a2_bench --preset pangu [--sensitivity] [--trace-dir DIR] [--json F]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from typing import Callable, Dict, List, Optional

import torch

from .. import _cli
from . import a2_timeline as tl
from .hardware import HardwareTable, load_table

#: the benchmark's shapes (ascend_moe_ops/benchmark/runner.py PRESETS; bench_grouped_gemm's and
#: bench_mla_attention's cases)
PRESETS = {
    "quick": dict(T=1024, H=1024, E=64, K=8,
                  gemm=[(8, 2048, 1024, 704, "balanced"), (64, 4096, 512, 256, "fine")],
                  attn=[(512, 8)]),
    "pangu": dict(T=4096, H=7680, E=256, K=8,
                  gemm=[(32, 8192, 2048, 1408, "balanced"), (256, 16384, 512, 256, "fine")],
                  attn=[(1024, 8), (2048, 16)]),
    # the first Pangu attention case only (S=2048 H=16 records ~10 M instructions per kernel)
    "pangu-attn1": dict(T=4096, H=7680, E=256, K=8, gemm=[], attn=[(1024, 8)]),
    # Pangu Ultra MoE's training sequence (4096) with 2 of the 16 heads a TP8 rank holds (128 / 8):
    # the time per head is what the 16-head launch spends per head once all 24 AICs are busy (64
    # items here), at a ninth of the recording cost of S=2048 H=16
    "pangu-attn4k": dict(T=4096, H=7680, E=256, K=8, gemm=[], attn=[(4096, 2)]),
}
DN, DR, DV, DC = 128, 64, 128, 512  # MLA dims of DeepSeek-V3 / Pangu Ultra MoE
DQK = DN + DR
SCALE = 0.1352
TARGET_PCT = 70.0
#: table entries the sensitivity study leaves alone: core counts and memory sizes are facts of the
#: chip (and the recording's core count is fixed by the tiling), not rates. The L2 capacity stays in
#: the study: what the model's LRU keeps is not what the chip's partitioned L2 keeps.
FIXED = {"cube_cores", "vector_cores", "hbm_capacity", "ub_bytes", "l1_bytes"}


@dataclasses.dataclass
class Case:
    op: str
    case: str
    run: Callable[[], None]
    flops: int
    nbytes: int
    formula: str
    #: run before the recording starts (the inputs a backward case needs from its forward): without it
    #: ``--ops moe_unpermute`` or ``--ops "flash_attention bwd"`` alone recorded the forward launch too
    setup: Optional[Callable[[], None]] = None


@dataclasses.dataclass
class OpModel:
    op: str
    case: str
    predicted_s: float
    roofline_s: float
    pct_roofline: float
    regime: str
    bound: str
    launches: int
    records: int
    flops: int
    nbytes: int
    formula: str
    table_version: str
    kernels: List[str]
    busy: Dict[str, float] = dataclasses.field(default_factory=dict)  # of its longest launch
    hbm_bytes: int = 0        # charged to HBM (L2 read misses + writes), all launches
    l2_hit_bytes: int = 0     # GM reads served by L2, all launches
    #: the causes along the critical path of every launch, summed (seconds; add up to predicted_s)
    critical_path: Dict[str, float] = dataclasses.field(default_factory=dict)
    #: the launches' pipe floors summed (a2_timeline.pipe_floor) and the busiest pipe of the longest launch
    floor_s: float = 0.0
    busiest_pipe: str = ""
    #: pipe -> (busiest core, mean core) floors, each launch's plus its launch latency, summed over launches
    pipe_floors: Dict[str, tuple] = dataclasses.field(default_factory=dict)

    @property
    def pct_ceiling(self) -> float:
        """% of the roofline reachable at most without giving the busiest pipe less work (model)."""
        return 100.0 * self.roofline_s / max(self.floor_s, self.roofline_s) if self.floor_s > 0 else 0.0

    def to_json(self) -> dict:
        """The fields and the derived ceiling, for the JSON files."""
        return dict(dataclasses.asdict(self), pct_ceiling=self.pct_ceiling)

    @property
    def meets_target(self) -> bool:
        return self.pct_roofline >= TARGET_PCT


def _balanced(E, M):
    s = torch.full((E,), M // E, dtype=torch.int64)
    s[: M % E] += 1
    return s


def cases(preset: str) -> List[Case]:
    p = PRESETS[preset]
    out: List[Case] = []
    ops = torch.ops.ascend_moe_ops_emu
    bf = torch.bfloat16
    T, H, E, K = p["T"], p["H"], p["E"], p["K"]
    g = torch.Generator().manual_seed(0)
    tokens = torch.randn(T, H, generator=g).to(bf)
    routing = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    probs = torch.rand(T, K, generator=g)
    N = T * K
    state = {}

    def permute():
        state["perm"] = ops.moe_permute(tokens, routing, None, E, None, 1, None)

    def need_perm():
        if "perm" not in state:
            permute()

    def unpermute():
        perm, _, row_map, _, _ = state["perm"]
        ops.moe_unpermute(perm, row_map, probs)

    tag = f"T={T} H={H} E={E} K={K} bf16"
    out.append(Case("moe_permute", tag, permute, 0, (T * H + N * H) * 2 + T * K * 4 + N * 4,
                    "bytes = (T*H + N*H)*2 + T*K*4 + N*4 (read tokens, write N = T*K rows, int32 maps)"))
    out.append(Case("moe_unpermute", tag + " probs", unpermute, 0, (N * H + T * H) * 2 + T * K * 8,
                    "bytes = (N*H + T*H)*2 + T*K*8 (read N rows, write tokens, int32 map + fp32 probs)",
                    need_perm))
    for E_, M, K_, N_, kind in p["gemm"]:
        sizes = _balanced(E_, M)
        x = torch.randn(M, K_, generator=g).to(bf)
        w = torch.randn(E_, K_, N_, generator=g).to(bf)
        dy = torch.randn(M, N_, generator=g).to(bf)
        name = f"{kind} E{E_} M{M} K{K_} N{N_}"
        fl = 2 * M * K_ * N_
        out.append(Case("grouped_gemm fwd", name, lambda x=x, w=w, s=sizes: ops.grouped_gemm(x, w, s, False), fl,
                        (M * K_ + E_ * K_ * N_ + M * N_) * 2, "flops = 2*M*K*N; bytes = (M*K + E*K*N + M*N)*2"))
        out.append(Case("grouped_gemm dX", name, lambda d=dy, w=w, s=sizes: ops.grouped_gemm(d, w, s, True), fl,
                        (M * N_ + E_ * K_ * N_ + M * K_) * 2, "flops = 2*M*N*K; bytes = (M*N + E*K*N + M*K)*2"))
        out.append(Case("grouped_gemm dW", name, lambda x=x, d=dy, s=sizes: ops.grouped_gemm_dw(x, d, s), fl,
                        (M * K_ + M * N_ + E_ * K_ * N_) * 2,
                        "flops = 2*M*K*N; bytes = (M*K + M*N + E*K*N)*2"))
    for S, Hh in p["attn"]:
        P = S * (S + 1) // 2
        q = torch.randn(S, Hh, DQK, generator=g).to(bf)
        k = torch.randn(S, Hh, DQK, generator=g).to(bf)
        v = torch.randn(S, Hh, DV, generator=g).to(bf)
        cu = torch.tensor([0, S], dtype=torch.int32)
        fwd_st = {}

        def fa_fwd(q=q, k=k, v=v, cu=cu, S=S, st=fwd_st):
            st["o"] = ops.flash_attention_fwd(q, k, v, None, cu, cu, S, S, True, SCALE)

        def need_fwd(st=fwd_st, fwd=fa_fwd):
            if "o" not in st:
                fwd()

        def fa_bwd(q=q, k=k, v=v, cu=cu, S=S, st=fwd_st):
            o, lse = st["o"]
            ops.flash_attention_bwd(o, q, k, v, None, o, lse, cu, cu, S, S, True, SCALE)

        name = f"B=1 S={S} H={Hh} 192/128 causal"
        io = S * Hh * (2 * DQK + 2 * DV) * 2 + Hh * S * 4
        out.append(Case("flash_attention fwd", name, fa_fwd, 2 * Hh * P * (DQK + DV), io,
                        "flops = 2*H*P*(Dqk+Dv), P = S(S+1)/2; bytes = q, k, v, out (bf16) + lse (fp32)"))
        out.append(Case("flash_attention bwd", name, fa_bwd, 2 * Hh * P * (3 * DQK + 2 * DV),
                        2 * io + S * Hh * DV * 2,
                        "flops = 2*H*P*(3*Dqk+2*Dv); bytes = q, k, v, out, dout, dq, dk, dv (bf16) + lse",
                        need_fwd))
        out.append(_mla_case(S, Hh, g))
    return out


def _mla_case(S, Hh, g) -> Case:
    import ascend_moe_ops as amo
    bf = torch.bfloat16
    q = torch.randn(1, S, Hh, DQK, generator=g).to(bf)
    c = torch.randn(1, S, DC, generator=g).to(bf)
    kpe = torch.randn(1, S, DR, generator=g).to(bf)
    w = (torch.randn(Hh * (DN + DV), DC, generator=g) / DC ** 0.5).to(bf)

    def run():
        xs = [t.detach().requires_grad_() for t in (q, c, kpe, w)]
        with amo.use_backend("ascendc-emu"):
            out = amo.mla_attention(*xs, num_heads=Hh, qk_nope_dim=DN, v_dim=DV, softmax_scale=SCALE,
                                    causal=True, recompute="kv")
            out.backward(torch.ones_like(out))

    P = S * (S + 1) // 2
    attn = 2 * Hh * P * (DQK + DV) + 2 * Hh * P * (3 * DQK + 2 * DV)
    up = 2 * S * DC * Hh * (DN + DV)  # the K/V up-projection, forward, recomputed in backward, dX, dW
    flops = attn + 4 * up
    nbytes = (S * Hh * (2 * DQK + 2 * DV) + 2 * S * (DC + DR) + 2 * Hh * (DN + DV) * DC) * 2
    return Case("mla_attention fwd+bwd", f"B=1 S={S} H={Hh} Dc=512 recompute=kv", run, flops, nbytes,
                "flops = attention fwd+bwd + 4 x 2*S*Dc*H*(Dn+Dv) (up-projection fwd, recompute, dX, dW); "
                "bytes = q, dq, out, dout, c_kv, dc_kv, k_pe, dk_pe, w_kv_up, dw_kv_up")


def record_case(c: Case) -> List[dict]:
    """Run a case once on the emulator with the recorder on (Cube arithmetic skipped: timing only);
    its ``setup`` first, unrecorded."""
    if c.setup is not None:
        with tl.recording(skip_compute=True):
            c.setup()
    with tl.recording(skip_compute=True) as launches:
        c.run()
    return launches


def model_case(c: Case, launches: List[dict], table: HardwareTable, trace_dir: Optional[str] = None) -> OpModel:
    ms = [tl.simulate(l, table, trace=trace_dir is not None) for l in launches]
    if trace_dir:
        os.makedirs(trace_dir, exist_ok=True)
        for i, m in enumerate(ms):
            fn = f"{c.op}_{c.case}_{i}_{m.kernel}".replace(" ", "_").replace("/", "-").replace("=", "")
            tl.write_trace(os.path.join(trace_dir, fn + ".json"), m)
    pred = sum(m.predicted_s for m in ms)
    roof = tl.roofline_seconds(c.flops, c.nbytes, table)
    regime = "compute" if c.flops / tl.peak_flops(table) >= c.nbytes / table["gm_bandwidth"] else "HBM bandwidth"
    main = max(ms, key=lambda m: m.predicted_s)
    return OpModel(c.op, c.case, pred, roof, 100.0 * roof / pred if pred else 0.0, regime, main.bound, len(ms),
                   sum(m.records for m in ms), c.flops, c.nbytes, c.formula, table.version,
                   sorted({m.kernel for m in ms}), dict(main.busy), sum(m.hbm_bytes for m in ms),
                   sum(m.l2_hit_bytes for m in ms), _sum_paths(ms), sum(m.floor_s for m in ms),
                   main.busiest_pipe, _sum_floors(ms, table["launch_latency_s"]))


def _sum_paths(ms) -> Dict[str, float]:
    out: Dict[str, float] = {}
    for m in ms:
        for k, v in m.critical_path.items():
            out[k] = out.get(k, 0.0) + v
    return out


def _sum_floors(ms, launch_s: float) -> Dict[str, tuple]:
    out: Dict[str, tuple] = {}
    for m in ms:
        for p, (hi, mean) in m.pipe_floors.items():
            a, b = out.get(p, (0.0, 0.0))
            out[p] = (a + hi + launch_s, b + mean + launch_s)
    return out


def format_pipe_floors(models: List[OpModel], top: int = 4) -> str:
    """One line per op: the ceiling (roofline / floor) each pipe sets, on its busiest core and on the
    mean core (what a perfect deal of the same work would leave), lowest first."""
    lines = ["pipe floors (model): % of roofline each pipe allows at most, busiest core (mean core)"]
    for m in models:
        parts = sorted(m.pipe_floors.items(), key=lambda kv: -kv[1][0])[:top]
        lines.append(f"  {m.op} | {m.case}: " + ", ".join(
            f"{p} {100 * m.roofline_s / hi:.0f} % ({100 * m.roofline_s / mean:.0f} %)" for p, (hi, mean) in parts))
    return "\n".join(lines)


def format_critical_paths(models: List[OpModel], top: int = 5) -> str:
    """One line per op: the largest causes along its launches' critical paths, % of its predicted
    time (a2_timeline.critical_path)."""
    lines = ["critical path (model): where the predicted time goes, largest causes first"]
    for m in models:
        parts = sorted(m.critical_path.items(), key=lambda kv: -kv[1])[:top]
        lines.append(f"  {m.op} | {m.case}: " + ", ".join(
            f"{k} {100 * v / m.predicted_s:.0f} %" for k, v in parts if m.predicted_s > 0))
    return "\n".join(lines)


def run(preset: str, table=None, ops: Optional[List[str]] = None, trace_dir: Optional[str] = None,
        log=print):
    """Record and model every case of ``preset``; returns [(Case, launches, OpModel)]."""
    t = load_table("a2") if table is None else table
    out = []
    for c in cases(preset):
        if ops and not any(c.op.startswith(o) for o in ops):
            continue
        t0 = time.monotonic()
        launches = record_case(c)
        t1 = time.monotonic()
        m = model_case(c, launches, t, trace_dir)
        log(f"  {c.op} | {c.case}: {m.predicted_s * 1e6:.1f} us (model), {m.pct_roofline:.0f} % of the "
            f"{m.regime} roofline (ceiling {m.pct_ceiling:.0f} %: {m.busiest_pipe}), bound {m.bound}; "
            f"{m.records} records, recorded in {t1 - t0:.1f} s, "
            f"scheduled in {time.monotonic() - t1:.1f} s")
        out.append((c, launches, m))
    return out


def format_busy(busy: Dict[str, float]) -> str:
    """Busy fraction of each pipe the launch has, e.g. "MTE2 95 / M 31 / MTE1 14 / FIX 9 / S 0"."""
    return " / ".join(f"{p} {100 * busy[p]:.0f}" for p in tl.PIPES if p in busy)


def format_table(models: List[OpModel], title: str = "") -> str:
    cols = ["op", "case", "A2 (model) us", "% roofline (model)", "ceiling (model): busiest pipe", "roofline regime",
            "bound (model)", "launches", "busy % per pipe (model)", "HBM / L2-hit MB (model)"]
    lines = [[m.op, m.case, f"{m.predicted_s * 1e6:.1f}", f"{m.pct_roofline:.0f}%",
              f"{m.pct_ceiling:.0f}%: {m.busiest_pipe}", m.regime, m.bound,
              str(m.launches), format_busy(m.busy), f"{m.hbm_bytes / 1e6:.0f} / {m.l2_hit_bytes / 1e6:.0f}"]
             for m in models]
    w = [max(len(str(x)) for x in col) for col in zip(cols, *lines)]
    fmt = "  ".join("{:<%d}" % k for k in w)
    out = [title] if title else []
    out += [fmt.format(*cols), fmt.format(*["-" * k for k in w])] + [fmt.format(*l) for l in lines]
    if models:
        out.append(f"every number above is a MODEL of Atlas A2 (table a2 v{models[0].table_version}), "
                   "not a measurement; formulas: " + "; ".join(sorted({f"{m.op}: {m.formula}" for m in models})))
    return "\n".join(out)


def _bound_class(bound: str) -> str:
    """The bound without its detail ("latency / dependencies (most used: ...)" -> "latency / dependencies")."""
    return bound.split(" (")[0]


def sensitivity(results, table=None, factors=(0.7, 1.3), keys: Optional[List[str]] = None):
    """Re-schedule every recording with each table entry scaled; returns rows
    (key, factor, [(op, case, what flipped)])."""
    t = load_table("a2") if table is None else table
    base = {(c.op, c.case): m for c, _, m in results}
    keys = keys or [k for k in t.params if k not in FIXED]
    rows = []
    for k in keys:
        for f in factors:
            s = t.scaled({k: f})
            flips = []
            for c, launches, _ in results:
                m = model_case(c, launches, s)
                b = base[(c.op, c.case)]
                if _bound_class(m.bound) != _bound_class(b.bound):
                    flips.append((c.op, c.case, f"bound {b.bound} -> {m.bound}"))
                if m.meets_target != b.meets_target:
                    flips.append((c.op, c.case, f">= {TARGET_PCT:.0f} % of roofline: {b.meets_target} -> "
                                  f"{m.meets_target} ({b.pct_roofline:.0f} -> {m.pct_roofline:.0f} %)"))
            rows.append((k, f, flips))
    return rows


def format_sensitivity(rows) -> str:
    out = ["parameter  factor  conclusions that flip (model)"]
    for k, f, flips in rows:
        what = "; ".join(f"{op} {case}: {w}" for op, case, w in flips) or "none"
        out.append(f"{k}  x{f:g}  {what}")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="quick")
    ap.add_argument("--ops", nargs="*", help="op name prefixes (default: every AscendC kernel)")
    ap.add_argument("--table", default="a2", help="hardware table name or JSON path")
    ap.add_argument("--sensitivity", action="store_true", help="each table entry x0.7 and x1.3")
    ap.add_argument("--sensitivity-keys", nargs="*",
                    help="with --sensitivity: only these table entries (default: every rate and latency)")
    ap.add_argument("--trace-dir", type=_cli.output_dir, help="write a Chrome / Perfetto trace of every launch there")
    ap.add_argument("--json", type=_cli.output_file, help="write the results (and the sensitivity rows) to this file")
    a = ap.parse_args(argv)
    try:
        table = tl._table(a.table)  # loaded, and holding every entry the timeline reads
    except (ValueError, OSError) as exc:  # TableError is a ValueError
        ap.error(f"--table: {exc}")
    if a.ops:
        names = sorted({c.op for c in cases(a.preset)})
        bad = [o for o in a.ops if not any(n.startswith(o) for n in names)]
        if bad:
            ap.error(f"--ops: {', '.join(map(repr, bad))} matches no case of preset {a.preset}; "
                     f"available ops: {', '.join(names)}")
    if a.sensitivity_keys is not None and not a.sensitivity:
        ap.error("--sensitivity-keys needs --sensitivity")
    if a.sensitivity_keys:
        valid = [k for k in table.params if k not in FIXED]
        bad = [k for k in a.sensitivity_keys if k not in valid]
        if bad:
            ap.error(f"--sensitivity-keys: unknown key {', '.join(map(repr, bad))}; "
                     f"valid: {', '.join(valid)}")
    res = run(a.preset, table, a.ops, a.trace_dir)
    models = [m for _, _, m in res]
    print(format_table(models, f"AscendC kernels, preset {a.preset}: {table.label}"))
    print()
    print(format_critical_paths(models))
    print()
    print(format_pipe_floors(models))
    sens = None
    if a.sensitivity:
        sens = sensitivity(res, table, keys=a.sensitivity_keys or None)
        print()
        print(format_sensitivity(sens))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"label": table.label, "preset": a.preset,
                       "models": [m.to_json() for m in models],
                       "sensitivity": [dict(param=k, factor=fa, flips=fl) for k, fa, fl in (sens or [])]},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
