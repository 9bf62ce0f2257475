// Tiny kernels for the emulator's per-core pipe model (csrc/ascend/emu/pipe_model.h): each "bad_*"
// case breaks one ordering rule and must be caught, its "ok_*" twin is the corrected kernel and must
// run clean (tests/test_ascend_emu_pipes.py). Usage: emu_pipes_driver <case>; prints
// "EmuError: <message>" or "ok".
#include <cstdio>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "emu/kernel_operator_emu.h"
#include "emu_case_main.h"

using namespace AscendC;

static std::vector<float> g_in(4096, 1.0f), g_out(4096, 0.0f);
static std::vector<half> g_h(64 * 64, half(1.0f)), g_c(64 * 64);

template <typename T>
static GlobalTensor<T> gt(std::vector<T>& v) {
  GlobalTensor<T> g;
  g.SetGlobalBuffer(v.data(), v.size());
  return g;
}

// ---- vector (AIV) side ------------------------------------------------------------------------------
// One UB row reused for two loads: MTE2 writes, V reads, MTE2 writes again.
static void reload(bool v_mte2) {
  TPipe pipe;
  TBuf<TPosition::VECCALC> b;
  pipe.InitBuffer(b, 256);
  auto t = b.Get<float>();
  DataCopy(t, gt(g_in), 64);
  SetFlag<HardEvent::MTE2_V>(EVENT_ID0);
  WaitFlag<HardEvent::MTE2_V>(EVENT_ID0);
  Muls(t, t, 2.0f, 64);
  if (v_mte2) {  // the vector unit's read completes before the row is overwritten
    SetFlag<HardEvent::V_MTE2>(EVENT_ID1);
    WaitFlag<HardEvent::V_MTE2>(EVENT_ID1);
  }
  DataCopy(t, gt(g_in), 64);
  SetFlag<HardEvent::MTE2_V>(EVENT_ID0);
  WaitFlag<HardEvent::MTE2_V>(EVENT_ID0);
  Muls(t, t, 2.0f, 64);
}

// A load then a vector op on it, with or without the MTE2 -> V sync.
static void load_then_compute(bool mte2_v) {
  TPipe pipe;
  TBuf<TPosition::VECCALC> b;
  pipe.InitBuffer(b, 256);
  auto t = b.Get<float>();
  DataCopy(t, gt(g_in), 64);
  if (mte2_v) {
    SetFlag<HardEvent::MTE2_V>(EVENT_ID0);
    WaitFlag<HardEvent::MTE2_V>(EVENT_ID0);
  }
  Adds(t, t, 1.0f, 64);
}

// Double buffering in one TBuf: half 0 loaded and synced, half 1 loaded (the next head) while V adds
// half 0 (fine), or while V adds half 1 (a race: nothing orders that load before the read).
static void prefetch_other_half(bool read_loaded_half) {
  TPipe pipe;
  TBuf<TPosition::VECCALC> s, b;
  pipe.InitBuffer(s, 256);
  pipe.InitBuffer(b, 512);
  auto sum = s.Get<float>(), rows = b.Get<float>();
  DataCopy(sum, gt(g_in), 64);
  DataCopy(rows, gt(g_in)[64], 64);
  SetFlag<HardEvent::MTE2_V>(EVENT_ID0);
  WaitFlag<HardEvent::MTE2_V>(EVENT_ID0);
  DataCopy(rows[64], gt(g_in)[128], 64);
  Add(sum, sum, rows[read_loaded_half ? 64 : 0], 64);
  SetFlag<HardEvent::MTE2_V>(EVENT_ID0);
  WaitFlag<HardEvent::MTE2_V>(EVENT_ID0);
}

// A row stored (MTE3 reads it) and then reloaded (MTE2 overwrites it).
static void store_then_reload(bool mte3_mte2) {
  TPipe pipe;
  TBuf<TPosition::VECCALC> b;
  pipe.InitBuffer(b, 256);
  auto t = b.Get<float>();
  Duplicate(t, 3.0f, 64);
  SetFlag<HardEvent::V_MTE3>(EVENT_ID0);  // V -> MTE3: not in the documented auto-sync set
  WaitFlag<HardEvent::V_MTE3>(EVENT_ID0);
  DataCopy(gt(g_out), t, 64);
  if (mte3_mte2) {
    SetFlag<HardEvent::MTE3_MTE2>(EVENT_ID0);
    WaitFlag<HardEvent::MTE3_MTE2>(EVENT_ID0);
  }
  DataCopy(t, gt(g_in), 64);
}

