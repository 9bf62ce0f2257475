// AscendC kernels of moe_unpermute (forward) and of its backward.
//
// Forward, amo_moe_unpermute: out[t] = sum_s w[t,s] * permuted[map[t,s]] over kept slots
// (map >= 0), w = probs (given to the kernel as fp32 [T, S]) or 1.
//   * tokens are split evenly over the AIV cores; each core writes its own contiguous output rows;
//   * for every token and H-tile the sum is accumulated in fp32 in UB, slot by slot in ascending slot
//     order (deterministic and bitwise reproducible: no atomics, one writer per output element),
//     then cast (round to nearest even) to the token dtype and stored; a row no kept slot points to
//     is never read (a NaN there cannot leak);
//   * the input rows stream through a double-buffered VECIN queue, the results through a
//     double-buffered VECOUT queue; DataCopyPad handles rows whose size is not a multiple of 32 B.
//
// Backward, amo_moe_unpermute_grad: over the N rows of grad_permuted (split over the cores), with
// slot[r] = the routing slot t*S+s that maps to row r (-1: none; the host glue inverts the map):
//   grad_permuted[r] = w[t,s] * grad_out[t]   (zeros when slot[r] < 0), computed in fp32;
//   with probs also dot[r] = <permuted[r], grad_out[t]> in fp32 (Mul + ReduceSum per tile, tiles
//   added in order); the host gathers grad_probs[t,s] = dot[map[t,s]].
#include "kernels/kernel_common.h"
#include "tiling/moe_unpermute_tiling.h"

using namespace AscendC;

namespace amo_ascend {
namespace kernels {

template <typename T>
constexpr bool kIsF32 = IsSame<T, float>::value;

template <typename T>
class MoeUnpermuteKernel {
 public:
  __aicore__ inline void Init(GM_ADDR permuted, GM_ADDR rowMap, GM_ADDR probs, GM_ADDR out,
                              const MoeUnpermuteTiling& t, TPipe* pipe) {
    t_ = t;
    BlockRows(t.rows, static_cast<uint32_t>(GetBlockIdx()), &first_, &count_);
    permGm_.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(permuted), static_cast<uint64_t>(t.numRows * t.hidden));
    mapGm_.SetGlobalBuffer(reinterpret_cast<__gm__ int32_t*>(rowMap) + first_ * t.slots, static_cast<uint64_t>(count_ * t.slots));
    if (t.withProbs) {
      probsGm_.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(probs) + first_ * t.slots, static_cast<uint64_t>(count_ * t.slots));
    }
    outGm_.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(out) + first_ * t.hidden, static_cast<uint64_t>(count_ * t.hidden));
    const uint32_t tile = t.cols.tileCols;
    pipe->InitBuffer(inQue_, t.bufferNum, tile * sizeof(T));
    pipe->InitBuffer(outQue_, t.bufferNum, tile * sizeof(T));
    if constexpr (!kIsF32<T>) {
      pipe->InitBuffer(accBuf_, tile * sizeof(float));
      pipe->InitBuffer(castBuf_, tile * sizeof(float));
    }
  }

  __aicore__ inline void Process() {
    for (int64_t tok = 0; tok < count_; ++tok) {
      for (uint32_t j = 0; j < t_.cols.tileNum; ++j) {
        const uint32_t cols = TileCols(t_.cols, j);
        const int64_t col0 = static_cast<int64_t>(j) * t_.cols.tileCols;
        LocalTensor<T> y = outQue_.template AllocTensor<T>();
        LocalTensor<float> acc;
        if constexpr (kIsF32<T>) {
          acc = y;  // fp32: accumulate in the output tile itself
        } else {
          acc = accBuf_.template Get<float>();
        }
        Duplicate(acc, 0.0f, static_cast<int32_t>(cols));
        for (int64_t s = 0; s < t_.slots; ++s) {
          const int64_t row = ReadGmFresh(mapGm_, tok * t_.slots + s);
          if (row < 0 || row >= t_.numRows) continue;  // dropped / empty slot
          LocalTensor<T> x = inQue_.template AllocTensor<T>();
          CopyRowIn(x, permGm_[row * t_.hidden + col0], cols);
          inQue_.EnQue(x);
          x = inQue_.template DeQue<T>();
          LocalTensor<float> xf;
          if constexpr (kIsF32<T>) {
            xf = x;
          } else {
            xf = castBuf_.template Get<float>();
            Cast(xf, x, RoundMode::CAST_NONE, cols);
          }
          if (t_.withProbs) {
            const float w = ReadGmFresh(probsGm_, tok * t_.slots + s);
            Axpy(acc, xf, w, static_cast<int32_t>(cols));  // acc += w * x
          } else {
            Add(acc, acc, xf, static_cast<int32_t>(cols));
          }
          inQue_.FreeTensor(x);
        }
        if constexpr (!kIsF32<T>) {
          Cast(y, acc, RoundMode::CAST_RINT, cols);
        }
        outQue_.EnQue(y);
        y = outQue_.template DeQue<T>();
        CopyRowOut(outGm_[tok * t_.hidden + col0], y, cols);
        outQue_.FreeTensor(y);
      }
    }
  }

 private:
  MoeUnpermuteTiling t_;
  int64_t first_ = 0, count_ = 0;
  GlobalTensor<T> permGm_, outGm_;
  GlobalTensor<int32_t> mapGm_;
  GlobalTensor<float> probsGm_;
  TQue<TPosition::VECIN, kDoubleBuffer> inQue_;
  TQue<TPosition::VECOUT, kDoubleBuffer> outQue_;
  TBuf<TPosition::VECCALC> accBuf_, castBuf_;
};

