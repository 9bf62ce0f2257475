// Tiny kernels for the A2 rules of issue 30 (tests/test_ascend_a2_rules.py): GM written by several
// cores in one launch (emu/gm_model.h), atomic accumulation, CrossCoreSetFlag's pipe, scalar access
// to UB positions only, and the tiling read through the data cache. Each rule has a case that breaks
// it (the emulator must raise EmuError naming the rule) and a corrected twin (runs clean, right result).
// Usage: emu_gm_rules_driver <case>; prints "EmuError: <message>" or the case's result line.
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <string>

#include "kernels/kernel_common.h"
#include "emu_case_main.h"

using namespace AscendC;

static std::string g_result = "ok";
alignas(64) static float g_f[1024];
alignas(64) static half g_h[64];
alignas(64) static float g_slot[256];

template <typename T>
static GlobalTensor<T> gt(T* p, uint64_t n) {
  GlobalTensor<T> g;
  g.SetGlobalBuffer(p, n);
  return g;
}
template <typename T>
static void dcci(const GlobalTensor<T>& g) {
  DataCacheCleanAndInvalid<T, CacheLine::SINGLE_CACHE_LINE, DcciDst::CACHELINE_OUT>(g);
}

// UB tensor of n floats set to v (queue-free: V -> MTE3 ordered by an explicit flag).
static void store_const(const GlobalTensor<float>& dst, TBuf<TPosition::VECCALC>& buf, float v, uint32_t n) {
  auto u = buf.Get<float>();
  Duplicate(u, v, static_cast<int32_t>(n));
  SetFlag<HardEvent::V_MTE3>(EVENT_ID0);
  WaitFlag<HardEvent::V_MTE3>(EVENT_ID0);
  DataCopy(dst, u, n);
}

// ---- rule: GM written by several cores (vector launches of 2 blocks) --------------------------------
static std::map<std::string, std::function<void()>> vec_cases() {
  return {
      {"gm_overlap_writes", [] {  // both blocks store g_f[0..8)
         TPipe pipe;
         TBuf<TPosition::VECCALC> buf;
         pipe.InitBuffer(buf, 32);
         store_const(gt(g_f, 1024), buf, 1.0f + GetBlockIdx(), 8);
       }},
      {"gm_tail_spill", [] {  // rows of 6 floats; a DataCopy rounded up to 8 floats spills into the next row
         TPipe pipe;
         TBuf<TPosition::VECCALC> buf;
         pipe.InitBuffer(buf, 32);
         store_const(gt(g_f, 1024)[6 * GetBlockIdx()], buf, 1.0f + GetBlockIdx(), 8);
       }},
      {"gm_tail_pad_ok", [] {  // the twin: DataCopyPad of exactly 24 bytes
         TPipe pipe;
         TBuf<TPosition::VECCALC> buf;
         pipe.InitBuffer(buf, 32);
         auto u = buf.Get<float>();
         Duplicate(u, 1.0f + GetBlockIdx(), 8);
         SetFlag<HardEvent::V_MTE3>(EVENT_ID0);
         WaitFlag<HardEvent::V_MTE3>(EVENT_ID0);
         DataCopyExtParams p{1, 6 * sizeof(float), 0, 0, 0};
         DataCopyPad(gt(g_f, 1024)[6 * GetBlockIdx()], u, p);
       }},
      {"gm_rmw", [] {  // each block: g_f[0..8) += 1 by load, add, store (a read-modify-write)
         TPipe pipe;
         TBuf<TPosition::VECCALC> buf;
         pipe.InitBuffer(buf, 32);
         auto u = buf.Get<float>();
         DataCopy(u, gt(g_f, 1024), 8);
         SetFlag<HardEvent::MTE2_V>(EVENT_ID0);
         WaitFlag<HardEvent::MTE2_V>(EVENT_ID0);
         Adds(u, u, 1.0f, 8);
         SetFlag<HardEvent::V_MTE3>(EVENT_ID0);
         WaitFlag<HardEvent::V_MTE3>(EVENT_ID0);
         DataCopy(gt(g_f, 1024), u, 8);
       }},
      {"gm_atomic_add_ok", [] {  // the twin: each block adds 1 with SetAtomicAdd<float>
         TPipe pipe;
         TBuf<TPosition::VECCALC> buf;
         pipe.InitBuffer(buf, 32);
         SetAtomicAdd<float>();
         store_const(gt(g_f, 1024), buf, 1.0f, 8);
         SetAtomicNone();
       }},
      {"gm_atomic_half", [] {  // each block adds 1 to 2048 in half: 2049 is not a half, ties to even
         TPipe pipe;
         TBuf<TPosition::VECCALC> buf;
         pipe.InitBuffer(buf, 32);
         auto u = buf.Get<half>();
         Duplicate(u, half(1.0f), 16);
         SetFlag<HardEvent::V_MTE3>(EVENT_ID0);
         WaitFlag<HardEvent::V_MTE3>(EVENT_ID0);
         SetAtomicAdd<half>();
         DataCopy(gt(g_h, 64), u, 16);
         SetAtomicNone();
       }},
      {"gm_atomic_mixed_types", [] {  // block 0 accumulates float, block 1 int32_t on the same bytes
         TPipe pipe;
         TBuf<TPosition::VECCALC> buf;
         pipe.InitBuffer(buf, 32);
         if (GetBlockIdx() == 0) SetAtomicAdd<float>();
         else SetAtomicAdd<int32_t>();
         store_const(gt(g_f, 1024), buf, 0.0f, 8);
         SetAtomicNone();
       }},
      {"gm_atomic_then_none", [] {  // after SetAtomicNone block 0's second store is a plain write
         TPipe pipe;
         TBuf<TPosition::VECCALC> buf;
         pipe.InitBuffer(buf, 32);
         SetAtomicAdd<float>();
         store_const(gt(g_f, 1024), buf, 1.0f, 8);
         SetAtomicNone();
         if (GetBlockIdx() == 0) {
           PipeBarrier<PIPE_MTE3>();              // the two stores of the same bytes
           SetFlag<HardEvent::MTE3_V>(EVENT_ID0);  // the UB tensor is rewritten after the store read it
           WaitFlag<HardEvent::MTE3_V>(EVENT_ID0);
           store_const(gt(g_f, 1024), buf, 5.0f, 8);
         }
       }},
      {"gm_scalar_race", [] {  // block 0 SetValue(0) (cleaned out), block 1 GetValue(0): unordered
         auto g = gt(g_f, 1024);
         dcci(g);
         if (GetBlockIdx() == 0) {
           g.SetValue(0, 3.0f);
           dcci(g);
         } else {
           g_result = std::to_string(static_cast<int>(g.GetValue(0)));
         }
       }},
      {"gm_scalar_own_lines_ok", [] {  // the twin: each block reads and writes its own line only
         auto g = gt(g_f, 1024)[16 * GetBlockIdx()];
         dcci(g);
         g.SetValue(0, g.GetValue(0) + 1.0f);
         dcci(g);
       }},
  };
}

