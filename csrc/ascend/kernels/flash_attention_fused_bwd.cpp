// AscendC flash attention: the fused backward pass, one mixed launch per pass (MIX_AIC_1_2).
// One kernel type per source file (see kernels/flash_attention_common.h for the layout and the math).
// Nothing here has been compiled with bisheng or run on an NPU (see docs/ascend.md).
#include "kernels/flash_attention_common.h"

using namespace AscendC;

namespace amo_ascend {
namespace kernels {

// ==== Fused backward pass: ONE mixed launch per pass (KERNEL_TYPE_MIX_AIC_1_2) ==========================
// Same arithmetic as the phase kernels. Per AI Core (one AIC + two AIVs) the items with
// item % groups == group, each with its N blocks in step order, PIPELINED over two GM slots (block n
// uses slot n % 2):
//   AIC : S, dP of block 0; then for each n: S, dP of block n+1 (lookahead, flag S[(n+1)%2]); wait
//         P[n%2] (both AIVs); the pass's products of block n -> part slot; flag G[n%2].
//   AIVs: for each n: wait S[n%2]; P and dS of its half of the query rows -> slot; flag P[n%2]; then
//         wait G[(n-1)%2] and add block n-1's products to the running sums of its half of the gradient
//         rows (kept in UB for the whole item); after the last block the rows are written out.
// Slot hazards: the S/dP slot of block n+1 is rewritten after the AIC waited P of block n-1 (its
// readers are done); the P/dS slot of block n after the AIVs waited G of block n-2 (the AIC read it
// before); the part slot of block n after the AIC waited P of block n (set after the AIVs added block
// n-2). No GM running sums and no zeroing, one launch per pass.
constexpr uint16_t kFabFlagS = 3, kFabFlagP = 5, kFabFlagG = 7;  // + slot (0 / 1)

template <typename T>
class FabFused {
 public:
  __aicore__ inline void Run(const FlashAttentionBwdArgs& g, const FlashAttentionTiling& t) {
    t_ = t;
    aic_ = g_coreType == AIC;
    const int64_t ratio = GetTaskRatio();
    group_ = GetBlockIdx() / ratio;
    sub_ = GetBlockIdx() % ratio;
    g_.Set(g, t);
    score_ = static_cast<uint64_t>(t.baseM) * t.baseM;
    const uint64_t rows = static_cast<uint64_t>(t.baseM) * t.gradCols;
    // this AI Core's two slots (the phase kernels' per-item workspaces shrink to 2 slots per AI Core);
    // slot k of S/dP/P/dS starts at k * b * b and its part slot at k * b * gradCols, as FabGradMath expects
    g_.s.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(g.s) + group_ * 2 * score_, 2 * score_);
    g_.dp.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(g.dp) + group_ * 2 * score_, 2 * score_);
    g_.p.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(g.p) + group_ * 2 * score_, 2 * score_);
    g_.ds.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(g.ds) + group_ * 2 * score_, 2 * score_);
    g_.part.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(g.part) + group_ * 2 * rows, 2 * rows);
    TPipe pipe;
    if (aic_) {
      cube_.InitBwd(t, &pipe);
    } else {
      pipe.InitBuffer(accBuf_, t.vecRows * t.gradCols * sizeof(float));
      pipe.InitBuffer(partBuf_, t.gradCols * sizeof(float));
      rows_.Init(pipe, t, &g_, true, true);
    }
    FabWalkItems(t, g_.cu, g_.cuK, group_, GetBlockNum(), *this);
  }

  // An item without blocks (KV pass: no query; Q pass: its rows see no key): the AIVs write its zero
  // gradient rows, with no hand-off (the AIC skips it).
  __aicore__ inline void Empty(const FabItem& it) {
    if (aic_) return;
    const int64_t g0 = sub_ * t_.vecRows, g1 = Min64(rows_.Extent(it), g0 + t_.vecRows);
    rows_.WriteZeroGrads(it, g0, g1, accBuf_.Get<float>());
  }

  __aicore__ inline void Item(int64_t count, const FabNth& nth) {
    if (aic_) {
      ScoresBlock(nth(0), 0);
      for (int64_t n = 0; n < count; ++n) {
        if (n + 1 < count) ScoresBlock(nth(n + 1), (n + 1) % 2);  // overlaps the AIVs' P, dS of block n
        const int64_t slot = n % 2;
        CrossCoreWaitFlag(kFabFlagP + slot);
        grad_.Item(cube_, t_, g_, nth(n), static_cast<int64_t>(slot * score_));
        CrossCoreSetFlag<2, PIPE_FIX>(kFabFlagG + slot);
      }
      return;
    }
    for (int64_t n = 0; n < count; ++n) {
      const FabItem it = nth(n);
      const int64_t slot = n % 2, b = t_.baseM, ws = static_cast<int64_t>(slot * score_);
      const int64_t r0 = sub_ * t_.vecRows, r1 = Min64(it.rows, r0 + t_.vecRows);
      CrossCoreWaitFlag(kFabFlagS + slot);
      for (int64_t r = r0; r < r1; ++r)
        rows_.GradRow(it, r, g_.s[ws + r * b], g_.dp[ws + r * b], g_.p[ws + r * b], g_.ds[ws + r * b]);
      // The set fires after MTE3's earlier work only. When this AIV's half of the block is empty there
      // is no store before it, so MTE3 first waits for MTE2: the flag then also covers the part-slot
      // loads of AccBlock(n - 2), whose slot the AIC overwrites once it has this flag (issue 30).
      SetFlag<HardEvent::MTE2_MTE3>(EVENT_ID1);
      WaitFlag<HardEvent::MTE2_MTE3>(EVENT_ID1);
      CrossCoreSetFlag<2, PIPE_MTE3>(kFabFlagP + slot);
      if (n > 0) AccBlock(nth(n - 1), (n - 1) % 2);  // overlaps the AIC's products of block n
    }
    AccBlock(nth(count - 1), (count - 1) % 2);
  }

 private:
  __aicore__ inline void ScoresBlock(const FabItem& it, int64_t slot) {
    qk_.Item(cube_, t_, g_, it, static_cast<int64_t>(slot * score_));
    CrossCoreSetFlag<2, PIPE_FIX>(kFabFlagS + slot);
  }

  // Running sums of this AIV's half of the gradient rows += the block's products; written out at the
  // item's last block.
  __aicore__ inline void AccBlock(const FabItem& it, int64_t slot) {
    CrossCoreWaitFlag(kFabFlagG + slot);
    const int64_t g0 = sub_ * t_.vecRows, g1 = Min64(rows_.Extent(it), g0 + t_.vecRows);
    const int32_t n = rows_.AccCols();
    const int64_t base = slot * static_cast<int64_t>(t_.baseM) * t_.gradCols;
    LocalTensor<float> part = partBuf_.Get<float>();
    for (int64_t r = g0; r < g1; ++r) {
      LocalTensor<float> acc = accBuf_.Get<float>()[(r - g0) * t_.gradCols];
      SetFlag<HardEvent::V_MTE2>(EVENT_ID0);  // part is reloaded: the previous row's Add / Muls read it
      WaitFlag<HardEvent::V_MTE2>(EVENT_ID0);
      DataCopy(part, g_.part[base + r * t_.gradCols], static_cast<uint32_t>(n));
      SetFlag<HardEvent::MTE2_V>(EVENT_ID0);
      WaitFlag<HardEvent::MTE2_V>(EVENT_ID0);
      if (it.first) Muls(acc, part, 1.0f, n);  // start the running sum (x * 1 is exact)
      else Add(acc, acc, part, n);
      if (it.last) rows_.WriteGrad(it, r, acc);
    }
  }

  FlashAttentionTiling t_;
  bool aic_ = false;
  int64_t group_ = 0, sub_ = 0;
  uint64_t score_ = 0;  // elements of one S / dP / P / dS slot
  FabTensors<T> g_;
  FaCube<T> cube_;
  FabQkMath<T> qk_;
  FabGradMath<T> grad_;
  FabRows<T> rows_;
  TBuf<TPosition::VECCALC> accBuf_, partBuf_;
};

}  // namespace kernels
}  // namespace amo_ascend

// Fused backward pass (pass set by the host): one mixed launch on blockDim AI Cores.
extern "C" __global__ __aicore__ void amo_fab_fused(GM_ADDR gmArgs, GM_ADDR tiling) {
  KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIC_1_2);
  amo_ascend::kernels::FaRun<amo_ascend::kernels::FabFused, amo_ascend::FlashAttentionBwdArgs>(gmArgs, tiling);
}
