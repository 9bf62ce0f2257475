"""Packaging layout: metadata in pyproject.toml, the Triton kernels and the bench suite installed
under the package namespace (checked on the files, without building anything)."""

import ast
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_metadata_and_extras():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    proj = meta["project"]
    assert proj["name"] == "ascend_moe_ops" and proj["version"]
    assert any(d.startswith("torch") for d in proj["dependencies"])
    assert {"test", "bench", "triton"} <= set(proj["optional-dependencies"])
    assert "setuptools" in " ".join(meta["build-system"]["requires"])
    import ascend_moe_ops
    assert ascend_moe_ops.__version__ == proj["version"]


def test_setup_maps_source_folders_into_the_package():
    tree = ast.parse((ROOT / "setup.py").read_text())
    mapping = next(ast.literal_eval(n.value) for n in ast.walk(tree)
                   if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "PACKAGE_DIR")
    assert mapping == {"ascend_moe_ops.triton_ref": "triton_ref", "ascend_moe_ops.benchmark.suite": "bench"}
    for src in mapping.values():
        assert (ROOT / src / "__init__.py").is_file()
    assert '"triton_ref.*"' not in (ROOT / "setup.py").read_text()  # no top-level triton_ref package


def test_shipped_code_stands_alone():
    """What an install ships (the package, triton_ref/ and bench/, installed as
    ascend_moe_ops.benchmark.suite) imports nothing from tests/ and never walks up the source tree
    (``parents[n]``, nested ``dirname``) or edits ``sys.path`` to find its own code."""
    bad = re.compile(r"parents\[|os\.path\.dirname\(os\.path\.dirname\(|sys\.path\.(insert|append)"
                     r"|^\s*(from|import)\s+(tests|conftest|_megatron_cpu)\b|/ \"tests\"", re.M)
    hits = [f"{f.relative_to(ROOT)}: {m.group(0)}"
            for folder in ("ascend_moe_ops", "triton_ref", "bench")
            for f in sorted((ROOT / folder).rglob("*.py"))
            for m in bad.finditer(f.read_text())]
    assert hits == []
