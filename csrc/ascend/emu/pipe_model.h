// Per-core pipe model and race detector of the AscendC emulation layer (included by
// kernel_operator_emu.h; plain C++17, no CANN code).
//
// The emulator runs every instruction at once, in program order. On the chip each instruction is
// issued by the scalar unit into the queue of one pipe (Atlas A2: S scalar, V vector, M cube, MTE1
// L1 -> L0A/L0B, MTE2 GM -> UB/L1, MTE3 UB -> GM, FIX L0C -> GM) and the pipes run concurrently: an
// instruction may start before an instruction of ANOTHER pipe issued earlier has finished, unless a
// synchronization orders them. This model keeps, per core, a vector clock per pipe and a record of
// every local-memory access (buffer, byte range, read/write, pipe, issue index), and throws
// ascend_emu::EmuError when two accesses to overlapping bytes of one buffer from different pipes, at
// least one a write, are not ordered by the happens-before relation built from:
//   * program order within one pipe;
//   * dispatch order: the scalar unit issues every instruction, so whatever the scalar pipe has
//     waited for (WaitFlag<X_S>, PipeBarrier<PIPE_ALL>) is complete before any later instruction;
//   * SetFlag<HardEvent::X_Y>(id) / WaitFlag<HardEvent::X_Y>(id): everything issued on X before the
//     set is complete before anything issued on Y after the wait (event ids 0..7 per pipe pair; a
//     wait with no pending set would hang the pipe and is an error);
//   * PipeBarrier<PIPE_X>: everything before it on X completes before anything after it on X;
//     PipeBarrier<PIPE_ALL>: everything before it on every pipe completes first;
//   * queues: TQue EnQue is a set on the producer pipe of the queue's position and DeQue the matching
//     wait on the consumer pipe; FreeTensor a set on the consumer pipe and the next AllocTensor of
//     that buffer the wait on the producer pipe (VECIN: MTE2 -> V, VECOUT: V -> MTE3, VECIN->VECOUT:
//     MTE2 -> MTE3, A1/B1: MTE2 -> MTE1, A2/B2: MTE1 -> M, CO1: M -> FIX). TBuf carries no sync;
//   * on vector (AIV) cores only, the syncs the compiler's automatic synchronization inserts for a
//     conflicting pair of accesses: the pairs the public BiSheng / AscendC documentation lists, i.e.
//     the scalar-related ones (S <-> V, S <-> MTE2, S <-> MTE3; V -> V is program order here).
//     V <-> MTE2, V <-> MTE3, MTE2 <-> MTE3 need a flag or a queue. Cube (AIC) cores get none.
// Also checked: two writes to overlapping bytes on the same data-movement pipe (MTE1, MTE2, MTE3,
// FIX) need a PipeBarrier of that pipe (or any sync chain) between them; consecutive Mmads that
// accumulate into one L0C tile need PipeBarrier<PIPE_M> between them when ceil(m/16)*ceil(n/16) < 10.
// GM (global memory) accesses of the DMA instructions are tracked WITHIN ONE CORE the same way: the
// byte ranges DataCopy / DataCopyPad read (GM -> UB / L1, MTE2) and write (UB -> GM, MTE3), and
// Fixpipe writes (L0C -> GM, FIX), are kept per block in one interval list (cleared at block start)
// and checked against the same happens-before relation: e.g. a row stored on MTE3 and read back on
// MTE2 needs SetFlag/WaitFlag<HardEvent::MTE3_MTE2> (auto-sync does not insert it). Scalar GM
// accesses (GlobalTensor::GetValue/SetValue) and ordering between cores are not part of this model
// (the data-cache model, data_cache.h, and the cross-core flags cover those).
//
// ASCEND_MOE_OPS_EMU_PIPES=off turns the model off (for debugging a kernel only; CI runs it on).
// ASCEND_MOE_OPS_EMU_AUTOSYNC=wide widens the AIV auto-sync to every ordered pair of S, V, MTE2, MTE3
// except V -> MTE2, MTE3 -> MTE2 and MTE2 -> V (issue 12's reading; an explicit option only, not
// documented behaviour); `scalar` (or unset) is the documented set above.
#pragma once

