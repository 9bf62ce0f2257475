"""Build-flow rule for the AscendC kernel sources (issue 12, rule 3).

CANN's ascendc_library() flow classifies a kernel source file by its FIRST
``KERNEL_TASK_TYPE_DEFAULT(...)`` and builds every kernel of that file as that type, so a file that
mixes AIC_ONLY, AIV_ONLY and MIX kernels silently gets its later kernels built for the wrong core
type. Every file under csrc/ascend/kernels must hold one kernel type, and every ``__global__``
entry must declare it. CMake builds every kernel source (a glob).
"""

import glob
import os
import re

import pytest

from _ascend_cxx import ASCEND

KERNELS = os.path.join(ASCEND, "kernels")
TYPE_RE = re.compile(r"KERNEL_TASK_TYPE_DEFAULT\s*\(\s*(KERNEL_TYPE_\w+)\s*\)")
ENTRY_RE = re.compile(r'extern\s+"C"\s+__global__\s+__aicore__\s+void\s+(\w+)\s*\(')


def _strip_comments(text):
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", " ", text)


def kernel_types(text):
    """Kernel types declared in a source text, in order (comments ignored)."""
    return TYPE_RE.findall(_strip_comments(text))


def check_one_type(path, text):
    """Raise AssertionError naming the file and its types if it mixes kernel types."""
    types = kernel_types(text)
    if len(set(types)) > 1:
        raise AssertionError(f"{path}: holds {sorted(set(types))}; the build flow would build all of them as "
                             f"{types[0]} (its first KERNEL_TASK_TYPE_DEFAULT): one kernel type per file")
    return types


SOURCES = sorted(glob.glob(os.path.join(KERNELS, "*.cpp")))


def test_kernel_sources_found():
    assert len(SOURCES) >= 7, SOURCES


@pytest.mark.parametrize("path", SOURCES, ids=[os.path.basename(p) for p in SOURCES])
def test_one_kernel_type_per_file(path):
    text = open(path).read()
    types = check_one_type(path, text)
    entries = ENTRY_RE.findall(_strip_comments(text))
    assert entries, f"{path}: no kernel entry"
    assert len(types) == len(entries), f"{path}: {len(entries)} entries but {len(types)} KERNEL_TASK_TYPE_DEFAULT"


def test_headers_hold_no_kernel_entry():
    for path in glob.glob(os.path.join(KERNELS, "*.h")):
        text = _strip_comments(open(path).read())
        assert not kernel_types(text) and not ENTRY_RE.findall(text), f"{path}: kernel entries belong in .cpp files"


def test_checker_catches_a_mixed_file():
    mixed = ('extern "C" __global__ __aicore__ void a(GM_ADDR x) { KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_AIC_ONLY); }\n'
             'extern "C" __global__ __aicore__ void b(GM_ADDR x) { KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_AIV_ONLY); }\n')
    with pytest.raises(AssertionError, match=r"KERNEL_TYPE_AIC_ONLY.*one kernel type per file"):
        check_one_type("mixed.cpp", mixed)
    # the corrected twin: same type twice, and a commented-out other type does not count
    check_one_type("ok.cpp", mixed.replace("AIV_ONLY", "AIC_ONLY") + "// KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_AIV_ONLY)\n")


def test_cmake_builds_every_kernel_source():
    """CMake builds every kernels/*.cpp (a glob, so a new kernel file needs no list entry)."""
    cmake = open(os.path.join(ASCEND, "CMakeLists.txt")).read()
    assert re.search(r"ascendc_library\(\s*amo_ascendc_kernels\s+\w+\s+\$\{AMO_KERNEL_SOURCES\}\s*\)", cmake)
    assert re.search(r"file\(GLOB AMO_KERNEL_SOURCES[^)]*\$\{CMAKE_CURRENT_SOURCE_DIR\}/kernels/\*\.cpp\)", cmake), \
        "AMO_KERNEL_SOURCES is not the glob of kernels/*.cpp"


def test_cmake_probe_covers_install_layouts():
    """Rule 7 (build recipe): every public install layout of ascendc_kernel_cmake, a build type, options."""
    cmake = open(os.path.join(ASCEND, "CMakeLists.txt")).read()
    for layout in ("compiler/tikcpp/ascendc_kernel_cmake", "tools/tikcpp/ascendc_kernel_cmake",
                   "${CMAKE_SYSTEM_PROCESSOR}-linux/tikcpp/ascendc_kernel_cmake"):
        assert layout in cmake, layout
    assert re.search(r"set\(CMAKE_BUILD_TYPE \w+", cmake)
    assert re.search(r"ascendc_compile_options\(amo_ascendc_kernels PRIVATE[^)]*-O2", cmake)
