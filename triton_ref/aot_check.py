"""Compile every Triton kernel of ``triton_ref`` for GPU targets without a GPU, and check resources.

    env -u TRITON_INTERPRET python -m ascend_moe_ops.triton_ref.aot_check                  # all targets
    env -u TRITON_INTERPRET python -m ascend_moe_ops.triton_ref.aot_check --targets sm_90
    env -u TRITON_INTERPRET python -m ascend_moe_ops.triton_ref.aot_check --markdown table.md --json r.json

The interpreter (``TRITON_INTERPRET=1``) never runs Triton's GPU compiler, so a kernel can pass
every CPU test and still fail to compile (layout, histogram or scan lowering, type errors only the
MLIR passes catch), spill registers or ask for more shared memory than a block may have. This
script finds out without a GPU:

1. **Which kernels, with which arguments.** It runs the package's own launch functions
   (``moe_permute``, ``moe_unpermute``(+backward), ``grouped_gemm``(+dW), ``flash_attention``
   fwd/bwd, ``mla_attention`` fwd/bwd) on small CPU tensors at the real model dims (H = 1024,
   E = 256 and E = 8, top-8, MLA heads 128 + 64 / 128, plain 192- and 128-dim heads) in every
   dtype and mode, with each ``@triton.jit`` kernel replaced by a recorder. A recorded launch
   holds the exact arguments, constexprs (block sizes) and options (``num_warps``,
   ``enable_fp_fusion``) the GPU path passes: with ``TRITON_INTERPRET`` unset the launchers pick
   their GPU tiles, and the two choices made from ``tensor.device`` (flash attention's block and
   warps; the persistent grouped GEMM's program count) are asked as for a GPU tensor.
2. **Compile.** Each distinct launch is bound and specialized by Triton's own JIT binder for the
   target (so the divisibility hints match a real launch) and compiled with ``triton.compile``:
   NVIDIA to PTX and a cubin (triton ships ``ptxas``), AMD to AMDGCN and an hsaco (triton ships
   the LLVM AMDGPU backend, the linker and the device libraries; no ROCm needed).
3. **Check.** It fails on a compile error, on a register spill (NVIDIA: ``ptxas -v`` spill
   stores/loads of the PTX with the flags Triton uses; AMD: the code object's
   ``vgpr_spill_count`` / ``sgpr_spill_count``) and on shared memory (Triton's allocation,
   ``metadata.shared``; AMD: LDS) above the target's per-block limit (:data:`TARGETS`).

Exit status 1 if any kernel fails, 2 if run under the interpreter. ``--markdown`` writes the
per-kernel resource table (docs/gpu_compile_check.md holds the last one), ``--json`` the raw
results. Kernels compiled once stay in Triton's cache (``~/.triton/cache``), so a second run is
fast. It uses Triton's JIT binder (``triton.runtime.jit``), an internal API checked with triton 3.9.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import types
from typing import Dict, List, Optional

#: Targets checked. ``smem_limit``: shared memory one block (work-group) may use, in bytes.
#: ``programs``: the persistent grouped GEMM's program count on that GPU (its SM/CU count; a
#: constexpr of the kernel, so it is part of the compiled code).
TARGETS: Dict[str, dict] = {
    "sm_90": dict(backend="cuda", arch=90, warp=32, smem_limit=227 * 1024, programs=132,
                  gpu="H100/H200 (compute capability 9.0)",
                  source="NVIDIA CUDA C++ Programming Guide, 'Technical Specifications per Compute "
                         "Capability' table, row 'Maximum amount of shared memory per thread block': "
                         "227 KB for 9.0; 132 SMs: NVIDIA H100 Tensor Core GPU Architecture "
                         "whitepaper (H100 SXM5)"),
    "sm_80": dict(backend="cuda", arch=80, warp=32, smem_limit=163 * 1024, programs=108,
                  gpu="A100 (compute capability 8.0)",
                  source="NVIDIA CUDA C++ Programming Guide, same table: 163 KB for 8.0; 108 SMs: "
                         "NVIDIA A100 Tensor Core GPU Architecture whitepaper"),
    "gfx942": dict(backend="hip", arch="gfx942", warp=64, smem_limit=64 * 1024, programs=304,
                   gpu="MI300X / MI300A (CDNA3, gfx942)",
                   source="AMD ROCm documentation, 'GPU hardware specifications' table: LDS 64 KiB "
                          "per CU (a work-group's limit) for MI300X/MI300A; 304 CUs on MI300X (AMD "
                          "CDNA 3 architecture whitepaper)"),
}

_MODULES = ("moe_permute", "moe_unpermute", "grouped_gemm", "flash_attention", "mla_attention")


def _package():
    """The triton_ref package object (``ascend_moe_ops.triton_ref`` when installed, ``triton_ref``
    in the source tree)."""
    return sys.modules[__package__] if __package__ else __import__("triton_ref")


def _modules():
    import importlib
    return {m: importlib.import_module(f"{_package().__name__}.{m}") for m in _MODULES}


def all_kernels() -> Dict[str, object]:
    """Every launchable ``@triton.jit`` function of triton_ref (name ends in ``_kernel``; the
    other jit functions are helpers inlined into them): ``{"module.name": JITFunction}``."""
    import triton
    out = {}
    for mname, mod in _modules().items():
        for name, obj in vars(mod).items():
            if isinstance(obj, triton.runtime.jit.JITFunction) and name.endswith("_kernel") \
                    and obj.fn.__module__ == mod.__name__:
                out[f"{mname}.{name}"] = obj
    return out


class _Recorder:
    """Stands in for a JITFunction: ``rec[grid](*args, **kwargs)`` records the launch."""

    def __init__(self, qualname, fn, launches):
        self.qualname, self.fn, self.launches = qualname, fn, launches

    def __getitem__(self, grid):
        def record(*args, **kwargs):
            self.launches.append((self.qualname, self.fn, args, kwargs))
        return record


class _GpuView:
    """The tensor as the launchers' tile choices see it on a GPU: a CUDA device, everything else
    (dtype, element size, shape) the tensor's own."""

    def __init__(self, t):
        self._t = t
        self.device = types.SimpleNamespace(type="cuda")

    def __getattr__(self, name):
        return getattr(self._t, name)


