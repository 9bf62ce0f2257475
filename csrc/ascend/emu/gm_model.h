// Cross-core GM model of the AscendC emulation layer (included by kernel_operator_emu.h; plain C++17,
// no CANN code; docs/ascend.md, "A2 rules: GM between cores").
//
// On the chip the cores of one launch run concurrently and GM is shared; the emulator runs them one
// after another (or under the mixed launch's scheduler), so two cores that touch the same GM bytes
// without an ordering give a result that depends on timing on the device but looks fine here. This
// model records, per launch, every GM access of every core -- the DMA transfers (DataCopy /
// DataCopyPad GM <-> UB, ND2NZ GM -> L1, Fixpipe L0C -> GM) and the scalar GlobalTensor::GetValue /
// SetValue -- as (bytes, core, pipe, index of the instruction on its pipe, read/write, atomic mode),
// and throws EmuError when a core accesses bytes that ANOTHER core wrote, or writes bytes another
// core read, and the earlier access is not known complete to the later core. Knowledge between
// cores comes only from the cross-core flags (mode 2, CrossCoreSetFlag<2, pipe> ->
// CrossCoreWaitFlag): a set carries what ITS pipe has completed (the pipe model's snapshot of that
// pipe: its own earlier instructions and whatever it waited for) plus what the setter knew of other
// cores; the matching wait hands it to the waiting core (treated as a wait on PIPE_S: every later
// instruction of the waiter is ordered after it). Two writes in the same atomic-accumulate mode
// (SetAtomicAdd<T>, same T) do not conflict with each other. SyncAll is not in the emulated subset,
// so a single-type launch (launch / launch_cube) has no ordering between its blocks at all.
// The model is on with the pipe model (ASCEND_MOE_OPS_EMU_PIPES, default on) and costs one hash
// look-up per 1 KiB of GM touched.
#pragma once

#include <cstdint>
#include <mutex>
#include <sstream>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "data_cache.h"
#include "pipe_model.h"

