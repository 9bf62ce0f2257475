#include "flash_attention_tiling.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace amo_ascend {

namespace {

// The fused kernels' AIV pipeline extras (fusedPipe), planned after their base UB plan of `fused`
// bytes so that they never change baseM / baseN: the double buffers (`dbl` bytes) where they fit the
// UB budget; sets ubFusedBytes to the total. (Until 2026-12-07 a causal mask triangle, added to the
// scores, was a second extra: an added -inf turned a NaN or +inf score of a masked key into NaN.)
void plan_fused_extras(FlashAttentionTiling& t, uint64_t fused, uint64_t dbl, const ChipInfo& chip) {
  t.fusedPipe = 0;
  if (fused + dbl <= ub_budget(chip)) {
    fused += dbl;
    t.fusedPipe |= kFaPipeDouble;
  }
  t.ubFusedBytes = static_cast<uint32_t>(fused);
}

// Columns of the head dim per Q . K^T Mmad (and per dK / dQ N-chunk), padded: min(up16(Dk), qkChunk).
uint64_t qk_cols(const FlashAttentionTiling& t) {
  const uint64_t dk = align_up(t.Dk, 16);
  return t.qkChunk ? std::min<uint64_t>(dk, t.qkChunk) : dk;
}

// One step of the tilings' fit loops before a block shrinks: the head-dim chunk narrows by 16 while it
// is wider than a block row and than the other L0 operands (never below 64 columns). False when it
// may not narrow further.
bool narrow_qk_chunk(FlashAttentionTiling& t, uint64_t block) {
  const uint64_t floor = std::max<uint64_t>({uint64_t(64), t.Dr ? align_up(t.Dr, 16) : 0, align_up(t.Dv, 16), block});
  if (t.qkChunk <= floor) return false;
  t.qkChunk -= 16;
  return true;
}

// Fill the byte plan of t for its baseM / baseN.
void plan(FlashAttentionTiling& t, const ChipInfo& chip) {
  const uint32_t aivPerAic = std::max<uint32_t>(1, chip.aivNum / chip.aicNum);
  t.vecRows = (t.baseM + aivPerAic - 1) / aivPerAic;
  const uint64_t M = t.baseM, N = t.baseN, e = 2;
  const uint64_t dk = align_up(t.Dk, 16), dr = t.Dr ? align_up(t.Dr, 16) : 0, dv = align_up(t.Dv, 16);
  const uint64_t dq = qk_cols(t);  // Q . K^T columns per Mmad
  t.l1Bytes = M * (dk + dr) * e + t.l1Buffers * (N * (dk + dr + dv) * e + M * N * e);
  t.l0aBytes = t.l0Buffers * M * std::max<uint64_t>({dq, dr, N}) * e;
  t.l0bBytes = t.l0Buffers * N * std::max<uint64_t>({dq, dr, dv}) * e;
  t.l0cBytes = t.l0cBuffers * M * std::max<uint64_t>(N, dv) * 4;
  const uint64_t R = t.vecRows, dv8 = align_up(t.Dv, 8), r8 = align_up(R, 8);
  t.ubBytes = t.ubBuffers * R * N * 4 + R * N * e + 2 * R * dv8 * 4 + 3 * r8 * 4 + reduce_max_work_bytes(N) + 32;
  // fused: the S tile (R x N fp32), the P tile (R x N), O and O_partial (R x up8(Dv) fp32 each), the
  // output tile (R x its row stride), per-row broadcast blocks (8 fp32 per row), 12 state vectors (the
  // alphas of 2 blocks and the m, l of 2 items in flight, 6 scratch), and EmptyRow's 8 fp32 + output row
  const uint64_t outStride = (dv8 * e) % 32 == 0 ? dv8 : align_up(t.Dv, 16);
  const uint64_t fused = R * N * 4 + R * N * e + 2 * R * dv8 * 4 + R * outStride * e + r8 * 8 * 4 + 12 * r8 * 4 + 32 +
                   align_up(t.Dv, 16) * e;
  // extras of the AIV pipeline, only where they fit what the base plan leaves (fusedPipe; the base
  // plan alone decides baseM / baseN): the second S and P tiles, and the alpha of each further block
  // and the m, l of each further item in flight (the O update trails by kFlashAttentionFusedSlots - 1)
  plan_fused_extras(t, fused, R * N * 4 + R * N * e + 3 * (kFlashAttentionFusedSlots - 2) * r8 * 4, chip);
}

// Backward byte plan (square blocks b = baseM = baseN; W = the widest operand row of any product):
//   L1  : A and B operands, l1Buffers deep each: b x W (Q/dO/P^T/dS parts; K/V/dO/Q/K parts)
//   L0A, L0B: l0Buffers x b x W;  L0C: l0cBuffers x b x W fp32 (S, dP, then each gradient product)
//   UB  : the largest vector phase, per AIV core:
//         softmax-grad  S and dP rows (b fp32 each), P and dS rows (b, input dtype)
//         accumulate    running sum and product rows (gradCols fp32 each), output row (up16(max dim), input dtype)
//         delta / dK_rope reduction: two fp32 rows and two input-dtype rows of up16(max(Dv, Dr)), work, 8 fp32
//         tile-wise delta (Dv % 16 == 0): deltaRows rows of dout, out (input dtype) and their fp32 casts,
//         2 x up8(deltaRows) fp32
//         tile-wise dK_rope sum (Dr % 16 == 0): dkropeRows tokens of three fp32 rows and one input-dtype row
void plan_bwd(FlashAttentionTiling& t, const ChipInfo& chip) {
  const uint32_t aivPerAic = std::max<uint32_t>(1, chip.aivNum / chip.aicNum);
  t.vecRows = (t.baseM + aivPerAic - 1) / aivPerAic;
  const uint64_t b = t.baseM, e = 2;
  // Q . K^T, dK = dS^T . Q and dQ = dS . K run in head-dim chunks of qkChunk columns (K-chunks of the
  // score, N-chunks of the two gradient products)
  const uint64_t W = std::max<uint64_t>({b, qk_cols(t), t.Dr ? align_up(t.Dr, 16) : 0, align_up(t.Dv, 16)});
  t.l1Bytes = 2 * t.l1Buffers * b * W * e;
  t.l0aBytes = t.l0Buffers * b * W * e;
  t.l0bBytes = t.l0Buffers * b * W * e;
  t.l0cBytes = t.l0cBuffers * b * W * 4;
  const uint64_t softmax = 2 * b * 4 + 2 * b * e;
  const uint64_t dmax = align_up(std::max<int64_t>({t.Dk, t.Dr, t.Dv}), 16);
  const uint64_t acc = 2 * uint64_t(t.gradCols) * 4 + dmax * e;
  const uint64_t rowDim = align_up(std::max<int64_t>(t.Dv, t.Dr), 16);
  const uint64_t reduce = 2 * rowDim * 4 + 2 * rowDim * e + reduce_max_work_bytes(rowDim) + 32;
  // amo_fab_delta tile-wise when Dv is a multiple of 16 (its rows are whole 32-byte blocks): R rows of
  // dout and out (input dtype) and their fp32 casts, the R row sums and a chunk's partials; R a multiple
  // of 8 in [8, 64] with the four tiles within 64 KiB
  t.deltaRows = 0;
  uint64_t delta = 0;
  if (t.Dv % 16 == 0) {
    const uint64_t perRow = uint64_t(t.Dv) * (2 * e + 2 * 4);
    t.deltaRows = static_cast<uint32_t>(std::min<uint64_t>(64, std::max<uint64_t>(8, 65536 / perRow / 8 * 8)));
    delta = t.deltaRows * perRow + 2 * align_up(t.deltaRows, 8) * 4;
  }
  // amo_fab_dkrope tile-wise when Dr is a multiple of 16 (a token's dK_rope row is whole 32-byte blocks
  // in fp32 and in the input dtype): R tokens of the running sum and of two per-head rows (fp32, the
  // next head's loaded while this one is added) and of the rounded output; R a multiple of 8 in
  // [8, 128] with the four tiles within 64 KiB
  t.dkropeRows = 0;
  uint64_t dkrope = 0;
  if (t.Dr > 0 && t.Dr % 16 == 0) {
    const uint64_t perTok = uint64_t(t.Dr) * (3 * 4 + e);
    t.dkropeRows = static_cast<uint32_t>(std::min<uint64_t>(128, std::max<uint64_t>(8, 65536 / perTok / 8 * 8)));
    dkrope = t.dkropeRows * perTok;
  }
  t.ubBytes = std::max({softmax, acc, reduce, delta, dkrope});
  // fused pass kernel amo_fab_fused, per AIV, tile-wise in chunks of c = min(vecRows, 16) rows: S and
  // dP (c x b fp32 each), P and dS (c x b, input dtype), the running sums of its vecRows gradient rows
  // (fp32, kept in UB for the whole item), a chunk of product rows (c x gradCols fp32) and of output
  // rows (c x gradCols, input dtype), lse and delta (2 x up8(c) fp32), delta as loaded and the per-row
  // broadcast blocks (2 x up8(c) x 8 fp32), and the output row of the row-wise path
  const uint64_t c = std::min<uint64_t>(t.vecRows, 16), c8 = align_up(c, 8), gc = t.gradCols;
  const uint64_t fused = 2 * c * b * 4 + 2 * c * b * e + uint64_t(t.vecRows) * gc * 4 + c * gc * 4 + c * gc * e + 2 * c8 * 4 +
                   2 * c8 * 8 * 4 + dmax * e;
  // extras where they fit (as the forward's): a second chunk of S, dP (fp32), P, dS, lse and delta (as
  // loaded too) and of product rows, for the prefetch of the next chunk
  plan_fused_extras(t, fused, 2 * c * b * 4 + 2 * c * b * e + 2 * c8 * 4 + c8 * 8 * 4 + c * gc * 4, chip);
}

uint32_t vec_blocks(const FlashAttentionTiling& t, const ChipInfo& chip) {
  const uint64_t units = (t.baseM + t.vecRows - 1) / t.vecRows;
  return static_cast<uint32_t>(std::max<uint64_t>(1, std::min<uint64_t>(chip.aivNum, t.blockDim * units)));
}

bool fits(const FlashAttentionTiling& t, const ChipInfo& chip) {
  return t.l1Bytes <= chip.l1Bytes && t.l0aBytes <= chip.l0aBytes && t.l0bBytes <= chip.l0bBytes &&
         t.l0cBytes <= chip.l0cBytes && t.ubBytes <= ub_budget(chip) && t.ubFusedBytes <= ub_budget(chip);
}

}  // namespace