@contextlib.contextmanager
def _recording(programs: int, amd: bool = False):
    """Replace every kernel by a recorder; make the launchers choose as on a GPU. Yields the list
    of launches ``(qualname, JITFunction, args, kwargs)``."""
    launches: list = []
    mods = _modules()
    saved = []

    def patch(mod, name, value):
        saved.append((mod, name, getattr(mod, name)))
        setattr(mod, name, value)

    for qual, fn in all_kernels().items():
        mname, name = qual.split(".")
        patch(mods[mname], name, _Recorder(qual, fn, launches))
    fa, gg = mods["flash_attention"], mods["grouped_gemm"]
    block, warps = fa._block, fa._warps
    patch(fa, "_block", lambda q, max_seqlen: block(_GpuView(q), max_seqlen))
    patch(fa, "_warps", lambda q, *d: warps(_GpuView(q), *d))
    patch(gg, "_num_programs", lambda device: programs)
    patch(gg, "_on_amd", lambda: amd)  # the tile choice of an AMD (ROCm) torch
    try:
        yield launches
    finally:
        for mod, name, value in reversed(saved):
            setattr(mod, name, value)


SUBSETS = ("full", "ci")


def _workloads(subset: str = "full"):
    """Calls of the launch functions covering every dtype and mode the GPU path launches.

    ``subset="ci"``: every kernel and mode, but the data-moving kernels in bf16 and fp32 only and
    flash attention in bf16 only (fp32 flash attention alone takes minutes to compile)."""
    import torch
    m = _modules()
    P, U, G, FA, MLA = (m[k] for k in _MODULES)
    g = torch.Generator().manual_seed(0)
    calls = []
    full = subset == "full"
    dtypes = (torch.bfloat16, torch.float16, torch.float32) if full else (torch.bfloat16, torch.float32)
    T, H, K = 8, 1024, 8

    for dt in dtypes:
        for E in (256, 8, 20000):  # 20000: the row-map kernels' expert tiles (E > 4096)
            for kind in ("i64", "i32", "mask"):
                if E != 256 and (dt != torch.bfloat16 or kind != "i64"):
                    continue
                ids = torch.stack([torch.randperm(E, generator=g)[:min(K, E)] for _ in range(T)])
                routing = ids.to(torch.int32) if kind == "i32" else ids
                if kind == "mask":
                    routing = torch.zeros(T, E, dtype=torch.bool).scatter_(1, ids, True)
                for has_probs in (True, False):
                    probs = torch.rand(routing.shape, generator=g) if has_probs else None
                    for cap in (None, 4):
                        calls.append(lambda dt=dt, r=routing, p=probs, E=E, cap=cap:
                                     P.moe_permute(torch.randn(T, H).to(dt), r, p, E, cap, 1, None))
        rmap = torch.randperm(T * K, generator=g).view(T, K).to(torch.int32)
        for has_probs in (True, False):
            probs = torch.rand(T, K, generator=g) if has_probs else None
            perm = torch.randn(T * K, H).to(dt)
            for mt in (torch.int32, torch.int64):
                calls.append(lambda perm=perm, m=rmap.to(mt), p=probs: U.moe_unpermute(perm, m, p))
            calls.append(lambda perm=perm, p=probs, dt=dt:
                         U.moe_unpermute_backward(torch.randn(T, H).to(dt), perm, rmap, p))
        # grouped GEMM: the expert MLP shapes (fc1 H -> 2F, fc2 F -> H), both weight layouts
        x = torch.randn(64, 256).to(dt)
        gs = torch.tensor([16, 0, 48, 0], dtype=torch.int64)
        for trans_b in (False, True):
            w = torch.randn(4, 512, 256).to(dt) if trans_b else torch.randn(4, 256, 512).to(dt)
            calls.append(lambda x=x, w=w, t=trans_b: G.grouped_gemm(x, w, gs, t))
        calls.append(lambda x=x, dt=dt: G.grouped_gemm_dw(x, torch.randn(64, 512).to(dt), gs))

    def attention(dt, kind, causal, seqlen, heads=2):
        cu = torch.tensor([0, seqlen, 2 * seqlen], dtype=torch.int32)
        Tq = 2 * seqlen
        if kind == "mla":  # 128 + 64 (shared rope key) / 128, latent 512
            q = torch.randn(Tq, heads, 192).to(dt)
            c_kv, k_pe = torch.randn(Tq, 512).to(dt), torch.randn(Tq, 64).to(dt)
            w = torch.randn(heads * 256, 512).to(dt)
            out, lse, kv = MLA.mla_attention_fwd(q, c_kv, k_pe, w, cu, seqlen, heads, 128, 128, 0.1,
                                                 causal, False)
            MLA.mla_attention_bwd(torch.randn(Tq, heads, 128).to(dt), q, c_kv, k_pe, w, out, lse, kv,
                                  cu, seqlen, heads, 128, 128, 0.1, causal)
            return
        d = 192 if kind == "d192" else 128
        q, k = torch.randn(Tq, heads, d).to(dt), torch.randn(Tq, heads, d).to(dt)
        v = torch.randn(Tq, heads, 128).to(dt)
        out, lse = FA.flash_attention_fwd(q, k, v, None, cu, cu, seqlen, seqlen, causal, 0.1)
        FA.flash_attention_bwd(torch.randn_like(out), q, k, v, None, out, lse, cu, cu, seqlen, seqlen,
                               causal, 0.1)

    for dt in dtypes if full else (torch.bfloat16,):
        for causal in (True, False):
            calls.append(lambda dt=dt, c=causal: attention(dt, "mla", c, 64))
        calls.append(lambda dt=dt: attention(dt, "d192", True, 64))
    calls.append(lambda: attention(torch.bfloat16, "d128", True, 64))
    calls.append(lambda: attention(torch.bfloat16, "mla", True, 16))   # short sequences: 16-row tiles
    return calls


