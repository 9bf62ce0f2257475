#!/usr/bin/env bash
# Type-check the AscendC kernels (csrc/ascend/kernels/*.cpp) with g++ -fsyntax-only against the REAL
# public AscendC headers of the open asc-devkit source, in its CPU-debug configuration
# (ASCENDC_CPU_DEBUG=1, __NPU_ARCH__=2201 = Atlas A2, implementation under dav_c220).
#
# The headers are NOT part of this repository (their licence limits their use to Huawei processors):
# point ASC_DEVKIT_SRC at a checkout of the asc-devkit source (the directory that holds include/ and
# impl/). Without it the script skips (exit 0) and says why. tests/ascend_typecheck_shim holds what
# the toolkit's CPU-debug library would provide: the device compiler's qualifiers and predefined
# types (stub_def.h), its intrinsics as catch-all declarations (stub_fun.h), empty stand-ins for
# toolkit-only headers, and a kernel_operator.h that includes the real basic-API headers only.
#
# What passing means: every AscendC API the kernels call exists in the real headers with a signature
# and template parameters that accept the kernels' arguments (class templates, enums, parameter
# structs, overloads). It does NOT check the intrinsics underneath (declared catch-all), link, or run.
#
#   ASC_DEVKIT_SRC=/path/to/asc-devkit bash tests/ascend_typecheck.sh
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SHIM="$ROOT/tests/ascend_typecheck_shim"
D="${ASC_DEVKIT_SRC:-}"
if [ -z "$D" ] || [ ! -f "$D/include/kernel_operator.h" ] || [ ! -d "$D/impl/basic_api/dav_c220" ]; then
  echo "SKIP ascend_typecheck: ASC_DEVKIT_SRC does not point at an asc-devkit source tree (include/kernel_operator.h, impl/basic_api/dav_c220)"
  exit 0
fi
CXX="${CXX:-g++}"
FLAGS=(-std=c++17 -fsyntax-only -DASCENDC_CPU_DEBUG=1 -D__NPU_ARCH__=2201
       -I"$SHIM" -I"$D" -I"$D/include" -I"$D/include/basic_api" -I"$D/include/utils" -I"$D/impl" -I"$D/impl/basic_api"
       -I"$ROOT/csrc/ascend")
rev="$(git -C "$D" rev-parse --short HEAD 2>/dev/null || echo "unknown revision")"
echo "asc-devkit: $D ($rev), $("$CXX" --version | head -1)"
fail=0
for f in "$ROOT"/csrc/ascend/kernels/*.cpp; do
  if out="$("$CXX" "${FLAGS[@]}" "$f" 2>&1)"; then
    echo "OK    ${f#"$ROOT"/}"
  else
    echo "FAIL  ${f#"$ROOT"/}"
    echo "$out" | grep -E "error" | head -20
    fail=1
  fi
done
# Self-test: a wrong call the real headers must reject (DataCacheCleanAndInvalid without its CacheLine
# template argument, an InitConstValueParams field that does not exist) and its corrected twin,
# which must pass -- so OK above means something.
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
cat > "$tmp/good.cpp" <<'CPP'
#include "kernels/kernel_common.h"
__aicore__ inline void Twin(AscendC::GlobalTensor<float> g, AscendC::LocalTensor<half> t) {
  AscendC::DataCacheCleanAndInvalid<float, AscendC::CacheLine::SINGLE_CACHE_LINE, AscendC::DcciDst::CACHELINE_OUT>(g);
  AscendC::InitConstValueParams<half> z;
  z.blockNum = 1;
  AscendC::InitConstValue(t, z);
}
CPP
sed -e 's/DataCacheCleanAndInvalid<float, [^>]*>(g)/DataCacheCleanAndInvalid<float>(g)/' -e 's/z.blockNum = 1/z.blockCount = 1/' \
  "$tmp/good.cpp" > "$tmp/bad.cpp"
if "$CXX" "${FLAGS[@]}" "$tmp/good.cpp" >/dev/null 2>&1 && ! "$CXX" "${FLAGS[@]}" "$tmp/bad.cpp" >/dev/null 2>&1; then
  echo "OK    self-test: the wrong call is rejected, its twin accepted"
else
  echo "FAIL  self-test: the check does not tell a wrong call from a right one"
  fail=1
fi
exit $fail
