#!/usr/bin/env bash
# Build the AscendC backend on a CANN machine (UNVERIFIED: never run; see docs/ascend.md).
#   bash csrc/ascend/build_npu.sh [SOC_VERSION]      e.g. Ascend910B2, Ascend910B3, Ascend910_9392
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
SOC="${1:-Ascend910B2}"
if [ -z "${ASCEND_HOME_PATH:-}" ]; then
  for env in /usr/local/Ascend/ascend-toolkit/set_env.sh "$HOME/Ascend/ascend-toolkit/set_env.sh"; do
    # shellcheck disable=SC1090
    [ -f "$env" ] && source "$env" && break
  done
fi
: "${ASCEND_HOME_PATH:?no CANN toolkit: source <cann>/set_env.sh first}"
cmake -S "$ROOT/csrc/ascend" -B "$ROOT/build/ascend" -DSOC_VERSION="$SOC" -DCMAKE_BUILD_TYPE="${BUILD_TYPE:-Release}" \
  -DPython3_EXECUTABLE="$(command -v python)"
cmake --build "$ROOT/build/ascend" -j "$(nproc)"
cmake --install "$ROOT/build/ascend"
echo "built ascend_moe_ops/lib/libascend_moe_ops_npu.so; run: python -m pytest -m npu tests/test_ascend_npu.py"
