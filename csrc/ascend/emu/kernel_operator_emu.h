// AscendC emulation layer: a plain C++17 implementation of exactly the subset of the AscendC kernel
// API (CANN 8.x, namespace AscendC) that the kernels in csrc/ascend/kernels use, so that the very same
// kernel sources compile with g++ and run on a CPU (ascend_moe_ops._ascendc_emu, tests).
//
// Written from the public CANN documentation of these APIs; no CANN code is used or copied.
//
// WHAT IT CHECKS (each violation throws ascend_emu::EmuError with a message naming the rule):
//   * UB capacity: every TPipe::InitBuffer allocation is placed in the block's UB (32-byte aligned);
//     the total may not exceed the capacity given to the launcher (the tiling's UB budget). At most
//     one TPipe per block; a queue/buffer is initialized once.
//   * Queue protocol of TQue/TQueBind: AllocTensor needs a free buffer, EnQue needs an allocated
//     tensor of this queue and respects the queue depth, DeQue needs a queued tensor, FreeTensor needs
//     an allocated or dequeued tensor of this queue. Using a LocalTensor after FreeTensor, or while it
//     sits in a queue (between EnQue and DeQue), is an error. A block that ends with a tensor still
//     allocated or queued is an error (reported by the launcher).
//   * DataCopy moves whole 32-byte blocks: count * sizeof(T) must be a multiple of 32; the UB
//     operand must start 32-byte aligned. DataCopyPad: blockLen a multiple of sizeof(T), UB rows laid
//     out at 32-byte aligned strides. GM accesses stay inside the GlobalTensor's buffer (SetGlobalBuffer
//     size) and UB accesses inside the LocalTensor.
//   * Vector ops (Add, Mul, Muls, Axpy, Duplicate, Cast, ReduceSum): operands 32-byte aligned, count
//     within every operand, no partial overlap of source and destination (identical = in place is
//     fine), element types the A2 vector unit supports (no bf16 arithmetic: Cast to float first),
//     Cast only between the supported pairs and narrowing casts with an explicit rounding mode
//     (stricter than the hardware, which has defaults per pair).
//   * Fresh UB is filled with 0xFF bytes (a NaN in fp16/bf16/fp32), so a kernel that reads UB it never
//     wrote, or the undefined pad bytes of DataCopyPad without isPad, produces NaN in the tests.
//
// WHAT IT DOES NOT CHECK: timing and performance; pipe races and missing SetFlag/WaitFlag/PipeBarrier
// (instructions run one after another in program order, so a missing synchronization is invisible;
// the sync calls are accepted and ignored); UB bank conflicts; blocks running concurrently (blocks run
// one after another, so races between cores on GM are invisible too — the kernels avoid them by
// construction: every output element has exactly one writer); the hardware's exact rounding of fused
// operations (Axpy rounds the product and the sum separately here; ReduceSum follows the documented
// A2 order: binary tree inside a 256-byte repeat, repeats summed in order); GM address alignment and
// burst efficiency; the Cube unit (not part of this subset yet: Mmad/Matmul, L1/L0A/L0B/L0C positions
// and their capacities are the planned extension for grouped GEMM and MLA, see docs/ascend.md).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#define __aicore__
#define __global__
#define __gm__
#define GM_ADDR uint8_t*

namespace ascend_emu {

struct EmuError : std::runtime_error {
  explicit EmuError(const std::string& m) : std::runtime_error("AscendC emulator: " + m) {}
};

[[noreturn]] inline void fail(const std::string& m) { throw EmuError(m); }

enum class SlotState { kFree, kAllocated, kQueued, kDequeued, kCalc };

inline const char* state_name(SlotState s) {
  switch (s) {
    case SlotState::kFree: return "free";
    case SlotState::kAllocated: return "allocated";
    case SlotState::kQueued: return "queued (between EnQue and DeQue)";
    case SlotState::kDequeued: return "dequeued";
    case SlotState::kCalc: return "TBuf";
  }
  return "?";
}

// One UB buffer of a queue or TBuf.
struct Slot {
  uint64_t offset = 0;  // byte offset in UB
  uint64_t bytes = 0;
  SlotState state = SlotState::kFree;
  uint64_t generation = 0;  // bumped on every FreeTensor: stale LocalTensors are detected
  std::string owner;
};

struct PipeState {
  uint64_t used = 0;
  std::vector<std::shared_ptr<Slot>> slots;
  std::vector<std::string> queues;
  bool alive = true;
};

struct BlockContext {
  uint32_t blockIdx = 0;
  uint32_t blockNum = 1;
  uint64_t ubCapacity = 0;
  std::vector<uint8_t> ub;
  std::shared_ptr<PipeState> pipe;
  bool active = false;
};

inline BlockContext& ctx() {
  static thread_local BlockContext c;
  return c;
}

inline uint64_t align32(uint64_t x) { return (x + 31) / 32 * 32; }

}  // namespace ascend_emu

