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
//   * Vector ops (Add, Sub, Mul, Max, Muls, Adds, Axpy, Exp, Ln, Duplicate, Cast, ReduceSum, ReduceMax): operands 32-byte aligned, count
//     (Add, Sub, Mul, Max, Muls, Adds, Exp, Ln, Duplicate also in their tensor high-dimension form:
//     repeatTimes, continuous / bit mask, block and repeat strides; WholeReduceMax / WholeReduceSum, Brcb)
//     within every operand, no partial overlap of source and destination (identical = in place is
//     fine), element types the A2 vector unit supports (no bf16 arithmetic: Cast to float first),
//     Cast only between the supported pairs and narrowing casts with an explicit rounding mode
//     (stricter than the hardware, which has defaults per pair).
//   * Fresh UB is filled with 0xFF bytes (a NaN in fp16/bf16/fp32), so a kernel that reads UB it never
//     wrote, or the undefined pad bytes of DataCopyPad without isPad, produces NaN in the tests.
//
// ATLAS A2 RULES (docs/ascend.md, "A2 rules"; tests/test_ascend_a2_rules.py); errors name the kernel set
// with ascend_emu::set_kernel and the core ("[kernel amo_fa_qk, AIC block 3]"):
//   * InitConstValue: blockNum / dstGap count 32-byte blocks on L1 but 512-byte fractals on L0A/L0B;
//     a fill past the tensor is an error (the fill's pipe: MTE2 on L1, MTE1 on L0);
//   * Mmad with m == 1 is GEMV: L0A is read as one ND row of k elements, not zZ (computed that way);
//     the Mmad destination must be 1024-byte aligned in L0C;
//   * scalar GlobalTensor::GetValue / SetValue go through a per-core data cache of 64-byte lines
//     (emu/data_cache.h): lost writes between cores, DMA over a dirty line and stale lines (cached by
//     an earlier launch, or written after caching) are errors; DataCacheCleanAndInvalid cleans/drops;
//   * ReduceMax work buffer: ceil(2 * repeats / 8) * 8 floats;
//   * cross-core flag ids 0..15, of which 11..14 belong to SyncAll; CrossCoreSetFlag<mode, pipe> with
//     PIPE_S / PIPE_ALL is rejected (modes 0..2), and the set covers only `pipe`'s earlier work;
//   * LocalTensor GetValue / SetValue (the scalar unit) on UB positions only, not L1/L0A/L0B/L0C;
//   * GM between cores (gm_model.h): two cores of one launch touching the same GM bytes, one writing,
//     with no cross-core flag ordering them and not both SetAtomicAdd<T> of the same T, is an error;
//     SetAtomicAdd<T> makes later DMA stores to GM add in T, SetAtomicNone / DisableDmaAtomic end it.
//
//   * Intra-core ordering (pipe_model.h): every instruction is issued on its A2 pipe (DataCopy
//     GM->UB/L1 MTE2, UB->GM MTE3, LoadData MTE1, Mmad M, Fixpipe FIX, vector ops V, LocalTensor
//     GetValue/SetValue S, InitConstValue MTE1 on L0A/L0B and MTE2 on L1) and two accesses of
//     different pipes to overlapping bytes of one UB/L1/L0 buffer, one a write, that no
//     SetFlag/WaitFlag, PipeBarrier, queue hand-over or (AIV only) compiler auto-sync orders are an
//     error; so are same-pipe overlapping writes of MTE1/MTE2/MTE3/FIX without a PipeBarrier of that
//     pipe, small accumulating Mmads without PipeBarrier<PIPE_M>, event ids outside 0..7 and a
//     WaitFlag with no pending SetFlag. ASCEND_MOE_OPS_EMU_PIPES=off disables it (debugging only).
//
// WHAT IT DOES NOT CHECK: timing and performance; UB bank conflicts; blocks running concurrently
// (blocks of single-type launches run one after another, mixed launches under the deterministic
// scheduler below; races between cores on GM are named by gm_model.h instead); SyncAll (not in the
// emulated subset); the hardware's exact rounding of fused
// operations (Axpy rounds the product and the sum separately here; ReduceSum follows the documented
// A2 order: binary tree inside a 256-byte repeat, repeats summed in order); GM address alignment and
// burst efficiency.
//
// CUBE SIDE (AIC cores; used by the grouped GEMM kernels). Memories are modelled per position:
// A1/B1 share L1, A2 is L0A, B2 is L0B, CO1 is L0C, each with its own capacity (launch_cube, from
// ChipInfo); an AIC block has no UB (vector ops and UB DataCopy on it fail), and vector ops reject
// tensors that do not live in UB. Fresh L1/L0 memory is 0xFF (NaN) like UB. Checked:
//   * capacities of L1, L0A, L0B, L0C per block; L0A/L0B/L0C buffers start 512-byte aligned;
//   * DataCopy GM -> A1/B1 with Nd2NzParams (ND -> NZ: 16-element C0 column blocks, row stride one
//     C0, dstNzC0Stride rows between column blocks; column blocks may not overlap; only ndNum == 1,
//     dstNzNStride == 1 and 2-byte types are emulated). The pad columns/rows of a partial fractal are
//     NOT written (left as they were) -- stricter than assuming the hardware zero-fills them;
//   * LoadData A1/B1 -> A2/B2 with LoadData2DParams: repeatTimes whole 512-byte fractals from
//     startIndex + i * srcStride (fractal units) to consecutive destination fractals (+ dstGap),
//     optionally transposed inside each fractal (ifTranspose); all fractals in bounds;
//   * Mmad: dst CO1, fm A2, filter B2, element types (half, half, float) or (bfloat16_t, bfloat16_t,
//     float) only (fp32 accumulation; anything else throws), 1 <= m, n, k <= 4095, operands hold
//     whole fractals (ceil16(m) x ceil16(k), ceil16(k) x ceil16(n), ceil16(m) x ceil16(n)). Layouts:
//     A2 zZ (fractal grid row-major, fractals row-major), B2 zN (grid row-major over (k, n), each
//     fractal stored n-major), CO1 NZ (grid column-major, fractals row-major). The reduction reads the
//     whole padded K fractals (ceil16(k)), so a kernel that leaves NaN in the K padding of A or B
//     gets NaN -- again stricter than what we could verify about the hardware;
//   * InitConstValue on A1/B1 (repeatTimes x blockNum 32-byte blocks) and A2/B2 (512-byte fractals),
//     dstGap blocks between;
//   * Fixpipe CO1 -> GM with NZ2ND (row-major output): float source, quantPre matching the GM type
//     (NoQuant float, F322F16 half, F322BF16 bfloat16_t; round to nearest even), srcStride a multiple
//     of 16 that is >= mSize, dstStride >= nSize, GM bounds.
// MIXED KERNELS (KERNEL_TYPE_MIX_AIC_1_2; ascend_emu::launch_mix): each AI Core group = one AIC block
// and two AIV blocks as three threads under a DETERMINISTIC scheduler (one runs at a time; groups one
// after another): a block runs until it waits on a flag it cannot take, then the next block that can
// run gets the turn (AIC, AIV0, AIV1 round robin). ASCEND_MOE_OPS_EMU_MIX_SCHEDULE=switch also hands
// the turn on after every CrossCoreSetFlag. The two schedules are adversarial in opposite ways: the
// default lets a producer run as far ahead as its flags allow (a consumer that reads a slot too late
// sees it overwritten); "switch" runs consumers as early as possible. GetBlockIdx is
// the group on the AIC and 2 * group + sub on an AIV, GetBlockNum the group count, GetTaskRatio 1 / 2,
// g_coreType AIC / AIV. CrossCoreSetFlag<2, pipe>(id) / CrossCoreWaitFlag(id) are real counters per
// group with the documented mode-2 semantics (an AIC set releases one wait on EACH AIV; the AIC's
// wait needs a set from BOTH AIVs); checked: mode 2 only, flag ids 0..15 except 11..14 (SyncAll's), at most 15 pending sets per
// counter, a deadlock (no block of the group can run) throws, and a group that ends with a set nobody
// waited for throws. GM is shared, so a kernel that touches a workspace slot outside the order its
// flags impose reads stale or overwritten data under one of the schedules -- the emulator does not
// name such a race itself, but the tests' results then differ from the reference.
// NOT modelled on the Cube side: the hardware's accumulation order inside a fractal (the emulator sums
// the K products one by one in fp32), hf32/fp32 Cube modes, bank/ping-pong conflicts, unitFlag,
// bias tables, cross-core flag modes 0
// and 1, and the hardware's timing of cross-core flags.
#pragma once

#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include <dlfcn.h>

#include "../../common/bf16.h"

#include "emu/data_cache.h"
#include "pipe_model.h"
#include "gm_model.h"

#define __aicore__
#define __global__
#define __gm__
#define GM_ADDR uint8_t*
#define KERNEL_TASK_TYPE_DEFAULT(x)

namespace ascend_emu {

struct EmuError : std::runtime_error {
  explicit EmuError(const std::string& m) : std::runtime_error("AscendC emulator: " + m) {}
};

// The kernel being launched (set by the host with set_kernel before a launch, cleared by the launch):
// every EmuError names it and the core that failed.
inline std::string& current_kernel() {
  static std::string name;
  return name;
}
inline void set_kernel(const char* name) { current_kernel() = name ? name : ""; }

[[noreturn]] inline void fail(const std::string& m);

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
// Memories of a core: UB (AIV), L1, L0A, L0B, L0C (AIC).
enum Space : int { kUB = 0, kL1 = 1, kL0A = 2, kL0B = 3, kL0C = 4, kNumSpaces = 5 };
inline const char* space_name(int s) {
  static const char* n[] = {"UB", "L1", "L0A", "L0B", "L0C"};
  return n[s];
}

struct Slot {
  int space = kUB;
  uint64_t offset = 0;  // byte offset in its memory (UB, L1, ...)
  uint64_t bytes = 0;
  SlotState state = SlotState::kFree;
  uint64_t generation = 0;  // bumped on every FreeTensor: stale LocalTensors are detected
  std::string owner;
  BufferRecords rec;        // pipe model: accesses to this buffer (pipe_model.h)
  QueueSync qsync;          // pipe model: the sync a queue buffer carries (EnQue/DeQue, Free/Alloc)
};

struct PipeState {
  uint64_t used = 0;  // UB bytes
  uint64_t usedSpace[kNumSpaces] = {0, 0, 0, 0, 0};
  std::vector<std::shared_ptr<Slot>> slots;
  std::vector<std::string> queues;
  uint32_t queBuffers[10] = {};  // queue buffers per TPosition (index: the TPosition's value)
  uint32_t buffers = 0;          // every buffer of the pipe: each queue's num, one per TBuf
  bool alive = true;
};

struct BlockContext {
  uint32_t blockIdx = 0;
  uint32_t blockNum = 1;
  uint64_t ubCapacity = 0;
  std::vector<uint8_t> ub;
  uint64_t cap[kNumSpaces] = {0, 0, 0, 0, 0};  // L1, L0A, L0B, L0C (index kUB unused: ubCapacity)
  std::vector<uint8_t> mem[kNumSpaces];          // index kUB unused: ub
  bool aic = false;                              // a Cube (AIC) block: no UB
  std::shared_ptr<PipeState> pipe;
  bool active = false;
  struct MixGroup* mix = nullptr;                // set in a mixed launch: the block's AI Core group
  uint32_t sub = 0;                              // AIV index inside the group (0 / 1)
  PipeModel model;                               // per-core pipe model / race detector (pipe_model.h)
};

// Cross-core flag state of one AI Core group of a mixed launch (mode 2: AIC <-> its two AIVs), and
// its deterministic scheduler: the three blocks are threads, but exactly one holds the run token at a
// time; it runs until it waits on a flag it cannot take (or, with the "switch" schedule, until it sets
// a flag), then the token goes to the next block (AIC, AIV0, AIV1 round robin) that can run.
struct MixGroup {
  static constexpr int kFlags = 16;
  std::mutex m;
  std::condition_variable cv;
  int aic[kFlags] = {};        // pending releases of the AIC's waits
  int aiv[2][kFlags] = {};     // pending releases of each AIV's waits
  int fromAiv[2][kFlags] = {}; // AIV sets not yet matched by the other AIV's set
  // cross-core GM model (gm_model.h): what each pending set tells the waiter, in set order
  std::deque<GmKnown> aicMsg[kFlags], aivMsg[2][kFlags], fromAivMsg[2][kFlags];
  int* waitingOn[3] = {nullptr, nullptr, nullptr};  // the counter each block (AIC, AIV0, AIV1) waits on
  bool done[3] = {false, false, false};
  int turn = 0;                // the block holding the run token
  bool switchOnSet = false;    // schedule: also hand the token on after every CrossCoreSetFlag
  bool abort = false;
  std::string error;

