"""The NPU host glue (csrc/ascend/moe_permute.cpp, moe_unpermute.cpp, grouped_gemm.cpp,
flash_attention.cpp) type-checks with ``g++ -fsyntax-only`` against the torch headers and the headers
shipped inside the torch_npu wheel of the same torch version (acl, torch_npu/csrc/...). The wheel is
downloaded with ``pip download --no-deps`` and unpacked under build/ — never installed (an installed
torch_npu breaks ``import torch`` on a machine without CANN). The kernel launchers that CANN's
ascendc_library() generates (aclrtlaunch_<kernel>) are replaced by the labelled stub declarations in
csrc/ascend/host/stubs. Skips, with the reason printed, when the wheel or a header is unavailable.

ASCEND_MOE_OPS_TORCH_NPU_INCLUDE=<dir> uses an already unpacked ``torch_npu/include`` instead.
"""

import glob
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile

import pytest
import torch

from _ascend_cxx import ASCEND, CACHE, ROOT, ascend_headers

GLUE = ["moe_permute.cpp", "moe_unpermute.cpp", "grouped_gemm.cpp", "flash_attention.cpp"]
NEEDED = ["acl/acl.h", "torch_npu/csrc/framework/OpCommand.h", "torch_npu/csrc/core/npu/NPUStream.h"]


def _skip(reason):
    print(f"SKIP test_ascend_glue: {reason}")
    pytest.skip(reason)


def _torch_npu_include():
    env = os.environ.get("ASCEND_MOE_OPS_TORCH_NPU_INCLUDE")
    if env:
        return env
    version = torch.__version__.split("+")[0]
    dest = os.path.join(ROOT, "build", f"torch_npu-{version}-include")
    if os.path.isdir(os.path.join(dest, "torch_npu", "include")):
        return os.path.join(dest, "torch_npu", "include")
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
               f"torch_npu=={version}", "-d", tmp]
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired:
            _skip(f"pip download torch_npu=={version} timed out")
        wheels = glob.glob(os.path.join(tmp, "torch_npu-*.whl"))
        if res.returncode != 0 or not wheels:
            _skip(f"cannot fetch the torch_npu=={version} wheel: {res.stderr.strip()[-300:]}")
        staging = dest + f".tmp{os.getpid()}"
        with zipfile.ZipFile(wheels[0]) as z:
            z.extractall(staging, [n for n in z.namelist() if n.startswith("torch_npu/include/")])
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(staging, dest)
    return os.path.join(dest, "torch_npu", "include")


@pytest.fixture(scope="module")
def npu_include():
    if shutil.which("g++") is None:
        _skip("g++ is not installed")
    inc = _torch_npu_include()
    missing = [h for h in NEEDED if not os.path.exists(os.path.join(inc, h))]
    if missing:
        _skip(f"the torch_npu wheel lacks headers the glue needs: {missing}")
    return inc


def _syntax_check_cmd(src, npu_inc):
    from torch.utils.cpp_extension import include_paths
    cmd = ["g++", "-std=c++17", "-fsyntax-only", "-w", "-DAMO_ASCEND_GLUE_TYPECHECK", "-I", ASCEND]
    for p in include_paths():
        cmd += ["-I", p]
    return cmd + ["-I", npu_inc, os.path.join(ASCEND, src)]


