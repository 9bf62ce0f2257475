// AscendC Cube kernels of grouped_gemm (forward, both weight layouts) and of its weight gradient
// grouped_gemm_dw. AIC-only kernels: GM -> L1 (ND2NZ DataCopy) -> L0A/L0B (LoadData) -> Mmad into
// L0C (fp32) -> Fixpipe to GM with the cast to fp16/bf16 (NZ2ND on the way out).
//
// Work items are output tiles of (baseM * mPair) x baseN (csrc/ascend/tiling/grouped_gemm_tiling.h):
// item t runs on core t % blockDim. With mPair 2 (long reductions) an item is two M sub-tiles that
// share each B chunk loaded to L1, each accumulating in its own L0C tile; with mPair 1 (short ones)
// the two L0C buffers alternate between items, so a tile's Fixpipe overlaps the next tile's Mmads. The group sizes stay on the device: every core reads them from GM and
// walks the groups itself, so the host never synchronizes.
//   forward: items (group e, M-tile of e's rows, N-tile) for the non-empty groups in order, then zero
//            items covering rows [sum(group_sizes), M) (written with zeros, so the output needs no
//            memset and rows past the groups are exactly 0);
//   dW:      items (group e, K-tile, N-tile) for every group; an empty group gives exact zeros.
// The reduction runs in L1 chunks of baseK * stepK and L0 steps of baseK. Padding of a partial K
// fractal is zero-filled in L1 (InitConstValue) before the ragged copy, so stale L1 contents never
// reach the sum; partial M/N fractals only feed output rows/columns that Fixpipe does not store.
// Zero tiles are Mmad of zero-filled L0A/L0B fractals (a Cube-only core has no vector unit to
// fill GM).
#include "kernels/kernel_common.h"
#include "tiling/grouped_gemm_tiling.h"

using namespace AscendC;