#include <array>
#include <cstdint>
#include <cstdlib>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "timeline.h"

namespace ascend_emu {

// Defined in kernel_operator_emu.h (throws ascend_emu::EmuError).
[[noreturn]] inline void fail(const std::string& m);

// Pipe indices of the model (same order as AscendC::pipe_t in the emulator).
enum PipeId : int { kPipeS = 0, kPipeV, kPipeM, kPipeMTE1, kPipeMTE2, kPipeMTE3, kPipeFIX, kNumPipes };
inline const char* pipe_name(int p) {
  static const char* n[] = {"PIPE_S", "PIPE_V", "PIPE_M", "PIPE_MTE1", "PIPE_MTE2", "PIPE_MTE3", "PIPE_FIX"};
  return p >= 0 && p < kNumPipes ? n[p] : "PIPE_?";
}
inline const char* pipe_short(int p) {
  static const char* n[] = {"S", "V", "M", "MTE1", "MTE2", "MTE3", "FIX"};
  return p >= 0 && p < kNumPipes ? n[p] : "?";
}

using Clock = std::array<uint32_t, kNumPipes>;
inline void join(Clock& a, const Clock& b) {
  for (int i = 0; i < kNumPipes; ++i) a[i] = b[i] > a[i] ? b[i] : a[i];
}

// One recorded access (ranges are byte offsets inside the buffer).
struct Access {
  uint64_t lo = 0, hi = 0;
  uint64_t issue = 0;          // index of the instruction in the block (all pipes)
  uint32_t seq = 0;            // index of the instruction on its pipe (1-based)
  int pipe = 0;
  bool write = false;
  Clock known{};               // what its pipe knew when it was issued
  const char* instr = "";
};

// Sync state a queue buffer carries between EnQue -> DeQue and FreeTensor -> AllocTensor.
struct QueueSync {
  Clock enq{}, freed{};
};

// The access records of one buffer (a queue buffer or a TBuf).
struct BufferRecords {
  std::vector<Access> acc;
};

// Default: the documented (scalar-related) set; "wide" is the explicit opt-in to the wider one.
inline bool autosync_scalar_only() {
  const char* e = std::getenv("ASCEND_MOE_OPS_EMU_AUTOSYNC");
  return !(e && std::string(e) == "wide");
}

inline bool pipes_enabled() {
  const char* e = std::getenv("ASCEND_MOE_OPS_EMU_PIPES");
  if (!e) return true;
  const std::string v(e);
  return !(v == "0" || v == "off" || v == "OFF" || v == "false");
}

// Set by a caller that launches lambdas (test drivers): the kernel name used in messages.
inline std::string& kernel_label_override() {
  static thread_local std::string s;
  return s;
}

class PipeModel {
 public:
  void reset(bool on, bool aiv, uint32_t block, std::string kernel) {
    on_ = on;
    aiv_ = aiv;
    scalarAuto_ = on && autosync_scalar_only();
    block_ = block;
    kernel_ = std::move(kernel);
    for (auto& c : vc_) c.fill(0);
    count_.fill(0);
    issued_ = 0;
    fence_ = 0;
    pending_.clear();
    lastMmad_ = nullptr;
    cur_ = Cur{};
    gm_.acc.clear();
    tl_ = on ? timeline::core_begin(aiv, block) : nullptr;  // the timeline recorder, when asked
  }
  bool on() const { return on_; }
  bool aiv() const { return aiv_; }
  const std::string& kernel() const { return kernel_; }
  timeline::CoreRec* tl() const { return tl_; }

  // A new instruction on pipe p (all its accesses follow until the next begin()).
  void begin(int p, const char* name) {
    if (!on_) return;
    if (p != kPipeS) join(vc_[p], vc_[kPipeS]);  // dispatched by the scalar unit after what it waited for
    cur_.pipe = p;
    cur_.seq = ++count_[p];
    cur_.issue = ++issued_;
    cur_.name = name;
    if (tl_) tl_->begin(p, name, cur_.seq, vc_[p]);
  }

