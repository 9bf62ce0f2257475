#include "moe_unpermute_tiling.h"

#include <algorithm>
#include <limits>
#include <stdexcept>

namespace amo_ascend {

namespace {

MoeUnpermuteTilingKey key_of(DType d) {
  switch (d) {
    case DType::kF32: return MoeUnpermuteTilingKey::kF32;
    case DType::kF16: return MoeUnpermuteTilingKey::kF16;
    case DType::kBF16: return MoeUnpermuteTilingKey::kBF16;
  }
  throw std::invalid_argument("moe_unpermute tiling: unknown dtype");
}

CopyMode tail_mode(int64_t hidden, uint32_t bytes) {
  return (static_cast<uint64_t>(hidden) * bytes) % kBlockBytes ? CopyMode::kPadded : CopyMode::kAligned;
}

}  // namespace

MoeUnpermuteTiling compute_moe_unpermute_tiling(int64_t numTokens, int64_t slots, int64_t numRows, int64_t hidden,
                                                DType dtype, bool withProbs, const ChipInfo& chip,
                                                uint32_t maxTileCols) {
  if (numTokens < 0 || slots < 0 || numRows < 0 || hidden < 0)
    throw std::invalid_argument("moe_unpermute tiling: negative size");
  MoeUnpermuteTiling t{};
  t.key = key_of(dtype);
  t.dtype = dtype;
  t.withProbs = withProbs ? 1 : 0;
  t.bufferNum = kDoubleBuffer;
  t.numTokens = numTokens;
  t.slots = slots;
  t.numRows = numRows;
  t.hidden = hidden;
  const uint32_t xb = dtype_bytes(dtype);
  t.tailMode = tail_mode(hidden, xb);
  t.rows = split_rows(numTokens, chip.aivNum);
  // fp32 rows accumulate directly in the output tile; 16-bit rows need an fp32 accumulator and an
  // fp32 copy of the input tile
  const uint64_t perCol = 2ull * t.bufferNum * xb + (xb != 4 ? 8 : 0);
  t.cols = split_hidden(hidden, perCol, 0, kBlockBytes / xb, ub_budget(chip),
                        maxTileCols ? maxTileCols : std::numeric_limits<uint32_t>::max());
  t.ubBytes = perCol * t.cols.tileCols;
  if (numTokens == 0 || hidden == 0) t.key = MoeUnpermuteTilingKey::kEmpty;
  return t;
}

MoeUnpermuteGradTiling compute_moe_unpermute_grad_tiling(int64_t numTokens, int64_t slots, int64_t numRows,
                                                         int64_t hidden, DType xDtype, DType gDtype,
                                                         bool withProbs, const ChipInfo& chip,
                                                         uint32_t maxTileCols) {
  if (numTokens < 0 || slots < 0 || numRows < 0 || hidden < 0)
    throw std::invalid_argument("moe_unpermute_backward tiling: negative size");
  if (gDtype != xDtype && gDtype != DType::kF32)
    throw std::invalid_argument("moe_unpermute_backward tiling: grad dtype must equal the permuted dtype or be fp32");
  MoeUnpermuteGradTiling t{};
  t.key = key_of(xDtype);
  t.xDtype = xDtype;
  t.gDtype = gDtype;
  t.withProbs = withProbs ? 1 : 0;
  t.bufferNum = kDoubleBuffer;
  t.numTokens = numTokens;
  t.slots = slots;
  t.numRows = numRows;
  t.hidden = hidden;
  const uint32_t xb = dtype_bytes(xDtype), gb = dtype_bytes(gDtype);
  t.tailMode = (tail_mode(hidden, xb) == CopyMode::kPadded || tail_mode(hidden, gb) == CopyMode::kPadded)
                   ? CopyMode::kPadded : CopyMode::kAligned;
  t.rows = split_rows(numRows, chip.aivNum);
  uint64_t perCol = static_cast<uint64_t>(t.bufferNum) * gb   // grad_out tiles
                    + static_cast<uint64_t>(t.bufferNum) * xb  // grad_permuted tiles
                    + 4;                                       // fp32 scaled gradient
  if (gb != 4) perCol += 4;                                    // fp32 copy of the grad tile
  uint64_t fixed = 0;
  if (withProbs) {
    perCol += static_cast<uint64_t>(t.bufferNum) * xb;         // permuted tiles
    if (xb != 4) perCol += 4;                                  // fp32 copy of the permuted tile
    perCol += 4 + 4;                                           // product and ReduceSum work area
    // dot staging: one queue of dotChunk fp32 plus a 32-byte ReduceSum result
    int64_t most = std::max<int64_t>(t.rows.formerRows, 1);
    t.dotChunk = static_cast<uint32_t>(align_up(static_cast<uint64_t>(std::min<int64_t>(most, 1024)), 8));
    fixed = static_cast<uint64_t>(t.dotChunk) * 4 + kBlockBytes;
  }
  const uint32_t alignElems = kBlockBytes / std::min(xb, gb);
  t.cols = split_hidden(hidden, perCol, fixed, alignElems, ub_budget(chip),
                        maxTileCols ? maxTileCols : std::numeric_limits<uint32_t>::max());
  t.ubBytes = perCol * t.cols.tileCols + fixed;
  if (numRows == 0 || hidden == 0) t.key = MoeUnpermuteTilingKey::kEmpty;
  return t;
}

}  // namespace amo_ascend
