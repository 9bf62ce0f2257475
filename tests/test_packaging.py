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


def test_metadata_licence_authors_urls_and_pinned_torchtitan_extra():
    proj = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert proj["license"] == "Apache-2.0" and proj["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text  # the whole licence, not a stub
    assert proj["authors"] == [{"name": "ascend_moe_ops maintainers"}]
    assert any("arxiv.org/abs/2505.04519" in u for u in proj["urls"].values())
    assert proj["optional-dependencies"]["torchtitan"] == ["torchtitan==0.3.0"]


def test_torch_is_not_a_build_requirement():
    """An isolated build must never download torch (a multi-GB CUDA wheel) to compile against."""
    reqs = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    assert not any(re.match(r"torch\b", r) for r in reqs), reqs


def test_build_without_torch_stops_at_once_with_the_commands(tmp_path):
    """setup.py where torch cannot be imported (as in pip's isolated build environment): it stops
    before building anything and prints the two commands to use, with the installed torch's version
    (found outside the isolated environment)."""
    import os
    import subprocess
    import sys
    import torch
    fake = tmp_path / "fake" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('no torch in this build environment')\n")
    info = ROOT / "ascend_moe_ops" / "_build_info.py"
    before = info.read_bytes() if info.exists() else None
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "fake"))
    env.pop("ASCEND_MOE_OPS_NO_NATIVE", None)
    proc = subprocess.run([sys.executable, "setup.py", "egg_info", "--egg-base", str(tmp_path)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert f"pip install torch=={torch.__version__.split('+')[0]}" in out, out[-2000:]
    assert "pip install --no-build-isolation ." in out
    assert "running build_ext" not in out and "build summary" not in out
    assert (info.read_bytes() if info.exists() else None) == before  # the build record untouched
