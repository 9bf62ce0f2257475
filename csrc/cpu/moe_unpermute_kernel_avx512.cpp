// moe_unpermute on the CPU: the per-token loops (moe_unpermute_kernel_impl.h) compiled for the
// avx512 level of a portable build, under `#pragma GCC target` (the rest of the build targets
// x86-64-v3); run only when the CPU supports it (cpu/cpu_capability.cpp). As in
// grouped_gemm_kernel_avx512.cpp (with the same target, AMO_TARGET_AVX512 of cpu/cpu_capability.h, so
// that the inline functions of the vector layer both units emit in the namespace isa_avx512 are the
// same code), the headers shared
// with the other units (c10, the standard library, common/bf16.h) are included first, outside the
// pragma, so that their inline functions keep the baseline target; this unit's own functions live in
// the namespace isa_avx512 (AMO_VEC_NS). Empty in a build with a fixed -march.
#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "common/bf16.h"
#include "cpu/cpu_capability.h"
#include "cpu/moe_unpermute_kernel.h"

#if AMO_PORTABLE_ISA
AMO_ISA_TARGET_PUSH(AMO_TARGET_AVX512)
#define AMO_ISA_AVX512 1
#define AMO_VEC_NS isa_avx512
#include "cpu/moe_unpermute_kernel_impl.h"
AMO_ISA_TARGET_POP()

AMO_UNPERMUTE_DEFINE_TABLE(kernels_avx512, "avx512")
#endif