// A row written to GM (MTE3) and read back from the same GM bytes (MTE2) into another UB buffer:
// auto-sync does not insert MTE3 -> MTE2, so the load may read GM before the store landed.
static void gm_store_then_load(bool mte3_mte2) {
  TPipe pipe;
  TBuf<TPosition::VECCALC> a, b;
  pipe.InitBuffer(a, 256);
  pipe.InitBuffer(b, 256);
  auto ta = a.Get<float>();
  auto tb = b.Get<float>();
  Duplicate(ta, 3.0f, 64);
  SetFlag<HardEvent::V_MTE3>(EVENT_ID0);
  WaitFlag<HardEvent::V_MTE3>(EVENT_ID0);
  DataCopy(gt(g_out)[32], ta, 64);  // GM floats [32, 96)
  if (mte3_mte2) {
    SetFlag<HardEvent::MTE3_MTE2>(EVENT_ID0);
    WaitFlag<HardEvent::MTE3_MTE2>(EVENT_ID0);
  }
  DataCopy(tb, gt(g_out), 64);  // GM floats [0, 64): overlaps [32, 64)
}

// ---- Cube (AIC) side ---------------------------------------------------------------------------------
// 16 x 16 x 16 tile on TBufs (no queues: every hand-over is an explicit flag when `sync`).
struct CubeTile {
  TPipe pipe;
  TBuf<TPosition::A1> a1b;
  TBuf<TPosition::A2> a2b;
  TBuf<TPosition::B2> b2b;
  TBuf<TPosition::CO1> cb;
  LocalTensor<half> a1, a2, b2;
  LocalTensor<float> c;
  CubeTile() {
    pipe.InitBuffer(a1b, 64 * 64 * 2);
    pipe.InitBuffer(a2b, 64 * 64 * 2);
    pipe.InitBuffer(b2b, 64 * 64 * 2);
    pipe.InitBuffer(cb, 64 * 64 * 4);
    a1 = a1b.Get<half>();
    a2 = a2b.Get<half>();
    b2 = b2b.Get<half>();
    c = cb.Get<float>();
  }
  void nd2nz(uint16_t rows, uint16_t cols) {
    Nd2NzParams p;
    p.nValue = rows;
    p.dValue = cols;
    p.srcDValue = 64;
    p.dstNzC0Stride = rows;
    DataCopy(a1, gt(g_h), p);
  }
  void fill(const LocalTensor<half>& t, uint16_t blocks) {
    InitConstValueParams<half> z;
    z.repeatTimes = 1;
    z.blockNum = blocks;
    z.initValue = half(1.0f);
    InitConstValue(t, z);
  }
  void load_a(uint8_t fractals) {
    LoadData2DParams l;
    l.repeatTimes = fractals;
    l.srcStride = 1;
    LoadData(a2, a1, l);
  }
  void mmad(uint16_t m, uint16_t n, bool init) {
    MmadParams p;
    p.m = m;
    p.n = n;
    p.k = 16;
    p.cmatrixInitVal = init;
    Mmad(c, a2, b2, p);
  }
  void fix(uint16_t m, uint16_t n) {
    FixpipeParamsV220 f;
    f.nSize = n;
    f.mSize = m;
    f.srcStride = static_cast<uint16_t>((m + 15) / 16 * 16);
    f.dstStride = 64;
    f.quantPre = QuantMode_t::F322F16;
    Fixpipe(gt(g_c), c, f);
  }
};

// Full path GM -> L1 -> L0A -> Mmad -> GM; `broken` names the hand-over left without its flag.
static void cube_path(const std::string& broken) {
  CubeTile t;
  t.nd2nz(16, 16);
  if (broken != "MTE2_MTE1") {
    SetFlag<HardEvent::MTE2_MTE1>(EVENT_ID0);
    WaitFlag<HardEvent::MTE2_MTE1>(EVENT_ID0);
  }
  t.load_a(1);
  t.fill(t.b2, 16);  // L0B fill: PIPE_MTE1 (program order after the load)
  if (broken != "MTE1_M") {
    SetFlag<HardEvent::MTE1_M>(EVENT_ID0);
    WaitFlag<HardEvent::MTE1_M>(EVENT_ID0);
  }
  t.mmad(16, 16, true);
  if (broken != "M_FIX") {
    SetFlag<HardEvent::M_FIX>(EVENT_ID0);
    WaitFlag<HardEvent::M_FIX>(EVENT_ID0);
  }
  t.fix(16, 16);
  if (broken != "FIX_M") {
    SetFlag<HardEvent::FIX_M>(EVENT_ID0);
    WaitFlag<HardEvent::FIX_M>(EVENT_ID0);
  }
  t.mmad(16, 16, true);  // overwrites the L0C tile Fixpipe read
}

