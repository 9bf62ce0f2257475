"""GPU compile check of every Triton kernel without a GPU (``ascend_moe_ops.triton_ref.aot_check``).

Runs in a subprocess with ``TRITON_INTERPRET`` unset (the suite sets it for the CPU tests, and
interpreted kernels cannot be compiled). Fast: the sm_90 check of every kernel in the ``ci`` subset
(bf16/fp32 data kernels, bf16 attention) and the detection of the three failure kinds (compile
error, register spill, shared memory over the limit) on deliberately bad kernels. Slow: the same
subset for sm_80 and gfx942 (MI300: AMDGCN from triton's bundled LLVM, no ROCm needed) and the bad
kernels on gfx942. Every dtype: the command line (``--subset full``, docs/gpu_compile_check.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

MODULE = "ascend_moe_ops.triton_ref.aot_check"


def _env():
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    return env


def _run(args, timeout):
    return subprocess.run([sys.executable, *args], env=_env(), capture_output=True, text=True,
                          timeout=timeout)


def _check(tmp_path, targets, subset, timeout):
    out = tmp_path / "aot.json"
    r = _run(["-m", MODULE, "--targets", targets, "--subset", subset, "--quiet", "--json", str(out)],
             timeout)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    with open(out) as f:
        rep = json.load(f)
    assert rep["missing"] == [] and rep["fixed_known_issues"] == []
    kernels = {r["kernel"] for r in rep["results"]}
    # every launchable kernel of every Triton module, on every target asked for
    for mod in ("moe_permute", "moe_unpermute", "grouped_gemm", "flash_attention"):
        assert any(k.startswith(mod + ".") for k in kernels), mod
    for row in rep["results"]:
        assert row["ok"], row
        assert row["registers"] > 0 and row["num_warps"] in (1, 2, 4, 8, 16)
        limit = rep["targets"][row["target"]]["smem_limit"]
        assert row["shared_bytes"] <= limit or "known" in row, row
        assert row["spill_bytes"] == 0 or "known" in row, row
    return rep


def test_every_kernel_compiles_for_sm90(tmp_path):
    rep = _check(tmp_path, "sm_90", "ci", 900)
    assert {r["target"] for r in rep["results"]} == {"sm_90"}
    assert len(rep["results"]) > 40


def test_interpreter_is_refused():
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-m", MODULE, "--targets", "sm_90"], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "unset TRITON_INTERPRET" in r.stdout


BAD_KERNELS = '''
import triton
import triton.language as tl


@triton.jit
def good_kernel(x_ptr, y_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < N) * 2, mask=offs < N)


@triton.jit
def compile_error_kernel(x_ptr, N, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)  # BLOCK = 3: tl.arange needs a power of two
    tl.store(x_ptr + offs, tl.load(x_ptr + offs))


@triton.jit
def spill_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
    r = tl.arange(0, BLOCK)  # a 128 x 128 fp32 tile live across two reductions, one warp
    x = tl.load(x_ptr + r[:, None] * BLOCK + r[None, :])
    y = x / tl.sum(x, axis=1)[:, None] + tl.sum(x, axis=0)[None, :]
    tl.store(y_ptr + r[:, None] * BLOCK + r[None, :], y)


@triton.jit
def big_smem_kernel(a_ptr, b_ptr, c_ptr, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rm = tl.arange(0, BM)  # 256 x 128 + 128 x 256 fp16 tiles, 4 pipeline stages
    rn = tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], tl.float32)
    for k in range(0, K, BK):
        a = tl.load(a_ptr + rm[:, None] * K + (k + rk)[None, :])
        b = tl.load(b_ptr + (k + rk)[:, None] * BN + rn[None, :])
        acc += tl.dot(a, b)
    tl.store(c_ptr + rm[:, None] * BN + rn[None, :], acc)
'''

DRIVER = '''
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
import bad_kernels as B
from ascend_moe_ops.triton_ref import aot_check as A

f16 = torch.float16
cases = {
    "good": (B.good_kernel, (torch.empty(1024), torch.empty(1024), 1000), dict(BLOCK=256)),
    "compile_error": (B.compile_error_kernel, (torch.empty(16), 16), dict(BLOCK=3)),
    "spill": (B.spill_kernel, (torch.empty(128 * 128), torch.empty(128 * 128)), dict(BLOCK=128, num_warps=1)),
    "big_smem": (B.big_smem_kernel, (torch.empty(256 * 1024, dtype=f16), torch.empty(1024 * 256, dtype=f16),
                                     torch.empty(256 * 256), 1024),
                 dict(BM=256, BN=256, BK=128, num_warps=8, num_stages=4)),
}
out = {}
for target in sys.argv[2].split(","):
    for name in sys.argv[3].split(","):
        fn, args, kw = cases[name]
        r = A.check_launch(target, name, "", fn, args, kw)
        out[target + "/" + name] = dict(ok=r["ok"], problems=r["problems"])
print("RESULT" + json.dumps(out))
'''


def _bad(tmp_path, targets, names):
    (tmp_path / "bad_kernels.py").write_text(textwrap.dedent(BAD_KERNELS))
    (tmp_path / "driver.py").write_text(textwrap.dedent(DRIVER))
    r = _run([str(tmp_path / "driver.py"), str(tmp_path), targets, names], 600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(r.stdout.split("RESULT", 1)[1])


def test_check_fails_on_compile_error_spill_and_shared_memory(tmp_path):
    res = _bad(tmp_path, "sm_90", "good,compile_error,spill,big_smem")
    assert res["sm_90/good"] == dict(ok=True, problems=[])
    ce = res["sm_90/compile_error"]
    assert not ce["ok"] and ce["problems"][0].startswith("compile error") and "power of 2" in ce["problems"][0]
    sp = res["sm_90/spill"]
    assert not sp["ok"] and any(p.startswith("register spill") for p in sp["problems"])
    sm = res["sm_90/big_smem"]
    assert not sm["ok"] and any(p.startswith("shared memory") and "> 232448 B" in p for p in sm["problems"])


@pytest.mark.slow
def test_check_fails_on_amd_too(tmp_path):
    res = _bad(tmp_path, "gfx942", "good,compile_error,big_smem")
    assert res["gfx942/good"]["ok"]
    assert res["gfx942/compile_error"]["problems"][0].startswith("compile error")
    probs = res["gfx942/big_smem"]["problems"]
    assert any(p.startswith("shared memory") and "> 65536 B" in p for p in probs)
    assert any(p.startswith("register spill") for p in probs)


@pytest.mark.slow
@pytest.mark.parametrize("target", ["sm_80", "gfx942"])
def test_every_kernel_compiles_for_a100_and_mi300(tmp_path, target):
    # minutes each with a cold Triton cache on 2 cores; every dtype of every target:
    # `python -m ascend_moe_ops.triton_ref.aot_check` (docs/gpu_compile_check.md)
    rep = _check(tmp_path, target, "ci", 1800)
    assert {r["target"] for r in rep["results"]} == {target}