namespace AscendC {

using ascend_emu::fail;

enum class TPosition { GM, VECIN, VECOUT, VECCALC, A1, A2, B1, B2, CO1, CO2 };
using QuePosition = TPosition;
enum class RoundMode { CAST_NONE, CAST_RINT, CAST_FLOOR, CAST_CEIL, CAST_ROUND, CAST_TRUNC, CAST_ODD };
enum class HardEvent { MTE2_V, V_MTE3, MTE3_V, V_S, S_V, S_MTE3, MTE3_S, MTE2_S, S_MTE2, MTE3_MTE2 };
enum pipe_t { PIPE_S, PIPE_V, PIPE_MTE2, PIPE_MTE3, PIPE_ALL };
using event_t = int32_t;
constexpr event_t EVENT_ID0 = 0;

// ---- 16-bit float storage types (conversions round to nearest even, like torch) -----------------
namespace detail {
inline uint16_t f32_to_f16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return static_cast<uint16_t>(sign | (ax > 0x7f800000u ? 0x7e00u : 0x7c00u));
  if (ax >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520 rounds to inf
  if (ax < 0x38800000u) {                                              // half subnormal or zero
    float a;
    std::memcpy(&a, &ax, 4);
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(a * 16777216.0f)));
  }
  uint32_t h = (((ax >> 23) - 112u) << 10) | ((ax & 0x7fffffu) >> 13);
  uint32_t rem = ax & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return static_cast<uint16_t>(sign | h);
}
inline float f16_to_f32(uint16_t h) {
  uint32_t sign = (static_cast<uint32_t>(h) & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu, x;
  if (e == 0) {
    float v = std::ldexp(static_cast<float>(m), -24);
    return (sign ? -v : v);
  }
  if (e == 31) x = sign | 0x7f800000u | (m << 13);
  else x = sign | ((e + 112u) << 23) | (m << 13);
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}
inline uint16_t f32_to_bf16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
  return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}
inline float bf16_to_f32(uint16_t b) {
  uint32_t x = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}
}  // namespace detail

struct half {
  uint16_t bits = 0;
  half() = default;
  half(float f) : bits(detail::f32_to_f16(f)) {}  // NOLINT: implicit like the device type
  operator float() const { return detail::f16_to_f32(bits); }
};
struct bfloat16_t {
  uint16_t bits = 0;
  bfloat16_t() = default;
  bfloat16_t(float f) : bits(detail::f32_to_bf16(f)) {}  // NOLINT
  operator float() const { return detail::bf16_to_f32(bits); }
};
static_assert(sizeof(half) == 2 && sizeof(bfloat16_t) == 2, "16-bit storage");

template <typename T> constexpr const char* type_name() {
  if constexpr (std::is_same_v<T, float>) return "float";
  else if constexpr (std::is_same_v<T, half>) return "half";
  else if constexpr (std::is_same_v<T, bfloat16_t>) return "bfloat16_t";
  else if constexpr (std::is_same_v<T, int32_t>) return "int32_t";
  else if constexpr (std::is_same_v<T, int16_t>) return "int16_t";
  else if constexpr (std::is_same_v<T, uint16_t>) return "uint16_t";
  else if constexpr (std::is_same_v<T, uint32_t>) return "uint32_t";
  else return "T";
}