// ---- rule: CrossCoreSetFlag honours its pipe (mixed launch, 1 AI Core) ---------------------------
// The AIC stores a 16 x 16 float tile of L0C to g_slot with Fixpipe and signals the AIVs, which read it.
// A 16 x 16 float tile of L0C (never computed: its contents do not matter here) to g_slot.
static void fixpipe_tile_to_slot() {
  TPipe pipe;
  TBuf<TPosition::CO1> c;
  pipe.InitBuffer(c, 16 * 16 * 4);
  FixpipeParamsV220 f;
  f.nSize = 16;
  f.mSize = 16;
  f.srcStride = 16;
  f.dstStride = 16;
  Fixpipe(gt(g_slot, 256), c.Get<float>(), f);
}
static void aic_store_then_set(bool onFix) {
  fixpipe_tile_to_slot();
  if (onFix) CrossCoreSetFlag<2, PIPE_FIX>(0);
  else CrossCoreSetFlag<2, PIPE_M>(0);  // PIPE_M has nothing to do with the Fixpipe store
}
static void aiv_wait_then_load() {
  CrossCoreWaitFlag(0);
  TPipe pipe;
  TBuf<TPosition::VECCALC> buf;
  pipe.InitBuffer(buf, 1024);
  DataCopy(buf.Get<float>(), gt(g_slot, 256)[128 * (GetBlockIdx() % 2)], 128);
}
// The AIVs load the slot (MTE2) and signal on PIPE_MTE3 with no store pending; the AIC then overwrites
// the slot (Fixpipe). With `order`, MTE3 first waits for MTE2 (SetFlag/WaitFlag<MTE2_MTE3>).
static void aiv_load_then_set(bool order) {
  TPipe pipe;
  TBuf<TPosition::VECCALC> buf;
  pipe.InitBuffer(buf, 1024);
  DataCopy(buf.Get<float>(), gt(g_slot, 256)[128 * (GetBlockIdx() % 2)], 128);
  if (order) {
    SetFlag<HardEvent::MTE2_MTE3>(EVENT_ID0);
    WaitFlag<HardEvent::MTE2_MTE3>(EVENT_ID0);
  }
  CrossCoreSetFlag<2, PIPE_MTE3>(1);
}
static void aic_wait_then_store() {
  CrossCoreWaitFlag(1);
  fixpipe_tile_to_slot();
}

