// moe_unpermute on the CPU: the per-token loops (moe_unpermute_kernel_impl.h) compiled with the
// build's own flags, and the run-time choice among the compiled copies. A portable build
// (AMO_PORTABLE_ISA, the default of setup.py) compiles everything for x86-64-v3 (AVX2 + FMA), so this
// copy is the AVX2 one, and moe_unpermute_kernel_avx512.cpp adds an AVX-512 copy, run when the CPU
// supports it (cpu/cpu_capability.cpp: the level chosen once per process, the same one the grouped
// GEMM's tile kernels run at; levels above AVX-512 run the AVX-512 copy). A build with a fixed -march
// (ASCEND_MOE_OPS_NATIVE_ARCH=1 or ASCEND_MOE_OPS_MARCH) has only this copy.
#include "cpu/moe_unpermute_kernel_impl.h"

#include "cpu/cpu_capability.h"

#if AMO_PORTABLE_ISA
static_assert(AMO_AVX2 && !AMO_AVX512, "a portable build compiles its baseline for x86-64-v3 (AVX2 + FMA)");
AMO_UNPERMUTE_DEFINE_TABLE(kernels_build, "avx2")
#else
AMO_UNPERMUTE_DEFINE_TABLE(kernels_build, "march")
#endif

namespace amo {
namespace unpermute_cpu {

const Kernels& kernels() {
#if AMO_PORTABLE_ISA
  static const Kernels& k = static_cast<int>(cpu::chosen()) >= static_cast<int>(cpu::Capability::kAVX512)
                                ? kernels_avx512()
                                : kernels_build();
  return k;
#else
  return kernels_build();
#endif
}

}  // namespace unpermute_cpu
}  // namespace amo
