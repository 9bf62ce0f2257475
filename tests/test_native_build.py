"""The build record and the safe loading of the C++ extension (ascend_moe_ops/_native.py), and the
run-time choice of the CPU level of a portable build (csrc/cpu/cpu_capability.cpp): the record
matches the running torch; a mismatch, a missing or a broken extension warns with the rebuild
command and falls back to the reference kernels (no crash); every level the CPU supports gives the
same grouped GEMM and unpermute results; bad values of ASCEND_MOE_OPS_CPU_CAPABILITY are refused or
capped."""

import json
import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from ascend_moe_ops import _native
from ascend_moe_ops.testing import cpu_flags

ROOT = Path(__file__).resolve().parents[1]
HAS_EXT = _native.problem() is None
needs_ext = pytest.mark.skipif(not HAS_EXT, reason="the native extension is not built or not usable here")
LEVELS = ("avx2", "avx512", "avx512_bf16", "amx")


def _run(code: str, env_extra=None, cwd=ROOT, pythonpath=ROOT, timeout=600):
    env = dict(os.environ, PYTHONPATH=str(pythonpath), OMP_NUM_THREADS="2")
    env.pop("ASCEND_MOE_OPS_CPU_CAPABILITY", None)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          cwd=str(cwd), timeout=timeout)


# ------------------------------------------------------------------------------ the build record
@needs_ext
def test_build_record_matches_the_running_torch():
    info = _native.build_info()
    assert info is not None, "the build wrote no ascend_moe_ops/_build_info.py"
    assert info.TORCH_VERSION == torch.__version__.split("+")[0]
    assert info.CXX11_ABI == bool(torch._C._GLIBCXX_USE_CXX11_ABI)
    assert _native.record_problem(info, torch.__version__.split("+")[0], cpu_flags()) is None
    if info.BUILD_KIND == "portable":
        assert info.CPU_FLAGS == ["-march=x86-64-v3", "-DAMO_PORTABLE_ISA=1"]
        assert info.GROUPED_GEMM_ISA == list(LEVELS)
        assert info.UNPERMUTE_ISA == ["avx2", "avx512"]
    else:
        assert getattr(info, "UNPERMUTE_ISA", []) == []


def test_record_problem_names_what_differs():
    rec = types.SimpleNamespace(TORCH_VERSION="2.6.0", CXX11_ABI=bool(torch._C._GLIBCXX_USE_CXX11_ABI),
                                BUILD_KIND="portable")
    why = _native.record_problem(rec, "2.13.0", None)
    assert "torch 2.6.0" in why and "torch 2.13.0" in why
    rec.TORCH_VERSION = "2.13.0"
    assert _native.record_problem(rec, "2.13.0", None) is None
    assert _native.record_problem(rec, "2.13.0", {"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"}) is None
    why = _native.record_problem(rec, "2.13.0", {"sse4_2", "avx"})
    assert "x86-64-v3" in why and "avx2" in why and "ASCEND_MOE_OPS_MARCH=none" in why
    rec.CXX11_ABI = not rec.CXX11_ABI
    assert "ABI" in _native.record_problem(rec, "2.13.0", None)
    assert "no torch version" in _native.record_problem(types.SimpleNamespace(), "2.13.0", None)


# a script that imports the package with a fake build record (built against another torch), and
# reports the warnings, the backend chosen, and whether a grouped GEMM still runs and is right
_MISMATCH = r"""
import json, sys, types, warnings
rec = types.ModuleType("ascend_moe_ops._build_info")
rec.TORCH_VERSION = "1.0.0"; rec.BUILD_KIND = "portable"
sys.modules["ascend_moe_ops._build_info"] = rec
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    import torch, ascend_moe_ops as amo
    x, wt = torch.randn(6, 8), torch.randn(2, 8, 4)
    gs = torch.tensor([2, 4])
    y = amo.grouped_gemm(x, wt, gs)
ref = torch.cat([x[:2] @ wt[0], x[2:] @ wt[1]])
print(json.dumps({"warnings": [str(m.message) for m in w if m.category.__name__ == "NativeBuildWarning"],
                  "backend": amo.active_backend("grouped_gemm", "cpu"),
                  "loaded": "ascend_moe_ops._C" in sys.modules,
                  "ok": bool(torch.allclose(y, ref, atol=1e-5))}))
"""


