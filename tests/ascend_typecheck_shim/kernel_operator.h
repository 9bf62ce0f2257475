// Type-check shim (tests/ascend_typecheck.sh): stands in for the toolkit's kernel_operator.h and
// includes the REAL public AscendC basic-API headers (from the asc-devkit source given to the
// script) that the kernels of this package use -- the high-level API headers (softmax, layernorm,
// matmul, ...) are left out because they need tiling types of the toolkit that the source tree
// does not ship.
#pragma once
#include "stub_def.h"
#include "stub_fun.h"
#include "kernel_tpipe.h"
#include "kernel_tensor.h"
#include "kernel_type.h"
#include "kernel_operator_data_copy_intf.h"
#include "kernel_operator_fixpipe_intf.h"
#include "kernel_operator_mm_intf.h"
#include "kernel_operator_common_intf.h"
#include "kernel_operator_vec_binary_intf.h"
#include "kernel_operator_vec_binary_scalar_intf.h"
#include "kernel_operator_vec_duplicate_intf.h"
#include "kernel_operator_vec_vconv_intf.h"
#include "kernel_operator_vec_reduce_intf.h"
#include "kernel_operator_vec_unary_intf.h"
#include "kernel_operator_sys_var_intf.h"
#include "kernel_operator_cache_intf.h"
#include "kernel_operator_block_sync_intf.h"