// TX: permuted / grad_permuted; TG: grad_out (TX or float).
template <typename TX, typename TG>
class MoeUnpermuteGradKernel {
 public:
  __aicore__ inline void Init(GM_ADDR gradOut, GM_ADDR permuted, GM_ADDR slotOfRow, GM_ADDR probs,
                              GM_ADDR gradPermuted, GM_ADDR dots, const MoeUnpermuteGradTiling& t, TPipe* pipe) {
    t_ = t;
    BlockRows(t.rows, static_cast<uint32_t>(GetBlockIdx()), &first_, &count_);
    gradGm_.SetGlobalBuffer(reinterpret_cast<__gm__ TG*>(gradOut), static_cast<uint64_t>(t.numTokens * t.hidden));
    slotGm_.SetGlobalBuffer(reinterpret_cast<__gm__ int32_t*>(slotOfRow) + first_, static_cast<uint64_t>(count_));
    outGm_.SetGlobalBuffer(reinterpret_cast<__gm__ TX*>(gradPermuted) + first_ * t.hidden, static_cast<uint64_t>(count_ * t.hidden));
    const uint32_t tile = t.cols.tileCols;
    pipe->InitBuffer(gQue_, t.bufferNum, tile * sizeof(TG));
    pipe->InitBuffer(outQue_, t.bufferNum, tile * sizeof(TX));
    pipe->InitBuffer(scaledBuf_, tile * sizeof(float));
    if constexpr (!kIsF32<TG>) pipe->InitBuffer(gCastBuf_, tile * sizeof(float));
    if (t.withProbs) {
      permGm_.SetGlobalBuffer(reinterpret_cast<__gm__ TX*>(permuted) + first_ * t.hidden, static_cast<uint64_t>(count_ * t.hidden));
      probsGm_.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(probs), static_cast<uint64_t>(t.numTokens * t.slots));
      dotGm_.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(dots) + first_, static_cast<uint64_t>(count_));
      pipe->InitBuffer(xQue_, t.bufferNum, tile * sizeof(TX));
      if constexpr (!kIsF32<TX>) pipe->InitBuffer(xCastBuf_, tile * sizeof(float));
      pipe->InitBuffer(prodBuf_, tile * sizeof(float));
      pipe->InitBuffer(workBuf_, tile * sizeof(float));
      pipe->InitBuffer(dotQue_, 1, t.dotChunk * sizeof(float));
      pipe->InitBuffer(redBuf_, kBlockBytes);
    }
  }

  __aicore__ inline void Process() {
    LocalTensor<float> dotLocal;
    int64_t chunkStart = 0;
    if (t_.withProbs && count_ > 0) dotLocal = dotQue_.template AllocTensor<float>();
    for (int64_t r = 0; r < count_; ++r) {
      const int64_t slot = ReadGmFresh(slotGm_, r);
      const bool none = slot < 0 || slot >= t_.numTokens * t_.slots;
      const int64_t tok = none ? 0 : slot / t_.slots;
      const float w = (!none && t_.withProbs) ? ReadGmFresh(probsGm_, slot) : 1.0f;
      float dot = 0.0f;
      for (uint32_t j = 0; j < t_.cols.tileNum; ++j) {
        const uint32_t cols = TileCols(t_.cols, j);
        const int64_t col0 = static_cast<int64_t>(j) * t_.cols.tileCols;
        LocalTensor<TX> y = outQue_.template AllocTensor<TX>();
        if (none) {
          ZeroFill(y, cols);
        } else {
          dot += RowTile(tok, r, col0, cols, w, y);
        }
        outQue_.EnQue(y);
        y = outQue_.template DeQue<TX>();
        CopyRowOut(outGm_[r * t_.hidden + col0], y, cols);
        outQue_.FreeTensor(y);
      }
      if (t_.withProbs) {
        dotLocal.SetValue(static_cast<uint32_t>(r - chunkStart), dot);
        if (r + 1 - chunkStart == t_.dotChunk || r + 1 == count_) {
          const uint32_t n = static_cast<uint32_t>(r + 1 - chunkStart);
          SetFlag<HardEvent::S_MTE3>(EVENT_ID0);  // scalar writes to UB before MTE3 reads them
          WaitFlag<HardEvent::S_MTE3>(EVENT_ID0);
          dotQue_.EnQue(dotLocal);
          dotLocal = dotQue_.template DeQue<float>();
          CopyRowOut(dotGm_[chunkStart], dotLocal, n);
          dotQue_.FreeTensor(dotLocal);
          chunkStart = r + 1;
          if (r + 1 < count_) dotLocal = dotQue_.template AllocTensor<float>();
        }
      }
    }
  }

 private:
  // One H-tile of a row that some slot maps to: y = cast(w * g), returns <x, g> of the tile.
  __aicore__ inline float RowTile(int64_t tok, int64_t r, int64_t col0, uint32_t cols, float w, const LocalTensor<TX>& y) {
    LocalTensor<TG> g = gQue_.template AllocTensor<TG>();
    CopyRowIn(g, gradGm_[tok * t_.hidden + col0], cols);
    gQue_.EnQue(g);
    g = gQue_.template DeQue<TG>();
    LocalTensor<float> gf;
    if constexpr (kIsF32<TG>) {
      gf = g;
    } else {
      gf = gCastBuf_.template Get<float>();
      Cast(gf, g, RoundMode::CAST_NONE, cols);
    }
    float dot = 0.0f;
    if (t_.withProbs) {
      LocalTensor<TX> x = xQue_.template AllocTensor<TX>();
      CopyRowIn(x, permGm_[r * t_.hidden + col0], cols);
      xQue_.EnQue(x);
      x = xQue_.template DeQue<TX>();
      LocalTensor<float> xf;
      if constexpr (kIsF32<TX>) {
        xf = x;
      } else {
        xf = xCastBuf_.template Get<float>();
        Cast(xf, x, RoundMode::CAST_NONE, cols);
      }
      LocalTensor<float> prod = prodBuf_.template Get<float>();
      LocalTensor<float> red = redBuf_.template Get<float>();
      Mul(prod, xf, gf, static_cast<int32_t>(cols));
      ReduceSum(red, prod, workBuf_.template Get<float>(), static_cast<int32_t>(cols));
      SetFlag<HardEvent::V_S>(EVENT_ID0);  // the scalar unit reads the vector result
      WaitFlag<HardEvent::V_S>(EVENT_ID0);
      dot = red.GetValue(0);
      xQue_.FreeTensor(x);
    }
    if constexpr (kIsF32<TX>) {
      Muls(y, gf, w, static_cast<int32_t>(cols));
    } else {
      LocalTensor<float> scaled = scaledBuf_.template Get<float>();
      Muls(scaled, gf, w, static_cast<int32_t>(cols));
      Cast(y, scaled, RoundMode::CAST_RINT, cols);
    }
    gQue_.FreeTensor(g);
    return dot;
  }

  MoeUnpermuteGradTiling t_;
  int64_t first_ = 0, count_ = 0;
  GlobalTensor<TG> gradGm_;
  GlobalTensor<TX> permGm_, outGm_;
  GlobalTensor<int32_t> slotGm_;
  GlobalTensor<float> probsGm_, dotGm_;
  TQue<TPosition::VECIN, kDoubleBuffer> gQue_, xQue_;
  TQue<TPosition::VECOUT, kDoubleBuffer> outQue_;
  TQue<TPosition::VECOUT, 1> dotQue_;
  TBuf<TPosition::VECCALC> scaledBuf_, gCastBuf_, xCastBuf_, prodBuf_, workBuf_, redBuf_;
};