FlashAttentionTiling compute_flash_attention_tiling(int64_t T, int64_t Tk, int64_t H, int64_t Dk, int64_t Dr,
                                                    int64_t Dv, int64_t B, int64_t maxSeqlenQ, int64_t maxSeqlenK,
                                                    bool causal, DType dtype, const ChipInfo& chip,
                                                    uint32_t maxBase) {
  if (T < 0 || Tk < 0 || H < 0 || Dk < 0 || Dr < 0 || Dv < 0 || B < 0 || maxSeqlenQ < 0 || maxSeqlenK < 0)
    throw std::invalid_argument("flash_attention tiling: negative size");
  const int64_t maxSeqlen = std::max(maxSeqlenQ, maxSeqlenK);
  if (dtype == DType::kF32)
    throw std::invalid_argument("flash_attention on the Ascend Cube path supports fp16 and bf16 inputs only");
  if (chip.aicNum == 0) throw std::invalid_argument("flash_attention tiling: aicNum must be >= 1");
  if (Dk + Dr > 4095 || Dv > 4095) throw std::invalid_argument("flash_attention tiling: head dim above the Mmad limit 4095");
  // the fused kernels' vector tiles step from row to row with 8-bit repeat strides (32-byte blocks):
  // a row of up8(Dv) fp32 (forward O tile) or up8(Dk) + up8(Dr) + up8(Dv) fp32 (backward gradient
  // rows) must stay within 255 blocks
  if (align_up(Dv, 8) > 2040 || align_up(Dk, 8) + align_up(Dr, 8) + align_up(Dv, 8) > 2040)
    throw std::invalid_argument("flash_attention tiling: head dims too large for the fused kernels' vector tiles (Dk=" +
                                std::to_string(Dk) + ", Dr=" + std::to_string(Dr) + ", Dv=" + std::to_string(Dv) +
                                "): up8(Dk) + up8(Dr) + up8(Dv) must be <= 2040, the row stride limit of 255 x 32 B");
  FlashAttentionTiling t{};
  t.key = dtype == DType::kF16 ? FlashAttentionTilingKey::kF16 : FlashAttentionTilingKey::kBF16;
  t.mask = causal ? FlashAttentionMask::kCausal : FlashAttentionMask::kNone;
  t.rope = Dr > 0 ? FlashAttentionRope::kSharedKey : FlashAttentionRope::kNone;
  t.T = T; t.H = H; t.Dk = Dk; t.Dr = Dr; t.Dv = Dv; t.B = B; t.maxSeqlen = maxSeqlen;
  t.Tk = Tk; t.maxSeqlenQ = maxSeqlenQ; t.maxSeqlenK = maxSeqlenK;
  t.l1Buffers = kFlashAttentionL1Buffers;
  t.l0Buffers = kDoubleBuffer;
  t.l0cBuffers = kDoubleBuffer;
  t.ubBuffers = kDoubleBuffer;
  const uint32_t cap = maxBase ? std::max<uint32_t>(16, maxBase / 16 * 16) : 128u;
  const uint32_t want = static_cast<uint32_t>(std::min<uint64_t>(align_up(std::max<int64_t>(maxSeqlen, 1), 16), cap));
  t.baseM = want;
  t.baseN = want;
  t.qkChunk = static_cast<uint32_t>(align_up(Dk, 16));
  plan(t, chip);
  // Where the L1 overflows, two L1 buffers instead of kFlashAttentionL1Buffers; split the Q . K^T head
  // dim into narrower Mmads before shrinking a block (narrow_qk_chunk); then shrink the larger of the
  // two blocks (keys first) until every memory fits.
  while (!fits(t, chip)) {
    if (t.l1Bytes > chip.l1Bytes && t.l1Buffers > kDoubleBuffer) t.l1Buffers = kDoubleBuffer;
    else if (!narrow_qk_chunk(t, t.baseN)) {
      if (t.baseN >= t.baseM && t.baseN > 16) t.baseN -= 16;
      else if (t.baseM > 16) t.baseM -= 16;
      else if (t.l0cBuffers > 1) t.l0cBuffers = 1;
      else throw std::invalid_argument("flash_attention tiling: head dims too large for L0/L1/UB (Dk=" +
                                       std::to_string(Dk) + ", Dr=" + std::to_string(Dr) + ", Dv=" + std::to_string(Dv) + ")");
    }
    plan(t, chip);
  }
  // no key at all (Tk = 0): every row gets out 0, lse -inf, zero gradients (the host's empty path)
  const int64_t items = B * H * ceil_div(maxSeqlenQ, t.baseM);
  if (T == 0 || Tk == 0 || H == 0 || items == 0 || maxSeqlenK == 0) t.key = FlashAttentionTilingKey::kEmpty;
  t.blockDim = static_cast<uint32_t>(
      std::max<int64_t>(1, std::min<int64_t>(std::min<int64_t>(chip.aicNum, kFlashAttentionMaxCores), items)));
  t.vecBlockDim = vec_blocks(t, chip);
  t.pass = FlashAttentionPass::kForward;
  return t;
}

