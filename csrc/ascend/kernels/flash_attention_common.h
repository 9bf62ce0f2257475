// AscendC flash attention (shared device code) forward and backward (MLA shape: Dk nope + Dr rope with a key part shared by all heads,
// and plain equal dims), fp16/bf16 inputs, fp32 accumulation, causal or not, packed sequences.
//
// STRUCTURE: two variants of the same arithmetic. The default is one fused mixed launch
// (amo_fa_fused, "Fused forward" below: AIC and AIVs hand blocks over through GM slots and cross-core
// flags). The fallback (ASCEND_MOE_OPS_FA_KERNELS=phases) is four phase kernels, launched by the host
// once per key block j (step), that exchange data through GM workspaces -- the same Cube -> GM ->
// Vector hand-off, with kernel boundaries instead of cross-core flags:
//   amo_fa_qk      (AIC) S_j = Q_nope . K_j^T + Q_rope . Krope_j^T: two Mmads accumulating into one
//                  L0C tile (k_rope is read once per key block, never expanded per head); Fixpipe fp32.
//   amo_fa_softmax (AIV) online softmax of S_j rows in fp32 in UB: scale, causal column limit, row max,
//                  exp, row sum; new (m, l) and the rescale factor alpha = exp(m_old - m_new) per row;
//                  P_j in the input dtype to GM (pad columns exactly zero).
//   amo_fa_pv      (AIC) O_partial = P_j . V_j (fp32, Fixpipe).
//   amo_fa_update  (AIV) O = alpha * O + O_partial in fp32; after the item's last key block:
//                  out = O / l (input dtype) and lse = m + ln(l).
// The per-row (m, l, alpha) state and the O accumulator live in GM workspaces between launches (a
// fused kernel keeps them in UB). Work items (sequence, head, query block) are walked on the device
// from cu_seqlens_q and cu_seqlens_k (int64; a sequence may have Lq != Lk, causal is bottom-right
// aligned: query i sees keys j <= i + Lk - Lq) exactly as flash_attention_schedule() does: item t runs on AIC core
// t % blockDim; on the vector side item t is split into U = ceil(baseM / vecRows) units of vecRows rows
// (U = 2 on the 910B: two AIVs per AIC), unit t * U + u on AIV core (t * U + u) % blockNum. Every workspace row has one writer per phase.
// The fused kernels deal the items over the AI Cores by their length instead (FaDeal below; host twin
// flash_attention_fused_schedule()); an AI Core's two AIVs split each of its items by rows.
// FILES (one kernel type per source file: CANN's build flow classifies a file by its FIRST
// KERNEL_TASK_TYPE_DEFAULT and builds every kernel in it that way):
//   flash_attention_common.h     this header: shared device code (walks, Cube/vector phase classes)
//   flash_attention_cube.cpp     AIC_ONLY phase kernels amo_fa_qk, amo_fa_pv, amo_fab_qk, amo_fab_grad
//   flash_attention_vec.cpp      AIV_ONLY phase kernels amo_fa_softmax, amo_fa_update, amo_fab_delta,
//                                amo_fab_softmax, amo_fab_acc, amo_fab_dkrope
//   flash_attention_fused_fwd.cpp MIX_AIC_1_2 amo_fa_fused
//   flash_attention_fused_bwd.cpp MIX_AIC_1_2 amo_fab_fused
// Nothing here has been compiled with bisheng or run on an NPU (see docs/ascend.md).
#pragma once

#include "kernels/kernel_common.h"
#include "tiling/flash_attention_tiling.h"

using namespace AscendC;

namespace amo_ascend {
namespace kernels {

// One work item as the device sees it: query rows [seqStart + qPos0, + rows) of q, keys
// [kvStart, kvStart + kvLen) of k (kvLen = 0: the item sees no key), off = Lk - Lq of its sequence
// (query qPos sees keys j <= qPos + off when causal).
struct FaItem {
  int64_t t, seq, head, seqStart, qPos0, rows, kvStart, off, kvLen, keyBlocks;
};

// Keys seen by query block [qPos0, qPos0 + rows) of a sequence with lq queries and lk keys: all lk, or
// causal the keys up to the one its last row sees (j <= qPos0 + rows - 1 + lk - lq), clamped to [0, lk].
__aicore__ inline int64_t FaKvLen(bool causal, int64_t qPos0, int64_t rows, int64_t lq, int64_t lk) {
  if (!causal) return lk;
  const int64_t n = qPos0 + rows + lk - lq;
  return n < 0 ? 0 : Min64(n, lk);
}

// The four cu_seqlens entries of sequence b (scalar GM reads of host-written data: ReadGmFresh).
struct FaSeq {
  int64_t q0, lq, k0, lk;
};
__aicore__ inline FaSeq FaReadSeq(const GlobalTensor<int64_t>& cu, const GlobalTensor<int64_t>& cuK, int64_t b) {
  FaSeq s;
  s.q0 = ReadGmFresh(cu, b);
  s.lq = ReadGmFresh(cu, b + 1) - s.q0;
  s.k0 = ReadGmFresh(cuK, b);
  s.lk = ReadGmFresh(cuK, b + 1) - s.k0;
  return s;
}

// Item `item` (query block i of head h of sequence b, read as sq) as the device sees it.
__aicore__ inline FaItem FaMakeItem(const FlashAttentionTiling& t, const FaSeq& sq, int64_t item, int64_t b,
                                    int64_t h, int64_t i) {
  FaItem it;
  it.t = item;
  it.seq = b;
  it.head = h;
  it.seqStart = sq.q0;
  it.qPos0 = i * t.baseM;
  it.rows = Min64(t.baseM, sq.lq - it.qPos0);
  it.kvStart = sq.k0;
  it.off = sq.lk - sq.lq;
  it.kvLen = FaKvLen(t.mask == FlashAttentionMask::kCausal, it.qPos0, it.rows, sq.lq, sq.lk);
  it.keyBlocks = CeilDiv(it.kvLen, t.baseN);
  return it;
}

// Walks the items in schedule order; calls op.Item(it) for those with (t * units + u) % cores == core
// for some unit u < units (units = 1 on the Cube side, 2 on the vector side: op gets the unit index).
template <typename Op>
__aicore__ inline void FaWalkOn(const FlashAttentionTiling& t, const GlobalTensor<int64_t>& cu,
                                const GlobalTensor<int64_t>& cuK, int64_t core, int64_t cores, uint32_t units, Op& op) {
  int64_t item = 0;
  for (int64_t b = 0; b < t.B; ++b) {
    const FaSeq sq = FaReadSeq(cu, cuK, b);
    const int64_t qb = CeilDiv(sq.lq, t.baseM);
    for (int64_t h = 0; h < t.H; ++h)
      for (int64_t i = 0; i < qb; ++i, ++item) {
        for (uint32_t u = 0; u < units; ++u) {
          if ((item * units + u) % cores != core) continue;
          const FaItem it = FaMakeItem(t, sq, item, b, h, i);
          op.Item(it, u);
        }
      }
  }
}

// ---- The fused kernels' deal of the items over the AI Cores --------------------------------------------
// Causal items differ in length: query block i of a sequence with Lq = Lk sees i + 1 key blocks (forward,
// backward Q pass), key block i is seen by nb - i query blocks (backward KV pass). Dealt as item % cores
// (the phase kernels' deal), the items of one core can all be long: at the Pangu shape (S = 1024, 128-row
// blocks, H = 8, 24 AI Cores) item t has t % 8 + 1 key blocks and core c took t = c, c + 24, c + 48, all
// with c % 8 + 1 blocks: 3 to 24 blocks per core for a mean of 12. The fused kernels walk each sequence's
// items longest first (block index outer: query blocks from the last, key blocks from the first; heads
// inner) and deal each item to the AI Core with the least work so far (greedy list scheduling, cost =
// the item's blocks + 1, ties to the lowest core): every core runs the same integer arithmetic over the
// same walk, so all agree without communicating (13 blocks at most at that shape). Items keep their
// number (it.t: the b-major numbering of FaWalkOn); which core runs an item changes nothing in its
// arithmetic. Scalar cost: one pass over `cores` loads per item, on every core.
struct FaDeal {
  __aicore__ inline void Init(int64_t cores) {
    n_ = cores < kFlashAttentionMaxCores ? cores : kFlashAttentionMaxCores;
    for (int64_t c = 0; c < n_; ++c) load_[c] = 0;
  }
  // the core that takes an item of `blocks` blocks
  __aicore__ inline int64_t Take(int64_t blocks) {
    int64_t best = 0;
    for (int64_t c = 1; c < n_; ++c)
      if (load_[c] < load_[best]) best = c;
    load_[best] += blocks + 1;
    return best;
  }
  int64_t n_ = 0;
  int64_t load_[kFlashAttentionMaxCores];
};

// Blocks of item i of sequence sq in the fused kernels (in closed form): forward and backward Q pass
// (item = query block i), the key blocks up to the last key its last row sees; backward KV pass (item =
// key block i), the query blocks from the first whose rows see key i * baseM to the last (every key is
// seen by the last query). For the backward, FabBlock's valid steps (its blocks are square).
__aicore__ inline int64_t FaItemBlocks(const FlashAttentionTiling& t, const FaSeq& sq, int64_t i) {
  const int64_t b = t.baseM, off = sq.lk - sq.lq;
  const bool causal = t.mask == FlashAttentionMask::kCausal;
  if (t.pass == FlashAttentionPass::kBackwardKV) {
    if (sq.lq == 0) return 0;
    const int64_t k0 = i * b, firstQ = causal && k0 - off > 0 ? k0 - off : 0;
    return CeilDiv(sq.lq, b) - firstQ / b;
  }
  const int64_t q0 = i * b;
  return CeilDiv(FaKvLen(causal, q0, Min64(b, sq.lq - q0), sq.lq, sq.lk), t.baseN);
}

// The items dealt to `core` (FaDeal), one per Next(item, sequence s, its cu entries sq, block i, head
// h), each sequence's longest first (forward and backward Q pass: query blocks from the last; KV pass:
// key blocks from the first, which the most query blocks see), heads inner; items keep the b-major
// numbering of FaWalkOn / FabItems. Every cursor replays the whole deal on its own: two cursors of one
// core see the same items in the same order (the fused kernels' stream keeps one for the blocks whose
// scores the AIC computes and one for the blocks it finishes). Scalar cost: the deal, once per cursor.
struct FaDealtCursor {
  __aicore__ inline void Init(const FlashAttentionTiling& t, const GlobalTensor<int64_t>& cu,
                              const GlobalTensor<int64_t>& cuK, int64_t core, int64_t cores) {
    t_ = &t;
    cu_ = cu;
    cuK_ = cuK;
    core_ = core;
    deal_.Init(cores);
  }
  // the next item dealt to this core; false after the last
  __aicore__ inline bool Next(int64_t& item, int64_t& s, FaSeq& sq, int64_t& i, int64_t& h) {
    const FlashAttentionTiling& t = *t_;
    const bool kv = t.pass == FlashAttentionPass::kBackwardKV;
    while (s_ < t.B) {
      if (!seqRead_) {
        sq_ = FaReadSeq(cu_, cuK_, s_);
        nb_ = CeilDiv(kv ? sq_.lk : sq_.lq, t.baseM);
        n_ = 0;
        h_ = 0;
        seqRead_ = true;
      }
      if (n_ == nb_) {  // the sequence is done
        item0_ += t.H * nb_;
        ++s_;
        seqRead_ = false;
        continue;
      }
      const int64_t bi = kv ? n_ : nb_ - 1 - n_, hh = h_;  // causal: the longest items first
      if (h_ == 0) blocks_ = FaItemBlocks(t, sq_, bi);  // the same for every head
      if (++h_ == t.H) {
        h_ = 0;
        ++n_;
      }
      if (deal_.Take(blocks_) == core_) {
        item = item0_ + hh * nb_ + bi;
        s = s_;
        sq = sq_;
        i = bi;
        h = hh;
        return true;
      }
    }
    return false;
  }

