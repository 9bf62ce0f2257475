// Timeline recorder of the emulator's pipe model (plain C++17; included by pipe_model.h). OFF unless
// a caller turns it on (ascend_emu::timeline::start); then every launch records, per core and in
// issue order, each instruction the pipe model sees: its pipe, its name, what it moves or computes
// (GM bytes of a DMA, the largest local operand in bytes, Cube MACs and useful FLOPs of an Mmad) and
// its happens-before predecessors as the pipe model's vector clock at issue (instructions 1..c[q] of
// pipe q complete before it starts, joined with the compiler's auto-sync edges of its accesses).
// Cross-core flags of mixed launches (CrossCoreSetFlag / CrossCoreWaitFlag, mode 2) are recorded as
// a SET record on the setting pipe and a WAIT record on the waiting core's scalar unit, the wait
// naming the set(s) it consumed (first set, first consumed).
//
// Consecutive instructions of one pipe with the same name and the same predecessors, and no flag,
// queue hand-over or barrier between them, are merged into one record with `count` instructions (the
// sums of their bytes and MACs): the schedule is the same up to the per-instruction overheads, which
// the timeline model charges per instruction. This keeps the Pangu-shape launches at a few hundred
// thousand records.
//
// With `skip_compute` the Cube instructions (ND2NZ copies, LoadData, Mmad, Fixpipe) record but skip
// their arithmetic: the kernel's control flow does not depend on those values, and the results are
// garbage -- for timing the Pangu shapes only, never for tests of results.
//
// Each record also keeps the GM address ranges its DMAs touched (for the timeline's L2 cache model), as
// strided runs (address, bytes, stride, count, read / write): the rows of one DataCopyPad or ND2NZ copy
// collapse into one run, contiguous accesses into one range.
//
// ascend_moe_ops/perfmodel/a2_timeline.py turns a recording into durations and a schedule.
#pragma once

#include <array>
#include <charconv>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

namespace ascend_emu {
namespace timeline {

constexpr int kPipes = 7;          // S, V, M, MTE1, MTE2, MTE3, FIX (pipe_model.h order)
constexpr int kSet = 7, kWait = 8;  // side records: cross-core flag set / wait
using TlClock = std::array<uint32_t, kPipes>;

// A strided run of GM accesses of one record: `count` ranges of `len` bytes, `stride` bytes apart.
struct GmRun {
  uint64_t addr = 0, len = 0, stride = 0;
  uint32_t count = 1;
  bool write = false;
};

struct Rec {
  int pipe = 0;
  const char* name = "";
  uint32_t count = 1;
  uint32_t seq = 0;  // seq of its first instruction on its pipe (1-based; 0 for side records)
  uint64_t gm = 0, local = 0, macs = 0, flops = 0, l0b = 0;  // l0b: bytes written to L0B
  TlClock clock{};
  std::vector<GmRun> gmr;  // the GM address ranges of its DMAs (L2 model)
};

struct Launch;

class CoreRec {
 public:
  CoreRec(Launch* l, uint32_t index, bool aiv, uint32_t block) : launch_(l), index_(index), aiv_(aiv), block_(block) {}

  // A new instruction on pipe p with sequence number seq, its clock at issue.
  void begin(int p, const char* name, uint32_t seq, const TlClock& clock) {
    curMax_ = 0;
    if (mergeable_ && !recs_.empty()) {
      Rec& l = recs_.back();
      if (l.pipe == p && l.name == name && l.clock == clock && l.seq + l.count == seq) {
        ++l.count;
        return;
      }
    }
    Rec r;
    r.pipe = p;
    r.name = name;
    r.seq = seq;
    r.clock = clock;
    recs_.push_back(r);
    mergeable_ = true;
  }
  // An access of the current instruction: GM bytes add up; of the local operands the largest counts.
  void touch(uint64_t addr, uint64_t bytes, bool gm, const char* space, bool write) {
    if (recs_.empty()) return;
    Rec& r = recs_.back();
    if (r.pipe == 3 && !write) return;  // LoadData (MTE1): the bytes it writes; its source range spans the strides
    if (write && space[0] == 'L' && space[1] == '0' && space[2] == 'B') r.l0b += bytes;
    if (gm) {
      r.gm += bytes;
      add_run(r, addr, bytes, write);
    } else if (bytes > curMax_) {
      r.local += bytes - curMax_;
      curMax_ = bytes;
    }
  }
  // A vector instruction of the repeat (high-dimension) form: the vector unit runs it as `repeats`
  // iterations of one 256-byte (8 x 32 B block) step each, whatever its strides or mask (API reference,
  // repeatTimes), so its work is repeats x 256 B, not the span of its strided operands.
  void vec_iterations(uint64_t repeats) {
    if (recs_.empty()) return;
    const uint64_t bytes = repeats * kVecIterationBytes;
    Rec& r = recs_.back();
    r.local = r.local - curMax_ + bytes;
    curMax_ = bytes;
  }
  static constexpr uint64_t kVecIterationBytes = 256;
  void join(const TlClock& c) {  // an auto-sync edge of the current instruction
    if (recs_.empty()) return;
    for (int i = 0; i < kPipes; ++i) recs_.back().clock[i] = c[i] > recs_.back().clock[i] ? c[i] : recs_.back().clock[i];
  }
  void mmad(uint64_t macs, uint64_t flops) {
    if (recs_.empty()) return;
    recs_.back().macs += macs;
    recs_.back().flops += flops;
  }
  void brk() { mergeable_ = false; }
  // Append GM range [addr, addr + bytes) to the record's runs: it extends the last run when it
  // continues it (contiguous, or the next row at the run's stride), else starts a new one.
  static void add_run(Rec& r, uint64_t addr, uint64_t bytes, bool write) {
    if (!r.gmr.empty()) {
      GmRun& l = r.gmr.back();
      if (l.write == write) {
        if (l.count == 1 && addr == l.addr + l.len) {
          l.len += bytes;
          return;
        }
        if (bytes == l.len && addr > l.addr) {
          if (l.count == 1) {
            l.stride = addr - l.addr;
            l.count = 2;
            return;
          }
          if (addr == l.addr + uint64_t(l.count) * l.stride) {
            ++l.count;
            return;
          }
        }
      }
    }
    GmRun n;
    n.addr = addr;
    n.len = bytes;
    n.write = write;
    r.gmr.push_back(n);
  }  // a flag / queue event: the next instruction starts a new record