FlashAttentionTiling compute_flash_attention_bwd_tiling(int64_t T, int64_t Tk, int64_t H, int64_t Dk, int64_t Dr,
                                                        int64_t Dv, int64_t B, int64_t maxSeqlenQ,
                                                        int64_t maxSeqlenK, bool causal, DType dtype,
                                                        const ChipInfo& chip, uint32_t maxBase) {
  // Same checks, keys and item walk as the forward; square blocks and the backward byte plan.
  FlashAttentionTiling t = compute_flash_attention_tiling(T, Tk, H, Dk, Dr, Dv, B, maxSeqlenQ, maxSeqlenK, causal,
                                                          dtype, chip, maxBase);
  t.baseM = t.baseN = std::max(t.baseM, t.baseN);
  t.qkChunk = static_cast<uint32_t>(align_up(Dk, 16));
  t.gradCols = static_cast<uint32_t>(align_up(Dk, 8) + align_up(Dr, 8) + align_up(Dv, 8));
  t.l1Buffers = kFlashAttentionL1Buffers;
  plan_bwd(t, chip);
  // as the forward: two L1 buffers where the L1 overflows, narrower head-dim chunks, then smaller blocks
  while (!fits(t, chip)) {
    if (t.l1Bytes > chip.l1Bytes && t.l1Buffers > kDoubleBuffer) t.l1Buffers = kDoubleBuffer;
    else if (!narrow_qk_chunk(t, t.baseM)) {
      if (t.baseM > 16) t.baseM = t.baseN = t.baseM - 16;
      else throw std::invalid_argument("flash_attention backward tiling: head dims too large for L0/L1/UB (Dk=" +
                                       std::to_string(Dk) + ", Dr=" + std::to_string(Dr) + ", Dv=" + std::to_string(Dv) + ")");
    }
    plan_bwd(t, chip);
  }
  const int64_t items = B * H * ceil_div(t.maxSeqlen, t.baseM);  // the larger pass (KV: key blocks, Q: query blocks)
  t.blockDim = static_cast<uint32_t>(
      std::max<int64_t>(1, std::min<int64_t>(std::min<int64_t>(chip.aicNum, kFlashAttentionMaxCores), items)));
  t.vecBlockDim = vec_blocks(t, chip);
  t.pass = FlashAttentionPass::kBackwardKV;
  return t;
}