 private:
  const FlashAttentionTiling* t_ = nullptr;
  GlobalTensor<int64_t> cu_, cuK_;
  int64_t core_ = 0, s_ = 0, n_ = 0, h_ = 0, nb_ = 0, item0_ = 0, blocks_ = 0;
  bool seqRead_ = false;
  FaSeq sq_;
  FaDeal deal_;
};

template <typename Op>
__aicore__ inline void FaWalk(const FlashAttentionTiling& t, const GlobalTensor<int64_t>& cu,
                              const GlobalTensor<int64_t>& cuK, uint32_t units, Op& op) {
  FaWalkOn(t, cu, cuK, GetBlockIdx(), GetBlockNum(), units, op);
}

// The cu_seqlens_q / cu_seqlens_k tensors of an argument block.
template <typename Args>
__aicore__ inline void FaSetCu(GlobalTensor<int64_t>& cu, GlobalTensor<int64_t>& cuK, const Args& g,
                               const FlashAttentionTiling& t) {
  cu.SetGlobalBuffer(reinterpret_cast<__gm__ int64_t*>(g.cu), static_cast<uint64_t>(t.B + 1));
  cuK.SetGlobalBuffer(reinterpret_cast<__gm__ int64_t*>(g.cuK), static_cast<uint64_t>(t.B + 1));
}

// ---- Tile routines of the fused kernels' vector side (repeat-form vector instructions) -----------------
// Columns [from, n) of `rows` rows (row stride n elements) starting at row u0 of x := v: bit masks per
// 256-byte repeat, one repeat per row. E: int32_t (fp32 bits) or int16_t (16-bit bits).
template <typename E>
__aicore__ inline void FaMaskCols(const LocalTensor<E>& x, int64_t n, int64_t u0, int64_t rows, int64_t from, E v) {
  constexpr int64_t per = 256 / sizeof(E);
  const uint8_t rep = static_cast<uint8_t>(n * static_cast<int64_t>(sizeof(E)) / 32);
  for (int64_t c0 = (from / per) * per; c0 < n; c0 += per) {
    const int64_t lo = from > c0 ? from - c0 : 0, hi = Min64(per, n - c0);
    uint64_t mask[2] = {0, 0};
    for (int64_t i = lo; i < hi; ++i) mask[i / 64] |= uint64_t(1) << (i % 64);
    Duplicate(x[u0 * n + c0], v, mask, static_cast<uint8_t>(rows), 1, rep);
  }
}

// Row u of the R rows (row stride n elements) of x sees its first vis(u) columns (vis nondecreasing in u,
// as a causal block's rows are); columns [vis(u), n) := v. Per 256-byte chunk of the rows: the rows that
// see none of the chunk (a prefix) in one repeat-form Duplicate, then one Duplicate with a bit mask per
// row that sees part of it; rows that see the whole chunk are left alone. The same bits as FaMaskCols row
// by row, in about half the instructions for a causal diagonal block (its row-by-row form issued one
// instruction per row and chunk: 128 for 64 rows of 128 fp32, 1.2 us of a fused forward's vector
// time per item in the A2 model).
struct FaCausalVis {  // vis(u) = clamp(min(cols, u + c), 0)
  int64_t c, cols;
  __aicore__ inline int64_t operator()(int64_t u) const {
    const int64_t w = Min64(cols, u + c);
    return w > 0 ? w : 0;
  }
};
template <typename E, typename Vis>
__aicore__ inline void FaMaskPast(const LocalTensor<E>& x, int64_t n, int64_t R, const Vis& vis, E v) {
  constexpr int64_t per = 256 / sizeof(E);
  const uint8_t rep = static_cast<uint8_t>(n * static_cast<int64_t>(sizeof(E)) / 32);
  for (int64_t c0 = 0; c0 < n; c0 += per) {
    const int64_t hi = Min64(per, n - c0);
    int64_t full = 0;  // rows [0, full) see none of this chunk
    while (full < R && vis(full) <= c0) ++full;
    if (full > 0) {
      uint64_t mask[2] = {0, 0};
      for (int64_t i = 0; i < hi; ++i) mask[i / 64] |= uint64_t(1) << (i % 64);
      Duplicate(x[c0], v, mask, static_cast<uint8_t>(full), 1, rep);
    }
    for (int64_t u = full; u < R; ++u) {
      const int64_t w = vis(u);
      if (w >= c0 + hi) break;  // this row and the later ones see the whole chunk
      uint64_t mask[2] = {0, 0};
      for (int64_t i = w - c0; i < hi; ++i) mask[i / 64] |= uint64_t(1) << (i % 64);
      Duplicate(x[u * n + c0], v, mask, 1, 1, rep);
    }
  }
}

// x[u, c] = x[u, c] - v[u] (kSub) or x[u, c] * v[u], for the R rows (row stride `width` fp32) and
// columns [0, cols) of x; v is broadcast one 32-byte block per row by Brcb into b (up8(R) x 8 fp32).
template <bool kSub>
__aicore__ inline void FaRowScalar(const LocalTensor<float>& x, const LocalTensor<float>& v, const LocalTensor<float>& b,
                                   int64_t R, int64_t width, int64_t cols) {
  Brcb(b, v, static_cast<uint8_t>(CeilDiv(R, 8)), BrcbRepeatParams(1, 8));
  const uint8_t rep = static_cast<uint8_t>(width / 8);
  for (int64_t c0 = 0; c0 < cols; c0 += 64) {
    const uint64_t mask = static_cast<uint64_t>(Min64(64, cols - c0));
    const BinaryRepeatParams p(1, 1, 0, rep, rep, 1);
    if (kSub) Sub(x[c0], x[c0], b, mask, static_cast<uint8_t>(R), p);
    else Mul(x[c0], x[c0], b, mask, static_cast<uint8_t>(R), p);
  }
}

// Cross-core flag id of GM slot `slot` of the fused kernels' hand-off `kind` (0: S ready, 1: P ready,
// 2: O_partial / gradient products ready): kind * slots + slot, except that 11 (one of SyncAll's ids
// 11..14) is moved to 15.
__aicore__ inline uint16_t FaFlag(int64_t kind, int64_t slot) {
  const int64_t id = kind * static_cast<int64_t>(kFlashAttentionFusedSlots) + slot;
  return static_cast<uint16_t>(id >= 11 && id <= 14 ? id + 4 : id);
}
static_assert(3 * kFlashAttentionFusedSlots <= 12, "fused flash attention: flag ids 0..10 and 15 (11..14 are SyncAll's)");

// ---- Cube phases ------------------------------------------------------------------------------------
template <typename T>
class FaCube {
 public:
  // Columns of the head-dim chunk that starts at column k0 of n (the tiling's qkChunk, a multiple of
  // 16; 0 or >= n: all n, one Mmad). The callers run at least one chunk (n = 0: one Mmad of 0 columns,
  // as before the chunks).
  __aicore__ static inline int64_t ChunkCols(const FlashAttentionTiling& t, int64_t n, int64_t k0) {
    const int64_t chunk = t.qkChunk && t.qkChunk < n ? static_cast<int64_t>(t.qkChunk) : n;
    return n - k0 < chunk ? n - k0 : chunk;
  }
  // ... of Q . K^T: chunks of Dk
  __aicore__ static inline int64_t QkCols(const FlashAttentionTiling& t, int64_t k0) { return ChunkCols(t, t.Dk, k0); }
  // Forward buffers: Q parts / P on the A side, K parts / V on the B side, S / O_partial in L0C. The L1
  // budget keeps room for the fused forward's Q block (InitQ).
  __aicore__ inline void Init(const FlashAttentionTiling& t, TPipe* pipe) {
    const uint32_t dk = Up16(QkCols(t, 0)), dr = t.Dr ? Up16(t.Dr) : 0, dv = Up16(t.Dv);  // dk: one Q . K^T chunk
    uint32_t wa = dk > dr ? dk : dr;
    wa = wa > t.baseN ? wa : t.baseN;
    uint32_t wb = dk > dr ? dk : dr;
    wb = wb > dv ? wb : dv;
    const uint32_t wc = t.baseN > dv ? t.baseN : dv;
    InitSizes(pipe, t, t.baseM * wa, t.baseN * wb, t.baseM * wc, static_cast<uint64_t>(t.baseM) * (dk + dr) * sizeof(T));
  }

  // Backward buffers (square blocks b): every operand and product fits b x W, W = the widest of b and
  // the padded head dims (see compute_flash_attention_bwd_tiling).
  __aicore__ inline void InitBwd(const FlashAttentionTiling& t, TPipe* pipe) {
    uint32_t w = t.baseM;
    const uint32_t dims[3] = {static_cast<uint32_t>(Up16(QkCols(t, 0))), Up16(t.Dr), Up16(t.Dv)};  // one Dk chunk
    for (uint32_t d : dims) w = d > w ? d : w;
    InitSizes(pipe, t, t.baseM * w, t.baseM * w, t.baseM * w, 0);
  }

  // As many buffers per queue as the tiling's plan holds (its l1Buffers / l0Buffers / l0cBuffers, within
  // its L1 / L0A / L0B / L0C bytes; at least one, at most kFlashAttentionL1Buffers): with two, the MTE2
  // copies of the next Mmad's operands and the next Mmad itself run while the Fixpipe still drains the
  // previous L0C tile (the queues hand their buffers out in turn), instead of each stage waiting for the
  // one before; with four L1 buffers the operand copies run two Mmads ahead of their L1 -> L0 loads, so
  // the copies' DMA latency no longer sits between MTE2 and MTE1.
  __aicore__ inline void InitSizes(TPipe* pipe, const FlashAttentionTiling& t, uint32_t aElems, uint32_t bElems,
                                   uint32_t cElems, uint64_t l1Other) {
    const uint64_t a = static_cast<uint64_t>(aElems) * sizeof(T), b = static_cast<uint64_t>(bElems) * sizeof(T);
    const uint64_t c = static_cast<uint64_t>(cElems) * sizeof(float);
    const uint64_t l1 = t.l1Bytes > l1Other ? t.l1Bytes - l1Other : 0;
    const uint32_t n1 = Depth(t.l1Buffers, l1 / (a + b));
    const uint32_t na = Depth(t.l0Buffers, t.l0aBytes / a), nb = Depth(t.l0Buffers, t.l0bBytes / b);
    pipe->InitBuffer(l1A_, n1, static_cast<uint32_t>(a));
    pipe->InitBuffer(l1B_, n1, static_cast<uint32_t>(b));
    pipe->InitBuffer(l0A_, na, static_cast<uint32_t>(a));
    pipe->InitBuffer(l0B_, nb, static_cast<uint32_t>(b));
    pipe->InitBuffer(l0C_, Depth(t.l0cBuffers, t.l0cBytes / c), static_cast<uint32_t>(c));
  }
  __aicore__ static inline uint32_t Depth(uint32_t planned, uint64_t fit) {
    const uint64_t n = planned < fit ? planned : fit;
    return n > kFlashAttentionL1Buffers ? kFlashAttentionL1Buffers : (n < 1 ? 1 : static_cast<uint32_t>(n));
  }

