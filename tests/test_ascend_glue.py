"""The NPU host glue (csrc/ascend/*.cpp but emu_bindings.cpp: one glue TU per op family and
npu_bindings.cpp) type-checks with ``g++ -fsyntax-only`` against the torch headers and the headers
shipped inside the torch_npu wheel of the same torch version (acl, torch_npu/csrc/...). The wheel is
downloaded with ``pip download --no-deps`` and unpacked under build/ — never installed (an installed
torch_npu breaks ``import torch`` on a machine without CANN). The kernel launchers that CANN's
ascendc_library() generates (aclrtlaunch_<kernel>) are replaced by the labelled stand-in declarations
of AMO_ASCEND_KERNEL under -DAMO_ASCEND_GLUE_TYPECHECK (csrc/ascend/host/launch.h). Skips, with the reason printed, when the wheel or a header is unavailable.

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

GLUE = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ASCEND, "*.cpp")) if not p.endswith("emu_bindings.cpp"))
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


def test_declared_launchers_match_kernel_entries():
    """Each kernel entry is declared once (AMO_ASCEND_KERNEL in a host header) with its GM argument
    count: the stand-in launcher of the type-check and the emulator's declaration both derive from it."""
    declared = {}
    for h in glob.glob(os.path.join(ASCEND, "host", "*_host.h")):
        for name, n in re.findall(r"^AMO_ASCEND_KERNEL\((\w+), (\d+)\)", open(h).read(), flags=re.M):
            assert name not in declared, f"{name} declared twice"
            declared[name] = int(n)
    entries = {}
    for src in glob.glob(os.path.join(ASCEND, "kernels", "*.cpp")):
        for name, args in re.findall(r'extern "C" __global__ __aicore__ void (\w+)\(([^)]*)\)', open(src).read()):
            entries[name] = args.count("GM_ADDR")
    assert declared == entries, f"declared {declared}, kernel entries {entries}"


# ---- one host function per op: the NPU glue and the emulator glue cannot drift apart again --------------
# Every op's host code (checks, tiling, allocation, row maps, launch sequence) lives once in
# csrc/ascend/host/<family>_host.h as a template on its Launcher; its glue TU csrc/ascend/<family>.cpp,
# compiled into both the emulator extension and the NPU library, only names the ops (AMO_ASCEND_OP), and
# the shared TUs (emu_bindings.cpp, npu_bindings.cpp) only expand the op list. These scans fail when any
# of them grows logic of its own again.

def _ascend_ops():
    """family -> the ASCENDC ops of the op list (csrc/common/op_list.h)."""
    text = open(os.path.join(ASCEND, "..", "common", "op_list.h")).read()
    fams = {}
    for op, fam, _scope, asc, _grad in re.findall(r"X\((\w+),\s*(\w+),\s*(\w+),\s*(\w+),\s*(\w+)\)", text):
        if asc == "ASCENDC":
            fams.setdefault(fam, []).append(op)
    return fams


_SHARED_TUS = ["emu_bindings.cpp", "npu_bindings.cpp"]
# what only per-op host code does: checks, tilings, allocations, kernel launches, device copies
_LOGIC = [r"TORCH_CHECK", r"\bchecks::", r"compute_\w+_tiling", r"\bat::(empty|zeros|full|where|arange)\b",
          r"aclrtlaunch_", r"ascend_emu::launch", r"\.contiguous\(\)", r"\.to\(", r"row_id_map|compute_row",
          r"m\.impl\("]


def _code(text):
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return "\n".join(line.split("//")[0] for line in text.splitlines())


def _glue_problems(name, text):
    """What is wrong with a glue TU: per-op logic or a registration of its own."""
    code = _code(text)
    return [f"{name}: per-op logic ({pat})" for pat in _LOGIC if re.search(pat, code)]


def _registered(text):
    return set(re.findall(r"^AMO_ASCEND_OP\((\w+)\)", _code(text), flags=re.M))


def test_glue_tus_instantiate_the_host_code_of_the_op_list():
    fams = _ascend_ops()
    problems = []
    for tu in _SHARED_TUS:
        text = open(os.path.join(ASCEND, tu)).read()
        problems += _glue_problems(tu, text)
        assert "register_ascend(" in _code(text) and not _registered(text), tu
    for fam, ops in fams.items():
        htext = _code(open(os.path.join(ASCEND, "host", f"{fam}_host.h")).read())
        for op in ops:
            assert "template <class L>" in htext and re.search(r"\b%s\(" % op, htext), f"{fam}_host.h lacks {op}"
        text = open(os.path.join(ASCEND, f"{fam}.cpp")).read()
        problems += _glue_problems(f"{fam}.cpp", text)
        assert f'#include "host/{fam}_host.h"' in text, f"{fam}.cpp does not include host/{fam}_host.h"
        assert _registered(text) == set(ops), f"{fam}.cpp registers {sorted(_registered(text))}, the list {ops}"
    assert not problems, "\n".join(problems)
    glue = {g[:-4] for g in GLUE} - {t[:-4] for t in _SHARED_TUS}
    assert glue == set(fams), f"glue TUs {sorted(glue)}, ASCENDC families of the op list {sorted(fams)}"


def test_launchers_hold_no_per_op_code():
    """The launchers know no kernel, tiling or op."""
    for path in [os.path.join(ASCEND, "host", "emu_launcher.h"), os.path.join(ASCEND, "host", "npu_common.h")]:
        code = _code(open(path).read())
        for pat in [r"compute_\w+_tiling", r"\bchecks::", r"Tiling\b", r"row_map", r"\bamo_(?!ascend\b)\w+"]:
            assert not re.search(pat, code), f"{os.path.basename(path)}: {pat}"


def test_the_glue_scan_catches_a_twin():
    """The scan itself: a glue TU with its own check, or registering its own function, is caught."""
    ok = '#include "host/moe_permute_host.h"\n#include "host/register.h"\n\nAMO_ASCEND_OP(moe_permute)\n'
    assert _glue_problems("ok.cpp", ok) == [] and _registered(ok) == {"moe_permute"}
    twin = ok + 'at::Tensor moe_permute_npu(const at::Tensor& t) {\n  TORCH_CHECK(t.dim() == 2);\n  return at::empty({1});\n}\n'
    twin += 'TORCH_LIBRARY_IMPL(ascend_moe_ops, PrivateUse1, m) {\n  m.impl("moe_permute", TORCH_FN(moe_permute_npu));\n}\n'
    found = _glue_problems("twin.cpp", twin)
    assert any("TORCH_CHECK" in p for p in found) and any("at::" in p for p in found)
    assert any("m\\.impl" in p for p in found)
    assert _glue_problems("c.cpp", ok + "// TORCH_CHECK in a comment is fine\n") == []