FlashAttentionWorkspace flash_attention_workspace(const FlashAttentionTiling& t) {
  FlashAttentionWorkspace w{};
  if (t.key == FlashAttentionTilingKey::kEmpty) return w;
  const bool fwd = t.pass == FlashAttentionPass::kForward;
  w.items = t.B * t.H * ceil_div(fwd ? t.maxSeqlenQ : t.maxSeqlen, t.baseM);
  w.steps = ceil_div(fwd ? t.maxSeqlenK : t.maxSeqlen, t.baseN);
  w.score = w.items * t.baseM * t.baseN;
  if (fwd) {
    w.rows = w.items * t.baseM * static_cast<int64_t>(align_up(t.Dv, 8));
    w.state = w.items * 3 * t.baseM;
    const int64_t slots = kFlashAttentionFusedSlots;  // pipelined
    w.fusedScore = slots * static_cast<int64_t>(t.blockDim) * t.baseM * t.baseN;
    w.fusedRows = slots * static_cast<int64_t>(t.blockDim) * t.baseM * static_cast<int64_t>(align_up(t.Dv, 8));
  } else {
    w.rows = w.items * t.baseM * t.gradCols;
    w.delta = t.T * t.H;
    w.dkRopeHeads = t.H * t.Tk * t.Dr;
    const int64_t slots = kFlashAttentionFusedSlots;  // pipelined
    w.fusedScore = slots * static_cast<int64_t>(t.blockDim) * t.baseM * t.baseN;
    w.fusedRows = slots * static_cast<int64_t>(t.blockDim) * t.baseM * t.gradCols;
  }
  return w;
}

