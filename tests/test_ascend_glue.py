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
