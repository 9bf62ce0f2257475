// Tiling of the AscendC flash attention forward (plain C++17, no CANN include; chip facts in
// tiling_common.h).
//
// Shapes (schema flash_attention_fwd in ascend_moe_ops/_library.py): q [T, H, Dq], k [Tk, H, Dk],
// v [Tk, H, Dv], optional k_rope [Tk, Dr] shared by every head (then Dq = Dk + Dr, and the score is
// q[:, :Dk]·k + q[:, Dk:]·k_rope: two Cube Mmads accumulating into the same L0C tile, so k_rope is
// never expanded per head), packed sequences given by cu_seqlens_q [B + 1] (Lq_b queries from
// cu_q[b]) and cu_seqlens_k [B + 1] (Lk_b keys from cu_k[b]); Lq_b != Lk_b allowed, either may be 0.
//
// Work items: (sequence b, head h, query block i) with i < ceil(Lq_b / baseM), in that order (b
// outer, then h, then i). Item t runs on core t % blockDim. The sequence lengths stay on the device
// (the kernel reads both cu_seqlens from GM and walks the sequences itself); the host only knows B
// and max_seqlen_q / max_seqlen_k, which bound the item and step counts. Each item walks its key
// blocks of baseN keys with the online softmax: all Lk_b keys, or causal (bottom-right aligned: query
// i sees keys j <= i + Lk_b - Lq_b) up to the last key its last query row sees. An item that sees no
// key (Lk_b = 0, or causal with its last row i + Lk_b - Lq_b < 0) has no key block: its rows get
// out 0 and lse -inf, as does every row that sees no key inside an item (row sum l = 0).
//
// Buffers (fp16/bf16 inputs, 16 x 16 fractals, fp32 accumulation):
//   L1  : Q block baseM x up16(Dq) (nope and rope parts, one buffer), and per key block, l1Buffers deep:
//         K block baseN x up16(Dk), K-rope block baseN x up16(Dr), V block baseN x up16(Dv),
//         P block baseM x baseN (the fp16/bf16 probabilities written back by the vector side)
//   L0A : l0Buffers x baseM x max(dq, up16(Dr), baseN)           (Q parts, then P)
//   L0B : l0Buffers x max(baseN x dq, baseN x up16(Dr), baseN x up16(Dv))   (K^T parts, then V)
//         dq = min(up16(Dk), qkChunk): Q . K^T runs as ceil(Dk / qkChunk) Mmads over column chunks of
//         the head dim (accumulating in L0C) where a whole Dk row would shrink baseM / baseN (e.g. the
//         Pangu / DeepSeek 192-wide q/k heads: 128 + 64 at 128 x 128 blocks instead of 80 x 80 blocks)
//   L0C : l0cBuffers x baseM x max(baseN, up16(Dv)) fp32                (S, then O_partial)
//   UB of the fused kernel amo_fa_fused (ubFusedBytes), tile-wise: the S tile (vecRows x baseN fp32),
//         the P tile (vecRows x baseN, input dtype), the O accumulator and O_partial tiles (vecRows x
//         up8(Dv) fp32 each), the output tile (vecRows x up8(Dv) or up16(Dv), input dtype), per-row
//         broadcast blocks (up8(vecRows) x 8 fp32), 12 state vectors of up8(vecRows) fp32 (alpha of
//         the two blocks and m, l of the two items in flight -- the key blocks of a core's items run as
//         one stream --, row max, row sum, chunk partial, m_old, 1 / l, lse), and 8 fp32 + one output
//         row for items without keys. Extras where they fit (fusedPipe): a second S and P tile, the
//         alphas of the other blocks and the m, l of the other items in flight.
//   UB  : per AIV core, the softmax state of vecRows = ceil(baseM / (aivNum / aicNum)) query rows
//         (the AIVs paired with one AIC split its query block by rows), fp32: S rows (vecRows x baseN,
//         ubBuffers deep), P rows in the input type (vecRows x baseN), O accumulator and O_partial
//         (vecRows x up8(Dv) fp32 each), row max / row sum / rescale factor (3 x up8(vecRows) fp32)
//         and a ReduceSum work buffer.
#pragma once

#ifndef __CCE_AICORE__  // host only: the kernels (device pass of bisheng) see the POD structs
#include <vector>
#endif

