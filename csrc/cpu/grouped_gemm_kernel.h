// grouped_gemm on the CPU, part 2 of 3: the tile kernels (grouped_gemm_kernel.cpp). One work item's
// GEMM, out[m x n] = A[m x K] . B[K x n] with strided operands, for fp32, fp16 and bf16 (AMX or
// AVX512_BF16); the packing they use is grouped_gemm_pack.h, the work split and the entry points are
// grouped_gemm.cpp.
#pragma once

#include "cpu/grouped_gemm_pack.h"

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

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

// AMX for this call? Compiled in, CPU + OS allow it, and not switched off with AMO_GG_AMX=0 (read
// per call, so one process can time both kernels).
bool amx_wanted(at::ScalarType dt);

// Runs one item with the kernel of element type T (float, c10::Half, c10::BFloat16); `next` (the
// item this thread runs next, or nullptr) is only prefetched. Instantiated in grouped_gemm_kernel.cpp.
template <typename T>
void run_tile(const TileArgs& t, const TileArgs* next, Workspace& ws);

extern template void run_tile<float>(const TileArgs&, const TileArgs*, Workspace&);
extern template void run_tile<c10::Half>(const TileArgs&, const TileArgs*, Workspace&);
extern template void run_tile<c10::BFloat16>(const TileArgs&, const TileArgs*, Workspace&);

}  // namespace grouped_gemm_cpu
}  // namespace amo