def _last_json(proc):
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_torch_mismatch_warns_with_the_rebuild_command_and_falls_back():
    out = _last_json(_run(_MISMATCH))
    assert len(out["warnings"]) == 1, out
    msg = out["warnings"][0]
    assert "built against torch 1.0.0" in msg and torch.__version__.split("+")[0] in msg
    assert "pip install --no-build-isolation ." in msg and "reference" in msg
    assert out["backend"] == "reference" and not out["loaded"] and out["ok"]


def _copy_tree(dst: Path) -> Path:
    """The package, triton_ref/ and bench/ without compiled files (for a broken or missing build)."""
    ignore = shutil.ignore_patterns("*.so", "__pycache__")
    for folder in ("ascend_moe_ops", "triton_ref", "bench"):
        shutil.copytree(ROOT / folder, dst / folder, ignore=ignore)
    return dst


_LOAD = r"""
import json, warnings
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    import torch, ascend_moe_ops as amo
    y = amo.grouped_gemm(torch.ones(3, 2), torch.ones(1, 2, 2), torch.tensor([3]))
print(json.dumps({"warnings": [str(m.message) for m in w if m.category.__name__ == "NativeBuildWarning"],
                  "file": amo.__file__, "backend": amo.active_backend("grouped_gemm", "cpu"),
                  "ok": bool((y == 2).all())}))
"""


@pytest.mark.parametrize("state", ["missing", "broken"])
def test_missing_or_broken_extension_warns_and_falls_back(tmp_path, state):
    tree = _copy_tree(tmp_path / "tree")
    if state == "broken":  # a truncated file where the extension should be
        (tree / "ascend_moe_ops" / f"_C{_ext_suffix()}").write_bytes(b"\x7fELF\x02\x01")
        (tree / "ascend_moe_ops" / "_build_info.py").write_text(
            f"TORCH_VERSION = {torch.__version__.split('+')[0]!r}\nBUILD_KIND = 'portable'\n")
    else:
        (tree / "ascend_moe_ops" / "_build_info.py").unlink(missing_ok=True)
    out = _last_json(_run(_LOAD, cwd=tmp_path, pythonpath=tree))
    assert out["file"].startswith(str(tree)), out
    assert out["backend"] == "reference" and out["ok"], out
    msgs = [m for m in out["warnings"] if "ascend_moe_ops._C" in m]
    assert len(msgs) == 1, out
    assert ("importing it failed" if state == "broken" else "not built") in msgs[0]
    assert "pip install --no-build-isolation ." in msgs[0] and "build_ext --inplace" in msgs[0]


def _ext_suffix():
    import sysconfig
    return sysconfig.get_config_var("EXT_SUFFIX")


# ------------------------------------------------------------------------------ CPU capability
def _expected_level(flags):
    if {"amx_tile", "amx_bf16"} <= flags and "avx512_bf16" in flags:
        return None  # AMX also needs the OS permission: not predictable from the flags alone
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        return "avx512_bf16" if "avx512_bf16" in flags else "avx512"
    return "avx2"


@needs_ext
def test_detected_level_follows_the_cpu_flags():
    cap = _native.cpu_capability()
    assert set(cap) == {"detected", "chosen", "grouped_gemm_kernels", "unpermute_kernels", "build"}
    exp = _expected_level(cpu_flags())
    if exp is not None:
        assert cap["detected"] == exp
    if os.environ.get("ASCEND_MOE_OPS_CPU_CAPABILITY") is None:
        assert cap["chosen"] == cap["detected"]
    if cap["build"] == "portable":
        assert cap["grouped_gemm_kernels"] == cap["chosen"]
        assert cap["unpermute_kernels"] == _unpermute_level(cap["chosen"])
    else:
        assert cap["grouped_gemm_kernels"] == "march"
        assert cap["unpermute_kernels"] == "march"


