"""The one C++ op list (csrc/common/op_list.h) against the files and the registered ops.

Every C++ registration derives from ``ASCEND_MOE_OPS_FOR_EACH_OP`` (common/op_registry.h,
ascend/host/register.h); these checks keep the list and the tree in agreement, so that adding an op
on the C++ side is its own files plus one line of the list (docs/design.md, "Adding an op"):

* every op of the list has its schema in ascend_moe_ops/_library.py (registered in its home
  namespace), and every op with a native kernel is in the list;
* its CPU kernel file, its C++ autograd file (CXX_GRAD ops) and, for ASCENDC ops, its host code and
  glue TU exist and name it, and the registered kernels follow the list when the extensions are built;
* every public op's contract (amo::checks::<op>) is in its family's common/<family>_checks.h and is
  bound as _C._check_<op> from its own CPU kernel file (AMO_OP_CONTRACT);
* the ASCENDC ops' host code declares exactly the kernel entries of csrc/ascend/kernels;
* the shared C++ files (those of no op family) hold no per-op code beyond the list.
"""

import glob
import os
import re

import pytest
import torch

import ascend_moe_ops  # noqa: F401  (defines the schemas)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(ROOT, "csrc")
OP_LIST = os.path.join(CSRC, "common", "op_list.h")
ROW = re.compile(r"^\s*X\((\w+),\s*(\w+),\s*(\w+),\s*(\w+),\s*(\w+)\)\s*\\?\s*$", re.M)
COLUMNS = {"scope": {"PUBLIC_OP", "INTERNAL_OP"}, "ascendc": {"ASCENDC", "NO_ASCENDC"},
           "autograd": {"CXX_GRAD", "NO_CXX_GRAD"}}
HOME = {"PUBLIC_OP": "ascend_moe_ops", "INTERNAL_OP": "ascend_moe_ops_native"}
NATIVE = "ascend_moe_ops_native"


def parse_op_list(text):
    """[(op, family, scope, ascendc, autograd)] of an op_list.h text; raises on a malformed row."""
    assert "#define ASCEND_MOE_OPS_FOR_EACH_OP(X)" in text, "no #define ASCEND_MOE_OPS_FOR_EACH_OP(X)"
    rows = ROW.findall(text)
    calls = re.findall(r"^\s*X\(", text, re.M)
    assert len(rows) == len(calls), "a row of the op list does not have the five columns"
    for op, fam, scope, asc, grad in rows:
        for col, value in zip(COLUMNS, (scope, asc, grad)):
            assert value in COLUMNS[col], f"{op}: {col} is {value}, not one of {sorted(COLUMNS[col])}"
        assert op == op.lower() and fam == fam.lower(), op
    names = [r[0] for r in rows]
    assert len(names) == len(set(names)), "an op is listed twice"
    return rows


OPS = parse_op_list(open(OP_LIST).read())
FAMILIES = sorted({r[1] for r in OPS})


def _code(text):
    """The text without comments."""
    return re.sub(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"',
                  lambda m: m.group(0) if m.group(0).startswith('"') else " ", text, flags=re.S)


def _read(*parts):
    path = os.path.join(CSRC, *parts)
    return _code(open(path).read()) if os.path.exists(path) else None


def _native_loaded():
    try:
        import ascend_moe_ops._C  # noqa: F401
        return True
    except Exception:
        return False


def _emu_loaded():
    try:
        import ascend_moe_ops._ascendc_emu  # noqa: F401
        return True
    except Exception:
        return False


def test_the_parser_rejects_a_malformed_row():
    good = "#define ASCEND_MOE_OPS_FOR_EACH_OP(X) \\\n  X(a, a, PUBLIC_OP, ASCENDC, CXX_GRAD) \\\n  X(b, a, INTERNAL_OP, NO_ASCENDC, NO_CXX_GRAD)\n"
    assert [r[0] for r in parse_op_list(good)] == ["a", "b"]
    for bad in (good.replace("INTERNAL_OP", "PRIVATE_OP"), good.replace(", NO_CXX_GRAD)", ")"),
                good.replace("X(b, a", "X(a, a")):
        with pytest.raises(AssertionError):
            parse_op_list(bad)


