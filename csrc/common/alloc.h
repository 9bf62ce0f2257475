// Allocation and zero-filling of large CPU outputs.
//
// A fresh multi-hundred-MiB output (permute writes T*K*H elements) is new anonymous memory, and on
// this kind of machine (KVM guest) first-touch faults of 4 KiB pages cost more than the copy itself:
// measured here, `torch.empty_like(x).copy_(x)` on 256 MiB runs at ~1.4 GB/s vs ~9 GB/s into a
// preallocated buffer, and filling a fresh 184 MiB grouped_gemm_dw output (E=32, K=2048, N=1408)
// took 86 ms of CPU time with 4 KiB pages vs 18 ms with huge pages. PyTorch's own allocator can
// back large blocks with transparent huge pages, but only when THP_MEM_ALLOC_ENABLE=1 is set before
// torch is imported. empty_large() allocates with the normal allocator (a plain tensor: resizable,
// freed as usual) and, for big blocks, advises the kernel to back the 2 MiB-aligned interior with
// huge pages before anything touches it (512x fewer faults). The advice is only a hint: where THP
// is off it does nothing and nothing else changes.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace amo {

constexpr int64_t kHugePageAdviseBytes = int64_t(8) << 20;

inline at::Tensor empty_large(at::IntArrayRef sizes, const at::TensorOptions& options) {
  at::Tensor t = at::empty(sizes, options);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  const int64_t bytes = static_cast<int64_t>(t.nbytes());
  if (t.device().is_cpu() && bytes >= kHugePageAdviseBytes) {
    constexpr uintptr_t kHuge = uintptr_t(2) << 20;
    const uintptr_t p = reinterpret_cast<uintptr_t>(t.data_ptr());
    const uintptr_t b = (p + kHuge - 1) & ~(kHuge - 1);
    const uintptr_t e = (p + static_cast<uintptr_t>(bytes)) & ~(kHuge - 1);
    if (e > b) (void)madvise(reinterpret_cast<void*>(b), e - b, MADV_HUGEPAGE);  // a hint; errors ignored
  }
#endif
  return t;
}

}  // namespace amo

#include <ATen/Parallel.h>

#include <vector>

#include "common/vec.h"

namespace amo {

// Zero every row r of a [filled.size(), row_bytes] byte matrix with !filled[r]. The runs are found
// on the calling thread (one byte per row); threads are used only when there is enough to zero.
inline void zero_rows(char* base, const std::vector<uint8_t>& filled, int64_t row_bytes, bool stream) {
  const int64_t n = static_cast<int64_t>(filled.size());
  std::vector<std::pair<int64_t, int64_t>> runs;  // [first row, end row)
  int64_t total = 0;
  for (int64_t r = 0; r < n;) {
    if (filled[r]) {
      ++r;
      continue;
    }
    int64_t r2 = r + 1;
    while (r2 < n && !filled[r2]) ++r2;
    runs.emplace_back(r, r2);
    total += r2 - r;
    r = r2;
  }
  if (runs.empty() || row_bytes <= 0) return;
  // split runs into pieces of at most 64 rows so that threads share the work evenly
  std::vector<std::pair<int64_t, int64_t>> pieces;
  for (auto& [a, b] : runs)
    for (int64_t r = a; r < b; r += 64) pieces.emplace_back(r, std::min(b, r + 64));
  const int64_t grain = total * row_bytes >= (int64_t(4) << 20) ? 1 : static_cast<int64_t>(pieces.size());
  at::parallel_for(0, static_cast<int64_t>(pieces.size()), grain, [&](int64_t pb, int64_t pe) {
    for (int64_t i = pb; i < pe; ++i)
      vec::zero_bytes(base + pieces[i].first * row_bytes, (pieces[i].second - pieces[i].first) * row_bytes, stream);
    if (stream) vec::sfence();
  });
}

}  // namespace amo