def _describe(fn, args, kwargs) -> str:
    """Short label of one launch: the constexprs and options, plus the pointer dtypes."""
    import torch
    parts = []
    first_ptr = None
    for p, a in zip(fn.params, args):
        if isinstance(a, torch.Tensor) and first_ptr is None:
            first_ptr = str(a.dtype).replace("torch.", "").replace("bfloat16", "bf16") \
                .replace("float16", "fp16").replace("float32", "fp32")
    if first_ptr:
        parts.append(first_ptr)
    for k, v in kwargs.items():
        v = getattr(v, "name", v) if not isinstance(v, (bool, int, float, str)) else v
        parts.append(f"{k}={v}")
    return " ".join(parts)


def collect(programs: int, subset: str = "full", amd: bool = False) -> List[tuple]:
    """The distinct launches ``(qualname, label, JITFunction, args, kwargs)`` of the workloads."""
    with _recording(programs, amd) as launches:
        for call in _workloads(subset):
            call()
    seen, out = set(), []
    for qual, fn, args, kwargs in launches:
        label = _describe(fn, args, kwargs)
        key = (qual, label, tuple(_spec_key(a) for a in args))
        if key not in seen:
            seen.add(key)
            out.append((qual, label, fn, args, kwargs))
    return out


def _spec_key(a):
    import torch
    if isinstance(a, torch.Tensor):
        return ("t", a.dtype, a.data_ptr() % 16 == 0)
    if isinstance(a, bool) or not isinstance(a, int):
        return (type(a).__name__,)
    return ("i", a == 1, a % 16 == 0, -2**31 <= a < 2**31)


