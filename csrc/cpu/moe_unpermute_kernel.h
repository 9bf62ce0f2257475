// moe_unpermute on the CPU: the per-token loops of the forward and the backward
// (moe_unpermute_kernel_impl.h, compiled per instruction set; moe_unpermute_kernel.cpp picks one at
// run time, as the grouped GEMM's tile kernels do). moe_unpermute.cpp prepares the tensors and runs
// the chosen copy over token ranges in parallel.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>

namespace amo {
namespace unpermute_cpu {

// Forward over the tokens [tb, te): out[t] = sum_s w[t,s] * src[map[t,s]] over the kept slots
// (0 <= map[t,s] < N), in fp32, slots in ascending order.
struct ForwardArgs {
  at::ScalarType dtype;  // of src and dst: kFloat, kHalf or kBFloat16
  const void* src;       // permuted [N, H], contiguous
  void* dst;             // out [T, H], contiguous
  const int64_t* map;    // row_id_map [T, S]
  const float* w;        // probs [T, S] in fp32, or nullptr (every weight 1)
  int64_t N, H, S;
  bool stream;  // streaming stores (the caller checked the alignment of dst's rows)
};

// Backward over the tokens [tb, te): per kept slot d[r] = w[t,s] * g[t] and, when x is set,
// gp[t,s] = <x[r], g[t]>; filled[r] = 1 for every row written.
struct BackwardArgs {
  at::ScalarType g_dtype;  // of g: kFloat, kHalf or kBFloat16
  at::ScalarType p_dtype;  // of x and d: kFloat, kHalf, kBFloat16 or kDouble
  const void* g;           // grad_out [T, H], contiguous
  const void* x;           // permuted [N, H], contiguous, or nullptr (no probs: no dot products)
  void* d;                 // grad_permuted [N, H]
  const int64_t* map;      // row_id_map [T, S]
  const float* w;          // probs [T, S] in fp32, or nullptr (every weight 1)
  float* gp;               // grad_probs [T, S] in fp32, or nullptr
  uint8_t* filled;         // [N]
  int64_t N, H, S;
  bool stream;  // streaming stores (the caller checked the alignment of d's rows)
};

using ForwardFn = void (*)(const ForwardArgs&, int64_t tb, int64_t te);
using BackwardFn = void (*)(const BackwardArgs&, int64_t tb, int64_t te);

// One compiled copy of the loops for one instruction set.
struct Kernels {
  ForwardFn forward;
  BackwardFn backward;
  const char* name;  // "avx2", "avx512" (portable build) or "march"
};
// the copy compiled with the build's own flags (moe_unpermute_kernel.cpp) ...
const Kernels& kernels_build();
// ... and, in a portable build (AMO_PORTABLE_ISA), the AVX-512 copy (moe_unpermute_kernel_avx512.cpp)
const Kernels& kernels_avx512();
// the copy this process runs (chosen once, at the first call; cpu/cpu_capability.h)
const Kernels& kernels();

}  // namespace unpermute_cpu
}  // namespace amo
