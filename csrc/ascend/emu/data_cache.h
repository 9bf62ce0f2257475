// AscendC emulation layer: the per-core scalar DATA CACHE of an Atlas A2 AI Core (included by
// kernel_operator_emu.h; not AscendC API).
//
// On the device, scalar accesses to GM (GlobalTensor::GetValue / SetValue, and plain pointer loads)
// go through a per-core data cache with 64-byte lines, while DMA transfers (DataCopy, DataCopyPad,
// Fixpipe) bypass it. The A2 kernel build does not insert the cache maintenance for scalar GM
// accesses automatically, so a kernel has to call DataCacheCleanAndInvalid itself ("DataCacheCleanAndInvalid"
// page of the AscendC API reference: clean = write dirty lines back, invalid = drop them so the next
// access reloads from GM). What this file models, per core (AIC i / AIV i of the chip):
//   * a scalar read loads the whole 64 B line into the core's cache on a miss and serves later reads
//     from the cached copy; a scalar write changes the cached copy only (the line becomes dirty);
//   * dirty lines are written back when the core's block ends or at DataCacheCleanAndInvalid (the
//     device writes the whole line; the emulator writes the changed bytes and instead REPORTS the cases
//     where the whole-line write-back would lose another core's bytes, see below); lines stay cached (clean) after the block ends, so a later launch
//     on the same core can hit a line cached by an earlier launch;
//   * DataCacheCleanAndInvalid<T, SINGLE_CACHE_LINE, ...>(gm) cleans and drops the line holding gm's
//     first element, ENTIRE_DATA_CACHE all lines of the core.
// Checked (EmuError naming the rule, the kernel, the core and the line):
//   * LOST WRITE: a line dirtied by scalar writes of one core and written by another core (scalar or
//     DMA) in the same launch -- on the device the later whole-line write-back overwrites the other
//     core's bytes;
//   * DMA write over a line that is dirty in this core's own cache (the later write-back undoes it);
//   * STALE LINE: a scalar read or write that hits a line cached by an earlier launch and not
//     invalidated since, or a line that another core wrote (DMA or write-back) after this core cached
//     it: the cached copy may not be what GM holds.
// The kernels' tiling structs are read through GlobalTensor::GetValue after a clean + invalidate of
// their lines (kernels/kernel_common.h CopyTiling), so they go through this model too.
// Not modelled: capacity and eviction (nothing is evicted, which only makes the stale-line check
// stricter), the instruction cache.
#pragma once

#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <unordered_map>

