"""Keeps docs/design.md's "Adding an op" true: an op is its own files plus one line in
``ascend_moe_ops/__init__.py`` and one ``X(...)`` line in ``csrc/common/op_list.h``. Each test lists
the op names (or op modules) found in one place and checks that the list agrees with the specs."""

import ast
import importlib
import os
import re

import pytest

import ascend_moe_ops
from ascend_moe_ops import _library

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "ascend_moe_ops")
OP_LIST = os.path.join(ROOT, "csrc", "common", "op_list.h")
SPECS = _library.specs()
NAMES = {s.name for s in SPECS}
MODULES = set(_library.op_modules())
PUBLIC_MODULES = set(_library.op_modules(public=True))
INIT_BEGIN = "# The op modules:"
INIT_END = "# (end of the op modules)"


def _read(*parts):
    with open(os.path.join(ROOT, *parts)) as f:
        return f.read()


def _init_op_lines():
    """The lines of ``ascend_moe_ops/__init__.py`` between the op-module markers."""
    text = _read("ascend_moe_ops", "__init__.py")
    assert INIT_BEGIN in text and INIT_END in text, "the op-module markers are missing from __init__.py"
    block = text.split(INIT_BEGIN, 1)[1].split(INIT_END, 1)[0]
    return [ln for ln in block.splitlines()[1:] if ln.strip() and not ln.lstrip().startswith("#")]


def _init_imports():
    """op module -> (imported names, or None for ``from .ops import m as _m``) from those lines."""
    out = {}
    for line in _init_op_lines():
        node = ast.parse(line.split("  #")[0].strip()).body[0]
        assert isinstance(node, ast.ImportFrom) and node.level == 1, f"not an op-module import: {line!r}"
        if node.module == "ops":
            (alias,) = node.names
            assert alias.asname == f"_{alias.name}", f"an internal op module is imported as _<module>: {line!r}"
            out[alias.name] = None
        else:
            assert node.module.startswith("ops."), line
            out[node.module[4:]] = [a.name for a in node.names]
    return out


def test_specs_are_well_formed():
    assert NAMES, "no op was defined"
    for s in SPECS:
        assert re.fullmatch(r"[a-z][a-z0-9_]*", s.name), s.name
        assert s.schema.startswith("(") and "->" in s.schema, (s.name, s.schema)
        assert s.module, s.name
        assert s.implemented_by(_library.FALLBACK.name), f"{s.name}: the reference backend must implement it"
    assert set(_library.SCHEMAS) == {s.name for s in SPECS if s.public}
    assert set(_library.INTERNAL_SCHEMAS) == {s.name for s in SPECS if not s.public}


def test_one_line_per_op_module_in_init():
    """Place 1 of 2 in shared files: one import line per op module, nothing else."""
    lines = _init_op_lines()
    imports = _init_imports()
    assert len(lines) == len(imports), f"one line per op module expected: {lines}"
    assert set(imports) == MODULES, (sorted(imports), sorted(MODULES))
    for module, names in imports.items():
        mod = importlib.import_module(f"ascend_moe_ops.ops.{module}")
        if module in PUBLIC_MODULES:
            assert names == list(mod.__all__), f"{module}: import what its __all__ exports: {names} vs {mod.__all__}"
        else:
            assert names is None, f"{module} defines only internal ops: import it as _{module}"
    exported = [n for m in _library.op_modules(public=True)
                for n in importlib.import_module(f"ascend_moe_ops.ops.{m}").__all__]
    assert set(exported) <= set(ascend_moe_ops.__all__)
    assert not NAMES & set(ascend_moe_ops.__all__) - set(exported)