def compile_one(target_name: str, fn, args, kwargs):
    """Compile one launch for a target exactly as the JIT would; returns the CompiledKernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    t = TARGETS[target_name]
    target = GPUTarget(t["backend"], t["arch"], t["warp"])
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, spec, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, dict(kwargs), bound, spec, options)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                          options=options.__dict__)


def _nvidia_resources(kernel, arch: int) -> dict:
    """Registers and spills from ``ptxas -v`` on the kernel's PTX, with Triton's ptxas flags."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability
    fmad = [] if kernel.metadata.enable_fp_fusion else ["--fmad=false"]
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(kernel.asm["ptx"])
        r = subprocess.run([get_ptxas(arch).path, *fmad, "-v", f"--gpu-name={sm_arch_from_capability(arch)}",
                            src, "-o", os.path.join(d, "k.cubin")], capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"ptxas -v failed: {r.stderr.strip()[-2000:]}")

    def num(pattern):
        hit = re.search(pattern, r.stderr)
        return int(hit.group(1)) if hit else 0
    return dict(registers=num(r"Used (\d+) registers"),
                spill_bytes=num(r"(\d+) bytes spill stores") + num(r"(\d+) bytes spill loads"),
                stack_bytes=num(r"(\d+) bytes stack frame"))


def _amd_resources(kernel) -> dict:
    """VGPRs (``.vgpr_count``), AGPRs, SGPRs, spills, scratch and LDS from the AMDGCN code object
    metadata. A spill to memory (VGPR spills, or SGPR spills in a kernel with scratch) counts
    in ``spill_bytes``; SGPR spills into VGPR lanes (no memory traffic) are only reported."""
    asm = kernel.asm["amdgcn"]

    def num(key):
        hit = re.search(rf"^\s*\.{key}:\s+(\d+)", asm, re.M)
        return int(hit.group(1)) if hit else 0
    hit = re.search(r"; ScratchSize: (\d+)", asm)
    scratch = int(hit.group(1)) if hit else 0
    # VGPR spills go to scratch (memory); SGPR spills go to lanes of a VGPR and only reach
    # memory when the kernel has scratch as well
    sgpr_spills = num("sgpr_spill_count")
    return dict(registers=num("vgpr_count"), agprs=num("agpr_count"), sgprs=num("sgpr_count"),
                spill_bytes=4 * num("vgpr_spill_count") + (4 * sgpr_spills if scratch else 0),
                sgpr_spills_to_vgpr=0 if scratch else sgpr_spills, stack_bytes=scratch,
                lds_bytes=num("group_segment_fixed_size"))


