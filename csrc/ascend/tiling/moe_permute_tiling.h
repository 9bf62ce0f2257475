// Tiling of the moe_permute AscendC kernel (plain C++17, no CANN include; see tiling_common.h).
//
// The kernel is a row gather with zero fill: out[r, :] = src[index[r], :] (index[r] == -1: zeros),
// r in [0, numRows). Two loop orders:
//   * row-major (slots == 0): output rows are split evenly over the AIV cores (each core writes a
//     contiguous slab of the output, every row exactly once, so no memset of the output is needed);
//     a token routed to K rows is read K times;
//   * token-major (1 <= slots <= kPermuteMaxSlots, the row map [srcRows, slots] given): source tokens
//     are split evenly over the cores; each core reads each of its tokens once and stores it to its
//     (up to `slots`) destination rows, then writes zeros to the rows of its output slab that no slot
//     maps to (padding). Every output row is still written exactly once.
// Each row is cut into H-tiles that fit in UB with double buffering.
#pragma once

#include "tiling_common.h"

namespace amo_ascend {

// The permute kernel only moves bits, so it is specialized on the element width, not the float type:
// fp16 and bf16 rows move as 16-bit words, fp32 rows as 32-bit words.
enum class MoePermuteTilingKey : uint32_t { kEmpty = 0, kB16 = 1, kB32 = 2 };

constexpr int64_t kPermuteMaxSlots = 64;  // token-major: a token's destinations are read into a scalar array

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
  uint32_t tokenMajor;  // 1: the token-major loop (see above)
  uint32_t blockDim;    // AIV cores launched: rows.blockDim, or max(rows, tokens) when token-major
  int64_t slots;        // token-major: routing slots per token (the row map's columns)
  RowSplit tokens;      // token-major: over the srcRows source tokens
  uint64_t ubBytes;     // UB the kernel allocates with this tiling (all buffers, 32-byte aligned)
};

// UB plan (per AIV core): copy queue bufferNum x tileCols x elemBytes, plus one tile of zeros for
// rows with index -1. maxTileCols (0 = no cap) lets tests force several tiles per row. slots > 0
// (at most kPermuteMaxSlots) selects the token-major loop; the kernel then reads the row map
// [srcRows, slots] right after the N entries of `index`.
MoePermuteTiling compute_moe_permute_tiling(int64_t numRows, int64_t srcRows, int64_t hidden, DType dtype,
                                            const ChipInfo& chip, uint32_t maxTileCols = 0, int64_t slots = 0);

}  // namespace amo_ascend