namespace ascend_emu {

// The atomic-accumulate mode of a core's GM writes (SetAtomicAdd<T> / SetAtomicNone).
enum class AtomicKind : uint8_t { kNone, kF32, kF16, kBF16, kI8, kI16, kI32 };
inline const char* atomic_name(AtomicKind k) {
  switch (k) {
    case AtomicKind::kNone: return "none";
    case AtomicKind::kF32: return "float";
    case AtomicKind::kF16: return "half";
    case AtomicKind::kBF16: return "bfloat16_t";
    case AtomicKind::kI8: return "int8_t";
    case AtomicKind::kI16: return "int16_t";
    case AtomicKind::kI32: return "int32_t";
  }
  return "?";
}
inline uint32_t atomic_size(AtomicKind k) {
  return k == AtomicKind::kF32 || k == AtomicKind::kI32 ? 4 : k == AtomicKind::kI8 ? 1 : k == AtomicKind::kNone ? 0 : 2;
}
// The calling core's mode (functional: the stores accumulate whether or not the model is on).
inline AtomicKind& gm_atomic() {
  static thread_local AtomicKind k = AtomicKind::kNone;
  return k;
}

// What one core knows complete of other cores: core id -> clock of that core's pipes.
using GmKnown = std::vector<std::pair<int, Clock>>;

inline void gm_join(GmKnown& into, int core, const Clock& c) {
  for (auto& kv : into)
    if (kv.first == core) {
      join(kv.second, c);
      return;
    }
  into.emplace_back(core, c);
}

struct GmRec {
  uint64_t lo = 0, hi = 0;  // absolute byte addresses, clipped to one granule
  int core = 0;
  int pipe = 0;
  uint32_t seq = 0;
  bool write = false;
  AtomicKind atomic = AtomicKind::kNone;
  const char* instr = "";
};

struct GmState {
  static constexpr int kGranBits = 10;  // 1 KiB granules
  std::mutex m;
  bool on = false;
  std::unordered_map<uint64_t, std::vector<GmRec>> gran;
  std::unordered_map<int, GmKnown> known;  // per core
};
inline GmState& gm() {
  static GmState s;
  return s;
}

inline void gm_begin_launch(bool on) {
  std::lock_guard<std::mutex> lk(gm().m);
  gm().on = on;
  gm().gran.clear();
  gm().known.clear();
}
// A block starts on `core`: it knows nothing of other cores yet; no atomic mode.
inline void gm_begin_block(int core) {
  gm_atomic() = AtomicKind::kNone;
  std::lock_guard<std::mutex> lk(gm().m);
  gm().known[core].clear();
}

// The message a cross-core set carries: what `core` knows of others plus `own` (its pipe's snapshot).
inline GmKnown gm_message(int core, const Clock& own) {
  std::lock_guard<std::mutex> lk(gm().m);
  if (!gm().on) return {};
  GmKnown msg = gm().known[core];
  gm_join(msg, core, own);
  return msg;
}
inline void gm_acquire(int core, const GmKnown& msg) {
  std::lock_guard<std::mutex> lk(gm().m);
  if (!gm().on) return;
  auto& k = gm().known[core];
  for (auto& kv : msg)
    if (kv.first != core) gm_join(k, kv.first, kv.second);
}

[[noreturn]] inline void fail(const std::string& m);  // kernel_operator_emu.h

// An access of the current instruction of `model` (core `core`) to GM bytes [p, p + bytes).
inline void gm_touch(const PipeModel& model, int core, const void* p, uint64_t bytes, bool write, AtomicKind atomic) {
  if (bytes == 0 || !model.on()) return;
  GmState& s = gm();
  std::lock_guard<std::mutex> lk(s.m);
  if (!s.on) return;
  const uint64_t lo = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(p)), hi = lo + bytes;
  const int pipe = model.cur_pipe();
  const uint32_t seq = model.cur_seq();
  const GmKnown* kn = nullptr;
  for (uint64_t g = lo >> GmState::kGranBits; g <= (hi - 1) >> GmState::kGranBits; ++g) {
    const uint64_t glo = g << GmState::kGranBits, ghi = glo + (uint64_t(1) << GmState::kGranBits);
    const uint64_t clo = lo > glo ? lo : glo, chi = hi < ghi ? hi : ghi;
    auto& v = s.gran[g];
    GmRec* mine = nullptr;  // a record of this very instruction to extend
    bool covers = false;    // an earlier record of this core, pipe and kind that this access covers
    for (auto& r : v) {
      if (r.core == core) {
        if (r.pipe == pipe && r.write == write && r.atomic == atomic) {
          if (!mine && r.seq == seq && r.lo <= chi && clo <= r.hi) mine = &r;
          else if (clo <= r.lo && r.hi <= chi) covers = true;
        }
        continue;
      }
      if (!(r.lo < chi && clo < r.hi) || !(r.write || write)) continue;
      if (r.write && write && atomic != AtomicKind::kNone && r.atomic == atomic) continue;  // both accumulate
      if (!kn) kn = &s.known[core];
      bool ok = false;
      for (auto& kv : *kn)
        if (kv.first == r.core) ok = kv.second[r.pipe] >= r.seq;
      if (ok) continue;
      const uint64_t olo = clo > r.lo ? clo : r.lo, ohi = chi < r.hi ? chi : r.hi;
      std::ostringstream o;
      const char* kind = r.write ? (write ? "write-after-write" : "read-after-write") : "write-after-read";
      o << "GM race between cores (" << kind << ") in kernel " << model.kernel() << ": GM bytes [0x" << std::hex << olo
        << ", 0x" << ohi << std::dec << ") " << (r.write ? "written" : "read") << " by " << r.instr << " on "
        << dc_core_name(r.core) << " (" << pipe_name(r.pipe) << (r.atomic != AtomicKind::kNone ? ", atomic add " : "")
        << (r.atomic != AtomicKind::kNone ? atomic_name(r.atomic) : "") << ") and " << (write ? "written" : "read")
        << " by " << model.cur_name() << " on " << dc_core_name(core) << " (" << pipe_name(pipe)
        << (atomic != AtomicKind::kNone ? ", atomic add " : "") << (atomic != AtomicKind::kNone ? atomic_name(atomic) : "")
        << ") in the same launch, with no ordering between them";
      if (r.write && write && r.atomic != atomic && r.atomic != AtomicKind::kNone && atomic != AtomicKind::kNone)
        o << ": atomic accumulation in two different types";
      o << ". Give each core its own bytes (a ragged tail with DataCopyPad, not a DataCopy rounded up to 32 B), "
        << "accumulate with SetAtomicAdd<T> on both sides, or order the two with a cross-core flag set on the pipe "
        << "that made the first access (CrossCoreSetFlag<2, " << pipe_name(r.pipe) << "> -> CrossCoreWaitFlag)";
      fail(o.str());
    }
    if (covers) {  // superseded: a later access must be ordered after this one, hence after those
      size_t keep = 0;
      for (size_t i = 0; i < v.size(); ++i) {
        const GmRec& r = v[i];
        const bool drop = &r != mine && r.core == core && r.pipe == pipe && r.write == write && r.atomic == atomic &&
                          clo <= r.lo && r.hi <= chi;
        if (!drop) {
          if (mine == &v[i]) mine = &v[keep];
          if (keep != i) v[keep] = v[i];
          ++keep;
        }
      }
      v.resize(keep);
    }
    if (mine) {
      mine->lo = mine->lo < clo ? mine->lo : clo;
      mine->hi = mine->hi > chi ? mine->hi : chi;
    } else {
      GmRec r;
      r.lo = clo;
      r.hi = chi;
      r.core = core;
      r.pipe = pipe;
      r.seq = seq;
      r.write = write;
      r.atomic = atomic;
      r.instr = model.cur_name();
      v.push_back(r);
    }
  }
}

}  // namespace ascend_emu
