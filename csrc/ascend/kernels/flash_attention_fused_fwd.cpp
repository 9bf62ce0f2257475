// AscendC flash attention: the fused forward, one mixed launch (MIX_AIC_1_2).
// One kernel type per source file (see kernels/flash_attention_common.h for the layout and the math).
// Nothing here has been compiled with bisheng or run on an NPU (see docs/ascend.md).
#include "kernels/flash_attention_common.h"

using namespace AscendC;

namespace amo_ascend {
namespace kernels {

// ==== Fused forward: ONE mixed launch (KERNEL_TYPE_MIX_AIC_1_2) ========================================
// The same math as the four phase kernels, in one kernel: per AI Core (one AIC + its two AIVs) the
// items t with t % groups == group, and per item the key blocks j, PIPELINED over two GM slots per
// workspace (slot j % 2) so the Cube and the vector units overlap:
//   AIC : S_0 -> slot; then for each j: S_{j+1} -> slot (lookahead, flag S[(j+1)%2]); wait P[j%2]
//         (both AIVs); O_part_j = P_j V_j -> slot; flag O[j%2].
//   AIVs: for each j: wait S[j%2]; online softmax of its half of the rows (m, l and alpha_j in UB);
//         P_j -> slot; flag P[j%2]; then wait O[(j-1)%2] and O = alpha_{j-1} O + O_part_{j-1} (O in
//         UB); after the last block the final update, out = O / l and lse = m + ln(l).
// So the AIVs' softmax of block j runs while the AIC computes S_{j+1}, and their update of block j-1
// while it computes P_j V_j. Slot hazards: S slot (j+1)%2 is rewritten after the AIC waited P_{j-1}
// (its readers are done); P slot j%2 after the AIVs' update j-2 (which waited O_{j-2}, set after the
// AIC read P_{j-2}); O slot j%2 after the AIC waited P_j (set after the AIVs' update j-2 read it).
// Same arithmetic, same order per row as the phase kernels (bitwise equal on the emulator, tested
// under both of its schedules). Never compiled with bisheng nor run on an NPU (docs/ascend.md).
constexpr uint16_t kFaFlagS = 0, kFaFlagP = 2, kFaFlagO = 4;  // + slot (0 / 1)

template <typename T>
class FaFused {
 public:
  __aicore__ inline void Run(const FaGm& g, const FlashAttentionTiling& t) {
    t_ = t;
    dva_ = Up8(t.Dv);
    aic_ = g_coreType == AIC;
    const int64_t ratio = GetTaskRatio();
    group_ = GetBlockIdx() / ratio;
    sub_ = static_cast<uint32_t>(GetBlockIdx() % ratio);
    FaSetCu(cu_, cuK_, g, t);
    score_ = static_cast<uint64_t>(t.baseM) * t.baseN;
    rowsSlot_ = static_cast<uint64_t>(t.baseM) * dva_;
    s_.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(g.s) + group_ * 2 * score_, 2 * score_);
    p_.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(g.p) + group_ * 2 * score_, 2 * score_);
    o_.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(g.oPart) + group_ * 2 * rowsSlot_, 2 * rowsSlot_);
    TPipe pipe;
    if (aic_) {
      const int64_t dq = t.Dk + t.Dr;
      cube_.Init(t, &pipe);
      q_.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(g.q), static_cast<uint64_t>(t.T * t.H * dq));
      k_.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(g.k), static_cast<uint64_t>(t.Tk * t.H * t.Dk));
      v_.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(g.v), static_cast<uint64_t>(t.Tk * t.H * t.Dv));
      if (t.Dr) kr_.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(g.kRope), static_cast<uint64_t>(t.Tk * t.Dr));
    } else {
      const uint32_t r8 = Up8(t.vecRows);
      rows_.Init(pipe, t, true, true);
      pipe.InitBuffer(oAcc_, t.vecRows * dva_ * sizeof(float));
      pipe.InitBuffer(pv_, dva_ * sizeof(float));
      pipe.InitBuffer(state_, 4 * r8 * sizeof(float));  // m, l, alpha of the two blocks in flight
      out_.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(g.out), static_cast<uint64_t>(t.T * t.H * t.Dv));
      lse_.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(g.lse), static_cast<uint64_t>(t.H * t.T));
    }
    FaWalkOn(t, cu_, cuK_, group_, GetBlockNum(), 1, *this);
  }

  __aicore__ inline void Item(const FaItem& it, uint32_t) {
    if (aic_) CubeItem(it);
    else VecItem(it);
  }

 private:
  __aicore__ inline void CubeItem(const FaItem& it) {
    if (it.keyBlocks == 0) return;  // the item sees no key: the AIVs write out 0 / lse -inf, no hand-off
    const int64_t qRow = it.seqStart + it.qPos0;
    ScoresBlock(it, qRow, 0);
    for (int64_t j = 0; j < it.keyBlocks; ++j) {
      if (j + 1 < it.keyBlocks) ScoresBlock(it, qRow, j + 1);  // lookahead: overlaps the softmax of j
      const int64_t slot = j % 2, k0 = j * t_.baseN, cols = Min64(t_.baseN, it.kvLen - k0), kRow = it.kvStart + k0;
      CrossCoreWaitFlag(kFaFlagP + slot);
      LocalTensor<float> c = cube_.l0C_.template AllocTensor<float>();
      cube_.MatMul(c, p_[slot * score_], t_.baseN, v_[(kRow * t_.H + it.head) * t_.Dv], t_.H * t_.Dv, false, it.rows,
                   t_.Dv, cols, true);
      cube_.Store(o_[slot * rowsSlot_], c, it.rows, t_.Dv, dva_);
      CrossCoreSetFlag<2, PIPE_FIX>(kFaFlagO + slot);
    }
  }

  __aicore__ inline void ScoresBlock(const FaItem& it, int64_t qRow, int64_t j) {
    const int64_t slot = j % 2, k0 = j * t_.baseN, cols = Min64(t_.baseN, it.kvLen - k0);
    LocalTensor<float> c = cube_.l0C_.template AllocTensor<float>();
    cube_.Scores(c, t_, q_, k_, kr_, qRow, it.kvStart + k0, it.head, it.rows, cols);
    cube_.Store(s_[slot * score_], c, it.rows, cols, t_.baseN);
    CrossCoreSetFlag<2, PIPE_FIX>(kFaFlagS + slot);
  }

  __aicore__ inline void VecItem(const FaItem& it) {
    // both AIVs take part in every flag exchange, also one whose half of the rows is empty
    const int64_t r0 = sub_ * t_.vecRows, r1 = Min64(it.rows, r0 + t_.vecRows);
    if (it.keyBlocks == 0) {  // the item sees no key (no flags: the AIC skips it too)
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t tok = it.seqStart + it.qPos0 + r;
        rows_.EmptyRow(out_[(tok * t_.H + it.head) * t_.Dv], lse_, it.head * t_.T + tok);
      }
      return;
    }
    const uint32_t r8 = Up8(t_.vecRows);
    LocalTensor<float> st = state_.Get<float>();
    LocalTensor<float> m = st, l = st[r8];
    for (int64_t j = 0; j < it.keyBlocks; ++j) {
      const int64_t slot = j % 2, k0 = j * t_.baseN, cols = Min64(t_.baseN, it.kvLen - k0);
      CrossCoreWaitFlag(kFaFlagS + slot);
      for (int64_t r = r0; r < r1; ++r) SoftmaxRow(it, r, r - r0, j, k0, cols, m, l, st[(2 + slot) * r8]);
      CrossCoreSetFlag<2, PIPE_MTE3>(kFaFlagP + slot);
      if (j > 0) UpdateBlock(it, j - 1, r0, r1, m, l);  // overlaps the AIC's P_j V_j
    }
    UpdateBlock(it, it.keyBlocks - 1, r0, r1, m, l);
  }

  __aicore__ inline void UpdateBlock(const FaItem& it, int64_t j, int64_t r0, int64_t r1, const LocalTensor<float>& m,
                                     const LocalTensor<float>& l) {
    const int64_t slot = j % 2;
    const uint32_t r8 = Up8(t_.vecRows);
    CrossCoreWaitFlag(kFaFlagO + slot);
    LocalTensor<float> alpha = state_.Get<float>()[(2 + slot) * r8];
    for (int64_t r = r0; r < r1; ++r) UpdateRow(it, r, r - r0, j, j + 1 == it.keyBlocks, m, l, alpha);
  }

  __aicore__ inline void SoftmaxRow(const FaItem& it, int64_t r, int64_t u, int64_t j, int64_t k0, int64_t cols,
                                    const LocalTensor<float>& m, const LocalTensor<float>& l,
                                    const LocalTensor<float>& alpha) {
    FaRowState old{0.0f, 0.0f, 0.0f};
    if (j != 0) {
      old.m = m.GetValue(u);
      old.l = l.GetValue(u);
    }
    const int64_t row = (j % 2) * score_ + r * t_.baseN;
    const FaRowState st = rows_.SoftmaxRow(s_[row], p_[row], it.qPos0 + r + it.off, k0, cols, j == 0, old);
    m.SetValue(u, st.m);
    l.SetValue(u, st.l);
    alpha.SetValue(u, st.alpha);
  }

  __aicore__ inline void UpdateRow(const FaItem& it, int64_t r, int64_t u, int64_t j, bool last,
                                   const LocalTensor<float>& m, const LocalTensor<float>& l,
                                   const LocalTensor<float>& alpha) {
    LocalTensor<float> o = oAcc_.Get<float>()[u * dva_], pv = pv_.Get<float>();
    const int32_t dva = static_cast<int32_t>(dva_);
    const GlobalTensor<float> part = o_[(j % 2) * rowsSlot_ + r * dva_];
    SetFlag<HardEvent::V_MTE2>(EVENT_ID0);  // o / pv are reloaded: earlier vector reads of them are done
    WaitFlag<HardEvent::V_MTE2>(EVENT_ID0);
    if (j == 0) {
      DataCopy(o, part, dva_);
      SetFlag<HardEvent::MTE2_V>(EVENT_ID0);
      WaitFlag<HardEvent::MTE2_V>(EVENT_ID0);
    } else {
      DataCopy(pv, part, dva_);
      SetFlag<HardEvent::MTE2_V>(EVENT_ID0);
      WaitFlag<HardEvent::MTE2_V>(EVENT_ID0);
      Muls(o, o, alpha.GetValue(u), dva);
      Add(o, o, pv, dva);
    }
    if (!last) return;
    const int64_t tok = it.seqStart + it.qPos0 + r;
    rows_.FinishRow(o, m.GetValue(u), l.GetValue(u), out_[(tok * t_.H + it.head) * t_.Dv], lse_, it.head * t_.T + tok);
  }

  FlashAttentionTiling t_;
  uint32_t dva_ = 0, sub_ = 0;
  uint64_t score_ = 0, rowsSlot_ = 0;  // elements of one S / P slot and of one O_partial slot
  int64_t group_ = 0;
  bool aic_ = false;
  FaCube<T> cube_;
  FaRows<T> rows_;
  TBuf<TPosition::VECCALC> oAcc_, pv_, state_;
  GlobalTensor<int64_t> cu_, cuK_;
  GlobalTensor<T> q_, k_, v_, kr_, p_, out_;
  GlobalTensor<float> s_, o_, lse_;
};

}  // namespace kernels
}  // namespace amo_ascend

// Fused forward: one mixed launch on blockDim AI Cores (1 AIC + 2 AIVs each), same argument block.
extern "C" __global__ __aicore__ void amo_fa_fused(GM_ADDR gmArgs, GM_ADDR tiling) {
  KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIC_1_2);
  amo_ascend::kernels::FaRun<amo_ascend::kernels::FaFused>(gmArgs, tiling);
}
