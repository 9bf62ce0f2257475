// Tilings of the moe_unpermute forward and backward AscendC kernels (plain C++17, no CANN include).
//
// Forward: out[t] = sum_s w[t,s] * permuted[map[t,s]] for kept slots, tokens split over the AIV
//   cores; for each token and H-tile the weighted sum accumulates in an fp32 UB buffer in slot order
//   (deterministic), then is cast to the token dtype and stored.
// Backward: rows of grad_permuted are split over the cores (each written exactly once):
//   grad_permuted[r] = w[t,s] * grad_out[t] for the slot (t,s) that maps to r, zeros otherwise; with
//   probs, also dot[r] = <permuted[r], grad_out[t]> in fp32 (the host gathers dot into grad_probs).
#pragma once

#include "tiling_common.h"

namespace amo_ascend {

// Typed kernel selector: the kernel entry switches on this to pick the template instance.
enum class MoeUnpermuteTilingKey : uint32_t { kEmpty = 0, kF32 = 1, kF16 = 2, kBF16 = 3 };

struct MoeUnpermuteTiling {
  MoeUnpermuteTilingKey key;
  DType dtype;          // permuted / out
  CopyMode tailMode;
  uint32_t withProbs;   // 0: w = 1
  uint32_t bufferNum;
  uint32_t pad0;
  int64_t numTokens;    // T
  int64_t slots;        // S (K, or E for mask routing)
  int64_t numRows;      // N rows of permuted (map values are < N)
  int64_t hidden;       // H
  RowSplit rows;        // over the T tokens
  HiddenSplit cols;
  uint64_t ubBytes;
};

// UB plan: input queue bufferNum x tile x xB, output queue bufferNum x tile x xB; for fp16/bf16 also
// an fp32 accumulator and an fp32 cast buffer (fp32 rows accumulate in the output tile itself).
MoeUnpermuteTiling compute_moe_unpermute_tiling(int64_t numTokens, int64_t slots, int64_t numRows, int64_t hidden,
                                                DType dtype, bool withProbs, const ChipInfo& chip,
                                                uint32_t maxTileCols = 0);

struct MoeUnpermuteGradTiling {
  MoeUnpermuteTilingKey key;  // from xDtype
  DType xDtype;         // permuted and grad_permuted
  DType gDtype;         // grad_out: xDtype or kF32
  CopyMode tailMode;
  uint32_t withProbs;
  uint32_t bufferNum;
  int64_t numTokens, slots, numRows, hidden;
  RowSplit rows;        // over the N rows of grad_permuted
  HiddenSplit cols;
  uint32_t dotChunk;    // rows whose dot products are staged in UB before one store (withProbs)
  uint32_t pad0;
  uint64_t ubBytes;
};

// UB plan: grad queue bufferNum x tile x gB, output queue bufferNum x tile x xB, and with probs a
// permuted-row queue bufferNum x tile x xB, fp32 buffers for the casts, the product and the
// ReduceSum work area, plus the staged dot chunk (fixed size).
MoeUnpermuteGradTiling compute_moe_unpermute_grad_tiling(int64_t numTokens, int64_t slots, int64_t numRows,
                                                         int64_t hidden, DType xDtype, DType gDtype,
                                                         bool withProbs, const ChipInfo& chip,
                                                         uint32_t maxTileCols = 0);

}  // namespace amo_ascend
