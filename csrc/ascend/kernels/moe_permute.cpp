// AscendC kernel of moe_permute: the row gather  out[r, :] = tokens[index[r], :]  (index[r] < 0:
// a zero row), r in [0, N).
//
// Division of labour (documented in docs/ascend.md): the row map of moe_permute (expert-major,
// stable, capacity, align and num_out_tokens rules; the spec: reference/moe_permute.py) needs global
// prefix sums over experts, so it is computed by the
// host glue with ATen ops that run on the device (argsort/cumsum/scatter, no host synchronization,
// csrc/ascend/host/row_map.h); the glue also inverts it into `index` (the source token of each output
// row, -1 for padding, unused rows and the slots dropped past num_out_tokens). This kernel then moves the T*K*H payload in one pass:
//   * output rows are split evenly over the AIV cores; each core writes a contiguous slab of the
//     output, every row exactly once (padding rows get zeros here, so the output needs no memset);
//   * each row is cut into H-tiles sized to UB; tiles flow GM -> UB -> GM through one double-buffered
//     VECIN->VECOUT queue, so the load of tile i+1 overlaps the store of tile i;
//   * rows whose byte size is not a multiple of 32 use DataCopyPad for the ragged tail.
// It only moves bits: fp16/bf16 rows move as int16, fp32 rows as int32.
#include "kernels/kernel_common.h"
#include "tiling/moe_permute_tiling.h"

using namespace AscendC;

