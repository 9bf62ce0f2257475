"""GPU check of the Triton moe_permute / moe_unpermute kernels (not run in CI).

On a CUDA machine::

    python bench/gpu_check_moe_permute.py                  # T=4096 H=7680 E=256 K=8 bf16
    python bench/gpu_check_moe_permute.py --json out.json  # also write the table as JSON

It checks parity against the pure-PyTorch reference (permute: every output bitwise equal;
unpermute and its backward: the fp64-reference error rule of ``ascend_moe_ops.testing``, plus
bitwise repeatability), then times each op with the project's harness (median of ``--iters`` runs after
``--warmup`` runs, CUDA synchronized) for the ``triton`` and ``reference`` backends and, when it imports,
TransformerEngine's ``transformer_engine.pytorch.moe_permute`` / ``moe_unpermute`` (mask map, the
same routing), and prints a table with GB/s.

Byte formulas (dropless, every slot kept, ``s`` = bytes per element; index/prob traffic ignored):
permute ``T*H*s + T*K*H*s`` (read each token once, write each row once); unpermute
``T*K*H*s + T*H*s``; unpermute backward with probs ``T*H*s + 2*T*K*H*s`` (read grad, read the
rows for the prob gradient, write the row gradients).

``--device cpu`` runs the same script on tiny shapes under the Triton interpreter
(``TRITON_INTERPRET=1`` is set before triton is imported): a smoke test of the script itself,
its timings mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", "-T", type=int, default=4096)
    p.add_argument("--hidden", "-H", type=int, default=7680)
    p.add_argument("--experts", "-E", type=int, default=256)
    p.add_argument("--topk", "-K", type=int, default=8)
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--iters", type=int, default=20, help="timed runs per case (median reported)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu = smoke test under TRITON_INTERPRET=1 (use tiny shapes)")
    p.add_argument("--no-te", action="store_true", help="skip TransformerEngine even if importable")
    p.add_argument("--skip-parity", action="store_true")
    p.add_argument("--json", default=None, help="write the results table to this file")
    args = p.parse_args(argv)
    for name in ("tokens", "hidden", "experts", "topk", "iters"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    if args.topk > args.experts:
        p.error("--topk must be <= --experts (distinct experts per token)")
    return args


def _timer(device):
    """The project's one harness (``ascend_moe_ops.benchmark.timing.measure``: torch.utils.benchmark
    underneath, CUDA synchronized around each clock read): median of ``iters`` runs."""
    from ascend_moe_ops.benchmark.timing import measure

    def time_fn(fn, iters, warmup):
        return float(measure(fn, device=device, runs=iters, warmup=warmup))

    return time_fn


def _te_ops():
    try:
        import transformer_engine.pytorch as te  # noqa: F401
        return te.moe_permute, te.moe_unpermute
    except Exception as exc:  # not installed, or no matching CUDA build
        return f"{type(exc).__name__}: {exc}"


def run(args):
    import torch

    import ascend_moe_ops as amo
    from ascend_moe_ops.testing import assert_close_to_ref

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check_moe_permute: no CUDA device here; nothing to check "
              "(use --device cpu with tiny shapes for a smoke test of this script)")
        return None
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    T, H, E, K = args.tokens, args.hidden, args.experts, args.topk
    g = torch.Generator(device="cpu").manual_seed(0)
    tokens = torch.randn(T, H, generator=g).to(device=device, dtype=dtype)
    ids = torch.rand(T, E, generator=g).topk(K, dim=1).indices.to(device)  # distinct experts
    probs = torch.softmax(torch.randn(T, K, generator=g), dim=1).to(device)
    esize = tokens.element_size()
    time_fn = _timer(device)
    op_bwd = torch.ops.ascend_moe_ops.moe_unpermute_backward.default
    print(f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu (interpreter)'}"
          f"; torch {torch.__version__}; shape T={T} H={H} E={E} K={K} {args.dtype}")

    def permute(backend):
        with amo.use_backend(backend):
            return amo.moe_permute(tokens, ids, probs, num_experts=E)

    # ---- parity -------------------------------------------------------------------------
    ref = permute("reference")
    if not args.skip_parity:
        tri = permute("triton")
        for name, a, b in zip(ref._fields, tri, ref):
            assert a.dtype == b.dtype and a.shape == b.shape, f"permute {name}: dtype/shape differ"
            assert torch.equal(a, b), f"permute {name}: triton differs from the reference"
        print("parity permute: all 5 outputs bitwise equal to the reference")
    rows = (ref.tokens.float() * 1.5 + 0.25).to(dtype)
    rmap = ref.row_id_map
    if not args.skip_parity:
        with amo.use_backend("triton"):
            out = amo.moe_unpermute(rows, rmap, probs)
            again = amo.moe_unpermute(rows, rmap, probs)
        with amo.use_backend("reference"):
            ref64 = amo.moe_unpermute(rows.double(), rmap, probs.double())
            lowp = amo.moe_unpermute(rows, rmap, probs)
        assert_close_to_ref(out, ref64, dtype=dtype, torch_lowp=lowp, name="unpermute")
        assert torch.equal(out, again), "unpermute is not bitwise repeatable"
        print(f"parity unpermute: within the 2x-PyTorch rule (bitwise equal to the reference: "
              f"{torch.equal(out, lowp)}), bitwise repeatable")
        gout = torch.randn(T, H, generator=g).to(device=device, dtype=dtype)
        with amo.use_backend("triton"):
            gx, gp = op_bwd(gout, rows, rmap, probs)
        with amo.use_backend("reference"):
            rx, rp = op_bwd(gout.double(), rows.double(), rmap, probs.double())
            lx, lp = op_bwd(gout, rows, rmap, probs)
        assert_close_to_ref(gx, rx, dtype=dtype, torch_lowp=lx, name="unpermute backward: grad rows")
        assert_close_to_ref(gp, rp, dtype=torch.float32, torch_lowp=lp, name="unpermute backward: grad probs")
        print("parity unpermute backward: within the 2x-PyTorch rule")

    # ---- timing -------------------------------------------------------------------------
    results = []

    def record(op, impl, fn, nbytes):
        try:
            sec = time_fn(fn, args.iters, args.warmup)
            results.append(dict(op=op, impl=impl, ms=sec * 1e3, gbps=nbytes / sec / 1e9))
        except Exception as exc:
            results.append(dict(op=op, impl=impl, ms=None, gbps=None,
                                error=f"{type(exc).__name__}: {exc}"[:200]))

    b_perm = T * H * esize + T * K * H * esize
    b_unperm = T * K * H * esize + T * H * esize
    b_bwd = T * H * esize + 2 * T * K * H * esize
    gout = torch.randn(T, H, generator=g).to(device=device, dtype=dtype)
    for backend in ("triton", "reference"):
        record("permute", backend, lambda: permute(backend), b_perm)

        def unperm(backend=backend):
            with amo.use_backend(backend):
                return amo.moe_unpermute(rows, rmap, probs)

        def bwd(backend=backend):
            with amo.use_backend(backend):
                return op_bwd(gout, rows, rmap, probs)

        record("unpermute", backend, unperm, b_unperm)
        record("unpermute_bwd", backend, bwd, b_bwd)

    te = None if args.no_te or device.type != "cuda" else _te_ops()
    if isinstance(te, str):
        print(f"TransformerEngine: not used ({te})")
    elif te is not None:
        te_permute, te_unpermute = te
        mask = torch.zeros(T, E, dtype=torch.bool, device=device).scatter_(1, ids, True)
        probs_mask = torch.zeros(T, E, dtype=torch.float32, device=device).scatter_(1, ids, probs)
        te_out, te_mask, te_err = None, None, ""
        for candidate in (mask.to(torch.int32), mask):  # older TE wants int32, newer takes bool
            try:
                te_out = te_permute(tokens, candidate, num_out_tokens=T * K, map_type="mask")
                te_mask = candidate
                break
            except Exception as exc:
                te_err = f"{type(exc).__name__}: {exc}"[:200]
        if te_out is None:
            print(f"TransformerEngine moe_permute failed: {te_err}")
        else:
            te_rows, te_map = te_out[0], te_out[1]
            if not args.skip_parity:
                same = torch.equal(te_rows, ref.tokens[:T * K])
                print(f"TransformerEngine permute rows equal to ours (same expert-major order): {same}")
            record("permute", "transformer_engine",
                   lambda: te_permute(tokens, te_mask, num_out_tokens=T * K, map_type="mask"), b_perm)
            record("unpermute", "transformer_engine",
                   lambda: te_unpermute(te_rows, te_map, merging_probs=probs_mask,
                                        restore_shape=tokens.shape, map_type="mask"), b_unperm)

    # ---- report -------------------------------------------------------------------------
    base = {(r["op"]): r["ms"] for r in results if r["impl"] == "reference" and r["ms"]}
    print(f"\n{'op':<15}{'impl':<20}{'ms':>10}{'GB/s':>10}{'vs reference':>14}")
    for r in results:
        if r["ms"] is None:
            print(f"{r['op']:<15}{r['impl']:<20}{'error':>10}  {r['error']}")
            continue
        speed = base.get(r["op"])
        rel = f"{speed / r['ms']:.2f}x" if speed else "-"
        print(f"{r['op']:<15}{r['impl']:<20}{r['ms']:>10.3f}{r['gbps']:>10.1f}{rel:>14}")
    print("bytes: permute T*H*s + T*K*H*s; unpermute T*K*H*s + T*H*s; "
          "unpermute_bwd T*H*s + 2*T*K*H*s (s = bytes per element)")
    report = dict(shape=dict(T=T, H=H, E=E, K=K, dtype=args.dtype), device=str(device),
                  device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                  torch=torch.__version__, iters=args.iters, results=results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return report


def main(argv=None):
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