def test_glue_type_checks_against_torch_npu_headers(npu_include):
    """Every glue file, compiled in parallel; a pass is cached on the hash of sources + headers."""
    h = hashlib.sha256(torch.__version__.encode() + npu_include.encode())
    for path in [os.path.join(ASCEND, g) for g in GLUE] + ascend_headers():
        with open(path, "rb") as f:
            h.update(f.read())
    stamp = os.path.join(CACHE, f"glue-syntax-{h.hexdigest()[:16]}.ok")
    if os.path.exists(stamp):
        return
    procs = {g: subprocess.Popen(_syntax_check_cmd(g, npu_include), stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for g in GLUE}
    errors = {}
    for g, p in procs.items():
        _, err = p.communicate(timeout=600)
        if p.returncode != 0:
            errors[g] = err[-3000:]
    assert not errors, "glue does not type-check:\n" + "\n".join(f"--- {g}\n{e}" for g, e in errors.items())
    os.makedirs(CACHE, exist_ok=True)
    open(stamp, "w").close()


def test_stub_launchers_match_kernel_entries():
    """Each kernel entry point has a stub launcher with the same GM arguments (+ blockDim, stream)."""
    import re
    stubs = open(os.path.join(ASCEND, "host", "stubs", "aclrtlaunch_amo_kernels.h")).read()
    for src in glob.glob(os.path.join(ASCEND, "kernels", "*.cpp")):
        text = open(src).read()
        for name, args in re.findall(r'extern "C" __global__ __aicore__ void (\w+)\(([^)]*)\)', text):
            n_gm = args.count("GM_ADDR")
            m = re.search(r"aclrtlaunch_%s\(([^)]*)\)" % name, stubs)
            assert m, f"no stub launcher for kernel {name}"
            assert m.group(1).count("void*") == n_gm, f"{name}: stub and kernel disagree on the arguments"


# ---- one host function per op: the NPU glue and the emulator glue cannot drift apart again --------------
# Every op's host code (checks, tiling, allocation, row maps, launch sequence) lives once in
# csrc/ascend/host/<op>_host.h as a template on its Launcher; the NPU glue TUs and the emulator TU only
# instantiate it. These scans fail when either side grows logic of its own again.

_HOST_OPS = {  # host header -> the ops it implements (registered by both sides)
    "moe_permute_host.h": ["moe_permute"],
    "moe_unpermute_host.h": ["moe_unpermute", "moe_unpermute_backward"],
    "grouped_gemm_host.h": ["grouped_gemm", "grouped_gemm_dw"],
    "flash_attention_host.h": ["flash_attention_fwd", "flash_attention_bwd"],
}
_EMU_TU = "emu_bindings.cpp"
# what only per-op host code does: checks, tilings, allocations, kernel launches, device copies
_LOGIC = [r"TORCH_CHECK", r"\bchecks::", r"compute_\w+_tiling", r"\bat::(empty|zeros|full|where|arange)\b",
          r"aclrtlaunch_", r"ascend_emu::launch", r"\.contiguous\(\)", r"\.to\(", r"row_id_map|compute_row"]


def _code(text):
    import re
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return "\n".join(line.split("//")[0] for line in text.splitlines())


def _glue_problems(name, text, launcher):
    """What is wrong with a glue TU: per-op logic of its own, or an op not taken from its host header."""
    import re
    code = _code(text)
    problems = [f"{name}: per-op logic ({pat})" for pat in _LOGIC if re.search(pat, code)]
    for op, fn in re.findall(r'm\.impl\("(\w+)",\s*([^;]*)\);', code):
        if not re.fullmatch(r"TORCH_FN\((amo_ascend::)?host::%s<%s>\)" % (op, launcher), fn.strip()):
            problems.append(f"{name}: op {op} is registered with {fn.strip()}, not host::{op}<{launcher}>")
    return problems


def _registered(text):
    import re
    return set(re.findall(r'm\.impl\("(\w+)"', _code(text)))


def test_npu_and_emu_glue_instantiate_the_same_host_code():
    npu_ops, emu_text = set(), open(os.path.join(ASCEND, _EMU_TU)).read()
    problems = _glue_problems(_EMU_TU, emu_text, "EmuLauncher")
    for header, ops in _HOST_OPS.items():
        hpath = os.path.join(ASCEND, "host", header)
        htext = _code(open(hpath).read())
        for op in ops:
            assert f"template <class L>" in htext and re.search(r"\b%s\(" % op, htext), f"{header} lacks {op}"
        assert f'#include "host/{header}"' in emu_text, f"{_EMU_TU} does not include host/{header}"
    for g in GLUE:
        text = open(os.path.join(ASCEND, g)).read()
        problems += _glue_problems(g, text, "NpuLauncher")
        npu_ops |= _registered(text)
    assert not problems, "\n".join(problems)
    every = {op for ops in _HOST_OPS.values() for op in ops}
    assert npu_ops == every, f"NPU glue registers {sorted(npu_ops)}, host headers implement {sorted(every)}"
    assert _registered(emu_text) == every, f"{_EMU_TU} registers {sorted(_registered(emu_text))}"


def test_launchers_hold_no_per_op_code():
    """The launchers know kernels only through the one kernel list; no tiling, no op names."""
    for path in [os.path.join(ASCEND, "host", "emu_launcher.h"), os.path.join(ASCEND, "host", "npu_common.h")]:
        code = _code(open(path).read())
        for pat in [r"compute_\w+_tiling", r"\bchecks::", r"Tiling\b", r"row_map"]:
            assert not re.search(pat, code), f"{os.path.basename(path)}: {pat}"


def test_the_glue_scan_catches_a_twin():
    """The scan itself: a glue TU with its own check, or registering its own function, is caught."""
    ok = 'TORCH_LIBRARY_IMPL(ascend_moe_ops, PrivateUse1, m) {\n  m.impl("moe_permute", TORCH_FN(amo_ascend::host::moe_permute<NpuLauncher>));\n}\n'
    assert _glue_problems("ok.cpp", ok, "NpuLauncher") == []
    twin = ok.replace("amo_ascend::host::moe_permute<NpuLauncher>", "moe_permute_npu")
    twin = "at::Tensor moe_permute_npu(const at::Tensor& t) {\n  TORCH_CHECK(t.dim() == 2);\n  return at::empty({1});\n}\n" + twin
    found = _glue_problems("twin.cpp", twin, "NpuLauncher")
    assert any("TORCH_CHECK" in p for p in found) and any("at::" in p for p in found)
    assert any("not host::moe_permute<NpuLauncher>" in p for p in found)
    assert _glue_problems("c.cpp", ok + "// TORCH_CHECK in a comment is fine\n", "NpuLauncher") == []
