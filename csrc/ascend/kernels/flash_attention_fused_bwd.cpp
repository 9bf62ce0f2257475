// AscendC flash attention: the fused backward pass, one mixed launch per pass (MIX_AIC_1_2).
// One kernel type per source file (see kernels/flash_attention_common.h for the layout and the math).
// Nothing here has been compiled with bisheng or run on an NPU (see docs/ascend.md).
#include "kernels/flash_attention_common.h"

using namespace AscendC;

namespace amo_ascend {
namespace kernels {

// ==== Fused backward pass: ONE mixed launch per pass (KERNEL_TYPE_MIX_AIC_1_2) ==========================
// Same arithmetic as the phase kernels. Per AI Core (one AIC + two AIVs) the items FaDealtCursor deals
// to it (longest first, balanced over the AI Cores), their blocks in step order and as ONE stream g = 0,
// 1, ... across items (since 2026-12-08), PIPELINED over kFabSlots GM slots (block g uses slot
// g % kFabSlots, kFlashAttentionFusedSlots):
//   AIC : S, dP of the first kFabSlots - 1 blocks; then for each g: S, dP of block g + kFabSlots - 1
//         (lookahead, also into the next item; flag S); wait P[g % kFabSlots] (both AIVs); the pass's
//         products of block g -> part slot; flag G.
//   AIVs: for each g: P and dS of its half of the query rows -> slot, in chunks whose S, dP, lse and
//         delta are loaded one chunk ahead (two buffers where the UB has room: tiling fusedPipe);
//         flag P; wait S of block g + 1 and load its first chunk; then wait G of block g - 1 and add
//         its products (loaded one chunk ahead too) to the running sums of its half of the item's
//         gradient rows (kept in UB for the whole item); after an item's last block the rows are
//         written out; items without blocks get their zero rows after the stream.
// Slot hazards (n = kFabSlots): the S/dP slot of block g+n-1 (block g-1's) is rewritten after the AIC
// waited P of block g-1 (its readers are done); the P/dS slot of block g after the AIVs waited G of
// block g-n (the AIC read it before); the part slot of block g after the AIC waited P of block g (set
// after the AIVs added block g-n). No GM running sums and no zeroing, one launch per pass.
constexpr int64_t kFabSlots = kFlashAttentionFusedSlots;
constexpr int64_t kFabFlagS = 0, kFabFlagP = 1, kFabFlagG = 2;  // hand-off kinds of FaFlag(kind, slot)

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
    // this AI Core's kFabSlots slots (the phase kernels' per-item workspaces shrink to 3 slots per AI
    // Core); slot k of S/dP/P/dS starts at k * b * b and its part slot at k * b * gradCols, as FabGradMath
    // expects
    g_.s.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(g.s) + group_ * kFabSlots * score_, kFabSlots * score_);
    g_.dp.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(g.dp) + group_ * kFabSlots * score_, kFabSlots * score_);
    g_.p.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(g.p) + group_ * kFabSlots * score_, kFabSlots * score_);
    g_.ds.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(g.ds) + group_ * kFabSlots * score_, kFabSlots * score_);
    g_.part.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(g.part) + group_ * kFabSlots * rows, kFabSlots * rows);
    TPipe pipe;
    if (aic_) {
      cube_.InitBwd(t, &pipe);
    } else {
      const uint32_t c = Chunk(), c8 = Up8(c), b = t.baseM;
      nbuf_ = (t.fusedPipe & kFaPipeDouble) ? 2 : 1;
      pipe.InitBuffer(accBuf_, t.vecRows * t.gradCols * sizeof(float));
      for (int64_t k = 0; k < nbuf_; ++k) {  // one TBuf per buffer (the emulator tracks each buffer's accesses)
        pipe.InitBuffer(partBuf_[k], c * t.gradCols * sizeof(float));
        pipe.InitBuffer(sT_[k], c * b * sizeof(float));
        pipe.InitBuffer(dpT_[k], c * b * sizeof(float));
        pipe.InitBuffer(pT_[k], c * b * sizeof(T));
        pipe.InitBuffer(dsT_[k], c * b * sizeof(T));
        pipe.InitBuffer(vecs_[k], 2 * c8 * sizeof(float));       // lse, delta of the chunk's rows
        pipe.InitBuffer(deltaBlk_[k], c8 * 8 * sizeof(float));   // delta as loaded: one 32-byte row each
      }
      pipe.InitBuffer(outT_, c * t.gradCols * sizeof(T));
      pipe.InitBuffer(bcast_, c8 * 8 * sizeof(float));
      rows_.Init(pipe, t, &g_, false, true);  // the output row of WriteZeroGrads / the row-wise WriteGrad
    }
    if (aic_) {
      CubeStream();
      return;
    }
    VecStream();
    // items without blocks: their zero gradient rows, after the stream (WriteZeroGrads uses the
    // running-sum buffer as its zero row, which the stream's items hold until their last block)
    FaDealtCursor c;
    c.Init(t_, g_.cu, g_.cuK, group_, GetBlockNum());
    int64_t item = 0, seq = 0, i = 0, h = 0;
    FaSeq sq;
    while (c.Next(item, seq, sq, i, h)) {
      FabItem it;
      it.t = item;
      it.head = h;
      if (FabEmpty(t_, sq, i, it)) Empty(it);
    }
  }

  // An item without blocks (KV pass: no query; Q pass: its rows see no key): the AIVs write its zero
  // gradient rows, with no hand-off (the AIC skips it).
  __aicore__ inline void Empty(const FabItem& it) {
    const int64_t g0 = sub_ * t_.vecRows, g1 = Min64(rows_.Extent(it), g0 + t_.vecRows);
    rows_.WriteZeroGrads(it, g0, g1, accBuf_.Get<float>());
  }

 private:
  // One core's blocks in stream order: the valid steps (FabBlock) of the items FaDealtCursor deals to
  // it, items without blocks skipped; blk = the current block.
  struct Blocks {
    FaDealtCursor items;
    FabNth nth;
    FabItem blk;
    int64_t steps = 0, step = 0;
    bool live = false;
  };
  __aicore__ inline void Start(Blocks& b) {
    b.items.Init(t_, g_.cu, g_.cuK, group_, GetBlockNum());
    NextItem(b);
  }
  __aicore__ inline void NextItem(Blocks& b) {
    int64_t item = 0, seq = 0, i = 0, h = 0;
    FaSeq sq;
    b.live = false;
    while (b.items.Next(item, seq, sq, i, h)) {
      FabItem it;
      it.t = item;
      it.head = h;
      if (FabEmpty(t_, sq, i, it)) continue;
      b.nth = FabNth{&t_, item, sq, i, h};
      b.steps = CeilDiv(t_.pass == FlashAttentionPass::kBackwardKV ? sq.lq : sq.lk, t_.baseM);
      b.step = -1;
      if (NextStep(b)) {
        b.live = true;
        return;
      }
    }
  }
  __aicore__ inline bool NextStep(Blocks& b) {
    while (++b.step < b.steps)
      if (b.nth.At(b.step, b.blk)) return true;
    return false;
  }
  __aicore__ inline void Step(Blocks& b) {
    if (!NextStep(b)) NextItem(b);
  }

  // The AIC's stream: every block of the core's items as one sequence g = 0, 1, ... (slot g %
  // kFabSlots), S and dP computed kFabSlots - 1 blocks ahead of the products ACROSS item boundaries
  // (since 2026-12-08; before, each item filled and drained the pipeline on its own).
  __aicore__ inline void CubeStream() {
    Blocks s, p;
    Start(s);
    Start(p);
    int64_t gs = 0;
    for (; gs < kFabSlots - 1 && s.live; ++gs) {
      ScoresBlock(s.blk, gs % kFabSlots);
      Step(s);
    }
    for (int64_t g = 0; p.live; ++g) {
      if (s.live) {  // lookahead: overlaps the AIVs' P, dS of g .. g + kFabSlots - 2
        ScoresBlock(s.blk, gs % kFabSlots);
        ++gs;
        Step(s);
      }
      const int64_t slot = g % kFabSlots;
      CrossCoreWaitFlag(FaFlag(kFabFlagP, slot));
      grad_.Item(cube_, t_, g_, p.blk, static_cast<int64_t>(slot * score_));
      CrossCoreSetFlag<2, PIPE_FIX>(FaFlag(kFabFlagG, slot));
      Step(p);
    }
  }

  // The AIVs' stream, block by block in the AIC's order g. Software pipeline (nbuf_ == 2): chunk u + 1's
  // S, dP, lse and delta are loaded (MTE2) while the vector unit works on chunk u -- within a block
  // issued before chunk u's vector work, across blocks (and items) after the P flag of block g (then the
  // cross-core wait for S_{g+1} sits where its data are needed next); the P / dS tiles and the product
  // rows alternate between two buffers as well. The running sums of block g - 1's item are added after
  // block g's P, dS (an item's rows are written out at its last block, before the next item's first
  // block starts the sums again: one running-sum buffer).
  __aicore__ inline void VecStream() {
    for (int64_t k = 0; k < nbuf_; ++k) {
      SetFlag<HardEvent::V_MTE2>(static_cast<event_t>(kEvC + k));  // chunk buffers free
      SetFlag<HardEvent::MTE3_V>(static_cast<event_t>(kEvC + k));
      SetFlag<HardEvent::V_S>(static_cast<event_t>(kEvC + k));
    }
    const int64_t r0 = sub_ * t_.vecRows, C = Chunk();
    Blocks c;
    Start(c);
    int64_t g = 0;
    if (c.live) {
      FabItem it = c.blk, accIt = it;
      CrossCoreWaitFlag(FaFlag(kFabFlagS, 0));
      if (r0 < it.rows) Prefetch(it, 0, r0, Min64(C, Min64(it.rows, r0 + t_.vecRows) - r0), unit_);
      for (; c.live; ++g) {
        const int64_t slot = g % kFabSlots, b = t_.baseM, ws = static_cast<int64_t>(slot * score_);
        const int64_t r1 = Min64(it.rows, r0 + t_.vecRows);
        for (int64_t c0 = r0; c0 < r1; c0 += C) {
          const int64_t R = Min64(C, r1 - c0), nx = c0 + C;
          if (nbuf_ == 2 && nx < r1) Prefetch(it, ws, nx, Min64(C, r1 - nx), unit_ + 1);
          GradChunk(it, ws, b, c0, R, unit_);
          if (nbuf_ == 1 && nx < r1) Prefetch(it, ws, nx, Min64(C, r1 - nx), unit_ + 1);
          ++unit_;
        }
        // The set fires after MTE3's earlier work only. When this AIV's half of the block is empty there
        // is no store before it, so MTE3 first waits for MTE2: the flag then also covers the part-slot
        // loads of AccBlock(g - 2), whose slot the AIC overwrites once it has this flag (issue 30).
        SetFlag<HardEvent::MTE2_MTE3>(EVENT_ID1);
        WaitFlag<HardEvent::MTE2_MTE3>(EVENT_ID1);
        CrossCoreSetFlag<2, PIPE_MTE3>(FaFlag(kFabFlagP, slot));
        const FabItem prev = it;
        Step(c);
        if (c.live) {
          it = c.blk;
          const int64_t ns = (g + 1) % kFabSlots;
          CrossCoreWaitFlag(FaFlag(kFabFlagS, ns));
          if (r0 < it.rows)
            Prefetch(it, static_cast<int64_t>(ns * score_), r0, Min64(C, Min64(it.rows, r0 + t_.vecRows) - r0), unit_);
        }
        if (g > 0) AccBlock(accIt, (g - 1) % kFabSlots);  // overlaps the AIC's products of block g
        accIt = prev;
      }
      AccBlock(accIt, (g - 1) % kFabSlots);
    }
    for (int64_t k = 0; k < nbuf_; ++k) {
      WaitFlag<HardEvent::V_MTE2>(static_cast<event_t>(kEvC + k));
      WaitFlag<HardEvent::MTE3_V>(static_cast<event_t>(kEvC + k));
      WaitFlag<HardEvent::V_S>(static_cast<event_t>(kEvC + k));
    }
  }

  __aicore__ inline void ScoresBlock(const FabItem& it, int64_t slot) {
    qk_.Item(cube_, t_, g_, it, static_cast<int64_t>(slot * score_));
    CrossCoreSetFlag<2, PIPE_FIX>(FaFlag(kFabFlagS, slot));
  }

  // ---- vector side, tile-wise: chunks of up to Chunk() rows per DMA / vector instruction -------------
  // The same fp32 operations per element, in the same order, as FabRows::GradRow / FabAcc / WriteGrad of
  // the phase kernels (bitwise equal results): columns a row does not see are -inf before the exp (P = 0),
  // Sub(x, v) is Adds(x, -v), and the dS columns (and rows) the row form leaves zero are zeroed.
  static constexpr uint32_t kChunk = 16;
  __aicore__ inline uint32_t Chunk() const { return t_.vecRows < kChunk ? t_.vecRows : kChunk; }

  static constexpr int kEvC = 2, kEvP = 4;  // event ids + buffer: chunk tiles (S, dP, lse, delta, P, dS); product rows

  // Load chunk u's S, dP (fp32), lse and delta (one 32-byte row each) into buffer u % nbuf_, once the
  // vector unit (and the scalar copy of delta) are done with that buffer's previous chunk.
  __aicore__ inline void Prefetch(const FabItem& it, int64_t ws, int64_t c0, int64_t R, int64_t u) {
    const int64_t b = t_.baseM, k = u % nbuf_;
    const event_t ev = static_cast<event_t>(kEvC + k);
    const int32_t cnt = static_cast<int32_t>(R * b);
    const int64_t tok0 = it.seqStart + it.qPos0 + c0;
    WaitFlag<HardEvent::V_MTE2>(ev);  // the vector reads of this buffer's s / dp / lse are done
    SetFlag<HardEvent::S_MTE2>(EVENT_ID0);  // and the scalar reads of its dblk
    WaitFlag<HardEvent::S_MTE2>(EVENT_ID0);
    DataCopy(STile(k), g_.s[ws + c0 * b], static_cast<uint32_t>(cnt));
    DataCopy(DpTile(k), g_.dp[ws + c0 * b], static_cast<uint32_t>(cnt));
    DataCopyPadExtParams<float> none;
    DataCopyPad(Lse(k), g_.lse[it.head * t_.T + tok0], DataCopyExtParams{1, static_cast<uint32_t>(R * 4), 0, 0, 0}, none);
    DataCopyPad(DBlk(k), g_.delta[tok0 * t_.H + it.head],
                DataCopyExtParams{static_cast<uint16_t>(R), 4, static_cast<uint32_t>((t_.H - 1) * 4), 0, 0}, none);
    SetFlag<HardEvent::MTE2_S>(ev);
    SetFlag<HardEvent::MTE2_V>(ev);
  }

  __aicore__ inline LocalTensor<float> STile(int64_t k) { return sT_[k].Get<float>(); }
  __aicore__ inline LocalTensor<float> DpTile(int64_t k) { return dpT_[k].Get<float>(); }
  __aicore__ inline LocalTensor<T> PTile(int64_t k) { return pT_[k].Get<T>(); }
  __aicore__ inline LocalTensor<T> DsTile(int64_t k) { return dsT_[k].Get<T>(); }
  __aicore__ inline LocalTensor<float> Lse(int64_t k) { return vecs_[k].Get<float>(); }
  __aicore__ inline LocalTensor<float> Delta(int64_t k) { return vecs_[k].Get<float>()[Up8(Chunk())]; }
  __aicore__ inline LocalTensor<float> DBlk(int64_t k) { return deltaBlk_[k].Get<float>(); }

  __aicore__ inline void GradChunk(const FabItem& it, int64_t ws, int64_t b, int64_t c0, int64_t R, int64_t u) {
    const int32_t cnt = static_cast<int32_t>(R * b);
    const bool causal = t_.mask == FlashAttentionMask::kCausal;
    const int64_t k = u % nbuf_;
    const event_t ev = static_cast<event_t>(kEvC + k);
    LocalTensor<float> s = STile(k), dp = DpTile(k), lse = Lse(k), delta = Delta(k), dblk = DBlk(k),
                       bc = bcast_.Get<float>();
    LocalTensor<T> p = PTile(k), ds = DsTile(k);
    WaitFlag<HardEvent::MTE2_S>(ev);  // this chunk's delta rows are in (Prefetch)
    WaitFlag<HardEvent::V_S>(ev);     // the vector reads of this buffer's delta (two chunks ago) are done
    for (int64_t r = 0; r < R; ++r) delta.SetValue(r, dblk.GetValue(r * 8));  // delta rows are H apart in GM
    SetFlag<HardEvent::S_V>(EVENT_ID0);
    WaitFlag<HardEvent::S_V>(EVENT_ID0);
    WaitFlag<HardEvent::MTE2_V>(ev);  // s / dp / lse are in (Prefetch)
    Muls(s, s, t_.softmaxScale, cnt);
    LocalTensor<int32_t> si = s.template ReinterpretCast<int32_t>();
    const int32_t negInf = static_cast<int32_t>(0xFF800000u);
    if (!causal) {
      if (it.cols < b) FaMaskCols(si, b, 0, R, it.cols, negInf);
    } else {  // writing the -inf bits (not an added mask: NaN / +inf scores stay out); row r sees Valid(it, c0 + r)
      FaMaskPast(si, b, R, FaCausalVis{it.qPos0 + c0 + it.lenK - it.lenQ - it.k0 + 1, it.cols}, negInf);
    }
    FaRowScalar<true>(s, lse, bc, R, b, b);  // scale * S - lse
    Exp(s, s, cnt);                           // P in fp32
    WaitFlag<HardEvent::MTE3_V>(ev);          // the stores of this buffer's P / dS (two chunks ago) are done
    Cast(p, s, RoundMode::CAST_RINT, static_cast<uint32_t>(cnt));
    FaRowScalar<true>(dp, delta, bc, R, b, b);  // dP - delta
    SetFlag<HardEvent::V_S>(ev);                // the last vector read of delta (Brcb)
    Mul(dp, dp, s, cnt);                        // dS = P * (dP - delta)
    Cast(ds, dp, RoundMode::CAST_RINT, static_cast<uint32_t>(cnt));
    SetFlag<HardEvent::V_MTE2>(ev);  // the last vector reads of s / dp / lse
    // zeros of the row form: dS past a row's visible columns; P and dS of a row without a visible key
    // (its lse may be -inf); dS of a row that sees one key only (see GradRow)
    for (int64_t r = 0; r < R; ++r) {
      const int64_t v = causal ? Valid(it, c0 + r) : it.cols;
      if (v <= 0) {
        ZeroFill(p[r * b], static_cast<uint32_t>(b));
        ZeroFill(ds[r * b], static_cast<uint32_t>(b));
      } else if (Visible(it, c0 + r) <= 1) {
        ZeroFill(ds[r * b], static_cast<uint32_t>(b));
      } else if (v < b && causal) {
        FaMaskCols(ds.template ReinterpretCast<int16_t>(), b, r, 1, v, static_cast<int16_t>(0));
      }
    }
    if (!causal && it.cols < b) FaMaskCols(ds.template ReinterpretCast<int16_t>(), b, 0, R, it.cols, static_cast<int16_t>(0));
    SetFlag<HardEvent::V_MTE3>(EVENT_ID0);
    WaitFlag<HardEvent::V_MTE3>(EVENT_ID0);
    DataCopy(g_.p[ws + c0 * b], p, static_cast<uint32_t>(cnt));
    DataCopy(g_.ds[ws + c0 * b], ds, static_cast<uint32_t>(cnt));
    SetFlag<HardEvent::MTE3_V>(ev);
  }

  // Columns of block it that query row r of the block sees (causal: up to its last key), and keys it
  // sees in all (GradRow's `valid` and `visible`).
  __aicore__ inline int64_t Valid(const FabItem& it, int64_t r) const {
    const int64_t lastKey = it.qPos0 + r + it.lenK - it.lenQ;
    return Min64(it.cols, lastKey - it.k0 + 1);
  }
  __aicore__ inline int64_t Visible(const FabItem& it, int64_t r) const {
    if (t_.mask != FlashAttentionMask::kCausal) return it.lenK;
    return Min64(it.lenK, it.qPos0 + r + it.lenK - it.lenQ + 1);
  }

  // Running sums of this AIV's half of the gradient rows += the block's products, Chunk() rows per DMA
  // and vector instruction (the vector instructions run over all gradCols columns: in the Q pass those
  // past AccCols() are neither loaded nor written out); written out at the item's last block.
  __aicore__ inline void AccBlock(const FabItem& it, int64_t slot) {
    CrossCoreWaitFlag(FaFlag(kFabFlagG, slot));
    const int64_t g0 = sub_ * t_.vecRows, g1 = Min64(rows_.Extent(it), g0 + t_.vecRows), gc = t_.gradCols;
    const int64_t C = Chunk();
    // the product rows of chunk k + 1 load while chunk k is added (nbuf_ == 2)
    for (int64_t k = 0; k < nbuf_; ++k) SetFlag<HardEvent::V_MTE2>(static_cast<event_t>(kEvP + k));
    if (g0 < g1) LoadPart(it, slot, g0, Min64(C, g1 - g0), 0);
    for (int64_t c0 = g0, k = 0; c0 < g1; c0 += C, ++k) {
      const int64_t R = Min64(C, g1 - c0), nx = c0 + C;
      if (nbuf_ == 2 && nx < g1) LoadPart(it, slot, nx, Min64(C, g1 - nx), k + 1);
      const int32_t cnt = static_cast<int32_t>(R * gc);
      const event_t ev = static_cast<event_t>(kEvP + k % nbuf_);
      LocalTensor<float> acc = accBuf_.Get<float>()[(c0 - g0) * gc], part = partBuf_[k % nbuf_].Get<float>();
      WaitFlag<HardEvent::MTE2_V>(ev);
      if (it.first) Muls(acc, part, 1.0f, cnt);  // start the running sum (x * 1 is exact)
      else Add(acc, acc, part, cnt);
      SetFlag<HardEvent::V_MTE2>(ev);  // part buffer read
      if (nbuf_ == 1 && nx < g1) LoadPart(it, slot, nx, Min64(C, g1 - nx), k + 1);
    }
    for (int64_t k = 0; k < nbuf_; ++k) WaitFlag<HardEvent::V_MTE2>(static_cast<event_t>(kEvP + k));
    if (!it.last) return;
    if (!TileOut()) {
      for (int64_t r = g0; r < g1; ++r) rows_.WriteGrad(it, r, accBuf_.Get<float>()[(r - g0) * gc]);
      return;
    }
    for (int64_t c0 = g0; c0 < g1; c0 += Chunk()) WriteChunk(it, c0, Min64(Chunk(), g1 - c0), accBuf_.Get<float>()[(c0 - g0) * gc]);
  }

  // Product rows [c0, c0 + R) of the part slot into part buffer k % nbuf_ (in the Q pass only the
  // AccCols() columns the pass wrote, rows gc apart in GM and in UB).
  __aicore__ inline void LoadPart(const FabItem& it, int64_t slot, int64_t c0, int64_t R, int64_t k) {
    const int64_t gc = t_.gradCols, n = rows_.AccCols(), base = slot * static_cast<int64_t>(t_.baseM) * gc;
    const event_t ev = static_cast<event_t>(kEvP + k % nbuf_);
    LocalTensor<float> part = partBuf_[k % nbuf_].Get<float>();
    WaitFlag<HardEvent::V_MTE2>(ev);  // this buffer's previous Add / Muls read it
    if (n == gc) {
      DataCopy(part, g_.part[base + c0 * gc], static_cast<uint32_t>(R * gc));
    } else {
      const uint32_t len = static_cast<uint32_t>(n * 4);
      DataCopyPadExtParams<float> none;
      DataCopyPad(part, g_.part[base + c0 * gc],
                  DataCopyExtParams{static_cast<uint16_t>(R), len, static_cast<uint32_t>((gc - n) * 4),
                                    static_cast<uint32_t>((gc * 4 - (len + 31) / 32 * 32) / 32), 0},
                  none);
    }
    SetFlag<HardEvent::MTE2_V>(ev);
  }

  // The gradient rows leave as whole chunks when every segment starts on a 32-byte boundary of the
  // input-dtype tile (gradCols, the rope and the v column multiples of 16); else row by row.
  __aicore__ inline bool TileOut() const {
    return t_.gradCols % 16 == 0 && FabRopeCol(t_) % 16 == 0 && FabVCol(t_) % 16 == 0;
  }

  __aicore__ inline void WriteChunk(const FabItem& it, int64_t c0, int64_t R, const LocalTensor<float>& acc) {
    const int64_t gc = t_.gradCols, vcol = FabVCol(t_), rcol = FabRopeCol(t_);
    LocalTensor<T> o = outT_.Get<T>();
    // dK / dQ and dK_rope carry the scale: columns [0, vcol) of each row
    const uint8_t rep = static_cast<uint8_t>(gc / 8);
    for (int64_t cc = 0; cc < vcol; cc += 64)
      Muls(acc[cc], acc[cc], t_.softmaxScale, static_cast<uint64_t>(Min64(64, vcol - cc)), static_cast<uint8_t>(R),
           UnaryRepeatParams(1, 1, rep, rep));
    SetFlag<HardEvent::MTE3_V>(EVENT_ID0);  // the previous chunk's stores of o are done
    WaitFlag<HardEvent::MTE3_V>(EVENT_ID0);
    Cast(o, acc, RoundMode::CAST_RINT, static_cast<uint32_t>(R * gc));
    SetFlag<HardEvent::V_MTE3>(EVENT_ID0);
    WaitFlag<HardEvent::V_MTE3>(EVENT_ID0);
    const int64_t e = sizeof(T);
    if (t_.pass == FlashAttentionPass::kBackwardKV) {
      const int64_t tok0 = it.kvStart + it.k0 + c0;
      StoreRows(g_.dko[(tok0 * t_.H + it.head) * t_.Dk], o, R, t_.Dk, gc, (t_.H - 1) * t_.Dk * e);
      StoreRows(g_.dvo[(tok0 * t_.H + it.head) * t_.Dv], o[vcol], R, t_.Dv, gc, (t_.H - 1) * t_.Dv * e);
      if (t_.Dr) StoreRows(g_.dkrh[(it.head * t_.Tk + tok0) * t_.Dr], acc[rcol], R, t_.Dr, gc, 0);
    } else {
      const int64_t tok0 = it.seqStart + it.qPos0 + c0, dq = t_.Dk + t_.Dr;
      StoreRows(g_.dqo[(tok0 * t_.H + it.head) * dq], o, R, t_.Dk, gc, (t_.H * dq - t_.Dk) * e);
      if (t_.Dr) StoreRows(g_.dqo[(tok0 * t_.H + it.head) * dq + t_.Dk], o[rcol], R, t_.Dr, gc, (t_.H * dq - t_.Dr) * e);
    }
    SetFlag<HardEvent::MTE3_V>(EVENT_ID0);
    WaitFlag<HardEvent::MTE3_V>(EVENT_ID0);
  }

  // R rows of `cols` elements, `ubStride` elements apart in UB, to GM rows gapBytes apart.
  template <typename E>
  __aicore__ inline void StoreRows(const GlobalTensor<E>& dst, const LocalTensor<E>& src, int64_t R, int64_t cols,
                                   int64_t ubStride, int64_t gapBytes) {
    const uint32_t len = static_cast<uint32_t>(cols * sizeof(E));
    DataCopyExtParams p{static_cast<uint16_t>(R), len,
                        static_cast<uint32_t>((ubStride * sizeof(E) - (len + 31) / 32 * 32) / 32),
                        static_cast<uint32_t>(gapBytes), 0};
    DataCopyPad(dst, src, p);
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
  TBuf<TPosition::VECCALC> accBuf_, partBuf_[2], sT_[2], dpT_[2], pT_[2], dsT_[2], outT_, vecs_[2], deltaBlk_[2], bcast_;
  int64_t nbuf_ = 1;   // buffers of the chunk tiles and product rows (2: the next chunk is prefetched)
  int64_t unit_ = 0;   // chunks of this AIV so far: chunk u uses buffer u % nbuf_
};

}  // namespace kernels
}  // namespace amo_ascend

// Fused backward pass (pass set by the host): one mixed launch on blockDim AI Cores.
extern "C" __global__ __aicore__ void amo_fab_fused(GM_ADDR gmArgs, GM_ADDR tiling) {
  KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIC_1_2);
  amo_ascend::kernels::FaRun<amo_ascend::kernels::FabFused, amo_ascend::FlashAttentionBwdArgs>(gmArgs, tiling);
}