  bool runnable(int j) const { return !done[j] && (!waitingOn[j] || *waitingOn[j] > 0); }
  // Hand the token from block `me` to the next runnable block (me itself last); false = nobody can run.
  bool pass(int me) {
    for (int k = 1; k <= 3; ++k) {
      const int j = (me + k) % 3;
      if (runnable(j)) {
        turn = j;
        cv.notify_all();
        return true;
      }
    }
    return false;
  }
};

inline BlockContext& ctx() {
  static thread_local BlockContext c;
  return c;
}

[[noreturn]] inline void fail(const std::string& m) {
  const auto& c = ctx();
  if (!c.active || current_kernel().empty()) throw EmuError(m);
  throw EmuError(m + " [kernel " + current_kernel() + ", " + (c.aic ? "AIC" : "AIV") + " block " +
                 std::to_string(c.blockIdx) + "]");
}
[[noreturn]] inline void dc_fail(const std::string& m) { fail(m); }
inline int core_id() { return dc_core_id(ctx().aic, ctx().blockIdx); }

inline uint64_t align32(uint64_t x) { return (x + 31) / 32 * 32; }

}  // namespace ascend_emu

namespace AscendC {

using ascend_emu::fail;

enum class TPosition { GM, VECIN, VECOUT, VECCALC, A1, A2, B1, B2, CO1, CO2 };
using QuePosition = TPosition;
enum class RoundMode { CAST_NONE, CAST_RINT, CAST_FLOOR, CAST_CEIL, CAST_ROUND, CAST_TRUNC, CAST_ODD };
// HardEvent SRC_DST: SetFlag on pipe SRC, WaitFlag on pipe DST (the pipe model, pipe_model.h).
#define AMO_EMU_EVENTS(X)                                                                              \
  X(MTE2_MTE1, MTE2, MTE1) X(MTE1_MTE2, MTE1, MTE2) X(MTE1_M, MTE1, M) X(M_MTE1, M, MTE1)             \
  X(MTE2_V, MTE2, V) X(V_MTE2, V, MTE2) X(MTE3_V, MTE3, V) X(V_MTE3, V, MTE3) X(M_V, M, V)           \
  X(V_M, V, M) X(V_V, V, V) X(MTE3_MTE1, MTE3, MTE1) X(MTE1_MTE3, MTE1, MTE3) X(MTE1_V, MTE1, V)     \
  X(MTE2_M, MTE2, M) X(M_MTE2, M, MTE2) X(V_MTE1, V, MTE1) X(M_FIX, M, FIX) X(FIX_M, FIX, M)         \
  X(MTE3_MTE2, MTE3, MTE2) X(MTE2_MTE3, MTE2, MTE3) X(S_V, S, V) X(V_S, V, S) X(S_MTE2, S, MTE2)     \
  X(MTE2_S, MTE2, S) X(S_MTE3, S, MTE3) X(MTE3_S, MTE3, S) X(MTE2_FIX, MTE2, FIX)                    \
  X(FIX_MTE2, FIX, MTE2) X(FIX_S, FIX, S) X(M_S, M, S) X(FIX_MTE3, FIX, MTE3) X(MTE1_FIX, MTE1, FIX) \
  X(FIX_MTE1, FIX, MTE1) X(FIX_FIX, FIX, FIX)
#define AMO_EMU_EV_NAME(n, a, b) n,
enum class HardEvent { AMO_EMU_EVENTS(AMO_EMU_EV_NAME) MAX };
#undef AMO_EMU_EV_NAME
enum pipe_t { PIPE_S, PIPE_V, PIPE_M, PIPE_MTE1, PIPE_MTE2, PIPE_MTE3, PIPE_FIX, PIPE_ALL };
static_assert(int(PIPE_FIX) == ascend_emu::kPipeFIX && int(PIPE_ALL) == ascend_emu::kNumPipes, "pipe order");
using event_t = int32_t;
constexpr event_t EVENT_ID0 = 0, EVENT_ID1 = 1, EVENT_ID2 = 2, EVENT_ID3 = 3, EVENT_ID4 = 4, EVENT_ID5 = 5,
                  EVENT_ID6 = 6, EVENT_ID7 = 7;
namespace detail {
struct EventPipes {
  int src, dst;
  const char* name;
};
constexpr EventPipes event_pipes(HardEvent e) {
#define AMO_EMU_EV_CASE(n, a, b) \
  if (e == HardEvent::n) return EventPipes{int(PIPE_##a), int(PIPE_##b), #n};
  AMO_EMU_EVENTS(AMO_EMU_EV_CASE)
#undef AMO_EMU_EV_CASE
  return EventPipes{0, 0, "MAX"};
}
// Pipe model: the current instruction's pipe and name, and an access of it.
inline void issue(int pipe, const char* name) { ascend_emu::ctx().model.begin(pipe, name); }
// A DMA access of the current instruction to GM: the core's pipe model (intra-core order) and the
// cross-core GM model (gm_model.h; writes carry the core's atomic mode).
inline void gm_touch(const void* p, uint64_t bytes, bool write) {
  auto& c = ascend_emu::ctx();
  c.model.touch_gm(p, bytes, write);
  if (ascend_emu::timeline::skip_compute()) return;  // timing-only recording: no GM race model either
  ascend_emu::gm_touch(c.model, ascend_emu::core_id(), p, bytes, write,
                       write ? ascend_emu::gm_atomic() : ascend_emu::AtomicKind::kNone);
}
// A scalar GM access (GlobalTensor::GetValue / SetValue): a PIPE_S instruction for the GM model.
inline void scalar_gm(const void* p, uint64_t bytes, bool write, const char* name) {
  auto& c = ascend_emu::ctx();
  if (!c.model.on()) return;
  c.model.begin(ascend_emu::kPipeS, name);
  ascend_emu::gm_touch(c.model, ascend_emu::core_id(), p, bytes, write, ascend_emu::AtomicKind::kNone);
}
}  // namespace detail

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
// bf16: the CPU side's one rounding routine (common/bf16.h)
inline uint16_t f32_to_bf16(float f) { return amo::bf16::from_f32(f); }
inline float bf16_to_f32(uint16_t b) { return amo::bf16::to_f32(b); }
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
  else if constexpr (std::is_same_v<T, int64_t>) return "int64_t";
  else if constexpr (std::is_same_v<T, int16_t>) return "int16_t";
  else if constexpr (std::is_same_v<T, uint16_t>) return "uint16_t";
  else if constexpr (std::is_same_v<T, uint32_t>) return "uint32_t";
  else return "T";
}

// ---- atomic accumulate of GM writes (SetAtomicAdd<T> / SetAtomicNone; gm_model.h) -------------------
namespace detail {
template <typename A>
void atomic_add_n(uint8_t* dst, const uint8_t* src, uint64_t n) {
  for (uint64_t i = 0; i + sizeof(A) <= n; i += sizeof(A)) {
    A a, b;
    std::memcpy(&a, dst + i, sizeof(A));
    std::memcpy(&b, src + i, sizeof(A));
    A r;
    if constexpr (std::is_integral_v<A>)
      r = static_cast<A>(static_cast<int64_t>(a) + static_cast<int64_t>(b));  // wraps like the DMA's adder (assumption)
    else
      r = static_cast<A>(static_cast<float>(static_cast<double>(static_cast<float>(a)) + static_cast<float>(b)));
    std::memcpy(dst + i, &r, sizeof(A));
  }
}
// A DMA store of n bytes to GM: a copy, or with an atomic mode set, GM = GM + src in the mode's type.
inline void gm_store(void* dst, const void* src, uint64_t n, const char* what) {
  const ascend_emu::AtomicKind k = ascend_emu::gm_atomic();
  if (k == ascend_emu::AtomicKind::kNone) {
    std::memcpy(dst, src, n);
    return;
  }
  if (n % ascend_emu::atomic_size(k))
    fail(std::string(what) + " with SetAtomicAdd<" + ascend_emu::atomic_name(k) + ">: " + std::to_string(n) +
         " B is not a whole number of " + ascend_emu::atomic_name(k) + " elements");
  auto* d = static_cast<uint8_t*>(dst);
  auto* s = static_cast<const uint8_t*>(src);
  switch (k) {
    case ascend_emu::AtomicKind::kF32: atomic_add_n<float>(d, s, n); break;
    case ascend_emu::AtomicKind::kF16: atomic_add_n<half>(d, s, n); break;
    case ascend_emu::AtomicKind::kBF16: atomic_add_n<bfloat16_t>(d, s, n); break;
    case ascend_emu::AtomicKind::kI8: atomic_add_n<int8_t>(d, s, n); break;
    case ascend_emu::AtomicKind::kI16: atomic_add_n<int16_t>(d, s, n); break;
    case ascend_emu::AtomicKind::kI32: atomic_add_n<int32_t>(d, s, n); break;
    default: break;
  }
}
}  // namespace detail

// API reference, SetAtomicAdd: later DMA transfers to GM (from UB, L0C or L1) add to what GM holds, in
// type T (A2: int8_t, int16_t, half, bfloat16_t, int32_t, float); SetAtomicNone / DisableDmaAtomic end it.
template <typename T>
inline void SetAtomicAdd() {
  using K = ascend_emu::AtomicKind;
  K k = K::kNone;
  if constexpr (std::is_same_v<T, float>) k = K::kF32;
  else if constexpr (std::is_same_v<T, half>) k = K::kF16;
  else if constexpr (std::is_same_v<T, bfloat16_t>) k = K::kBF16;
  else if constexpr (std::is_same_v<T, int8_t>) k = K::kI8;
  else if constexpr (std::is_same_v<T, int16_t>) k = K::kI16;
  else if constexpr (std::is_same_v<T, int32_t>) k = K::kI32;
  else fail(std::string("SetAtomicAdd<") + type_name<T>() + ">: A2 accumulates int8_t, int16_t, half, bfloat16_t, int32_t or float only");
  ascend_emu::gm_atomic() = k;
}
inline void SetAtomicNone() { ascend_emu::gm_atomic() = ascend_emu::AtomicKind::kNone; }
inline void DisableDmaAtomic() { SetAtomicNone(); }

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
  // Scalar accesses go through the core's data cache (emu/data_cache.h).
  T GetValue(uint64_t i) const {
    check(i, 1, "GetValue");
    T v;
    if (ascend_emu::ctx().active) {
      detail::scalar_gm(base_ + i, sizeof(T), false, "GlobalTensor::GetValue");
      ascend_emu::dc_read(ascend_emu::core_id(), base_ + i, &v, sizeof(T), type_name<T>(), i);
    } else {
      v = base_[i];
    }
    return v;
  }
  void SetValue(uint64_t i, T v) {
    check(i, 1, "SetValue");
    if (ascend_emu::ctx().active) {
      detail::scalar_gm(base_ + i, sizeof(T), true, "GlobalTensor::SetValue");
      ascend_emu::dc_write(ascend_emu::core_id(), base_ + i, &v, sizeof(T), type_name<T>(), i);
    } else {
      base_[i] = v;
    }
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
    scalar_position("GetValue");
    if (i >= size_) fail("LocalTensor GetValue(" + std::to_string(i) + ") past its " + std::to_string(size_) + " elements");
    detail::issue(PIPE_S, "LocalTensor::GetValue");
    emu_touch(sizeof(T), false, i * sizeof(T));
    T v;
    std::memcpy(&v, data() + i, sizeof(T));
    return v;
  }
  void SetValue(uint64_t i, T v) const {
    live("SetValue");
    scalar_position("SetValue");
    if (i >= size_) fail("LocalTensor SetValue(" + std::to_string(i) + ") past its " + std::to_string(size_) + " elements");
    detail::issue(PIPE_S, "LocalTensor::SetValue");
    emu_touch(sizeof(T), true, i * sizeof(T));
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
  T* data() const {
    auto& c = ascend_emu::ctx();
    uint8_t* base = slot_->space == ascend_emu::kUB ? c.ub.data() : c.mem[slot_->space].data();
    return reinterpret_cast<T*>(base + ub_addr());
  }
  int space() const { return slot_ ? slot_->space : ascend_emu::kUB; }
  // API reference, LocalTensor GetValue / SetValue: only for the VECIN / VECCALC / VECOUT positions (UB).
  void scalar_position(const char* what) const {
    if (slot_->space != ascend_emu::kUB)
      fail(std::string("scalar ") + what + " on a LocalTensor of " + slot_->owner + " in " +
           ascend_emu::space_name(slot_->space) + ": the scalar unit reaches UB only (VECIN/VECCALC/VECOUT); move " +
           "the data to GM (Fixpipe / DataCopy) and read it there");
  }
  // Cube-side operand check: live, in one of the allowed memories, holds n elements, aligned.
  void need_in(uint64_t n, const char* what, int s1, int s2, uint64_t align) const {
    live(what);
    if (slot_->space != s1 && slot_->space != s2) {
      std::ostringstream o;
      o << what << ": operand of " << slot_->owner << " lives in " << ascend_emu::space_name(slot_->space)
        << ", expected " << ascend_emu::space_name(s1) << (s2 != s1 ? std::string(" or ") + ascend_emu::space_name(s2) : "");
      fail(o.str());
    }
    if (n > size_) {
      std::ostringstream o;
      o << what << ": " << n << " elements needed but the LocalTensor<" << type_name<T>() << "> of " << slot_->owner
        << " in " << ascend_emu::space_name(slot_->space) << " holds " << size_;
      fail(o.str());
    }
    if (ub_addr() % align) {
      std::ostringstream o;
      o << what << ": operand of " << slot_->owner << " starts at byte " << ub_addr() << " of "
        << ascend_emu::space_name(slot_->space) << ", not " << align << "-byte aligned";
      fail(o.str());
    }
  }
  uint64_t ub_addr() const { return slot_->offset + byteOff_; }
  void need(uint64_t n, const char* what) const {
    live(what);
    if (slot_->space != ascend_emu::kUB)
      fail(std::string(what) + ": operand of " + slot_->owner + " lives in " + ascend_emu::space_name(slot_->space) +
           ", not UB (vector instructions and UB copies work on UB only)");
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
  // Pipe model: the current instruction accesses `bytes` bytes from element offset startByte / sizeof(T).
  void emu_touch(uint64_t bytes, bool write, uint64_t startByte = 0) const {
    auto& m = ascend_emu::ctx().model;
    if (!m.on() || !slot_) return;
    m.touch(slot_->rec, slot_->owner, ascend_emu::space_name(slot_->space), byteOff_ + startByte,
            byteOff_ + startByte + bytes, write);
  }

 private:
  std::shared_ptr<ascend_emu::Slot> slot_;
  uint64_t gen_ = 0;
  uint64_t byteOff_ = 0;
  uint64_t size_ = 0;
};

// ---- TPipe, TQue, TBuf ----------------------------------------------------------------------------
class TPipe;

namespace detail {
// Pipe model: the pipe that fills a queue buffer of this position (EnQue side) and the one that
// drains it (DeQue side); a TQueBind<SRC, DST> goes from producer(SRC) to consumer(DST).
constexpr int queue_producer(TPosition p) {
  return p == TPosition::VECIN || p == TPosition::A1 || p == TPosition::B1 ? int(PIPE_MTE2)
         : p == TPosition::A2 || p == TPosition::B2                       ? int(PIPE_MTE1)
         : p == TPosition::CO1                                            ? int(PIPE_M)
                                                                          : int(PIPE_V);
}
constexpr int queue_consumer(TPosition p) {
  return p == TPosition::VECOUT                      ? int(PIPE_MTE3)
         : p == TPosition::A1 || p == TPosition::B1 ? int(PIPE_MTE1)
         : p == TPosition::A2 || p == TPosition::B2 ? int(PIPE_M)
         : p == TPosition::CO1                      ? int(PIPE_FIX)
                                                    : int(PIPE_V);
}
}  // namespace detail

template <TPosition SRC, TPosition DST, int32_t DEPTH>
class TQueBind {
 public:
  static_assert(DEPTH >= 1, "queue depth must be >= 1");
  static constexpr int kProducer = detail::queue_producer(SRC);
  static constexpr int kConsumer = detail::queue_consumer(DST);
  template <typename T>
  LocalTensor<T> AllocTensor() {
    init_check("AllocTensor");
    // Buffers are handed out in rotation from the one after the last allocated (a ring, as double
    // buffering needs: tile i + 1 goes to the other buffer while tile i is still being stored).
    for (size_t k = 0; k < slots_.size(); ++k) {
      auto& s = slots_[(cursor_ + k) % slots_.size()];
      if (s->state == ascend_emu::SlotState::kFree) {
        cursor_ = (cursor_ + k + 1) % slots_.size();
        ascend_emu::ctx().model.acquire(kProducer, s->qsync.freed);  // waits for the FreeTensor's event
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
    s->qsync.enq = ascend_emu::ctx().model.snapshot(kProducer);  // the event set on the producer pipe
    fifo_.push_back(s);
    return true;
  }
  template <typename T>
  LocalTensor<T> DeQue() {
    init_check("DeQue");
    if (fifo_.empty()) fail("DeQue on " + name_ + ": the queue is empty (missing EnQue)");
    auto s = fifo_.front();
    fifo_.pop_front();
    ascend_emu::ctx().model.acquire(kConsumer, s->qsync.enq);  // the wait on the consumer pipe
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
    s->qsync.freed = ascend_emu::ctx().model.snapshot(kConsumer);  // the event the next AllocTensor waits for
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
  size_t cursor_ = 0;  // AllocTensor's next buffer
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

  // Buffer counts of the TPipe::InitBuffer reference (CANN 8.0.0, Atlas A2 training series): at most
  // kQueBuffersPerPosition queue buffers on one TPosition (an allocation beyond it "may fail" on the chip)
  // and kBuffersPerKernel buffers in all (each queue's num; a TBuf counted as one buffer).
  static constexpr uint32_t kQueBuffersPerPosition = 8, kBuffersPerKernel = 64;

  template <TPosition SRC, TPosition DST, int32_t DEPTH>
  bool InitBuffer(TQueBind<SRC, DST, DEPTH>& que, uint8_t num, uint32_t len) {
    if (num == 0 || len == 0) fail("InitBuffer of a queue with num=" + std::to_string(num) + ", len=" + std::to_string(len));
    uint32_t& onPos = state_->queBuffers[static_cast<int>(SRC)];
    if (onPos + num > kQueBuffersPerPosition)
      fail("InitBuffer: " + std::to_string(onPos + num) + " queue buffers on TPosition::" + position_name(SRC) +
           " (this queue's num=" + std::to_string(num) + "); A2 allows at most " +
           std::to_string(kQueBuffersPerPosition) + " per TPosition (merge buffers into one and offset into it)");
    onPos += num;
    count_buffers(num);
    std::string name = "queue #" + std::to_string(state_->queues.size());
    state_->queues.push_back(name);
    std::vector<std::shared_ptr<ascend_emu::Slot>> slots;
    for (uint8_t i = 0; i < num; ++i)
      slots.push_back(alloc(len, name + " buffer " + std::to_string(i), ascend_emu::SlotState::kFree, space_of(SRC)));
    que.emu_init(std::move(slots), name);
    return true;
  }
  template <TPosition POS>
  bool InitBuffer(TBuf<POS>& buf, uint32_t len) {
    if (len == 0) fail("InitBuffer of a TBuf with len=0");
    count_buffers(1);
    std::string name = "TBuf #" + std::to_string(state_->queues.size());
    state_->queues.push_back(name);
    buf.emu_init(alloc(len, name, ascend_emu::SlotState::kCalc, space_of(POS)));
    return true;
  }
  void Destroy() {}

 private:
  void count_buffers(uint32_t n) {
    state_->buffers += n;
    if (state_->buffers > kBuffersPerKernel)
      fail("InitBuffer: " + std::to_string(state_->buffers) + " buffers in one kernel; at most " +
           std::to_string(kBuffersPerKernel) + " (the sum of every queue's num and every TBuf)");
  }
  static const char* position_name(TPosition p) {
    switch (p) {
      case TPosition::GM: return "GM";
      case TPosition::VECIN: return "VECIN";
      case TPosition::VECOUT: return "VECOUT";
      case TPosition::VECCALC: return "VECCALC";
      case TPosition::A1: return "A1";
      case TPosition::A2: return "A2";
      case TPosition::B1: return "B1";
      case TPosition::B2: return "B2";
      case TPosition::CO1: return "CO1";
      case TPosition::CO2: return "CO2";
    }
    return "?";
  }
  static int space_of(TPosition p) {
    switch (p) {
      case TPosition::A1: case TPosition::B1: return ascend_emu::kL1;
      case TPosition::A2: return ascend_emu::kL0A;
      case TPosition::B2: return ascend_emu::kL0B;
      case TPosition::CO1: return ascend_emu::kL0C;
      case TPosition::CO2: fail("TPosition::CO2 is not in the emulated subset (A2 chips fix-pipe CO1 straight to GM)");
      default: return ascend_emu::kUB;
    }
  }
  std::shared_ptr<ascend_emu::Slot> alloc(uint32_t len, const std::string& owner, ascend_emu::SlotState st, int space) {
    auto& c = ascend_emu::ctx();
    if (space != ascend_emu::kUB) {
      if (!c.aic) fail(owner + ": " + ascend_emu::space_name(space) + " buffers exist on AIC (Cube) cores only; this is a vector launch");
      const uint64_t al = space == ascend_emu::kL1 ? 32 : 512;
      uint64_t off = (state_->usedSpace[space] + al - 1) / al * al;
      uint64_t bytes = (uint64_t(len) + al - 1) / al * al;
      if (off + bytes > c.cap[space]) {
        std::ostringstream o;
        o << ascend_emu::space_name(space) << " overflow: " << owner << " needs " << bytes << " B at offset " << off
          << ", but the " << ascend_emu::space_name(space) << " of block " << c.blockIdx << " holds " << c.cap[space] << " B";
        fail(o.str());
      }
      auto s = std::make_shared<ascend_emu::Slot>();
      s->space = space;
      s->offset = off;
      s->bytes = bytes;
      s->state = st;
      s->owner = owner;
      state_->usedSpace[space] = off + bytes;
      state_->slots.push_back(s);
      return s;
    }
    if (c.aic) fail(owner + ": an AIC (Cube) core has no UB; vector buffers need a vector (AIV) launch");
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
inline int64_t GetTaskRatio() { return ascend_emu::ctx().mix && !ascend_emu::ctx().aic ? 2 : 1; }
enum CoreType { AIC = 1, AIV = 2 };
#define g_coreType (ascend_emu::ctx().aic ? AscendC::AIC : AscendC::AIV)

namespace detail {
inline ascend_emu::MixGroup& mix_group(const char* what) {
  auto* g = ascend_emu::ctx().mix;
  if (!g) fail(std::string(what) + " outside a mixed (AIC + AIV) launch");
  return *g;
}
inline void check_flag(uint16_t id, const char* what) {
  // API reference, CrossCoreSetFlag: modes 0/1/2 take flagId 0..15; SyncAll uses 11..14 internally.
  if (id >= ascend_emu::MixGroup::kFlags) fail(std::string(what) + ": flagId " + std::to_string(id) + " outside 0..15");
  if (id >= 11 && id <= 14)
    fail(std::string(what) + ": flagId " + std::to_string(id) + " is one of 11..14, which SyncAll uses internally");
}
}  // namespace detail

// Mode 2 (AIC <-> the two AIVs of its AI Core): an AIC set releases one wait on each AIV; the two
// AIV sets together release one wait on the AIC.
template <uint8_t modeId, pipe_t pipe>
inline void CrossCoreSetFlag(uint16_t flagId) {
  // API reference, CrossCoreSetFlag: `pipe` is the pipe the set is issued on (the flag fires once that
  // pipe's earlier work is done); PIPE_S and PIPE_ALL are not allowed on A2 (modes 0..2).
  if (modeId <= 2 && (pipe == PIPE_S || pipe == PIPE_ALL))
    fail(std::string("CrossCoreSetFlag<") + std::to_string(modeId) + ", " + (pipe == PIPE_S ? "PIPE_S" : "PIPE_ALL") +
         ">: the set is issued on a transfer or compute pipe; PIPE_S and PIPE_ALL are not allowed for modes 0..2 on A2");
  if (modeId != 2) fail("CrossCoreSetFlag: only mode 2 (AIC <-> AIV of one AI Core) is emulated");
  detail::check_flag(flagId, "CrossCoreSetFlag");
  auto& c = ascend_emu::ctx();
  auto& g = detail::mix_group("CrossCoreSetFlag");
  // cross-core GM model: the set covers what `pipe` has completed (not the other pipes' pending work)
  ascend_emu::GmKnown msg = ascend_emu::gm_message(ascend_emu::core_id(), c.model.flag_clock(int(pipe)));
  std::unique_lock<std::mutex> lk(g.m);
  auto bump = [&](int& n) {
    if (++n > 15) fail("CrossCoreSetFlag: flag " + std::to_string(flagId) + " set more than 15 times without a wait");
  };
  if (c.aic) {
    bump(g.aiv[0][flagId]);
    bump(g.aiv[1][flagId]);
    g.aivMsg[0][flagId].push_back(msg);
    g.aivMsg[1][flagId].push_back(msg);
  } else {
    bump(g.fromAiv[c.sub][flagId]);
    g.fromAivMsg[c.sub][flagId].push_back(msg);
    if (g.fromAiv[0][flagId] > 0 && g.fromAiv[1][flagId] > 0) {
      --g.fromAiv[0][flagId];
      --g.fromAiv[1][flagId];
      bump(g.aic[flagId]);
      ascend_emu::GmKnown both = g.fromAivMsg[0][flagId].front();
      for (auto& kv : g.fromAivMsg[1][flagId].front()) ascend_emu::gm_join(both, kv.first, kv.second);
      g.fromAivMsg[0][flagId].pop_front();
      g.fromAivMsg[1][flagId].pop_front();
      g.aicMsg[flagId].push_back(std::move(both));
    }
  }
  if (auto* tl = c.model.tl()) tl->cross_set(int(pipe), c.model.snapshot(int(pipe)), flagId);  // timeline.h
  if (g.switchOnSet) {  // let the others run first: the setter continues when the token comes back
    const int me = c.aic ? 0 : 1 + static_cast<int>(c.sub);
    g.pass(me);
    g.cv.wait(lk, [&] { return g.turn == me || g.abort; });
    if (g.abort) fail("aborted: another block of the AI Core group failed");
  }
}

// Documented prototype: template <uint8_t modeId = 0, pipe_t pipe = PIPE_S> (older CANN: no template);
// the kernels call it without template arguments, which both accept. The wait side does not depend on
// the mode here (the counters are the set side's).
template <uint8_t modeId = 0, pipe_t pipe = PIPE_S>
inline void CrossCoreWaitFlag(uint16_t flagId) {
  detail::check_flag(flagId, "CrossCoreWaitFlag");
  auto& c = ascend_emu::ctx();
  auto& g = detail::mix_group("CrossCoreWaitFlag");
  std::unique_lock<std::mutex> lk(g.m);
  int& n = c.aic ? g.aic[flagId] : g.aiv[c.sub][flagId];
  const int me = c.aic ? 0 : 1 + static_cast<int>(c.sub);
  if (n == 0) {  // cannot go on: hand the token to a block that can, and wait until it comes back
    g.waitingOn[me] = &n;
    if (!g.pass(me)) {
      g.abort = true;
      g.error = std::string("deadlock: every live block of the AI Core group waits on a cross-core flag (") +
                (c.aic ? "AIC" : "AIV") + " waits on flag " + std::to_string(flagId) + ")";
      g.cv.notify_all();
      fail(g.error);
    }
    g.cv.wait(lk, [&] { return (g.turn == me && n > 0) || g.abort; });
    g.waitingOn[me] = nullptr;
    if (g.abort) fail("aborted: another block of the AI Core group failed");
  }
  --n;
  if (auto* tl = c.model.tl()) tl->cross_wait(flagId);  // timeline.h
  // cross-core GM model: the waiter learns what the matching set covered (the wait is taken as PIPE_S)
  auto& q = c.aic ? g.aicMsg[flagId] : g.aivMsg[c.sub][flagId];
  if (!q.empty()) {
    ascend_emu::GmKnown msg = std::move(q.front());
    q.pop_front();
    lk.unlock();
    ascend_emu::gm_acquire(ascend_emu::core_id(), msg);
  }
}

// ---- data cache maintenance (emu/data_cache.h) ------------------------------------------------------
enum class CacheLine { SINGLE_CACHE_LINE, ENTIRE_DATA_CACHE };
enum class DcciDst { CACHELINE_ALL, CACHELINE_UB, CACHELINE_OUT, CACHELINE_ATOMIC };

// Documented prototypes: template <typename T, CacheLine entireType, DcciDst dcciDst> (GM or local
// tensor) and template <typename T, CacheLine entireType> (GM). SINGLE_CACHE_LINE: the 64 B line that
// holds the tensor's first element; ENTIRE_DATA_CACHE: every line of the core.
template <typename T, CacheLine entireType, DcciDst dcciDst>
inline void DataCacheCleanAndInvalid(const GlobalTensor<T>& dst) {
  if (dcciDst == DcciDst::CACHELINE_UB || dcciDst == DcciDst::CACHELINE_ATOMIC)
    fail("DataCacheCleanAndInvalid on a GlobalTensor: dcciDst must be CACHELINE_OUT or CACHELINE_ALL on A2");
  dst.check(0, 0, "DataCacheCleanAndInvalid");
  ascend_emu::dc_clean_invalidate(ascend_emu::core_id(), dst.GetPhyAddr(), entireType == CacheLine::ENTIRE_DATA_CACHE);
}
template <typename T, CacheLine entireType>
inline void DataCacheCleanAndInvalid(const GlobalTensor<T>& dst) {
  DataCacheCleanAndInvalid<T, entireType, DcciDst::CACHELINE_OUT>(dst);
}

template <HardEvent E>
inline void SetFlag(event_t id) {
  constexpr detail::EventPipes ev = detail::event_pipes(E);
  ascend_emu::ctx().model.set_flag(ev.src, ev.dst, id, ev.name);
}
template <HardEvent E>
inline void WaitFlag(event_t id) {
  constexpr detail::EventPipes ev = detail::event_pipes(E);
  ascend_emu::ctx().model.wait_flag(ev.src, ev.dst, id, ev.name);
}
template <pipe_t P>
inline void PipeBarrier() {
  ascend_emu::ctx().model.barrier(int(P));
}

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
  detail::issue(PIPE_MTE2, "DataCopy (GM->UB)");
  dst.emu_touch(uint64_t(count) * sizeof(T), true);
  detail::gm_touch(src.GetPhyAddr(), uint64_t(count) * sizeof(T), false);
  std::memcpy(dst.data(), src.GetPhyAddr(), uint64_t(count) * sizeof(T));
}

template <typename T>
void DataCopy(const GlobalTensor<T>& dst, const LocalTensor<T>& src, uint32_t count) {
  detail::check_block_len<T>(uint64_t(count) * sizeof(T), "DataCopy (UB->GM)");
  src.need(count, "DataCopy (UB->GM)");
  dst.check(0, count, "DataCopy (UB->GM)");
  detail::issue(PIPE_MTE3, "DataCopy (UB->GM)");
  src.emu_touch(uint64_t(count) * sizeof(T), false);
  detail::gm_touch(dst.GetPhyAddr(), uint64_t(count) * sizeof(T), true);
  ascend_emu::dc_dma_write(ascend_emu::core_id(), dst.GetPhyAddr(), uint64_t(count) * sizeof(T));
  detail::gm_store(dst.GetPhyAddr(), src.data(), uint64_t(count) * sizeof(T), "DataCopy (UB->GM)");
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
  detail::issue(PIPE_MTE2, "DataCopyPad (GM->UB)");
  dst.emu_touch(uint64_t(p.blockCount) * rowUb, true);
  uint8_t* ub = reinterpret_cast<uint8_t*>(dst.data());
  for (uint32_t b = 0; b < p.blockCount; ++b) {
    uint8_t* row = ub + b * rowUb;
    std::memset(row, 0xFF, ascend_emu::align32(pad.leftPadding * sizeof(T) + p.blockLen));  // undefined bytes
    T* r = reinterpret_cast<T*>(row);
    detail::gm_touch(src.GetPhyAddr() + b * gmStride, p.blockLen, false);
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
  detail::issue(PIPE_MTE3, "DataCopyPad (UB->GM)");
  if (p.blockCount) src.emu_touch(uint64_t(p.blockCount - 1) * rowUb + p.blockLen, false);
  const uint8_t* ub = reinterpret_cast<const uint8_t*>(src.data());
  for (uint32_t b = 0; b < p.blockCount; ++b) {
    detail::gm_touch(dst.GetPhyAddr() + b * gmStride, p.blockLen, true);
    ascend_emu::dc_dma_write(ascend_emu::core_id(), dst.GetPhyAddr() + b * gmStride, p.blockLen);
    detail::gm_store(dst.GetPhyAddr() + b * gmStride, ub + b * rowUb, p.blockLen, "DataCopyPad (UB->GM)");
  }
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
  detail::issue(PIPE_V, "Duplicate");
  dst.emu_touch(uint64_t(count) * sizeof(T), true);
  for (int32_t i = 0; i < count; ++i) dst.data()[i] = v;
}

#define AMO_EMU_BINARY(NAME, EXPR)                                                      \
  template <typename T>                                                                 \
  void NAME(const LocalTensor<T>& dst, const LocalTensor<T>& a, const LocalTensor<T>& b, \
            int32_t count) {                                                            \
    detail::arith_type<T>(#NAME);                                                       \
    dst.need(count, #NAME); a.need(count, #NAME); b.need(count, #NAME);                 \
    detail::overlap(dst, a, count, #NAME); detail::overlap(dst, b, count, #NAME);        \
    detail::issue(PIPE_V, #NAME);                                                       \
    a.emu_touch(uint64_t(count) * sizeof(T), false);                                    \
    b.emu_touch(uint64_t(count) * sizeof(T), false);                                    \
    dst.emu_touch(uint64_t(count) * sizeof(T), true);                                   \
    for (int32_t i = 0; i < count; ++i) {                                               \
      float x = static_cast<float>(a.data()[i]), y = static_cast<float>(b.data()[i]);   \
      dst.data()[i] = static_cast<T>(EXPR);                                             \
    }                                                                                   \
  }
AMO_EMU_BINARY(Add, x + y)
AMO_EMU_BINARY(Mul, x * y)
AMO_EMU_BINARY(Sub, x - y)
AMO_EMU_BINARY(Max, (x > y || std::isnan(x)) ? x : y)
#undef AMO_EMU_BINARY

// Unary fp32/fp16 ops of the flash attention softmax (computed in float, rounded to T).
#define AMO_EMU_UNARY(NAME, EXPR)                                                           \
  template <typename T>                                                                     \
  void NAME(const LocalTensor<T>& dst, const LocalTensor<T>& src, int32_t count) {           \
    detail::arith_type<T>(#NAME);                                                           \
    if constexpr (!(std::is_same_v<T, float> || std::is_same_v<T, half>))                   \
      fail(std::string(#NAME) + " on " + type_name<T>() + ": float/half only");            \
    dst.need(count, #NAME); src.need(count, #NAME);                                         \
    detail::overlap(dst, src, count, #NAME);                                                \
    detail::issue(PIPE_V, #NAME);                                                           \
    src.emu_touch(uint64_t(count) * sizeof(T), false);                                      \
    dst.emu_touch(uint64_t(count) * sizeof(T), true);                                       \
    for (int32_t i = 0; i < count; ++i) {                                                   \
      float x = static_cast<float>(src.data()[i]);                                          \
      dst.data()[i] = static_cast<T>(EXPR);                                                 \
    }                                                                                       \
  }
AMO_EMU_UNARY(Exp, std::exp(x))
AMO_EMU_UNARY(Ln, std::log(x))
#undef AMO_EMU_UNARY

template <typename T>
void Muls(const LocalTensor<T>& dst, const LocalTensor<T>& src, const T& s, int32_t count) {
  detail::arith_type<T>("Muls");
  dst.need(count, "Muls");
  src.need(count, "Muls");
  detail::overlap(dst, src, count, "Muls");
  detail::issue(PIPE_V, "Muls");
  src.emu_touch(uint64_t(count) * sizeof(T), false);
  dst.emu_touch(uint64_t(count) * sizeof(T), true);
  for (int32_t i = 0; i < count; ++i) dst.data()[i] = static_cast<T>(static_cast<float>(src.data()[i]) * static_cast<float>(s));
}

template <typename T>
void Adds(const LocalTensor<T>& dst, const LocalTensor<T>& src, const T& s, int32_t count) {
  detail::arith_type<T>("Adds");
  dst.need(count, "Adds");
  src.need(count, "Adds");
  detail::overlap(dst, src, count, "Adds");
  detail::issue(PIPE_V, "Adds");
  src.emu_touch(uint64_t(count) * sizeof(T), false);
  dst.emu_touch(uint64_t(count) * sizeof(T), true);
  for (int32_t i = 0; i < count; ++i) dst.data()[i] = static_cast<T>(static_cast<float>(src.data()[i]) + static_cast<float>(s));
}

// dst = src * s + dst (the product and the sum are rounded separately here)
template <typename T, typename U>
void Axpy(const LocalTensor<T>& dst, const LocalTensor<U>& src, const U& s, int32_t count) {
  static_assert(std::is_same_v<T, U>, "emulator: Axpy with mixed precision is not in the emulated subset");
  detail::arith_type<T>("Axpy");
  dst.need(count, "Axpy");
  src.need(count, "Axpy");
  detail::overlap(dst, src, count, "Axpy");
  detail::issue(PIPE_V, "Axpy");
  src.emu_touch(uint64_t(count) * sizeof(U), false);
  dst.emu_touch(uint64_t(count) * sizeof(T), false);
  dst.emu_touch(uint64_t(count) * sizeof(T), true);
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
    detail::issue(PIPE_V, "Cast");
    src.emu_touch(uint64_t(count) * sizeof(S), false);
    dst.emu_touch(uint64_t(count) * sizeof(D), true);
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
  detail::issue(PIPE_V, "ReduceSum");
  src.emu_touch(uint64_t(count) * sizeof(T), false);
  work.emu_touch(uint64_t(repeats) * sizeof(T), true);
  dst.emu_touch(sizeof(T), true);
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

// Maximum of the first `count` floats into dst[0] (no index: calIndex = false).
template <typename T>
void ReduceMax(const LocalTensor<T>& dst, const LocalTensor<T>& src, const LocalTensor<T>& work, int32_t count,
               bool calIndex = false) {
  static_assert(std::is_same_v<T, float>, "emulator: ReduceMax is emulated for float only");
  if (calIndex) fail("ReduceMax with calIndex is not in the emulated subset");
  if (count <= 0) fail("ReduceMax with count <= 0");
  src.need(count, "ReduceMax");
  dst.need(1, "ReduceMax");
  // A2 rule (API reference, ReduceMax, sharedTmpBuffer without index): the first round writes a
  // (max, index) pair per 256-byte repeat, so the work buffer needs ceil(2 * repeats / 8) * 8 floats.
  const int32_t repeats = (count + 63) / 64;
  const int32_t need = (2 * repeats + 7) / 8 * 8;
  work.live("ReduceMax");
  if (static_cast<uint64_t>(need) > work.GetSize())
    fail("ReduceMax work buffer of " + work.slot()->owner + ": " + std::to_string(count) + " floats = " +
         std::to_string(repeats) + " repeats need ceil(2 * repeats / 8) * 8 = " + std::to_string(need) +
         " floats, it holds " + std::to_string(work.GetSize()));
  work.need(need, "ReduceMax work buffer");
  detail::issue(PIPE_V, "ReduceMax");
  src.emu_touch(uint64_t(count) * sizeof(T), false);
  work.emu_touch(uint64_t(need) * sizeof(T), true);
  dst.emu_touch(sizeof(T), true);
  float m = src.data()[0];
  for (int32_t i = 1; i < count; ++i) m = src.data()[i] > m ? src.data()[i] : m;
  dst.data()[0] = m;
}

// ---- vector unit: the tensor high-dimension forms (repeatTimes, mask, block / repeat strides) ------
// API reference (CANN 8.x, "Ascend C API > basic API > vector compute", the "高维切分" / tensor
// high-dimension calling form, e.g. Add, Exp, Muls, Duplicate, WholeReduceMax, WholeReduceSum, Brcb
// pages): one instruction runs repeatTimes (0..255) repeats; a repeat covers 8 data blocks of 32 B
// (256 B: 64 fp32 or 128 fp16 elements); inside a repeat, block b of an operand starts blkStride
// blocks after block b-1, and repeat r starts repStride blocks after repeat r-1 (both in 32-byte
// blocks). The mask selects the elements of each repeat that take part: the "continuous" form counts
// the first `mask` elements (1..64 for 32-bit, 1..128 for 16-bit types); the bit form mask[0] (bits of
// elements 0..63) and mask[1] (elements 64..127, 16-bit types only; must be 0 for 32-bit types).
// Elements outside the mask are left as they were in the destination. Checked: repeatTimes and mask
// ranges, every accessed element inside its operand, operands 32-byte aligned.
struct BinaryRepeatParams {
  BinaryRepeatParams() = default;
  BinaryRepeatParams(uint8_t dB, uint8_t s0B, uint8_t s1B, uint8_t dR, uint8_t s0R, uint8_t s1R)
      : dstBlkStride(dB), src0BlkStride(s0B), src1BlkStride(s1B), dstRepStride(dR), src0RepStride(s0R), src1RepStride(s1R) {}
  uint8_t dstBlkStride = 1, src0BlkStride = 1, src1BlkStride = 1;
  uint8_t dstRepStride = 8, src0RepStride = 8, src1RepStride = 8;
};
struct UnaryRepeatParams {
  UnaryRepeatParams() = default;
  UnaryRepeatParams(uint16_t dB, uint16_t sB, uint8_t dR, uint8_t sR)
      : dstBlkStride(dB), srcBlkStride(sB), dstRepStride(dR), srcRepStride(sR) {}
  uint16_t dstBlkStride = 1, srcBlkStride = 1;
  uint8_t dstRepStride = 8, srcRepStride = 8;
};
// Brcb (API reference, Brcb): each repeat takes 8 consecutive elements of src and writes each one
// broadcast over one 32-byte block of dst; blocks dstBlkStride apart, repeats dstRepStride apart.
struct BrcbRepeatParams {
  BrcbRepeatParams() = default;
  BrcbRepeatParams(uint16_t dB, uint16_t dR) : dstRepStride(dR), dstBlkStride(dB) {}
  uint16_t dstRepStride = 8;
  uint16_t dstBlkStride = 1;
};
// WholeReduceMax / WholeReduceMin result layout (API reference, WholeReduceMax: ORDER_VALUE_INDEX
// default); the emulator implements ORDER_ONLY_VALUE (value only; index forms are not emulated).
enum class ReduceOrder { ORDER_VALUE_INDEX, ORDER_INDEX_VALUE, ORDER_ONLY_VALUE, ORDER_ONLY_INDEX };

namespace detail {
// The elements of one repeat that the mask selects.
struct RepMask {
  uint64_t bits[2] = {0, 0};
  int per = 0;  // elements per repeat
  bool on(int i) const { return (bits[i / 64] >> (i % 64)) & 1u; }
  int last() const {  // highest selected element + 1
    for (int i = per; i-- > 0;)
      if (on(i)) return i + 1;
    return 0;
  }
};
template <typename T>
RepMask cont_mask(uint64_t mask, const char* what) {
  RepMask m;
  m.per = 256 / sizeof(T);
  if (mask < 1 || mask > uint64_t(m.per))
    fail(std::string(what) + ": continuous mask " + std::to_string(mask) + " outside [1, " + std::to_string(m.per) +
         "] for " + type_name<T>());
  for (uint64_t i = 0; i < mask; ++i) m.bits[i / 64] |= uint64_t(1) << (i % 64);
  return m;
}
template <typename T>
RepMask bit_mask(const uint64_t mask[], const char* what) {
  RepMask m;
  m.per = 256 / sizeof(T);
  m.bits[0] = mask[0];
  m.bits[1] = m.per > 64 ? mask[1] : 0;
  if (m.per == 64 && mask[1] != 0)
    fail(std::string(what) + ": bit mask[1] must be 0 for the 32-bit type " + type_name<T>() + " (64 elements per repeat)");
  if (!m.bits[0] && !m.bits[1]) fail(std::string(what) + ": bit mask selects no element");
  return m;
}
inline void check_repeat(int64_t repeat, const char* what) {
  if (repeat < 0 || repeat > 255) fail(std::string(what) + ": repeatTimes " + std::to_string(repeat) + " outside [0, 255]");
}
// Element offset of element i of repeat r for an operand with block / repeat strides (32-byte blocks).
template <typename T>
inline uint64_t rep_off(int64_t r, int i, uint32_t blk, uint32_t rep) {
  constexpr int perBlk = 32 / sizeof(T);
  return uint64_t(r) * rep * perBlk + uint64_t(i / perBlk) * blk * perBlk + i % perBlk;
}
// Highest element offset + 1 an operand is accessed at (0 without repeats).
template <typename T>
inline uint64_t rep_span(int64_t repeat, const RepMask& m, uint32_t blk, uint32_t rep) {
  if (repeat == 0) return 0;
  const int last = m.last();
  uint64_t hi = 0;
  for (int i = 0; i < last; ++i)
    if (m.on(i)) hi = std::max<uint64_t>(hi, rep_off<T>(repeat - 1, i, blk, rep) + 1);
  return hi;
}
// Charge / order the span of an operand for the pipe model; its bytes touched.
template <typename T>
inline void rep_touch(const LocalTensor<T>& t, uint64_t span, bool write) {
  t.emu_touch(span * sizeof(T), write);
}
// The timeline's charge of a repeat-form vector instruction: `repeats` iterations of 256 B each (the
// spans above order the accesses; they include the stride gaps, which cost no iteration).
inline void rep_work(int64_t repeats) {
  if (auto* tl = ascend_emu::ctx().model.tl()) tl->vec_iterations(static_cast<uint64_t>(repeats));
}
// The repeat loop of the high-dimension forms, for N source operands with their block / repeat
// strides: the checks, every operand's span (dst first, then the sources) and its pipe-model charge,
// then f(x) per selected element, x[j] the element of source j. Every source element is read before
// any is written (in-place forms with different strides stay defined).
template <typename T, size_t N, typename F>
void repeat_hd(const char* name, const LocalTensor<T>& dst, uint32_t dstBlk, uint32_t dstRep,
               const LocalTensor<T>* const (&src)[N], const uint32_t (&blk)[N], const uint32_t (&rep)[N],
               const RepMask& m, uint8_t repeat, F f) {
  arith_type<T>(name);
  check_repeat(repeat, name);
  const uint64_t sd = rep_span<T>(repeat, m, dstBlk, dstRep);
  uint64_t ss[N];
  for (size_t j = 0; j < N; ++j) ss[j] = rep_span<T>(repeat, m, blk[j], rep[j]);
  dst.need(sd, name);
  for (size_t j = 0; j < N; ++j) src[j]->need(ss[j], name);
  issue(PIPE_V, name);
  for (size_t j = 0; j < N; ++j) rep_touch(*src[j], ss[j], false);
  rep_touch(dst, sd, true);
  rep_work(repeat);
  std::vector<std::pair<uint64_t, T>> out;
  out.reserve(size_t(repeat) * m.per);
  for (int64_t r = 0; r < repeat; ++r)
    for (int i = 0; i < m.per; ++i) {
      if (!m.on(i)) continue;
      float x[N];
      for (size_t j = 0; j < N; ++j) x[j] = static_cast<float>(src[j]->data()[rep_off<T>(r, i, blk[j], rep[j])]);
      out.emplace_back(rep_off<T>(r, i, dstBlk, dstRep), static_cast<T>(f(x)));
    }
  for (auto& e : out) dst.data()[e.first] = e.second;
}
template <typename T, typename F>
void binary_hd(const char* name, const LocalTensor<T>& dst, const LocalTensor<T>& a, const LocalTensor<T>& b,
               const RepMask& m, uint8_t repeat, const BinaryRepeatParams& p, F f) {
  const LocalTensor<T>* const src[2] = {&a, &b};
  const uint32_t blk[2] = {p.src0BlkStride, p.src1BlkStride}, rep[2] = {p.src0RepStride, p.src1RepStride};
  repeat_hd<T, 2>(name, dst, p.dstBlkStride, p.dstRepStride, src, blk, rep, m, repeat,
                  [&](const float* x) { return f(x[0], x[1]); });
}
template <typename T, typename F>
void unary_hd(const char* name, const LocalTensor<T>& dst, const LocalTensor<T>& src, const RepMask& m, uint8_t repeat,
              const UnaryRepeatParams& p, F f) {
  const LocalTensor<T>* const srcs[1] = {&src};
  const uint32_t blk[1] = {p.srcBlkStride}, rep[1] = {p.srcRepStride};
  repeat_hd<T, 1>(name, dst, p.dstBlkStride, p.dstRepStride, srcs, blk, rep, m, repeat,
                  [&](const float* x) { return f(x[0]); });
}
}  // namespace detail

#define AMO_EMU_BINARY_HD(NAME, EXPR)                                                                        \
  template <typename T, bool isSetMask = true>                                                               \
  void NAME(const LocalTensor<T>& dst, const LocalTensor<T>& a, const LocalTensor<T>& b, uint64_t mask,        \
            const uint8_t repeatTimes, const BinaryRepeatParams& p) {                                        \
    detail::binary_hd(#NAME, dst, a, b, detail::cont_mask<T>(mask, #NAME), repeatTimes, p,                   \
                      [](float x, float y) { return EXPR; });                                                \
  }                                                                                                          \
  template <typename T, bool isSetMask = true>                                                               \
  void NAME(const LocalTensor<T>& dst, const LocalTensor<T>& a, const LocalTensor<T>& b, const uint64_t mask[], \
            const uint8_t repeatTimes, const BinaryRepeatParams& p) {                                        \
    detail::binary_hd(#NAME, dst, a, b, detail::bit_mask<T>(mask, #NAME), repeatTimes, p,                   \
                      [](float x, float y) { return EXPR; });                                                \
  }
AMO_EMU_BINARY_HD(Add, x + y)
AMO_EMU_BINARY_HD(Mul, x * y)
AMO_EMU_BINARY_HD(Sub, x - y)
AMO_EMU_BINARY_HD(Max, (x > y || std::isnan(x)) ? x : y)
#undef AMO_EMU_BINARY_HD

#define AMO_EMU_UNARY_HD(NAME, EXPR)                                                                          \
  template <typename T, bool isSetMask = true>                                                                \
  void NAME(const LocalTensor<T>& dst, const LocalTensor<T>& src, uint64_t mask, const uint8_t repeatTimes,    \
            const UnaryRepeatParams& p) {                                                                     \
    detail::unary_hd(#NAME, dst, src, detail::cont_mask<T>(mask, #NAME), repeatTimes, p,                      \
                     [](float x) { return EXPR; });                                                           \
  }                                                                                                           \
  template <typename T, bool isSetMask = true>                                                                \
  void NAME(const LocalTensor<T>& dst, const LocalTensor<T>& src, const uint64_t mask[], const uint8_t repeatTimes, \
            const UnaryRepeatParams& p) {                                                                     \
    detail::unary_hd(#NAME, dst, src, detail::bit_mask<T>(mask, #NAME), repeatTimes, p,                       \
                     [](float x) { return EXPR; });                                                           \
  }
AMO_EMU_UNARY_HD(Exp, std::exp(x))
AMO_EMU_UNARY_HD(Ln, std::log(x))
#undef AMO_EMU_UNARY_HD

#define AMO_EMU_SCALAR_HD(NAME, OP)                                                                           \
  template <typename T, bool isSetMask = true>                                                                \
  void NAME(const LocalTensor<T>& dst, const LocalTensor<T>& src, const T& s, uint64_t mask,                   \
            const uint8_t repeatTimes, const UnaryRepeatParams& p) {                                          \
    const float sv = static_cast<float>(s);                                                                   \
    detail::unary_hd(#NAME, dst, src, detail::cont_mask<T>(mask, #NAME), repeatTimes, p,                      \
                     [sv](float x) { return x OP sv; });                                                      \
  }                                                                                                           \
  template <typename T, bool isSetMask = true>                                                                \
  void NAME(const LocalTensor<T>& dst, const LocalTensor<T>& src, const T& s, const uint64_t mask[],           \
            const uint8_t repeatTimes, const UnaryRepeatParams& p) {                                          \
    const float sv = static_cast<float>(s);                                                                   \
    detail::unary_hd(#NAME, dst, src, detail::bit_mask<T>(mask, #NAME), repeatTimes, p,                       \
                     [sv](float x) { return x OP sv; });                                                      \
  }
AMO_EMU_SCALAR_HD(Muls, *)
AMO_EMU_SCALAR_HD(Adds, +)
#undef AMO_EMU_SCALAR_HD

namespace detail {
template <typename T>
void duplicate_hd(const LocalTensor<T>& dst, const T& v, const RepMask& m, uint8_t repeat, uint16_t blk, uint8_t rep) {
  check_repeat(repeat, "Duplicate");
  const uint64_t sd = rep_span<T>(repeat, m, blk, rep);
  dst.need(sd, "Duplicate");
  issue(PIPE_V, "Duplicate");
  rep_touch(dst, sd, true);
  rep_work(repeat);
  for (int64_t r = 0; r < repeat; ++r)
    for (int i = 0; i < m.per; ++i)
      if (m.on(i)) dst.data()[rep_off<T>(r, i, blk, rep)] = v;
}
}  // namespace detail
// API reference, Duplicate (high-dimension form): dst elements selected by the mask in each repeat = v.
template <typename T, bool isSetMask = true>
void Duplicate(const LocalTensor<T>& dst, const T& v, uint64_t mask, const uint8_t repeatTimes, const uint16_t dstBlockStride,
               const uint8_t dstRepeatStride) {
  detail::duplicate_hd(dst, v, detail::cont_mask<T>(mask, "Duplicate"), repeatTimes, dstBlockStride, dstRepeatStride);
}
template <typename T, bool isSetMask = true>
void Duplicate(const LocalTensor<T>& dst, const T& v, const uint64_t mask[], const uint8_t repeatTimes,
               const uint16_t dstBlockStride, const uint8_t dstRepeatStride) {
  detail::duplicate_hd(dst, v, detail::bit_mask<T>(mask, "Duplicate"), repeatTimes, dstBlockStride, dstRepeatStride);
}

namespace detail {
// WholeReduceMax / WholeReduceSum: one result per repeat, at dst[r * dstRepStride] (units: one result
// element for ORDER_ONLY_VALUE / the sum). Sum order inside a repeat: the binary tree over the repeat's
// lanes the API reference describes for the reduction instructions (masked-off lanes count as 0), the
// same order as ReduceSum's per-repeat step above.
template <typename T, bool kMax>
void whole_reduce(const char* name, const LocalTensor<T>& dst, const LocalTensor<T>& src, const RepMask& m, int32_t repeat,
                  int32_t dstRepStride, int32_t srcBlkStride, int32_t srcRepStride) {
  static_assert(std::is_same_v<T, float>, "emulator: WholeReduceMax / WholeReduceSum are emulated for float only");
  check_repeat(repeat, name);
  if (dstRepStride < 0 || srcBlkStride < 0 || srcRepStride < 0) fail(std::string(name) + ": negative stride");
  const uint64_t ss = rep_span<T>(repeat, m, srcBlkStride, srcRepStride);
  const uint64_t sd = repeat ? uint64_t(repeat - 1) * dstRepStride + 1 : 0;
  src.need(ss, name);
  dst.live(name);
  if (sd > dst.GetSize()) fail(std::string(name) + ": " + std::to_string(sd) + " result elements past the destination's " + std::to_string(dst.GetSize()));
  if (dst.ub_addr() % sizeof(T) || dst.space() != ascend_emu::kUB) fail(std::string(name) + ": destination must be in UB, element aligned");
  issue(PIPE_V, name);
  rep_touch(src, ss, false);
  rep_touch(dst, sd, true);
  rep_work(repeat);
  std::vector<float> res(static_cast<size_t>(repeat));
  constexpr int per = 256 / sizeof(T);
  for (int32_t r = 0; r < repeat; ++r) {
    if constexpr (kMax) {
      bool any = false;
      float v = 0.0f;
      for (int i = 0; i < per; ++i) {
        if (!m.on(i)) continue;
        const float x = src.data()[rep_off<T>(r, i, srcBlkStride, srcRepStride)];
        if (!any || x > v || std::isnan(x)) v = (any && std::isnan(v)) ? v : x;
        any = true;
      }
      res[r] = v;
    } else {
      float lane[per];
      for (int i = 0; i < per; ++i) lane[i] = m.on(i) ? src.data()[rep_off<T>(r, i, srcBlkStride, srcRepStride)] : 0.0f;
      for (int w = per / 2; w >= 1; w /= 2)
        for (int i = 0; i < w; ++i) lane[i] = lane[2 * i] + lane[2 * i + 1];
      res[r] = lane[0];
    }
  }
  for (int32_t r = 0; r < repeat; ++r) dst.data()[uint64_t(r) * dstRepStride] = res[r];
}
}  // namespace detail

template <typename T, bool isSetMask = true>
void WholeReduceMax(const LocalTensor<T>& dst, const LocalTensor<T>& src, const int32_t mask, const int32_t repeatTimes,
                    const int32_t dstRepStride, const int32_t srcBlkStride, const int32_t srcRepStride,
                    ReduceOrder order = ReduceOrder::ORDER_VALUE_INDEX) {
  if (order != ReduceOrder::ORDER_ONLY_VALUE)
    fail("WholeReduceMax: only ReduceOrder::ORDER_ONLY_VALUE is emulated (the index forms are not)");
  detail::whole_reduce<T, true>("WholeReduceMax", dst, src, detail::cont_mask<T>(uint64_t(mask), "WholeReduceMax"),
                                repeatTimes, dstRepStride, srcBlkStride, srcRepStride);
}
template <typename T, bool isSetMask = true>
void WholeReduceMax(const LocalTensor<T>& dst, const LocalTensor<T>& src, const uint64_t mask[], const int32_t repeatTimes,
                    const int32_t dstRepStride, const int32_t srcBlkStride, const int32_t srcRepStride,
                    ReduceOrder order = ReduceOrder::ORDER_VALUE_INDEX) {
  if (order != ReduceOrder::ORDER_ONLY_VALUE)
    fail("WholeReduceMax: only ReduceOrder::ORDER_ONLY_VALUE is emulated (the index forms are not)");
  detail::whole_reduce<T, true>("WholeReduceMax", dst, src, detail::bit_mask<T>(mask, "WholeReduceMax"), repeatTimes,
                                dstRepStride, srcBlkStride, srcRepStride);
}
template <typename T, bool isSetMask = true>
void WholeReduceSum(const LocalTensor<T>& dst, const LocalTensor<T>& src, const int32_t mask, const int32_t repeatTimes,
                    const int32_t dstRepStride, const int32_t srcBlkStride, const int32_t srcRepStride) {
  detail::whole_reduce<T, false>("WholeReduceSum", dst, src, detail::cont_mask<T>(uint64_t(mask), "WholeReduceSum"),
                                 repeatTimes, dstRepStride, srcBlkStride, srcRepStride);
}
template <typename T, bool isSetMask = true>
void WholeReduceSum(const LocalTensor<T>& dst, const LocalTensor<T>& src, const uint64_t mask[], const int32_t repeatTimes,
                    const int32_t dstRepStride, const int32_t srcBlkStride, const int32_t srcRepStride) {
  detail::whole_reduce<T, false>("WholeReduceSum", dst, src, detail::bit_mask<T>(mask, "WholeReduceSum"), repeatTimes,
                                 dstRepStride, srcBlkStride, srcRepStride);
}

template <typename T>
void Brcb(const LocalTensor<T>& dst, const LocalTensor<T>& src, const uint8_t repeatTimes, const BrcbRepeatParams& p) {
  static_assert(sizeof(T) == 2 || sizeof(T) == 4, "emulator: Brcb on 16- or 32-bit types");
  detail::check_repeat(repeatTimes, "Brcb");
  constexpr int perBlk = 32 / sizeof(T);
  const uint64_t ss = uint64_t(repeatTimes) * 8;
  const uint64_t sd = repeatTimes ? (uint64_t(repeatTimes - 1) * p.dstRepStride + 7ull * p.dstBlkStride + 1) * perBlk : 0;
  src.need(ss, "Brcb");
  dst.need(sd, "Brcb");
  if (src.slot() == dst.slot() && src.ub_addr() < dst.ub_addr() + sd * sizeof(T) && dst.ub_addr() < src.ub_addr() + ss * sizeof(T))
    fail("Brcb: source and destination overlap (the API reference excludes src0 and dst at the same memory)");
  detail::issue(PIPE_V, "Brcb");
  src.emu_touch(ss * sizeof(T), false);
  dst.emu_touch(sd * sizeof(T), true);
  detail::rep_work(repeatTimes);
  for (int64_t r = 0; r < repeatTimes; ++r)
    for (int b = 0; b < 8; ++b) {
      const T v = src.data()[r * 8 + b];
      T* blk = dst.data() + (uint64_t(r) * p.dstRepStride + uint64_t(b) * p.dstBlkStride) * perBlk;
      for (int i = 0; i < perBlk; ++i) blk[i] = v;
    }
}

// ---- Cube unit (AIC) ---------------------------------------------------------------------------------
namespace detail {
constexpr uint64_t kC0 = 16;          // fp16/bf16 elements per 32-byte C0 block
constexpr uint64_t kFrac = 256;       // elements of a 16 x 16 fractal (512 B for 2-byte types)
inline uint64_t up16(uint64_t x) { return (x + 15) / 16 * 16; }
template <typename T>
void cube_input_type(const char* what) {
  if constexpr (!(std::is_same_v<T, half> || std::is_same_v<T, bfloat16_t>))
    fail(std::string(what) + " on " + type_name<T>() + ": the emulated Cube subset takes half/bfloat16_t inputs only");
}
}  // namespace detail

struct Nd2NzParams {
  uint16_t ndNum = 1;
  uint16_t nValue = 0;             // rows of the ND source
  uint16_t dValue = 0;             // columns of the ND source
  uint16_t srcNdMatrixStride = 0;
  uint16_t srcDValue = 0;          // elements between source rows
  uint16_t dstNzC0Stride = 0;      // rows (C0 blocks) between consecutive column blocks in L1
  uint16_t dstNzNStride = 1;       // C0 blocks between consecutive rows in L1
  uint16_t dstNzMatrixStride = 0;
};

// GM (ND) -> L1 (NZ): element (r, c) goes to ((c / 16) * dstNzC0Stride + r * dstNzNStride) * 16 + c % 16.
template <typename T>
void DataCopy(const LocalTensor<T>& dst, const GlobalTensor<T>& src, const Nd2NzParams& p) {
  detail::cube_input_type<T>("DataCopy (GM->L1, ND2NZ)");
  if (p.ndNum != 1 || p.dstNzNStride != 1) fail("DataCopy ND2NZ: only ndNum == 1 and dstNzNStride == 1 are emulated");
  if (p.nValue == 0 || p.dValue == 0) fail("DataCopy ND2NZ: nValue and dValue must be >= 1");
  if (p.srcDValue < p.dValue) fail("DataCopy ND2NZ: srcDValue < dValue (source rows overlap)");
  if (p.dstNzC0Stride < p.nValue)
    fail("DataCopy ND2NZ: dstNzC0Stride " + std::to_string(p.dstNzC0Stride) + " < nValue " + std::to_string(p.nValue) +
         ": column blocks would overlap in L1");
  const uint64_t blocks = (p.dValue + detail::kC0 - 1) / detail::kC0;
  dst.need_in((blocks - 1) * p.dstNzC0Stride * detail::kC0 + uint64_t(p.nValue) * detail::kC0,
              "DataCopy (GM->L1, ND2NZ)", ascend_emu::kL1, ascend_emu::kL1, 32);
  src.check(0, uint64_t(p.nValue - 1) * p.srcDValue + p.dValue, "DataCopy (GM->L1, ND2NZ)");
  detail::issue(PIPE_MTE2, "DataCopy (GM->L1, ND2NZ)");
  dst.emu_touch(((blocks - 1) * p.dstNzC0Stride * detail::kC0 + uint64_t(p.nValue) * detail::kC0) * sizeof(T), true);
  T* d = dst.data();
  const T* g = src.GetPhyAddr();
  for (uint64_t r = 0; r < p.nValue; ++r) detail::gm_touch(g + r * p.srcDValue, uint64_t(p.dValue) * sizeof(T), false);
  if (ascend_emu::timeline::skip_compute()) return;  // timing-only recording (timeline.h)
  for (uint64_t r = 0; r < p.nValue; ++r)
    for (uint64_t c = 0; c < p.dValue; ++c)
      d[((c / detail::kC0) * p.dstNzC0Stride + r) * detail::kC0 + c % detail::kC0] = g[r * p.srcDValue + c];
}

struct LoadData2DParams {
  uint16_t startIndex = 0;  // first source fractal (512-byte units from the source tensor's start)
  uint8_t repeatTimes = 0;  // fractals moved
  uint16_t srcStride = 0;   // fractals between consecutive source fractals
  uint8_t sid = 0;
  uint16_t dstGap = 0;      // fractals skipped between consecutive destination fractals
  bool ifTranspose = false; // transpose each 16 x 16 fractal
  uint8_t addrMode = 0;
};

// L1 (A1/B1) -> L0A (A2) / L0B (B2), whole fractals.
template <typename T>
void LoadData(const LocalTensor<T>& dst, const LocalTensor<T>& src, const LoadData2DParams& p) {
  detail::cube_input_type<T>("LoadData");
  if (p.repeatTimes == 0) fail("LoadData with repeatTimes = 0");
  if (p.srcStride == 0 && p.repeatTimes > 1) fail("LoadData: srcStride 0 would read one fractal repeatedly");
  const uint64_t lastSrc = uint64_t(p.startIndex) + uint64_t(p.repeatTimes - 1) * p.srcStride;
  src.need_in((lastSrc + 1) * detail::kFrac, "LoadData source", ascend_emu::kL1, ascend_emu::kL1, 32);
  dst.need_in((uint64_t(p.repeatTimes - 1) * (1 + p.dstGap) + 1) * detail::kFrac, "LoadData destination",
              ascend_emu::kL0A, ascend_emu::kL0B, 512);
  detail::issue(PIPE_MTE1, "LoadData (L1->L0)");
  src.emu_touch((lastSrc + 1 - p.startIndex) * detail::kFrac * sizeof(T), false, uint64_t(p.startIndex) * detail::kFrac * sizeof(T));
  dst.emu_touch((uint64_t(p.repeatTimes - 1) * (1 + p.dstGap) + 1) * detail::kFrac * sizeof(T), true);
  if (ascend_emu::timeline::skip_compute()) return;  // timing-only recording (timeline.h)
  const T* s = src.data();
  T* d = dst.data();
  for (uint64_t i = 0; i < p.repeatTimes; ++i) {
    const T* f = s + (p.startIndex + i * p.srcStride) * detail::kFrac;
    T* o = d + i * (1 + p.dstGap) * detail::kFrac;
    for (uint64_t r = 0; r < 16; ++r)
      for (uint64_t c = 0; c < 16; ++c) o[r * 16 + c] = p.ifTranspose ? f[c * 16 + r] : f[r * 16 + c];
  }
}

template <typename U>
struct InitConstValueParams {
  uint16_t repeatTimes = 0;
  uint16_t blockNum = 0;  // blocks per repeat: 32 B on L1 (A1/B1), 512 B on L0A/L0B (A2/B2)
  uint16_t dstGap = 0;    // blocks (same unit) skipped after each repeat
  U initValue = U(0);
};

template <typename T, typename U>
void InitConstValue(const LocalTensor<T>& dst, const InitConstValueParams<U>& p) {
  detail::cube_input_type<T>("InitConstValue");
  if (p.repeatTimes == 0 || p.blockNum == 0) fail("InitConstValue with repeatTimes or blockNum = 0");
  // A2 rule (API reference, InitConstValue): blockNum / dstGap count 32-byte blocks on L1 but 512-byte
  // fractals on L0A/L0B. The L0 fill runs on PIPE_MTE1, the L1 fill on PIPE_MTE2 (a sync is needed
  // before the Mmad / LoadData that reads it); the pipe model issues it there.
  const int s = dst.space();
  const uint64_t unit = s == ascend_emu::kL1 ? 32 : 512;
  const AscendC::pipe_t fillPipe = s == ascend_emu::kL1 ? PIPE_MTE2 : PIPE_MTE1;
  (void)fillPipe;
  const uint64_t per = unit / sizeof(T);
  const uint64_t n = (uint64_t(p.repeatTimes - 1) * (p.blockNum + p.dstGap) + p.blockNum) * per;
  dst.live("InitConstValue");
  if (n > dst.GetSize()) {
    std::ostringstream o;
    o << "InitConstValue overrun: " << p.repeatTimes << " x " << p.blockNum << " blocks of " << unit << " B on "
      << ascend_emu::space_name(s) << " (" << (s == ascend_emu::kL1 ? "32 B per block on L1" : "512 B per block on L0A/L0B")
      << ") = " << n * sizeof(T) << " B, but the tensor of " << dst.slot()->owner << " holds " << dst.GetSize() * sizeof(T) << " B";
    fail(o.str());
  }
  dst.need_in(n, "InitConstValue", s == ascend_emu::kL1 ? ascend_emu::kL1 : ascend_emu::kL0A,
              s == ascend_emu::kL1 ? ascend_emu::kL1 : ascend_emu::kL0B, s == ascend_emu::kL1 ? 32 : 512);
  // pipe: MTE1 on L0A/L0B, MTE2 on L1 (A2)
  detail::issue(s == ascend_emu::kL1 ? PIPE_MTE2 : PIPE_MTE1,
                s == ascend_emu::kL1 ? "InitConstValue (L1)" : "InitConstValue (L0A/L0B)");
  dst.emu_touch(n * sizeof(T), true);
  T* d = dst.data();
  const T v = static_cast<T>(static_cast<float>(p.initValue));
  for (uint64_t r = 0; r < p.repeatTimes; ++r)
    for (uint64_t i = 0; i < p.blockNum * per; ++i) d[r * (p.blockNum + p.dstGap) * per + i] = v;
}

struct MmadParams {
  uint16_t m = 0;
  uint16_t n = 0;
  uint16_t k = 0;
  bool isBias = false;
  int32_t fmOffset = 0;
  bool enSsparse = false;
  bool enWinogradA = false;
  bool enWinogradB = false;
  uint8_t unitFlag = 0;
  bool cmatrixInitVal = true;  // true: C = A * B; false: C += A * B (cmatrixSource false: from L0C)
  bool cmatrixSource = false;
};

template <typename D, typename A, typename B>
void Mmad(const LocalTensor<D>& c, const LocalTensor<A>& a, const LocalTensor<B>& b, const MmadParams& p) {
  constexpr bool ok = std::is_same_v<D, float> && std::is_same_v<A, B> &&
                      (std::is_same_v<A, half> || std::is_same_v<A, bfloat16_t>);
  if constexpr (!ok) {
    fail(std::string("Mmad on (") + type_name<A>() + ", " + type_name<B>() + ") -> " + type_name<D>() +
         ": the emulated Cube takes (half, half) or (bfloat16_t, bfloat16_t) inputs with float accumulation in L0C");
  } else {
    if (p.m == 0 || p.n == 0 || p.k == 0 || p.m > 4095 || p.n > 4095 || p.k > 4095)
      fail("Mmad: m, n, k must be in [1, 4095], got m=" + std::to_string(p.m) + " n=" + std::to_string(p.n) +
           " k=" + std::to_string(p.k));
    if (p.isBias || p.cmatrixSource) fail("Mmad: bias / BT-buffer initial values are not in the emulated subset");
    const uint64_t M16 = detail::up16(p.m), N16 = detail::up16(p.n), K16 = detail::up16(p.k);
    const uint64_t Mf = M16 / 16, Nf = N16 / 16, Kf = K16 / 16;
    a.need_in(M16 * K16, "Mmad left matrix (L0A)", ascend_emu::kL0A, ascend_emu::kL0A, 512);
    b.need_in(K16 * N16, "Mmad right matrix (L0B)", ascend_emu::kL0B, ascend_emu::kL0B, 512);
    // A2 rule: the Mmad destination in L0C starts 1024-byte aligned.
    c.need_in(M16 * N16, "Mmad result (L0C)", ascend_emu::kL0C, ascend_emu::kL0C, 1024);
    // A2 rule (API reference, Mmad / GEMV): m == 1 switches the Cube to GEMV, which reads L0A as ONE
    // row of k contiguous elements (ND), not as zZ fractals; A2 cannot turn it off. A kernel that
    // loaded a zZ tile and asks for m = 1 gets what the hardware computes from that memory.
    const bool gemv = p.m == 1;
    detail::issue(PIPE_M, "Mmad");
    a.emu_touch(M16 * K16 * sizeof(A), false);
    b.emu_touch(K16 * N16 * sizeof(B), false);
    if (!p.cmatrixInitVal) c.emu_touch(M16 * N16 * sizeof(D), false);
    c.emu_touch(M16 * N16 * sizeof(D), true);
    {
      const uint64_t lo = c.ub_addr() - c.slot()->offset;
      ascend_emu::ctx().model.mmad(c.slot().get(), c.slot()->owner, lo, lo + M16 * N16 * sizeof(D), !p.cmatrixInitVal,
                                   p.m, p.n);
    }
    if (auto* tl = ascend_emu::ctx().model.tl()) tl->mmad(M16 * N16 * K16, 2ull * p.m * p.n * p.k);
    if (ascend_emu::timeline::skip_compute()) return;  // timing-only recording (timeline.h)
    const A* pa = a.data();
    const B* pb = b.data();
    float* pc = c.data();
    std::vector<float> bt(K16 * N16);  // B as [k][n] floats
    for (uint64_t kk = 0; kk < K16; ++kk)
      for (uint64_t j = 0; j < N16; ++j)
        bt[kk * N16 + j] = static_cast<float>(pb[((kk / 16) * Nf + j / 16) * 256 + (j % 16) * 16 + kk % 16]);
    std::vector<float> arow(K16);
    for (uint64_t i = 0; i < p.m; ++i) {
      for (uint64_t kk = 0; kk < K16; ++kk)
        arow[kk] = gemv ? static_cast<float>(pa[kk])
                        : static_cast<float>(pa[((i / 16) * Kf + kk / 16) * 256 + (i % 16) * 16 + kk % 16]);
      for (uint64_t j = 0; j < p.n; ++j) {
        float* out = pc + ((j / 16) * Mf + i / 16) * 256 + (i % 16) * 16 + j % 16;
        float acc = p.cmatrixInitVal ? 0.0f : *out;
        for (uint64_t kk = 0; kk < K16; ++kk) acc += arow[kk] * bt[kk * N16 + j];
        *out = acc;
      }
    }
  }
}

enum class QuantMode_t { NoQuant, F322F16, F322BF16 };

struct FixpipeParamsV220 {
  uint16_t nSize = 0;       // columns moved
  uint16_t mSize = 0;       // rows moved
  uint16_t srcStride = 0;   // rows (16-element C0 rows) between column blocks of the NZ source
  uint32_t dstStride = 0;   // elements between rows of the ND destination
  QuantMode_t quantPre = QuantMode_t::NoQuant;
  uint64_t deqScalar = 0;
  uint16_t ndNum = 1;
  uint16_t srcNdStride = 0;
  uint16_t dstNdStride = 0;
  bool reluEn = false;
  uint8_t unitFlag = 0;
};

// L0C (CO1, NZ, float) -> GM (ND, row-major), with the cast of quantPre.
template <typename D, typename S>
void Fixpipe(const GlobalTensor<D>& dst, const LocalTensor<S>& src, const FixpipeParamsV220& p) {
  static_assert(std::is_same_v<S, float>, "emulator: Fixpipe from a float L0C only");
  constexpr QuantMode_t want = std::is_same_v<D, half> ? QuantMode_t::F322F16
                               : std::is_same_v<D, bfloat16_t> ? QuantMode_t::F322BF16 : QuantMode_t::NoQuant;
  if constexpr (!(std::is_same_v<D, float> || std::is_same_v<D, half> || std::is_same_v<D, bfloat16_t>)) {
    fail(std::string("Fixpipe to ") + type_name<D>() + " is not in the emulated subset");
  } else {
    if (p.quantPre != want)
      fail(std::string("Fixpipe float -> ") + type_name<D>() + ": quantPre does not match the destination type");
    if (p.reluEn || p.ndNum != 1) fail("Fixpipe: reluEn / ndNum != 1 are not in the emulated subset");
    if (p.mSize == 0 || p.nSize == 0) fail("Fixpipe: mSize and nSize must be >= 1");
    if (p.srcStride % 16 || p.srcStride < p.mSize)
      fail("Fixpipe: srcStride " + std::to_string(p.srcStride) + " must be a multiple of 16 and >= mSize " + std::to_string(p.mSize));
    if (p.dstStride < p.nSize) fail("Fixpipe: dstStride < nSize (destination rows overlap)");
    const uint64_t blocks = (p.nSize + 15) / 16;
    src.need_in((blocks - 1) * p.srcStride * 16 + detail::up16(p.mSize) * 16, "Fixpipe source (L0C)", ascend_emu::kL0C,
                ascend_emu::kL0C, 64);
    dst.check(0, uint64_t(p.mSize - 1) * p.dstStride + p.nSize, "Fixpipe (L0C->GM)");
    detail::issue(PIPE_FIX, "Fixpipe (L0C->GM)");
    src.emu_touch(((blocks - 1) * p.srcStride * 16 + detail::up16(p.mSize) * 16) * sizeof(S), false);
    const float* s = src.data();
    D* d = dst.GetPhyAddr();
    for (uint64_t i = 0; i < p.mSize; ++i) detail::gm_touch(d + i * p.dstStride, p.nSize * sizeof(D), true);
    if (ascend_emu::timeline::skip_compute()) return;  // timing-only recording (timeline.h)
    for (uint64_t i = 0; i < p.mSize; ++i) ascend_emu::dc_dma_write(ascend_emu::core_id(), d + i * p.dstStride, p.nSize * sizeof(D));
    const bool atomic = ascend_emu::gm_atomic() != ascend_emu::AtomicKind::kNone;
    for (uint64_t i = 0; i < p.mSize; ++i)
      for (uint64_t j = 0; j < p.nSize; ++j) {
        const D v = static_cast<D>(s[((j / 16) * p.srcStride + i) * 16 + j % 16]);
        if (atomic) detail::gm_store(d + i * p.dstStride + j, &v, sizeof(D), "Fixpipe (L0C->GM)");
        else d[i * p.dstStride + j] = v;
      }
  }
}

}  // namespace AscendC

namespace ascend_emu {

// The first buffer of a block's pipe still allocated, queued or dequeued when the block ends (every
// AllocTensor needs a FreeTensor), or nullptr.
inline const Slot* leaked_slot(const PipeState& p) {
  for (auto& s : p.slots)
    if (s->state == SlotState::kAllocated || s->state == SlotState::kQueued || s->state == SlotState::kDequeued)
      return s.get();
  return nullptr;
}

// The kernel's name for the pipe model's messages: kernel_label_override() when a caller set one,
// else the exported symbol of a kernel function (dladdr), else "an unnamed kernel".
template <typename F>
std::string kernel_label(const F& f) {
  if (!current_kernel().empty()) return current_kernel();
  if (!kernel_label_override().empty()) return kernel_label_override();
  if constexpr (std::is_function_v<F>) {
    Dl_info info;
    if (dladdr(reinterpret_cast<void*>(&f), &info) && info.dli_sname) return info.dli_sname;
  } else if constexpr (std::is_pointer_v<F> && std::is_function_v<std::remove_pointer_t<F>>) {
    Dl_info info;
    if (f && dladdr(reinterpret_cast<void*>(f), &info) && info.dli_sname) return info.dli_sname;
  }
  return "an unnamed kernel";
}

// Start block `idx` of `num` on this thread's core context: an AIV block gets a UB of `ubCapacity`
// bytes and no Cube memories, an AIC block the Cube memories `cap` (by space) and no UB, all filled
// with 0xFF; a fresh pipe and pipe model, the GM model told which core runs.
inline void begin_block(BlockContext& c, uint32_t idx, uint32_t num, bool aic, uint64_t ubCapacity,
                        const uint64_t (&cap)[kNumSpaces], bool pipesOn, const std::string& label) {
  c.blockIdx = idx;
  c.blockNum = num;
  c.aic = aic;
  c.ubCapacity = aic ? 0 : ubCapacity;
  c.ub.assign(aic ? 0 : ubCapacity, 0xFF);
  for (int s = 1; s < kNumSpaces; ++s) {
    c.cap[s] = aic ? cap[s] : 0;
    c.mem[s].assign(aic ? cap[s] : 0, 0xFF);
  }
  c.pipe.reset();
  c.active = true;
  c.model.reset(pipesOn, !aic, idx, label);
  gm_begin_block(core_id());
}

// End of a block's kernel: the data cache model's end of block, then every queue tensor must have
// been freed (`who` names the block in the error).
inline void end_block(BlockContext& c, const std::string& who) {
  dc_end_block(core_id());
  if (!c.pipe) return;
  if (const Slot* s = leaked_slot(*c.pipe))
    fail(who + " ended with " + s->owner + " still " + state_name(s->state) + " (every AllocTensor needs a FreeTensor)");
}

// Run `kernel(args...)` once per block, blocks one after another, each with a fresh UB of
// `ubCapacity` bytes filled with 0xFF; then check that the block freed every queue tensor.
// Returns the most UB any block allocated (the host compares it with the tiling's UB plan).
template <typename F, typename... Args>
uint64_t launch(uint32_t blockDim, uint64_t ubCapacity, F&& kernel, Args... args) {
  uint64_t peak = 0;
  if (blockDim == 0) fail("launch with blockDim = 0");
  const bool pipesOn = pipes_enabled();
  const std::string name = kernel_label(kernel);
  timeline::launch_begin(name, "vector", blockDim);
  auto& c = ctx();
  if (c.active) fail("nested kernel launch");
  struct Reset {
    ~Reset() {
      ctx().active = false;
      ctx().pipe.reset();
      current_kernel().clear();
    }
  } reset;
  const uint64_t noCube[kNumSpaces] = {};
  dc_begin_launch();
  gm_begin_launch(pipesOn);
  for (uint32_t b = 0; b < blockDim; ++b) {
    begin_block(c, b, blockDim, false, ubCapacity, noCube, pipesOn, name);
    kernel(args...);
    end_block(c, "block " + std::to_string(b));
    if (c.pipe) peak = c.pipe->used > peak ? c.pipe->used : peak;
    c.active = false;
  }
  return peak;
}

// Memory sizes of an AIC core for launch_cube, and what a block allocated of each.
struct CubeMem {
  uint64_t l1 = 0, l0a = 0, l0b = 0, l0c = 0;
  // each memory: the larger of this and what `p` allocated of it
  void take_max(const PipeState& p) {
    auto mx = [](uint64_t& a, uint64_t v) { a = v > a ? v : a; };
    mx(l1, p.usedSpace[kL1]);
    mx(l0a, p.usedSpace[kL0A]);
    mx(l0b, p.usedSpace[kL0B]);
    mx(l0c, p.usedSpace[kL0C]);
  }
};

// Run an AIC-only (Cube) kernel once per block, blocks one after another. Each block gets fresh L1,
// L0A, L0B, L0C of the given sizes filled with 0xFF and no UB. Returns the most of each memory any
// block allocated.
template <typename F, typename... Args>
CubeMem launch_cube(uint32_t blockDim, CubeMem caps, F&& kernel, Args... args) {
  CubeMem peak;
  if (blockDim == 0) fail("launch with blockDim = 0");
  const bool pipesOn = pipes_enabled();
  const std::string name = kernel_label(kernel);
  timeline::launch_begin(name, "cube", blockDim);
  auto& c = ctx();
  if (c.active) fail("nested kernel launch");
  struct Reset {
    ~Reset() {
      ctx().active = false;
      ctx().aic = false;
      ctx().pipe.reset();
      current_kernel().clear();
      for (auto& m : ctx().mem) std::vector<uint8_t>().swap(m);
    }
  } reset;
  const uint64_t cap[kNumSpaces] = {0, caps.l1, caps.l0a, caps.l0b, caps.l0c};
  dc_begin_launch();
  gm_begin_launch(pipesOn);
  for (uint32_t b = 0; b < blockDim; ++b) {
    begin_block(c, b, blockDim, true, 0, cap, pipesOn, name);
    kernel(args...);
    end_block(c, "block " + std::to_string(b));
    if (c.pipe) peak.take_max(*c.pipe);
    c.active = false;
  }
  return peak;
}

// What a mixed launch's blocks allocated at most: Cube memories (AIC) and UB (AIV).
struct MixMem {
  CubeMem cube;
  uint64_t ub = 0;
};

// Run a mixed kernel (KERNEL_TYPE_MIX_AIC_1_2) on `groups` AI Cores: per group one AIC block (Cube
// memories `caps`, no UB) and two AIV blocks (UB of `ubCapacity` bytes) as three threads sharing the
// group's cross-core flags, one running at a time (MixGroup's scheduler); groups one after another.
template <typename F, typename... Args>
MixMem launch_mix(uint32_t groups, uint64_t ubCapacity, CubeMem caps, F&& kernel, Args... args) {
  if (groups == 0) fail("launch with blockDim = 0");
  if (ctx().active) fail("nested kernel launch");
  MixMem peak;
  const uint64_t cap[kNumSpaces] = {0, caps.l1, caps.l0a, caps.l0b, caps.l0c};
  struct ResetName {
    ~ResetName() { current_kernel().clear(); }
  } resetName;
  dc_begin_launch();
  const bool pipesOn = pipes_enabled();
  gm_begin_launch(pipesOn);
  const std::string name = kernel_label(kernel);
  timeline::launch_begin(name, "mix", groups);
  for (uint32_t grp = 0; grp < groups; ++grp) {
    MixGroup g;
    std::mutex peakMu;
    const char* sched = std::getenv("ASCEND_MOE_OPS_EMU_MIX_SCHEDULE");
    g.switchOnSet = sched && std::string(sched) == "switch";
    auto body = [&](bool aic, uint32_t sub) {
      const int me = aic ? 0 : 1 + static_cast<int>(sub);
      {
        std::unique_lock<std::mutex> lk(g.m);
        g.cv.wait(lk, [&] { return g.turn == me || g.abort; });
        if (g.abort) {
          g.done[me] = true;
          return;
        }
      }
      auto& c = ctx();
      c.sub = sub;
      c.mix = &g;
      begin_block(c, aic ? grp : 2 * grp + sub, groups, aic, ubCapacity, cap, pipesOn,
                  name + (aic ? " (AIC)" : " (AIV)"));
      try {
        kernel(args...);
        end_block(c, std::string(aic ? "AIC" : "AIV") + " block");
        std::lock_guard<std::mutex> lk(peakMu);
        if (c.pipe) {
          if (aic)
            peak.cube.take_max(*c.pipe);
          else
            peak.ub = c.pipe->used > peak.ub ? c.pipe->used : peak.ub;
        }
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lk(g.m);
        if (!g.abort) {
          g.abort = true;
          g.error = e.what();
        }
        g.cv.notify_all();
      }
      c.active = false;
      c.mix = nullptr;
      c.pipe.reset();
      std::lock_guard<std::mutex> lk(g.m);
      g.done[me] = true;
      if (!g.abort && !(g.done[0] && g.done[1] && g.done[2]) && !g.pass(me)) {
        g.abort = true;
        g.error = "deadlock: every live block of the AI Core group waits on a cross-core flag nobody will set";
      }
      g.cv.notify_all();
    };
    std::thread a(body, true, 0u), v0(body, false, 0u), v1(body, false, 1u);
    a.join();
    v0.join();
    v1.join();
    if (g.abort) throw EmuError("AI Core group " + std::to_string(grp) + ": " + g.error);
    for (int f = 0; f < MixGroup::kFlags; ++f)
      if (g.aic[f] || g.aiv[0][f] || g.aiv[1][f] || g.fromAiv[0][f] || g.fromAiv[1][f])
        fail("AI Core group " + std::to_string(grp) + ": cross-core flag " + std::to_string(f) +
             " was set but never waited for");
  }
  return peak;
}

}  // namespace ascend_emu
