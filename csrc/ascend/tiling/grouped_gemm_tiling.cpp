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
  const bool dw = layout == GroupedGemmLayout::kDW;
  const int64_t mDim = dw ? K : M;  // GEMM m-dimension (forward: rows, bounded by M)
  const int64_t kDim = dw ? M : K;  // reduction (dW: group rows, bounded by M)
  // The reduction one output tile runs over: forward K; dW the rows of one group, on average M / E
  // (the group sizes stay on the device).
  const int64_t kTile = dw ? ceil_div(M, std::max<int64_t>(E, 1)) : K;
  // Both blocks are 128 x 128 x 128 output tiles with two L0C tiles of 128 x 128 fp32 (2 x 64 KiB),
  // L0A / L0B 2 x 32 KiB:
  //   short reductions (<= kShortReduction): one M tile per item, the two L0C tiles alternate between
  //     items, so the Fixpipe of a tile overlaps the Mmads of the next (for K = 512 a tile's Fixpipe
  //     is half its Mmad time, for dW over 64 rows four times it); stepK 4;
  //   long ones: two M tiles per item (mPair 2) sharing each B chunk in L1, each accumulating in
  //     its own L0C tile: 256 x 128 of output per B chunk, the GM bytes per MAC of a 128 x 256 tile
  //     (96 B/cycle of MTE2 at the Cube's peak) while every weight block is loaded by one core
  //     once per 256 rows; stepK 2 (L1: 2 x (256 + 128) x 256 x 2 B = 384 KiB).
  const bool shortK = kTile <= kShortReduction;
  t.l0cBuffers = kDoubleBuffer;
  t.mPair = shortK ? 1 : 2;
  t.baseM = cap16(mDim, std::min<uint32_t>(128, cap));
  if (t.mPair == 2 && mDim <= t.baseM) t.mPair = 1;  // one M tile in all: nothing to pair
  t.baseN = cap16(N, std::min<uint32_t>(128, cap));
  t.baseK = cap16(kDim, std::min<uint32_t>(128, cap));
  // L1 chunk: up to 4 (short) / 2 (long) L0 K-steps, within the cap
  const uint64_t kWant = align_up(static_cast<uint64_t>(std::max<int64_t>(kDim, 1)), t.baseK);
  const uint64_t steps = shortK ? 4 : 2;
  t.stepK = static_cast<uint32_t>(std::max<uint64_t>(1, std::min<uint64_t>({steps, kWant / t.baseK, cap / t.baseK})));
  const uint64_t eb = t.elemBytes;
  t.l1Bytes = t.l1Buffers * (uint64_t(t.baseM) * t.mPair * t.baseK * t.stepK + uint64_t(t.baseK) * t.stepK * t.baseN) * eb;
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
  const int64_t span = int64_t(t.baseM) * t.mPair;
  if (dw) items = E * ceil_div(K, span) * nTiles;
  else items = (ceil_div(M, span) + std::min<int64_t>(E, M) + 1) * nTiles;
  t.blockDim = static_cast<uint32_t>(std::max<int64_t>(1, std::min<int64_t>(chip.aicNum, items)));
  return t;
}

std::vector<std::vector<GroupedGemmItem>> grouped_gemm_schedule(const GroupedGemmTiling& t,
                                                                const std::vector<int64_t>& sizes) {
  std::vector<std::vector<GroupedGemmItem>> out(t.blockDim);
  if (t.key == GroupedGemmTilingKey::kEmpty) return out;
  const int64_t nTiles = ceil_div(t.N, t.baseN);
  const int64_t span = int64_t(t.baseM) * t.mPair;
  int64_t item = 0, off = 0;
  auto put = [&](GroupedGemmItem it) {
    out[static_cast<size_t>(item % t.blockDim)].push_back(it);
    ++item;
  };
  if (t.layout == GroupedGemmLayout::kDW) {
    const int64_t mTiles = ceil_div(t.K, span);
    for (size_t e = 0; e < sizes.size(); ++e) {
      const int64_t g = std::max<int64_t>(0, std::min<int64_t>(sizes[e], t.M - off));
      for (int64_t i = 0; i < mTiles; ++i)
        for (int64_t j = 0; j < nTiles; ++j)
          put({static_cast<int64_t>(e), i * span, std::min<int64_t>(span, t.K - i * span), j * t.baseN,
               std::min<int64_t>(t.baseN, t.N - j * t.baseN), g});
      off += g;
    }
    return out;
  }
  for (size_t e = 0; e < sizes.size(); ++e) {
    const int64_t g = std::max<int64_t>(0, std::min<int64_t>(sizes[e], t.M - off));
    for (int64_t i = 0; i < ceil_div(g, span); ++i)
      for (int64_t j = 0; j < nTiles; ++j)
        put({static_cast<int64_t>(e), off + i * span, std::min<int64_t>(span, g - i * span), j * t.baseN,
             std::min<int64_t>(t.baseN, t.N - j * t.baseN), t.K});
    off += g;
  }
  for (int64_t r = off; r < t.M; r += span)
    for (int64_t j = 0; j < nTiles; ++j)
      put({-1, r, std::min<int64_t>(span, t.M - r), j * t.baseN, std::min<int64_t>(t.baseN, t.N - j * t.baseN), 0});
  return out;
}

}  // namespace amo_ascend