  // A . B into c (rows x cols, K = kc). A is ND in GM with row stride aStride: A itself (rows x kc,
  // !transA) or A^T (kc x rows, transA: each fractal is transposed on its way to L0A). B likewise:
  // B^T (cols x kc, transB) or B (kc x cols, !transB). init: C = A.B, else C += A.B.
  // bReady: B (!transB) is already in L1, copied by PrefetchB (its queue's next tile).
  __aicore__ inline void MatMul(const LocalTensor<float>& c, const GlobalTensor<T>& a, int64_t aStride,
                                const GlobalTensor<T>& b, int64_t bStride, bool transB, int64_t rows, int64_t cols,
                                int64_t kc, bool init, bool transA = false, bool bReady = false) {
    const uint32_t mp = Up16(rows), np = Up16(cols), kp = Up16(kc);
    LocalTensor<T> a1 = l1A_.template AllocTensor<T>();
    LocalTensor<T> b1;
    if (!bReady) b1 = l1B_.template AllocTensor<T>();
    if (kc % 16) {  // K padding must be zero: the Cube sums whole K fractals
      ZeroCubeBuffer<TPosition::A1>(a1, mp * kp);
      if (!bReady) ZeroCubeBuffer<TPosition::B1>(b1, np * kp);
      PipeBarrier<PIPE_MTE2>();  // the L1 fill and the ND2NZ copy below both write L1 on MTE2
    }
    if (transA) Nd2Nz(a1, a, kc, rows, aStride, kp);  // L1 holds (k, m) fractals, m-major
    else Nd2Nz(a1, a, rows, kc, aStride, mp);        // L1 holds (m, k) fractals, k-major
    if (!bReady) {
      if (transB) Nd2Nz(b1, b, cols, kc, bStride, np);
      else Nd2Nz(b1, b, kc, cols, bStride, kp);
      l1B_.EnQue(b1);
    }
    l1A_.EnQue(a1);
    a1 = l1A_.template DeQue<T>();
    b1 = l1B_.template DeQue<T>();
    LocalTensor<T> a0 = l0A_.template AllocTensor<T>();
    LocalTensor<T> b0 = l0B_.template AllocTensor<T>();
    const uint32_t kf = kp / 16, nf = np / 16, mf = mp / 16;
    for (uint32_t i = 0; i < mf; ++i) {  // L0A zZ: (m, k) fractals row-major
      LoadData2DParams p;
      p.startIndex = static_cast<uint16_t>(transA ? i * kf : i);
      p.repeatTimes = static_cast<uint8_t>(kf);
      p.srcStride = static_cast<uint16_t>(transA ? 1 : mf);
      p.ifTranspose = transA;
      LoadData(a0[i * kf * 256], a1, p);
    }
    for (uint32_t i = 0; i < kf; ++i) {  // L0B zN: (k, n) grid row-major, fractals n-major
      LoadData2DParams p;
      if (transB) {  // L1 holds (n, k) fractals: already n-major
        p.startIndex = static_cast<uint16_t>(i * nf);
        p.srcStride = 1;
        p.ifTranspose = false;
      } else {  // L1 holds (k, n) fractals: transpose each
        p.startIndex = static_cast<uint16_t>(i);
        p.srcStride = static_cast<uint16_t>(kf);
        p.ifTranspose = true;
      }
      p.repeatTimes = static_cast<uint8_t>(nf);
      LoadData(b0[i * nf * 256], b1, p);
    }
    l1A_.FreeTensor(a1);
    l1B_.FreeTensor(b1);
    l0A_.EnQue(a0);
    l0B_.EnQue(b0);
    a0 = l0A_.template DeQue<T>();
    b0 = l0B_.template DeQue<T>();
    MmadParams mm;
    mm.m = MmadM(rows);  // never 1: A2 would run GEMV on the zZ tile
    mm.n = static_cast<uint16_t>(cols);
    mm.k = static_cast<uint16_t>(kc);
    mm.cmatrixInitVal = init;
    // A2: an Mmad accumulating onto the previous one's small L0C tile must wait for it
    if (!init && (mp / 16) * (np / 16) < 10) PipeBarrier<PIPE_M>();
    Mmad(c, a0, b0, mm);
    l0A_.FreeTensor(a0);
    l0B_.FreeTensor(b0);
  }

  // B into the next L1 B tile (K padding zeroed), enqueued: B^T (cols x kc, transB) or B (kc x cols).
  __aicore__ inline void CopyB(const GlobalTensor<T>& b, int64_t bStride, bool transB, int64_t cols, int64_t kc) {
    const uint32_t np = Up16(cols), kp = Up16(kc);
    LocalTensor<T> b1 = l1B_.template AllocTensor<T>();
    if (kc % 16) {
      ZeroCubeBuffer<TPosition::B1>(b1, np * kp);
      PipeBarrier<PIPE_MTE2>();
    }
    if (transB) Nd2Nz(b1, b, cols, kc, bStride, np);
    else Nd2Nz(b1, b, kc, cols, bStride, kp);
    l1B_.EnQue(b1);
  }
  // B (kc x cols, !transB) of the next MatMul(..., bReady = true) copied into L1 now: the fused
  // forward copies V_j while it waits for its AIVs' P_j (V_j does not depend on P_j).
  __aicore__ inline void PrefetchB(const GlobalTensor<T>& b, int64_t bStride, int64_t cols, int64_t kc) {
    CopyB(b, bStride, false, cols, kc);
  }

  // ---- fused forward: the item's Q block stays in L1 across its key blocks ----------------------
  // qL1_ holds Q_nope (mp x up16(Dk), NZ: (m, k) fractals k-major) and after it Q_rope (mp x up16(Dr)).
  __aicore__ inline void InitQ(const FlashAttentionTiling& t, TPipe* pipe) {
    pipe->InitBuffer(qL1_, 1, t.baseM * (Up16(t.Dk) + (t.Dr ? Up16(t.Dr) : 0)) * sizeof(T));
  }
  __aicore__ inline void LoadQ(const FlashAttentionTiling& t, const GlobalTensor<T>& q, int64_t qRow, int64_t h,
                               int64_t rows) {
    const int64_t dq = t.Dk + t.Dr;
    const uint32_t mp = Up16(rows), kn = Up16(t.Dk), kr = t.Dr ? Up16(t.Dr) : 0;
    q1_ = qL1_.template AllocTensor<T>();
    PipeBarrier<PIPE_MTE2>();  // the previous item's Q writes of this buffer (same pipe) come first
    if (t.Dk % 16 || t.Dr % 16) {  // K padding must be zero: the Cube sums whole K fractals
      ZeroCubeBuffer<TPosition::A1>(q1_, mp * (kn + kr));
      PipeBarrier<PIPE_MTE2>();
    }
    Nd2Nz(q1_, q[(qRow * t.H + h) * dq], rows, t.Dk, t.H * dq, mp);
    if (t.Dr) {
      // ordered explicitly: without it the pipe model reports the two ND2NZ copies into this buffer
      // as overlapping MTE2 writes (rows = 19, Dk = 40, Dr = 8 in the emulator tests)
      PipeBarrier<PIPE_MTE2>();
      Nd2Nz(q1_[mp * kn], q[(qRow * t.H + h) * dq + t.Dk], rows, t.Dr, t.H * dq, mp);
    }
    qL1_.EnQue(q1_);
    q1_ = qL1_.template DeQue<T>();
  }
  __aicore__ inline void FreeQ() { qL1_.FreeTensor(q1_); }

  // S for key rows [kRow, kRow + cols) of head h against the Q block in L1 (LoadQ): the same two
  // Mmads as Scores, A taken from L1.
  __aicore__ inline void ScoresQ(const LocalTensor<float>& c, const FlashAttentionTiling& t, const GlobalTensor<T>& k,
                                 const GlobalTensor<T>& kr, int64_t kRow, int64_t h, int64_t rows, int64_t cols) {
    // Q_nope . K^T in column chunks of the head dim (t.qkChunk): chunk k0 of Q starts at element
    // up16(rows) * k0 of the NZ block ((m, k) fractals k-major)
    int64_t k0 = 0;
    do {
      const int64_t w = QkCols(t, k0);
      MatMulQ(c, static_cast<uint32_t>(Up16(rows) * k0), k[(kRow * t.H + h) * t.Dk + k0], t.H * t.Dk, rows, cols, w,
              k0 == 0);
      k0 += w;
    } while (k0 < t.Dk);
    if (t.rope == FlashAttentionRope::kSharedKey)
      MatMulQ(c, Up16(rows) * Up16(t.Dk), kr[kRow * t.Dr], t.Dr, rows, cols, t.Dr, false);
  }

  // c (+)= Q_part . B^T with Q_part at element aOff of the L1 Q block (mp x up16(kc), NZ) and B^T
  // (cols x kc) from GM.
  __aicore__ inline void MatMulQ(const LocalTensor<float>& c, uint32_t aOff, const GlobalTensor<T>& b, int64_t bStride,
                                 int64_t rows, int64_t cols, int64_t kc, bool init) {
    const uint32_t mp = Up16(rows), np = Up16(cols), kp = Up16(kc);
    CopyB(b, bStride, true, cols, kc);
    LocalTensor<T> b1 = l1B_.template DeQue<T>();
    LocalTensor<T> a0 = l0A_.template AllocTensor<T>();
    LocalTensor<T> b0 = l0B_.template AllocTensor<T>();
    const uint32_t kf = kp / 16, nf = np / 16, mf = mp / 16;
    for (uint32_t i = 0; i < mf; ++i) {  // L0A zZ
      LoadData2DParams p;
      p.startIndex = static_cast<uint16_t>(i);
      p.repeatTimes = static_cast<uint8_t>(kf);
      p.srcStride = static_cast<uint16_t>(mf);
      p.ifTranspose = false;
      LoadData(a0[i * kf * 256], q1_[aOff], p);
    }
    for (uint32_t i = 0; i < kf; ++i) {  // L0B zN: L1 holds (n, k) fractals, already n-major
      LoadData2DParams p;
      p.startIndex = static_cast<uint16_t>(i * nf);
      p.srcStride = 1;
      p.ifTranspose = false;
      p.repeatTimes = static_cast<uint8_t>(nf);
      LoadData(b0[i * nf * 256], b1, p);
    }
    l1B_.FreeTensor(b1);
    l0A_.EnQue(a0);
    l0B_.EnQue(b0);
    a0 = l0A_.template DeQue<T>();
    b0 = l0B_.template DeQue<T>();
    MmadParams mm;
    mm.m = MmadM(rows);
    mm.n = static_cast<uint16_t>(cols);
    mm.k = static_cast<uint16_t>(kc);
    mm.cmatrixInitVal = init;
    if (!init && (mp / 16) * (np / 16) < 10) PipeBarrier<PIPE_M>();
    Mmad(c, a0, b0, mm);
    l0A_.FreeTensor(a0);
    l0B_.FreeTensor(b0);
  }

  // S = Q_nope . K^T (+ Q_rope . K_rope^T as a second Mmad into the same L0C tile: k_rope is read once
  // per key block, never expanded per head) for query rows [qRow, qRow + rows) and key rows
  // [kRow, kRow + cols) of head h.
  __aicore__ inline void Scores(const LocalTensor<float>& c, const FlashAttentionTiling& t, const GlobalTensor<T>& q,
                                const GlobalTensor<T>& k, const GlobalTensor<T>& kr, int64_t qRow, int64_t kRow,
                                int64_t h, int64_t rows, int64_t cols) {
    const int64_t dq = t.Dk + t.Dr;
    int64_t k0 = 0;
    do {  // Q_nope . K^T in column chunks of the head dim (t.qkChunk)
      const int64_t w = QkCols(t, k0);
      MatMul(c, q[(qRow * t.H + h) * dq + k0], t.H * dq, k[(kRow * t.H + h) * t.Dk + k0], t.H * t.Dk, true, rows, cols,
             w, k0 == 0);
      k0 += w;
    } while (k0 < t.Dk);
    if (t.rope == FlashAttentionRope::kSharedKey)
      MatMul(c, q[(qRow * t.H + h) * dq + t.Dk], t.H * dq, kr[kRow * t.Dr], t.Dr, true, rows, cols, t.Dr, false);
  }

