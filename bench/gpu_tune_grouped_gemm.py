"""Tile sweep of the Triton grouped GEMM on a GPU (not run in CI).

    python bench/gpu_tune_grouped_gemm.py                       # pangu shapes, bf16, cuda
    python bench/gpu_tune_grouped_gemm.py --json sweep.json
    python bench/gpu_tune_grouped_gemm.py --device cpu          # smoke test: interpreter, tiny shape

For each case of the grouped GEMM benchmark (balanced, Zipf and fine-grained experts) and each
pass (fwd, dX, dW) it runs every candidate configuration (tile sizes, warps, pipeline stages) of
``triton_ref.grouped_gemm``, checks it against the fp64 reference with the tests' rule
(``ascend_moe_ops.testing``: error <= 2x that of the same product in PyTorch bf16), and times it
with the project's harness next to dense ``torch.mm`` of the same total problem and
``torch._grouped_mm``. The first configuration of each list is the current default.

FLOPs = 2 * sum(group_sizes) * K * N per pass. % dense = dense-mm time / ours (same M x K x N).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

FWD_CONFIGS = [  # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages); first = default
    (128, 256, 64, 8, 3), (64, 128, 32, 4, 3), (128, 128, 32, 4, 3), (128, 128, 64, 4, 3), (128, 128, 64, 8, 3),
    (64, 256, 64, 4, 4), (128, 64, 64, 4, 4), (128, 128, 64, 8, 4),
]
DW_CONFIGS = [  # (BLOCK_P, BLOCK_Q, BLOCK_M, num_warps, num_stages); first = default
    (128, 128, 64, 4, 3), (64, 64, 64, 4, 3), (128, 128, 64, 8, 3), (128, 128, 32, 8, 4),
    (64, 128, 64, 4, 3), (128, 64, 64, 4, 3), (128, 256, 64, 8, 3),
]
TINY = [(4, 96, 64, 48, "zipf")]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu = smoke test under TRITON_INTERPRET=1 on a tiny shape")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    import ascend_moe_ops as amo
    from ascend_moe_ops.benchmark.suite.bench_grouped_gemm import PRESET_CASES, balanced_sizes, zipf_sizes
    from ascend_moe_ops.benchmark.timing import measure
    from ascend_moe_ops.testing import ERROR_FACTOR, TOLERANCES, max_abs_err
    from ascend_moe_ops.triton_ref import grouped_gemm as tg

    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("gpu_tune_grouped_gemm: no CUDA device here (use --device cpu for a smoke test)")
        return 0
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float16  # interpreter: bf16 tl.dot is wrong
    cases = PRESET_CASES[False] if dev.type == "cuda" else TINY
    fwd_cfgs = FWD_CONFIGS if dev.type == "cuda" else [(32, 32, 32, 4, 1), (16, 32, 16, 4, 1)]
    dw_cfgs = DW_CONFIGS if dev.type == "cuda" else [(32, 32, 32, 4, 1), (16, 32, 16, 4, 1)]

    def timed(fn):
        return float(measure(fn, device=dev, runs=args.iters, warmup=args.warmup))

    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (interpreter)"
    print(f"device: {name}; torch {torch.__version__}; {dtype}")
    results, bad = [], 0
    for E, M, K, N, kind in cases:
        sizes = zipf_sizes(E, M) if kind == "zipf" else balanced_sizes(E, M)
        g = torch.Generator().manual_seed(0)
        x = torch.randn(M, K, generator=g)
        w = torch.randn(E, K, N, generator=g) / K ** 0.5
        dy = torch.randn(M, N, generator=g)
        gs = sizes.to(dev)
        offs = torch.cumsum(gs, 0, dtype=torch.int32)
        lo = [t.to(dev, dtype) for t in (x, w, dy)]
        flops = 2 * int(sizes.sum()) * K * N
        passes = {
            "fwd": (lambda a, b, c: amo.grouped_gemm(a, b, gs), fwd_cfgs, "gemm_config",
                    lambda: torch.mm(lo[0], lo[1][0]), lambda: torch._grouped_mm(lo[0], lo[1], offs=offs)),
            "dX": (lambda a, b, c: amo.grouped_gemm(c, b, gs, trans_b=True), fwd_cfgs, "gemm_config",
                   lambda: torch.mm(lo[2], lo[1][0].t()),
                   lambda: torch._grouped_mm(lo[2], lo[1].transpose(1, 2), offs=offs)),
            "dW": (lambda a, b, c: amo.grouped_gemm_dw(a, c, gs), dw_cfgs, "dw_config",
                   lambda: torch.mm(lo[0].t(), lo[2]), lambda: torch._grouped_mm(lo[0].t(), lo[2], offs=offs)),
        }
        for pname, (fn, cfgs, hook, dense, peer) in passes.items():
            with amo.use_backend("reference"):
                ref64 = fn(*(t.to(dev, torch.float64) for t in (x, w, dy)))
                low = fn(*lo)
            atol, rtol = TOLERANCES[dtype]
            bound = ERROR_FACTOR * max_abs_err(low, ref64) + atol + rtol * ref64.abs().max().item()
            t_dense = timed(dense)
            try:
                t_peer = timed(peer)
            except Exception as exc:  # a torch without _grouped_mm for this device/dtype
                print(f"  torch._grouped_mm failed: {exc}")
                t_peer = None
            orig = getattr(tg, hook)
            for cfg in cfgs:
                keys = ("BLOCK_M", "BLOCK_N", "BLOCK_K") if hook == "gemm_config" else ("BLOCK_P", "BLOCK_Q", "BLOCK_M")
                launch = dict(zip(keys, cfg[:3]), num_warps=cfg[3], num_stages=cfg[4])
                setattr(tg, hook, lambda _dtype, launch=launch: dict(launch))
                try:
                    with amo.use_backend("triton"):
                        out = fn(*lo)
                        err = max_abs_err(out, ref64)
                        t = timed(lambda: fn(*lo))
                    rec = dict(case=f"{kind} E{E} M{M} K{K} N{N}", pass_=pname, config=list(cfg),
                               ms=t * 1e3, tflops=flops / t / 1e12, pct_dense=100 * t_dense / t,
                               vs_grouped_mm=(t_peer / t) if t_peer else None, err=err, bound=bound,
                               ok=err <= bound, default=cfg == cfgs[0])
                except Exception as exc:  # e.g. out of shared memory for this tile
                    rec = dict(case=f"{kind} E{E} M{M} K{K} N{N}", pass_=pname, config=list(cfg),
                               error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}",
                               ok=False, default=cfg == cfgs[0])
                finally:
                    setattr(tg, hook, orig)
                bad += not rec["ok"] and "error" not in rec
                results.append(rec)
                if "error" in rec:
                    print(f"{rec['case']:<28} {pname:<3} {str(cfg):<24} {rec['error']}")
                else:
                    vs = f"{rec['vs_grouped_mm']:.2f}x" if rec["vs_grouped_mm"] else "-"
                    print(f"{rec['case']:<28} {pname:<3} {str(cfg):<24} {rec['ms']:8.3f} ms "
                          f"{rec['tflops']:7.1f} TFLOP/s  {rec['pct_dense']:5.1f}% dense  "
                          f"vs _grouped_mm {vs:>6}  err {err:.2e} <= {bound:.2e} "
                          f"{'ok' if rec['ok'] else 'FAIL'}{'  (default)' if rec['default'] else ''}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=name, torch=torch.__version__, dtype=str(dtype), results=results), f, indent=1)
    if bad:
        print(f"{bad} configuration(s) outside the error bound")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
