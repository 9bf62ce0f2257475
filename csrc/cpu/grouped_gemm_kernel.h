// grouped_gemm on the CPU, part 2 of 3: the tile kernels (grouped_gemm_kernel_impl.h, compiled per
// instruction set; grouped_gemm_kernel.cpp picks one at run time). One work item's GEMM,
// out[m x n] = A[m x K] . B[K x n] with strided operands, for fp32, fp16 and bf16 (AMX or
// AVX512_BF16); the packing they use is grouped_gemm_pack.h, the work split and the entry points are
// grouped_gemm.cpp.
#pragma once

#include "cpu/grouped_gemm_pack.h"

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <type_traits>

namespace amo {
namespace grouped_gemm_cpu {

// A strided operand: A(r, k) = p[r * s0 + k * s1]; B(k, c) = p[k * s0 + c * s1].
struct Operand {
  const void* p;
  int64_t s0, s1;  // A: (row stride, k stride); B: (k stride, col stride)
};

// One work item's GEMM: out[m x n] (ldo) = A[m x K] . B[K x n]; m <= MC, n <= NC_MAX.
struct TileArgs {
  int64_t m, n, K;
  Operand A, B;
  void* out;
  int64_t ldo;
  bool amx = false;  // bf16 only: run the AMX tile kernel (see amx_wanted)
};

// AMX for this call? The chosen tile kernels have it (cpu/cpu_capability.cpp: the CPU and the OS
// allow it, ASCEND_MOE_OPS_CPU_CAPABILITY does not force a lower level) and it is not switched off
// with AMO_GG_AMX=0 (read per call, so one process can time both kernels).
bool amx_wanted(at::ScalarType dt);

// One compiled copy of the tile kernels (grouped_gemm_kernel_impl.h) for one instruction set.
using TileFn = void (*)(const TileArgs&, const TileArgs*, Workspace&);
struct TileKernels {
  TileFn f32, f16, bf16;
  bool amx;          // has the AMX bf16 kernel
  const char* name;  // "avx2", "avx512", "avx512_bf16", "amx" or "native"
};
// the copy compiled with the build's own flags (grouped_gemm_kernel.cpp) ...
const TileKernels& tile_kernels_build();
// ... and, in a portable build (AMO_PORTABLE_ISA), the per-ISA copies (grouped_gemm_kernel_<isa>.cpp)
const TileKernels& tile_kernels_avx512();
const TileKernels& tile_kernels_avx512_bf16();
const TileKernels& tile_kernels_amx();
// the copy this process runs (chosen once, at the first call; cpu/cpu_capability.h)
const TileKernels& tile_kernels();

// Runs one item with the kernel of element type T (float, c10::Half, c10::BFloat16) of the chosen
// copy; `next` (the item this thread runs next, or nullptr) is only prefetched.
template <typename T>
inline void run_tile(const TileArgs& t, const TileArgs* next, Workspace& ws) {
  static const TileKernels& k = tile_kernels();
  if constexpr (std::is_same<T, float>::value) k.f32(t, next, ws);
  else if constexpr (std::is_same<T, c10::Half>::value) k.f16(t, next, ws);
  else k.bf16(t, next, ws);
}

}  // namespace grouped_gemm_cpu
}  // namespace amo
