"""Compile small C++ test programs with g++ once and cache them under build/ascend_tests, keyed on
a hash of their sources, headers and flags (so a test run only pays the compile after a change), and
run them: the emulator rules drivers (one case per run) and the tiling drivers (JSON lines)."""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(ROOT, "csrc")
ASCEND = os.path.join(CSRC, "ascend")
CACHE = os.path.join(ROOT, "build", "ascend_tests")


def ascend_headers():
    return sorted(glob.glob(os.path.join(ASCEND, "**", "*.h"), recursive=True))


# ASCEND_MOE_OPS_CXX_SANITIZE=1 (set by tests/sanitize.sh) builds every driver with AddressSanitizer
# and UBSan; any finding aborts the driver, so the test that ran it fails.
SANITIZE_FLAGS = ("-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer", "-g")


def sanitizing() -> bool:
    return os.environ.get("ASCEND_MOE_OPS_CXX_SANITIZE") == "1"


def compile_cached(name, sources, flags=(), extra_deps=()):
    """Return the path of an executable built from ``sources`` (skips if there is no g++)."""
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ is not installed")
    if sanitizing():
        flags = tuple(flags) + SANITIZE_FLAGS
        name += "-sanitize"
    h = hashlib.sha256()
    local = sorted({h for src in sources for h in glob.glob(os.path.join(os.path.dirname(src), "*.h"))})
    for path in list(sources) + list(extra_deps) + local + ascend_headers():  # local: the drivers' shared headers
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


def run_case(exe, case, env=None, timeout=None):
    """Run a rules driver on one case and return its stripped stdout (the result line)."""
    return subprocess.run([exe, case], capture_output=True, text=True, check=True, env=env,
                          timeout=timeout).stdout.strip()


def assert_emu_error(out, case, pattern):
    """``out`` is the emulator error a rules driver printed for ``case``, matching regex ``pattern``."""
    assert out.startswith("EmuError: AscendC emulator:"), f"{case} was not caught: {out}"
    assert re.search(pattern, out), out


def run_json_lines(exe, lines, args=()):
    """Feed ``lines`` to a tiling driver on stdin; one JSON object per output line."""
    res = subprocess.run([exe, *args], input="\n".join(lines) + "\n", capture_output=True, text=True, check=True)
    return [json.loads(x) for x in res.stdout.splitlines()]


def driver(name, flags=(), tilings=()):
    """The test program ``tests/cpp/<name>.cpp``, compiled once (:func:`compile_cached`); with
    ``tilings``, linked with the host tiling sources ``csrc/ascend/tiling/tiling_common.cpp`` and
    ``<tiling>.cpp`` for each of them."""
    tiling = [os.path.join(ASCEND, "tiling", t + ".cpp") for t in (("tiling_common",) + tuple(tilings) if tilings else ())]
    return compile_cached(name, [os.path.join(ROOT, "tests", "cpp", name + ".cpp")] + tiling, flags=flags)


def driver_fixture(name, flags=()):
    """A module-scoped fixture giving :func:`driver` ``name`` (assign it to the fixture's name)."""

    @pytest.fixture(scope="module")
    def fixture():
        return driver(name, flags)

    return fixture


def rule_cases(table):
    """Parametrize a test over the ``(case, match)`` rows of a rule table, each row named by its case."""
    return pytest.mark.parametrize("case, match", table, ids=[row[0] for row in table])


def needs_emu(op):
    """``(available, skip mark)``: whether the ascendc-emu backend implements ``op`` on CPU, and a
    mark that skips a test (naming the reason) when it does not."""
    from ascend_moe_ops import _backends
    have = "ascendc-emu" in _backends.available_backends(op, "cpu")
    reason = f"ascend_moe_ops._ascendc_emu is not built or lacks {op} ({_backends.unavailable_reason(op, 'ascendc-emu')})"
    return have, pytest.mark.skipif(not have, reason=reason)