def test_every_op_module_file_is_imported():
    """A module of ops/ that defines an op but is not imported by __init__ would define nothing."""
    defining = set()
    for f in os.listdir(os.path.join(PKG, "ops")):
        if f.endswith(".py") and not f.startswith("_"):
            if "_library.define(" in _read("ascend_moe_ops", "ops", f):
                defining.add(f[:-3])
    assert defining == MODULES, (sorted(defining), sorted(MODULES))
    for s in SPECS:  # the op's name is in its own module's text
        assert s.name in _read("ascend_moe_ops", "ops", f"{s.module}.py") or \
            repr(s.name) in _read("ascend_moe_ops", "ops", f"{s.module}.py"), s.name


def _code_words(source: str):
    """The string constants (docstrings left out) and identifiers of a module's code."""
    tree = ast.parse(source)
    docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    words = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings:
            words |= set(re.findall(r"[A-Za-z0-9_]+", n.value))
        elif isinstance(n, ast.Name):
            words.add(n.id)
        elif isinstance(n, ast.Attribute):
            words.add(n.attr)
        elif isinstance(n, ast.alias):
            words |= set((n.name + "." + (n.asname or "")).split("."))
    return words


def test_shared_python_files_name_no_op():
    """Nothing in the registration machinery names an op in its code: it all derives from the specs
    (the op-module lines of __init__.py are the one exception)."""
    for f in ("_library.py", "_backends.py", "__init__.py"):
        text = _read("ascend_moe_ops", f)
        if f == "__init__.py":
            for line in _init_op_lines():
                text = text.replace(line, "")
        found = sorted(NAMES & _code_words(text))
        assert not found, f"ascend_moe_ops/{f} names ops {found}"


def test_code_words_sees_a_name():
    assert {"moe_permute", "x"} <= _code_words('"""moe_unpermute"""\nx = op("moe_permute")\n')
    assert "moe_unpermute" not in _code_words('"""moe_unpermute"""\nx = 1\n')


@pytest.mark.parametrize("backend", [b for b in _library.BACKENDS.values() if b.python_package])
def test_python_kernels_are_in_files_named_alike(backend):
    """``<package>/<module>.py`` holds ``def <op>`` for every op the backend implements (its own
    file; no registration line)."""
    pkg_dir = os.path.join(ROOT, "triton_ref") if backend.python_package.endswith("triton_ref") else \
        os.path.join(PKG, backend.python_package.rsplit(".", 1)[-1])
    want = {s.name for s in SPECS if s.implemented_by(backend.name) and backend.name not in s.composite}
    found = set()
    for s in SPECS:
        path = os.path.join(pkg_dir, f"{s.module}.py")
        if os.path.exists(path):
            tree = ast.parse(open(path).read())
            defs = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
            found |= {t.name for t in SPECS if t.module == s.module and t.name in defs}
    assert want <= found, f"{backend.name}: missing kernels {sorted(want - found)} in {pkg_dir}"
    assert not (found - want) or backend.name == _library.REFERENCE.name, sorted(found - want)


def test_tests_and_docs_named_alike():
    for module in MODULES:
        assert os.path.exists(os.path.join(ROOT, "tests", f"test_{module}.py")), f"tests/test_{module}.py"
    for module in PUBLIC_MODULES:
        assert os.path.exists(os.path.join(ROOT, "docs", "ops", f"{module}.md")), f"docs/ops/{module}.md"


def test_native_kernels_registered_in_csrc():
    """Every op the native backend implements has a kernel registered in csrc/cpu (its own file)."""
    text = "".join(_read("csrc", "cpu", f) for f in sorted(os.listdir(os.path.join(ROOT, "csrc", "cpu")))
                   if f.endswith(".cpp"))
    registered = set(re.findall(r'^AMO_CPU_KERNEL\(\s*([a-z0-9_]+)\s*,', text, re.M))  # op_registry.h
    want = {s.name for s in SPECS if s.implemented_by(_library.NATIVE.name)}
    assert want <= registered, sorted(want - registered)


