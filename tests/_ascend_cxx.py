"""Compile small C++ test programs with g++ once and cache them under build/ascend_tests, keyed on
a hash of their sources, headers and flags (so a test run only pays the compile after a change)."""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(ROOT, "csrc")
ASCEND = os.path.join(CSRC, "ascend")
CACHE = os.path.join(ROOT, "build", "ascend_tests")


def ascend_headers():
    return sorted(glob.glob(os.path.join(ASCEND, "**", "*.h"), recursive=True))


def compile_cached(name, sources, flags=(), extra_deps=()):
    """Return the path of an executable built from ``sources`` (skips if there is no g++)."""
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ is not installed")
    h = hashlib.sha256()
    for path in list(sources) + list(extra_deps) + ascend_headers():
        h.update(path.encode())
        with open(path, "rb") as f:
            h.update(f.read())
    h.update(" ".join(flags).encode())
    out = os.path.join(CACHE, f"{name}-{h.hexdigest()[:16]}")
    if not os.path.exists(out):
        os.makedirs(CACHE, exist_ok=True)
        tmp = out + f".tmp{os.getpid()}"
        cmd = [gxx, "-std=c++17", "-O1", "-I", CSRC, "-I", ASCEND, *flags, *sources, "-o", tmp]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise AssertionError(f"compile failed: {' '.join(cmd)}\n{res.stderr[-4000:]}")
        os.replace(tmp, out)
    return out