// L1 zero-fill (MTE2) and an ND -> NZ copy (MTE2) into the same L1 bytes.
static void l1_fill_then_copy(bool barrier) {
  CubeTile t;
  t.fill(t.a1, 32);
  if (barrier) PipeBarrier<PIPE_MTE2>();
  t.nd2nz(16, 16);
}

// Two Mmads accumulating into one L0C tile of m x n.
static void accumulate(uint16_t m, uint16_t n, bool barrier) {
  CubeTile t;  // (L0A/L0B hold NaN: the values do not matter here)
  t.mmad(m, n, true);
  if (barrier) PipeBarrier<PIPE_M>();
  t.mmad(m, n, false);
}

static std::map<std::string, std::function<void()>> vector_cases() {
  return {
      {"bad_v_mte2", [] { reload(false); }},
      {"ok_v_mte2", [] { reload(true); }},
      {"bad_mte2_v", [] { load_then_compute(false); }},
      {"ok_mte2_v", [] { load_then_compute(true); }},
      {"ok_prefetch_other_half", [] { prefetch_other_half(false); }},
      {"bad_prefetch_same_half", [] { prefetch_other_half(true); }},
      {"bad_mte3_mte2", [] { store_then_reload(false); }},
      {"ok_mte3_mte2", [] { store_then_reload(true); }},
      {"bad_gm_mte3_mte2", [] { gm_store_then_load(false); }},
      {"ok_gm_mte3_mte2", [] { gm_store_then_load(true); }},
      {"ok_pipe_all", [] {  // PipeBarrier<PIPE_ALL> orders everything before it
         TPipe pipe;
         TBuf<TPosition::VECCALC> b;
         pipe.InitBuffer(b, 256);
         auto t = b.Get<float>();
         Duplicate(t, 1.0f, 64);
         PipeBarrier<PIPE_ALL>();
         DataCopy(t, gt(g_in), 64);
         PipeBarrier<PIPE_ALL>();
         Muls(t, t, 2.0f, 64);
       }},
      {"ok_scalar_wait", [] {  // a WaitFlag<V_S> holds the scalar unit: later instructions start after V
         TPipe pipe;
         TBuf<TPosition::VECCALC> b;
         pipe.InitBuffer(b, 256);
         auto t = b.Get<float>();
         Duplicate(t, 1.0f, 64);
         SetFlag<HardEvent::V_S>(EVENT_ID0);
         WaitFlag<HardEvent::V_S>(EVENT_ID0);
         DataCopy(t, gt(g_in), 64);
       }},
      {"ok_queues", [] {  // VECIN / VECOUT queues carry MTE2 -> V, V -> MTE3 and the Free -> Alloc syncs
         TPipe pipe;
         TQue<TPosition::VECIN, 1> in;
         TQue<TPosition::VECOUT, 1> out;
         pipe.InitBuffer(in, 1, 256);
         pipe.InitBuffer(out, 1, 256);
         for (int i = 0; i < 3; ++i) {
           auto x = in.AllocTensor<float>();
           DataCopy(x, gt(g_in)[64 * i], 64);
           in.EnQue(x);
           x = in.DeQue<float>();
           auto y = out.AllocTensor<float>();
           Muls(y, x, 2.0f, 64);
           in.FreeTensor(x);
           out.EnQue(y);
           y = out.DeQue<float>();
           DataCopy(gt(g_out)[64 * i], y, 64);
           out.FreeTensor(y);
         }
       }},
      {"bad_tbuf_no_queue_sync", [] {  // the same loop on a TBuf: nothing orders the reload after the read
         TPipe pipe;
         TBuf<TPosition::VECCALC> in;
         TQue<TPosition::VECOUT, 1> out;
         pipe.InitBuffer(in, 256);
         pipe.InitBuffer(out, 1, 256);
         for (int i = 0; i < 2; ++i) {
           auto x = in.Get<float>();
           DataCopy(x, gt(g_in)[64 * i], 64);
           SetFlag<HardEvent::MTE2_V>(EVENT_ID0);
           WaitFlag<HardEvent::MTE2_V>(EVENT_ID0);
           auto y = out.AllocTensor<float>();
           Muls(y, x, 2.0f, 64);
           out.EnQue(y);
           y = out.DeQue<float>();
           DataCopy(gt(g_out)[64 * i], y, 64);
           out.FreeTensor(y);
         }
       }},
      {"bad_v_mte3_no_auto_sync", [] {  // S -> V is compiler-inserted on AIV; V -> MTE3 is not documented
         TPipe pipe;
         TBuf<TPosition::VECCALC> b;
         pipe.InitBuffer(b, 256);
         auto t = b.Get<float>();
         t.SetValue(0, 5.0f);
         Adds(t, t, 1.0f, 8);
         DataCopy(gt(g_out), t, 8);
       }},
      {"ok_auto_sync_scalar_side", [] {  // the twin: S -> V left to the compiler, V -> MTE3 written out
         TPipe pipe;
         TBuf<TPosition::VECCALC> b;
         pipe.InitBuffer(b, 256);
         auto t = b.Get<float>();
         t.SetValue(0, 5.0f);
         Adds(t, t, 1.0f, 8);
         SetFlag<HardEvent::V_MTE3>(EVENT_ID0);
         WaitFlag<HardEvent::V_MTE3>(EVENT_ID0);
         DataCopy(gt(g_out), t, 8);
       }},
      {"bad_wait_without_set", [] { WaitFlag<HardEvent::MTE2_V>(EVENT_ID0); }},
      {"bad_event_id", [] { SetFlag<HardEvent::V_MTE2>(8); }},
      {"ok_event_ids", [] {
         SetFlag<HardEvent::V_MTE2>(EVENT_ID7);
         WaitFlag<HardEvent::V_MTE2>(EVENT_ID7);
       }},
  };
}

