// Test driver for the grouped GEMM tiling (tests/test_ascend_grouped_gemm_tiling.py). One case per
// stdin line:  layout M K N dtype maxBase aicNum E size_0 ... size_{E-1}
// (layout 0 = NN, 1 = NT, 2 = DW; dtype 0 = fp32, 1 = fp16, 2 = bf16). Prints one JSON object per
// line: the tiling, the per-core item counts, and the result of the exact-once coverage check of the
// output, done here because real shapes have tens of millions of output elements.
#include <cstdint>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "tiling/grouped_gemm_tiling.h"

using namespace amo_ascend;

int main() {
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    int layout, dtype;
    int64_t M, K, N, E;
    uint32_t maxBase, aic;
    in >> layout >> M >> K >> N >> dtype >> maxBase >> aic >> E;
    std::vector<int64_t> sizes(static_cast<size_t>(E));
    for (auto& s : sizes) in >> s;
    ChipInfo chip = Ascend910B2();
    chip.aicNum = aic;
    try {
      GroupedGemmTiling t = compute_grouped_gemm_tiling(static_cast<GroupedGemmLayout>(layout), M, K, N, E,
                                                        static_cast<DType>(dtype), chip, maxBase);
      auto sched = grouped_gemm_schedule(t, sizes);
      const bool dw = t.layout == GroupedGemmLayout::kDW;
      const uint64_t total = t.key == GroupedGemmTilingKey::kEmpty ? 0 : uint64_t(dw ? E * K : M) * uint64_t(N);
      std::vector<uint8_t> cover(total, 0);
      std::string err;
      int64_t off = 0;
      std::vector<int64_t> starts;
      for (auto s : sizes) { starts.push_back(off); off += s; }
      for (auto& core : sched) {
        for (auto& it : core) {
          if (it.rows <= 0 || it.rows > int64_t(t.baseM) * t.mPair || it.cols <= 0 || it.cols > t.baseN) err = "tile outside the base block";
          if (!dw && it.group >= 0 && (it.row0 < starts[it.group] || it.row0 + it.rows > starts[it.group] + sizes[it.group]))
            err = "forward tile crosses its group";
          if (!dw && it.group < 0 && it.row0 < off) err = "zero tile over group rows";
          for (int64_t r = it.row0; r < it.row0 + it.rows; ++r)
            for (int64_t c = it.col0; c < it.col0 + it.cols; ++c) {
              uint64_t idx = uint64_t(dw ? it.group * K + r : r) * uint64_t(N) + uint64_t(c);
              if (idx >= total) { err = "tile outside the output"; continue; }
              if (++cover[idx] > 1) err = "element covered twice";
            }
        }
      }
      for (auto c : cover)
        if (c != 1) { if (err.empty()) err = "element not covered"; break; }
      std::ostringstream o;
      o << "{\"ok\":true,\"key\":" << uint32_t(t.key) << ",\"blockDim\":" << t.blockDim << ",\"baseM\":" << t.baseM
        << ",\"baseN\":" << t.baseN << ",\"baseK\":" << t.baseK << ",\"stepK\":" << t.stepK << ",\"l1Buffers\":" << t.l1Buffers
        << ",\"l0Buffers\":" << t.l0Buffers << ",\"l0cBuffers\":" << t.l0cBuffers << ",\"mPair\":" << t.mPair
        << ",\"l1Bytes\":" << t.l1Bytes
        << ",\"l0aBytes\":" << t.l0aBytes << ",\"l0bBytes\":" << t.l0bBytes << ",\"l0cBytes\":" << t.l0cBytes
        << ",\"coverage\":\"" << (err.empty() ? "exact" : err) << "\",\"items\":[";
      for (size_t c = 0; c < sched.size(); ++c) o << (c ? "," : "") << sched[c].size();
      o << "]}";
      std::cout << o.str() << std::endl;
    } catch (const std::exception& e) {
      std::cout << "{\"ok\":false,\"error\":\"" << e.what() << "\"}" << std::endl;
    }
  }
  return 0;
}
