#include "grouped_gemm_tiling.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace amo_ascend {

namespace {

uint32_t cap16(int64_t want, uint32_t limit) {
  uint64_t w = align_up(static_cast<uint64_t>(std::max<int64_t>(want, 1)), kFractal);
  return static_cast<uint32_t>(std::min<uint64_t>(w, limit));
}

}  // namespace

GroupedGemmTiling compute_grouped_gemm_tiling(GroupedGemmLayout layout, int64_t M, int64_t K, int64_t N, int64_t E,
                                              DType dtype, const ChipInfo& chip, uint32_t maxBase) {
  if (M < 0 || K < 0 || N < 0 || E < 0) throw std::invalid_argument("grouped_gemm tiling: negative size");
  if (dtype == DType::kF32)
    throw std::invalid_argument("grouped_gemm on the Ascend Cube path supports fp16 and bf16 inputs only "
                                "(fp32 inputs are not implemented: no fp32 Cube mode is used)");
  if (chip.aicNum == 0) throw std::invalid_argument("grouped_gemm tiling: aicNum must be >= 1");
  GroupedGemmTiling t{};
  t.layout = layout;
  t.key = dtype == DType::kF16 ? GroupedGemmTilingKey::kF16 : GroupedGemmTilingKey::kBF16;
  t.M = M; t.K = K; t.N = N; t.E = E;
  t.elemBytes = 2;
  t.l1Buffers = kDoubleBuffer;
  t.l0Buffers = kDoubleBuffer;
  t.l0cBuffers = 1;
  const uint32_t cap = maxBase ? std::max<uint32_t>(kFractal, maxBase / kFractal * kFractal) : 0xFFFFFFFFu;
  // Base block 128 x 256 x 64: L0A 2 x 16 KiB, L0B 2 x 32 KiB = 64 KiB, L0C 128 KiB (fp32).
  const bool dw = layout == GroupedGemmLayout::kDW;
  const int64_t mDim = dw ? K : M;  // GEMM m-dimension (forward: rows, bounded by M)
  const int64_t kDim = dw ? M : K;  // reduction (dW: group rows, bounded by M)
  t.baseM = cap16(mDim, std::min<uint32_t>(128, cap));
  t.baseN = cap16(N, std::min<uint32_t>(256, cap));
  t.baseK = cap16(kDim, std::min<uint32_t>(64, cap));
  // L1 chunk: up to 4 L0 K-steps, within the cap
  const uint64_t kWant = align_up(static_cast<uint64_t>(std::max<int64_t>(kDim, 1)), t.baseK);
  t.stepK = static_cast<uint32_t>(std::max<uint64_t>(1, std::min<uint64_t>({4, kWant / t.baseK, cap / t.baseK})));
  const uint64_t eb = t.elemBytes;
  t.l1Bytes = t.l1Buffers * (uint64_t(t.baseM) * t.baseK * t.stepK + uint64_t(t.baseK) * t.stepK * t.baseN) * eb;
  t.l0aBytes = t.l0Buffers * uint64_t(t.baseM) * t.baseK * eb;
  t.l0bBytes = t.l0Buffers * uint64_t(t.baseK) * t.baseN * eb;
  t.l0cBytes = t.l0cBuffers * uint64_t(t.baseM) * t.baseN * 4;
  if (t.l1Bytes > chip.l1Bytes || t.l0aBytes > chip.l0aBytes || t.l0bBytes > chip.l0bBytes || t.l0cBytes > chip.l0cBytes)
    throw std::invalid_argument("grouped_gemm tiling: base block " + std::to_string(t.baseM) + "x" + std::to_string(t.baseN) +
                                "x" + std::to_string(t.baseK) + " does not fit L1/L0 of this chip");
  // Forward: every output row is written (zero items cover rows past the groups, and K == 0 gives
  // zero tiles), so only M == 0 or N == 0 is empty. dW: no output unless E, K and N are positive.
  if (dw ? (E == 0 || K == 0 || N == 0) : (M == 0 || N == 0)) {
    t.key = GroupedGemmTilingKey::kEmpty;
    t.blockDim = 1;
    return t;
  }
  // Upper bound of the item count (the group sizes are not known here).
  int64_t items;
  const int64_t nTiles = ceil_div(N, t.baseN);
  if (dw) items = E * ceil_div(K, t.baseM) * nTiles;
  else items = (ceil_div(M, t.baseM) + std::min<int64_t>(E, M) + 1) * nTiles;
  t.blockDim = static_cast<uint32_t>(std::max<int64_t>(1, std::min<int64_t>(chip.aicNum, items)));
  return t;
}

std::vector<std::vector<GroupedGemmItem>> grouped_gemm_schedule(const GroupedGemmTiling& t,
                                                                const std::vector<int64_t>& sizes) {
  std::vector<std::vector<GroupedGemmItem>> out(t.blockDim);
  if (t.key == GroupedGemmTilingKey::kEmpty) return out;
  const int64_t nTiles = ceil_div(t.N, t.baseN);
  int64_t item = 0, off = 0;
  auto put = [&](GroupedGemmItem it) {
    out[static_cast<size_t>(item % t.blockDim)].push_back(it);
    ++item;
  };
  if (t.layout == GroupedGemmLayout::kDW) {
    const int64_t mTiles = ceil_div(t.K, t.baseM);
    for (size_t e = 0; e < sizes.size(); ++e) {
      const int64_t g = std::max<int64_t>(0, std::min<int64_t>(sizes[e], t.M - off));
      for (int64_t i = 0; i < mTiles; ++i)
        for (int64_t j = 0; j < nTiles; ++j)
          put({static_cast<int64_t>(e), i * t.baseM, std::min<int64_t>(t.baseM, t.K - i * t.baseM), j * t.baseN,
               std::min<int64_t>(t.baseN, t.N - j * t.baseN), g});
      off += g;
    }
    return out;
  }
  for (size_t e = 0; e < sizes.size(); ++e) {
    const int64_t g = std::max<int64_t>(0, std::min<int64_t>(sizes[e], t.M - off));
    for (int64_t i = 0; i < ceil_div(g, t.baseM); ++i)
      for (int64_t j = 0; j < nTiles; ++j)
        put({static_cast<int64_t>(e), off + i * t.baseM, std::min<int64_t>(t.baseM, g - i * t.baseM), j * t.baseN,
             std::min<int64_t>(t.baseN, t.N - j * t.baseN), t.K});
    off += g;
  }
  for (int64_t r = off; r < t.M; r += t.baseM)
    for (int64_t j = 0; j < nTiles; ++j)
      put({-1, r, std::min<int64_t>(t.baseM, t.M - r), j * t.baseN, std::min<int64_t>(t.baseN, t.N - j * t.baseN), 0});
  return out;
}

}  // namespace amo_ascend