def check(target_name: str, kernel) -> dict:
    """Resources of a compiled kernel and the problems found (a list of strings)."""
    t = TARGETS[target_name]
    res = _nvidia_resources(kernel, t["arch"]) if t["backend"] == "cuda" else _amd_resources(kernel)
    res["shared_bytes"] = max(int(kernel.metadata.shared), res.pop("lds_bytes", 0))
    res["num_warps"] = int(kernel.metadata.num_warps)
    problems = []
    if res["spill_bytes"]:
        problems.append(f"register spill: {res['spill_bytes']} bytes")
    if res["shared_bytes"] > t["smem_limit"]:
        problems.append(f"shared memory {res['shared_bytes']} B > {t['smem_limit']} B per block "
                        f"on {target_name}")
    res["problems"] = problems
    return res


def check_launch(target_name: str, qual: str, label: str, fn, args, kwargs) -> dict:
    """Compile one launch for one target and check it: a result dict with ``ok``, ``problems``
    (compile error, spill, shared memory over the limit) and, when it compiled, the resources."""
    from ascend_moe_ops.benchmark.timing import clock_for
    clock = clock_for("cpu")  # the harness's clock: compile time of the check, not a kernel timing
    t0 = clock()
    row = dict(target=target_name, kernel=qual, variant=label)
    try:
        row.update(check(target_name, compile_one(target_name, fn, args, kwargs)))
    except Exception as e:  # a compile error: report it, go on with the next kernel
        row["problems"] = [f"compile error: {type(e).__name__}: {str(e).strip()[:1500]}"]
    row["ok"] = not row["problems"]
    row["seconds"] = round(clock() - t0, 2)
    return row


#: Problems found by this check and not fixed yet: ``(target regex, kernel, variant regex,
#: problem regex, note)``. A matching failure is reported as ``known`` and does not fail the run;
#: a listed issue that no longer happens fails it (so that the entry is removed). Each one is in
#: docs/gpu_compile_check.md.
KNOWN_ISSUES = [
    (r"sm_80|sm_90|gfx942", "flash_attention._bwd_dkdv_kernel", r"BLOCK_M=(64|32) ", r"register spill|shared memory",
     "dK/dV: the fp32 accumulators (keys x (128 + 64 + 128)) plus the K/V tiles exceed the registers "
     "of 8 warps: 64-key tiles (16-bit inputs) on every target, 32-key tiles (fp32 inputs) too"),
    (r"sm_80|sm_90|gfx942", "flash_attention._(fwd|bwd_dq)_kernel", r"^fp32 ", r"register spill|shared memory",
     "fp32 inputs (32 x 32 tiles since the H200 fix of the shared-memory overflow): still spill on "
     "some targets"),
    (r"sm_80|gfx942", "flash_attention._bwd_dq_kernel", r"BLOCK_M=64 ", r"register spill|shared memory",
     "dQ of 64 queries spills on A100 and MI300 (on H100 it fits)"),
    (r"gfx942", "flash_attention._fwd_kernel", r"BLOCK_M=64 ", r"register spill|shared memory",
     "the 64 x 64 forward spills VGPRs on MI300"),
    (r"sm_80|sm_90|gfx942", "grouped_gemm._grouped_gemm_kernel", r"BLOCK_M=128 BLOCK_N=256 ",
     r"register spill|shared memory", "the 128 x 256 x 64 tile (8 warps, 3 stages; fastest in the H200 "
     "sweep) spills a few dozen to hundreds of bytes in 16-bit on NVIDIA (fp32 and AMD take smaller "
     "tiles)"),
    (r"sm_90", "grouped_gemm._grouped_gemm_kernel", r"^fp32 .*BLOCK_M=64 BLOCK_N=64 ", r"register spill",
     "fp32 (IEEE) 64 x 64 x 32: 16 B of spill on sm_90 (64 x 128 x 32 spilled 32 B, and 552 B on sm_80)"),
    (r"sm_80", "grouped_gemm._grouped_gemm_dw_kernel", r"^fp32 ", r"register spill|shared memory",
     "the fp32 (IEEE) 64 x 64 x 64 weight-gradient tile spills 68 B on A100"),
    (r"sm_80", "moe_unpermute._unpermute_bwd_kernel", r"^fp32 HAS_PROBS=False", r"register spill",
     "8 bytes of spill on A100 (fp32, no probs)"),
]