@pytest.mark.parametrize("op,family,scope,ascendc,autograd", OPS, ids=[r[0] for r in OPS])
def test_each_op_has_its_schema_and_files(op, family, scope, ascendc, autograd):
    home = HOME[scope]
    assert hasattr(getattr(torch.ops, home), op), f"{home}::{op}: no schema (ascend_moe_ops/_library.py)"
    cpu = _read("cpu", f"{family}.cpp")
    assert cpu is not None, f"no CPU kernel file csrc/cpu/{family}.cpp"
    assert len(re.findall(r"\bAMO_CPU_KERNEL\(%s," % op, cpu)) == 1, f"csrc/cpu/{family}.cpp: AMO_CPU_KERNEL({op}, ...)"
    grad = _read("cpu", f"{family}_autograd.cpp") or ""
    has_grad = re.search(r"\bAMO_CXX_AUTOGRAD\(%s," % op, grad) is not None
    assert has_grad == (autograd == "CXX_GRAD"), f"{op}: autograd column {autograd}, {family}_autograd.cpp disagrees"
    glue = _read("ascend", f"{family}.cpp") or ""
    has_glue = re.search(r"^AMO_ASCEND_OP\(%s\)" % op, glue, re.M) is not None
    assert has_glue == (ascendc == "ASCENDC"), f"{op}: ascendc column {ascendc}, csrc/ascend/{family}.cpp disagrees"
    if ascendc == "ASCENDC":
        host = _read("ascend", "host", f"{family}_host.h")
        assert host and re.search(r"template <class L>\s*[^;{]*?\b%s\(" % op, host), f"host/{family}_host.h lacks {op}<L>"
    contract = _read("common", f"{family}_checks.h") or ""
    has_contract = re.search(r"^inline\s[^;{]*?\b%s\(" % op, contract, re.M) is not None
    assert has_contract == (scope == "PUBLIC_OP"), \
        f"{op}: scope {scope}, amo::checks::{op} in common/{family}_checks.h: {has_contract}"
    bound = re.search(r"^AMO_OP_CONTRACT\(%s\)" % op, cpu, re.M) is not None
    assert bound == (scope == "PUBLIC_OP"), f"{op}: scope {scope}, AMO_OP_CONTRACT({op}) in cpu/{family}.cpp: {bound}"


def test_no_registration_outside_the_list():
    """Every AMO_CPU_KERNEL / AMO_CXX_AUTOGRAD / AMO_ASCEND_OP / AMO_OP_CONTRACT in the tree names an op
    of the list (the C++ build fails too: the op's function is not declared)."""
    names = {r[0] for r in OPS}
    macros = r"^\s*(AMO_CPU_KERNEL|AMO_CXX_AUTOGRAD|AMO_ASCEND_OP|AMO_OP_CONTRACT)\((\w+)"
    for path in glob.glob(os.path.join(CSRC, "**", "*.cpp"), recursive=True):
        for macro, op in re.findall(macros, _code(open(path).read()), re.M):
            assert op in names, f"{os.path.relpath(path, ROOT)}: {macro}({op}) but {op} is not in op_list.h"


def test_every_registered_op_is_in_the_list():
    """The reverse direction: every op of the native namespace and of the public namespace is listed,
    and every PUBLIC_OP row is a public op, so no op is registered by hand."""
    listed = {r[0]: r[2] for r in OPS}
    names = torch._C._dispatch_get_all_op_names()
    native = {n.split("::")[1].split(".")[0] for n in names if n.startswith(NATIVE + "::")}
    public = {n.split("::")[1].split(".")[0] for n in names if n.startswith("ascend_moe_ops::")}
    assert native, "no op in the native namespace"
    assert native <= set(listed), f"not in op_list.h: {sorted(native - set(listed))}"
    assert public <= set(listed), f"public-namespace ops not in op_list.h: {sorted(public - set(listed))}"
    assert {op for op, s in listed.items() if s == "PUBLIC_OP"} <= public


