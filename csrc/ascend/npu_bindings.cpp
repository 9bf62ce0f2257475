// NPU registration of every ASCENDC op of the op list (common/op_list.h) for the public namespace,
// dispatch key PrivateUse1 (registered by torch_npu): the host code of csrc/ascend/<family>.cpp
// instantiated with NpuLauncher (host/register.h). Built by CMakeLists.txt on a CANN machine only.
// UNVERIFIED: type-checked with g++ only (tests/test_ascend_glue.py), never compiled with the CANN
// toolkit nor run on an NPU (docs/ascend.md).
#include <torch/library.h>

#include "host/register.h"

TORCH_LIBRARY_IMPL(ascend_moe_ops, PrivateUse1, m) { amo_ascend::op_list::register_ascend(m); }