def _known(row: dict) -> Optional[int]:
    """Index of the KNOWN_ISSUES entry covering every problem of ``row``, else None."""
    for i, (tgt, kernel, variant, problem, _) in enumerate(KNOWN_ISSUES):
        if re.fullmatch(tgt, row["target"]) and re.fullmatch(kernel, row["kernel"]) \
                and re.search(variant, row["variant"]) and row["problems"] \
                and all(re.search(problem, p) for p in row["problems"]):
            return i
    return None


def _applies(i: int, row: dict) -> bool:
    tgt, kernel, variant, _, _ = KNOWN_ISSUES[i]
    return bool(re.fullmatch(tgt, row["target"]) and re.fullmatch(kernel, row["kernel"])
                and re.search(variant, row["variant"]))


def run(targets: List[str], subset: str = "full", verbose: bool = True) -> List[dict]:
    """Compile and check every launch for every target; one result dict per (target, launch).
    A failure listed in :data:`KNOWN_ISSUES` gets ``known`` (its index) and counts as ok."""
    results = []
    for tname in targets:
        for qual, label, fn, args, kwargs in collect(TARGETS[tname]["programs"], subset, amd=TARGETS[tname]["backend"] == "hip"):
            row = check_launch(tname, qual, label, fn, args, kwargs)
            if not row["ok"]:
                k = _known(row)
                if k is not None:
                    row.update(ok=True, known=k)
            results.append(row)
            if verbose:
                print(_line(row), flush=True)
    return results


def fixed_known_issues(results: List[dict]) -> List[int]:
    """KNOWN_ISSUES entries that applied to some checked variant, none of which failed."""
    out = []
    for i, (_, _, _, problem, _) in enumerate(KNOWN_ISSUES):
        rows = [r for r in results if _applies(i, r)]
        if rows and not any(r["problems"] and all(re.search(problem, p) for p in r["problems"])
                            for r in rows):
            out.append(i)
    return out


def _line(r: dict) -> str:
    if "registers" not in r:
        return f"FAIL  {r['target']:7s} {r['kernel']} [{r['variant']}]\n      " + "; ".join(r["problems"])
    extra = f" sgpr={r['sgprs']} agpr={r['agprs']}" if "sgprs" in r else ""
    status = "FAIL" if not r["ok"] else ("KNOWN" if "known" in r else "ok  ")
    return (f"{status}  {r['target']:7s} {r['kernel']} [{r['variant']}]  regs={r['registers']}{extra} "
            f"spill={r['spill_bytes']}B shared={r['shared_bytes']}B warps={r['num_warps']}"
            + ("  <- " + "; ".join(r["problems"]) if r["problems"] else ""))