  __aicore__ inline void Store(const GlobalTensor<float>& dst, LocalTensor<float>& c, int64_t rows, int64_t cols,
                               int64_t dstStride) {
    l0C_.EnQue(c);
    c = l0C_.template DeQue<float>();
    FixpipeParamsV220 fp;
    fp.nSize = static_cast<uint16_t>(cols);
    fp.mSize = static_cast<uint16_t>(rows);
    fp.srcStride = static_cast<uint16_t>(Up16(rows));
    fp.dstStride = static_cast<uint32_t>(dstStride);
    fp.quantPre = QuantMode_t::NoQuant;
    Fixpipe(dst, c, fp);
    l0C_.FreeTensor(c);
  }

  FlashAttentionTiling t_;
  TQue<TPosition::A1, 1> l1A_;
  TQue<TPosition::B1, 1> l1B_;
  TQue<TPosition::A2, 1> l0A_;
  TQue<TPosition::B2, 1> l0B_;
  TQue<TPosition::CO1, 1> l0C_;
  TQue<TPosition::A1, 1> qL1_;  // fused forward only (InitQ)
  LocalTensor<T> q1_;
};

using FaGm = FlashAttentionFwdArgs;  // device addresses as uint64 (tiling/flash_attention_tiling.h)

template <typename T>
class FaQk {
 public:
  __aicore__ inline void Run(const FaGm& g, const FlashAttentionTiling& t) {
    TPipe pipe;
    cube_.Init(t, &pipe);
    t_ = t;
    const int64_t dq = t.Dk + t.Dr;
    q_.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(g.q), static_cast<uint64_t>(t.T * t.H * dq));
    k_.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(g.k), static_cast<uint64_t>(t.Tk * t.H * t.Dk));
    if (t.Dr) kr_.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(g.kRope), static_cast<uint64_t>(t.Tk * t.Dr));
    FaSetCu(cu_, cuK_, g, t);
    s_.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(g.s));
    FaWalk(t, cu_, cuK_, 1, *this);
  }
  __aicore__ inline void Item(const FaItem& it, uint32_t) {
    if (static_cast<int64_t>(t_.step) >= it.keyBlocks) return;
    const int64_t k0 = static_cast<int64_t>(t_.step) * t_.baseN, cols = Min64(t_.baseN, it.kvLen - k0);
    const int64_t qRow = it.seqStart + it.qPos0, kRow = it.kvStart + k0;
    LocalTensor<float> c = cube_.l0C_.template AllocTensor<float>();
    cube_.Scores(c, t_, q_, k_, kr_, qRow, kRow, it.head, it.rows, cols);
    cube_.Store(s_[it.t * t_.baseM * t_.baseN], c, it.rows, cols, t_.baseN);
  }

 private:
  FaCube<T> cube_;
  FlashAttentionTiling t_;
  GlobalTensor<T> q_, k_, kr_;
  GlobalTensor<int64_t> cu_, cuK_;
  GlobalTensor<float> s_;
};

template <typename T>
class FaPv {
 public:
  __aicore__ inline void Run(const FaGm& g, const FlashAttentionTiling& t) {
    TPipe pipe;
    cube_.Init(t, &pipe);
    t_ = t;
    v_.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(g.v), static_cast<uint64_t>(t.Tk * t.H * t.Dv));
    p_.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(g.p));
    FaSetCu(cu_, cuK_, g, t);
    o_.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(g.oPart));
    FaWalk(t, cu_, cuK_, 1, *this);
  }
  __aicore__ inline void Item(const FaItem& it, uint32_t) {
    if (static_cast<int64_t>(t_.step) >= it.keyBlocks) return;
    const int64_t k0 = static_cast<int64_t>(t_.step) * t_.baseN, cols = Min64(t_.baseN, it.kvLen - k0);
    const int64_t kRow = it.kvStart + k0;
    LocalTensor<float> c = cube_.l0C_.template AllocTensor<float>();
    cube_.MatMul(c, p_[it.t * t_.baseM * t_.baseN], t_.baseN, v_[(kRow * t_.H + it.head) * t_.Dv], t_.H * t_.Dv, false,
                 it.rows, t_.Dv, cols, true);
    cube_.Store(o_[it.t * t_.baseM * Up8(t_.Dv)], c, it.rows, t_.Dv, Up8(t_.Dv));
  }

 private:
  FaCube<T> cube_;
  FlashAttentionTiling t_;
  GlobalTensor<T> v_, p_;
  GlobalTensor<int64_t> cu_, cuK_;
  GlobalTensor<float> o_;
};

// ---- Vector phases ----------------------------------------------------------------------------------
// Online-softmax state of one query row: running max m, running sum l, and the rescale factor
// alpha = exp(m_old - m_new) of the last step.
struct FaRowState {
  float m, l, alpha;
};

// Vector-side row work of the forward, shared by the phase kernels (state and O in GM workspaces) and
// the fused kernel (state and O in UB): the same instructions in the same order in both.
template <typename T>
class FaRows {
 public:
  __aicore__ inline void Init(TPipe& pipe, const FlashAttentionTiling& t, bool softmax, bool finish) {
    t_ = t;
    if (softmax) {
      pipe.InitBuffer(sBuf_, t.baseN * sizeof(float));
      pipe.InitBuffer(pBuf_, t.baseN * sizeof(T));
      pipe.InitBuffer(work_, ReduceMaxWorkFloats(t.baseN) * sizeof(float));
    }
    pipe.InitBuffer(red_, 8 * sizeof(float));
    if (finish) pipe.InitBuffer(outBuf_, Up16(t.Dv) * sizeof(T));
  }

  // One online-softmax step against the key block [k0, k0 + cols) of a query row whose last visible
  // key is lastKey (causal: its position + Lk - Lq): the P row (input dtype, baseN wide, pad columns
  // exactly zero) from the score row sRow to pRow, and the row's new state from `old` (ignored at the
  // item's first block). A row whose keys are all masked in this block gets a zero P row and keeps its
  // state (alpha = 1); a row that sees no key at all keeps l = 0 (FinishRow: out 0, lse -inf).
  __aicore__ inline FaRowState SoftmaxRow(const GlobalTensor<float>& sRow, const GlobalTensor<T>& pRow,
                                          int64_t lastKey, int64_t k0, int64_t cols, bool first,
                                          const FaRowState& old) {
    LocalTensor<float> s = sBuf_.Get<float>(), work = work_.Get<float>(), red = red_.Get<float>();
    LocalTensor<T> p = pBuf_.Get<T>();
    const int64_t valid = t_.mask == FlashAttentionMask::kCausal ? Min64(cols, lastKey - k0 + 1) : cols;
    FaRowState st{old.m, old.l, 1.0f};
    ZeroFill(p, t_.baseN);
    if (valid > 0) {
      SetFlag<HardEvent::V_MTE2>(EVENT_ID0);  // the previous row's vector reads of s are done (not auto-synced)
      WaitFlag<HardEvent::V_MTE2>(EVENT_ID0);
      DataCopy(s, sRow, t_.baseN);
      SetFlag<HardEvent::MTE2_V>(EVENT_ID0);
      WaitFlag<HardEvent::MTE2_V>(EVENT_ID0);
      const int32_t n = static_cast<int32_t>(valid);
      Muls(s, s, t_.softmaxScale, n);
      ReduceMax(red, s, work, n);
      SetFlag<HardEvent::V_S>(EVENT_ID0);
      WaitFlag<HardEvent::V_S>(EVENT_ID0);
      const float rowMax = red.GetValue(0);
      const float mOld = first ? rowMax : old.m;
      st.m = mOld > rowMax ? mOld : rowMax;
      st.alpha = 0.0f;
      if (!first) {  // alpha = exp(m_old - m_new) on the vector unit
        Duplicate(red, mOld - st.m, 8);
        Exp(red, red, 8);
        SetFlag<HardEvent::V_S>(EVENT_ID0);
        WaitFlag<HardEvent::V_S>(EVENT_ID0);
        st.alpha = red.GetValue(0);
      }
      Adds(s, s, -st.m, n);
      Exp(s, s, n);
      ReduceSum(red, s, work, n);
      SetFlag<HardEvent::V_S>(EVENT_ID0);
      WaitFlag<HardEvent::V_S>(EVENT_ID0);
      st.l = (first ? 0.0f : old.l) * st.alpha + red.GetValue(0);
      Cast(p, s, RoundMode::CAST_RINT, static_cast<uint32_t>(n));
    }
    SetFlag<HardEvent::V_MTE3>(EVENT_ID0);
    WaitFlag<HardEvent::V_MTE3>(EVENT_ID0);
    DataCopy(pRow, p, t_.baseN);
    SetFlag<HardEvent::MTE3_V>(EVENT_ID0);
    WaitFlag<HardEvent::MTE3_V>(EVENT_ID0);
    return st;
  }

  // dst[0] = v through UB and a 4-byte DMA (never the scalar data cache), ordered against the vector
  // unit's next use of the red buffer.
  __aicore__ inline void StoreScalar(const GlobalTensor<float>& dst, float v) {
    LocalTensor<float> red = red_.Get<float>();
    SetFlag<HardEvent::V_S>(EVENT_ID0);
    WaitFlag<HardEvent::V_S>(EVENT_ID0);
    red.SetValue(0, v);
    SetFlag<HardEvent::S_MTE3>(EVENT_ID0);
    WaitFlag<HardEvent::S_MTE3>(EVENT_ID0);
    StoreElement(dst, red);
    SetFlag<HardEvent::MTE3_V>(EVENT_ID0);
    WaitFlag<HardEvent::MTE3_V>(EVENT_ID0);
    SetFlag<HardEvent::MTE3_S>(EVENT_ID0);
    WaitFlag<HardEvent::MTE3_S>(EVENT_ID0);
  }

  // After the item's last key block: out row = O / l in the input dtype to outRow, lse[lseIdx] =
  // m + ln(l). o: the row's fp32 accumulator (Up8(Dv) wide, scaled in place). A row that saw no key
  // (l = 0; its P rows and so o are exactly 0) gets out 0 and lse -inf; only such a row: a NaN l (a NaN
  // or +inf score) keeps out NaN and lse NaN, or +inf where the row's max m is +inf (the reference's
  // logsumexp), as in FinishTile of the fused kernel.
  __aicore__ inline void FinishRow(const LocalTensor<float>& o, float m, float l, const GlobalTensor<T>& outRow,
                                   GlobalTensor<float>& lse, int64_t lseIdx) {
    LocalTensor<T> outT = outBuf_.Get<T>();
    LocalTensor<float> red = red_.Get<float>();
    const bool seen = !(l == 0.0f);  // true for a NaN l
    Muls(o, o, seen ? 1.0f / l : 0.0f, static_cast<int32_t>(Up8(t_.Dv)));
    Cast(outT, o, RoundMode::CAST_RINT, static_cast<uint32_t>(t_.Dv));
    if (seen && m > 3.4028235e38f) {  // a +inf score: lse = m = +inf, as the reference's logsumexp
      Duplicate(red, m, 8);
    } else if (seen) {
      Duplicate(red, l, 8);
      Ln(red, red, 8);
      Adds(red, red, m, 8);  // lse = m + ln(l), stored by DMA: rows of other cores share its 64-byte line
    } else {
      NegInfFill(red);
    }
    SetFlag<HardEvent::V_MTE3>(EVENT_ID0);
    WaitFlag<HardEvent::V_MTE3>(EVENT_ID0);
    CopyRowOut(outRow, outT, static_cast<uint32_t>(t_.Dv));
    StoreElement(lse[lseIdx], red);
    SetFlag<HardEvent::MTE3_V>(EVENT_ID0);
    WaitFlag<HardEvent::MTE3_V>(EVENT_ID0);
  }

  // A row of an item without any key block: out row 0, lse -inf.
  __aicore__ inline void EmptyRow(const GlobalTensor<T>& outRow, GlobalTensor<float>& lse, int64_t lseIdx) {
    LocalTensor<T> outT = outBuf_.Get<T>();
    LocalTensor<float> red = red_.Get<float>();
    ZeroFill(outT, Up16(t_.Dv));
    NegInfFill(red);
    SetFlag<HardEvent::V_MTE3>(EVENT_ID0);
    WaitFlag<HardEvent::V_MTE3>(EVENT_ID0);
    CopyRowOut(outRow, outT, static_cast<uint32_t>(t_.Dv));
    StoreElement(lse[lseIdx], red);
    SetFlag<HardEvent::MTE3_V>(EVENT_ID0);
    WaitFlag<HardEvent::MTE3_V>(EVENT_ID0);
  }

