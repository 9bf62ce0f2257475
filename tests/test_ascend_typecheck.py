"""The AscendC kernels type-check against the real public AscendC headers (tests/ascend_typecheck.sh).

Runs only when ASC_DEVKIT_SRC points at a checkout of the open asc-devkit source (never vendored
here: its licence limits its use to Huawei processors); skips with the reason otherwise."""

import os
import shutil
import subprocess

import pytest

from _ascend_cxx import ROOT

SRC = os.environ.get("ASC_DEVKIT_SRC", "")


@pytest.mark.skipif(not SRC or not os.path.isfile(os.path.join(SRC, "include", "kernel_operator.h")),
                    reason="ASC_DEVKIT_SRC does not point at an asc-devkit source tree (the AscendC headers)")
@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not installed")
def test_kernels_typecheck_against_asc_devkit_headers():
    res = subprocess.run(["bash", os.path.join(ROOT, "tests", "ascend_typecheck.sh")], capture_output=True, text=True,
                         timeout=900)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert "FAIL" not in res.stdout and res.stdout.count("OK ") >= 8, res.stdout