def markdown(results: List[dict]) -> str:
    """The per-kernel resource table: one row per kernel and data type (the first pointer's dtype),
    one column per target with the largest registers / shared memory / spill bytes over the
    variants compiled (modes, constexprs)."""
    import triton
    targets = [t for t in TARGETS if any(r["target"] == t for r in results)]
    lines = [f"Generated by `python -m ascend_moe_ops.triton_ref.aot_check --markdown` with triton "
             f"{triton.__version__} on {datetime.date.today().isoformat()} (compiled, not run: no GPU). "
             "Each cell: registers per thread / shared memory per block / spill bytes, the maximum "
             "over the variants of that row (modes and block sizes of the GPU path). AMD: registers "
             "= VGPRs (`.vgpr_count`; SGPRs in the JSON), shared = LDS. **bold**: a problem "
             "(spill, or shared memory over the limit) listed in `KNOWN_ISSUES`; FAIL: a new one.", "",
             "| kernel | dtype | variants | " + " | ".join(
                 f"{t} (limit {TARGETS[t]['smem_limit'] // 1024} KiB)" for t in targets) + " |",
             "|---|---|---|" + "---|" * len(targets)]
    groups: Dict[tuple, Dict[str, List[dict]]] = {}
    for r in results:
        groups.setdefault((r["kernel"], r["variant"].split(" ")[0]), {}).setdefault(r["target"], []).append(r)
    for (kernel, dtype), per_target in sorted(groups.items()):
        cells = []
        for t in targets:
            rows = per_target.get(t, [])
            good = [r for r in rows if "registers" in r]
            if not good:
                cells.append("compile error" if rows else "-")
                continue
            cell = (f"{max(r['registers'] for r in good)} / {max(r['shared_bytes'] for r in good) / 1024:.1f} KiB"
                    f" / {max(r['spill_bytes'] for r in good)} B")
            if any(not r["ok"] for r in rows):
                cell = f"FAIL {cell}"
            elif any("known" in r for r in rows):
                cell = f"**{cell}**"
            cells.append(cell)
        n = max(len(v) for v in per_target.values())
        lines.append(f"| `{kernel}` | {dtype} | {n} | " + " | ".join(cells) + " |")
    lines += ["", "Limits:"] + [f"- {k} ({TARGETS[k]['gpu']}): {TARGETS[k]['source']}." for k in targets]
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--targets", default=",".join(TARGETS),
                    help=f"comma-separated subset of {', '.join(TARGETS)} (default: all)")
    ap.add_argument("--json", help="write the results (one object per kernel variant and target)")
    ap.add_argument("--markdown", help="write the per-kernel resource table")
    ap.add_argument("--subset", default="full", choices=SUBSETS,
                    help="full: every dtype; ci: bf16/fp32 data kernels, bf16 attention (faster)")
    ap.add_argument("--quiet", action="store_true", help="print failures and the summary only")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("aot_check: unset TRITON_INTERPRET (interpreted kernels cannot be compiled)")
        return 2
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        ap.error(f"--targets: unknown {unknown}; known: {list(TARGETS)}")
    import triton
    results = run(targets, args.subset, verbose=not args.quiet)
    failed = [r for r in results if not r["ok"]]
    if args.quiet:
        for r in failed:
            print(_line(r))
    fixed = fixed_known_issues(results)
    for i in fixed:
        print(f"FAIL  known issue {i} no longer happens; remove it from KNOWN_ISSUES: {KNOWN_ISSUES[i][1]} "
              f"[{KNOWN_ISSUES[i][2]}] on {KNOWN_ISSUES[i][0]}")
    launched = {r["kernel"] for r in results}
    missing = sorted(set(all_kernels()) - launched)
    if missing:
        print(f"FAIL  kernels never launched by the workloads (not checked): {missing}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(triton=triton.__version__, date=datetime.date.today().isoformat(),
                           subset=args.subset, targets={k: TARGETS[k] for k in targets},
                           missing=missing, fixed_known_issues=fixed, results=results),
                      f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(results))
    n_known = sum("known" in r for r in results)
    print(f"{len(results) - len(failed) - n_known} of {len(results)} kernel variants compiled and passed "
          f"the checks for {', '.join(targets)} (triton {triton.__version__}); {n_known} known issues, "
          f"{len(failed)} failed, {len(missing)} kernels not covered, {len(fixed)} known issues fixed")
    return 1 if failed or missing or fixed else 0


if __name__ == "__main__":
    sys.exit(main())