def _unpermute_level(chosen):
    """The copy of the unpermute loops a portable build runs at the chosen level (AVX2 or AVX-512)."""
    return "avx2" if chosen == "avx2" else "avx512"


# computes grouped GEMMs on the tile kernels and unpermutes (forward and backward; H = 200 takes the
# 128-column blocks, the 16-column steps and the masked tail; the large bf16 case the streaming
# stores) from fixed inputs, and saves them with the level that ran
_COMPUTE = r"""
import json, torch, ascend_moe_ops as amo
from ascend_moe_ops import _native
torch.manual_seed(0)
out = {}
for dt in (torch.float32, torch.float16, torch.bfloat16):
    gs = torch.tensor([0, 5, 37, 64, 1])
    x = torch.randn(int(gs.sum()), 200).to(dt)
    w = torch.randn(5, 200, 136).to(dt)
    wt = torch.randn(5, 136, 200).to(dt)
    dy = torch.randn(int(gs.sum()), 136).to(dt)
    n = str(dt).split(".")[1]
    out[n + "_fwd"] = amo.grouped_gemm(x, w, gs)
    out[n + "_dx"] = amo.grouped_gemm(x, wt, gs, trans_b=True)
    out[n + "_dw"] = amo.grouped_gemm_dw(x, dy, gs)
unperm_bwd = torch.ops.ascend_moe_ops.moe_unpermute_backward.default
for dt, T, S, H in ((torch.float32, 37, 3, 200), (torch.float16, 37, 3, 200), (torch.bfloat16, 37, 3, 200),
                    (torch.bfloat16, 1024, 2, 8192)):
    rid = torch.randperm(T * S).view(T, S)
    rid[::5, 1] = -1
    p = torch.randn(T * S, H).to(dt)
    pr = torch.rand(T, S)
    g = torch.randn(T, H).to(dt)
    n = f"{str(dt).split('.')[1]}_{H}"
    out[n + "_unpermute"] = amo.moe_unpermute(p, rid, pr)
    out[n + "_unpermute_dx"], out[n + "_unpermute_dprobs"] = unperm_bwd(g, p, rid, pr)
    out[n + "_unpermute_dx_noprobs"] = unperm_bwd(g, p, rid, None)[0]
torch.save(out, OUT_PATH)
print(json.dumps(_native.cpu_capability()))
"""


@needs_ext
def test_every_supported_level_gives_the_same_results(tmp_path):
    cap = _native.cpu_capability()
    if cap["build"] != "portable":
        pytest.skip("a -march build has one copy of the tile kernels")
    levels = LEVELS[:LEVELS.index(cap["detected"]) + 1]
    results = {}
    for lvl in levels:
        path = tmp_path / f"{lvl}.pt"
        env = {"ASCEND_MOE_OPS_CPU_CAPABILITY": lvl, "AMO_GG_MM": "0"}
        ran = _last_json(_run(_COMPUTE.replace("OUT_PATH", repr(str(path))), env))
        assert ran["chosen"] == lvl and ran["grouped_gemm_kernels"] == lvl, ran
        assert ran["unpermute_kernels"] == _unpermute_level(lvl), ran
        results[lvl] = torch.load(path)
    base = results[levels[0]]
    for lvl in levels[1:]:
        for name, t in results[lvl].items():
            assert torch.equal(t, base[name]), f"{name}: level {lvl} differs from {levels[0]}"
    assert len(base) == 9 + 4 * 4