 private:
  // 8 fp32 -inf (bit pattern 0xFF800000 through an integer view: no inf literal in device code)
  __aicore__ inline void NegInfFill(const LocalTensor<float>& red) {
    Duplicate(red.template ReinterpretCast<int32_t>(), static_cast<int32_t>(0xFF800000u), 8);
  }

  FlashAttentionTiling t_;
  TBuf<TPosition::VECCALC> sBuf_, pBuf_, work_, red_, outBuf_;
};

// state workspace per item: [3][baseM] fp32 = row max m, row sum l, rescale alpha.
template <typename T>
class FaSoftmax {
 public:
  __aicore__ inline void Run(const FaGm& g, const FlashAttentionTiling& t) {
    TPipe pipe;
    t_ = t;
    rows_.Init(pipe, t, true, false);
    FaSetCu(cu_, cuK_, g, t);
    s_.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(g.s));
    p_.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(g.p));
    st_.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(g.state));
    FaWalk(t, cu_, cuK_, static_cast<uint32_t>(CeilDiv(t.baseM, t.vecRows)), *this);
  }
  __aicore__ inline void Item(const FaItem& it, uint32_t half) {
    const int64_t j = t_.step;
    if (j >= it.keyBlocks) return;
    const int64_t k0 = j * t_.baseN, cols = Min64(t_.baseN, it.kvLen - k0);
    const int64_t r0 = half * t_.vecRows, r1 = Min64(it.rows, r0 + t_.vecRows);
    const int64_t stBase = it.t * 3 * t_.baseM;
    for (int64_t r = r0; r < r1; ++r) {
      FaRowState old{0.0f, 0.0f, 0.0f};
      if (j != 0) {
        old.m = ReadGmFresh(st_, stBase + r);  // written by the previous step's launch
        old.l = ReadGmFresh(st_, stBase + t_.baseM + r);
      }
      const int64_t row = (it.t * t_.baseM + r) * t_.baseN;
      const FaRowState st = rows_.SoftmaxRow(s_[row], p_[row], it.qPos0 + r + it.off, k0, cols, j == 0, old);
      // DMA stores, not scalar SetValue: the state rows of the two AIV units of an item share 64-byte
      // lines (vecRows = 8 floats at baseM = 16), and a data-cache write-back would lose the other's.
      rows_.StoreScalar(st_[stBase + r], st.m);
      rows_.StoreScalar(st_[stBase + t_.baseM + r], st.l);
      rows_.StoreScalar(st_[stBase + 2 * t_.baseM + r], st.alpha);
    }
  }

 private:
  FlashAttentionTiling t_;
  FaRows<T> rows_;
  GlobalTensor<int64_t> cu_, cuK_;
  GlobalTensor<float> s_, st_;
  GlobalTensor<T> p_;
};

template <typename T>
class FaUpdate {
 public:
  __aicore__ inline void Run(const FaGm& g, const FlashAttentionTiling& t) {
    TPipe pipe;
    t_ = t;
    dva_ = Up8(t.Dv);
    pipe.InitBuffer(oBuf_, dva_ * sizeof(float));
    pipe.InitBuffer(pvBuf_, dva_ * sizeof(float));
    rows_.Init(pipe, t, false, true);
    FaSetCu(cu_, cuK_, g, t);
    oPart_.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(g.oPart));
    o_.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(g.o));
    st_.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(g.state));
    out_.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(g.out), static_cast<uint64_t>(t.T * t.H * t.Dv));
    lse_.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(g.lse), static_cast<uint64_t>(t.H * t.T));
    FaWalk(t, cu_, cuK_, static_cast<uint32_t>(CeilDiv(t.baseM, t.vecRows)), *this);
  }
  __aicore__ inline void Item(const FaItem& it, uint32_t half) {
    const int64_t j = t_.step;
    const int64_t r0 = half * t_.vecRows, r1 = Min64(it.rows, r0 + t_.vecRows);
    if (it.keyBlocks == 0) {  // the item sees no key: out 0, lse -inf, written at step 0
      if (j != 0) return;
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t tok = it.seqStart + it.qPos0 + r;
        rows_.EmptyRow(out_[(tok * t_.H + it.head) * t_.Dv], lse_, it.head * t_.T + tok);
      }
      return;
    }
    if (j >= it.keyBlocks) return;
    const bool last = j + 1 == it.keyBlocks;
    LocalTensor<float> o = oBuf_.Get<float>(), pv = pvBuf_.Get<float>();
    const int64_t stBase = it.t * 3 * t_.baseM;
    const int32_t dva = static_cast<int32_t>(dva_);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t wsRow = (it.t * t_.baseM + r) * dva_;
      SetFlag<HardEvent::V_MTE2>(EVENT_ID0);  // o / pv are reloaded: the previous row's vector reads are done
      WaitFlag<HardEvent::V_MTE2>(EVENT_ID0);
      if (j == 0) {
        DataCopy(o, oPart_[wsRow], dva_);
        SetFlag<HardEvent::MTE2_V>(EVENT_ID0);
        WaitFlag<HardEvent::MTE2_V>(EVENT_ID0);
      } else {
        DataCopy(o, o_[wsRow], dva_);
        DataCopy(pv, oPart_[wsRow], dva_);
        SetFlag<HardEvent::MTE2_V>(EVENT_ID0);
        WaitFlag<HardEvent::MTE2_V>(EVENT_ID0);
        const float alpha = ReadGmFresh(st_, stBase + 2 * t_.baseM + r);
        Muls(o, o, alpha, dva);
        Add(o, o, pv, dva);
      }
      if (!last) {
        SetFlag<HardEvent::V_MTE3>(EVENT_ID0);
        WaitFlag<HardEvent::V_MTE3>(EVENT_ID0);
        DataCopy(o_[wsRow], o, dva_);
        SetFlag<HardEvent::MTE3_V>(EVENT_ID0);
        WaitFlag<HardEvent::MTE3_V>(EVENT_ID0);
        continue;
      }
      const int64_t tok = it.seqStart + it.qPos0 + r;
      rows_.FinishRow(o, ReadGmFresh(st_, stBase + r), ReadGmFresh(st_, stBase + t_.baseM + r),
                      out_[(tok * t_.H + it.head) * t_.Dv], lse_, it.head * t_.T + tok);
    }
  }

 private:
  FlashAttentionTiling t_;
  uint32_t dva_ = 0;
  FaRows<T> rows_;
  TBuf<TPosition::VECCALC> oBuf_, pvBuf_;
  GlobalTensor<int64_t> cu_, cuK_;
  GlobalTensor<float> oPart_, o_, st_, lse_;
  GlobalTensor<T> out_;
};

// ==== Backward ========================================================================================
// Two passes over the same square blocks (b = baseM = baseN), so every gradient row has one writer and
// nothing needs atomics (deterministic):
//   KV pass: item (sequence, head, key block j), steps over the query blocks i -> dK_j, dV_j and the
//            per-head dK_rope_j (summed over heads afterwards by amo_fab_dkrope, in head order);
//   Q pass : item (sequence, head, query block i), steps over the key blocks j -> dQ_i.
// Per step, four phase launches exchange data through GM workspaces (as in the forward):
//   amo_fab_qk      (AIC) S = Q K^T (+ Q_rope K_rope^T, second Mmad into the same L0C tile), dP = dO V^T
//   amo_fab_softmax (AIV) P = exp(scale * S - lse) (causal columns 0), dS = P * (dP - delta), both rounded
//                   to the input dtype for the Cube (as the forward rounds P)
//   amo_fab_grad    (AIC) KV pass: dV += P^T dO, dK += dS^T Q_nope, dK_rope += dS^T Q_rope (transposed
//                   L0A loads); Q pass: dQ_nope += dS K, dQ_rope += dS K_rope -> `part` workspace
//   amo_fab_acc     (AIV) acc += part in fp32; at the item's last step, dK/dQ = scale * acc in the input
//                   dtype, dV = acc, per-head dK_rope = scale * acc (fp32)
// before: amo_fab_delta (AIV) delta = rowsum(dO * O) in fp32 per (token, head).
// Nothing here has been compiled with bisheng or run on an NPU (see docs/ascend.md).

// One item at one step of a backward pass.
struct FabItem {
  int64_t t, head;
  int64_t seqStart;     // first query row of the sequence in q
  int64_t kvStart;      // first key row of the sequence in k
  int64_t qPos0, rows;  // query rows [qPos0, qPos0 + rows) of the sequence
  int64_t k0, cols;     // key rows [k0, k0 + cols) of the sequence
  int64_t lenQ, lenK;   // queries and keys of the sequence (causal: query i sees keys j <= i + lenK - lenQ)
  bool first;           // first (unmasked) step of the item (fused kernel: start the running sums)
  bool last;            // last step of the item: write its gradient rows
};

// Geometry of item block i of sequence sq at `step` for the pass of t; false when the item has no
// (unmasked) block at that step. KV pass: item = key block i, step = query block; Q pass: item =
// query block i, step = key block (up to the last key its last row sees). Fills it.k0 / cols (KV pass)
// or it.qPos0 / rows (Q pass), the item's own rows, in any case.
__aicore__ inline bool FabBlock(const FlashAttentionTiling& t, const FaSeq& sq, int64_t i, int64_t step, FabItem& it) {
  const int64_t b = t.baseM, off = sq.lk - sq.lq;
  const bool causal = t.mask == FlashAttentionMask::kCausal;
  it.seqStart = sq.q0;
  it.kvStart = sq.k0;
  it.lenQ = sq.lq;
  it.lenK = sq.lk;
  if (t.pass == FlashAttentionPass::kBackwardKV) {
    it.k0 = i * b;
    it.cols = Min64(b, sq.lk - it.k0);
    it.qPos0 = step * b;
    if (it.qPos0 >= sq.lq) return false;
    it.rows = Min64(b, sq.lq - it.qPos0);
    if (causal && it.qPos0 + it.rows - 1 + off < it.k0) return false;  // block entirely above the diagonal
    // causal: the first query block whose rows see key k0 (query k0 - off; every key is seen by the
    // last query, so the item has blocks whenever lq > 0)
    const int64_t firstQ = causal && it.k0 - off > 0 ? it.k0 - off : 0;
    it.first = step == firstQ / b;
    it.last = step == CeilDiv(sq.lq, b) - 1;
    return true;
  }
  it.qPos0 = i * b;
  it.rows = Min64(b, sq.lq - it.qPos0);
  const int64_t kvLen = FaKvLen(causal, it.qPos0, it.rows, sq.lq, sq.lk);
  it.k0 = step * b;
  if (it.k0 >= kvLen) return false;
  it.cols = Min64(b, kvLen - it.k0);
  it.first = step == 0;
  it.last = step == CeilDiv(kvLen, b) - 1;
  return true;
}

// An item without any block (KV pass: the sequence has no query; Q pass: the block's rows see no
// key): its gradient rows are zero. Fills the item's own rows of it (as FabBlock).
__aicore__ inline bool FabEmpty(const FlashAttentionTiling& t, const FaSeq& sq, int64_t i, FabItem& it) {
  FabBlock(t, sq, i, 0, it);
  if (t.pass == FlashAttentionPass::kBackwardKV) return sq.lq == 0;
  return FaKvLen(t.mask == FlashAttentionMask::kCausal, it.qPos0, it.rows, sq.lq, sq.lk) == 0;
}