namespace amo_ascend {
namespace kernels {

template <typename T>
class MoePermuteKernel {
 public:
  __aicore__ inline void Init(GM_ADDR tokens, GM_ADDR index, GM_ADDR out, const MoePermuteTiling& t, TPipe* pipe) {
    t_ = t;
    const uint32_t b = static_cast<uint32_t>(GetBlockIdx());
    OwnRows(t.rows, b, &first_, &count_);
    srcGm_.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(tokens), static_cast<uint64_t>(t.srcRows * t.hidden));
    indexGm_.SetGlobalBuffer(reinterpret_cast<__gm__ int32_t*>(index) + first_, static_cast<uint64_t>(count_));
    if (t.tokenMajor) {
      OwnRows(t.tokens, b, &tokFirst_, &tokCount_);
      mapGm_.SetGlobalBuffer(reinterpret_cast<__gm__ int32_t*>(index) + t.numRows + tokFirst_ * t.slots,
                             static_cast<uint64_t>(tokCount_ * t.slots));
      outAllGm_.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(out), static_cast<uint64_t>(t.numRows * t.hidden));
    }
    outGm_.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(out) + first_ * t.hidden, static_cast<uint64_t>(count_ * t.hidden));
    pipe->InitBuffer(copyQue_, t.bufferNum, t.cols.tileCols * sizeof(T));
    pipe->InitBuffer(zeroBuf_, t.cols.tileCols * sizeof(T));
  }

  __aicore__ inline void Process() {
    LocalTensor<T> zeros = zeroBuf_.Get<T>();
    ZeroFill(zeros, t_.cols.tileCols);
    SetFlag<HardEvent::V_MTE3>(EVENT_ID0);  // the zero tile is written by the vector unit, read by MTE3
    WaitFlag<HardEvent::V_MTE3>(EVENT_ID0);
    if (t_.tokenMajor) {
      TokenMajor(zeros);
      return;
    }
    for (int64_t r = 0; r < count_; ++r) {
      const int64_t src = ReadGmFresh(indexGm_, r);  // the row map: written by an earlier kernel
      const bool zero = src < 0 || src >= t_.srcRows;  // never a wild read
      for (uint32_t j = 0; j < t_.cols.tileNum; ++j) {
        const uint32_t cols = TileCols(t_.cols, j);
        const int64_t col0 = static_cast<int64_t>(j) * t_.cols.tileCols;
        const int64_t dst = r * t_.hidden + col0;  // 64-bit row * hidden products
        if (zero) {
          CopyRowOut(outGm_[dst], zeros, cols);
          continue;
        }
        LocalTensor<T> x = copyQue_.template AllocTensor<T>();
        CopyRowIn(x, srcGm_[src * t_.hidden + col0], cols);
        copyQue_.EnQue(x);
        LocalTensor<T> y = copyQue_.template DeQue<T>();
        CopyRowOut(outGm_[dst], y, cols);
        copyQue_.FreeTensor(y);
      }
    }
  }

 private:
  // The rows of split s this block owns (none when the split uses fewer blocks than launched).
  __aicore__ inline void OwnRows(const RowSplit& s, uint32_t b, int64_t* first, int64_t* count) {
    if (b < s.blockDim) {
      BlockRows(s, b, first, count);
    } else {
      *first = 0;
      *count = 0;
    }
  }

  // Token-major: each of this block's tokens read once and stored to its kept rows; then zeros to
  // the padding rows of this block's output slab.
  __aicore__ inline void TokenMajor(const LocalTensor<T>& zeros) {
    int64_t dst[kPermuteMaxSlots];
    for (int64_t tk = 0; tk < tokCount_; ++tk) {
      int64_t kept = 0;
      for (int64_t s = 0; s < t_.slots; ++s) {
        const int64_t r = ReadGmFresh(mapGm_, static_cast<uint64_t>(tk * t_.slots + s));  // written by an earlier kernel
        if (r >= 0 && r < t_.numRows) dst[kept++] = r;  // dropped slots (-1) write nothing
      }
      if (kept == 0) continue;
      const int64_t src = tokFirst_ + tk;
      for (uint32_t j = 0; j < t_.cols.tileNum; ++j) {
        const uint32_t cols = TileCols(t_.cols, j);
        const int64_t col0 = static_cast<int64_t>(j) * t_.cols.tileCols;
        LocalTensor<T> x = copyQue_.template AllocTensor<T>();
        CopyRowIn(x, srcGm_[src * t_.hidden + col0], cols);
        copyQue_.EnQue(x);
        LocalTensor<T> y = copyQue_.template DeQue<T>();
        for (int64_t k = 0; k < kept; ++k) CopyRowOut(outAllGm_[dst[k] * t_.hidden + col0], y, cols);
        copyQue_.FreeTensor(y);
      }
    }
    for (int64_t r = 0; r < count_; ++r) {
      const int64_t src = ReadGmFresh(indexGm_, r);
      if (src >= 0 && src < t_.srcRows) continue;  // a kept row: written by its token's core
      for (uint32_t j = 0; j < t_.cols.tileNum; ++j) {
        const int64_t col0 = static_cast<int64_t>(j) * t_.cols.tileCols;
        CopyRowOut(outGm_[r * t_.hidden + col0], zeros, TileCols(t_.cols, j));
      }
    }
  }

  MoePermuteTiling t_;
  int64_t first_ = 0, count_ = 0, tokFirst_ = 0, tokCount_ = 0;
  GlobalTensor<T> srcGm_, outGm_, outAllGm_;
  GlobalTensor<int32_t> indexGm_, mapGm_;
  TQueBind<TPosition::VECIN, TPosition::VECOUT, kDoubleBuffer> copyQue_;
  TBuf<TPosition::VECCALC> zeroBuf_;
};

}  // namespace kernels
}  // namespace amo_ascend

// tokens [T, H], index [N] int32, out [N, H], tiling: MoePermuteTiling in GM.
extern "C" __global__ __aicore__ void amo_moe_permute(GM_ADDR tokens, GM_ADDR index, GM_ADDR out, GM_ADDR tiling) {
  KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_AIV_ONLY);
  using namespace amo_ascend;
  MoePermuteTiling t;
  kernels::CopyTiling(&t, tiling);
  TPipe pipe;
  if (t.key == MoePermuteTilingKey::kB16) {
    kernels::MoePermuteKernel<int16_t> op;
    op.Init(tokens, index, out, t, &pipe);
    op.Process();
  } else if (t.key == MoePermuteTilingKey::kB32) {
    kernels::MoePermuteKernel<int32_t> op;
    op.Init(tokens, index, out, t, &pipe);
    op.Process();
  }
}
