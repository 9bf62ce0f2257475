// Allocation and zero-filling of large CPU outputs.
//
// A fresh multi-hundred-MiB output (permute writes T*K*H elements) is new anonymous memory, and on
// this kind of machine (KVM guest) first-touch faults cost more than the copy itself: measured
// here, `torch.empty_like(x).copy_(x)` on 256 MiB runs at ~1.4 GB/s vs ~9 GB/s into a
// preallocated buffer. With 4 KiB pages each fault costs ~10 us (zeroing a fresh 176 MiB tensor:
// 0.50 s, the same zero_() again: 0.06 s); with transparent huge pages there are 512x fewer faults
// but the kernel still zeroes every page before the op writes it, so the output is written twice.
// PyTorch's CPU allocator gives freed memory back to the OS, so every call pays this again.
//
// empty_large() therefore allocates big outputs (>= kLargeBytes, 2 MiB) from LargeBlocks, a small cache of
// 2 MiB-aligned mmap blocks advised MADV_HUGEPAGE before the first touch: a freed block is kept
// (already faulted in) and handed to the next large allocation of a similar size, up to a byte cap
// (ASCEND_MOE_OPS_CPU_CACHE_MB, default min(2 GiB, RAM / 8); 0 turns the cache off; blocks over the
// cap are unmapped at once). The tensor is a plain resizable CPU tensor (its storage allocator is
// LargeBlocks); nothing relies on its contents, which are stale after reuse. Smaller requests go to
// PyTorch's CPU allocator. amo::large_blocks().release() returns every cached block to the OS.
#pragma once

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <c10/core/CPUAllocator.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

namespace amo {

// Was 8 MiB. At 2 MiB (one huge page, the block granularity) the T=256 Megatron-path outputs (4 MiB)
// come from the cache too: from PyTorch's allocator they cost 350-420 first-touch faults per call,
// 0.1 -> 0.8 ms for a 0.1 ms permute, depending on what the allocator had freed before
// (2026-12-02, docs/benchmarks.md).
constexpr int64_t kLargeBytes = int64_t(2) << 20;

class LargeBlocks final : public c10::Allocator {
 public:
  struct Stats { int64_t cached_bytes, cached_blocks, hits, misses, cap_bytes; };

  static constexpr size_t kAlign = size_t(2) << 20;

  c10::DataPtr allocate(size_t n) override {
#if defined(__linux__)
    if (static_cast<int64_t>(n) >= kLargeBytes) {
      const size_t len = (n + kAlign - 1) / kAlign * kAlign;
      Block* b = take(len);
      if (b == nullptr) b = map(len);
      if (b != nullptr) return {b->p, b, &LargeBlocks::give_back, c10::Device(c10::DeviceType::CPU)};
    }
#endif
    return c10::GetCPUAllocator()->allocate(n);
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  // unmap every cached block
  void release() {
    std::vector<Block*> drop;
    {
      std::lock_guard<std::mutex> g(mu_);
      drop.swap(free_);
      cached_ = 0;
    }
    for (Block* b : drop) unmap(b);
  }
  Stats stats() {
    std::lock_guard<std::mutex> g(mu_);
    return {cached_, static_cast<int64_t>(free_.size()), hits_, misses_, cap_};
  }

 private:
  struct Block { void* p; size_t len; };

  LargeBlocks() {
    int64_t cap = int64_t(2) << 30;
#if defined(__linux__)
    const long pages = sysconf(_SC_PHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
    if (pages > 0 && psz > 0) cap = std::min<int64_t>(cap, int64_t(pages) * psz / 8);
#endif
    if (const char* v = std::getenv("ASCEND_MOE_OPS_CPU_CACHE_MB")) cap = std::max<int64_t>(0, std::atoll(v)) << 20;
    cap_ = cap;
  }
  friend LargeBlocks& large_blocks();

  // a cached block of len..len*5/4 bytes (the smallest), or nullptr
  Block* take(size_t len) {
    std::lock_guard<std::mutex> g(mu_);
    size_t best = free_.size();
    for (size_t i = 0; i < free_.size(); ++i)
      if (free_[i]->len >= len && free_[i]->len <= len + len / 4 &&
          (best == free_.size() || free_[i]->len < free_[best]->len))
        best = i;
    if (best == free_.size()) {
      ++misses_;
      return nullptr;
    }
    ++hits_;
    Block* b = free_[best];
    free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(best));
    cached_ -= static_cast<int64_t>(b->len);
    return b;
  }

  static Block* map(size_t len) {
#if defined(__linux__)
    // over-map by 2 MiB, keep the aligned part (huge pages need 2 MiB alignment)
    const size_t span = len + kAlign;
    void* raw = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) return nullptr;
    const uintptr_t r = reinterpret_cast<uintptr_t>(raw);
    const uintptr_t a = (r + kAlign - 1) & ~(uintptr_t(kAlign) - 1);
    if (a > r) munmap(raw, a - r);
    if (r + span > a + len) munmap(reinterpret_cast<void*>(a + len), r + span - (a + len));
#if defined(MADV_HUGEPAGE)
    (void)madvise(reinterpret_cast<void*>(a), len, MADV_HUGEPAGE);  // a hint; errors ignored
#endif
    return new Block{reinterpret_cast<void*>(a), len};
#else
    (void)len;
    return nullptr;
#endif
  }
  static void unmap(Block* b) {
#if defined(__linux__)
    munmap(b->p, b->len);
#endif
    delete b;
  }
  static void give_back(void* ctx);

  std::mutex mu_;
  std::vector<Block*> free_;  // oldest first
  int64_t cached_ = 0, hits_ = 0, misses_ = 0, cap_ = 0;
};

// The process-wide instance (never destroyed: tensors may be freed during exit).
inline LargeBlocks& large_blocks() {
  static LargeBlocks* inst = new LargeBlocks();
  return *inst;
}

inline void LargeBlocks::give_back(void* ctx) {
  Block* b = static_cast<Block*>(ctx);
  LargeBlocks& lb = large_blocks();
  std::vector<Block*> drop;
  {
    std::lock_guard<std::mutex> g(lb.mu_);
    if (static_cast<int64_t>(b->len) > lb.cap_) {
      drop.push_back(b);
    } else {
      lb.free_.push_back(b);
      lb.cached_ += static_cast<int64_t>(b->len);
      while (lb.cached_ > lb.cap_) {  // evict the oldest
        Block* o = lb.free_.front();
        lb.free_.erase(lb.free_.begin());
        lb.cached_ -= static_cast<int64_t>(o->len);
        drop.push_back(o);
      }
    }
  }
  for (Block* o : drop) unmap(o);
}

// A contiguous CPU tensor for a large output: from LargeBlocks when it is >= kLargeBytes (reused,
// pre-faulted, huge-page backed memory), else at::empty.
inline at::Tensor empty_large(at::IntArrayRef sizes, const at::TensorOptions& options) {
  const bool plain = options.device().is_cpu() && !options.pinned_memory() &&
                     options.layout() == c10::kStrided && !options.requires_grad();
  if (plain) {
    int64_t numel = 1;
    for (int64_t s : sizes) numel *= s;
    const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(options.dtype().toScalarType()));
    if (bytes >= kLargeBytes)
      return at::detail::empty_generic(sizes, &large_blocks(), c10::DispatchKeySet(c10::DispatchKey::CPU),
                                       options.dtype().toScalarType(), c10::nullopt);
  }
  return at::empty(sizes, options);
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
