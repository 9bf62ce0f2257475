// Internal entry points to the C++ op contracts alone, one per public op of the op list
// (common/op_list.h), with the argument list of its schema (ascend_moe_ops/_library.py):
// _C._check_<op>(*args) raises exactly what the C++ backends raise for those arguments and runs
// nothing else. For tests: the Python/C++ pair must agree case by case, and on device tensors the
// checks must never copy to the host (tests/test_op_contracts.py). No kernel is reachable from
// Python except through the dispatcher. Each op binds its own contract (AMO_OP_CONTRACT in
// csrc/cpu/<family>.cpp, common/registry.h); this file only expands the list.
#include "common/registry.h"

AMO_REGISTER(checks) { amo::op_list::register_contracts(m); }