  // An access of the current instruction to bytes [lo, hi) of a buffer.
  void touch(BufferRecords& r, const std::string& owner, const char* space, uint64_t lo, uint64_t hi, bool write) {
    if (!on_ || hi <= lo) return;
    if (tl_) tl_->touch(lo, hi - lo, gmRanges_, space, write);
    const int q = cur_.pipe;
    auto& list = r.acc;
    // newest first: the closest unordered predecessor is the one reported
    for (size_t i = list.size(); i-- > 0;) {
      const Access& b = list[i];
      if (b.issue > fence_ && b.lo < hi && lo < b.hi && (b.write || write)) check_pair(b, q, write, owner, space, lo, hi);
    }
    size_t keep = 0;
    for (size_t i = 0; i < list.size(); ++i) {
      const Access& b = list[i];
      // b is ordered before this access now; a write (or a read over a read) covering b makes b redundant
      const bool drop = b.issue <= fence_ || (lo <= b.lo && b.hi <= hi && (write || !b.write));
      if (!drop) {
        if (keep != i) list[keep] = list[i];
        ++keep;
      }
    }
    list.resize(keep);
    Access a;
    a.lo = lo;
    a.hi = hi;
    a.issue = cur_.issue;
    a.seq = cur_.seq;
    a.pipe = q;
    a.write = write;
    a.known = vc_[q];
    a.instr = cur_.name;
    // merge with the last record when it is the same instruction's (e.g. the rows of one strided DMA)
    // and contiguous; never across instructions: the merged record would carry the later one's
    // sequence number, so an access ordered after the earlier instruction but not the later one,
    // reading only the earlier one's bytes, would be reported as a race (a load into one half of a
    // buffer while the vector unit reads the other half)
    if (!list.empty()) {
      Access& l = list.back();
      if (l.issue == a.issue && l.pipe == q && l.write == write && l.lo <= hi && lo <= l.hi) {
        a.lo = l.lo < lo ? l.lo : lo;
        a.hi = l.hi > hi ? l.hi : hi;
        l = a;
        return;
      }
    }
    list.push_back(a);
    if (list.size() > 24) prune(list);
  }

  // A DMA access of the current instruction to GM bytes [addr, addr + bytes) (absolute addresses).
  void touch_gm(const void* addr, uint64_t bytes, bool write) {
    if (!on_ || bytes == 0) return;
    const uint64_t lo = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(addr));
    if (tl_ && timeline::skip_compute()) return tl_->touch(lo, bytes, true, "GM", write);  // timing-only: no GM checks
    gmRanges_ = true;
    touch(gm_, "global memory", "GM", lo, lo + bytes, write);
    gmRanges_ = false;
  }

  void set_flag(int src, int dst, int id, const char* ev) {
    if (!on_) return;
    check_event(id, ev, "SetFlag");
    if (tl_) tl_->brk();
    Clock c = vc_[src];
    if (src != kPipeS) join(c, vc_[kPipeS]);
    c[src] = count_[src];
    for (auto& p : pending_)
      if (p.src == src && p.dst == dst && p.id == id) {  // a set flag set again: the later set covers both
        join(p.clock, c);
        return;
      }
    pending_.push_back(Pending{src, dst, id, c});
  }
  void wait_flag(int src, int dst, int id, const char* ev) {
    if (!on_) return;
    check_event(id, ev, "WaitFlag");
    for (size_t i = 0; i < pending_.size(); ++i) {
      auto& p = pending_[i];
      if (p.src == src && p.dst == dst && p.id == id) {
        join(vc_[dst], p.clock);
        pending_.erase(pending_.begin() + static_cast<long>(i));
        return;
      }
    }
    std::ostringstream o;
    o << "flag rule in kernel " << kernel_ << ", block " << block_ << ": WaitFlag<HardEvent::" << ev << ">(" << id
      << ") with no pending SetFlag<HardEvent::" << ev << ">(" << id << "): " << pipe_name(dst)
      << " would wait forever";
    fail(o.str());
  }
  void barrier(int p) {  // p == kNumPipes: PIPE_ALL
    if (!on_) return;
    if (p == kNumPipes) {
      for (auto& c : vc_) c = count_;
      fence_ = issued_;
      return;
    }
    vc_[p][p] = count_[p];
  }