static std::map<std::string, std::function<void()>> cube_cases() {
  return {
      {"ok_cube_path", [] { cube_path(""); }},
      {"bad_cube_mte2_mte1", [] { cube_path("MTE2_MTE1"); }},
      {"bad_cube_mte1_m", [] { cube_path("MTE1_M"); }},
      {"bad_cube_m_fix", [] { cube_path("M_FIX"); }},
      {"bad_cube_fix_m", [] { cube_path("FIX_M"); }},
      {"bad_l0_fill_mmad", [] {  // InitConstValue on L0A/L0B runs on MTE1: the Mmad needs MTE1 -> M
         CubeTile t;
         t.fill(t.a2, 1);
         t.fill(t.b2, 1);
         t.mmad(16, 16, true);
       }},
      {"ok_l0_fill_mmad", [] {
         CubeTile t;
         t.fill(t.a2, 1);
         t.fill(t.b2, 1);
         SetFlag<HardEvent::MTE1_M>(EVENT_ID0);
         WaitFlag<HardEvent::MTE1_M>(EVENT_ID0);
         t.mmad(16, 16, true);
       }},
      {"bad_l1_fill_nd2nz", [] { l1_fill_then_copy(false); }},
      {"ok_l1_fill_nd2nz", [] { l1_fill_then_copy(true); }},
      {"bad_pipe_m", [] { accumulate(32, 64, false); }},   // 2 x 4 = 8 < 10 fractals
      {"ok_pipe_m", [] { accumulate(32, 64, true); }},
      {"ok_pipe_m_large", [] { accumulate(64, 48, false); }},  // 4 x 3 = 12: no barrier needed
  };
}

int main(int argc, char** argv) {
  const auto outcome = emu_driver::run_case_by_name(argc, argv, [](const std::string& name) {
    ascend_emu::kernel_label_override() = name;
    auto vs = vector_cases();
    auto cs = cube_cases();
    if (vs.count(name)) {
      ascend_emu::launch(1, 184 * 1024, vs[name]);
    } else if (cs.count(name)) {
      ascend_emu::launch_cube(1, emu_driver::a2_cube_mem(), cs[name]);
    } else {
      return false;
    }
    return true;
  });
  if (outcome != emu_driver::kRan) return emu_driver::exit_code(outcome);
  std::printf("ok\n");
  return 0;
}