def _op_list_entries(text: str):
    """The first arguments of the ``X(...)`` lines of ``ASCEND_MOE_OPS_FOR_EACH_OP(X)``."""
    m = re.search(r"#\s*define\s+ASCEND_MOE_OPS_FOR_EACH_OP\s*\(\s*X\s*\)((?:[^\n]*\\\n)*[^\n]*)", text)
    assert m, "csrc/common/op_list.h has no #define ASCEND_MOE_OPS_FOR_EACH_OP(X)"
    body = re.sub(r"/\*.*?\*/", "", m.group(1), flags=re.S)
    body = re.sub(r"//[^\n]*", "", body)
    return re.findall(r"\bX\(\s*([A-Za-z0-9_]+)\s*[,)]", body)


def test_op_list_parser_reads_an_x_macro():
    text = ("#pragma once\n// ops\n#define ASCEND_MOE_OPS_FOR_EACH_OP(X) \\\n  X(foo, a, b) /* fwd */ \\\n"
            "  X(foo_backward, c) \\\n  X(bar)\n#define OTHER(X) X(baz)\n")
    assert _op_list_entries(text) == ["foo", "foo_backward", "bar"]


def test_cpp_op_list_agrees():
    """Place 2 of 2 in shared files: one ``X(op_name, ...)`` line per op in csrc/common/op_list.h."""
    if not os.path.exists(OP_LIST):
        pytest.skip("csrc/common/op_list.h does not exist in this tree (the C++ op list is not built yet)")
    entries = _op_list_entries(open(OP_LIST).read())
    assert len(entries) == len(set(entries)), f"an op is listed twice: {entries}"
    want = {s.name for s in SPECS if s.implemented_by(_library.NATIVE.name)}
    assert set(entries) == want, (f"op_list.h lists {sorted(set(entries) - want)} that no spec defines, and "
                                  f"misses {sorted(want - set(entries))}")


def test_contracts_need_no_shared_entry():
    """An op's Python contract is its spec's ``check`` / ``check_meta``, defined in its op module
    (or, for the ops that predate that, in the shared helpers' module ``ops/_contracts.py``), and
    no table in the shared module lists the ops: a new op adds its contract in its own files only.
    Its C++ twin is in its own ``csrc/common/<family>_checks.h`` (tests/test_cxx_op_list.py)."""
    shared = "ascend_moe_ops.ops._contracts"
    for s in SPECS:
        for fn in (s.check, s.check_meta or s.check):
            assert fn.__module__ in (f"ascend_moe_ops.ops.{s.module}", shared), \
                f"{s.name}: its contract {fn.__qualname__} is defined in {fn.__module__}, not in its op module"
    tables = []
    for node in ast.walk(ast.parse(_read("ascend_moe_ops", "ops", "_contracts.py"))):
        if isinstance(node, ast.Dict):
            keys = {k.value for k in node.keys if isinstance(k, ast.Constant)}
            if keys & NAMES:
                tables.append(sorted(keys & NAMES))
    assert not tables, f"ops/_contracts.py lists ops in a table (a new op would need an entry): {tables}"


def test_design_doc_lists_these_places():
    """docs/design.md's table names every place checked here, and exactly two one-line entries."""
    text = _read("docs", "design.md")
    assert "## Adding an op" in text
    section = text.split("## Adding an op", 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]
    rows = [r for r in section.splitlines() if r.startswith("| `")]
    places = [re.match(r"\| `([^`]+)`", r).group(1) for r in rows]
    assert places == ["ascend_moe_ops/ops/foo.py", "ascend_moe_ops/reference/foo.py", "triton_ref/foo.py",
                      "csrc/cpu/foo.cpp", "csrc/common/foo_checks.h", "tests/test_foo.py", "docs/ops/foo.md",
                      "ascend_moe_ops/__init__.py", "csrc/common/op_list.h"], places
    shared = [p for p, r in zip(places, rows) if "**one line**" in r]
    assert shared == ["ascend_moe_ops/__init__.py", "csrc/common/op_list.h"], shared
    assert "own file" in "".join(r for p, r in zip(places, rows) if p not in shared)