  // Queue hand-over: snapshot of pipe p (everything issued on it so far), and the wait side.
  Clock snapshot(int p) const {
    if (tl_) tl_->brk();
    Clock c = vc_[p];
    if (p != kPipeS) join(c, vc_[kPipeS]);
    c[p] = count_[p];
    return c;
  }
  // What a cross-core flag set on pipe p covers: p's snapshot plus every scalar instruction issued so
  // far (the scalar unit runs in order and dispatches the set after them).
  Clock flag_clock(int p) const {
    Clock c = snapshot(p);
    c[kPipeS] = count_[kPipeS];
    return c;
  }
  void acquire(int p, const Clock& c) {
    if (on_) join(vc_[p], c);
  }

  // PIPE_M rule: called by Mmad (current instruction on PIPE_M) with its L0C destination.
  void mmad(const void* dstBuf, const std::string& owner, uint64_t lo, uint64_t hi, bool accumulate, uint32_t m,
            uint32_t n) {
    if (!on_) return;
    const uint32_t tiles = ((m + 15) / 16) * ((n + 15) / 16);
    if (accumulate && lastMmad_ == dstBuf && lastLo_ < hi && lo < lastHi_ && tiles < 10 &&
        vc_[kPipeM][kPipeM] < lastSeq_ && lastIssue_ > fence_) {
      std::ostringstream o;
      o << "PIPE_M rule in kernel " << kernel_ << ", block " << block_ << ": Mmad (issue #" << cur_.issue
        << ", m=" << m << " n=" << n << ": " << tiles << " < 10 L0C fractals) accumulates into L0C bytes [" << lo
        << ", " << hi << ") of " << owner << " right after the Mmad of issue #" << lastIssue_
        << " with no PipeBarrier<PIPE_M>() between them (small accumulating Mmads overlap on A2)";
      fail(o.str());
    }
    lastMmad_ = dstBuf;
    lastLo_ = lo;
    lastHi_ = hi;
    lastSeq_ = cur_.seq;
    lastIssue_ = cur_.issue;
  }

  // The current instruction (cross-core GM model, gm_model.h).
  int cur_pipe() const { return cur_.pipe; }
  uint32_t cur_seq() const { return cur_.seq; }
  const char* cur_name() const { return cur_.name; }
  uint32_t block() const { return block_; }

  bool ordered(int from, uint32_t seq, int to) const { return vc_[to][from] >= seq || vc_[kPipeS][from] >= seq; }

 private:
  struct Cur {
    int pipe = 0;
    uint32_t seq = 0;
    uint64_t issue = 0;
    const char* name = "";
  };
  struct Pending {
    int src, dst, id;
    Clock clock;
  };

  static bool transfer_pipe(int p) { return p == kPipeMTE1 || p == kPipeMTE2 || p == kPipeMTE3 || p == kPipeFIX; }
  // The compiler's automatic sync on AIV inserts p -> q for a conflicting pair (issue 12 / docs/ascend.md).
  bool auto_synced(int p, int q) const {
    if (!aiv_) return false;
    auto vecside = [](int x) { return x == kPipeS || x == kPipeV || x == kPipeMTE2 || x == kPipeMTE3; };
    if (!vecside(p) || !vecside(q)) return false;
    if (scalarAuto_) return p == kPipeS || q == kPipeS;
    if (p == kPipeV && q == kPipeMTE2) return false;
    if (p == kPipeMTE3 && q == kPipeMTE2) return false;
    if (p == kPipeMTE2 && q == kPipeV) return false;
    return true;
  }

  void check_event(int id, const char* ev, const char* what) const {
    if (id < 0 || id > 7) {
      std::ostringstream o;
      o << "flag rule in kernel " << kernel_ << ", block " << block_ << ": " << what << "<HardEvent::" << ev << ">("
        << id << "): event ids are 0..7 per pipe pair";
      fail(o.str());
    }
  }

  std::string range(uint64_t lo, uint64_t hi) const {
    std::ostringstream o;
    if (gmRanges_)
      o << "[0x" << std::hex << lo << ", 0x" << hi << ")";
    else
      o << "[" << lo << ", " << hi << ")";
    return o.str();
  }

