// Test driver for the flash attention tiling (tests/test_ascend_flash_attention.py). One case per
// stdin line:  H Dk Dr Dv causal dtype maxBase aicNum B cu_0 ... cu_B [cuk_0 ... cuk_B]
// (cu = cu_seqlens_q; cuk = cu_seqlens_k, = cu when absent). Prints one JSON object per line: the
// tiling and the result of the exact-once coverage check of every (query row, head) pair, plus the
// key-range check (bottom-right causal: query i of a sequence sees keys j <= i + Lk - Lq).
// With the argument "bwd": the backward tiling, and for each pass of flash_attention_bwd_schedule:
// every gradient row (key rows in the KV pass, query rows in the Q pass) written by exactly one
// block (an item without blocks writes its rows as zeros through one empty entry), each item's
// blocks tiling exactly the rows it must visit (no gap, no overlap), and its first block flagged.
// Both modes also check the fused kernels' deal (flash_attention_fused_schedule: every item once, its
// block count, longest first per core and sequence) and print the largest per-core block count of the
// deal (fusedMax*) and of the phase kernels' item % blockDim (plainMax*).
#include <cstdint>
#include <algorithm>
#include <iostream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "tiling/flash_attention_tiling.h"

using namespace amo_ascend;

// Backward pass check; returns "" or the first error.
std::string check_bwd(FlashAttentionTiling t, FlashAttentionPass pass, const std::vector<int64_t>& cu,
                      const std::vector<int64_t>& cuk, int64_t H, bool causal, size_t* blocks) {
  t.pass = pass;
  const bool kv = pass == FlashAttentionPass::kBackwardKV;
  const int64_t T = cu.back(), Tk = cuk.back(), b = t.baseM;
  auto sched = flash_attention_bwd_schedule(t, cu, cuk);
  std::vector<uint8_t> written(static_cast<size_t>((kv ? Tk : T) * H), 0);
  std::map<int64_t, std::vector<std::pair<int64_t, int64_t>>> visits;  // item -> visited ranges, in step order
  std::map<int64_t, std::vector<bool>> firsts;                         // item -> first flags, in step order
  std::map<int64_t, std::pair<int64_t, int64_t>> own;                  // item -> its own rows
  std::map<int64_t, int64_t> seqOf;
  for (size_t core = 0; core < sched.size(); ++core)
    for (auto& k : sched[core]) {
      ++*blocks;
      if (static_cast<size_t>(k.item % t.blockDim) != core) return "block on the wrong core";
      const int64_t s0 = cu[k.seq], s1 = cu[k.seq + 1], sk = cuk[k.seq], sk1 = cuk[k.seq + 1];
      const int64_t off = (sk1 - sk) - (s1 - s0);
      const int64_t minRows = k.empty && !kv ? 1 : (k.empty ? 0 : 1), minCols = k.empty && kv ? 1 : (k.empty ? 0 : 1);
      if (k.rows < minRows || k.rows > b || k.cols < minCols || k.cols > b) return "block larger than baseM x baseN";
      if (k.q0 < s0 || k.q0 + k.rows > s1 || k.k0 < sk || k.k0 + k.cols > sk1) return "block crosses its sequence";
      if (!k.empty && causal && (k.q0 - s0) + k.rows - 1 + off < (k.k0 - sk))
        return "block entirely above the causal diagonal";
      const auto mine = kv ? std::make_pair(k.k0, k.cols) : std::make_pair(k.q0, k.rows);
      auto it = own.find(k.item);
      if (it != own.end() && it->second != mine) return "item changes its own rows between steps";
      own[k.item] = mine;
      seqOf[k.item] = k.seq;
      if (k.empty) {
        if (visits.count(k.item)) return "an empty item has blocks";
        visits[k.item];
      } else {
        visits[k.item].push_back(kv ? std::make_pair(k.q0, k.rows) : std::make_pair(k.k0, k.cols));
        firsts[k.item].push_back(k.first);
      }
      if (k.last)
        for (int64_t r = mine.first; r < mine.first + mine.second; ++r)
          if (++written[static_cast<size_t>(r * H + k.head)] > 1) return "gradient row written twice";
    }
  for (auto c : written)
    if (c != 1) return "gradient row never written";
  for (auto& [item, v] : visits) {
    const auto& f = firsts[item];
    for (size_t n = 0; n < f.size(); ++n)
      if (f[n] != (n == 0)) return "first flag not on the item's first block";
    std::sort(v.begin(), v.end());
    const int64_t s = seqOf[item], s0 = cu[s], s1 = cu[s + 1], sk = cuk[s], sk1 = cuk[s + 1];
    const int64_t lq = s1 - s0, lk = sk1 - sk, off = lk - lq;
    const auto mine = own[item];
    // rows to visit: KV pass -> every query row that sees a key of the block (all of them without
    // causal; causal from the query block holding query k0 - off); Q pass -> the keys seen by the
    // block's last row (causal: up to its position + off, clamped to [0, lk])
    int64_t from, to;
    if (kv) {
      from = s0 + (causal ? std::max<int64_t>(0, mine.first - sk - off) / b * b : 0);
      to = s1;
      if (lq == 0) from = to;
    } else {
      from = sk;
      to = sk + (causal ? std::min(lk, std::max<int64_t>(0, mine.first - s0 + mine.second + off)) : lk);
    }
    int64_t at = from;
    for (auto& [r0, n] : v) {
      if (r0 != at) return "item's visits leave a gap or overlap";
      at = r0 + n;
    }
    if (at != to) return "item's visits do not reach the end of its range";
  }
  return "";
}