// ---- Global memory ---------------------------------------------------------------------------------
template <typename T>
class GlobalTensor {
 public:
  void SetGlobalBuffer(T* ptr, uint64_t size) {
    base_ = ptr;
    size_ = size;
    set_ = true;
  }
  void SetGlobalBuffer(T* ptr) { SetGlobalBuffer(ptr, UINT64_MAX); }
  GlobalTensor operator[](uint64_t off) const {
    check_set();
    if (off > size_) fail(msg("operator[]", off, 0));
    GlobalTensor g;
    g.SetGlobalBuffer(base_ + off, size_ - off);
    return g;
  }
  T GetValue(uint64_t i) const {
    check(i, 1, "GetValue");
    return base_[i];
  }
  void SetValue(uint64_t i, T v) {
    check(i, 1, "SetValue");
    base_[i] = v;
  }
  uint64_t GetSize() const { return size_; }
  T* GetPhyAddr() const { return base_; }
  // emulator helper: bounds check of [i, i + n)
  void check(uint64_t i, uint64_t n, const char* what) const {
    check_set();
    if (i > size_ || n > size_ - i) fail(msg(what, i, n));
  }

 private:
  void check_set() const {
    if (!set_) fail("GlobalTensor used before SetGlobalBuffer");
  }
  std::string msg(const char* what, uint64_t i, uint64_t n) const {
    std::ostringstream o;
    o << "GM access out of bounds in " << what << ": elements [" << i << ", " << i + n << ") of a GlobalTensor<"
      << type_name<T>() << "> holding " << size_ << " elements";
    return o.str();
  }
  T* base_ = nullptr;
  uint64_t size_ = 0;
  bool set_ = false;
};

// ---- Local (UB) tensors ------------------------------------------------------------------------------
template <typename T>
class LocalTensor {
 public:
  LocalTensor() = default;
  LocalTensor(std::shared_ptr<ascend_emu::Slot> slot, uint64_t byteOff, uint64_t elems)
      : slot_(std::move(slot)), gen_(slot_->generation), byteOff_(byteOff), size_(elems) {}

  LocalTensor operator[](uint64_t off) const {
    live("operator[]");
    if (off > size_) fail("LocalTensor operator[]: offset " + std::to_string(off) + " past its " + std::to_string(size_) + " elements");
    return LocalTensor(slot_, byteOff_ + off * sizeof(T), size_ - off, gen_);
  }
  T GetValue(uint64_t i) const {
    live("GetValue");
    if (i >= size_) fail("LocalTensor GetValue(" + std::to_string(i) + ") past its " + std::to_string(size_) + " elements");
    T v;
    std::memcpy(&v, data() + i, sizeof(T));
    return v;
  }
  void SetValue(uint64_t i, T v) const {
    live("SetValue");
    if (i >= size_) fail("LocalTensor SetValue(" + std::to_string(i) + ") past its " + std::to_string(size_) + " elements");
    std::memcpy(data() + i, &v, sizeof(T));
  }
  uint32_t GetSize() const { return static_cast<uint32_t>(size_); }
  template <typename U>
  LocalTensor<U> ReinterpretCast() const {
    live("ReinterpretCast");
    return LocalTensor<U>(slot_, byteOff_, size_ * sizeof(T) / sizeof(U), gen_);
  }

  // ---- emulator internals (not AscendC API) ----
  LocalTensor(std::shared_ptr<ascend_emu::Slot> slot, uint64_t byteOff, uint64_t elems, uint64_t gen)
      : slot_(std::move(slot)), gen_(gen), byteOff_(byteOff), size_(elems) {}
  void live(const char* what) const {
    if (!slot_) fail(std::string(what) + " on a LocalTensor that was never allocated");
    if (slot_->generation != gen_ || slot_->state == ascend_emu::SlotState::kFree)
      fail(std::string(what) + " on a LocalTensor of " + slot_->owner + " after FreeTensor");
    if (slot_->state == ascend_emu::SlotState::kQueued)
      fail(std::string(what) + " on a LocalTensor of " + slot_->owner +
           " while it is queued (between EnQue and DeQue): DeQue it first");
  }
  T* data() const { return reinterpret_cast<T*>(ascend_emu::ctx().ub.data() + ub_addr()); }
  uint64_t ub_addr() const { return slot_->offset + byteOff_; }
  void need(uint64_t n, const char* what) const {
    live(what);
    if (n > size_) {
      std::ostringstream o;
      o << what << ": " << n << " elements needed but the LocalTensor<" << type_name<T>() << "> of " << slot_->owner
        << " holds " << size_;
      fail(o.str());
    }
    if (ub_addr() % 32) {
      std::ostringstream o;
      o << what << ": UB operand of " << slot_->owner << " starts at byte " << ub_addr() << ", not 32-byte aligned";
      fail(o.str());
    }
  }
  const std::shared_ptr<ascend_emu::Slot>& slot() const { return slot_; }
  uint64_t generation() const { return gen_; }

