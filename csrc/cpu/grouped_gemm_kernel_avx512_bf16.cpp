// grouped_gemm on the CPU: the tile kernels (grouped_gemm_kernel_impl.h) compiled for the avx512_bf16 level
// of a portable build, under `#pragma GCC target` (the rest of the build targets x86-64-v3); run
// only when the CPU supports it (cpu/cpu_capability.cpp). Headers shared with the other units
// (ATen, c10, the standard library, common/bf16.h) are included first, outside the pragma, so that
// their inline functions keep the baseline target; this unit's own functions live in the namespace
// isa_avx512_bf16 (AMO_GG_NS, AMO_VEC_NS). Empty in a build with a fixed -march.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "common/bf16.h"
#include "cpu/cpu_capability.h"

#if AMO_PORTABLE_ISA
AMO_ISA_TARGET_PUSH(AMO_TARGET_AVX512_BF16)
#define AMO_ISA_AVX512 1
#define AMO_ISA_AVX512_BF16 1
#define AMO_ISA_AMX 0
#define AMO_GG_NS isa_avx512_bf16
#define AMO_VEC_NS isa_avx512_bf16
#include "cpu/grouped_gemm_kernel_impl.h"
AMO_ISA_TARGET_POP()

AMO_GG_DEFINE_TABLE(tile_kernels_avx512_bf16, "avx512_bf16")
#endif
