"""Build of ascend_moe_ops.

Metadata (name, version, dependencies, extras) is in pyproject.toml; this file builds the
extensions and lays out the packages: ``ascend_moe_ops`` plus the source folders ``triton_ref/``
and ``bench/`` installed as ``ascend_moe_ops.triton_ref`` and ``ascend_moe_ops.benchmark.suite``
(no top-level ``triton_ref`` package in site-packages).

Always: the C++ CPU extension ``ascend_moe_ops._C`` from ``csrc/cpu/*.cpp`` (+ ``csrc/common``).
Optional: the AscendC backend, only when ``ASCEND_HOME_PATH`` points at a CANN toolkit with
``bisheng`` (see docs/ascend.md). Triton kernels are plain Python and need no build step.

Install torch first and build without isolation (torch is not a build requirement, so that an
isolated PEP 517 build never downloads a multi-GB CUDA torch; such a build stops at once and prints
the commands below):

    pip install torch==<version>
    pip install --no-build-isolation .

Set ``ASCEND_MOE_OPS_NO_NATIVE=1`` to skip every compiled part (the package then runs on its
reference and Triton backends). The CPU extension is portable by default: x86-64-v3 (AVX2 + FMA)
everywhere, plus the grouped-GEMM tile kernels for AVX-512, AVX512_BF16 and AMX and the unpermute's
per-token loops for AVX-512, chosen at run time;
``ASCEND_MOE_OPS_NATIVE_ARCH=1`` (or ``ASCEND_MOE_OPS_MARCH=<cpu>``) builds for one CPU instead.
Every build writes ``ascend_moe_ops/_build_info.py`` (torch version, flags), which the package checks
at import.
"""

import glob
import os
import platform
import shutil
import subprocess
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
summary = []


def _rel(paths):
    return sorted(os.path.relpath(p, ROOT) for p in paths)


#: the torch the CI and the benchmarks use (suggested when no torch is installed at all)
TESTED_TORCH = "2.13.0"


def _outer_torch_version():
    """The torch version of the interpreter outside pip's isolated build environment (pip hides the
    site-packages through PYTHONPATH/PYTHONNOUSERSITE), or None."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE", "PYTHONHOME")}
    try:
        out = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"], env=env,
                             capture_output=True, text=True, timeout=120, cwd=os.path.expanduser("~"))
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip().split("+")[0] or None


def require_torch():
    """Stop at once, with the commands to use, when torch cannot be imported here (an isolated build,
    pip's default, or no torch installed) and the native extensions are wanted."""
    if os.environ.get("ASCEND_MOE_OPS_NO_NATIVE") == "1":
        return
    try:
        import torch  # noqa: F401
        return
    except ImportError:
        pass
    isolated = any("pip-build-env" in p or "build-env-" in p for p in sys.path + [sys.prefix])
    outer = _outer_torch_version()
    version = outer or TESTED_TORCH
    why = ("pip builds in an isolated environment by default, which cannot see the installed torch "
           f"{outer}" if outer else
           "an isolated build environment (pip's default) has no torch" if isolated else "torch is not installed")
    sys.exit("ascend_moe_ops: the C++ extension is built against the torch it will run with, and torch "
             f"cannot be imported here ({why}). Install torch first, then build without isolation:\n\n"
             f"    pip install torch=={version}\n"
             "    pip install --no-build-isolation .\n\n"
             "(from a git URL: pip install --no-build-isolation git+<url>; ASCEND_MOE_OPS_NO_NATIVE=1 installs "
             "the package without compiled parts)")


def cpu_arch_flags():
    """(-march and -D flags, the build kind): portable by default on x86-64 (x86-64-v3 everywhere,
    the grouped-GEMM tile kernels also compiled for AVX-512 / AVX512_BF16 / AMX and the unpermute's
    loops for AVX-512, chosen at run time); -march=native with ASCEND_MOE_OPS_NATIVE_ARCH=1 or
    ASCEND_MOE_OPS_MARCH=native; any other ASCEND_MOE_OPS_MARCH value is passed to -march (none: no
    -march flag)."""
    march = os.environ.get("ASCEND_MOE_OPS_MARCH", "")
    if os.environ.get("ASCEND_MOE_OPS_NATIVE_ARCH") == "1" or march == "native":
        return ["-march=native"], "native"
    if march == "none":
        return [], "none"
    if march:
        return ["-march=" + march], march
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return [], "none"
    return ["-march=x86-64-v3", "-DAMO_PORTABLE_ISA=1"], "portable"


def write_build_info(kind, cxx):
    """ascend_moe_ops/_build_info.py: what the extension was built against, checked at import
    (ascend_moe_ops/_native.py), with the instruction sets of the per-ISA kernel copies (portable
    builds; a fixed -march has one copy, listed as [])."""
    import torch
    portable = kind == "portable"
    isa = ["avx2", "avx512", "avx512_bf16", "amx"] if portable else []
    unpermute_isa = ["avx2", "avx512"] if portable else []
    text = ('"""Written by setup.py when the C++ extension was built; checked at import (_native.py)."""\n'
            f"TORCH_VERSION = {torch.__version__.split('+')[0]!r}\n"
            f"TORCH_FULL_VERSION = {str(torch.__version__)!r}\n"
            f"CXX11_ABI = {bool(torch._C._GLIBCXX_USE_CXX11_ABI)!r}\n"
            f"BUILD_KIND = {kind!r}\n"
            f"CPU_FLAGS = {[f for f in cxx if f.startswith(('-m', '-DAMO_'))]!r}\n"
            f"GROUPED_GEMM_ISA = {isa!r}\n"
            f"UNPERMUTE_ISA = {unpermute_isa!r}\n"
            f"MACHINE = {platform.machine()!r}\n")
    with open(os.path.join(ROOT, "ascend_moe_ops", "_build_info.py"), "w") as f:
        f.write(text)


def cpu_extension():
    if os.environ.get("ASCEND_MOE_OPS_NO_NATIVE") == "1":
        with open(os.path.join(ROOT, "ascend_moe_ops", "_build_info.py"), "w") as f:
            f.write('"""Written by setup.py: built without compiled parts (ASCEND_MOE_OPS_NO_NATIVE=1)."""\n'
                    "BUILD_KIND = 'no-native'\n")
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
    arch, kind = cpu_arch_flags()
    cxx = ["-O3", "-std=c++17", "-fopenmp", "-DAT_PARALLEL_OPENMP=1"] + arch
    write_build_info(kind, cxx)
    summary.append(f"cpu   (_C)      : built from {len(sources)} sources ({kind}), flags {' '.join(cxx)}")
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


require_torch()
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