#include "tiling_common.h"

namespace amo_ascend {

// Most AI Cores a fused flash attention launch deals its items to (the kernels' FaDeal keeps one load
// per core on the stack); the tilings cap blockDim here.
constexpr uint32_t kFlashAttentionMaxCores = 64;
// GM slots per workspace and AI Core of the fused kernels (amo_fa_fused, amo_fab_fused): the AIC runs
// up to kFlashAttentionFusedSlots - 1 blocks ahead of its AIVs (S of blocks j + 1 .. j + 3 while they
// work on block j; three slots and two blocks before 2026-12-07, v07.4).
constexpr uint32_t kFlashAttentionFusedSlots = 4;
// L1 buffers per Cube operand queue the tilings plan first (l1Buffers; back to 2 before a block or a
// head-dim chunk shrinks): with two, the MTE2 copy of an operand waited for the L1 -> L0 load of the
// operand two Mmads back, and that load for the copy's DMA latency, so MTE2 and MTE1 ran as one chain
// (table v07.4 timeline of the fused forward). A2 allows up to 8 queue buffers per TPosition (A1 also
// holds the fused forward's Q block).
constexpr uint32_t kFlashAttentionL1Buffers = 4;

enum class FlashAttentionTilingKey : uint32_t { kEmpty = 0, kF16 = 1, kBF16 = 2 };
enum class FlashAttentionMask : uint32_t { kNone = 0, kCausal = 1 };
enum class FlashAttentionRope : uint32_t { kNone = 0, kSharedKey = 1 };
// Which pass a phase launch belongs to (set by the host per launch, like `step`).
//   kForward   : items (b, h, query block i), steps over key blocks j      (kernels amo_fa_*)
//   kBackwardKV: items (b, h, key block j),   steps over query blocks i    (kernels amo_fab_*): dK, dV, dK_rope
//   kBackwardQ : items (b, h, query block i), steps over key blocks j      (kernels amo_fab_*): dQ
// An item of a backward pass with no block (KV pass: Lq_b = 0; Q pass: its rows see no key) writes
// zero gradient rows.
enum class FlashAttentionPass : uint32_t { kForward = 0, kBackwardKV = 1, kBackwardQ = 2 };

struct FlashAttentionTiling {
  FlashAttentionTilingKey key;
  FlashAttentionMask mask;
  FlashAttentionRope rope;
  uint32_t blockDim;                 // cores launched (<= aicNum)
  uint32_t baseM, baseN;             // query rows x key rows per step, multiples of 16
  uint32_t vecRows;                  // query rows per AIV core (softmax in UB)
  uint32_t l1Buffers, l0Buffers, l0cBuffers, ubBuffers;
  int64_t T, H, Dk, Dr, Dv, B;      // T = query tokens; Dq = Dk + Dr
  int64_t maxSeqlen;                // max(maxSeqlenQ, maxSeqlenK): block sizes and workspace bounds
  int64_t Tk;                       // key tokens (rows of k, v, k_rope, dk, dv, dk_rope)
  int64_t maxSeqlenQ, maxSeqlenK;   // bounds of the longest query / key sequence (the host's arguments)
  uint64_t l1Bytes, l0aBytes, l0bBytes, l0cBytes, ubBytes;  // planned per core
  float softmaxScale;   // set by the host
  uint32_t step;        // key block (forward, backward Q pass) or query block (backward KV pass) of the
                        // current phase launch (set by the host, see kernels/flash_attention_*.cpp)
  FlashAttentionPass pass;  // set by the host per launch
  uint32_t vecBlockDim; // AIV cores of the vector phases: min(aivNum, blockDim * ceil(baseM / vecRows))
  uint32_t gradCols;    // backward: fp32 row width of the gradient workspaces, up8(Dk) + up8(Dr) + up8(Dv)
  uint32_t ubFusedBytes;  // fused mixed kernels (amo_fa_fused / amo_fab_fused): UB per AIV
  uint32_t deltaRows;     // backward: rows per tile of amo_fab_delta (0: row by row; set when Dv % 16 == 0)
  uint32_t fusedPipe;     // fused kernels' AIV extras, planned only where they fit the UB left over by the
                          // base plan (so they never change baseM / baseN): bit 0 (kFaPipeDouble) a second
                          // score tile and P tile (forward; backward: S and dP) for the prefetch of the next
                          // block (bit 1, an added causal mask triangle, is no longer planned)
  uint32_t dkropeRows;    // backward: key tokens per tile of amo_fab_dkrope (0: token by token; set when Dr > 0
                          // and Dr % 16 == 0)
  uint32_t qkChunk;       // columns of Dk per Mmad (a multiple of 16): forward and backward Q . K^T in K-chunks
                          // accumulating into one L0C tile, the backward's dK = dS^T . Q and dQ = dS . K in
                          // N-chunks (one L0C tile and Fixpipe each); 0 or >= Dk: one Mmad. Narrower than Dk
                          // where a whole up16(Dk) row would make the L0 tiles shrink the blocks
};
constexpr uint32_t kFaPipeDouble = 1;

// Device addresses handed to the phase kernels as one GM block (uint64 each; the kernels read them
// with CopyTiling and cast to GM_ADDR). Workspaces are fp32 unless noted; sizes in elements from
// flash_attention_workspace().
struct FlashAttentionFwdArgs {
  uint64_t q, k, v, kRope, cu, cuK; // inputs (kRope 0 without rope; cu / cuK = cu_seqlens_q / _k as int64 [B + 1])
  uint64_t s, p, oPart, o, state;   // workspaces (p in the input dtype)
  uint64_t out, lse;                // outputs: out [T, H, Dv] input dtype, lse [H, T] fp32
};
struct FlashAttentionBwdArgs {
  uint64_t q, k, v, kRope, cu, cuK, out, dout, lse;  // inputs (cu / cuK: cu_seqlens_q / _k as int64;
                                                     // forward's out and lse, dout [T, H, Dv])
  uint64_t delta;                   // [T * H] rowsum(dout * out), written by amo_fab_delta
  uint64_t s, dp, p, ds;            // per item baseM x baseN scores; p, ds in the input dtype
  uint64_t part, acc;               // per item baseM x gradCols products and their running sum (acc zeroed
                                    // by the host before each pass)
  uint64_t dkRopeHeads;             // [H, Tk, Dr] per-head dK_rope (rope only), summed by amo_fab_dkrope
  uint64_t dq, dk, dv, dkRope;      // outputs in the input dtype (dq [T, ..], dk / dv [Tk, ..], dkRope [Tk, Dr])
};

struct FlashAttentionWorkspace {
  int64_t items;        // work items of a pass: forward B * H * ceil(maxSeqlenQ / baseM); backward (one
                        // bound for both passes) B * H * ceil(max(maxSeqlenQ, maxSeqlenK) / baseM)
  int64_t steps;        // phase launches per pass: forward ceil(maxSeqlenK / baseN); backward (square
                        // blocks, one bound for both passes) ceil(max(maxSeqlenQ, maxSeqlenK) / baseM)
  int64_t score;        // s, p (and dp, ds): items * baseM * baseN
  int64_t rows;         // forward oPart, o: items * baseM * up8(Dv); backward part, acc: items * baseM * gradCols
  int64_t state;        // forward: items * 3 * baseM
  int64_t delta;        // backward: T * H
  int64_t dkRopeHeads;  // backward: H * Tk * Dr
  int64_t fusedScore;   // fused kernels (pipelined, kFlashAttentionFusedSlots slots per AI Core): S and P
                        // (and dP, dS), slots * blockDim * baseM * baseN
  int64_t fusedRows;    // fused kernels: O_partial slots (forward: slots * blockDim * baseM * up8(Dv)) or
                        // gradient-product slots (backward: slots * blockDim * baseM * gradCols)
};
FlashAttentionWorkspace flash_attention_workspace(const FlashAttentionTiling& t);

// T / Tk: query / key tokens; maxSeqlenQ / maxSeqlenK: bounds of the longest query / key sequence.
// maxBase (0 = none) caps baseM and baseN so tests can force many small blocks.
FlashAttentionTiling compute_flash_attention_tiling(int64_t T, int64_t Tk, int64_t H, int64_t Dk, int64_t Dr,
                                                    int64_t Dv, int64_t B, int64_t maxSeqlenQ, int64_t maxSeqlenK,
                                                    bool causal, DType dtype, const ChipInfo& chip,
                                                    uint32_t maxBase = 0);

// Backward tiling: square blocks (baseM == baseN), buffers sized for every product of the two passes
// (S = Q K^T + Q_rope K_rope^T and dP = dO V^T; then dV = P^T dO, dK = dS^T Q, dK_rope = dS^T Q_rope in
// the KV pass and dQ = dS [K | K_rope] in the Q pass). Launch order (host):
//   amo_fab_delta (AIV, vecBlockDim)
//   fused (default): for pass in (kBackwardKV, kBackwardQ): amo_fab_fused (mixed, blockDim AI Cores)
//   phases: for pass in (kBackwardKV, kBackwardQ): zero acc; for step < steps:
//       amo_fab_qk (AIC, blockDim), amo_fab_softmax (AIV), amo_fab_grad (AIC), amo_fab_acc (AIV)
//   amo_fab_dkrope (AIV, vecBlockDim; rope only)
FlashAttentionTiling compute_flash_attention_bwd_tiling(int64_t T, int64_t Tk, int64_t H, int64_t Dk, int64_t Dr,
                                                        int64_t Dv, int64_t B, int64_t maxSeqlenQ,
                                                        int64_t maxSeqlenK, bool causal, DType dtype,
                                                        const ChipInfo& chip, uint32_t maxBase = 0);

#ifndef __CCE_AICORE__  // host-side twins of the kernels' walks (tests)
// Host twin of the kernel's walk (tests): the work items each core runs, in order.
struct FlashAttentionItem {
  int64_t seq, head;
  int64_t q0, rows;   // query rows [q0, q0 + rows) of the packed tensor
  int64_t k0;         // first key row of the sequence in the packed k (cu_seqlens_k[seq])
  int64_t kvLen;      // keys attended: [k0, k0 + kvLen) (0: the item sees no key)
  int64_t keyBlocks;  // ceil(kvLen / baseN)
};
std::vector<std::vector<FlashAttentionItem>> flash_attention_schedule(const FlashAttentionTiling& t,
                                                                      const std::vector<int64_t>& cuSeqlensQ,
                                                                      const std::vector<int64_t>& cuSeqlensK);

// Host twin of the backward kernels' walk (FabWalk): for pass t.pass, every (item, step) block a core
// runs, in launch order (steps outer), with the query and key rows it covers. Blocks entirely above
// the causal diagonal are not listed (the kernels skip them).
struct FlashAttentionBwdBlock {
  int64_t item, step, seq, head;
  int64_t q0, rows;  // query rows [q0, q0 + rows) of the packed tensor
  int64_t k0, cols;  // key rows [k0, k0 + cols) of the packed tensor
  bool first;        // the item's first block: its running sums start
  bool last;         // the item's last block: its gradient rows are written out
  bool empty;        // an item without any block (listed once, step 0, rows / cols = its own rows, the
                     // other extent 0): it writes zero gradient rows
};
std::vector<std::vector<FlashAttentionBwdBlock>> flash_attention_bwd_schedule(const FlashAttentionTiling& t,
                                                                              const std::vector<int64_t>& cuSeqlensQ,
                                                                              const std::vector<int64_t>& cuSeqlensK);

// Host twin of the fused kernels' deal (FaDeal / FaDealtCursor in
// kernels/flash_attention_common.h): for pass t.pass (kForward: amo_fa_fused; kBackwardKV / kBackwardQ:
// amo_fab_fused) the items each AI Core runs, in order: each sequence's items longest first (block index
// outer: query blocks from the last in the forward and Q pass, key blocks from the first in the KV pass;
// heads inner), each dealt to the core with the least work so far (cost: its blocks + 1; ties to the
// lowest core). `item` is the b-major number (sequence, head, block) of flash_attention_schedule /
// _bwd_schedule; `blocks` the item's key blocks (forward, Q pass) or query blocks (KV pass).
struct FlashAttentionFusedItem {
  int64_t item, seq, head, block, blocks;
};
std::vector<std::vector<FlashAttentionFusedItem>> flash_attention_fused_schedule(const FlashAttentionTiling& t,
                                                                                const std::vector<int64_t>& cuSeqlensQ,
                                                                                const std::vector<int64_t>& cuSeqlensK);

#endif  // __CCE_AICORE__

}  // namespace amo_ascend