@needs_ext
def test_unknown_level_is_an_error_naming_the_variable():
    code = ("import torch, ascend_moe_ops as amo\n"
            "amo.grouped_gemm(torch.ones(2, 3), torch.ones(1, 3, 2), torch.tensor([2]))\n")
    proc = _run(code, {"ASCEND_MOE_OPS_CPU_CAPABILITY": "sse9"})
    assert proc.returncode != 0
    assert "ASCEND_MOE_OPS_CPU_CAPABILITY=sse9 is not a level" in proc.stderr
    assert "avx512_bf16" in proc.stderr


@needs_ext
def test_level_above_the_cpu_warns_and_runs_at_the_cpu_level():
    cap = _native.cpu_capability()
    if cap["build"] != "portable" or cap["detected"] == "amx":
        pytest.skip("needs a portable build on a CPU without AMX")
    code = ("import json, warnings, torch, ascend_moe_ops as amo\n"
            "from ascend_moe_ops import _native\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    c = _native.cpu_capability()\n"
            "print(json.dumps({'cap': c, 'w': [str(m.message) for m in w]}))\n")
    proc = _run(code, {"ASCEND_MOE_OPS_CPU_CAPABILITY": "amx"})
    out = _last_json(proc)
    assert out["cap"]["chosen"] == cap["detected"]
    # a C++ warning outside an op call goes to stderr, inside one to Python's warnings
    said = out["w"] + [proc.stderr]
    assert any("ASCEND_MOE_OPS_CPU_CAPABILITY=amx is above" in m for m in said), (out, proc.stderr[-2000:])


# AVX-512 / AMX registers and EVEX-only mnemonics (an AVX2 CPU faults on any of them)
_AVX512_INSN = re.compile(
    r"%zmm|%k[1-7]\b|%[xy]mm(1[6-9]|2\d|3[01])\b|%tmm|\btdp|\bvdpbf16|\bvcvtne2?ps2bf16|\bvpternlog|\bvperm[it]2"
    r"|\bvpro[lr]|\bvpmov(u?s)?(db|dw|qb|qw|qd|wb)\b|\bvpmov(m2[bwdq]|[bwdq]2m)|\bvp?compress|\bvp?expand|\bvalign|\bvfixupimm"
    r"|\bvgetexp|\bvgetmant|\bvrndscale|\bvscalef|\bvrcp14|\bvrsqrt14|\bvpabsq|\bvpm(ax|in)[su]q|\bvpsraq"
    r"|\bvpconflict|\bvplzcnt|\bvpmullq|\bv(insert|extract)[fi](32x4|64x2|32x8|64x4)"
    r"|\bvbroadcast[fi](32x2|32x4|64x2|32x8|64x4)|\bvshuf[fi](32x4|64x2)|\bvpermw\b|\bvps[lr]lvw|\bvpsravw"
    r"|\bvpcmpu?[bwdq]\b")


@needs_ext
@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs objdump")
def test_portable_build_has_avx512_code_only_in_the_per_isa_namespaces():
    """A portable build runs on any x86-64-v3 CPU: every function of the extension that uses an
    AVX-512 / AMX instruction belongs to a per-ISA copy of the tile kernels (namespaces isa_*),
    which run only after the CPUID check; in particular no inline function shared between units
    (ATen, c10, the standard library) was emitted with AVX-512 code."""
    info = _native.build_info()
    if getattr(info, "BUILD_KIND", "") != "portable":
        pytest.skip("not a portable build")
    import ascend_moe_ops._C as ext
    out = subprocess.run(["objdump", "-d", "-C", "--no-show-raw-insn", ext.__file__], capture_output=True,
                         text=True, check=True, timeout=900).stdout
    fn, bad, isa = None, set(), set()
    for line in out.splitlines():
        if line.endswith(">:") and " <" in line:
            fn = line.split(" <", 1)[1][:-2]
        elif fn and _AVX512_INSN.search(line):
            (isa if "::isa_" in fn else bad).add(fn)
    assert isa, "no AVX-512 code at all: the per-ISA tile kernels are missing"
    assert not bad, f"AVX-512 / AMX code outside the per-ISA namespaces: {sorted(bad)[:10]}"