// The fused kernels' deal for pass t.pass (flash_attention_fused_schedule): every item exactly once, with
// the blocks `want` counts for it; the largest per-core block count of the deal and of item % blockDim.
std::string check_fused(FlashAttentionTiling t, FlashAttentionPass pass, const std::vector<int64_t>& cu,
                        const std::vector<int64_t>& cuk, const std::map<int64_t, int64_t>& want, int64_t items,
                        int64_t* maxDealt, int64_t* maxPlain) {
  t.pass = pass;
  const auto sched = flash_attention_fused_schedule(t, cu, cuk);
  std::vector<int64_t> seen(static_cast<size_t>(items), 0), plain(t.blockDim, 0);
  *maxDealt = *maxPlain = 0;
  std::string err;
  for (size_t c = 0; c < sched.size(); ++c) {
    int64_t load = 0, prev = -1;
    for (const auto& it : sched[c]) {
      if (it.item < 0 || it.item >= items) return "fused: item number out of range";
      ++seen[static_cast<size_t>(it.item)];
      auto w = want.find(it.item);
      if (it.blocks != (w == want.end() ? 0 : w->second)) err = "fused: wrong block count";
      if (prev >= 0 && it.seq == sched[c][static_cast<size_t>(prev)].seq &&
          it.blocks > sched[c][static_cast<size_t>(prev)].blocks)
        err = "fused: a core's items of one sequence not longest first";
      prev = static_cast<int64_t>(&it - &sched[c][0]);
      load += it.blocks;
      plain[static_cast<size_t>(it.item % t.blockDim)] += it.blocks;
    }
    *maxDealt = std::max(*maxDealt, load);
  }
  for (auto p : plain) *maxPlain = std::max(*maxPlain, p);
  for (auto n : seen)
    if (n != 1) return "fused: item not dealt exactly once";
  return err;
}