namespace amo_ascend {
namespace kernels {

template <typename T>
class GroupedGemmKernel {
 public:
  // Forward: a = x [M, K], b = weight, out [M, N]. dW: a [M, K], b [M, N], out [E, K, N].
  __aicore__ inline void Init(GM_ADDR a, GM_ADDR b, GM_ADDR groupSizes, GM_ADDR out, const GroupedGemmTiling& t,
                              TPipe* pipe) {
    t_ = t;
    const bool dw = t.layout == GroupedGemmLayout::kDW;
    aGm_.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(a), static_cast<uint64_t>(t.M * t.K));
    bGm_.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(b), static_cast<uint64_t>(dw ? t.M * t.N : t.E * t.K * t.N));
    gsGm_.SetGlobalBuffer(reinterpret_cast<__gm__ int64_t*>(groupSizes), static_cast<uint64_t>(t.E));
    outGm_.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(out), static_cast<uint64_t>(dw ? t.E * t.K * t.N : t.M * t.N));
    const uint32_t kL1 = t.baseK * t.stepK;
    pipe->InitBuffer(l1A_, t.l1Buffers, t.baseM * t.mPair * kL1 * sizeof(T));  // mPair M sub-tiles
    pipe->InitBuffer(l1B_, t.l1Buffers, kL1 * t.baseN * sizeof(T));
    pipe->InitBuffer(l0A_, t.l0Buffers, t.baseM * t.baseK * sizeof(T));
    pipe->InitBuffer(l0B_, t.l0Buffers, t.baseK * t.baseN * sizeof(T));
    pipe->InitBuffer(l0C_, t.l0cBuffers, t.baseM * t.baseN * sizeof(float));
  }

  __aicore__ inline void Process() {
    const int64_t cores = t_.blockDim, core = GetBlockIdx();
    const int64_t nTiles = CeilDiv(t_.N, t_.baseN);
    const int64_t span = static_cast<int64_t>(t_.baseM) * t_.mPair;  // output rows of one item
    int64_t item = 0, off = 0;
    if (t_.layout == GroupedGemmLayout::kDW) {
      const int64_t mTiles = CeilDiv(t_.K, span);
      for (int64_t e = 0; e < t_.E; ++e) {
        const int64_t g = GroupRows(e, off);
        const int64_t tiles = mTiles * nTiles;
        for (int64_t j = FirstLocal(item, core, cores); j < tiles; j += cores) {
          const int64_t i = j / nTiles, jn = j % nTiles;
          Tile(e, off, i * span, Min64(span, t_.K - i * span), jn * t_.baseN,
               Min64(t_.baseN, t_.N - jn * t_.baseN), g);
        }
        item += tiles;
        off += g;
      }
      return;
    }
    for (int64_t e = 0; e < t_.E; ++e) {
      const int64_t g = GroupRows(e, off);
      const int64_t tiles = CeilDiv(g, span) * nTiles;
      for (int64_t j = FirstLocal(item, core, cores); j < tiles; j += cores) {
        const int64_t i = j / nTiles, jn = j % nTiles;
        Tile(e, off, off + i * span, Min64(span, g - i * span), jn * t_.baseN,
             Min64(t_.baseN, t_.N - jn * t_.baseN), t_.K);
      }
      item += tiles;
      off += g;
    }
    const int64_t tiles = CeilDiv(t_.M - off, span) * nTiles;  // zero rows past the groups
    for (int64_t j = FirstLocal(item, core, cores); j < tiles; j += cores) {
      const int64_t i = j / nTiles, jn = j % nTiles;
      Tile(-1, off, off + i * span, Min64(span, t_.M - off - i * span), jn * t_.baseN,
           Min64(t_.baseN, t_.N - jn * t_.baseN), 0);
    }
  }

 private:
  // Rows of group e, clamped to the rows left (the op checks sizes; the kernel never reads past M).
  __aicore__ inline int64_t GroupRows(int64_t e, int64_t off) {
    int64_t g = ReadGmFresh(gsGm_, e);  // written by the host / an earlier kernel
    if (g < 0) g = 0;
    return Min64(g, t_.M - off);
  }
  // First index j >= 0 with (item + j) % cores == core.
  __aicore__ inline int64_t FirstLocal(int64_t item, int64_t core, int64_t cores) {
    return ((core - item % cores) % cores + cores) % cores;
  }

  // One work item: rows [row0, row0 + rows) x columns [col0, col0 + cols) of the output (dW: of
  // out[e]); the reduction runs over kRed (forward: K; dW: the group's rows starting at groupOff).
  // rows <= baseM * mPair: with mPair 2 the item is two M sub-tiles of baseM rows sharing each B
  // chunk in L1 (loaded once for both), each accumulating in its own L0C tile.
  __aicore__ inline void Tile(int64_t e, int64_t groupOff, int64_t row0, int64_t rows, int64_t col0, int64_t cols,
                              int64_t kRed) {
    const int64_t subs = CeilDiv(rows, static_cast<int64_t>(t_.baseM));
    LocalTensor<float> c[2];
    for (int64_t q = 0; q < subs; ++q) c[q] = l0C_.template AllocTensor<float>();
    const uint32_t mp = Up16(rows), np = Up16(cols);
    if (kRed == 0) {
      for (int64_t q = 0; q < subs; ++q) ZeroTile(c[q], SubRows(rows, q), cols);
    } else {
      const int64_t kL1 = static_cast<int64_t>(t_.baseK) * t_.stepK;
      for (int64_t k0 = 0; k0 < kRed; k0 += kL1) {
        const int64_t kc = Min64(kL1, kRed - k0);
        const uint32_t kp = Up16(kc);
        LocalTensor<T> a1 = l1A_.template AllocTensor<T>();
        LocalTensor<T> b1 = l1B_.template AllocTensor<T>();
        CopyA(a1, e, groupOff, row0, rows, k0, kc, mp, kp);
        CopyB(b1, e, groupOff, col0, cols, k0, kc, np, kp);
        l1A_.EnQue(a1);
        l1B_.EnQue(b1);
        a1 = l1A_.template DeQue<T>();
        b1 = l1B_.template DeQue<T>();
        for (int64_t s0 = 0; s0 < kc; s0 += t_.baseK) {
          const int64_t ks = Min64(t_.baseK, kc - s0);
          LocalTensor<T> b0 = l0B_.template AllocTensor<T>();
          LoadB(b0, b1, np, kp, static_cast<uint32_t>(s0), Up16(ks));
          l0B_.EnQue(b0);
          b0 = l0B_.template DeQue<T>();
          for (int64_t q = 0; q < subs; ++q) {
            const int64_t sr = SubRows(rows, q);
            const uint32_t mf0 = static_cast<uint32_t>(q * t_.baseM / 16);
            LocalTensor<T> a0 = l0A_.template AllocTensor<T>();
            LoadA(a0, a1, mp, kp, static_cast<uint32_t>(s0), Up16(ks), mf0, Up16(sr) / 16);
            l0A_.EnQue(a0);
            a0 = l0A_.template DeQue<T>();
            MmadParams mm;
            mm.m = MmadM(sr);  // never 1: A2 would run GEMV on the zZ tile
            mm.n = static_cast<uint16_t>(cols);
            mm.k = static_cast<uint16_t>(ks);
            mm.cmatrixInitVal = k0 == 0 && s0 == 0;
            // A2: an Mmad accumulating onto the previous one's small L0C tile must wait for it
            if (!mm.cmatrixInitVal && (Up16(sr) / 16) * (np / 16) < 10) PipeBarrier<PIPE_M>();
            Mmad(c[q], a0, b0, mm);
            l0A_.FreeTensor(a0);
          }
          l0B_.FreeTensor(b0);
        }
        l1A_.FreeTensor(a1);
        l1B_.FreeTensor(b1);
      }
    }
    for (int64_t q = 0; q < subs; ++q) l0C_.EnQue(c[q]);
    for (int64_t q = 0; q < subs; ++q) {
      LocalTensor<float> cq = l0C_.template DeQue<float>();
      const int64_t sr = SubRows(rows, q);
      FixpipeParamsV220 fp;
      fp.nSize = static_cast<uint16_t>(cols);
      fp.mSize = static_cast<uint16_t>(sr);
      fp.srcStride = static_cast<uint16_t>(Up16(sr));
      fp.dstStride = static_cast<uint32_t>(t_.N);
      fp.quantPre = IsSame<T, half>::value ? QuantMode_t::F322F16 : QuantMode_t::F322BF16;
      const int64_t base = t_.layout == GroupedGemmLayout::kDW ? e * t_.K * t_.N : 0;
      Fixpipe(outGm_[base + (row0 + q * t_.baseM) * t_.N + col0], cq, fp);
      l0C_.FreeTensor(cq);
    }
  }

  // Rows of M sub-tile q (of baseM rows) of an item of `rows` rows.
  __aicore__ inline int64_t SubRows(int64_t rows, int64_t q) {
    return Min64(static_cast<int64_t>(t_.baseM), rows - q * static_cast<int64_t>(t_.baseM));
  }

  // C = 0 for a rows x cols tile: one Mmad step over a zero K fractal.
  __aicore__ inline void ZeroTile(const LocalTensor<float>& c, int64_t rows, int64_t cols) {
    LocalTensor<T> a0 = l0A_.template AllocTensor<T>();
    LocalTensor<T> b0 = l0B_.template AllocTensor<T>();
    ZeroCubeBuffer<TPosition::A2>(a0, Up16(rows) * 16);  // whole 512-byte fractals on L0
    ZeroCubeBuffer<TPosition::B2>(b0, 16 * Up16(cols));
    l0A_.EnQue(a0);  // the L0 fills run on MTE1: the queues hand them to the Mmad (M)
    l0B_.EnQue(b0);
    a0 = l0A_.template DeQue<T>();
    b0 = l0B_.template DeQue<T>();
    MmadParams mm;
    mm.m = MmadM(rows);
    mm.n = static_cast<uint16_t>(cols);
    mm.k = 16;
    mm.cmatrixInitVal = true;
    Mmad(c, a0, b0, mm);
    l0A_.FreeTensor(a0);
    l0B_.FreeTensor(b0);
  }


  // L1 A chunk (m = rows, k = kc), NZ. Forward: x rows, layout (m rows, k cols), c0Stride mp.
  // dW: a_e^T, stored as (k rows, m cols) of `a`, c0Stride kp (transposed when loaded to L0A).
  __aicore__ inline void CopyA(const LocalTensor<T>& a1, int64_t e, int64_t groupOff, int64_t row0, int64_t rows,
                               int64_t k0, int64_t kc, uint32_t mp, uint32_t kp) {
    if (kc % 16) {  // K padding must be zero: the Cube sums whole K fractals
      ZeroCubeBuffer<TPosition::A1>(a1, mp * kp);
      PipeBarrier<PIPE_MTE2>();  // the L1 fill and the ND2NZ copy both write L1 on MTE2
    }
    if (t_.layout == GroupedGemmLayout::kDW) {
      Nd2Nz(a1, aGm_[(groupOff + k0) * t_.K + row0], kc, rows, t_.K, kp);
    } else {
      Nd2Nz(a1, aGm_[row0 * t_.K + k0], rows, kc, t_.K, mp);
    }
  }

  // L1 B chunk (k = kc, n = cols). NN and dW: (k rows, n cols), c0Stride kp. NT: weight[e] is
  // [N, K]: (n rows, k cols), c0Stride np.
  __aicore__ inline void CopyB(const LocalTensor<T>& b1, int64_t e, int64_t groupOff, int64_t col0, int64_t cols,
                               int64_t k0, int64_t kc, uint32_t np, uint32_t kp) {
    if (kc % 16) {
      ZeroCubeBuffer<TPosition::B1>(b1, np * kp);
      PipeBarrier<PIPE_MTE2>();
    }
    if (t_.layout == GroupedGemmLayout::kNT) {
      Nd2Nz(b1, bGm_[e * t_.N * t_.K + col0 * t_.K + k0], cols, kc, t_.K, np);
    } else if (t_.layout == GroupedGemmLayout::kNN) {
      Nd2Nz(b1, bGm_[e * t_.K * t_.N + k0 * t_.N + col0], kc, cols, t_.N, kp);
    } else {
      Nd2Nz(b1, bGm_[(groupOff + k0) * t_.N + col0], kc, cols, t_.N, kp);
    }
  }

  // L0A (zZ: fractal grid row-major over (m, k), fractals row-major) from the L1 chunk: M fractal
  // rows [mf0, mf0 + mfn) of the chunk's mp / 16, K fractals [s0, s0 + ksp) / 16.
  __aicore__ inline void LoadA(const LocalTensor<T>& a0, const LocalTensor<T>& a1, uint32_t mp, uint32_t kp, uint32_t s0,
                               uint32_t ksp, uint32_t mf0, uint32_t mfn) {
    const uint32_t kf = ksp / 16;
    for (uint32_t mf = 0; mf < mfn; ++mf) {
      LoadData2DParams p;
      p.repeatTimes = static_cast<uint8_t>(kf);
      p.dstGap = 0;
      if (t_.layout == GroupedGemmLayout::kDW) {  // L1 holds (k, m) fractals, column block = m
        p.startIndex = static_cast<uint16_t>((mf0 + mf) * (kp / 16) + s0 / 16);
        p.srcStride = 1;
        p.ifTranspose = true;
      } else {  // L1 holds (m, k) fractals, column block = k
        p.startIndex = static_cast<uint16_t>((s0 / 16) * (mp / 16) + mf0 + mf);
        p.srcStride = static_cast<uint16_t>(mp / 16);
        p.ifTranspose = false;
      }
      LoadData(a0[mf * kf * 256], a1, p);
    }
  }

  // L0B (zN: fractal grid row-major over (k, n), each fractal stored n-major) from the L1 chunk.
  __aicore__ inline void LoadB(const LocalTensor<T>& b0, const LocalTensor<T>& b1, uint32_t np, uint32_t kp, uint32_t s0,
                               uint32_t ksp) {
    const uint32_t nf = np / 16;
    for (uint32_t kf = 0; kf < ksp / 16; ++kf) {
      LoadData2DParams p;
      p.repeatTimes = static_cast<uint8_t>(nf);
      p.dstGap = 0;
      if (t_.layout == GroupedGemmLayout::kNT) {  // L1 holds (n, k) fractals: already n-major
        p.startIndex = static_cast<uint16_t>((s0 / 16 + kf) * (np / 16));
        p.srcStride = 1;
        p.ifTranspose = false;
      } else {  // L1 holds (k, n) fractals: transpose each
        p.startIndex = static_cast<uint16_t>(s0 / 16 + kf);
        p.srcStride = static_cast<uint16_t>(kp / 16);
        p.ifTranspose = true;
      }
      LoadData(b0[kf * nf * 256], b1, p);
    }
  }

  GroupedGemmTiling t_;
  GlobalTensor<T> aGm_, bGm_, outGm_;
  GlobalTensor<int64_t> gsGm_;
  TQue<TPosition::A1, kDoubleBuffer> l1A_;
  TQue<TPosition::B1, kDoubleBuffer> l1B_;
  TQue<TPosition::A2, kDoubleBuffer> l0A_;
  TQue<TPosition::B2, kDoubleBuffer> l0B_;
  TQue<TPosition::CO1, kDoubleBuffer> l0C_;  // l0cBuffers (1 or 2) deep
};