 private:
  std::shared_ptr<ascend_emu::Slot> slot_;
  uint64_t gen_ = 0;
  uint64_t byteOff_ = 0;
  uint64_t size_ = 0;
};

// ---- TPipe, TQue, TBuf ----------------------------------------------------------------------------
class TPipe;

template <TPosition SRC, TPosition DST, int32_t DEPTH>
class TQueBind {
 public:
  static_assert(DEPTH >= 1, "queue depth must be >= 1");
  template <typename T>
  LocalTensor<T> AllocTensor() {
    init_check("AllocTensor");
    for (auto& s : slots_) {
      if (s->state == ascend_emu::SlotState::kFree) {
        s->state = ascend_emu::SlotState::kAllocated;
        return LocalTensor<T>(s, 0, s->bytes / sizeof(T));
      }
    }
    fail("AllocTensor on " + name_ + ": all " + std::to_string(slots_.size()) +
         " buffers are in use (FreeTensor one first)");
  }
  template <typename T>
  bool EnQue(const LocalTensor<T>& t) {
    init_check("EnQue");
    auto& s = own(t, "EnQue");
    if (s->state != ascend_emu::SlotState::kAllocated)
      fail("EnQue on " + name_ + " of a tensor that is " + ascend_emu::state_name(s->state) + ", not freshly allocated");
    if (static_cast<int32_t>(fifo_.size()) >= DEPTH)
      fail("EnQue on " + name_ + ": queue depth " + std::to_string(DEPTH) + " exceeded (DeQue first)");
    s->state = ascend_emu::SlotState::kQueued;
    fifo_.push_back(s);
    return true;
  }
  template <typename T>
  LocalTensor<T> DeQue() {
    init_check("DeQue");
    if (fifo_.empty()) fail("DeQue on " + name_ + ": the queue is empty (missing EnQue)");
    auto s = fifo_.front();
    fifo_.pop_front();
    s->state = ascend_emu::SlotState::kDequeued;
    return LocalTensor<T>(s, 0, s->bytes / sizeof(T));
  }
  template <typename T>
  void FreeTensor(const LocalTensor<T>& t) {
    init_check("FreeTensor");
    auto& s = own(t, "FreeTensor");
    if (s->generation != t.generation() || s->state == ascend_emu::SlotState::kFree)
      fail("FreeTensor on " + name_ + " of a tensor that was already freed");
    if (s->state == ascend_emu::SlotState::kQueued)
      fail("FreeTensor on " + name_ + " of a tensor that is still queued (DeQue it first)");
    s->state = ascend_emu::SlotState::kFree;
    ++s->generation;
  }
  // emulator internals
  void emu_init(std::vector<std::shared_ptr<ascend_emu::Slot>> slots, std::string name) {
    if (!slots_.empty()) fail("InitBuffer called twice for " + name_);
    slots_ = std::move(slots);
    name_ = std::move(name);
  }

 private:
  void init_check(const char* what) const {
    if (slots_.empty()) fail(std::string(what) + " on a queue that was never given buffers (TPipe::InitBuffer)");
  }
  template <typename T>
  const std::shared_ptr<ascend_emu::Slot>& own(const LocalTensor<T>& t, const char* what) const {
    for (auto& s : slots_)
      if (s == t.slot()) return s;
    fail(std::string(what) + " on " + name_ + " of a tensor that belongs to " +
         (t.slot() ? t.slot()->owner : std::string("no queue")));
  }
  std::vector<std::shared_ptr<ascend_emu::Slot>> slots_;
  std::deque<std::shared_ptr<ascend_emu::Slot>> fifo_;
  std::string name_ = "an uninitialized queue";
};

template <TPosition POS, int32_t DEPTH>
using TQue = TQueBind<POS, POS, DEPTH>;

