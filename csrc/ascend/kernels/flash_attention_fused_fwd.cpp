// AscendC flash attention: the fused forward, one mixed launch (MIX_AIC_1_2).
// One kernel type per source file (see kernels/flash_attention_common.h for the layout and the math).
// Nothing here has been compiled with bisheng or run on an NPU (see docs/ascend.md).
#include "kernels/flash_attention_common.h"

using namespace AscendC;

namespace amo_ascend {
namespace kernels {

// ==== Fused forward: ONE mixed launch (KERNEL_TYPE_MIX_AIC_1_2) ========================================
// The same math as the four phase kernels, in one kernel: per AI Core (one AIC + its two AIVs) the
// items FaDealtCursor deals to it (longest first, balanced over the AI Cores), their key blocks as ONE
// stream g = 0, 1, ... across items (since 2026-12-08; before, each item filled and drained the pipeline
// on its own), PIPELINED over n = kFlashAttentionFusedSlots (4) GM slots per workspace (slot g % n) so
// the Cube and the vector units overlap:
//   AIC : S_0 .. S_{n-2} -> slots; then for each g: S_{g+n-1} -> slot (lookahead, flag S[(g+n-1)%n],
//         also when that block belongs to the next item); wait P[g%n] (both AIVs); O_part_g = P_g V_g
//         -> slot; flag O[g%n].
//   AIVs (a software pipeline, where the UB holds two S and two P tiles: tiling fusedPipe; lag = n - 1,
//         else 1): the S tile of block 0 is loaded; then for each g: wait O[(g-lag)%n] and load
//         O_partial_{g-lag} (it lands while the vector unit works); online softmax of its half of the
//         rows on S tile g % 2 (m, l of the block's item and alpha_g in UB); P_g -> slot; flag P[g%n];
//         wait S[(g+1)%n] and load S_{g+1} into the other tile; O = alpha_{g-lag} O + O_partial_{g-lag}
//         (O in UB); after an item's last block out = O / l and lse = m + ln(l); after the stream's last
//         block the last lag updates.
// So the AIC computes S up to n - 1 blocks ahead, the AIVs' S loads run one block ahead of their
// softmax, and their update of block g-lag uses a P V product the AIC could start lag softmaxes earlier.
// Slot hazards (n slots, lag = n - 1): S slot (g+n-1)%n (block g-1's) is rewritten after the AIC waited
// P_{g-1} (the AIVs loaded S_{g-1} before their softmax g-1); P slot g%n after the AIVs loaded
// O_{g-n} (set after the AIC read P_{g-n}); O slot g%n after the AIC waited P_g (the AIVs' load of
// O_{g-n} precedes, through their update g-n and the softmax g on the vector unit, the P_g store). The
// online-softmax state alpha keeps lag + 1 UB slots, m and l one pair per item in flight (lag + 1).
// Same arithmetic, same order per row as the phase kernels (bitwise equal on the emulator, tested
// under both of its schedules). Never compiled with bisheng nor run on an NPU (docs/ascend.md).
constexpr int64_t kFaSlots = kFlashAttentionFusedSlots;
constexpr int64_t kFaFlagS = 0, kFaFlagP = 1, kFaFlagO = 2;  // hand-off kinds of FaFlag(kind, slot)

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
    s_.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(g.s) + group_ * kFaSlots * score_, kFaSlots * score_);
    p_.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(g.p) + group_ * kFaSlots * score_, kFaSlots * score_);
    o_.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(g.oPart) + group_ * kFaSlots * rowsSlot_, kFaSlots * rowsSlot_);
    TPipe pipe;
    if (aic_) {
      const int64_t dq = t.Dk + t.Dr;
      cube_.Init(t, &pipe);
      cube_.InitQ(t, &pipe);  // the item's Q block stays in L1 across its key blocks
      q_.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(g.q), static_cast<uint64_t>(t.T * t.H * dq));
      k_.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(g.k), static_cast<uint64_t>(t.Tk * t.H * t.Dk));
      v_.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(g.v), static_cast<uint64_t>(t.Tk * t.H * t.Dv));
      if (t.Dr) kr_.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(g.kRope), static_cast<uint64_t>(t.Tk * t.Dr));
    } else {
      const uint32_t r8 = Up8(t.vecRows);
      nbuf_ = (t.fusedPipe & kFaPipeDouble) ? 2 : 1;
      lag_ = nbuf_ == 2 ? kFaSlots - 1 : 1;  // the O update trails the softmax by lag_ blocks (alpha of lag_ + 1 in flight)
      rows_.Init(pipe, t, false, true);  // EmptyRow's buffers (items without keys)
      for (int64_t b = 0; b < nbuf_; ++b) {  // one TBuf per tile (the emulator tracks each buffer's accesses)
        pipe.InitBuffer(sT_[b], t.vecRows * t.baseN * sizeof(float));
        pipe.InitBuffer(pT_[b], t.vecRows * t.baseN * sizeof(T));
      }
      pipe.InitBuffer(oAcc_, t.vecRows * dva_ * sizeof(float));
      pipe.InitBuffer(part_, t.vecRows * dva_ * sizeof(float));
      pipe.InitBuffer(outT_, t.vecRows * OutStride() * sizeof(T));
      pipe.InitBuffer(bcast_, r8 * 8 * sizeof(float));
      // alpha x (lag_ + 1), max, sum, tmp, m_old, 1/l, lse, (m, l) x (lag_ + 1)
      pipe.InitBuffer(state_, (3 * (lag_ + 1) + kScratch) * r8 * sizeof(float));
      out_.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(g.out), static_cast<uint64_t>(t.T * t.H * t.Dv));
      lse_.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(g.lse), static_cast<uint64_t>(t.H * t.T));
    }
    if (aic_) CubeStream();
    else VecStream();
  }

 private:
  // One core's key blocks in stream order: the items FaDealtCursor deals to it (those without a key are
  // skipped), block j of item `it`, k = the item's ordinal among the items with keys.
  struct Blocks {
    FaDealtCursor items;
    FaItem it;
    int64_t j = 0, k = -1;
    bool live = false;
  };
  __aicore__ inline void Start(Blocks& b, bool write) {
    b.items.Init(t_, cu_, cuK_, group_, GetBlockNum());
    Step(b, write);
  }
  // b's next key block (the first of the next item with keys after an item's last); the AIVs write the
  // output of the items without a key met on the way when `write` (out 0, lse -inf)
  __aicore__ inline void Step(Blocks& b, bool write) {
    if (b.live && ++b.j < b.it.keyBlocks) return;
    b.live = false;
    int64_t item = 0, seq = 0, i = 0, h = 0;
    FaSeq sq;
    while (b.items.Next(item, seq, sq, i, h)) {
      b.it = FaMakeItem(t_, sq, item, seq, h, i);
      if (b.it.keyBlocks > 0) {
        b.j = 0;
        ++b.k;
        b.live = true;
        return;
      }
      if (write) EmptyItem(b.it);
    }
  }

  // The AIC's stream: every key block of the core's items as one sequence g = 0, 1, ... (GM slot and
  // flags g % kFaSlots), S_g computed kFaSlots - 1 blocks ahead of P_g V_g ACROSS item boundaries: while
  // the AIVs finish an item's last softmaxes, the AIC already computes the next item's first S blocks
  // (its Q block is loaded into L1 once the last S of the previous item has read the old one).
  __aicore__ inline void CubeStream() {
    Blocks s, p;
    Start(s, false);
    Start(p, false);
    int64_t gs = 0;
    for (; gs < kFaSlots - 1 && s.live; ++gs) {
      ScoresBlock(s.it, s.j, gs);
      Step(s, false);
    }
    for (int64_t g = 0; p.live; ++g) {
      if (s.live) {  // lookahead: overlaps the softmax of g .. g + kFaSlots - 2
        ScoresBlock(s.it, s.j, gs++);
        Step(s, false);
      }
      PvBlock(p.it, p.j, g);
      Step(p, false);
    }
  }

  __aicore__ inline void PvBlock(const FaItem& it, int64_t j, int64_t g) {
    const int64_t slot = g % kFaSlots, k0 = j * t_.baseN, cols = Min64(t_.baseN, it.kvLen - k0), kRow = it.kvStart + k0;
    // V_j does not depend on P_j: its copy runs while the AIC waits for the AIVs' P_j
    cube_.PrefetchB(v_[(kRow * t_.H + it.head) * t_.Dv], t_.H * t_.Dv, t_.Dv, cols);
    CrossCoreWaitFlag(FaFlag(kFaFlagP, slot));
    LocalTensor<float> c = cube_.l0C_.template AllocTensor<float>();
    cube_.MatMul(c, p_[slot * score_], t_.baseN, v_[(kRow * t_.H + it.head) * t_.Dv], t_.H * t_.Dv, false, it.rows,
                 t_.Dv, cols, true, false, true);
    cube_.Store(o_[slot * rowsSlot_], c, it.rows, t_.Dv, dva_);
    CrossCoreSetFlag<2, PIPE_FIX>(FaFlag(kFaFlagO, slot));
  }

  // S of key block j of `it` into slot g % kFaSlots; the item's Q block is loaded with its first block
  // and freed after its last (the L1 queue orders the next item's Q copy after the Mmads that read it).
  __aicore__ inline void ScoresBlock(const FaItem& it, int64_t j, int64_t g) {
    const int64_t slot = g % kFaSlots, k0 = j * t_.baseN, cols = Min64(t_.baseN, it.kvLen - k0);
    if (j == 0) cube_.LoadQ(t_, q_, it.seqStart + it.qPos0, it.head, it.rows);
    LocalTensor<float> c = cube_.l0C_.template AllocTensor<float>();
    cube_.ScoresQ(c, t_, k_, kr_, it.kvStart + k0, it.head, it.rows, cols);
    cube_.Store(s_[slot * score_], c, it.rows, cols, t_.baseN);
    CrossCoreSetFlag<2, PIPE_FIX>(FaFlag(kFaFlagS, slot));
    if (j + 1 == it.keyBlocks) cube_.FreeQ();
  }

  // ---- vector side: tile-wise, this AIV's rows [r0, r1) of the item as one [R x baseN] tile --------
  // Per key block: one DMA of the S tile, the online softmax of all R rows with repeat-form vector
  // instructions (per-row operands laid out one 32-byte block per row by Brcb; row reductions by
  // WholeReduceMax / WholeReduceSum over 64-column chunks; the causal mask written as -inf bits), one
  // DMA of the P tile. The same fp32 operations per element, in the same order, as the phase kernels'
  // SoftmaxRow / UpdateRow / FinishRow (bitwise equal results): masked columns are -inf before the max
  // (so they add exp(-inf) = 0 to a row sum, as ReduceSum's lanes past its count do), Sub(s, m) is
  // Adds(s, -m), and the scalar state update l = l_old * alpha + rowsum is a Mul then an Add.
  __aicore__ inline int64_t R0() const { return sub_ * t_.vecRows; }
  __aicore__ inline int64_t R1(const FaItem& it) const { return Min64(it.rows, R0() + t_.vecRows); }

  // An item without a key: out 0, lse -inf for this AIV's rows (no flags: the AIC skips it too)
  __aicore__ inline void EmptyItem(const FaItem& it) {
    for (int64_t r = R0(); r < R1(it); ++r) {
      const int64_t tok = it.seqStart + it.qPos0 + r;
      rows_.EmptyRow(out_[(tok * t_.H + it.head) * t_.Dv], lse_, it.head * t_.T + tok);
    }
  }

  // The AIVs' stream, block by block in the AIC's order g (both AIVs take part in every flag exchange,
  // also one whose half of an item's rows is empty). A software pipeline: the S tile of block g + 1 is
  // loaded (MTE2) while the vector unit works on block g (nbuf_ S / P tiles, their own event ids per
  // tile), and the O update trails the softmax by lag_ blocks (kFaSlots - 1 with the double tiles, so
  // the AIC has had lag_ softmaxes' time for P V), its O_partial load issued before the softmax of
  // block g (after it, the update waited the load's DMA latency with the next softmax queued behind it
  // on the vector unit). The stream crosses items: the softmaxes of the next item's first blocks run
  // while the last updates of the previous one trail (each of the lag_ + 1 items that can be in flight
  // keeps its own row max m and row sum l: M(k), L(k)); the O accumulator is reused because the
  // updates run in block order (an item's first update follows the previous item's output).
  // A cross-core wait holds the AIV's dispatch, so S_{g+1}'s sits after block g's softmax; O_{g-lag}'s
  // before it is normally long satisfied (the AIC computed P_{g-lag} V_{g-lag} lag_ softmaxes ago).
  __aicore__ inline void VecStream() {
    for (int64_t b = 0; b < nbuf_; ++b) {
      SetFlag<HardEvent::V_MTE2>(static_cast<event_t>(kEvS + b));  // the S tiles are free
      SetFlag<HardEvent::MTE3_V>(static_cast<event_t>(kEvS + b));  // the P tiles are free
    }
    SetFlag<HardEvent::V_MTE2>(kEvO);  // O / O_partial are free
    Blocks s, u;
    Start(s, true);
    Start(u, false);
    if (s.live) LoadS(s.it, s.j, 0);
    int64_t g = 0;
    for (; s.live; ++g) {
      if (g >= lag_) LoadO(u.it, u.j, g - lag_);
      if (R1(s.it) > R0()) SoftmaxTile(s.it, s.j, g, s.k);
      CrossCoreSetFlag<2, PIPE_MTE3>(FaFlag(kFaFlagP, g % kFaSlots));
      Step(s, true);
      if (s.live) LoadS(s.it, s.j, g + 1);
      if (g >= lag_) {  // overlaps the AIC's P_g V_g
        UpdateTile(u.it, u.j, g - lag_, u.k);
        Step(u, false);
      }
    }
    for (int64_t gu = g > lag_ ? g - lag_ : 0; u.live; ++gu) {
      LoadO(u.it, u.j, gu);
      UpdateTile(u.it, u.j, gu, u.k);
      Step(u, false);
    }
    for (int64_t b = 0; b < nbuf_; ++b) {
      WaitFlag<HardEvent::V_MTE2>(static_cast<event_t>(kEvS + b));
      WaitFlag<HardEvent::MTE3_V>(static_cast<event_t>(kEvS + b));
    }
    WaitFlag<HardEvent::V_MTE2>(kEvO);
  }

  // Wait for S_g (block j of it) and load this AIV's rows of it into S tile g % nbuf_ (once the vector
  // unit is done with that tile's previous block).
  __aicore__ inline void LoadS(const FaItem& it, int64_t, int64_t g) {
    const int64_t slot = g % kFaSlots, n = t_.baseN, b = g % nbuf_, r0 = R0(), R = R1(it) - r0;
    CrossCoreWaitFlag(FaFlag(kFaFlagS, slot));
    if (R <= 0) return;
    const event_t ev = static_cast<event_t>(kEvS + b);
    WaitFlag<HardEvent::V_MTE2>(ev);
    DataCopy(STile(b), s_[slot * score_ + r0 * n], static_cast<uint32_t>(R * n));
    SetFlag<HardEvent::MTE2_V>(ev);
  }

  // Wait for O_partial_g (block j of it) and load this AIV's rows of it (into O itself for the item's
  // first block).
  __aicore__ inline void LoadO(const FaItem& it, int64_t j, int64_t g) {
    const int64_t slot = g % kFaSlots, r0 = R0(), R = R1(it) - r0;
    CrossCoreWaitFlag(FaFlag(kFaFlagO, slot));
    if (R <= 0) return;
    WaitFlag<HardEvent::V_MTE2>(kEvO);  // o / part are reloaded: the last update's vector reads of them are done
    DataCopy(j == 0 ? oAcc_.Get<float>() : part_.Get<float>(), o_[slot * rowsSlot_ + r0 * dva_],
             static_cast<uint32_t>(R * dva_));
    SetFlag<HardEvent::MTE2_V>(EVENT_ID1);
  }

  __aicore__ inline LocalTensor<float> STile(int64_t b) { return sT_[b].Get<float>(); }
  __aicore__ inline LocalTensor<T> PTile(int64_t b) { return pT_[b].Get<T>(); }
  static constexpr int kEvS = 2;  // event ids kEvS + tile of the S tiles (V <-> MTE2) and P tiles (MTE3 -> V)
  static constexpr event_t kEvO = 4;  // V -> MTE2: the O update read O / O_partial

  // State vectors (up8(vecRows) fp32 each) in state_: alpha of blocks g % (lag_ + 1), then row max, row
  // sum (and chunk partials), tmp, m_old, 1 / l, lse, then the running m and l of the lag_ + 1 items
  // that can be in flight (item k % (lag_ + 1)); per-row broadcast blocks (8 fp32 per row) in bcast_.
  static constexpr uint32_t kMax = 0, kSum = 1, kTmp = 2, kMOld = 3, kRl = 4, kLse = 5, kScratch = 6;
  __aicore__ inline LocalTensor<float> Vec(int64_t k) const {
    return state_.Get<float>()[static_cast<uint32_t>(k * Up8(t_.vecRows))];
  }
  __aicore__ inline LocalTensor<float> Alpha(int64_t g) const { return Vec(g % (lag_ + 1)); }
  __aicore__ inline LocalTensor<float> St(uint32_t k) const { return Vec(lag_ + 1 + k); }
  __aicore__ inline LocalTensor<float> M(int64_t k) const { return Vec(lag_ + 1 + kScratch + 2 * (k % (lag_ + 1))); }
  __aicore__ inline LocalTensor<float> L(int64_t k) const { return Vec(lag_ + 2 + kScratch + 2 * (k % (lag_ + 1))); }

  __aicore__ inline void VS() {
    SetFlag<HardEvent::V_S>(EVENT_ID0);
    WaitFlag<HardEvent::V_S>(EVENT_ID0);
  }
  __aicore__ inline void SV() {
    SetFlag<HardEvent::S_V>(EVENT_ID0);
    WaitFlag<HardEvent::S_V>(EVENT_ID0);
  }

  // Columns [from, N) of `rows` tile rows starting at row u0 of the S tile := -inf
  __aicore__ inline void MaskCols(const LocalTensor<float>& s, int64_t u0, int64_t rows, int64_t from) {
    FaMaskCols(s.template ReinterpretCast<int32_t>(), t_.baseN, u0, rows, from, static_cast<int32_t>(0xFF800000u));
  }

  // Per-row reduction of the R x N tile over its 64-column chunks into dst (R values): max or sum
  // (chunk partials added in chunk order, as ReduceSum adds its repeats).
  template <bool kIsMax>
  __aicore__ inline void RowReduce(const LocalTensor<float>& dst, const LocalTensor<float>& s, int64_t R) {
    const int64_t n = t_.baseN;
    const int32_t rep = static_cast<int32_t>(n / 8);
    LocalTensor<float> tmp = St(kTmp);
    for (int64_t c0 = 0; c0 < n; c0 += 64) {
      const int32_t mask = static_cast<int32_t>(Min64(64, n - c0));
      const LocalTensor<float>& d = c0 == 0 ? dst : tmp;
      if (kIsMax) WholeReduceMax(d, s[c0], mask, static_cast<int32_t>(R), 1, 1, rep, ReduceOrder::ORDER_ONLY_VALUE);
      else WholeReduceSum(d, s[c0], mask, static_cast<int32_t>(R), 1, 1, rep);
      if (c0 == 0) continue;
      if (kIsMax) Max(dst, dst, tmp, static_cast<int32_t>(R));
      else Add(dst, dst, tmp, static_cast<int32_t>(R));
    }
  }

  // x[u, :] op= v[u] for the R rows of a tile of `width` fp32 columns (v broadcast by Brcb).
  template <bool kSub>
  __aicore__ inline void RowScalar(const LocalTensor<float>& x, const LocalTensor<float>& v, int64_t R, int64_t width) {
    FaRowScalar<kSub>(x, v, bcast_.Get<float>(), R, width, width);
  }

  // Online softmax of block j of item `it` (stream block g, item ordinal k) on this AIV's rows.
  __aicore__ inline void SoftmaxTile(const FaItem& it, int64_t j, int64_t g, int64_t k) {
    const int64_t r0 = R0(), R = R1(it) - r0, n = t_.baseN, slot = g % kFaSlots, b = g % nbuf_;  // GM slot, UB tile
    const int64_t k0 = j * n, cols = Min64(n, it.kvLen - k0);
    const int32_t cnt = static_cast<int32_t>(R * n), rc = static_cast<int32_t>(R);
    const bool first = j == 0, causal = t_.mask == FlashAttentionMask::kCausal;
    const event_t ev = static_cast<event_t>(kEvS + b);
    LocalTensor<float> s = STile(b), m = M(k), l = L(k), alpha = Alpha(g), rmax = St(kMax), rsum = St(kSum),
                       mOld = St(kMOld);
    LocalTensor<T> p = PTile(b);
    WaitFlag<HardEvent::MTE2_V>(ev);  // this block's S tile is in (LoadS)
    Muls(s, s, t_.softmaxScale, cnt);
    // columns a row does not see (past the block's keys, or causal past the row's last key) := -inf
    int64_t empty = 0;  // rows that see no key of this block
    if (!causal) {
      if (cols < n) MaskCols(s, 0, R, cols);
    } else {
      const int64_t c = it.qPos0 + r0 + it.off - k0 + 1;  // row u sees min(cols, u + c) columns
      for (int64_t u = 0; u < R; ++u)
        if (Min64(cols, u + c) <= 0) ++empty;
      // writing the -inf bits (an added -inf mask would turn a NaN or +inf score of a key the row must
      // not see into NaN)
      FaMaskPast(s.template ReinterpretCast<int32_t>(), n, R, FaCausalVis{c, cols}, static_cast<int32_t>(0xFF800000u));
    }
    RowReduce<true>(rmax, s, R);
    if (first) {
      Muls(m, rmax, 1.0f, rc);  // m = rowmax (exact copy)
      Duplicate(alpha, 0.0f, rc);
    } else {
      Muls(mOld, m, 1.0f, rc);
      Max(m, mOld, rmax, rc);  // m = m_old > rowmax ? m_old : rowmax
      Sub(alpha, mOld, m, rc);
      Exp(alpha, alpha, rc);  // alpha = exp(m_old - m)
    }
    RowScalar<true>(s, m, R, n);  // s - m
    Exp(s, s, cnt);
    RowReduce<false>(rsum, s, R);
    if (first) {
      Muls(l, rsum, 1.0f, rc);
    } else {
      Mul(l, l, alpha, rc);
      Add(l, l, rsum, rc);  // l = l_old * alpha + rowsum
    }
    WaitFlag<HardEvent::MTE3_V>(ev);  // the store of this P tile's previous block is done
    Cast(p, s, RoundMode::CAST_RINT, static_cast<uint32_t>(cnt));
    SetFlag<HardEvent::V_MTE2>(ev);  // the last vector read of this S tile
    if (first && empty) FixEmptyRows(it, r0, R, k0, cols, g, k);
    SetFlag<HardEvent::V_MTE3>(EVENT_ID0);
    WaitFlag<HardEvent::V_MTE3>(EVENT_ID0);
    DataCopy(p_[slot * score_ + r0 * n], p, static_cast<uint32_t>(cnt));
    SetFlag<HardEvent::MTE3_V>(ev);
  }

  // Rows that see no key at all (causal, the item's first block): a zero P row, m = l = 0, alpha = 1,
  // as SoftmaxRow does (their -inf row max made the tile arithmetic NaN). On later blocks a row without
  // a key of the block needs no fix: m = max(m_old, -inf) = m_old, alpha = exp(0) = 1, P = exp(-inf) = 0
  // and l = l_old * 1 + 0 = l_old, exactly SoftmaxRow's state.
  __aicore__ inline void FixEmptyRows(const FaItem& it, int64_t r0, int64_t R, int64_t k0, int64_t cols, int64_t g,
                                      int64_t k) {
    LocalTensor<float> m = M(k), l = L(k), alpha = Alpha(g);
    LocalTensor<T> p = PTile(g % nbuf_);
    VS();
    for (int64_t u = 0; u < R; ++u) {
      if (Min64(cols, it.qPos0 + r0 + u + it.off - k0 + 1) > 0) continue;
      m.SetValue(u, 0.0f);
      l.SetValue(u, 0.0f);
      alpha.SetValue(u, 1.0f);
    }
    SV();
    for (int64_t u = 0; u < R; ++u)
      if (Min64(cols, it.qPos0 + r0 + u + it.off - k0 + 1) <= 0) ZeroFill(p[u * t_.baseN], t_.baseN);
  }

  // O update of block j of item `it` (stream block g, item ordinal k); the output after its last block.
  __aicore__ inline void UpdateTile(const FaItem& it, int64_t j, int64_t g, int64_t k) {
    const int64_t r0 = R0(), R = R1(it) - r0;
    if (R <= 0) return;
    const int32_t cnt = static_cast<int32_t>(R * dva_);
    LocalTensor<float> o = oAcc_.Get<float>(), part = part_.Get<float>();
    WaitFlag<HardEvent::MTE2_V>(EVENT_ID1);  // O_partial_j is in (LoadO)
    if (j > 0) {
      RowScalar<false>(o, Alpha(g), R, dva_);  // o * alpha
      Add(o, o, part, cnt);
    }
    if (j + 1 == it.keyBlocks) FinishTile(it, r0, R, k);
    SetFlag<HardEvent::V_MTE2>(kEvO);
  }

  // out = O / l in the input dtype, lse = m + ln(l); rows with l = 0 (no key seen): out 0, lse -inf.
  // Only those: a NaN l (a NaN or +inf score in the row) keeps out NaN and lse NaN (+inf where the row
  // max m is +inf, the reference's logsumexp), never the no-key -inf.
  __aicore__ inline void FinishTile(const FaItem& it, int64_t r0, int64_t R, int64_t k) {
    LocalTensor<float> o = oAcc_.Get<float>(), m = M(k), l = L(k), rl = St(kRl), lse = St(kLse);
    LocalTensor<T> outT = outT_.Get<T>();
    const int32_t rc = static_cast<int32_t>(R);
    Ln(lse, l, rc);
    Add(lse, lse, m, rc);
    VS();
    for (int64_t u = 0; u < R; ++u) {
      const float lv = l.GetValue(u);
      const bool seen = !(lv == 0.0f);  // true for a NaN l
      rl.SetValue(u, seen ? 1.0f / lv : 0.0f);
      if (!seen) lse.template ReinterpretCast<int32_t>().SetValue(u, static_cast<int32_t>(0xFF800000u));
      else if (m.GetValue(u) > 3.4028235e38f) lse.SetValue(u, m.GetValue(u));  // a +inf score: lse = m = +inf
    }
    SV();
    RowScalar<false>(o, rl, R, dva_);
    const uint32_t ostride = OutStride();
    if (ostride == dva_) {
      Cast(outT, o, RoundMode::CAST_RINT, static_cast<uint32_t>(R * dva_));
    } else {
      for (int64_t u = 0; u < R; ++u)
        Cast(outT[u * ostride], o[u * dva_], RoundMode::CAST_RINT, static_cast<uint32_t>(t_.Dv));
    }
    SetFlag<HardEvent::V_MTE3>(EVENT_ID0);
    WaitFlag<HardEvent::V_MTE3>(EVENT_ID0);
    const int64_t tok = it.seqStart + it.qPos0 + r0;
    const uint32_t rowBytes = static_cast<uint32_t>(t_.Dv * sizeof(T));
    DataCopyExtParams po{static_cast<uint16_t>(R), rowBytes,
                         static_cast<uint32_t>((ostride * sizeof(T) - (rowBytes + 31) / 32 * 32) / 32), 0, 0};
    po.dstStride = static_cast<uint32_t>((t_.H - 1) * t_.Dv * sizeof(T));
    DataCopyPad(out_[(tok * t_.H + it.head) * t_.Dv], outT, po);
    DataCopyExtParams pl{1, static_cast<uint32_t>(R * sizeof(float)), 0, 0, 0};
    DataCopyPad(lse_[it.head * t_.T + tok], lse, pl);
    SetFlag<HardEvent::MTE3_V>(EVENT_ID0);
    WaitFlag<HardEvent::MTE3_V>(EVENT_ID0);
    SetFlag<HardEvent::MTE3_S>(EVENT_ID0);  // the next item's scalar writes of rl / lse
    WaitFlag<HardEvent::MTE3_S>(EVENT_ID0);
  }

  // UB row stride (elements) of the output tile: up8(Dv) when its rows are whole 32-byte blocks in the
  // input dtype, else up16(Dv).
  __aicore__ inline uint32_t OutStride() const { return (dva_ * sizeof(T)) % 32 == 0 ? dva_ : Up16(t_.Dv); }

  FlashAttentionTiling t_;
  uint32_t dva_ = 0, sub_ = 0;
  int64_t nbuf_ = 1, lag_ = 1;  // S / P tiles; blocks the O update trails the softmax
  uint64_t score_ = 0, rowsSlot_ = 0;  // elements of one S / P slot and of one O_partial slot
  int64_t group_ = 0;
  bool aic_ = false;
  FaCube<T> cube_;
  FaRows<T> rows_;
  TBuf<TPosition::VECCALC> oAcc_, part_, state_, sT_[2], pT_[2], outT_, bcast_;
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