  void check_pair(const Access& b, int q, bool write, const std::string& owner, const char* space, uint64_t lo,
                  uint64_t hi) {
    const int p = b.pipe;
    const uint64_t olo = lo > b.lo ? lo : b.lo, ohi = hi < b.hi ? hi : b.hi;
    if (p == q) {
      if (!(write && b.write && transfer_pipe(q))) return;  // program order
      if (ordered(p, b.seq, q)) return;
      std::ostringstream o;
      o << "same-pipe overlap in kernel " << kernel_ << ", block " << block_ << ": " << b.instr << " (issue #"
        << b.issue << ") and " << cur_.name << " (issue #" << cur_.issue << ") both write " << space << " bytes "
        << range(olo, ohi) << " of " << owner << " on " << pipe_name(q)
        << " with no PipeBarrier<" << pipe_name(q) << ">() between them";
      fail(o.str());
    }
    if (vc_[q][p] >= b.seq) return;
    if (auto_synced(p, q)) {  // the compiler inserts SetFlag<p_q> after b and WaitFlag<p_q> before this one
      Clock c = b.known;
      c[p] = b.seq;
      join(vc_[q], c);
      if (tl_) tl_->join(c);
      return;
    }
    const char* kind = b.write ? (write ? "write-after-write" : "read-after-write") : "write-after-read";
    std::ostringstream o;
    o << "pipe race (" << kind << ", missing sync " << pipe_short(p) << "->" << pipe_short(q) << ") in kernel "
      << kernel_ << ", block " << block_ << ": " << space << " bytes " << range(olo, ohi) << " of " << owner << ": " << b.instr << " on " << pipe_name(p) << " (issue #"
      << b.issue << ", " << (b.write ? "write" : "read") << ") and " << cur_.name << " on " << pipe_name(q)
      << " (issue #" << cur_.issue << ", " << (write ? "write" : "read") << ") are not ordered: add SetFlag/WaitFlag<HardEvent::"
      << pipe_short(p) << "_" << pipe_short(q) << ">, a queue EnQue/DeQue or a PipeBarrier<PIPE_ALL>()";
    fail(o.str());
  }

  // Drop records that every pipe of this core type already knows complete.
  void prune(std::vector<Access>& list) const {
    static const int aivPipes[] = {kPipeS, kPipeV, kPipeMTE2, kPipeMTE3};
    static const int aicPipes[] = {kPipeS, kPipeM, kPipeMTE1, kPipeMTE2, kPipeFIX};
    size_t keep = 0;
    for (size_t i = 0; i < list.size(); ++i) {
      const Access& b = list[i];
      bool known = b.issue <= fence_ || vc_[kPipeS][b.pipe] >= b.seq;
      if (!known) {
        known = true;
        const int* ps = aiv_ ? aivPipes : aicPipes;
        const int n = aiv_ ? 4 : 5;
        for (int k = 0; k < n && known; ++k)
          if ((ps[k] != b.pipe || (b.write && transfer_pipe(b.pipe))) && vc_[ps[k]][b.pipe] < b.seq) known = false;
      }
      if (!known) {
        if (keep != i) list[keep] = list[i];
        ++keep;
      }
    }
    list.resize(keep);
  }

  timeline::CoreRec* tl_ = nullptr;  // timeline.h: set by reset() while a recording is on
  bool on_ = false, aiv_ = false, scalarAuto_ = false, gmRanges_ = false;
  BufferRecords gm_;  // GM accesses of this block's DMA instructions (absolute byte addresses)
  uint32_t block_ = 0;
  std::string kernel_;
  std::array<Clock, kNumPipes> vc_{};  // vc_[q][p]: instructions of p known complete before q's next one
  Clock count_{};                      // instructions issued per pipe
  uint64_t issued_ = 0, fence_ = 0;    // fence_: issue index of the last PipeBarrier<PIPE_ALL>
  std::vector<Pending> pending_;
  Cur cur_;
  const void* lastMmad_ = nullptr;
  uint64_t lastLo_ = 0, lastHi_ = 0, lastIssue_ = 0;
  uint32_t lastSeq_ = 0;
};

}  // namespace ascend_emu