// Calls visit.Visit(item, sequence, block i, head) for every item in schedule order (sequences, then
// heads, then blocks: the numbering of FaWalk; the KV pass's blocks are key blocks, the Q pass's
// query blocks). (Visitors are structs with __aicore__ members, not lambdas: device code calls only
// __aicore__ functions.)
template <typename Visitor>
__aicore__ inline void FabItems(const FlashAttentionTiling& t, const GlobalTensor<int64_t>& cu,
                                const GlobalTensor<int64_t>& cuK, Visitor& visit) {
  int64_t item = 0;
  const bool kv = t.pass == FlashAttentionPass::kBackwardKV;
  for (int64_t s = 0; s < t.B; ++s) {
    const FaSeq sq = FaReadSeq(cu, cuK, s);
    const int64_t nb = CeilDiv(kv ? sq.lk : sq.lq, t.baseM);
    for (int64_t h = 0; h < t.H; ++h)
      for (int64_t i = 0; i < nb; ++i, ++item) visit.Visit(item, sq, i, h);
  }
}

// Phase kernels: the blocks of t.pass at step t.step; op.Item(it, u) for the units u < units with
// (t * units + u) % cores == core; an item without blocks: op.Empty(it, u) at step 0.
template <typename Op>
struct FabStepVisitor {
  __aicore__ inline void Visit(int64_t item, const FaSeq& sq, int64_t i, int64_t h) {
    FabItem it;
    it.t = item;
    it.head = h;
    if (FabEmpty(*t, sq, i, it)) {
      if (t->step != 0) return;
      for (uint32_t u = 0; u < units; ++u)
        if ((item * units + u) % cores == core) op->Empty(it, u);
      return;
    }
    if (!FabBlock(*t, sq, i, t->step, it)) return;
    for (uint32_t u = 0; u < units; ++u)
      if ((item * units + u) % cores == core) op->Item(it, u);
  }
  const FlashAttentionTiling* t;
  int64_t core, cores;
  uint32_t units;
  Op* op;
};

template <typename Op>
__aicore__ inline void FabWalk(const FlashAttentionTiling& t, const GlobalTensor<int64_t>& cu,
                               const GlobalTensor<int64_t>& cuK, uint32_t units, Op& op) {
  FabStepVisitor<Op> v{&t, GetBlockIdx(), GetBlockNum(), units, &op};
  FabItems(t, cu, cuK, v);
}

// One backward item's blocks: At(step, it) fills the block at `step` (false where that step has no
// unmasked block; the valid steps are a contiguous range: causal masking only trims the ends).
struct FabNth {
  __aicore__ inline bool At(int64_t step, FabItem& it) const {
    it.t = item;
    it.head = head;
    return FabBlock(*t, sq, i, step, it);
  }
  const FlashAttentionTiling* t;
  int64_t item;
  FaSeq sq;
  int64_t i, head;
};

template <typename T>
struct FabTensors {
  __aicore__ inline void Set(const FlashAttentionBwdArgs& g, const FlashAttentionTiling& t) {
    const int64_t dq = t.Dk + t.Dr;
    q.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(g.q), static_cast<uint64_t>(t.T * t.H * dq));
    k.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(g.k), static_cast<uint64_t>(t.Tk * t.H * t.Dk));
    v.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(g.v), static_cast<uint64_t>(t.Tk * t.H * t.Dv));
    if (t.Dr) kr.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(g.kRope), static_cast<uint64_t>(t.Tk * t.Dr));
    dout.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(g.dout), static_cast<uint64_t>(t.T * t.H * t.Dv));
    out.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(g.out), static_cast<uint64_t>(t.T * t.H * t.Dv));
    lse.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(g.lse), static_cast<uint64_t>(t.H * t.T));
    delta.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(g.delta), static_cast<uint64_t>(t.T * t.H));
    FaSetCu(cu, cuK, g, t);
    s.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(g.s));
    dp.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(g.dp));
    p.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(g.p));
    ds.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(g.ds));
    part.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(g.part));
    acc.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(g.acc));
    if (t.Dr) dkrh.SetGlobalBuffer(reinterpret_cast<__gm__ float*>(g.dkRopeHeads), static_cast<uint64_t>(t.H * t.Tk * t.Dr));
    dqo.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(g.dq), static_cast<uint64_t>(t.T * t.H * dq));
    dko.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(g.dk), static_cast<uint64_t>(t.Tk * t.H * t.Dk));
    dvo.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(g.dv), static_cast<uint64_t>(t.Tk * t.H * t.Dv));
    if (t.Dr) dkro.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(g.dkRope), static_cast<uint64_t>(t.Tk * t.Dr));
  }
  GlobalTensor<T> q, k, v, kr, dout, out, p, ds, dqo, dko, dvo, dkro;
  GlobalTensor<float> lse, delta, s, dp, part, acc, dkrh;
  GlobalTensor<int64_t> cu, cuK;
};

// Column offsets of the gradient workspace row (fp32): [nope | rope | v], each padded to 8 (32 bytes).
__aicore__ inline int64_t FabRopeCol(const FlashAttentionTiling& t) { return Up8(t.Dk); }
__aicore__ inline int64_t FabVCol(const FlashAttentionTiling& t) { return Up8(t.Dk) + (t.Dr ? Up8(t.Dr) : 0); }

// Cube math of the backward, on explicit workspace tensors: the score block (S, dP) of one block, and
// the pass's gradient products. ws: this block's offset in the S/dP/P/dS and part workspaces (a per-item
// region for the phase kernels, 0 in the fused kernel's per-AI-Core slots).
template <typename T>
struct FabQkMath {
  __aicore__ inline void Item(FaCube<T>& cube, const FlashAttentionTiling& t, FabTensors<T>& g, const FabItem& it,
                              int64_t ws) {
    const int64_t H = t.H, b = t.baseM;
    const int64_t qRow = it.seqStart + it.qPos0, kRow = it.kvStart + it.k0;
    LocalTensor<float> c = cube.l0C_.template AllocTensor<float>();
    cube.Scores(c, t, g.q, g.k, g.kr, qRow, kRow, it.head, it.rows, it.cols);
    cube.Store(g.s[ws], c, it.rows, it.cols, b);
    c = cube.l0C_.template AllocTensor<float>();  // dP = dO . V^T
    cube.MatMul(c, g.dout[(qRow * H + it.head) * t.Dv], H * t.Dv, g.v[(kRow * H + it.head) * t.Dv], H * t.Dv, true,
                it.rows, it.cols, t.Dv, true);
    cube.Store(g.dp[ws], c, it.rows, it.cols, b);
  }
};

template <typename T>
struct FabGradMath {
  __aicore__ inline void Item(FaCube<T>& cube, const FlashAttentionTiling& t, FabTensors<T>& g, const FabItem& it,
                              int64_t ws) {
    const int64_t dq = t.Dk + t.Dr, H = t.H, b = t.baseM;
    const int64_t qRow = it.seqStart + it.qPos0, kRow = it.kvStart + it.k0;
    const GlobalTensor<float> part = g.part[(ws / b) * t.gradCols];  // ws = item * b * b -> item * b * gradCols
    const bool rope = t.rope == FlashAttentionRope::kSharedKey;
    if (t.pass == FlashAttentionPass::kBackwardKV) {  // key rows as M: A = P^T or dS^T (transposed loads)
      const GlobalTensor<T> qn = g.q[(qRow * H + it.head) * dq];
      Product(cube, t, part[FabVCol(t)], g.p[ws], g.dout[(qRow * H + it.head) * t.Dv], H * t.Dv, it.cols, t.Dv, it.rows, true);
      Product(cube, t, part, g.ds[ws], qn, H * dq, it.cols, t.Dk, it.rows, true);
      if (rope) Product(cube, t, part[FabRopeCol(t)], g.ds[ws], qn[t.Dk], H * dq, it.cols, t.Dr, it.rows, true);
    } else {  // query rows as M: A = dS
      Product(cube, t, part, g.ds[ws], g.k[(kRow * H + it.head) * t.Dk], H * t.Dk, it.rows, t.Dk, it.cols, false);
      if (rope) Product(cube, t, part[FabRopeCol(t)], g.ds[ws], g.kr[kRow * t.Dr], t.Dr, it.rows, t.Dr, it.cols, false);
    }
  }

  // dst (m x n rows of the gradient workspace) = A . B with A = the b x b block at `a` (transposed when
  // transA) and B = k x n rows of `bm` with row stride bStride; in column chunks of t.qkChunk (each its
  // own L0C tile and Fixpipe: every output column is its own sum, so the chunks change no bit).
  __aicore__ inline void Product(FaCube<T>& cube, const FlashAttentionTiling& t, const GlobalTensor<float>& dst,
                                 const GlobalTensor<T>& a, const GlobalTensor<T>& bm, int64_t bStride, int64_t m,
                                 int64_t n, int64_t k, bool transA) {
    int64_t n0 = 0;
    do {
      const int64_t w = FaCube<T>::ChunkCols(t, n, n0);
      LocalTensor<float> c = cube.l0C_.template AllocTensor<float>();
      cube.MatMul(c, a, t.baseM, bm[n0], bStride, false, m, w, k, true, transA);
      cube.Store(dst[n0], c, m, w, t.gradCols);
      n0 += w;
    } while (n0 < n);
  }
};

// The two backward Cube phase kernels: backward buffers, the argument tensors, the walk.
template <typename T, typename Math>
class FabCubePhase {
 public:
  __aicore__ inline void Run(const FlashAttentionBwdArgs& g, const FlashAttentionTiling& t) {
    TPipe pipe;
    cube_.InitBwd(t, &pipe);
    t_ = t;
    g_.Set(g, t);
    FabWalk(t, g_.cu, g_.cuK, 1, *this);
  }
  __aicore__ inline void Item(const FabItem& it, uint32_t) { math_.Item(cube_, t_, g_, it, it.t * t_.baseM * t_.baseM); }
  __aicore__ inline void Empty(const FabItem&, uint32_t) {}  // no block: nothing for the Cube

 private:
  FaCube<T> cube_;
  FlashAttentionTiling t_;
  FabTensors<T> g_;
  Math math_;
};

template <typename T>
using FabQk = FabCubePhase<T, FabQkMath<T>>;
template <typename T>
using FabGrad = FabCubePhase<T, FabGradMath<T>>;

// Vector-side row work of the backward, shared by the phase kernels and the fused kernel.
template <typename T>
class FabRows {
 public:
  __aicore__ inline void Init(TPipe& pipe, const FlashAttentionTiling& t, FabTensors<T>* g, bool grad, bool out) {
    t_ = t;
    g_ = g;
    if (grad) {
      pipe.InitBuffer(sBuf_, t.baseN * sizeof(float));
      pipe.InitBuffer(dpBuf_, t.baseN * sizeof(float));
      pipe.InitBuffer(pBuf_, t.baseN * sizeof(T));
      pipe.InitBuffer(dsBuf_, t.baseN * sizeof(T));
    }
    if (out) {
      uint32_t dmax = static_cast<uint32_t>(t.Dk > t.Dv ? t.Dk : t.Dv);
      dmax = dmax > t.Dr ? dmax : static_cast<uint32_t>(t.Dr);
      pipe.InitBuffer(outBuf_, Up16(dmax) * sizeof(T));
    }
  }