template <TPosition POS>
class TBuf {
 public:
  template <typename T>
  LocalTensor<T> Get() const {
    if (!slot_) fail("TBuf::Get before TPipe::InitBuffer");
    return LocalTensor<T>(slot_, 0, slot_->bytes / sizeof(T));
  }
  template <typename T>
  LocalTensor<T> Get(uint32_t len) const {
    auto t = Get<T>();
    if (len > t.GetSize()) fail("TBuf::Get(" + std::to_string(len) + ") larger than the buffer");
    return LocalTensor<T>(slot_, 0, len);
  }
  void emu_init(std::shared_ptr<ascend_emu::Slot> s) {
    if (slot_) fail("InitBuffer called twice for a TBuf");
    slot_ = std::move(s);
  }

 private:
  std::shared_ptr<ascend_emu::Slot> slot_;
};

class TPipe {
 public:
  TPipe() {
    auto& c = ascend_emu::ctx();
    if (!c.active) fail("TPipe created outside a kernel launch");
    if (c.pipe && c.pipe->alive) fail("a second TPipe in one block (one TPipe owns the whole UB)");
    state_ = std::make_shared<ascend_emu::PipeState>();
    c.pipe = state_;
  }
  ~TPipe() { state_->alive = false; }
  TPipe(const TPipe&) = delete;
  TPipe& operator=(const TPipe&) = delete;

  template <TPosition SRC, TPosition DST, int32_t DEPTH>
  bool InitBuffer(TQueBind<SRC, DST, DEPTH>& que, uint8_t num, uint32_t len) {
    if (num == 0 || len == 0) fail("InitBuffer of a queue with num=" + std::to_string(num) + ", len=" + std::to_string(len));
    std::string name = "queue #" + std::to_string(state_->queues.size());
    state_->queues.push_back(name);
    std::vector<std::shared_ptr<ascend_emu::Slot>> slots;
    for (uint8_t i = 0; i < num; ++i) slots.push_back(alloc(len, name + " buffer " + std::to_string(i), ascend_emu::SlotState::kFree));
    que.emu_init(std::move(slots), name);
    return true;
  }
  template <TPosition POS>
  bool InitBuffer(TBuf<POS>& buf, uint32_t len) {
    if (len == 0) fail("InitBuffer of a TBuf with len=0");
    std::string name = "TBuf #" + std::to_string(state_->queues.size());
    state_->queues.push_back(name);
    buf.emu_init(alloc(len, name, ascend_emu::SlotState::kCalc));
    return true;
  }
  void Destroy() {}

 private:
  std::shared_ptr<ascend_emu::Slot> alloc(uint32_t len, const std::string& owner, ascend_emu::SlotState st) {
    auto& c = ascend_emu::ctx();
    uint64_t bytes = ascend_emu::align32(len);
    if (state_->used + bytes > c.ubCapacity) {
      std::ostringstream o;
      o << "UB overflow: " << owner << " needs " << bytes << " B at offset " << state_->used << ", but the UB of block "
        << c.blockIdx << " holds " << c.ubCapacity << " B";
      fail(o.str());
    }
    auto s = std::make_shared<ascend_emu::Slot>();
    s->offset = state_->used;
    s->bytes = bytes;
    s->state = st;
    s->owner = owner;
    state_->used += bytes;
    state_->slots.push_back(s);
    return s;
  }
  std::shared_ptr<ascend_emu::PipeState> state_;
};

// ---- block index, synchronization --------------------------------------------------------------------
inline int64_t GetBlockIdx() { return ascend_emu::ctx().blockIdx; }
inline int64_t GetBlockNum() { return ascend_emu::ctx().blockNum; }
template <HardEvent E> inline void SetFlag(event_t) {}
template <HardEvent E> inline void WaitFlag(event_t) {}
template <pipe_t P> inline void PipeBarrier() {}

// ---- data movement -------------------------------------------------------------------------------
struct DataCopyExtParams {
  uint16_t blockCount = 1;
  uint32_t blockLen = 0;   // bytes per block
  uint32_t srcStride = 0;  // GM->UB: bytes between GM blocks; UB->GM: 32-byte units between UB blocks
  uint32_t dstStride = 0;  // GM->UB: 32-byte units between UB blocks; UB->GM: bytes between GM blocks
  uint32_t rsv = 0;
};

template <typename T>
struct DataCopyPadExtParams {
  bool isPad = false;
  uint8_t leftPadding = 0;
  uint8_t rightPadding = 0;
  T paddingValue = T(0);
};

