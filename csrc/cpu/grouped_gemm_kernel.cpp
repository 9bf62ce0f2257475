// grouped_gemm on the CPU, part 2 of 3: the tile kernels (grouped_gemm_kernel_impl.h) compiled with
// the build's own flags, and the run-time choice among the compiled copies. A portable build
// (AMO_PORTABLE_ISA, the default of setup.py) compiles everything for x86-64-v3 (AVX2 + FMA), so this
// copy is the AVX2 one, and grouped_gemm_kernel_{avx512,avx512_bf16,amx}.cpp add a copy per higher
// level; the level the CPU supports (cpu/cpu_capability.cpp) picks one, once per process. A build
// with a fixed -march (ASCEND_MOE_OPS_NATIVE_ARCH=1 or ASCEND_MOE_OPS_MARCH) has only this copy.
#include "cpu/grouped_gemm_kernel_impl.h"

#include "cpu/cpu_capability.h"

#include <cstdlib>

#if AMO_PORTABLE_ISA
static_assert(AMO_GG_AVX2 && !AMO_GG_AVX512, "a portable build compiles its baseline for x86-64-v3 (AVX2 + FMA)");
AMO_GG_DEFINE_TABLE(tile_kernels_build, "avx2")
#else
AMO_GG_DEFINE_TABLE(tile_kernels_build, "march")
#endif

namespace amo {
namespace grouped_gemm_cpu {

const TileKernels& tile_kernels() {
#if AMO_PORTABLE_ISA
  switch (cpu::chosen()) {
    case cpu::Capability::kAMX: return tile_kernels_amx();
    case cpu::Capability::kAVX512_BF16: return tile_kernels_avx512_bf16();
    case cpu::Capability::kAVX512: return tile_kernels_avx512();
    default: return tile_kernels_build();
  }
#else
  return tile_kernels_build();
#endif
}

bool amx_wanted(at::ScalarType dt) {
  if (dt != at::kBFloat16 || !tile_kernels().amx) return false;
  const char* v = std::getenv("AMO_GG_AMX");
  if (v != nullptr && v[0] == '0') return false;
  return cpu::amx_ready();
}

}  // namespace grouped_gemm_cpu
}  // namespace amo