static std::map<std::string, std::function<void()>> mix_cases() {
  return {
      {"xflag_fix_set_on_m", [] {
         if (g_coreType == AIC) aic_store_then_set(false);
         else aiv_wait_then_load();
       }},
      {"xflag_fix_set_on_fix_ok", [] {
         if (g_coreType == AIC) aic_store_then_set(true);
         else aiv_wait_then_load();
       }},
      {"xflag_pipe_s", [] {
         if (g_coreType == AIC) CrossCoreSetFlag<2, PIPE_S>(0);
         else CrossCoreWaitFlag(0);
       }},
      {"xflag_pipe_all", [] {
         if (g_coreType == AIV) CrossCoreSetFlag<2, PIPE_ALL>(0);
         else CrossCoreWaitFlag(0);
       }},
      {"xflag_mte3_no_store", [] {
         if (g_coreType == AIC) aic_wait_then_store();
         else aiv_load_then_set(false);
       }},
      {"xflag_mte3_after_mte2_ok", [] {
         if (g_coreType == AIC) aic_wait_then_store();
         else aiv_load_then_set(true);
       }},
  };
}

// ---- rule: scalar GetValue / SetValue on UB positions only (Cube launch) ---------------------------
static void scalar_on(TPosition pos) {
  TPipe pipe;
  TBuf<TPosition::CO1> c;
  TBuf<TPosition::A1> l1;
  pipe.InitBuffer(c, 16 * 16 * 4);
  pipe.InitBuffer(l1, 512);
  if (pos == TPosition::CO1) g_result = std::to_string(c.Get<float>().GetValue(0));
  else l1.Get<half>().SetValue(0, half(1.0f));
}

// ---- tiling read through the data cache at a reused address (two launches) ------------------------
struct TwoWords {
  uint32_t a, b;
};
alignas(64) static TwoWords g_tiling;
static void tiling_twice(bool copyTiling) {
  auto kernel = [copyTiling](GM_ADDR t) {
    TwoWords w{};
    if (copyTiling) {
      amo_ascend::kernels::CopyTiling(&w, t);
    } else {  // raw scalar reads, no invalidation
      auto g = gt(reinterpret_cast<uint32_t*>(t), 2);
      w.a = g.GetValue(0);
      w.b = g.GetValue(1);
    }
    g_result = std::to_string(w.a + w.b);
  };
  g_tiling = {1, 1};
  ascend_emu::set_kernel(copyTiling ? "tiling_copy_ok" : "tiling_raw_stale");
  ascend_emu::launch(1, 4096, kernel, reinterpret_cast<GM_ADDR>(&g_tiling));
  g_tiling = {2, 3};  // the host uploads the next step's tiling at the same address
  ascend_emu::set_kernel(copyTiling ? "tiling_copy_ok" : "tiling_raw_stale");
  ascend_emu::launch(1, 4096, kernel, reinterpret_cast<GM_ADDR>(&g_tiling));
}

int main(int argc, char** argv) {
  const auto outcome = emu_driver::run_case_by_name(argc, argv, [](const std::string& name) {
    auto vc = vec_cases();
    auto mc = mix_cases();
    const ascend_emu::CubeMem caps = emu_driver::a2_cube_mem();
    if (vc.count(name)) {
      for (auto& h : g_h) h = half(2048.0f);
      ascend_emu::set_kernel(name.c_str());
      ascend_emu::launch(2, 4096, vc[name]);
      if (name == "gm_tail_pad_ok") g_result = std::to_string(static_cast<int>(g_f[5])) + " " + std::to_string(static_cast<int>(g_f[6]));
      if (name == "gm_atomic_add_ok" || name == "gm_scalar_own_lines_ok")
        g_result = std::to_string(static_cast<int>(g_f[0])) + " " + std::to_string(static_cast<int>(g_f[16]));
      if (name == "gm_atomic_half") g_result = std::to_string(static_cast<int>(static_cast<float>(g_h[0])));
    } else if (mc.count(name)) {
      ascend_emu::set_kernel(name.c_str());
      ascend_emu::launch_mix(1, 8192, caps, mc[name]);
    } else if (name == "scalar_l0c_read" || name == "scalar_l1_write") {
      ascend_emu::set_kernel(name.c_str());
      ascend_emu::launch_cube(1, caps, [&] { scalar_on(name == "scalar_l0c_read" ? TPosition::CO1 : TPosition::A1); });
    } else if (name == "tiling_raw_stale" || name == "tiling_copy_ok") {
      tiling_twice(name == "tiling_copy_ok");
    } else {
      return false;
    }
    return true;
  });
  if (outcome != emu_driver::kRan) return emu_driver::exit_code(outcome);
  std::printf("%s\n", g_result.c_str());
  return 0;
}