template <typename T>
__aicore__ inline void RunGroupedGemm(GM_ADDR a, GM_ADDR b, GM_ADDR groupSizes, GM_ADDR out, const GroupedGemmTiling& t) {
  TPipe pipe;
  GroupedGemmKernel<T> op;
  op.Init(a, b, groupSizes, out, t, &pipe);
  op.Process();
}

}  // namespace kernels
}  // namespace amo_ascend

// Forward: x [M, K], weight [E, K, N] (tiling layout kNN) or [E, N, K] (kNT), group_sizes [E] int64,
// out [M, N]; tiling: GroupedGemmTiling in GM.
extern "C" __global__ __aicore__ void amo_grouped_gemm(GM_ADDR x, GM_ADDR weight, GM_ADDR groupSizes, GM_ADDR out,
                                                      GM_ADDR tiling) {
  KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_AIC_ONLY);
  using namespace amo_ascend;
  GroupedGemmTiling t;
  kernels::CopyTiling(&t, tiling);
  if (t.key == GroupedGemmTilingKey::kF16) kernels::RunGroupedGemm<half>(x, weight, groupSizes, out, t);
  else if (t.key == GroupedGemmTilingKey::kBF16) kernels::RunGroupedGemm<bfloat16_t>(x, weight, groupSizes, out, t);
}

// Weight gradient: a [M, K], b [M, N], group_sizes [E] int64, out [E, K, N] (tiling layout kDW).
extern "C" __global__ __aicore__ void amo_grouped_gemm_dw(GM_ADDR a, GM_ADDR b, GM_ADDR groupSizes, GM_ADDR out,
                                                         GM_ADDR tiling) {
  KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_AIC_ONLY);
  using namespace amo_ascend;
  GroupedGemmTiling t;
  kernels::CopyTiling(&t, tiling);
  if (t.key == GroupedGemmTilingKey::kF16) kernels::RunGroupedGemm<half>(a, b, groupSizes, out, t);
  else if (t.key == GroupedGemmTilingKey::kBF16) kernels::RunGroupedGemm<bfloat16_t>(a, b, groupSizes, out, t);
}
