// Tiling of the grouped GEMM AscendC kernels on the Cube unit (plain C++17, no CANN include; see
// tiling_common.h for the chip facts).
//
// Forward (layouts kNN / kNT):  out[rows of e] = x[rows of e] . W_e,  x [M, K], out [M, N],
//   W_e = weight[e] ([K, N], kNN) or weight[e]^T (weight [E, N, K], kNT). Rows past sum(group_sizes)
//   are written with zeros by the kernel ("zero items").
// Weight gradient (layout kDW):  out[e] = a_e^T . b_e,  a [M, K], b [M, N], out [E, K, N]; here the
//   GEMM's m-dimension is K, its n-dimension is N and its reduction runs over the group's rows.
//
// Work items are output tiles of (baseM * mPair) x baseN:
//   forward: (group e, M-tile of e's rows, N-tile) for every non-empty group, in group order, then the
//            zero items covering rows [sum(group_sizes), M);
//   dW:      (group e, K-tile, N-tile) for every group (an empty group gives zero tiles).
// Item t (counted in that order) runs on AIC core t % blockDim. The host does not know the group
// sizes (they stay on the device: no host synchronization); the kernel reads them from GM and walks
// the groups itself. The tiling only fixes the base block, the K steps and blockDim.
//
// Buffers per AIC core (fp16/bf16 inputs, 16 x 16 fractals, fp32 accumulation in L0C):
//   L1  : A chunk (baseM * mPair) x (baseK * stepK) and B chunk (baseK * stepK) x baseN, each l1Buffers deep
//   L0A : baseM x baseK,  l0Buffers deep;  L0B : baseK x baseN, l0Buffers deep
//   L0C : baseM x baseN fp32, l0cBuffers deep (2 for short reductions: the Fixpipe of one tile
//         overlaps the Mmads of the next)
// baseM, baseN, baseK are multiples of 16; every buffer is a multiple of 512 bytes (one fractal).
#pragma once

#ifndef __CCE_AICORE__  // host only: the kernels (device pass of bisheng) see the POD structs
#include <vector>
#endif

#include "tiling_common.h"

namespace amo_ascend {

// Element type of the Cube inputs. fp32 inputs are not implemented on the Cube path (see
// docs/ascend.md): the tiling refuses them.
enum class GroupedGemmTilingKey : uint32_t { kEmpty = 0, kF16 = 1, kBF16 = 2 };
enum class GroupedGemmLayout : uint32_t { kNN = 0, kNT = 1, kDW = 2 };

constexpr uint32_t kFractal = 16;          // 16 x 16 fp16/bf16 fractal (512 B) on L1/L0A/L0B
constexpr uint32_t kFractalBytes = 512;
// Reductions (per output tile) up to this length take the 128 x 128 base block with two L0C tiles.
constexpr int64_t kShortReduction = 512;

struct GroupedGemmTiling {
  GroupedGemmTilingKey key;
  GroupedGemmLayout layout;
  uint32_t blockDim;     // AIC cores launched (<= aicNum)
  uint32_t baseM, baseN, baseK, stepK;  // L1 K chunk = baseK * stepK
  uint32_t l1Buffers, l0Buffers, l0cBuffers;
  uint32_t mPair;        // M sub-tiles of baseM rows per work item (2: they share the B chunk in L1)
  uint32_t elemBytes;    // 2
  int64_t M, K, N, E;    // see the header comment (dW: out [E, K, N])
  uint64_t l1Bytes, l0aBytes, l0bBytes, l0cBytes;  // what the kernel allocates with this tiling
};

// Caps (0 = none) let tests force small tiles: maxBase caps baseM, baseN and baseK*stepK.
GroupedGemmTiling compute_grouped_gemm_tiling(GroupedGemmLayout layout, int64_t M, int64_t K, int64_t N, int64_t E,
                                              DType dtype, const ChipInfo& chip, uint32_t maxBase = 0);

// Host twin of the kernel's walk (for tests): the output tiles each core writes, in order.
#ifndef __CCE_AICORE__  // host-side twins of the kernels' walks (tests)
struct GroupedGemmItem {
  int64_t group;  // -1 for a forward zero item
  int64_t row0, rows;  // forward: rows of out; dW: rows of out[group] (the K dimension); <= baseM * mPair
  int64_t col0, cols;  // columns of out (N)
  int64_t kRows;       // dW: rows of the group reduced over; forward: K
};
std::vector<std::vector<GroupedGemmItem>> grouped_gemm_schedule(const GroupedGemmTiling& t,
                                                                const std::vector<int64_t>& groupSizes);

#endif  // __CCE_AICORE__

}  // namespace amo_ascend