  // P = exp(scale * S - lse) (causal columns 0) and dS = P * (dP - delta) for query row r of the block,
  // from the score rows sRow / dpRow (fp32) to pRow / dsRow (input dtype, baseN wide, pads zero).
  __aicore__ inline void GradRow(const FabItem& it, int64_t r, const GlobalTensor<float>& sRow,
                                 const GlobalTensor<float>& dpRow, const GlobalTensor<T>& pRow,
                                 const GlobalTensor<T>& dsRow) {
    LocalTensor<float> s = sBuf_.Get<float>(), dp = dpBuf_.Get<float>();
    LocalTensor<T> p = pBuf_.Get<T>(), ds = dsBuf_.Get<T>();
    const int64_t qPos = it.qPos0 + r, tok = it.seqStart + qPos;
    const int64_t lastKey = qPos + it.lenK - it.lenQ;  // causal: the last key this row sees (bottom-right)
    const int64_t valid = t_.mask == FlashAttentionMask::kCausal ? Min64(it.cols, lastKey - it.k0 + 1) : it.cols;
    ZeroFill(p, t_.baseN);
    ZeroFill(ds, t_.baseN);
    if (valid > 0) {
      SetFlag<HardEvent::V_MTE2>(EVENT_ID0);  // the previous row's vector reads of s / dp are done
      WaitFlag<HardEvent::V_MTE2>(EVENT_ID0);
      DataCopy(s, sRow, t_.baseN);
      DataCopy(dp, dpRow, t_.baseN);
      const float lse = ReadGmFresh(g_->lse, it.head * t_.T + tok);  // written by earlier kernels
      const float delta = ReadGmFresh(g_->delta, tok * t_.H + it.head);
      SetFlag<HardEvent::MTE2_V>(EVENT_ID0);
      WaitFlag<HardEvent::MTE2_V>(EVENT_ID0);
      const int32_t n = static_cast<int32_t>(valid);
      Muls(s, s, t_.softmaxScale, n);
      Adds(s, s, -lse, n);
      Exp(s, s, n);             // P in fp32
      Cast(p, s, RoundMode::CAST_RINT, static_cast<uint32_t>(n));
      // A row that sees one key only (a one-key sequence; with causal, the query at Lq - Lk) has P = 1 and
      // dP = delta mathematically, so dS = 0. Computed, dP (a Cube product over Dv) and delta (the
      // vector rowsum of dO * the rounded O) differ in the last bits (~1e-7), so such a row keeps the
      // zeros of ds instead: its dq, and the dk / dk_rope of a one-key sequence, are exactly 0.
      const int64_t visible = t_.mask == FlashAttentionMask::kCausal ? Min64(it.lenK, lastKey + 1) : it.lenK;
      if (visible > 1) {
        Adds(dp, dp, -delta, n);
        Mul(dp, dp, s, n);        // dS = P * (dP - delta) in fp32
        Cast(ds, dp, RoundMode::CAST_RINT, static_cast<uint32_t>(n));
      }
    } else {
      PipeBarrier<PIPE_V>();
    }
    SetFlag<HardEvent::V_MTE3>(EVENT_ID0);
    WaitFlag<HardEvent::V_MTE3>(EVENT_ID0);
    DataCopy(pRow, p, t_.baseN);
    DataCopy(dsRow, ds, t_.baseN);
    SetFlag<HardEvent::MTE3_V>(EVENT_ID0);
    WaitFlag<HardEvent::MTE3_V>(EVENT_ID0);
  }

  // Gradient row r of the item is complete in acc (fp32 [nope | rope | v]): scale and write it out --
  // KV pass: dK, dV and the per-head dK_rope row; Q pass: dQ (nope and rope columns).
  __aicore__ inline void WriteGrad(const FabItem& it, int64_t r, const LocalTensor<float>& acc) {
    LocalTensor<T> o = outBuf_.Get<T>();
    Muls(acc, acc, t_.softmaxScale, static_cast<int32_t>(FabVCol(t_)));  // dK / dQ and dK_rope carry the scale
    if (t_.pass == FlashAttentionPass::kBackwardKV) {
      const int64_t tok = it.kvStart + it.k0 + r;
      WriteRow(g_->dko[(tok * t_.H + it.head) * t_.Dk], acc, o, t_.Dk);
      WriteRow(g_->dvo[(tok * t_.H + it.head) * t_.Dv], acc[FabVCol(t_)], o, t_.Dv);
      if (t_.Dr) {
        SetFlag<HardEvent::V_MTE3>(EVENT_ID0);
        WaitFlag<HardEvent::V_MTE3>(EVENT_ID0);
        CopyRowOut(g_->dkrh[(it.head * t_.Tk + tok) * t_.Dr], acc[FabRopeCol(t_)], static_cast<uint32_t>(t_.Dr));
        SetFlag<HardEvent::MTE3_V>(EVENT_ID0);
        WaitFlag<HardEvent::MTE3_V>(EVENT_ID0);
      }
    } else {
      const int64_t tok = it.seqStart + it.qPos0 + r, dq = t_.Dk + t_.Dr;
      WriteRow(g_->dqo[(tok * t_.H + it.head) * dq], acc, o, t_.Dk);
      if (t_.Dr) WriteRow(g_->dqo[(tok * t_.H + it.head) * dq + t_.Dk], acc[FabRopeCol(t_)], o, t_.Dr);
    }
  }

  // Zero gradient rows [r0, r1) of an item without blocks (acc: a gradCols-wide fp32 row of UB).
  __aicore__ inline void WriteZeroGrads(const FabItem& it, int64_t r0, int64_t r1, const LocalTensor<float>& acc) {
    for (int64_t r = r0; r < r1; ++r) {
      ZeroFill(acc, t_.gradCols);
      WriteGrad(it, r, acc);
    }
  }

  // Gradient rows of an item: key rows in the KV pass, query rows in the Q pass.
  __aicore__ inline int64_t Extent(const FabItem& it) const {
    return t_.pass == FlashAttentionPass::kBackwardKV ? it.cols : it.rows;
  }

  // Columns of a gradient row that the pass accumulates (the Q pass has no V segment).
  __aicore__ inline int32_t AccCols() const {
    return static_cast<int32_t>(t_.pass == FlashAttentionPass::kBackwardKV ? t_.gradCols : FabVCol(t_));
  }

 private:
  // fp32 row -> input dtype -> GM
  __aicore__ inline void WriteRow(const GlobalTensor<T>& dst, const LocalTensor<float>& src, const LocalTensor<T>& o,
                                  int64_t cols) {
    Cast(o, src, RoundMode::CAST_RINT, static_cast<uint32_t>(cols));
    SetFlag<HardEvent::V_MTE3>(EVENT_ID0);
    WaitFlag<HardEvent::V_MTE3>(EVENT_ID0);
    CopyRowOut(dst, o, static_cast<uint32_t>(cols));
    SetFlag<HardEvent::MTE3_V>(EVENT_ID0);
    WaitFlag<HardEvent::MTE3_V>(EVENT_ID0);
  }

  FlashAttentionTiling t_;
  FabTensors<T>* g_ = nullptr;
  TBuf<TPosition::VECCALC> sBuf_, dpBuf_, pBuf_, dsBuf_, outBuf_;
};

// P and dS rows of the item's query rows handled by this AIV unit.
template <typename T>
class FabSoftmax {
 public:
  __aicore__ inline void Run(const FlashAttentionBwdArgs& g, const FlashAttentionTiling& t) {
    TPipe pipe;
    t_ = t;
    g_.Set(g, t);
    rows_.Init(pipe, t, &g_, true, false);
    FabWalk(t, g_.cu, g_.cuK, static_cast<uint32_t>(CeilDiv(t.baseM, t.vecRows)), *this);
  }
  __aicore__ inline void Empty(const FabItem&, uint32_t) {}  // no block: no P / dS rows
  __aicore__ inline void Item(const FabItem& it, uint32_t unit) {
    const int64_t b = t_.baseM, ws = it.t * b * b;
    const int64_t r0 = unit * t_.vecRows, r1 = Min64(it.rows, r0 + t_.vecRows);
    for (int64_t r = r0; r < r1; ++r)
      rows_.GradRow(it, r, g_.s[ws + r * b], g_.dp[ws + r * b], g_.p[ws + r * b], g_.ds[ws + r * b]);
  }

 private:
  FlashAttentionTiling t_;
  FabTensors<T> g_;
  FabRows<T> rows_;
};

// acc += part for the gradient rows of this AIV unit (running sums in GM); the item's last step writes
// them out.
template <typename T>
class FabAcc {
 public:
  __aicore__ inline void Run(const FlashAttentionBwdArgs& g, const FlashAttentionTiling& t) {
    TPipe pipe;
    t_ = t;
    g_.Set(g, t);
    pipe.InitBuffer(accBuf_, t.gradCols * sizeof(float));
    pipe.InitBuffer(partBuf_, t.gradCols * sizeof(float));
    rows_.Init(pipe, t, &g_, false, true);
    FabWalk(t, g_.cu, g_.cuK, static_cast<uint32_t>(CeilDiv(t.baseM, t.vecRows)), *this);
  }
  // An item without blocks: its (zero) gradient rows, at step 0.
  __aicore__ inline void Empty(const FabItem& it, uint32_t unit) {
    const int64_t r0 = unit * t_.vecRows, r1 = Min64(rows_.Extent(it), r0 + t_.vecRows);
    rows_.WriteZeroGrads(it, r0, r1, accBuf_.Get<float>());
  }
  __aicore__ inline void Item(const FabItem& it, uint32_t unit) {
    const int64_t b = t_.baseM, gc = t_.gradCols, extent = rows_.Extent(it);
    const int64_t r0 = unit * t_.vecRows, r1 = Min64(extent, r0 + t_.vecRows);
    const int32_t n = rows_.AccCols();
    LocalTensor<float> acc = accBuf_.Get<float>(), part = partBuf_.Get<float>();
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t wsRow = (it.t * b + r) * gc;
      SetFlag<HardEvent::V_MTE2>(EVENT_ID0);  // acc / part are reloaded: the previous row's vector reads are done
      WaitFlag<HardEvent::V_MTE2>(EVENT_ID0);
      DataCopy(acc, g_.acc[wsRow], static_cast<uint32_t>(n));
      DataCopy(part, g_.part[wsRow], static_cast<uint32_t>(n));
      SetFlag<HardEvent::MTE2_V>(EVENT_ID0);
      WaitFlag<HardEvent::MTE2_V>(EVENT_ID0);
      Add(acc, acc, part, n);
      if (it.last) {
        rows_.WriteGrad(it, r, acc);
        continue;
      }
      SetFlag<HardEvent::V_MTE3>(EVENT_ID0);
      WaitFlag<HardEvent::V_MTE3>(EVENT_ID0);
      DataCopy(g_.acc[wsRow], acc, static_cast<uint32_t>(n));
      SetFlag<HardEvent::MTE3_V>(EVENT_ID0);
      WaitFlag<HardEvent::MTE3_V>(EVENT_ID0);
    }
  }

 private:
  FlashAttentionTiling t_;
  FabTensors<T> g_;
  FabRows<T> rows_;
  TBuf<TPosition::VECCALC> accBuf_, partBuf_;
};

// Rows r of a [rows x D] job handled by this core: r = core, core + cores, ...
// delta[r] = sum(dO[r] * O[r]) over Dv (r = token * H + head), fp32.
template <typename T>
class FabDelta {
 public:
  __aicore__ inline void Run(const FlashAttentionBwdArgs& g, const FlashAttentionTiling& t) {
    TPipe pipe;
    t_ = t;
    g_.Set(g, t);
    if (t.deltaRows > 0) {
      RunTiles(pipe, t);
      return;
    }
    InitRowBuffers(pipe, t, xBuf_, yBuf_, fxBuf_, fyBuf_, work_, red_);
    LocalTensor<T> x = xBuf_.Get<T>(), y = yBuf_.Get<T>();
    LocalTensor<float> fx = fxBuf_.Get<float>(), fy = fyBuf_.Get<float>(), work = work_.Get<float>(), red = red_.Get<float>();
    const uint32_t dv = static_cast<uint32_t>(t.Dv);
    for (int64_t r = GetBlockIdx(); r < t.T * t.H; r += GetBlockNum()) {
      SetFlag<HardEvent::V_MTE2>(EVENT_ID0);  // x / y are reloaded: the previous row's Casts read them
      WaitFlag<HardEvent::V_MTE2>(EVENT_ID0);
      CopyRowIn(x, g_.dout[r * t.Dv], dv);
      CopyRowIn(y, g_.out[r * t.Dv], dv);
      SetFlag<HardEvent::MTE2_V>(EVENT_ID0);
      WaitFlag<HardEvent::MTE2_V>(EVENT_ID0);
      Cast(fx, x, RoundMode::CAST_NONE, dv);
      Cast(fy, y, RoundMode::CAST_NONE, dv);
      Mul(fx, fx, fy, static_cast<int32_t>(dv));
      ReduceSum(red, fx, work, static_cast<int32_t>(dv));
      // delta rows of different cores share 64-byte lines: a DMA store, not a scalar SetValue
      SetFlag<HardEvent::V_MTE3>(EVENT_ID0);
      WaitFlag<HardEvent::V_MTE3>(EVENT_ID0);
      StoreElement(g_.delta[r], red);
      SetFlag<HardEvent::MTE3_V>(EVENT_ID0);
      WaitFlag<HardEvent::MTE3_V>(EVENT_ID0);
      SetFlag<HardEvent::V_MTE2>(EVENT_ID0);  // the next row's loads overwrite x / y that Cast read
      WaitFlag<HardEvent::V_MTE2>(EVENT_ID0);
    }
  }