template <typename T>
__aicore__ inline void RunUnpermute(GM_ADDR permuted, GM_ADDR rowMap, GM_ADDR probs, GM_ADDR out,
                                    const MoeUnpermuteTiling& t, TPipe* pipe) {
  MoeUnpermuteKernel<T> op;
  op.Init(permuted, rowMap, probs, out, t, pipe);
  op.Process();
}

template <typename TX, typename TG>
__aicore__ inline void RunGrad(GM_ADDR gradOut, GM_ADDR permuted, GM_ADDR slotOfRow, GM_ADDR probs, GM_ADDR gradPermuted,
                               GM_ADDR dots, const MoeUnpermuteGradTiling& t, TPipe* pipe) {
  MoeUnpermuteGradKernel<TX, TG> op;
  op.Init(gradOut, permuted, slotOfRow, probs, gradPermuted, dots, t, pipe);
  op.Process();
}

}  // namespace kernels
}  // namespace amo_ascend

// permuted [N, H], row_map [T, S] int32, probs [T, S] fp32 (ignored without probs), out [T, H].
extern "C" __global__ __aicore__ void amo_moe_unpermute(GM_ADDR permuted, GM_ADDR rowMap, GM_ADDR probs, GM_ADDR out,
                                                         GM_ADDR tiling) {
  KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_AIV_ONLY);
  using namespace amo_ascend;
  MoeUnpermuteTiling t;
  kernels::CopyTiling(&t, tiling);
  TPipe pipe;
  switch (t.key) {
    case MoeUnpermuteTilingKey::kF32: kernels::RunUnpermute<float>(permuted, rowMap, probs, out, t, &pipe); break;
    case MoeUnpermuteTilingKey::kF16: kernels::RunUnpermute<half>(permuted, rowMap, probs, out, t, &pipe); break;
    case MoeUnpermuteTilingKey::kBF16: kernels::RunUnpermute<bfloat16_t>(permuted, rowMap, probs, out, t, &pipe); break;
    default: break;
  }
}

