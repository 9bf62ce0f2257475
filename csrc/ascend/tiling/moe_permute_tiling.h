// Tiling of the moe_permute AscendC kernel (plain C++17, no CANN include; see tiling_common.h).
//
// The kernel is a row gather with zero fill: out[r, :] = src[index[r], :] (index[r] == -1: zeros),
// r in [0, numRows). Output rows are split evenly over the AIV cores (each core writes a contiguous
// slab of the output, every row exactly once, so no memset of the output is needed), and each row is
// cut into H-tiles that fit in UB with double buffering.
#pragma once

#include "tiling_common.h"

namespace amo_ascend {

// The permute kernel only moves bits, so it is specialized on the element width, not the float type:
// fp16 and bf16 rows move as 16-bit words, fp32 rows as 32-bit words.
enum class MoePermuteTilingKey : uint32_t { kEmpty = 0, kB16 = 1, kB32 = 2 };

struct MoePermuteTiling {
  MoePermuteTilingKey key;
  CopyMode tailMode;    // kPadded when hidden * elemBytes is not a multiple of 32
  uint32_t elemBytes;
  uint32_t bufferNum;   // depth of the copy queue (double buffering)
  int64_t numRows;      // N: output rows
  int64_t srcRows;      // T: rows of the source (index values are < srcRows)
  int64_t hidden;       // H: elements per row
  RowSplit rows;        // over the N output rows
  HiddenSplit cols;     // over H
  uint64_t ubBytes;     // UB the kernel allocates with this tiling (all buffers, 32-byte aligned)
};

// UB plan (per AIV core): copy queue bufferNum x tileCols x elemBytes, plus one tile of zeros for
// rows with index -1. maxTileCols (0 = no cap) lets tests force several tiles per row.
MoePermuteTiling compute_moe_permute_tiling(int64_t numRows, int64_t srcRows, int64_t hidden, DType dtype,
                                            const ChipInfo& chip, uint32_t maxTileCols = 0);

}  // namespace amo_ascend
