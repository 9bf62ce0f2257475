"""Build of ascend_moe_ops.

Metadata (name, version, dependencies, extras) is in pyproject.toml; this file builds the
extensions and lays out the packages: ``ascend_moe_ops`` plus the source folders ``triton_ref/``
and ``bench/`` installed as ``ascend_moe_ops.triton_ref`` and ``ascend_moe_ops.benchmark.suite``
(no top-level ``triton_ref`` package in site-packages).

Always: the C++ CPU extension ``ascend_moe_ops._C`` from ``csrc/cpu/*.cpp`` (+ ``csrc/common``).
Optional: the AscendC backend, only when ``ASCEND_HOME_PATH`` points at a CANN toolkit with
``bisheng`` (see docs/ascend.md). Triton kernels are plain Python and need no build step.

Install torch first and build without isolation (an isolated PEP 517 build would download a
multi-GB CUDA torch):

    pip install -r requirements.txt
    pip install --no-build-isolation -e .

Set ``ASCEND_MOE_OPS_NO_NATIVE=1`` to skip every compiled part (the package then runs on its
reference and Triton backends).
"""

import glob
import os
import shutil
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
summary = []


def _rel(paths):
    return sorted(os.path.relpath(p, ROOT) for p in paths)


def cpu_extension():
    if os.environ.get("ASCEND_MOE_OPS_NO_NATIVE") == "1":
        summary.append("cpu   (_C)      : skipped, ASCEND_MOE_OPS_NO_NATIVE=1")
        return []
    try:
        from torch.utils.cpp_extension import CppExtension
    except ImportError:
        summary.append("cpu   (_C)      : skipped, torch is not installed (install it first, then "
                       "build with --no-build-isolation)")
        return []
    sources = _rel(glob.glob(os.path.join(ROOT, "csrc", "cpu", "*.cpp"))
                   + glob.glob(os.path.join(ROOT, "csrc", "common", "*.cpp")))
    if not sources:
        summary.append("cpu   (_C)      : skipped, no sources in csrc/cpu")
        return []
    cxx = ["-O3", "-std=c++17", "-fopenmp", "-DAT_PARALLEL_OPENMP=1"]
    if os.environ.get("ASCEND_MOE_OPS_MARCH", "native") != "none":
        cxx.append("-march=" + os.environ.get("ASCEND_MOE_OPS_MARCH", "native"))
    summary.append(f"cpu   (_C)      : built from {len(sources)} sources, flags {' '.join(cxx)}")
    return [CppExtension("ascend_moe_ops._C", sources, include_dirs=[os.path.join(ROOT, "csrc")],
                         extra_compile_args={"cxx": cxx}, extra_link_args=["-fopenmp"])]


def ascendc_emu_extension():
    """The AscendC kernels compiled with g++ against the emulation layer (tests only)."""
    if os.environ.get("ASCEND_MOE_OPS_NO_NATIVE") == "1":
        summary.append("ascendc-emu     : skipped, ASCEND_MOE_OPS_NO_NATIVE=1")
        return []
    try:
        from torch.utils.cpp_extension import CppExtension
    except ImportError:
        summary.append("ascendc-emu     : skipped, torch is not installed")
        return []
    asc = os.path.join(ROOT, "csrc", "ascend")
    # every csrc/ascend/*.cpp (the module and one glue TU per op family) but the NPU-only registration
    sources = _rel([p for p in glob.glob(os.path.join(asc, "*.cpp")) if not os.path.basename(p).startswith("npu_")]
                   + glob.glob(os.path.join(asc, "kernels", "*.cpp")) + glob.glob(os.path.join(asc, "tiling", "*.cpp")))
    cxx = ["-O2", "-std=c++17", "-DASCEND_MOE_OPS_EMU"]
    summary.append(f"ascendc-emu     : AscendC kernels on the CPU emulation layer, {len(sources)} sources")
    return [CppExtension("ascend_moe_ops._ascendc_emu", sources, include_dirs=[asc],
                         extra_compile_args={"cxx": cxx})]


def ascend_extension():
    home = os.environ.get("ASCEND_HOME_PATH")
    if not home:
        summary.append("ascend (AscendC): skipped, ASCEND_HOME_PATH is not set (no CANN toolkit)")
        return []
    if not shutil.which("bisheng", path=os.path.join(home, "compiler", "ccec_compiler", "bin")) \
            and not shutil.which("bisheng"):
        summary.append(f"ascend (AscendC): skipped, no bisheng compiler under {home}")
        return []
    summary.append("ascend (AscendC): toolkit found; build with the CMake recipe in docs/ascend.md")
    return []


def cuda_note():
    try:
        import triton  # noqa: F401
        summary.append("cuda  (Triton)  : Python kernels in triton_ref/ (installed as ascend_moe_ops.triton_ref), "
                       "compiled at first use on a GPU")
    except ImportError:
        summary.append("cuda  (Triton)  : triton is not installed; the triton backend is unavailable")


ext_modules = cpu_extension() + ascendc_emu_extension() + ascend_extension()
cuda_note()
cmdclass = {}
if ext_modules:
    from torch.utils.cpp_extension import BuildExtension
    cmdclass["build_ext"] = BuildExtension.with_options(use_ninja=shutil.which("ninja") is not None)

print("ascend_moe_ops build summary:\n  " + "\n  ".join(summary), file=sys.stderr)

#: source folders installed under the package namespace
PACKAGE_DIR = {"ascend_moe_ops.triton_ref": "triton_ref", "ascend_moe_ops.benchmark.suite": "bench"}

setup(
    packages=find_packages(include=["ascend_moe_ops", "ascend_moe_ops.*"]) + sorted(PACKAGE_DIR),
    package_dir=PACKAGE_DIR,
    package_data={"ascend_moe_ops.perfmodel": ["hardware/*.json"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