// The key range of query block [qPos0, qPos0 + rows) of a sequence with lq queries and lk keys: all lk
// keys, or causal (bottom-right) the keys up to the one its last row sees, clamped to [0, lk].
static int64_t fa_kv_len(bool causal, int64_t qPos0, int64_t rows, int64_t lq, int64_t lk) {
  return causal ? std::min(lk, std::max<int64_t>(0, qPos0 + rows + lk - lq)) : lk;
}

std::vector<std::vector<FlashAttentionItem>> flash_attention_schedule(const FlashAttentionTiling& t,
                                                                      const std::vector<int64_t>& cu,
                                                                      const std::vector<int64_t>& cuK) {
  std::vector<std::vector<FlashAttentionItem>> out(t.blockDim);
  if (t.key == FlashAttentionTilingKey::kEmpty) return out;
  if (cuK.size() != cu.size()) throw std::invalid_argument("flash_attention_schedule: cu_seqlens_q / _k sizes differ");
  const bool causal = t.mask == FlashAttentionMask::kCausal;
  int64_t item = 0;
  for (int64_t b = 0; b + 1 < static_cast<int64_t>(cu.size()); ++b) {
    const int64_t s0 = cu[b], len = cu[b + 1] - cu[b], lk = cuK[b + 1] - cuK[b];
    const int64_t qb = ceil_div(len, t.baseM);
    for (int64_t h = 0; h < t.H; ++h)
      for (int64_t i = 0; i < qb; ++i, ++item) {
        FlashAttentionItem it;
        it.seq = b;
        it.head = h;
        it.q0 = s0 + i * t.baseM;
        it.rows = std::min<int64_t>(t.baseM, len - i * t.baseM);
        it.k0 = cuK[b];
        it.kvLen = fa_kv_len(causal, i * t.baseM, it.rows, len, lk);
        it.keyBlocks = ceil_div(it.kvLen, t.baseN);
        out[static_cast<size_t>(item % t.blockDim)].push_back(it);
      }
  }
  return out;
}

