"""Loading the compiled extensions (``ascend_moe_ops._C``, ``ascend_moe_ops._ascendc_emu``) safely.

A C++ extension is tied to the torch it was compiled against: another torch can fail to load it
(undefined symbols) or, worse, load it and crash later. ``setup.py`` records the build in
``ascend_moe_ops/_build_info.py`` (torch version, C++ ABI, CPU flags); before an extension is
imported, :func:`problem` compares that record with the running torch and CPU. On a mismatch, or
when the extension is missing or fails to import, the package warns once -- naming the rebuild
command -- and runs the pure-PyTorch reference kernels instead (nothing crashes).
"""

import importlib
import importlib.util
import os
import warnings
from typing import Dict, Optional

import torch

REBUILD = ("pip install --no-build-isolation .  (in a source checkout: "
           "python setup.py build_ext --inplace)")
FALLBACK = "the pure-PyTorch reference kernels run instead"

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_PROBLEMS: Dict[str, Optional[str]] = {}
_WARNED: set = set()


class NativeBuildWarning(UserWarning):
    """The compiled extension cannot be used as built; the package falls back (see the message)."""


def build_info():
    """The build record module, or None when there is none (never built, or an old build)."""
    try:
        return importlib.import_module("ascend_moe_ops._build_info")
    except Exception:
        return None


def _torch_version() -> str:
    return str(torch.__version__).split("+")[0]


def _cpu_flags() -> Optional[set]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


# what -march=x86-64-v3 (the portable baseline) needs, as /proc/cpuinfo names the flags
_X86_64_V3 = ("avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe")


def record_problem(info, running_torch: str, cpu_flags: Optional[set]) -> Optional[str]:
    """Why the build recorded in ``info`` cannot run with ``running_torch`` on a CPU with
    ``cpu_flags`` (None: unknown), or None. Separate from the process state for the tests."""
    built = getattr(info, "TORCH_VERSION", None)
    if built is None:
        return "its build record (ascend_moe_ops/_build_info.py) has no torch version"
    if built != running_torch:
        return f"it was built against torch {built}, but torch {running_torch} is running"
    abi = getattr(info, "CXX11_ABI", None)
    if abi is not None and abi != bool(torch._C._GLIBCXX_USE_CXX11_ABI):
        return "it was built with another C++ ABI (_GLIBCXX_USE_CXX11_ABI) than the running torch"
    if getattr(info, "BUILD_KIND", "") == "portable" and cpu_flags is not None:
        missing = [f for f in _X86_64_V3 if f not in cpu_flags]
        if missing:
            return (f"it was built for x86-64-v3 (AVX2 + FMA) and this CPU lacks {', '.join(missing)}; "
                    "build with ASCEND_MOE_OPS_MARCH=none")
    return None


def _warn(module: str, why: str) -> None:
    # once per module, and once per reason: both extensions share the build record, so a record
    # problem (another torch, a CPU without AVX2) is one warning, not one per extension
    if module in _WARNED or ("why", why) in _WARNED:
        return
    _WARNED.add(module)
    _WARNED.add(("why", why))
    warnings.warn(f"ascend_moe_ops: the compiled extension {module} is not used: {why}. Rebuild it "
                  f"against the installed torch: {REBUILD}. Until then {FALLBACK}.",
                  NativeBuildWarning, stacklevel=3)


def built(module: str) -> bool:
    """Whether a compiled file of ``module`` is in this package (nothing is imported or warned)."""
    spec = importlib.util.find_spec(module)
    origin = getattr(spec, "origin", None)
    return bool(origin) and os.path.dirname(os.path.abspath(origin)) == _PACKAGE_DIR


def problem(module: str = "ascend_moe_ops._C") -> Optional[str]:
    """None when ``module`` can be imported and used; else the reason (warned once per process)."""
    if module in _PROBLEMS:
        return _PROBLEMS[module]
    why = None
    spec = importlib.util.find_spec(module)
    origin = getattr(spec, "origin", None)
    if spec is None or not origin or os.path.dirname(os.path.abspath(origin)) != _PACKAGE_DIR:
        info = build_info()
        if info is not None and getattr(info, "BUILD_KIND", "") == "no-native":
            why = "the package was built with ASCEND_MOE_OPS_NO_NATIVE=1"  # chosen: no warning
            _PROBLEMS[module] = why
            return why
        why = "it is not built (no compiled file in the package)"
        if spec is not None:  # e.g. an editable install's finder: another tree's build, other sources
            why = f"it is not built in this package ({_PACKAGE_DIR}; only {origin} was found)"
    else:
        info = build_info()
        if info is None:
            why = "it has no build record (ascend_moe_ops/_build_info.py): an old or foreign build"
        else:
            why = record_problem(info, _torch_version(), _cpu_flags())
        if why is None:
            try:
                importlib.import_module(module)
            except Exception as exc:  # undefined symbol, wrong Python, a truncated file...
                why = f"importing it failed ({type(exc).__name__}: {exc})"
    if why is not None:
        _warn(module, why)
    _PROBLEMS[module] = why
    return why


def extension(module: str = "ascend_moe_ops._C"):
    """The imported extension module, or None (after one warning) when it cannot be used."""
    return None if problem(module) is not None else importlib.import_module(module)


def cpu_capability() -> Optional[dict]:
    """The CPU level the native kernels run at: ``detected`` (CPU and OS), ``chosen`` (after
    ASCEND_MOE_OPS_CPU_CAPABILITY), ``grouped_gemm_kernels`` (the tile kernels running),
    ``unpermute_kernels`` (the unpermute's loops running: ``avx2`` or ``avx512`` in a portable build)
    and ``build`` (``portable`` or ``march``); None without a usable extension."""
    mod = extension()
    if mod is None or not hasattr(mod, "_cpu_capability"):
        return None
    return dict(mod._cpu_capability())