int main(int argc, char** argv) {
  const bool bwd = argc > 1 && std::string(argv[1]) == "bwd";
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    int64_t H, Dk, Dr, Dv, B;
    int causal, dtype;
    uint32_t maxBase, aic;
    in >> H >> Dk >> Dr >> Dv >> causal >> dtype >> maxBase >> aic >> B;
    std::vector<int64_t> cu(static_cast<size_t>(B + 1)), cuk;
    for (auto& c : cu) in >> c;
    int64_t x;
    while (in >> x) cuk.push_back(x);
    if (cuk.empty()) cuk = cu;
    if (cuk.size() != cu.size()) {
      std::cout << "{\"ok\":false,\"error\":\"driver: cu_k needs B + 1 entries\"}" << std::endl;
      continue;
    }
    int64_t maxLen = 0, maxLenK = 0;
    for (int64_t b = 0; b < B; ++b) maxLen = std::max<int64_t>(maxLen, cu[b + 1] - cu[b]);
    for (int64_t b = 0; b < B; ++b) maxLenK = std::max<int64_t>(maxLenK, cuk[b + 1] - cuk[b]);
    const int64_t T = cu[B], Tk = cuk[B];
    ChipInfo chip = Ascend910B2();
    chip.aicNum = aic;
    chip.aivNum = 2 * aic;
    try {
      FlashAttentionTiling t =
          bwd ? compute_flash_attention_bwd_tiling(T, Tk, H, Dk, Dr, Dv, B, maxLen, maxLenK, causal != 0,
                                                   static_cast<DType>(dtype), chip, maxBase)
              : compute_flash_attention_tiling(T, Tk, H, Dk, Dr, Dv, B, maxLen, maxLenK, causal != 0,
                                               static_cast<DType>(dtype), chip, maxBase);
      if (bwd) {
        size_t blocks = 0;
        std::string err = check_bwd(t, FlashAttentionPass::kBackwardKV, cu, cuk, H, causal != 0, &blocks);
        if (err.empty()) err = check_bwd(t, FlashAttentionPass::kBackwardQ, cu, cuk, H, causal != 0, &blocks);
        const auto w = flash_attention_workspace(t);
        // the fused deal of each pass against the blocks flash_attention_bwd_schedule lists per item
        int64_t fusedMax[2] = {0, 0}, plainMax[2] = {0, 0};
        for (int k = 0; k < 2 && err.empty(); ++k) {
          const FlashAttentionPass pass = k == 0 ? FlashAttentionPass::kBackwardKV : FlashAttentionPass::kBackwardQ;
          FlashAttentionTiling tp = t;
          tp.pass = pass;
          std::map<int64_t, int64_t> want;
          int64_t items = 0;
          for (auto& core : flash_attention_bwd_schedule(tp, cu, cuk))
            for (auto& blk : core) {
              items = std::max(items, blk.item + 1);
              if (!blk.empty) ++want[blk.item];
            }
          int64_t nItems = 0;  // every item of the pass, also those the schedule lists with no block
          for (int64_t s = 0; s < B; ++s)
            nItems += H * (((k == 0 ? cuk[s + 1] - cuk[s] : cu[s + 1] - cu[s]) + t.baseM - 1) / t.baseM);
          err = check_fused(t, pass, cu, cuk, want, nItems, &fusedMax[k], &plainMax[k]);
        }
        std::ostringstream o;
        o << "{\"ok\":true,\"key\":" << uint32_t(t.key) << ",\"blockDim\":" << t.blockDim
          << ",\"vecBlockDim\":" << t.vecBlockDim << ",\"baseM\":" << t.baseM << ",\"baseN\":" << t.baseN
          << ",\"vecRows\":" << t.vecRows << ",\"gradCols\":" << t.gradCols << ",\"l1Buffers\":" << t.l1Buffers
          << ",\"l0Buffers\":" << t.l0Buffers << ",\"l0cBuffers\":" << t.l0cBuffers << ",\"l1Bytes\":" << t.l1Bytes
          << ",\"l0aBytes\":" << t.l0aBytes << ",\"l0bBytes\":" << t.l0bBytes << ",\"l0cBytes\":" << t.l0cBytes
          << ",\"ubBytes\":" << t.ubBytes << ",\"ubFusedBytes\":" << t.ubFusedBytes << ",\"fusedPipe\":" << t.fusedPipe << ",\"deltaRows\":" << t.deltaRows
          << ",\"dkropeRows\":" << t.dkropeRows << ",\"qkChunk\":" << t.qkChunk
          << ",\"items\":" << w.items
          << ",\"steps\":" << w.steps
          << ",\"blocks\":" << blocks << ",\"fusedMaxKV\":" << fusedMax[0] << ",\"plainMaxKV\":" << plainMax[0]
          << ",\"fusedMaxQ\":" << fusedMax[1] << ",\"plainMaxQ\":" << plainMax[1]
          << ",\"coverage\":\"" << (err.empty() ? "ok" : err) << "\"}";
        std::cout << o.str() << std::endl;
        continue;
      }
      auto sched = flash_attention_schedule(t, cu, cuk);
      std::vector<uint8_t> cover(static_cast<size_t>(T * H), 0);
      std::string err;
      size_t items = 0, keyless = 0;
      for (size_t c = 0; c < sched.size(); ++c)
        for (auto& it : sched[c]) {
          ++items;
          const int64_t s0 = cu[it.seq], len = cu[it.seq + 1] - s0, lk = cuk[it.seq + 1] - cuk[it.seq];
          if (it.rows <= 0 || it.rows > t.baseM) err = "item outside the query block";
          if (it.q0 < s0 || it.q0 + it.rows > s0 + len) err = "item crosses its sequence";
          if (it.k0 != cuk[it.seq]) err = "wrong key start";
          // the keys the block's last query row sees (bottom-right causal), brute force
          int64_t want = 0;
          for (int64_t j = 0; j < lk; ++j)
            if (!causal || j <= (it.q0 - s0 + it.rows - 1) + lk - len) want = j + 1;
          if (it.kvLen != want) err = "wrong key range";
          if (it.keyBlocks * t.baseN < it.kvLen || (it.keyBlocks > 0 && (it.keyBlocks - 1) * t.baseN >= it.kvLen))
            err = "wrong key block count";
          if (it.keyBlocks == 0) ++keyless;
          for (int64_t r = it.q0; r < it.q0 + it.rows; ++r)
            if (++cover[static_cast<size_t>(r * H + it.head)] > 1) err = "query row covered twice";
        }
      for (auto c : cover)
        if (c != 1) { if (err.empty()) err = "query row not covered"; break; }
      // the fused forward's deal, against the key blocks of flash_attention_schedule's items (numbered
      // b-major: sequence, head, query block)
      int64_t fusedMax = 0, plainMax = 0;
      if (err.empty()) {
        std::map<int64_t, int64_t> want;
        int64_t item0 = 0;
        for (int64_t s = 0; s < B; ++s) {
          const int64_t nb = (cu[s + 1] - cu[s] + t.baseM - 1) / t.baseM;
          for (size_t c = 0; c < sched.size(); ++c)
            for (auto& it : sched[c])
              if (it.seq == s) want[item0 + it.head * nb + (it.q0 - cu[s]) / t.baseM] = it.keyBlocks;
          item0 += H * nb;
        }
        err = check_fused(t, FlashAttentionPass::kForward, cu, cuk, want, static_cast<int64_t>(items), &fusedMax,
                          &plainMax);
      }
      std::ostringstream o;
      o << "{\"ok\":true,\"key\":" << uint32_t(t.key) << ",\"blockDim\":" << t.blockDim << ",\"baseM\":" << t.baseM
        << ",\"baseN\":" << t.baseN << ",\"vecRows\":" << t.vecRows << ",\"l1Buffers\":" << t.l1Buffers
        << ",\"l0Buffers\":" << t.l0Buffers << ",\"l0cBuffers\":" << t.l0cBuffers << ",\"ubBuffers\":" << t.ubBuffers
        << ",\"l1Bytes\":" << t.l1Bytes << ",\"l0aBytes\":" << t.l0aBytes << ",\"l0bBytes\":" << t.l0bBytes
        << ",\"l0cBytes\":" << t.l0cBytes << ",\"ubBytes\":" << t.ubBytes << ",\"ubFusedBytes\":" << t.ubFusedBytes << ",\"fusedPipe\":" << t.fusedPipe
        << ",\"qkChunk\":" << t.qkChunk
        << ",\"vecBlockDim\":" << t.vecBlockDim << ",\"items\":" << items << ",\"keyless\":" << keyless
        << ",\"steps\":" << flash_attention_workspace(t).steps << ",\"fusedMax\":" << fusedMax
        << ",\"plainMax\":" << plainMax << ",\"coverage\":\"" << (err.empty() ? "ok" : err) << "\"}";
      std::cout << o.str() << std::endl;
    } catch (const std::exception& e) {
      std::cout << "{\"ok\":false,\"error\":\"" << e.what() << "\"}" << std::endl;
    }
  }
}