namespace detail {
template <typename T>
void check_block_len(uint64_t bytes, const char* what) {
  if (bytes % 32) {
    std::ostringstream o;
    o << what << " moves whole 32-byte blocks: " << bytes / sizeof(T) << " x " << type_name<T>() << " = " << bytes
      << " B is not a multiple of 32 (use DataCopyPad for ragged rows)";
    fail(o.str());
  }
}
}  // namespace detail

template <typename T>
void DataCopy(const LocalTensor<T>& dst, const GlobalTensor<T>& src, uint32_t count) {
  detail::check_block_len<T>(uint64_t(count) * sizeof(T), "DataCopy (GM->UB)");
  dst.need(count, "DataCopy (GM->UB)");
  src.check(0, count, "DataCopy (GM->UB)");
  std::memcpy(dst.data(), src.GetPhyAddr(), uint64_t(count) * sizeof(T));
}

template <typename T>
void DataCopy(const GlobalTensor<T>& dst, const LocalTensor<T>& src, uint32_t count) {
  detail::check_block_len<T>(uint64_t(count) * sizeof(T), "DataCopy (UB->GM)");
  src.need(count, "DataCopy (UB->GM)");
  dst.check(0, count, "DataCopy (UB->GM)");
  std::memcpy(dst.GetPhyAddr(), src.data(), uint64_t(count) * sizeof(T));
}

template <typename T>
void DataCopyPad(const LocalTensor<T>& dst, const GlobalTensor<T>& src, const DataCopyExtParams& p,
                 const DataCopyPadExtParams<T>& pad) {
  if (p.blockLen == 0 || p.blockLen % sizeof(T)) fail("DataCopyPad (GM->UB): blockLen " + std::to_string(p.blockLen) + " B is not a positive multiple of sizeof(T)");
  const uint64_t elems = p.blockLen / sizeof(T);
  const uint64_t rowUb = ascend_emu::align32(pad.leftPadding * sizeof(T) + p.blockLen) + uint64_t(p.dstStride) * 32;
  if (pad.isPad && (pad.leftPadding + elems + pad.rightPadding) * sizeof(T) > ascend_emu::align32(p.blockLen + pad.leftPadding * sizeof(T)))
    fail("DataCopyPad (GM->UB): padding goes past the 32-byte aligned end of the row");
  if (p.srcStride % sizeof(T)) fail("DataCopyPad (GM->UB): srcStride is not a multiple of sizeof(T)");
  const uint64_t needUb = (uint64_t(p.blockCount) * rowUb) / sizeof(T);
  dst.need(needUb, "DataCopyPad (GM->UB)");
  const uint64_t gmStride = elems + p.srcStride / sizeof(T);
  src.check(0, p.blockCount ? uint64_t(p.blockCount - 1) * gmStride + elems : 0, "DataCopyPad (GM->UB)");
  uint8_t* ub = reinterpret_cast<uint8_t*>(dst.data());
  for (uint32_t b = 0; b < p.blockCount; ++b) {
    uint8_t* row = ub + b * rowUb;
    std::memset(row, 0xFF, ascend_emu::align32(pad.leftPadding * sizeof(T) + p.blockLen));  // undefined bytes
    T* r = reinterpret_cast<T*>(row);
    std::memcpy(r + pad.leftPadding, src.GetPhyAddr() + b * gmStride, p.blockLen);
    if (pad.isPad) {
      for (uint32_t i = 0; i < pad.leftPadding; ++i) r[i] = pad.paddingValue;
      for (uint32_t i = 0; i < pad.rightPadding; ++i) r[pad.leftPadding + elems + i] = pad.paddingValue;
    }
  }
}