@pytest.mark.skipif(not _native_loaded(), reason="the C++ extension ascend_moe_ops._C is not built")
def test_native_registrations_follow_the_list():
    from ascend_moe_ops import _library
    guarded = {s.name for s in _library.specs() if s.backward_of}  # backward ops: the Python double-backward guard
    for op, _fam, scope, _asc, grad in OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"{NATIVE}::{op}", "CPU"), op
        home = HOME[scope]
        has = torch._C._dispatch_has_kernel_for_dispatch_key(f"{home}::{op}", "Autograd")
        if op in guarded:
            assert grad != "CXX_GRAD", f"{op}: a backward op with C++ autograd would bypass the guard"
            line = [ln for ln in torch._C._dispatch_dump(f"{home}::{op}").splitlines() if ln.startswith("Autograd")]
            assert has and line and "_library.py" in line[0], (op, line)
            continue
        if grad == "CXX_GRAD" or home == "ascend_moe_ops":
            assert has == (grad == "CXX_GRAD"), f"{home}::{op}: C++ autograd registered {has}, list says {grad}"
        if grad == "CXX_GRAD":
            line = [ln for ln in torch._C._dispatch_dump(f"{home}::{op}").splitlines() if ln.startswith("Autograd")]
            assert line and "autograd.cpp" in line[0], (op, line)
    import ascend_moe_ops._C as C
    assert {n[len("_check_"):] for n in dir(C) if n.startswith("_check_")} == \
        {r[0] for r in OPS if r[2] == "PUBLIC_OP"}, "one _check_<op> per public op"


@pytest.mark.skipif(not _emu_loaded(), reason="the emulator extension ascend_moe_ops._ascendc_emu is not built")
def test_emulator_registers_exactly_the_ascendc_ops():
    for op, _fam, scope, asc, _grad in OPS:
        if scope != "PUBLIC_OP":
            continue
        has = torch._C._dispatch_has_kernel_for_dispatch_key(f"ascend_moe_ops_emu::{op}", "CPU")
        # mla_attention on the emulator is a Python composition of the ASCENDC ops (registered from Python)
        if asc == "ASCENDC" or not has:
            assert has == (asc == "ASCENDC"), f"ascend_moe_ops_emu::{op}: kernel {has}, list says {asc}"
        else:
            line = [ln for ln in torch._C._dispatch_dump(f"ascend_moe_ops_emu::{op}").splitlines()
                    if ln.startswith("CPU")]
            assert line and ".py:" in line[0], f"{op} is NO_ASCENDC but has a C++ emulator kernel: {line}"


def test_ascend_kernels_match_the_list():
    """The kernel entries of csrc/ascend/kernels are exactly those the ASCENDC families' host code
    declares (AMO_ASCEND_KERNEL, one each, same GM argument count), each in a kernel file of its family."""
    ascend_fams = {r[1] for r in OPS if r[3] == "ASCENDC"}
    declared = {}
    for path in glob.glob(os.path.join(CSRC, "ascend", "host", "*_host.h")):
        fam = os.path.basename(path)[:-len("_host.h")]
        for k, n in re.findall(r"^AMO_ASCEND_KERNEL\((\w+), (\d+)\)", _code(open(path).read()), re.M):
            assert k not in declared, f"{k} declared twice"
            assert fam in ascend_fams, f"host/{fam}_host.h declares {k} but {fam} has no ASCENDC op"
            declared[k] = (fam, int(n))
    assert {fam for fam, _ in declared.values()} == ascend_fams, "an ASCENDC family launches no kernel"
    entries = {}
    for path in glob.glob(os.path.join(CSRC, "ascend", "kernels", "*.cpp")):
        for k, args in re.findall(r'extern\s+"C"\s+__global__\s+__aicore__\s+void\s+(\w+)\s*\(([^)]*)\)',
                                  _code(open(path).read())):
            entries[k] = (os.path.basename(path), args.count("GM_ADDR"))
    assert set(declared) == set(entries), f"declared only: {sorted(set(declared) - set(entries))}, " \
                                          f"kernel entries only: {sorted(set(entries) - set(declared))}"
    for k, (fam, n) in declared.items():
        src, gm = entries[k]
        assert gm == n, f"{k}: declared with {n} GM arguments, the entry in kernels/{src} takes {gm}"
        assert src.startswith(fam), f"{k} ({fam}) is defined in kernels/{src}, not a kernel file of its family"


