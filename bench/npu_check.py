"""NPU check of the AscendC kernels: parity, then timings against torch_npu (not run in CI).

NEVER RUN ON AN NPU: no Ascend machine was available when this was written. Only the
``--device cpu`` smoke mode below has run (in CI, tests/test_npu_check_script.py).

On an Ascend machine with torch_npu and the built library (docs/ascend.md, "Building on a CANN
machine")::

    python bench/npu_check.py                      # every op, the issue-sized shapes, bf16
    python bench/npu_check.py --json out.json      # also write everything as JSON
    python bench/npu_check.py --ops permute grouped_gemm --shapes smoke   # quick first contact

For each op it first checks parity: our op on the NPU against the CPU fp64 reference (backend
``reference``), with the bound of ``ascend_moe_ops.bench.parity_row`` — ``ERROR_FACTOR * err(lowp)
+ atol + rtol * max|ref|``, ``lowp`` being the reference run on the CPU in the op's own low
precision and ``(atol, rtol)`` from ``ascend_moe_ops.testing.TOLERANCES`` of the op's dtype (as
``assert_close_to_ref(..., dtype=...)`` uses it); data movement (permute) must be bitwise equal.
Then it times ours and, where one exists, the torch_npu baseline on the same inputs with the
project's one harness (``ascend_moe_ops.benchmark``: median of ``--iters`` runs after
``--warmup``; each run read from a clock that first calls ``torch.npu.synchronize``). A baseline that fails
to import or to run is reported with the reason and skipped. The machine limits are measured in the
same run: copy bandwidth (``dst.copy_(src)``, 1 GiB fp32 buffers, ``dst`` preallocated; bytes = 2 x
1 GiB) and dense bf16 ``torch.mm`` at 8192 (flops = 2*8192^3).

Shapes (``--shapes full``, the default on the NPU):

* permute / unpermute: Pangu Ultra MoE T=4096, H=7680, E=256, K=8, bf16, dropless (N = T*K rows),
  forward and backward. Baselines: ``torch_npu.npu_moe_token_permute`` /
  ``npu_moe_token_unpermute`` (backward through their autograd).
* grouped_gemm: E=32 experts x 128 rows and fine-grained E=256 x 64 rows, K=7680 -> N=2048, bf16;
  fwd (``x @ W_e``), dX (``dy @ W_e^T``), dW (``x_e^T @ dy_e``). Baseline
  ``torch_npu.npu_grouped_matmul`` (single-tensor x/y, cumulative ``group_list``; dW with
  ``group_type=2``).
* flash_attention: MLA dims q/k 192 = 128 nope + 64 shared rope key (``k_rope [T, 64]``), v 128,
  S=4096, H=16, causal, bf16, fwd and fwd+bwd. Baseline ``torch_npu.npu_fusion_attention``
  (TND, then BSND; the rope key expanded per head and concatenated outside the timed region).
* mla_attention: same S/H/dims with latent 512 (``w_kv_up [H*256, 512]``), recompute="kv".
  Baseline: the naive MLA on torch_npu — ``F.linear`` up-projection, per-head expanded rope key,
  ``npu_fusion_attention`` (autograd for fwd+bwd).

Byte / FLOP formulas (``s`` = bytes per element, N = T*K; index and prob traffic left out; the
same strings are in the JSON):

* permute fwd: ``T*H*s + N*H*s`` (read every token once, write every row once)
* permute bwd: ``N*H*s + T*H*s`` (grad tokens = unweighted unpermute of the row gradients)
* unpermute fwd: ``N*H*s + T*H*s``
* unpermute bwd: ``T*H*s + 2*N*H*s`` (read grad out, read rows for d probs, write row gradients)
* grouped_gemm fwd / dX / dW: ``flops = 2*M*K*N``, M = sum(group_sizes)
* flash_attention fwd: ``flops = 2*H*P*(Dqk+Dv)``, P = S(S+1)/2 causal pairs, Dqk=192, Dv=128;
  fwd+bwd adds ``2*H*P*(3*Dqk+2*Dv)`` (backward incl. the QK^T recompute)
* mla_attention: the flash_attention flops plus the up-projection ``U = 2*S*Dc*H*(Dn+Dv)``: fwd
  ``+U``, fwd+bwd ``+4U`` (forward, recompute, dC, dW)

Rates and "% of limit" are those of our op: bandwidth rows against the measured copy bandwidth,
FLOP rows against the measured dense bf16 mm. "speed-up" = baseline ms / ours ms (> 1: ours faster).

The fp64 reference of the full shapes runs on the host CPU (the attention reference materializes
the H x S x S scores: an estimated ~10 GiB of host memory at S=4096, H=16; the grouped GEMM reference
runs a few experts at a time); ``--skip-parity`` skips it, ``--shapes smoke`` checks parity quickly.

``--device cpu`` is a smoke test of this script: tiny shapes, our ops on CPU tensors with the
``ascendc-emu`` backend forced (the AscendC kernel sources on the CPU emulation layer), no
baselines; its timings mean nothing. Exit status: 0 when every parity check passed and every op ran,
1 otherwise, 2 when there is no usable NPU.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import importlib.util
import json
import math
import sys
import time
import traceback

OPS = ("permute", "unpermute", "grouped_gemm", "flash_attention", "mla_attention")

SHAPES = {
    "full": dict(T=4096, H=7680, E=256, K=8,
                 gg=[("E32x128", 32, 128), ("E256x64", 256, 64)], gg_K=7680, gg_N=2048,
                 S=4096, heads=16, Dc=512,
                 copy_mib=1024, mm_n=8192),
    "smoke": dict(T=48, H=256, E=16, K=4,
                  gg=[("E4x32", 4, 32), ("E16x8", 16, 8)], gg_K=128, gg_N=64,
                  S=40, heads=2, Dc=512,
                  copy_mib=8, mm_n=256),
}
DN, DR, DV = 128, 64, 128  # MLA head dims: q/k nope 128 + shared rope 64, v 128
DQK = DN + DR
MLA_SCALE = 0.1352  # DeepSeek-V3's YaRN-adjusted softmax scale (bench/bench_mla_attention.py)

FORMULAS = {
    ("permute", "fwd"): "bytes = T*H*s + N*H*s (N = T*K)",
    ("permute", "bwd"): "bytes = N*H*s + T*H*s",
    ("unpermute", "fwd"): "bytes = N*H*s + T*H*s",
    ("unpermute", "bwd"): "bytes = T*H*s + 2*N*H*s",
    ("grouped_gemm", "fwd"): "flops = 2*M*K*N (M = sum(group_sizes))",
    ("grouped_gemm", "dX"): "flops = 2*M*K*N",
    ("grouped_gemm", "dW"): "flops = 2*M*K*N",
    ("flash_attention", "fwd"): "flops = 2*H*P*(Dqk+Dv), P = S(S+1)/2",
    ("flash_attention", "fwd+bwd"): "flops = 2*H*P*(Dqk+Dv) + 2*H*P*(3*Dqk+2*Dv)",
    ("mla_attention", "fwd"): "flops = 2*H*P*(Dqk+Dv) + U, U = 2*S*Dc*H*(Dn+Dv)",
    ("mla_attention", "fwd+bwd"): "flops = 2*H*P*(Dqk+Dv) + 2*H*P*(3*Dqk+2*Dv) + 4*U",
}
COPY_FORMULA = "GB/s = 2 * buffer bytes / t (dst.copy_(src), dst preallocated, fp32)"
MM_FORMULA = "TFLOP/s = 2*n^3 / t (torch.mm, bf16, n x n)"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["npu", "cpu"], default="npu",
                   help="cpu = smoke test with the ascendc-emu backend and tiny shapes")
    p.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    p.add_argument("--shapes", choices=sorted(SHAPES), default=None,
                   help="full (default on npu) or smoke (default and only choice on cpu)")
    p.add_argument("--iters", type=int, default=20, help="timed runs per case (median reported)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--skip-parity", action="store_true")
    p.add_argument("--no-baselines", action="store_true", help="do not time the torch_npu ops")
    p.add_argument("--json", default=None, help="write limits, parity and timings to this file")
    args = p.parse_args(argv)
    if args.iters < 1 or args.warmup < 0:
        p.error("--iters must be >= 1 and --warmup >= 0")
    if args.shapes is None:
        args.shapes = "full" if args.device == "npu" else "smoke"
    if args.device == "cpu" and args.shapes != "smoke":
        p.error("--device cpu runs the emulator: use the smoke shapes")
    return args


def _err(exc) -> str:
    return f"{type(exc).__name__}: {exc}"[:300]


# --------------------------------------------------------------------------------------- timing
class Timer:
    """Median seconds of ``fn()`` with the project's one harness
    (``ascend_moe_ops.benchmark.timing.measure``: torch.utils.benchmark underneath, exactly
    ``--iters`` single-call runs after ``--warmup``); on the NPU the clock it reads synchronizes the
    device first, so a run is the wall time from launch to completion."""

    def __init__(self, device, iters, warmup):
        import torch
        self.torch = torch
        self.device = device
        self.iters, self.warmup = iters, warmup
        self.method = ("ascend_moe_ops.benchmark harness (torch.utils.benchmark.Timer), "
                       + ("torch.npu.synchronize() before each clock read" if device.type == "npu"
                          else "wall clock (cpu)"))
        self.last = None  # the last Timing (median, IQR, runs)

    def sync(self):
        if self.device.type == "npu":
            self.torch.npu.synchronize()

    def __call__(self, fn, iters=None):
        from ascend_moe_ops.benchmark.timing import measure
        self.sync()
        self.last = measure(fn, device=self.device, runs=iters or self.iters, warmup=self.warmup)
        return float(self.last)


def measure_limits(device, shp, timer):
    import torch
    n = shp["copy_mib"] * 2**20 // 4
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    t = timer(lambda: dst.copy_(src), iters=max(timer.iters, 5))
    copy_gbps = 2 * n * 4 / t / 1e9
    del src, dst
    m = shp["mm_n"]
    a = torch.randn(m, m, device=device).to(torch.bfloat16)
    b = torch.randn(m, m, device=device).to(torch.bfloat16)
    t = timer(lambda: torch.mm(a, b), iters=max(timer.iters, 5))
    mm_tflops = 2 * m**3 / t / 1e12
    return dict(copy_GBps=round(copy_gbps, 2), copy_MiB=shp["copy_mib"], copy_formula=COPY_FORMULA,
                mm_bf16_TFLOPs=round(mm_tflops, 4), mm_n=m, mm_formula=MM_FORMULA)


# --------------------------------------------------------------------------------------- parity
class Parity:
    """One output's parity against the fp64 reference, fed in chunks (same numbers as
    ``ascend_moe_ops.bench.parity_row`` on the whole tensor, with the tolerance of ``dtype``)."""

    def __init__(self, op, case, output, dtype, exact=False):
        self.op, self.case, self.output, self.dtype, self.exact = op, case, output, dtype, exact
        self.max_err = 0.0
        self.ref_max = 0.0
        self.lowp_err = 0.0
        self.equal = True
        self.note = ""

    def add(self, out, ref64, lowp=None):
        import torch
        from ascend_moe_ops.testing import max_abs_err
        out = out.detach().cpu()
        if tuple(out.shape) != tuple(ref64.shape):
            self.equal = False
            self.max_err = math.inf
            self.note = f"shape {tuple(out.shape)} != reference {tuple(ref64.shape)}"
            return
        if self.exact:
            self.equal = self.equal and out.dtype == ref64.dtype and torch.equal(out, ref64)
        err = max_abs_err(out, ref64) if out.numel() else 0.0
        self.max_err = max(self.max_err, math.inf if math.isnan(err) else err)
        if ref64.numel():
            self.ref_max = max(self.ref_max, ref64.double().abs().max().item())
        if lowp is not None and lowp.numel():
            self.lowp_err = max(self.lowp_err, max_abs_err(lowp.detach().cpu(), ref64))

    def row(self):
        from ascend_moe_ops.testing import ERROR_FACTOR, TOLERANCES
        if self.exact:
            bound, ok, rule = 0.0, self.equal, "bitwise equal"
        else:
            atol, rtol = TOLERANCES[self.dtype]
            bound = atol + rtol * self.ref_max + ERROR_FACTOR * self.lowp_err
            ok = self.max_err <= bound
            rule = f"{ERROR_FACTOR:g}*err(lowp) + atol + rtol*max|ref| ({str(self.dtype)[6:]})"
        return dict(op=self.op, case=self.case, output=self.output, max_err=self.max_err,
                    bound=bound, ok=bool(ok), rule=rule, note=self.note)


# --------------------------------------------------------------------------------------- the run
class Run:
    def __init__(self, args):
        import torch
        import ascend_moe_ops as amo
        self.torch, self.amo, self.args = torch, amo, args
        self.shp = SHAPES[args.shapes]
        self.device = torch.device("npu:0" if args.device == "npu" else "cpu")
        self.dtype = torch.bfloat16
        self.timer = Timer(self.device, args.iters, args.warmup)
        self.parity, self.results, self.errors = [], [], []
        self.npu = None  # the module whose ops are the baselines (None: no baselines)
        self.npu_version = "not used"
        self.baseline_note = ""
        if self.device.type == "cpu":
            self.baseline_note = "cpu smoke mode: no baselines"
        else:
            import torch_npu
            self.npu_version = getattr(torch_npu, "__version__", "?")
            if args.no_baselines:
                self.baseline_note = "--no-baselines"
            else:
                self.npu = torch_npu

    # which implementation runs "ours": the PrivateUse1 kernels on the NPU, ascendc-emu on the CPU
    def ours(self):
        if self.device.type == "cpu":
            return self.amo.use_backend("ascendc-emu")
        return contextlib.nullcontext()

    def reference(self):
        return self.amo.use_backend("reference")

    def gen(self, seed):
        return self.torch.Generator(device="cpu").manual_seed(seed)

    def dev(self, t):
        return None if t is None else t.to(self.device)

    def check(self, op, case, output, out, ref64, lowp=None, dtype=None, exact=False):
        p = Parity(op, case, output, dtype or self.dtype, exact=exact)
        p.add(out, ref64, lowp)
        self.parity.append(p.row())

    def check_fwd_bwd(self, op, case, names, run):
        """Parity of an attention op: ``run(device, dtype, backend)`` gives the outputs ``names``
        (forward ``out`` / ``lse``, then the gradients), ours on this device against the reference
        on CPU in fp64 and in this dtype (skipped with --skip-parity)."""
        if self.args.skip_parity:
            return
        ours = run(self.device, self.dtype, self.ours)
        ref64 = run("cpu", self.torch.float64, self.reference)
        lowp = run("cpu", self.dtype, self.reference)
        for name, a, r, l in zip(names, ours, ref64, lowp):
            self.check(op, case + (" fwd" if name in ("out", "lse") else " bwd"), name, a, r, l)

    def baseline(self, name, candidates):
        """First of ``candidates`` (label, fn) that runs; ``(label, fn, None)`` or
        ``(None, None, reason)``."""
        if self.npu is None:
            return None, None, self.baseline_note
        reasons = []
        for label, fn in candidates:
            try:
                fn()
                self.timer.sync()
                return label, fn, None
            except Exception as exc:
                reasons.append(f"{label}: {_err(exc)}")
        why = "; ".join(reasons) or "no candidate"
        print(f"  baseline {name} not used: {why}")
        return None, None, why

    def time_case(self, op, case, ours_fn, amount, kind, base=(None, None, None)):
        label, base_fn, base_why = base
        row = dict(op=op, case=case, ours_ms=None, baseline=label, baseline_ms=None,
                   baseline_error=base_why or None, speedup=None, rate=None,
                   unit="GB/s" if kind == "bytes" else "TFLOP/s", pct_limit=None,
                   amount=amount, formula=FORMULAS[(op, case.split(" ")[-1])])
        try:
            t = self.timer(ours_fn)
            row["ours_ms"] = t * 1e3
            if kind == "bytes":
                row["rate"] = amount / t / 1e9
                row["pct_limit"] = 100 * row["rate"] / self.limits["copy_GBps"]
            else:
                row["rate"] = amount / t / 1e12
                row["pct_limit"] = 100 * row["rate"] / self.limits["mm_bf16_TFLOPs"]
        except Exception as exc:
            row["error"] = _err(exc)
            self.errors.append(f"{op} {case}: {row['error']}")
        if base_fn is not None:
            try:
                tb = self.timer(base_fn)
                row["baseline_ms"] = tb * 1e3
                if row["ours_ms"]:
                    row["speedup"] = row["baseline_ms"] / row["ours_ms"]
            except Exception as exc:
                row["baseline_error"] = _err(exc)
        self.results.append(row)

    # ----------------------------------------------------------------------- permute, unpermute
    def _routing(self):
        torch = self.torch
        T, H, E, K = (self.shp[k] for k in "THEK")
        g = self.gen(0)
        tokens = torch.randn(T, H, generator=g).to(self.dtype)
        ids = torch.rand(T, E, generator=g).topk(K, dim=1).indices  # K distinct experts per token
        probs = torch.softmax(torch.randn(T, K, generator=g), dim=1)
        return tokens, ids, probs

    def op_permute(self):
        torch, amo = self.torch, self.amo
        T, H, E, K = (self.shp[k] for k in "THEK")
        N, s = T * K, 2
        tokens, ids, probs = self._routing()
        g = self.gen(1)
        g_rows = torch.randn(N, H, generator=g).to(self.dtype)
        g_probs = torch.randn(N, generator=g)
        td, idd, pd, grd = self.dev(tokens), self.dev(ids), self.dev(probs), self.dev(g_rows)
        case = f"T{T} H{H} E{E} K{K}"
        if not self.args.skip_parity:
            with self.ours():
                res = amo.moe_permute(td, idd, pd, num_experts=E)
            with self.reference():
                ref = amo.moe_permute(tokens, ids, probs, num_experts=E)
            for name, a, b in zip(ref._fields, res, ref):
                self.check("permute", case + " fwd", name, a, b, exact=True)

            def grads(device, x, p, backend):
                x = x.to(device).clone().requires_grad_()
                p = p.to(device).clone().requires_grad_()
                with backend():
                    r = amo.moe_permute(x, ids.to(device), p, num_experts=E)
                    dx, dp = torch.autograd.grad((r.tokens, r.probs), (x, p),
                                                 (g_rows.to(device, x.dtype), g_probs.to(device, p.dtype)))
                return dx.cpu(), dp.cpu()

            dx, dp = grads(self.device, tokens, probs, self.ours)
            rx, rp = grads("cpu", tokens.double(), probs.double(), self.reference)
            lx, lp = grads("cpu", tokens, probs, self.reference)
            self.check("permute", case + " bwd", "grad tokens", dx, rx, lx)
            self.check("permute", case + " bwd", "grad probs", dp, rp, lp, dtype=torch.float32)

        def ours_fwd():
            with self.ours():
                return amo.moe_permute(td, idd, pd, num_experts=E)

        base = self.baseline("npu_moe_token_permute", [
            ("torch_npu.npu_moe_token_permute", lambda: self.npu.npu_moe_token_permute(td, idd)),
            ("torch_npu.npu_moe_token_permute (int32 ids)",
             lambda: self.npu.npu_moe_token_permute(td, idd.int())),
        ])
        self.time_case("permute", case + " fwd", ours_fwd, T * H * s + N * H * s, "bytes", base)

        xl = td.detach().clone().requires_grad_()
        with self.ours():
            r = amo.moe_permute(xl, idd, pd, num_experts=E)

        def ours_bwd():
            with self.ours():
                return torch.autograd.grad(r.tokens, xl, grd, retain_graph=True)

        base_b = (None, None, base[2])
        if base[1] is not None:
            xb = td.detach().clone().requires_grad_()
            ids_b = idd.int() if "int32" in base[0] else idd
            yb = self.npu.npu_moe_token_permute(xb, ids_b)[0]
            base_b = self.baseline("npu_moe_token_permute backward", [
                (base[0] + " autograd", lambda: torch.autograd.grad(yb, xb, grd, retain_graph=True))])
        self.time_case("permute", case + " bwd", ours_bwd, N * H * s + T * H * s, "bytes", base_b)

    def op_unpermute(self):
        torch, amo = self.torch, self.amo
        T, H, E, K = (self.shp[k] for k in "THEK")
        N, s = T * K, 2
        tokens, ids, probs = self._routing()
        with self.reference():
            ref = amo.moe_permute(tokens, ids, probs, num_experts=E)
        rows = (ref.tokens.float() * 1.5 + 0.25).to(self.dtype)  # not the plain inverse of permute
        rmap = ref.row_id_map
        gout = torch.randn(T, H, generator=self.gen(2)).to(self.dtype)
        rd, md, pd, gd = self.dev(rows), self.dev(rmap), self.dev(probs), self.dev(gout)
        op_bwd = torch.ops.ascend_moe_ops.moe_unpermute_backward.default
        case = f"T{T} H{H} E{E} K{K}"
        if not self.args.skip_parity:
            with self.ours():
                out = amo.moe_unpermute(rd, md, pd).cpu()
                again = amo.moe_unpermute(rd, md, pd).cpu()
                gx, gp = (t.cpu() for t in op_bwd(gd, rd, md, pd))
            with self.reference():
                ref64 = amo.moe_unpermute(rows.double(), rmap, probs.double())
                lowp = amo.moe_unpermute(rows, rmap, probs)
                rx, rp = op_bwd(gout.double(), rows.double(), rmap, probs.double())
                lx, lp = op_bwd(gout, rows, rmap, probs)
            self.check("unpermute", case + " fwd", "out", out, ref64, lowp)
            self.check("unpermute", case + " fwd", "bitwise repeatable", again, out, exact=True)
            self.check("unpermute", case + " bwd", "grad rows", gx, rx, lx)
            self.check("unpermute", case + " bwd", "grad probs", gp, rp, lp, dtype=torch.float32)

        def ours_fwd():
            with self.ours():
                return amo.moe_unpermute(rd, md, pd)

        def ours_bwd():
            with self.ours():
                return op_bwd(gd, rd, md, pd)

        base_f = base_b = (None, None, self.baseline_note)
        if self.npu is not None:
            try:  # the baseline's own permuted layout of the same tokens (same rows, its index)
                td, idd = self.dev(tokens), self.dev(ids)
                perm, sorted_idx = self.npu.npu_moe_token_permute(td, idd)[:2]
                perm = (perm.float() * 1.5 + 0.25).to(self.dtype)
            except Exception as exc:
                perm = None
                base_f = base_b = (None, None, f"npu_moe_token_permute (to build the input): {_err(exc)}")
                print(f"  baseline npu_moe_token_unpermute not used: {base_f[2]}")
            if perm is not None:
                unp = self.npu.npu_moe_token_unpermute
                cands = [("torch_npu.npu_moe_token_unpermute (bf16 probs)",
                          lambda: unp(perm, sorted_idx, pd.to(self.dtype))),
                         ("torch_npu.npu_moe_token_unpermute (fp32 probs)",
                          lambda: unp(perm, sorted_idx, pd))]
                base_f = self.baseline("npu_moe_token_unpermute", cands)
                if base_f[1] is not None:
                    pl = (pd.to(self.dtype) if "bf16" in base_f[0] else pd).detach().clone().requires_grad_()
                    xl = perm.detach().clone().requires_grad_()
                    yb = unp(xl, sorted_idx, pl)
                    base_b = self.baseline("npu_moe_token_unpermute backward", [
                        (base_f[0] + " autograd",
                         lambda: torch.autograd.grad(yb, (xl, pl), gd, retain_graph=True))])
                else:
                    base_b = base_f
        self.time_case("unpermute", case + " fwd", ours_fwd, N * H * s + T * H * s, "bytes", base_f)
        self.time_case("unpermute", case + " bwd", ours_bwd, T * H * s + 2 * N * H * s, "bytes", base_b)

    # ----------------------------------------------------------------------- grouped GEMM
    def op_grouped_gemm(self):
        for name, E, rows in self.shp["gg"]:
            self._grouped_gemm_case(name, E, rows)

    def _grouped_gemm_case(self, name, E, rows):
        torch, amo = self.torch, self.amo
        K, N = self.shp["gg_K"], self.shp["gg_N"]
        M = E * rows
        g = self.gen(3)
        sizes = torch.full((E,), rows, dtype=torch.int64)
        x = torch.randn(M, K, generator=g).to(self.dtype)
        w = (torch.randn(E, K, N, generator=g) / K ** 0.5).to(self.dtype)
        dy = torch.randn(M, N, generator=g).to(self.dtype)
        xd, wd, dyd, sd = self.dev(x), self.dev(w), self.dev(dy), self.dev(sizes)
        gg = torch.ops.ascend_moe_ops.grouped_gemm.default
        case = f"{name} K{K} N{N}"
        passes = {
            "fwd": lambda: gg(xd, wd, sd, False),
            "dX": lambda: gg(dyd, wd, sd, True),
            "dW": lambda: amo.grouped_gemm_dw(xd, dyd, sd),
        }
        if not self.args.skip_parity:
            # the fp64 reference, a few experts at a time (the E=256 weights are 30 GiB in fp64)
            chunk = max(1, (2**30) // (K * N * 8))
            for pname, fn in passes.items():
                with self.ours():
                    out = fn().cpu()
                p = Parity("grouped_gemm", f"{case} {pname}", "out", self.dtype)
                for e0 in range(0, E, chunk):
                    e1 = min(E, e0 + chunk)
                    r0, r1 = e0 * rows, e1 * rows
                    sz = sizes[e0:e1]
                    xs, ws, dys = x[r0:r1], w[e0:e1], dy[r0:r1]
                    with self.reference():
                        if pname == "fwd":
                            ref64 = amo.grouped_gemm(xs.double(), ws.double(), sz)
                            lowp = amo.grouped_gemm(xs, ws, sz)
                            got = out[r0:r1]
                        elif pname == "dX":
                            ref64 = amo.grouped_gemm(dys.double(), ws.double(), sz, trans_b=True)
                            lowp = amo.grouped_gemm(dys, ws, sz, trans_b=True)
                            got = out[r0:r1]
                        else:
                            ref64 = amo.grouped_gemm_dw(xs.double(), dys.double(), sz)
                            lowp = amo.grouped_gemm_dw(xs, dys, sz)
                            got = out[e0:e1]
                    p.add(got, ref64, lowp)
                self.parity.append(p.row())
                del out
        flops = 2 * M * K * N
        gl = torch.cumsum(sd, 0)  # cumulative group_list (group_list_type 0)
        gmm = self.npu.npu_grouped_matmul if self.npu is not None else None
        copies = {}

        def once(name, make):  # a transposed copy made on first use, outside the timed calls
            if name not in copies:
                copies[name] = make()
            return copies[name]

        base_cands = {
            "fwd": [("torch_npu.npu_grouped_matmul", lambda: gmm([xd], [wd], group_list=gl, split_item=3,
                                                             group_type=0)[0])],
            "dX": [("torch_npu.npu_grouped_matmul (W^T view)",
                    lambda: gmm([dyd], [wd.transpose(1, 2)], group_list=gl, split_item=3, group_type=0)[0]),
                   ("torch_npu.npu_grouped_matmul (W^T copied once, untimed)",
                    lambda: gmm([dyd], [once("wT", lambda: wd.transpose(1, 2).contiguous())], group_list=gl,
                                split_item=3, group_type=0)[0])],
            "dW": [("torch_npu.npu_grouped_matmul group_type=2 (x^T view)",
                    lambda: gmm([xd.t()], [dyd], group_list=gl, split_item=3, group_type=2)[0]),
                   ("torch_npu.npu_grouped_matmul group_type=2 (x^T copied once, untimed)",
                    lambda: gmm([once("xT", lambda: xd.t().contiguous())], [dyd], group_list=gl,
                                split_item=3, group_type=2)[0])],
        }
        for pname, fn in passes.items():
            def ours_fn(fn=fn):
                with self.ours():
                    return fn()
            base = self.baseline(f"grouped_gemm {pname}", base_cands[pname])
            self.time_case("grouped_gemm", f"{case} {pname}", ours_fn, flops, "flops", base)

    # ----------------------------------------------------------------------- attention
    def _attn_inputs(self, seed):
        torch = self.torch
        S, Hh = self.shp["S"], self.shp["heads"]
        g = self.gen(seed)
        f64 = dict(generator=g, dtype=torch.float64)
        q = torch.randn(S, Hh, DQK, **f64)
        k = torch.randn(S, Hh, DN, **f64)
        v = torch.randn(S, Hh, DV, **f64)
        kr = torch.randn(S, DR, **f64)
        gout = torch.randn(S, Hh, DV, **f64)
        cu = torch.tensor([0, S], dtype=torch.int32)
        return q, k, v, kr, gout, cu

    def _attn_flops(self, with_bwd):
        S, Hh = self.shp["S"], self.shp["heads"]
        P = S * (S + 1) // 2
        f = 2 * Hh * P * (DQK + DV)
        return f + (2 * Hh * P * (3 * DQK + 2 * DV) if with_bwd else 0)

    def _fusion_attention(self, S, Hh, scale):
        """torch_npu.npu_fusion_attention candidates (causal, one sequence of S tokens, Hh heads):
        (label, fn(q, k, v) -> out) with q/k/v [S, Hh, D]."""
        torch, fa = self.torch, self.npu.npu_fusion_attention
        mask = torch.ones(2048, 2048, dtype=torch.bool, device=self.device).triu(1)
        return [
            ("torch_npu.npu_fusion_attention TND",
             lambda q, k, v: fa(q, k, v, Hh, "TND", atten_mask=mask, scale=scale, actual_seq_qlen=[S],
                                actual_seq_kvlen=[S], sparse_mode=3)[0]),
            ("torch_npu.npu_fusion_attention BSND",
             lambda q, k, v: fa(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), Hh, "BSND",
                                atten_mask=mask, scale=scale, sparse_mode=2)[0]),
        ]

    def op_flash_attention(self):
        torch = self.torch
        ops = torch.ops.ascend_moe_ops
        S, Hh = self.shp["S"], self.shp["heads"]
        q, k, v, kr, gout, cu = self._attn_inputs(4)
        scale = DQK ** -0.5
        case = f"S{S} H{Hh} {DN}+{DR}/{DV}"
        lo = lambda t: t.to(self.dtype)
        qd, kd, vd, krd, gd = (self.dev(lo(t)) for t in (q, k, v, kr, gout))
        cud = self.dev(cu)

        def run(dev, dt, backend):
            c = lambda t: t.to(dt).to(dev)
            cu_d = cu.to(dev)
            with backend():
                out, lse = ops.flash_attention_fwd(c(q), c(k), c(v), c(kr), cu_d, cu_d, S, S, True, scale)
                grads = ops.flash_attention_bwd(c(gout), c(q), c(k), c(v), c(kr), out, lse, cu_d,
                                                cu_d, S, S, True, scale)
            return [t.cpu() for t in (out, lse, *grads)]

        self.check_fwd_bwd("flash_attention", case, ["out", "lse", "dq", "dk", "dv", "dk_rope"], run)

        def ours_fwd():
            with self.ours():
                return ops.flash_attention_fwd(qd, kd, vd, krd, cud, cud, S, S, True, scale)

        def ours_fwdbwd():
            with self.ours():
                out, lse = ops.flash_attention_fwd(qd, kd, vd, krd, cud, cud, S, S, True, scale)
                return ops.flash_attention_bwd(gd, qd, kd, vd, krd, out, lse, cud, cud, S, S, True, scale)

        base_f = base_fb = (None, None, self.baseline_note)
        if self.npu is not None:
            kfull = torch.cat([kd, krd[:, None, :].expand(-1, Hh, -1)], dim=-1).contiguous()
            cands = self._fusion_attention(S, Hh, scale)
            base_f = self.baseline("npu_fusion_attention",
                                   [(lab, lambda f=f: f(qd, kfull, vd)) for lab, f in cands])
            if base_f[1] is not None:
                f = dict(cands)[base_f[0]]
                leaves = [t.detach().clone().requires_grad_() for t in (qd, kfull, vd)]
                base_fb = self.baseline("npu_fusion_attention fwd+bwd", [
                    (base_f[0] + " + autograd",
                     lambda: torch.autograd.grad(f(*leaves), leaves, gd))])
            else:
                base_fb = base_f
        self.time_case("flash_attention", case + " fwd", ours_fwd, self._attn_flops(False), "flops", base_f)
        self.time_case("flash_attention", case + " fwd+bwd", ours_fwdbwd, self._attn_flops(True), "flops",
                       base_fb)

    def op_mla_attention(self):
        torch = self.torch
        ops = torch.ops.ascend_moe_ops
        S, Hh, Dc = self.shp["S"], self.shp["heads"], self.shp["Dc"]
        g = self.gen(5)
        f64 = dict(generator=g, dtype=torch.float64)
        q = torch.randn(S, Hh, DQK, **f64)
        c = torch.randn(S, Dc, **f64)
        kpe = torch.randn(S, DR, **f64)
        w = torch.randn(Hh * (DN + DV), Dc, **f64) / Dc ** 0.5
        gout = torch.randn(S, Hh, DV, **f64)
        cu = torch.tensor([0, S], dtype=torch.int32)
        case = f"S{S} H{Hh} latent {Dc}"
        args = (S, Hh, DN, DV, MLA_SCALE, True)

        def run(dev, dt, backend):
            cv = lambda t: t.to(dt).to(dev)
            xs = [cv(t) for t in (q, c, kpe, w)]
            with backend():
                out, lse, kv = ops.mla_attention_fwd(*xs, cu.to(dev), S, Hh, DN, DV, MLA_SCALE, True, False)
                grads = ops.mla_attention_bwd(cv(gout), *xs, out, lse, kv, cu.to(dev), *args)
            return [t.cpu() for t in (out, lse, *grads)]

        self.check_fwd_bwd("mla_attention", case, ["out", "lse", "dq", "dc_kv", "dk_pe", "dw_kv_up"], run)

        qd, cd, kd, wd, gd = (self.dev(t.to(self.dtype)) for t in (q, c, kpe, w, gout))
        cud = self.dev(cu)

        def ours_fwd():
            with self.ours():
                return ops.mla_attention_fwd(qd, cd, kd, wd, cud, S, Hh, DN, DV, MLA_SCALE, True, False)

        def ours_fwdbwd():
            with self.ours():
                out, lse, kv = ops.mla_attention_fwd(qd, cd, kd, wd, cud, S, Hh, DN, DV, MLA_SCALE, True, False)
                return ops.mla_attention_bwd(gd, qd, cd, kd, wd, out, lse, kv, cud, *args)

        U = 2 * S * Dc * Hh * (DN + DV)
        base_f = base_fb = (None, None, self.baseline_note)
        if self.npu is not None:
            import torch.nn.functional as F
            cands = dict(self._fusion_attention(S, Hh, MLA_SCALE))

            def naive(att, q_, c_, kpe_, w_):
                kv = F.linear(c_, w_).view(S, Hh, DN + DV)
                k_nope, v = kv.split([DN, DV], dim=-1)
                kf = torch.cat([k_nope, kpe_[:, None, :].expand(-1, Hh, -1)], dim=-1)
                return att(q_, kf, v.contiguous())

            base_f = self.baseline("naive MLA on npu_fusion_attention",
                                   [(f"F.linear + {lab}", lambda f=f: naive(f, qd, cd, kd, wd))
                                    for lab, f in cands.items()])
            if base_f[1] is not None:
                f = cands[base_f[0][len("F.linear + "):]]
                leaves = [t.detach().clone().requires_grad_() for t in (qd, cd, kd, wd)]
                base_fb = self.baseline("naive MLA fwd+bwd", [
                    (base_f[0] + " + autograd",
                     lambda: torch.autograd.grad(naive(f, *leaves), leaves, gd))])
            else:
                base_fb = base_f
        self.time_case("mla_attention", case + " fwd", ours_fwd, self._attn_flops(False) + U, "flops", base_f)
        self.time_case("mla_attention", case + " fwd+bwd", ours_fwdbwd, self._attn_flops(True) + 4 * U,
                       "flops", base_fb)

    # ----------------------------------------------------------------------- driver
    def go(self):
        torch = self.torch
        from ascend_moe_ops import _npu
        if self.device.type == "npu":
            self.device_name = torch.npu.get_device_name(0)
        else:
            self.device_name = "cpu (ascendc-emu smoke mode)"
        print(f"npu_check {_dt.datetime.now(_dt.timezone.utc):%Y-%m-%d %H:%M} UTC; device {self.device_name}; "
              f"torch {torch.__version__}; torch_npu {self.npu_version}; shapes {self.args.shapes}")
        print(f"  AscendC backend: {_npu.status()}")
        print(f"  timing: median of {self.args.iters} after {self.args.warmup} warm-up runs, {self.timer.method}")
        self.limits = measure_limits(self.device, self.shp, self.timer)
        print(f"  limits: copy {self.limits['copy_GBps']:.1f} GB/s ({self.limits['copy_MiB']} MiB buffers), "
              f"bf16 mm {self.limits['mm_bf16_TFLOPs']:.3f} TFLOP/s (n={self.limits['mm_n']})", flush=True)
        for op in self.args.ops:
            t0 = time.monotonic()  # progress display only
            n_par = len(self.parity)
            try:
                getattr(self, f"op_{op}")()
            except Exception:
                tb = traceback.format_exc()
                self.errors.append(f"{op}: {tb.strip().splitlines()[-1]}")
                self.parity.append(dict(op=op, case="-", output="(op failed)", max_err=math.inf, bound=0.0,
                                        ok=False, rule="-", note=tb.strip().splitlines()[-1][:300]))
                print(f"[{op}] FAILED:\n{tb}")
            bad = [p for p in self.parity[n_par:] if not p["ok"]]
            print(f"  [{op}] {len(self.parity) - n_par} parity checks, {len(bad)} failed; "
                  f"{time.monotonic() - t0:.1f} s", flush=True)
        self.report()

    def report(self):
        if self.parity:
            print("\nparity vs the CPU fp64 reference (max abs error; bound as ascend_moe_ops.bench.parity_row):")
            for p in self.parity:
                print(f"  {'ok  ' if p['ok'] else 'FAIL'} {p['op']:<16} {p['case']:<36} {p['output']:<19} "
                      f"err {p['max_err']:.3e}  bound {p['bound']:.3e}" + (f"  {p['note']}" if p["note"] else ""))
        head = ["op", "case", "ours ms", "baseline ms", "speed-up", "rate", "% limit", "formula"]
        lines = []
        for r in self.results:
            ours = f"{r['ours_ms']:.3f}" if r["ours_ms"] is not None else "error"
            base = f"{r['baseline_ms']:.3f}" if r["baseline_ms"] is not None else "-"
            lines.append([r["op"], r["case"], ours, base,
                          f"{r['speedup']:.2f}x" if r["speedup"] else "-",
                          f"{r['rate']:.3g} {r['unit']}" if r["rate"] is not None else "-",
                          f"{r['pct_limit']:.1f}%" if r["pct_limit"] is not None else "-", r["formula"]])
        print()
        if lines:
            widths = [max(len(str(x)) for x in col) for col in zip(head, *lines)]
            fmt = "  ".join("{:<%d}" % w for w in widths)
            print(fmt.format(*head))
            print(fmt.format(*["-" * w for w in widths]))
            for line in lines:
                print(fmt.format(*line))
        print(f"\nlimits: copy {self.limits['copy_GBps']:.1f} GB/s [{COPY_FORMULA}]; bf16 mm "
              f"{self.limits['mm_bf16_TFLOPs']:.3f} TFLOP/s [{MM_FORMULA}]")
        print("speed-up = baseline ms / ours ms; rate and % limit are ours. s = bytes per element, N = T*K.")
        used = sorted({f"{r['op']} {r['case'].split(' ')[-1]}: {r['baseline']}" for r in self.results
                       if r["baseline_ms"] is not None})
        if used:
            print("baselines timed:")
            for u in used:
                print(f"  {u}")
        notes = sorted({f"{r['op']} {r['case']}: {r['baseline_error']}" for r in self.results
                        if r["baseline_error"] and r["baseline_ms"] is None})
        if notes and self.npu is not None:
            print("baselines not timed:")
            for n in notes:
                print(f"  {n}")
        elif self.npu is None:
            print(f"baselines: none ({self.baseline_note})")
        for e in self.errors:
            print(f"ERROR {e}")

    def payload(self):
        from ascend_moe_ops import _npu
        return dict(
            script="bench/npu_check.py", device=str(self.device), device_name=self.device_name,
            torch_npu=self.npu_version, shapes=self.args.shapes,
            shape_table={k: v for k, v in self.shp.items()}, dtype="bfloat16",
            date_utc=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            torch=self.torch.__version__, npu_backend=_npu.status(), timing=self.timer.method,
            iters=self.args.iters, warmup=self.args.warmup, limits=self.limits,
            formulas={f"{op} {case}": f for (op, case), f in FORMULAS.items()},
            parity=self.parity, results=self.results, errors=self.errors,
            ok=not self.errors and all(p["ok"] for p in self.parity))


def main(argv=None):
    args = parse_args(argv)
    if args.device == "npu":
        if importlib.util.find_spec("torch_npu") is None:
            print("npu_check: torch_npu is not installed; nothing to check "
                  "(use --device cpu for a smoke test of this script)")
            return 2
        import ascend_moe_ops
        status = ascend_moe_ops._npu.status()
        if not status.startswith("loaded"):
            print(f"npu_check: the AscendC backend is {status}")
            return 2
    run = Run(args)
    run.go()
    report = run.payload()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
        print(f"wrote {args.json}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