template <typename T>
void DataCopyPad(const GlobalTensor<T>& dst, const LocalTensor<T>& src, const DataCopyExtParams& p) {
  if (p.blockLen == 0 || p.blockLen % sizeof(T)) fail("DataCopyPad (UB->GM): blockLen " + std::to_string(p.blockLen) + " B is not a positive multiple of sizeof(T)");
  const uint64_t elems = p.blockLen / sizeof(T);
  const uint64_t rowUb = ascend_emu::align32(p.blockLen) + uint64_t(p.srcStride) * 32;
  src.need(uint64_t(p.blockCount) * rowUb / sizeof(T) - (rowUb - p.blockLen) / sizeof(T), "DataCopyPad (UB->GM)");
  if (p.dstStride % sizeof(T)) fail("DataCopyPad (UB->GM): dstStride is not a multiple of sizeof(T)");
  const uint64_t gmStride = elems + p.dstStride / sizeof(T);
  dst.check(0, p.blockCount ? uint64_t(p.blockCount - 1) * gmStride + elems : 0, "DataCopyPad (UB->GM)");
  const uint8_t* ub = reinterpret_cast<const uint8_t*>(src.data());
  for (uint32_t b = 0; b < p.blockCount; ++b) std::memcpy(dst.GetPhyAddr() + b * gmStride, ub + b * rowUb, p.blockLen);
}

// ---- vector unit -----------------------------------------------------------------------------------
namespace detail {
template <typename T>
constexpr bool vec_arith_ok() {
  return std::is_same_v<T, float> || std::is_same_v<T, half> || std::is_same_v<T, int32_t> || std::is_same_v<T, int16_t>;
}
template <typename T>
void arith_type(const char* what) {
  if constexpr (!vec_arith_ok<T>())
    fail(std::string(what) + " on " + type_name<T>() + ": the A2 vector unit has no arithmetic for this type (Cast to float first)");
}
template <typename D, typename S>
void overlap(const LocalTensor<D>& d, const LocalTensor<S>& s, uint64_t n, const char* what) {
  uint64_t d0 = d.ub_addr(), d1 = d0 + n * sizeof(D), s0 = s.ub_addr(), s1 = s0 + n * sizeof(S);
  bool same = d0 == s0 && sizeof(D) == sizeof(S);
  if (!same && d0 < s1 && s0 < d1) fail(std::string(what) + ": destination partially overlaps a source in UB");
}
}  // namespace detail

template <typename T>
void Duplicate(const LocalTensor<T>& dst, const T& v, int32_t count) {
  dst.need(count, "Duplicate");
  for (int32_t i = 0; i < count; ++i) dst.data()[i] = v;
}

