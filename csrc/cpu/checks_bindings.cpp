// Internal entry points to the C++ op contracts (common/checks.h) alone, one per public op of the op
// list (common/op_list.h), with the argument list of its schema (ascend_moe_ops/_library.py):
// _C._check_<op>(*args) raises exactly what the C++ backends raise for those arguments and runs
// nothing else. For tests: the Python/C++ pair must agree case by case, and on device tensors the
// checks must never copy to the host (tests/test_op_contracts.py). No kernel is reachable from
// Python except through the dispatcher.
#include "common/checks.h"
#include "common/op_registry.h"
#include "common/registry.h"

AMO_REGISTER(checks) {
#define AMO_OP_CHECK(op, fam, scope, ascendc, grad) AMO_WHEN(PUBLIC_OP, scope, m.def("_check_" #op, &amo::checks::op);)
  ASCEND_MOE_OPS_FOR_EACH_OP(AMO_OP_CHECK)
#undef AMO_OP_CHECK
}