std::vector<std::vector<FlashAttentionBwdBlock>> flash_attention_bwd_schedule(const FlashAttentionTiling& t,
                                                                              const std::vector<int64_t>& cu,
                                                                              const std::vector<int64_t>& cuK) {
  std::vector<std::vector<FlashAttentionBwdBlock>> out(t.blockDim);
  if (t.key == FlashAttentionTilingKey::kEmpty) return out;
  if (cuK.size() != cu.size())
    throw std::invalid_argument("flash_attention_bwd_schedule: cu_seqlens_q / _k sizes differ");
  const int64_t b = t.baseM, steps = ceil_div(t.maxSeqlen, b);
  const bool kv = t.pass == FlashAttentionPass::kBackwardKV, causal = t.mask == FlashAttentionMask::kCausal;
  for (int64_t step = 0; step < steps; ++step) {
    int64_t item = 0;
    for (int64_t s = 0; s + 1 < static_cast<int64_t>(cu.size()); ++s) {
      const int64_t s0 = cu[s], lq = cu[s + 1] - cu[s], sk = cuK[s], lk = cuK[s + 1] - cuK[s];
      const int64_t off = lk - lq, nb = ceil_div(kv ? lk : lq, b);
      for (int64_t h = 0; h < t.H; ++h)
        for (int64_t i = 0; i < nb; ++i, ++item) {
          FlashAttentionBwdBlock k{};
          k.item = item;
          k.step = step;
          k.seq = s;
          k.head = h;
          int64_t qPos0, kPos0;
          if (kv) {
            kPos0 = i * b;
            k.cols = std::min(b, lk - kPos0);
            qPos0 = step * b;
            if (lq == 0) {  // no query: zero dK / dV rows
              if (step != 0) continue;
              k.empty = k.first = k.last = true;
              k.rows = 0;
            } else {
              if (qPos0 >= lq) continue;
              k.rows = std::min(b, lq - qPos0);
              if (causal && qPos0 + k.rows - 1 + off < kPos0) continue;
              k.first = step == (causal ? std::max<int64_t>(0, kPos0 - off) / b : 0);
              k.last = step == ceil_div(lq, b) - 1;
            }
          } else {
            qPos0 = i * b;
            k.rows = std::min(b, lq - qPos0);
            const int64_t kvLen = fa_kv_len(causal, qPos0, k.rows, lq, lk);
            kPos0 = step * b;
            if (kvLen == 0) {  // the block's rows see no key: zero dQ rows
              if (step != 0) continue;
              k.empty = k.first = k.last = true;
              k.cols = 0;
            } else {
              if (kPos0 >= kvLen) continue;
              k.cols = std::min(b, kvLen - kPos0);
              k.first = step == 0;
              k.last = step == ceil_div(kvLen, b) - 1;
            }
          }
          k.q0 = s0 + qPos0;
          k.k0 = sk + kPos0;
          out[static_cast<size_t>(item % t.blockDim)].push_back(k);
        }
    }
  }
  return out;
}