  void cross_set(int pipe, const TlClock& c, int flag);
  void cross_wait(int flag);

  bool aiv() const { return aiv_; }
  uint32_t block() const { return block_; }
  uint32_t index() const { return index_; }
  const std::vector<Rec>& recs() const { return recs_; }
  const std::vector<std::array<uint32_t, 3>>& cross() const { return cross_; }

 private:
  uint32_t group() const { return aiv_ ? block_ / 2 : block_; }
  Launch* launch_;
  uint32_t index_;
  bool aiv_;
  uint32_t block_;
  bool mergeable_ = false;
  uint64_t curMax_ = 0;
  std::vector<Rec> recs_;
  std::vector<std::array<uint32_t, 3>> cross_;  // (wait record, set core index, set record)
};

struct Launch {
  std::string kernel, kind;
  uint32_t blockDim = 0;
  std::vector<std::unique_ptr<CoreRec>> cores;
  // pending cross-core sets: (group, flag, target) -> FIFO of (core index, record index);
  // target 0 / 1: the AIV of that sub index; 2 / 3: the AIC, from AIV 0 / 1.
  std::map<std::tuple<uint32_t, int, int>, std::deque<std::pair<uint32_t, uint32_t>>> sets;
};

struct State {
  std::mutex mu;
  bool on = false, skip = false;
  std::vector<std::unique_ptr<Launch>> launches;
};
inline State& state() {
  static State s;
  return s;
}

inline bool recording() { return state().on; }
inline bool skip_compute() { return state().on && state().skip; }

inline void start(bool skipCompute) {
  std::lock_guard<std::mutex> lk(state().mu);
  state().on = true;
  state().skip = skipCompute;
  state().launches.clear();
}

inline void launch_begin(const std::string& kernel, const char* kind, uint32_t blockDim) {
  if (!recording()) return;
  std::lock_guard<std::mutex> lk(state().mu);
  auto l = std::make_unique<Launch>();
  l->kernel = kernel;
  l->kind = kind;
  l->blockDim = blockDim;
  state().launches.push_back(std::move(l));
}

// Called by PipeModel::reset for every block of a launch: the block's recorder, or nullptr when off.
inline CoreRec* core_begin(bool aiv, uint32_t block) {
  if (!recording()) return nullptr;
  std::lock_guard<std::mutex> lk(state().mu);
  if (state().launches.empty()) return nullptr;  // a block run outside a recorded launch
  Launch& l = *state().launches.back();
  l.cores.push_back(std::make_unique<CoreRec>(&l, static_cast<uint32_t>(l.cores.size()), aiv, block));
  return l.cores.back().get();
}

inline void CoreRec::cross_set(int pipe, const TlClock& c, int flag) {
  std::lock_guard<std::mutex> lk(state().mu);
  Rec r;
  r.pipe = kSet;
  r.name = "CrossCoreSetFlag";
  r.clock = c;
  r.seq = static_cast<uint32_t>(pipe);  // side record: seq holds the pipe the set was issued on
  recs_.push_back(r);
  mergeable_ = false;
  const std::pair<uint32_t, uint32_t> me{index_, static_cast<uint32_t>(recs_.size() - 1)};
  if (aiv_) {
    launch_->sets[{group(), flag, 2 + static_cast<int>(block_ % 2)}].push_back(me);
  } else {
    launch_->sets[{group(), flag, 0}].push_back(me);
    launch_->sets[{group(), flag, 1}].push_back(me);
  }
}

inline void CoreRec::cross_wait(int flag) {
  std::lock_guard<std::mutex> lk(state().mu);
  Rec r;
  r.pipe = kWait;
  r.name = "CrossCoreWaitFlag";
  recs_.push_back(r);
  mergeable_ = false;
  const uint32_t w = static_cast<uint32_t>(recs_.size() - 1);
  auto take = [&](int target) {
    auto& q = launch_->sets[{group(), flag, target}];
    if (q.empty()) return;  // the emulator's counters already reported a wait without a set
    cross_.push_back({w, q.front().first, q.front().second});
    q.pop_front();
  };
  if (aiv_) {
    take(static_cast<int>(block_ % 2));
  } else {
    take(2);
    take(3);
  }
}

inline void json_str(std::ostringstream& o, const std::string& s) {
  o << '"';
  for (char ch : s) {
    if (ch == '"' || ch == '\\') o << '\\' << ch;
    else if (static_cast<unsigned char>(ch) < 0x20) o << ' ';
    else o << ch;
  }
  o << '"';
}

// Everything recorded since start() as JSON, and recording off. Per launch: kernel, kind
// ("vector" | "cube" | "mix"), block_dim, names (the instruction names), and per core its type, block,
// records [pipe, name index, count, seq, gm bytes, local bytes, macs, flops, L0B bytes, clock x 7],
// cross [wait record, set core, set record] and gmr [record, address, bytes, stride, count, write] (the
// GM runs of its records, in record order).
inline void json_num(std::string& o, uint64_t v) {
  char buf[24];
  auto r = std::to_chars(buf, buf + sizeof(buf), v);
  o.append(buf, r.ptr);
}

inline std::string take_json() {
  std::lock_guard<std::mutex> lk(state().mu);
  std::string o = "{\"launches\":[";
  bool firstL = true;
  for (auto& l : state().launches) {
    if (!firstL) o += ',';
    firstL = false;
    std::map<const char*, int> ids;  // names are string literals: one pointer per name
    std::vector<std::string> names;
    auto id = [&](const char* n) {
      auto it = ids.find(n);
      if (it != ids.end()) return it->second;
      const int k = static_cast<int>(names.size());
      ids.emplace(n, k);
      names.emplace_back(n);
      return k;
    };
    std::string cores;
    bool firstC = true;
    for (auto& c : l->cores) {
      if (!firstC) cores += ',';
      firstC = false;
      cores += c->aiv() ? "{\"type\":\"aiv\",\"block\":" : "{\"type\":\"aic\",\"block\":";
      json_num(cores, c->block());
      cores += ",\"recs\":[";
      bool firstR = true;
      for (const Rec& r : c->recs()) {
        cores += firstR ? "[" : ",[";
        firstR = false;
        json_num(cores, static_cast<uint64_t>(r.pipe));
        for (uint64_t v : {static_cast<uint64_t>(id(r.name)), uint64_t(r.count), uint64_t(r.seq), r.gm, r.local, r.macs,
                           r.flops, r.l0b}) {
          cores += ',';
          json_num(cores, v);
        }
        for (uint32_t v : r.clock) {
          cores += ',';
          json_num(cores, v);
        }
        cores += ']';
      }
      cores += "],\"cross\":[";
      bool firstX = true;
      for (auto& x : c->cross()) {
        cores += firstX ? "[" : ",[";
        firstX = false;
        json_num(cores, x[0]);
        cores += ',';
        json_num(cores, x[1]);
        cores += ',';
        json_num(cores, x[2]);
        cores += ']';
      }
      cores += "],\"gmr\":[";
      bool firstG = true;
      for (size_t ri = 0; ri < c->recs().size(); ++ri) {
        for (const GmRun& g : c->recs()[ri].gmr) {
          cores += firstG ? "[" : ",[";
          firstG = false;
          json_num(cores, ri);
          for (uint64_t v : {g.addr, g.len, g.stride, uint64_t(g.count), uint64_t(g.write ? 1 : 0)}) {
            cores += ',';
            json_num(cores, v);
          }
          cores += ']';
        }
      }
      cores += "]}";
    }
    std::ostringstream h;
    h << "{\"kernel\":";
    json_str(h, l->kernel);
    h << ",\"kind\":\"" << l->kind << "\",\"block_dim\":" << l->blockDim << ",\"names\":[";
    for (size_t i = 0; i < names.size(); ++i) {
      if (i) h << ',';
      json_str(h, names[i]);
    }
    h << "],\"cores\":[";
    o += h.str();
    o += cores;
    o += "]}";
  }
  o += "]}";
  state().launches.clear();
  state().on = false;
  state().skip = false;
  return o;
}

}  // namespace timeline
}  // namespace ascend_emu
