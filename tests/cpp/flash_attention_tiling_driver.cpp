// Test driver for the flash attention tiling (tests/test_ascend_flash_attention.py). One case per
// stdin line:  H Dk Dr Dv causal dtype maxBase aicNum B cu_0 ... cu_B
// Prints one JSON object per line: the tiling and the result of the exact-once coverage check of
// every (query row, head) pair, plus the causal key-range check.
#include <cstdint>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "tiling/flash_attention_tiling.h"

using namespace amo_ascend;

int main() {
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    int64_t H, Dk, Dr, Dv, B;
    int causal, dtype;
    uint32_t maxBase, aic;
    in >> H >> Dk >> Dr >> Dv >> causal >> dtype >> maxBase >> aic >> B;
    std::vector<int64_t> cu(static_cast<size_t>(B + 1));
    for (auto& c : cu) in >> c;
    int64_t maxLen = 0;
    for (int64_t b = 0; b < B; ++b) maxLen = std::max<int64_t>(maxLen, cu[b + 1] - cu[b]);
    const int64_t T = cu[B];
    ChipInfo chip = Ascend910B2();
    chip.aicNum = aic;
    chip.aivNum = 2 * aic;
    try {
      FlashAttentionTiling t = compute_flash_attention_tiling(T, H, Dk, Dr, Dv, B, maxLen, causal != 0,
                                                              static_cast<DType>(dtype), chip, maxBase);
      auto sched = flash_attention_schedule(t, cu);
      std::vector<uint8_t> cover(static_cast<size_t>(T * H), 0);
      std::string err;
      size_t items = 0;
      for (auto& core : sched)
        for (auto& it : core) {
          ++items;
          const int64_t s0 = cu[it.seq], len = cu[it.seq + 1] - s0;
          if (it.rows <= 0 || it.rows > t.baseM) err = "item outside the query block";
          if (it.q0 < s0 || it.q0 + it.rows > s0 + len) err = "item crosses its sequence";
          const int64_t want = causal ? it.q0 - s0 + it.rows : len;
          if (it.kvLen != want) err = "wrong key range";
          if (it.keyBlocks * t.baseN < it.kvLen || (it.keyBlocks - 1) * t.baseN >= it.kvLen) err = "wrong key block count";
          for (int64_t r = it.q0; r < it.q0 + it.rows; ++r)
            if (++cover[static_cast<size_t>(r * H + it.head)] > 1) err = "query row covered twice";
        }
      for (auto c : cover)
        if (c != 1) { if (err.empty()) err = "query row not covered"; break; }
      std::ostringstream o;
      o << "{\"ok\":true,\"key\":" << uint32_t(t.key) << ",\"blockDim\":" << t.blockDim << ",\"baseM\":" << t.baseM
        << ",\"baseN\":" << t.baseN << ",\"vecRows\":" << t.vecRows << ",\"l1Buffers\":" << t.l1Buffers
        << ",\"l0Buffers\":" << t.l0Buffers << ",\"l0cBuffers\":" << t.l0cBuffers << ",\"ubBuffers\":" << t.ubBuffers
        << ",\"l1Bytes\":" << t.l1Bytes << ",\"l0aBytes\":" << t.l0aBytes << ",\"l0bBytes\":" << t.l0bBytes
        << ",\"l0cBytes\":" << t.l0cBytes << ",\"ubBytes\":" << t.ubBytes << ",\"items\":" << items
        << ",\"coverage\":\"" << (err.empty() ? "ok" : err) << "\"}";
      std::cout << o.str() << std::endl;
    } catch (const std::exception& e) {
      std::cout << "{\"ok\":false,\"error\":\"" << e.what() << "\"}" << std::endl;
    }
  }
}