def _shared_files():
    """csrc files of no op family: what every op shares (relative to csrc)."""
    out = []
    for path in sorted(glob.glob(os.path.join(CSRC, "**", "*"), recursive=True)):
        rel = os.path.relpath(path, CSRC)
        if os.path.isdir(path) or not rel.endswith((".h", ".cpp", ".txt", ".sh")):
            continue
        if any(os.path.basename(rel).startswith(fam) for fam in FAMILIES):
            continue
        out.append(rel)
    return out


def _per_op_names():
    kernels = set()
    for path in glob.glob(os.path.join(CSRC, "ascend", "kernels", "*.cpp")):
        kernels |= set(re.findall(r'__global__\s+__aicore__\s+void\s+(\w+)', open(path).read()))
    return sorted({r[0] for r in OPS} | set(FAMILIES) | kernels, key=len, reverse=True)


def per_op_lines(rel, text, names=None):
    """Lines of a shared file's code (comments left out) that name an op, an op family or a kernel."""
    pat = re.compile(r"\b(%s)\b" % "|".join(names or _per_op_names()))
    if rel.endswith((".txt", ".sh")):
        text = re.sub(r"#[^\n]*", " ", text)
    else:
        text = _code(text)
    return [ln.strip() for ln in text.splitlines() if pat.search(ln)]


def test_shared_files_hold_no_per_op_code():
    """No shared csrc file names an op, a family or a kernel in its code (comments left out), the op
    list aside: not the contracts' helpers (common/checks.h), not the contract bindings
    (cpu/checks_bindings.cpp), not the host helpers (ascend/host/row_map.h takes the row count from
    the op's check instead of naming it)."""
    shared = _shared_files()
    for rel in ("op_list.h", "checks.h", "registry.h", "op_registry.h"):
        assert os.path.join("common", rel) in shared, rel
    for rel in (os.path.join("cpu", "autograd.cpp"), os.path.join("cpu", "checks_bindings.cpp"),
                os.path.join("ascend", "host", "row_map.h")):
        assert rel in shared, rel
    problems = {}
    for rel in shared:
        if rel == os.path.join("common", "op_list.h"):
            continue
        lines = per_op_lines(rel, open(os.path.join(CSRC, rel)).read())
        if lines:
            problems[rel] = lines[:5]
    assert not problems, f"per-op code in shared files (belongs in the op's own files): {problems}"


def shared_per_op_counts():
    """{shared file: (lines naming an op, a family or a kernel with comments, in code only)} for the
    files with any; the scan of test_shared_files_hold_no_per_op_code, op list included
    (docs/design.md, "The C++ op list", quotes the totals)."""
    names = _per_op_names()
    pat = re.compile(r"\b(%s)\b" % "|".join(names))
    out = {}
    for rel in _shared_files():
        text = open(os.path.join(CSRC, rel)).read()
        every = [ln for ln in text.splitlines() if pat.search(ln)]
        if every:
            out[rel] = (len(every), len(per_op_lines(rel, text, names)))
    return out


def test_the_shared_file_scan_catches_per_op_code():
    names = ["moe_permute", "grouped_gemm"]
    assert per_op_lines("x.cpp", '// moe_permute in a comment\nm.impl("moe_permute", f);\n', names) == \
        ['m.impl("moe_permute", f);']
    assert per_op_lines("x.cpp", "ASCEND_MOE_OPS_FOR_EACH_OP(AMO_OP_CPU)\n", names) == []
    assert per_op_lines("CMakeLists.txt", "# grouped_gemm\nadd_library(x grouped_gemm.cpp)\n", names) == \
        ["add_library(x grouped_gemm.cpp)"]


if __name__ == "__main__":
    counts = shared_per_op_counts()
    for rel, (every, code) in sorted(counts.items()):
        print(f"{rel}: {every} lines naming an op ({code} in code)")
    print(f"comments included: {sum(e for e, _ in counts.values())} lines in {len(counts)} files; in code: "
          f"{sum(c for _, c in counts.values())} lines in {sum(1 for _, c in counts.values() if c)} files")