 private:
  // Tile-wise (t.deltaRows = R > 0, planned when Dv is a multiple of 16): the T * H rows of dout and out
  // (contiguous, Dv apart) in tiles of R rows, tile k on core k % blockNum: one DMA per tile and operand,
  // the casts and the product over the whole tile, the row sums by WholeReduceSum per 64-column chunk
  // with the chunk partials added in chunk order -- per element the same fp32 operations in the same
  // order as the row form's ReduceSum (a binary tree inside each 64-lane repeat, repeats added in order),
  // so delta is bitwise the same -- and one DMA of the R sums.
  __aicore__ inline void RunTiles(TPipe& pipe, const FlashAttentionTiling& t) {
    const int64_t R = t.deltaRows, d = t.Dv, rows = t.T * t.H, r8 = Up8(static_cast<uint32_t>(R));
    pipe.InitBuffer(xBuf_, R * d * sizeof(T));
    pipe.InitBuffer(yBuf_, R * d * sizeof(T));
    pipe.InitBuffer(fxBuf_, R * d * sizeof(float));
    pipe.InitBuffer(fyBuf_, R * d * sizeof(float));
    pipe.InitBuffer(red_, 2 * r8 * sizeof(float));  // the row sums, a chunk's partial sums
    LocalTensor<T> x = xBuf_.Get<T>(), y = yBuf_.Get<T>();
    LocalTensor<float> fx = fxBuf_.Get<float>(), fy = fyBuf_.Get<float>(), sum = red_.Get<float>(),
                       part = red_.Get<float>()[r8];
    const int32_t rep = static_cast<int32_t>(d / 8);  // fp32 row stride in 32-byte blocks
    for (int64_t r0 = GetBlockIdx() * R; r0 < rows; r0 += GetBlockNum() * R) {
      const int64_t n = Min64(R, rows - r0);
      const uint32_t cnt = static_cast<uint32_t>(n * d);
      SetFlag<HardEvent::V_MTE2>(EVENT_ID0);  // x / y are reloaded: the previous tile's Casts read them
      WaitFlag<HardEvent::V_MTE2>(EVENT_ID0);
      DataCopy(x, g_.dout[r0 * d], cnt);
      DataCopy(y, g_.out[r0 * d], cnt);
      SetFlag<HardEvent::MTE2_V>(EVENT_ID0);
      WaitFlag<HardEvent::MTE2_V>(EVENT_ID0);
      Cast(fx, x, RoundMode::CAST_NONE, cnt);
      Cast(fy, y, RoundMode::CAST_NONE, cnt);
      Mul(fx, fx, fy, static_cast<int32_t>(cnt));
      SetFlag<HardEvent::MTE3_V>(EVENT_ID0);  // the previous tile's store of the sums is done
      WaitFlag<HardEvent::MTE3_V>(EVENT_ID0);
      for (int64_t c0 = 0; c0 < d; c0 += 64) {
        const int32_t mask = static_cast<int32_t>(Min64(64, d - c0));
        WholeReduceSum(c0 == 0 ? sum : part, fx[c0], mask, static_cast<int32_t>(n), 1, 1, rep);
        if (c0 > 0) Add(sum, sum, part, static_cast<int32_t>(n));
      }
      SetFlag<HardEvent::V_MTE3>(EVENT_ID0);
      WaitFlag<HardEvent::V_MTE3>(EVENT_ID0);
      // delta rows of the neighbouring tiles (other cores) follow in GM: a DataCopyPad of exactly n floats
      DataCopyPad(g_.delta[r0], sum, DataCopyExtParams{1, static_cast<uint32_t>(n * sizeof(float)), 0, 0, 0});
    }
  }

  FlashAttentionTiling t_;
  FabTensors<T> g_;
  TBuf<TPosition::VECCALC> xBuf_, yBuf_, fxBuf_, fyBuf_, work_, red_;

 public:
  // The row buffers of the two reduction kernels (same sizes: the tiling plans them once).
  static __aicore__ inline void InitRowBuffers(TPipe& pipe, const FlashAttentionTiling& t, TBuf<TPosition::VECCALC>& x,
                                               TBuf<TPosition::VECCALC>& y, TBuf<TPosition::VECCALC>& fx,
                                               TBuf<TPosition::VECCALC>& fy, TBuf<TPosition::VECCALC>& work,
                                               TBuf<TPosition::VECCALC>& red) {
    const uint32_t d = Up16(t.Dv > t.Dr ? t.Dv : t.Dr);
    pipe.InitBuffer(x, d * sizeof(T));
    pipe.InitBuffer(y, d * sizeof(T));
    pipe.InitBuffer(fx, d * sizeof(float));
    pipe.InitBuffer(fy, d * sizeof(float));
    pipe.InitBuffer(work, ReduceMaxWorkFloats(d) * sizeof(float));
    pipe.InitBuffer(red, 8 * sizeof(float));
  }
};

// dK_rope[token] = sum over heads (in head order) of the per-head rows, rounded to the input dtype.
template <typename T>
class FabDkRope {
 public:
  __aicore__ inline void Run(const FlashAttentionBwdArgs& g, const FlashAttentionTiling& t) {
    TPipe pipe;
    g_.Set(g, t);
    if (t.dkropeRows > 0) {
      RunTiles(pipe, t);
      return;
    }
    FabDelta<T>::InitRowBuffers(pipe, t, xBuf_, yBuf_, sumBuf_, rowBuf_, work_, red_);
    LocalTensor<T> o = xBuf_.Get<T>();
    LocalTensor<float> sum = sumBuf_.Get<float>(), row = rowBuf_.Get<float>();
    const uint32_t dr = static_cast<uint32_t>(t.Dr);
    for (int64_t tok = GetBlockIdx(); tok < t.Tk; tok += GetBlockNum()) {
      CopyRowIn(sum, g_.dkrh[tok * t.Dr], dr);
      SetFlag<HardEvent::MTE2_V>(EVENT_ID0);
      WaitFlag<HardEvent::MTE2_V>(EVENT_ID0);
      for (int64_t h = 1; h < t.H; ++h) {
        CopyRowIn(row, g_.dkrh[(h * t.Tk + tok) * t.Dr], dr);
        SetFlag<HardEvent::MTE2_V>(EVENT_ID0);
        WaitFlag<HardEvent::MTE2_V>(EVENT_ID0);
        Add(sum, sum, row, static_cast<int32_t>(dr));
        SetFlag<HardEvent::V_MTE2>(EVENT_ID0);
        WaitFlag<HardEvent::V_MTE2>(EVENT_ID0);
      }
      Cast(o, sum, RoundMode::CAST_RINT, dr);
      SetFlag<HardEvent::V_MTE3>(EVENT_ID0);
      WaitFlag<HardEvent::V_MTE3>(EVENT_ID0);
      CopyRowOut(g_.dkro[tok * t.Dr], o, dr);
      SetFlag<HardEvent::MTE3_MTE2>(EVENT_ID0);
      WaitFlag<HardEvent::MTE3_MTE2>(EVENT_ID0);
    }
  }

 private:
  // Tile-wise (t.dkropeRows = R > 0, planned when Dr is a multiple of 16): the per-head rows of R
  // consecutive tokens are contiguous in dkrh ([H][Tk][Dr] fp32), so tile k (tokens [kR, kR + R), on
  // core k % blockNum) takes one DMA per head and one Add over the whole tile per head, in head order
  // -- per element the same fp32 additions in the same order as the row form, so dK_rope is bitwise the
  // same -- through a two-deep input queue (head h + 1 loads while head h is added); then one Cast and
  // one DMA of the tile's rows.
  __aicore__ inline void RunTiles(TPipe& pipe, const FlashAttentionTiling& t) {
    const int64_t R = t.dkropeRows, d = t.Dr;
    pipe.InitBuffer(sumBuf_, R * d * sizeof(float));
    pipe.InitBuffer(inQ_, 2, R * d * sizeof(float));
    pipe.InitBuffer(xBuf_, R * d * sizeof(T));
    LocalTensor<float> sum = sumBuf_.Get<float>();
    LocalTensor<T> o = xBuf_.Get<T>();
    for (int64_t tok0 = GetBlockIdx() * R; tok0 < t.Tk; tok0 += GetBlockNum() * R) {
      const uint32_t cnt = static_cast<uint32_t>(Min64(R, t.Tk - tok0) * d);
      SetFlag<HardEvent::V_MTE2>(EVENT_ID0);  // the previous tile's Adds and Cast read sum
      WaitFlag<HardEvent::V_MTE2>(EVENT_ID0);
      DataCopy(sum, g_.dkrh[tok0 * d], cnt);
      if (t.H > 1) LoadHead(g_.dkrh[(t.Tk + tok0) * d], cnt);
      SetFlag<HardEvent::MTE2_V>(EVENT_ID0);
      WaitFlag<HardEvent::MTE2_V>(EVENT_ID0);
      for (int64_t h = 1; h < t.H; ++h) {
        if (h + 1 < t.H) LoadHead(g_.dkrh[((h + 1) * t.Tk + tok0) * d], cnt);
        LocalTensor<float> x = inQ_.template DeQue<float>();
        Add(sum, sum, x, static_cast<int32_t>(cnt));
        inQ_.FreeTensor(x);
      }
      Cast(o, sum, RoundMode::CAST_RINT, cnt);
      SetFlag<HardEvent::V_MTE3>(EVENT_ID0);
      WaitFlag<HardEvent::V_MTE3>(EVENT_ID0);
      DataCopy(g_.dkro[tok0 * d], o, cnt);
      SetFlag<HardEvent::MTE3_V>(EVENT_ID0);  // the next tile's Cast overwrites o
      WaitFlag<HardEvent::MTE3_V>(EVENT_ID0);
    }
  }

  // one head's rows of the tile into the input queue
  __aicore__ inline void LoadHead(const GlobalTensor<float>& src, uint32_t cnt) {
    LocalTensor<float> x = inQ_.template AllocTensor<float>();
    DataCopy(x, src, cnt);
    inQ_.EnQue(x);
  }

  TQue<TPosition::VECIN, 2> inQ_;
  FabTensors<T> g_;
  TBuf<TPosition::VECCALC> xBuf_, yBuf_, sumBuf_, rowBuf_, work_, red_;
};

template <template <typename> class K, typename Args = FaGm>
__aicore__ inline void FaRun(GM_ADDR gmArgs, GM_ADDR tiling) {
  FlashAttentionTiling t;
  CopyTiling(&t, tiling);
  Args g;
  CopyTiling(&g, gmArgs);
  if (t.key == FlashAttentionTilingKey::kF16) {
    K<half> k;
    k.Run(g, t);
  } else if (t.key == FlashAttentionTilingKey::kBF16) {
    K<bfloat16_t> k;
    k.Run(g, t);
  }
}

}  // namespace kernels
}  // namespace amo_ascend