namespace ascend_emu {

constexpr uint64_t kDcLine = 64;

struct DcLine {
  uint8_t data[kDcLine];
  bool dirty = false;
  uint64_t dirtyMask = 0;  // bytes changed by scalar writes (bit i = byte i)
  uint64_t launch = 0;   // launch that loaded the line
  uint64_t version = 0;  // GM version of the line when it was loaded
};

// Per-launch facts about a GM line.
struct DcGmLine {
  uint64_t version = 0;    // bumped on every write to GM (DMA or write-back) in this launch
  int scalarWriter = -1;   // core that dirtied the line through scalar writes in this launch
  int writer = -1;         // last core that wrote the line (any way) in this launch
  bool multiWriter = false;
};

struct DcState {
  std::recursive_mutex m;
  uint64_t launch = 0;
  std::map<int, std::unordered_map<uintptr_t, DcLine>> cores;  // core id -> cached lines
  std::unordered_map<uintptr_t, DcGmLine> gm;                  // line address -> this launch's facts
};

inline DcState& dc() {
  static DcState s;
  return s;
}

// Core identity across launches: AIC i = 1000 + i, AIV i = i.
inline int dc_core_id(bool aic, uint32_t block) { return aic ? 1000 + static_cast<int>(block) : static_cast<int>(block); }
inline std::string dc_core_name(int id) {
  return id >= 1000 ? "AIC " + std::to_string(id - 1000) : "AIV " + std::to_string(id);
}
inline uintptr_t dc_line_of(const void* p) { return reinterpret_cast<uintptr_t>(p) / kDcLine * kDcLine; }

// A new launch: per-launch GM facts reset; cached lines stay (they belong to the earlier launch).
inline void dc_begin_launch() {
  std::lock_guard<std::recursive_mutex> lk(dc().m);
  ++dc().launch;
  dc().gm.clear();
}

// Drop every cached line of every core (tests; the host has no way to do this on a device).
inline void dc_reset_all() {
  std::lock_guard<std::recursive_mutex> lk(dc().m);
  dc().cores.clear();
  dc().gm.clear();
}

[[noreturn]] inline void dc_fail(const std::string& m);  // defined in kernel_operator_emu.h (adds kernel name)

inline void dc_note_write(uintptr_t line, int core, const char* how) {
  auto& g = dc().gm[line];
  if (g.scalarWriter >= 0 && g.scalarWriter != core) {
    std::ostringstream o;
    o << "data cache (lost write): GM line 0x" << std::hex << line << std::dec << " (64 B) was written through scalar "
      << "SetValue by " << dc_core_name(g.scalarWriter) << " and by " << how << " of " << dc_core_name(core)
      << " in the same launch: the whole-line write-back of the data cache overwrites the other core's bytes. "
      << "Stage scalar results in UB and store them with DataCopyPad, or give each core whole 64 B lines";
    dc_fail(o.str());
  }
  if (g.writer >= 0 && g.writer != core) g.multiWriter = true;
  g.writer = core;
  ++g.version;
}

// Write back one dirty line (whole line) to GM.
inline void dc_write_back(int core, uintptr_t line, DcLine& l) {
  if (!l.dirty) return;
  uint8_t* gm = reinterpret_cast<uint8_t*>(line);
  for (uint64_t i = 0; i < kDcLine; ++i)
    if (l.dirtyMask >> i & 1u) gm[i] = l.data[i];
  l.dirty = false;
  l.dirtyMask = 0;
  dc_note_write(line, core, "the data cache write-back");
  l.version = dc().gm[line].version;
}

// The cached line of `core` holding `p` (loaded on a miss), after the stale-line checks.
inline DcLine& dc_line(int core, const void* p, const std::string& what) {
  const uintptr_t line = dc_line_of(p);
  auto& lines = dc().cores[core];
  auto it = lines.find(line);
  if (it != lines.end()) {
    DcLine& l = it->second;
    auto g = dc().gm.find(line);
    const uint64_t gv = g == dc().gm.end() ? 0 : g->second.version;
    if (l.launch != dc().launch && !l.dirty) {
      std::ostringstream o;
      o << "data cache (stale line): " << what << " on " << dc_core_name(core) << " hits GM line 0x" << std::hex << line
        << std::dec << " cached by an earlier launch and not invalidated since; GM may have changed (another kernel or "
        << "the host wrote it). Call DataCacheCleanAndInvalid<T, CacheLine::SINGLE_CACHE_LINE, DcciDst::CACHELINE_OUT> "
        << "on the tensor before scalar reads of GM written elsewhere";
      dc_fail(o.str());
    }
    if (l.launch == dc().launch && l.version != gv) {
      std::ostringstream o;
      o << "data cache (stale line): " << what << " on " << dc_core_name(core) << " hits GM line 0x" << std::hex << line
        << std::dec << " that was written (by a DMA transfer or another core's write-back) after this core cached it; "
        << "call DataCacheCleanAndInvalid before reading";
      dc_fail(o.str());
    }
    return l;
  }
  DcLine l;
  std::memcpy(l.data, reinterpret_cast<const void*>(line), kDcLine);
  l.launch = dc().launch;
  auto g = dc().gm.find(line);
  l.version = g == dc().gm.end() ? 0 : g->second.version;
  return lines.emplace(line, l).first->second;
}

// Scalar GM read of n bytes at p (n <= 8, naturally aligned: one line).
// `type` / `idx` name the access in errors (GlobalTensor<type>::GetValue(idx)).
inline std::string dc_what(const char* op, const char* type, uint64_t idx) {
  return std::string("scalar ") + op + "(" + std::to_string(idx) + ") of a GlobalTensor<" + type + ">";
}

inline void dc_read(int core, const void* p, void* out, uint64_t n, const char* type = "T", uint64_t idx = 0) {
  std::lock_guard<std::recursive_mutex> lk(dc().m);
  DcLine& l = dc_line(core, p, dc_what("GetValue", type, idx));
  std::memcpy(out, l.data + (reinterpret_cast<uintptr_t>(p) - dc_line_of(p)), n);
}

// Scalar GM write of n bytes at p: into the cached line only (dirty).
inline void dc_write(int core, void* p, const void* in, uint64_t n, const char* type = "T", uint64_t idx = 0) {
  std::lock_guard<std::recursive_mutex> lk(dc().m);
  const uintptr_t line = dc_line_of(p);
  DcLine& l = dc_line(core, p, dc_what("SetValue", type, idx));
  auto& g = dc().gm[line];
  if (g.writer >= 0 && g.writer != core) {
    std::ostringstream o;
    o << "data cache (lost write): " << dc_what("SetValue", type, idx) << " on " << dc_core_name(core) << " writes GM line 0x" << std::hex << line
      << std::dec << " (64 B) that " << dc_core_name(g.writer) << " wrote in the same launch: the whole-line "
      << "write-back overwrites the other core's bytes. Stage scalar results in UB and store them with DataCopyPad, "
      << "or give each core whole 64 B lines";
    dc_fail(o.str());
  }
  g.scalarWriter = core;
  g.writer = core;
  const uint64_t off = reinterpret_cast<uintptr_t>(p) - line;
  std::memcpy(l.data + off, in, n);
  for (uint64_t i = off; i < off + n && i < kDcLine; ++i) l.dirtyMask |= uint64_t(1) << i;
  l.dirty = true;
}

// A DMA write (DataCopy, DataCopyPad, Fixpipe) of [p, p + n) by `core`: bypasses the cache.
inline void dc_dma_write(int core, const void* p, uint64_t n) {
  if (n == 0) return;
  std::lock_guard<std::recursive_mutex> lk(dc().m);
  const uintptr_t first = dc_line_of(p), last = dc_line_of(static_cast<const uint8_t*>(p) + n - 1);
  auto& lines = dc().cores[core];
  for (uintptr_t line = first; line <= last; line += kDcLine) {
    auto it = lines.find(line);
    if (it != lines.end() && it->second.dirty) {
      std::ostringstream o;
      o << "data cache: DMA write of " << dc_core_name(core) << " over GM line 0x" << std::hex << line << std::dec
        << " that its own scalar writes left dirty in the data cache: the later write-back undoes the DMA write "
        << "(DataCacheCleanAndInvalid the line first)";
      dc_fail(o.str());
    }
    dc_note_write(line, core, "a DMA write");
  }
}

// DataCacheCleanAndInvalid: one line (the one holding p) or the whole cache of the core.
inline void dc_clean_invalidate(int core, const void* p, bool entire) {
  std::lock_guard<std::recursive_mutex> lk(dc().m);
  auto& lines = dc().cores[core];
  if (entire) {
    for (auto& kv : lines) dc_write_back(core, kv.first, kv.second);
    lines.clear();
    return;
  }
  auto it = lines.find(dc_line_of(p));
  if (it == lines.end()) return;
  dc_write_back(core, it->first, it->second);
  lines.erase(it);
}

// End of a block on `core`: dirty lines are written back; the lines stay cached (clean).
inline void dc_end_block(int core) {
  std::lock_guard<std::recursive_mutex> lk(dc().m);
  for (auto& kv : dc().cores[core]) dc_write_back(core, kv.first, kv.second);
}

}  // namespace ascend_emu
