"""Compile every Triton kernel of ``triton_ref`` for a CUDA target without a GPU.

    env -u TRITON_INTERPRET python -m ascend_moe_ops.triton_ref.aot_check            # sm_90 (H100/H200)
    env -u TRITON_INTERPRET python -m ascend_moe_ops.triton_ref.aot_check --arch 80  # A100

The interpreter (``TRITON_INTERPRET=1``) never runs Triton's GPU compiler, so a kernel can pass
every CPU test and still fail to compile (layout, histogram or scan lowering, type errors only the
MLIR passes catch). This script lowers each kernel with the block sizes the GPU path uses down to
PTX and a cubin (triton ships its own ``ptxas``) and, where the bundled ``ptxas`` accepts the PTX,
prints registers and spills. Exit status 1 if any kernel fails to compile. It needs no GPU and
must run with ``TRITON_INTERPRET`` unset (under the interpreter ``triton.jit`` gives objects that
cannot be compiled).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import traceback


def _cases():
    import triton.language as tl

    from . import moe_permute as P
    from . import moe_unpermute as U

    i32, c = "i32", "constexpr"
    cases = []
    for rt, is_mask in (("*i64", False), ("*i32", False), ("*u8", True)):
        cases.append((f"moe_permute._hist_kernel routing={rt}", P._hist_kernel,
                      dict(routing_ptr=rt, counts_ptr="*i32", P=i32, S=i32, E=i32, IS_MASK=c,
                           BLOCK_P=c, E_BINS=c),
                      dict(IS_MASK=is_mask, BLOCK_P=128, E_BINS=512)))
        cases.append((f"moe_permute._dest_kernel routing={rt}", P._dest_kernel,
                      dict(routing_ptr=rt, offsets_ptr="*i32", gstart_ptr="*i32", map_ptr="*i32",
                           P=i32, S=i32, E=i32, N=i32, IS_MASK=c, BLOCK_P=c, CH=c),
                      dict(IS_MASK=is_mask, BLOCK_P=128, CH=32)))
    cases.append(("moe_permute._hist_kernel E_BINS=64", P._hist_kernel,
                  dict(routing_ptr="*i64", counts_ptr="*i32", P=i32, S=i32, E=i32, IS_MASK=c,
                       BLOCK_P=c, E_BINS=c),
                  dict(IS_MASK=False, BLOCK_P=128, E_BINS=64)))
    cases.append(("moe_permute._scan_kernel", P._scan_kernel,
                  dict(counts_ptr="*i32", offsets_ptr="*i32", tpe_ptr="*i64", gs_ptr="*i64",
                       gstart_ptr="*i32", num_blocks=i32, E=i32, align=i32, E_PAD=c, CH=c),
                  dict(E_PAD=256, CH=16)))
    cases.append(("moe_permute._mark_kernel", P._mark_kernel,
                  dict(map_ptr="*i32", used_ptr="*i8", P=i32, N=i32, BLOCK_P=c), dict(BLOCK_P=128)))
    for dt in ("bf16", "fp16", "fp32"):
        for hp in (True, False):
            cases.append((f"moe_permute._permute_kernel {dt} probs={hp}", P._permute_kernel,
                          dict(tok_ptr=f"*{dt}", map_ptr="*i32", probs_ptr="*fp32",
                               out_ptr=f"*{dt}", out_probs_ptr="*fp32", T=i32, S=i32, H=i32,
                               HAS_PROBS=c, BLOCK_T=c, BLOCK_H=c),
                          dict(HAS_PROBS=hp, BLOCK_T=2, BLOCK_H=512)))
            cases.append((f"moe_permute._zero_unused_kernel {dt} probs={hp}", P._zero_unused_kernel,
                          dict(used_ptr="*i8", out_ptr=f"*{dt}", out_probs_ptr="*fp32", N=i32,
                               H=i32, HAS_PROBS=c, BLOCK_R=c, BLOCK_H=c),
                          dict(HAS_PROBS=hp, BLOCK_R=4, BLOCK_H=1024)))
            for mt in ("*i32", "*i64"):
                cases.append((f"moe_unpermute._unpermute_kernel {dt} probs={hp} map={mt}",
                              U._unpermute_kernel,
                              dict(perm_ptr=f"*{dt}", map_ptr=mt, probs_ptr="*fp32", out_ptr=f"*{dt}",
                                   N=i32, T=i32, S=i32, H=i32, HAS_PROBS=c, ACC=c, RTNE_OUT=c,
                                   BLOCK_T=c, BLOCK_H=c),
                              dict(HAS_PROBS=hp, ACC=tl.float32, RTNE_OUT=False, BLOCK_T=2,
                                   BLOCK_H=512)))
            cases.append((f"moe_unpermute._unpermute_bwd_kernel {dt} probs={hp}",
                          U._unpermute_bwd_kernel,
                          dict(g_ptr=f"*{dt}", perm_ptr=f"*{dt}", map_ptr="*i32", probs_ptr="*fp32",
                               gperm_ptr=f"*{dt}", gprobs_ptr="*fp32", N=i32, T=i32, S=i32, H=i32,
                               HP=i32, HAS_PROBS=c, ACC=c, RTNE_GRAD=c, RTNE_GPROBS=c, BLOCK_T=c,
                               BLOCK_H=c, S_PAD=c),
                          dict(HAS_PROBS=hp, ACC=tl.float32, RTNE_GRAD=False, RTNE_GPROBS=False,
                               BLOCK_T=2, BLOCK_H=512, S_PAD=8)))
    return cases


def _ptxas_info(ptx: str) -> str:
    import triton
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        for exe in ("ptxas-blackwell", "ptxas"):
            path = os.path.join(bindir, exe)
            if not os.path.exists(path):
                continue
            arch = "sm_" + ptx.split(".target", 1)[1].split()[0].split("_", 1)[1].rstrip(",")
            r = subprocess.run([path, "-v", f"-arch={arch}", f.name, "-o", os.devnull],
                               capture_output=True, text=True)
            if r.returncode == 0:
                lines = [ln.split("info    : ")[-1].strip() for ln in r.stderr.splitlines()
                         if "registers" in ln or "spill" in ln]
                return "; ".join(lines)
        return "(no bundled ptxas accepted the PTX; registers unknown)"
    finally:
        os.unlink(f.name)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 80, 90")
    ap.add_argument("--no-ptxas-info", action="store_true")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("aot_check: unset TRITON_INTERPRET (interpreted kernels cannot be compiled)")
        return 2
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", args.arch, 32)
    failed = 0
    for name, fn, sig, consts in _cases():
        try:
            k = triton.compile(ASTSource(fn, sig, consts), target=target)
            info = "" if args.no_ptxas_info else _ptxas_info(k.asm["ptx"])
            print(f"ok    {name}  {info}")
        except Exception:
            failed += 1
            print(f"FAIL  {name}\n{traceback.format_exc(limit=4)}")
    print(f"{'all' if not failed else failed} kernel variants "
          f"{'compiled' if not failed else 'FAILED'} for sm_{args.arch} (triton {triton.__version__})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