std::vector<std::vector<FlashAttentionFusedItem>> flash_attention_fused_schedule(const FlashAttentionTiling& t,
                                                                                const std::vector<int64_t>& cu,
                                                                                const std::vector<int64_t>& cuK) {
  std::vector<std::vector<FlashAttentionFusedItem>> out(t.blockDim);
  if (t.key == FlashAttentionTilingKey::kEmpty) return out;
  if (cuK.size() != cu.size())
    throw std::invalid_argument("flash_attention_fused_schedule: cu_seqlens_q / _k sizes differ");
  const bool causal = t.mask == FlashAttentionMask::kCausal, kv = t.pass == FlashAttentionPass::kBackwardKV;
  const bool fwd = t.pass == FlashAttentionPass::kForward;
  const int64_t bm = t.baseM, bn = fwd ? t.baseN : t.baseM;
  std::vector<int64_t> load(t.blockDim, 0);
  int64_t item0 = 0;
  for (int64_t s = 0; s + 1 < static_cast<int64_t>(cu.size()); ++s) {
    const int64_t lq = cu[s + 1] - cu[s], lk = cuK[s + 1] - cuK[s], off = lk - lq;
    const int64_t nb = ceil_div(kv ? lk : lq, bm);
    for (int64_t n = 0; n < nb; ++n) {
      const int64_t i = kv ? n : nb - 1 - n;
      for (int64_t h = 0; h < t.H; ++h) {
        FlashAttentionFusedItem it{};
        it.item = item0 + h * nb + i;
        it.seq = s;
        it.head = h;
        it.block = i;
        if (kv) {  // query blocks from the first whose rows see key i * bm to the last
          const int64_t k0 = i * bm, firstQ = causal && k0 - off > 0 ? k0 - off : 0;
          it.blocks = lq == 0 ? 0 : ceil_div(lq, bm) - firstQ / bm;
        } else {
          const int64_t rows = std::min(bm, lq - i * bm);
          it.blocks = ceil_div(fa_kv_len(causal, i * bm, rows, lq, lk), bn);
        }
        const size_t core = static_cast<size_t>(std::min_element(load.begin(), load.end()) - load.begin());
        load[core] += it.blocks + 1;
        out[core].push_back(it);
      }
    }
    item0 += t.H * nb;
  }
  return out;
}

}  // namespace amo_ascend
