#include "moe_permute_tiling.h"

#include <algorithm>
#include <limits>
#include <string>
#include <stdexcept>

namespace amo_ascend {

MoePermuteTiling compute_moe_permute_tiling(int64_t numRows, int64_t srcRows, int64_t hidden, DType dtype,
                                            const ChipInfo& chip, uint32_t maxTileCols, int64_t slots) {
  if (numRows < 0 || srcRows < 0 || hidden < 0) throw std::invalid_argument("moe_permute tiling: negative size");
  if (slots < 0 || slots > kPermuteMaxSlots)
    throw std::invalid_argument("moe_permute tiling: slots must be in [0, " + std::to_string(kPermuteMaxSlots) +
                                "], got " + std::to_string(slots));
  MoePermuteTiling t{};
  t.elemBytes = dtype_bytes(dtype);
  t.key = t.elemBytes == 2 ? MoePermuteTilingKey::kB16 : MoePermuteTilingKey::kB32;
  t.bufferNum = kDoubleBuffer;
  t.numRows = numRows;
  t.srcRows = srcRows;
  t.hidden = hidden;
  t.tailMode = (static_cast<uint64_t>(hidden) * t.elemBytes) % kBlockBytes ? CopyMode::kPadded : CopyMode::kAligned;
  t.rows = split_rows(numRows, chip.aivNum);
  const uint32_t alignElems = kBlockBytes / t.elemBytes;
  const uint64_t bytesPerCol = static_cast<uint64_t>(t.bufferNum + 1) * t.elemBytes;  // queue + zero tile
  t.cols = split_hidden(hidden, bytesPerCol, 0, alignElems, ub_budget(chip),
                        maxTileCols ? maxTileCols : std::numeric_limits<uint32_t>::max());
  t.ubBytes = bytesPerCol * t.cols.tileCols;
  t.blockDim = t.rows.blockDim;
  if (slots > 0) {
    t.tokenMajor = 1;
    t.slots = slots;
    t.tokens = split_rows(srcRows, chip.aivNum);
    t.blockDim = std::max(t.rows.blockDim, t.tokens.blockDim);
  }
  if (numRows == 0 || hidden == 0) t.key = MoePermuteTilingKey::kEmpty;
  return t;
}

}  // namespace amo_ascend