// grad_out [T, H] (TX or fp32), permuted [N, H] (read only with probs), slot_of_row [N] int32,
// probs [T, S] fp32, grad_permuted [N, H], dots [N] fp32 (written only with probs).
extern "C" __global__ __aicore__ void amo_moe_unpermute_grad(GM_ADDR gradOut, GM_ADDR permuted, GM_ADDR slotOfRow,
                                                              GM_ADDR probs, GM_ADDR gradPermuted, GM_ADDR dots,
                                                              GM_ADDR tiling) {
  KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_AIV_ONLY);
  using namespace amo_ascend;
  MoeUnpermuteGradTiling t;
  kernels::CopyTiling(&t, tiling);
  TPipe pipe;
  const bool gF32 = t.gDtype == DType::kF32;
  switch (t.key) {
    case MoeUnpermuteTilingKey::kF32:
      kernels::RunGrad<float, float>(gradOut, permuted, slotOfRow, probs, gradPermuted, dots, t, &pipe);
      break;
    case MoeUnpermuteTilingKey::kF16:
      if (gF32) kernels::RunGrad<half, float>(gradOut, permuted, slotOfRow, probs, gradPermuted, dots, t, &pipe);
      else kernels::RunGrad<half, half>(gradOut, permuted, slotOfRow, probs, gradPermuted, dots, t, &pipe);
      break;
    case MoeUnpermuteTilingKey::kBF16:
      if (gF32) kernels::RunGrad<bfloat16_t, float>(gradOut, permuted, slotOfRow, probs, gradPermuted, dots, t, &pipe);
      else kernels::RunGrad<bfloat16_t, bfloat16_t>(gradOut, permuted, slotOfRow, probs, gradPermuted, dots, t, &pipe);
      break;
    default: break;
  }
}