#define AMO_EMU_BINARY(NAME, EXPR)                                                      \
  template <typename T>                                                                 \
  void NAME(const LocalTensor<T>& dst, const LocalTensor<T>& a, const LocalTensor<T>& b, \
            int32_t count) {                                                            \
    detail::arith_type<T>(#NAME);                                                       \
    dst.need(count, #NAME); a.need(count, #NAME); b.need(count, #NAME);                 \
    detail::overlap(dst, a, count, #NAME); detail::overlap(dst, b, count, #NAME);        \
    for (int32_t i = 0; i < count; ++i) {                                               \
      float x = static_cast<float>(a.data()[i]), y = static_cast<float>(b.data()[i]);   \
      dst.data()[i] = static_cast<T>(EXPR);                                             \
    }                                                                                   \
  }
AMO_EMU_BINARY(Add, x + y)
AMO_EMU_BINARY(Mul, x * y)
#undef AMO_EMU_BINARY

template <typename T>
void Muls(const LocalTensor<T>& dst, const LocalTensor<T>& src, const T& s, int32_t count) {
  detail::arith_type<T>("Muls");
  dst.need(count, "Muls");
  src.need(count, "Muls");
  detail::overlap(dst, src, count, "Muls");
  for (int32_t i = 0; i < count; ++i) dst.data()[i] = static_cast<T>(static_cast<float>(src.data()[i]) * static_cast<float>(s));
}

// dst = src * s + dst (the product and the sum are rounded separately here)
template <typename T, typename U>
void Axpy(const LocalTensor<T>& dst, const LocalTensor<U>& src, const U& s, int32_t count) {
  static_assert(std::is_same_v<T, U>, "emulator: Axpy with mixed precision is not in the emulated subset");
  detail::arith_type<T>("Axpy");
  dst.need(count, "Axpy");
  src.need(count, "Axpy");
  detail::overlap(dst, src, count, "Axpy");
  for (int32_t i = 0; i < count; ++i) {
    T prod = static_cast<T>(static_cast<float>(src.data()[i]) * static_cast<float>(s));
    dst.data()[i] = static_cast<T>(static_cast<float>(prod) + static_cast<float>(dst.data()[i]));
  }
}

template <typename D, typename S>
void Cast(const LocalTensor<D>& dst, const LocalTensor<S>& src, RoundMode mode, uint32_t count) {
  constexpr bool widen = std::is_same_v<D, float> && (std::is_same_v<S, half> || std::is_same_v<S, bfloat16_t>);
  constexpr bool narrow = std::is_same_v<S, float> && (std::is_same_v<D, half> || std::is_same_v<D, bfloat16_t>);
  if constexpr (!widen && !narrow) {
    fail(std::string("Cast from ") + type_name<S>() + " to " + type_name<D>() + " is not in the emulated subset");
  } else {
    if (widen && mode != RoundMode::CAST_NONE) fail("Cast to float is exact: use RoundMode::CAST_NONE");
    if (narrow && mode != RoundMode::CAST_RINT)
      fail(std::string("Cast from float to ") + type_name<D>() +
           ": the emulator implements RoundMode::CAST_RINT (round to nearest even, as torch) only");
    dst.need(count, "Cast");
    src.need(count, "Cast");
    detail::overlap(dst, src, count, "Cast");
    // copy first: an in-place cast must not read what it already wrote
    std::vector<S> tmp(src.data(), src.data() + count);
    for (uint32_t i = 0; i < count; ++i) dst.data()[i] = static_cast<D>(static_cast<float>(tmp[i]));
  }
}

// Sum of the first `count` elements into dst[0]: binary tree inside each 256-byte repeat, repeat
// results added in order (the documented A2 behaviour of this interface).
template <typename T>
void ReduceSum(const LocalTensor<T>& dst, const LocalTensor<T>& src, const LocalTensor<T>& work, int32_t count) {
  static_assert(std::is_same_v<T, float>, "emulator: ReduceSum is emulated for float only");
  if (count <= 0) fail("ReduceSum with count <= 0");
  src.need(count, "ReduceSum");
  dst.need(1, "ReduceSum");
  constexpr int32_t per = 256 / sizeof(T);
  const int32_t repeats = (count + per - 1) / per;
  work.need(repeats, "ReduceSum work buffer");
  float total = 0.0f;
  float lane[per];
  for (int32_t r = 0; r < repeats; ++r) {
    for (int32_t i = 0; i < per; ++i) {
      int32_t k = r * per + i;
      lane[i] = k < count ? src.data()[k] : 0.0f;
    }
    for (int32_t w = per / 2; w >= 1; w /= 2)
      for (int32_t i = 0; i < w; ++i) lane[i] = lane[2 * i] + lane[2 * i + 1];
    work.data()[r] = lane[0];
    total = r == 0 ? lane[0] : total + lane[0];
  }
  dst.data()[0] = total;
}

}  // namespace AscendC

namespace ascend_emu {

// Run `kernel(args...)` once per block, blocks one after another, each with a fresh UB of
// `ubCapacity` bytes filled with 0xFF; then check that the block freed every queue tensor.
// Returns the most UB any block allocated (the host compares it with the tiling's UB plan).
template <typename F, typename... Args>
uint64_t launch(uint32_t blockDim, uint64_t ubCapacity, F&& kernel, Args... args) {
  uint64_t peak = 0;
  if (blockDim == 0) fail("launch with blockDim = 0");
  auto& c = ctx();
  if (c.active) fail("nested kernel launch");
  struct Reset {
    ~Reset() {
      ctx().active = false;
      ctx().pipe.reset();
    }
  } reset;
  for (uint32_t b = 0; b < blockDim; ++b) {
    c.blockIdx = b;
    c.blockNum = blockDim;
    c.ubCapacity = ubCapacity;
    c.ub.assign(ubCapacity, 0xFF);
    c.pipe.reset();
    c.active = true;
    kernel(args...);
    if (c.pipe) {
      for (auto& s : c.pipe->slots) {
        if (s->state == SlotState::kAllocated || s->state == SlotState::kQueued || s->state == SlotState::kDequeued)
          fail("block " + std::to_string(b) + " ended with " + s->owner + " still " + state_name(s->state) +
               " (every AllocTensor needs a FreeTensor)");
      }
    }
    if (c.pipe) peak = c.pipe->used > peak ? c.pipe->used : peak;
    c.active = false;
  }
  return peak;
}

}  // namespace ascend_emu
