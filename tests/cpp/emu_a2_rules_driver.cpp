// Tiny kernels for the Atlas A2 rules of the AscendC emulation layer (tests/test_ascend_a2_rules.py):
// each rule has a case that breaks it (the emulator must raise EmuError naming the rule, or compute
// what the hardware computes) and a corrected twin (must run clean and give the right answer).
// Usage: emu_a2_rules_driver <case>; prints "EmuError: <message>" or the case's result line.
#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "emu/kernel_operator_emu.h"
#include "emu_case_main.h"

using namespace AscendC;

static std::string g_result = "ok";
alignas(64) static float g_f[1024];
alignas(64) static half g_a[64 * 64];
alignas(64) static half g_b[64 * 64];
alignas(64) static half g_c[64 * 64];

template <typename T>
static GlobalTensor<T> gt(T* p, uint64_t n) {
  GlobalTensor<T> g;
  g.SetGlobalBuffer(p, n);
  return g;
}

// Fixpipe of rows x cols floats of an NZ L0C tile (16-row aligned) to g_f, row-major, unconverted.
static GlobalTensor<float> fixpipe_to_gf(const LocalTensor<float>& c, uint16_t rows, uint16_t cols) {
  FixpipeParamsV220 f;
  f.nSize = cols;
  f.mSize = rows;
  f.srcStride = static_cast<uint16_t>((rows + 15) / 16 * 16);
  f.dstStride = cols;
  auto out = gt(g_f, 1024);
  Fixpipe(out, c, f);
  return out;
}

template <typename T>
static void dcci(const GlobalTensor<T>& g) {
  DataCacheCleanAndInvalid<T, CacheLine::SINGLE_CACHE_LINE, DcciDst::CACHELINE_OUT>(g);
}

// ---- rule 1: InitConstValue units (512 B on L0A/L0B, 32 B on L1) ---------------------------------
// The scalar unit cannot read L1/L0 (GetValue is for UB positions only), so the fill is checked the
// way the hardware can: the filled 32 x 32 tile times a tile of ones through the Cube, Fixpipe to GM,
// every element 0 (an unfilled element is 0xFFFF = NaN and spreads into its row of the product).
static void fill(TPosition pos, uint16_t blockNum) {
  TPipe pipe;
  TQue<TPosition::A1, 1> l1;
  TQue<TPosition::A2, 1> l0a;
  TQue<TPosition::B2, 1> l0b;
  TQue<TPosition::CO1, 1> l0c;
  pipe.InitBuffer(l1, 1, 32 * 32 * 2);
  pipe.InitBuffer(l0a, 1, 32 * 32 * 2);
  pipe.InitBuffer(l0b, 1, 32 * 32 * 2);
  pipe.InitBuffer(l0c, 1, 32 * 32 * 4);
  auto t1 = l1.AllocTensor<half>();
  auto ta = l0a.AllocTensor<half>();
  auto tb = l0b.AllocTensor<half>();
  auto tc = l0c.AllocTensor<float>();
  InitConstValueParams<half> z;
  z.repeatTimes = 1;
  z.blockNum = blockNum;
  InitConstValueParams<half> ones;  // the other Cube operand: 4 fractals of 1.0
  ones.repeatTimes = 1;
  ones.blockNum = 4;
  ones.initValue = half(1.0f);
  if (pos == TPosition::A1) {
    InitConstValue(t1, z);
    SetFlag<HardEvent::MTE2_MTE1>(EVENT_ID0);  // L1 fill (MTE2) -> LoadData (MTE1)
    WaitFlag<HardEvent::MTE2_MTE1>(EVENT_ID0);
    LoadData2DParams l;
    l.repeatTimes = 4;
    l.srcStride = 1;
    LoadData(ta, t1, l);
    InitConstValue(tb, ones);
  } else if (pos == TPosition::A2) {
    InitConstValue(ta, z);
    InitConstValue(tb, ones);
  } else {
    InitConstValue(ta, ones);
    InitConstValue(tb, z);
  }
  SetFlag<HardEvent::MTE1_M>(EVENT_ID0);  // L0A/L0B (MTE1) -> Mmad (M)
  WaitFlag<HardEvent::MTE1_M>(EVENT_ID0);
  MmadParams mm;
  mm.m = mm.n = mm.k = 32;
  Mmad(tc, ta, tb, mm);
  SetFlag<HardEvent::M_FIX>(EVENT_ID0);  // L0C (M) -> Fixpipe (FIX)
  WaitFlag<HardEvent::M_FIX>(EVENT_ID0);
  auto out = fixpipe_to_gf(tc, 32, 32);
  PipeBarrier<PIPE_ALL>();  // the Fixpipe store completes before the scalar reads of GM
  for (uint32_t i = 0; i < 32 * 32; ++i)
    if (out.GetValue(i) != 0.0f) g_result = "not zeroed";
  l1.FreeTensor(t1);
  l0a.FreeTensor(ta);
  l0b.FreeTensor(tb);
  l0c.FreeTensor(tc);
}

// ---- rule 2: Mmad with m = 1 is GEMV (L0A read as ND) ------------------------------------------------
// A (1 x 32 used of a 16 x 32 zZ tile) . B (32 x 16), all ones in B: C[0][j] = sum of A's row 0.
static void gemv_case(uint16_t m) {
  for (int i = 0; i < 64 * 64; ++i) g_a[i] = half(static_cast<float>(i % 7) - 3.0f);  // rows differ
  for (int i = 0; i < 64 * 64; ++i) g_b[i] = half(1.0f);
  TPipe pipe;
  TQue<TPosition::A1, 1> a1q;
  TQue<TPosition::B1, 1> b1q;
  TQue<TPosition::A2, 1> a2q;
  TQue<TPosition::B2, 1> b2q;
  TQue<TPosition::CO1, 1> cq;
  pipe.InitBuffer(a1q, 1, 16 * 32 * 2);
  pipe.InitBuffer(b1q, 1, 32 * 16 * 2);
  pipe.InitBuffer(a2q, 1, 16 * 32 * 2);
  pipe.InitBuffer(b2q, 1, 32 * 16 * 2);
  pipe.InitBuffer(cq, 1, 16 * 16 * 4);
  auto a1 = a1q.AllocTensor<half>();
  auto b1 = b1q.AllocTensor<half>();
  auto a2 = a2q.AllocTensor<half>();
  auto b2 = b2q.AllocTensor<half>();
  auto c = cq.AllocTensor<float>();
  InitConstValueParams<half> z;
  z.repeatTimes = 1;
  z.blockNum = 16 * 32 * 2 / 32;  // L1: 32-byte blocks
  InitConstValue(a1, z);
  PipeBarrier<PIPE_MTE2>();  // pipe model: the L1 fill and the ND2NZ copy both write L1 on MTE2
  Nd2NzParams p;  // A: 1 row x 32 (rows 1..15 of the tile stay zero)
  p.nValue = 1;
  p.dValue = 32;
  p.srcDValue = 64;
  p.dstNzC0Stride = 16;
  DataCopy(a1, gt(g_a, 64 * 64), p);
  p.nValue = 32;  // B: 32 x 16
  p.dValue = 16;
  p.dstNzC0Stride = 32;
  DataCopy(b1, gt(g_b, 64 * 64), p);
  SetFlag<HardEvent::MTE2_MTE1>(EVENT_ID0);  // pipe model: L1 (MTE2) -> LoadData (MTE1)
  WaitFlag<HardEvent::MTE2_MTE1>(EVENT_ID0);
  LoadData2DParams l;  // L0A zZ: the (0, 0) and (0, 1) fractals
  l.startIndex = 0;
  l.repeatTimes = 2;
  l.srcStride = 1;
  LoadData(a2, a1, l);
  l.ifTranspose = true;  // L0B zN
  LoadData(b2, b1, l);
  SetFlag<HardEvent::MTE1_M>(EVENT_ID0);  // pipe model: L0A/L0B (MTE1) -> Mmad (M)
  WaitFlag<HardEvent::MTE1_M>(EVENT_ID0);
  MmadParams mm;
  mm.m = m;
  mm.n = 16;
  mm.k = 32;
  Mmad(c, a2, b2, mm);
  SetFlag<HardEvent::M_FIX>(EVENT_ID0);  // pipe model: L0C (M) -> Fixpipe (FIX)
  WaitFlag<HardEvent::M_FIX>(EVENT_ID0);
  auto out = fixpipe_to_gf(c, 1, 16);  // row 0 of C to GM (the scalar unit cannot read L0C)
  PipeBarrier<PIPE_ALL>();  // pipe model: the Fixpipe store completes before the scalar read of GM
  float want = 0.0f;
  for (int kk = 0; kk < 32; ++kk) want += static_cast<float>(g_a[kk]);
  if (out.GetValue(0) != want) g_result = "wrong";
  a1q.FreeTensor(a1);
  b1q.FreeTensor(b1);
  a2q.FreeTensor(a2);
  b2q.FreeTensor(b2);
  cq.FreeTensor(c);
}

// ---- rule 7: Mmad destination 1024-byte aligned ---------------------------------------------------
static void mmad_dst(uint32_t offFloats) {
  TPipe pipe;
  TQue<TPosition::A2, 1> a;
  TQue<TPosition::B2, 1> b;
  TQue<TPosition::CO1, 1> c;
  pipe.InitBuffer(a, 1, 512);
  pipe.InitBuffer(b, 1, 512);
  pipe.InitBuffer(c, 1, 4096);
  auto ta = a.AllocTensor<half>();
  auto tb = b.AllocTensor<half>();
  auto tc = c.AllocTensor<float>();
  InitConstValueParams<half> z;
  z.repeatTimes = 1;
  z.blockNum = 1;  // one 512-byte fractal
  InitConstValue(ta, z);
  InitConstValue(tb, z);
  SetFlag<HardEvent::MTE1_M>(EVENT_ID0);  // pipe model: the L0 fills run on MTE1
  WaitFlag<HardEvent::MTE1_M>(EVENT_ID0);
  MmadParams m;
  m.m = m.n = m.k = 16;
  Mmad(tc[offFloats], ta, tb, m);
  a.FreeTensor(ta);
  b.FreeTensor(tb);
  c.FreeTensor(tc);
}

// ---- rule 7: ReduceMax work buffer ceil(2 * repeats / 8) * 8 floats -----------------------------------
static void reduce_max(uint32_t workFloats) {
  TPipe pipe;
  TBuf<TPosition::VECCALC> src, dst, work;
  pipe.InitBuffer(src, 512 * 4);
  pipe.InitBuffer(dst, 32);
  pipe.InitBuffer(work, workFloats * 4);
  auto s = src.Get<float>();
  for (int i = 0; i < 512; ++i) s.SetValue(i, static_cast<float>(i % 97));
  ReduceMax(dst.Get<float>(), s, work.Get<float>(), 512);  // 8 repeats: 16 floats of work
  if (dst.Get<float>().GetValue(0) != 96.0f) g_result = "wrong";
}

// ---- buffer counts of TPipe::InitBuffer: <= 8 queue buffers per TPosition, <= 64 buffers per kernel --
static void queue_buffers(uint8_t first, uint8_t second) {  // two L1 queues on TPosition::A1
  TPipe pipe;
  TQue<TPosition::A1, 1> a, b;
  pipe.InitBuffer(a, first, 1024);
  pipe.InitBuffer(b, second, 1024);
  g_result = "ok";
}
static void many_tbufs(int n) {  // n TBufs of 32 B in one kernel
  TPipe pipe;
  std::vector<TBuf<TPosition::VECCALC>> bufs(static_cast<size_t>(n));
  for (auto& b : bufs) pipe.InitBuffer(b, 32);
  g_result = "ok";
}

static std::map<std::string, std::function<void()>> cube_cases() {
  return {
      {"nine_queue_buffers_on_a1", [] { queue_buffers(4, 5); }},
      {"eight_queue_buffers_on_a1", [] { queue_buffers(4, 4); }},
      {"fill_l0a_in_32b_units", [] { fill(TPosition::A2, 32 * 32 * 2 / 32); }},  // 64 "blocks" = 32 KiB on L0A
      {"fill_l0b_in_32b_units", [] { fill(TPosition::B2, 32 * 32 * 2 / 32); }},
      {"fill_l0a_ok", [] { fill(TPosition::A2, 32 * 32 * 2 / 512); }},            // 4 fractals of 512 B
      {"fill_l0b_ok", [] { fill(TPosition::B2, 32 * 32 * 2 / 512); }},
      {"fill_l1_ok", [] { fill(TPosition::A1, 32 * 32 * 2 / 32); }},              // L1: 32 B blocks
      {"fill_l1_in_512b_units_too_little", [] { fill(TPosition::A1, 32 * 32 * 2 / 512); }},  // fills 1/16
      {"gemv_m1", [] { gemv_case(1); }},
      {"gemv_m_promoted", [] { gemv_case(16); }},
      {"mmad_dst_512_aligned", [] { mmad_dst(128); }},   // 512 B into L0C
      {"mmad_dst_1024_aligned", [] { mmad_dst(256); }},  // 1024 B
  };
}

// ---- rule 4: the data cache (vector launches of 2 blocks) ------------------------------------------
static std::map<std::string, std::function<void()>> vec_cases() {
  return {
      {"sixty_five_buffers", [] { many_tbufs(65); }},
      {"sixty_four_buffers", [] { many_tbufs(64); }},
      {"false_sharing", [] {  // block b writes g_f[b]: one 64-byte line, two cores
         auto g = gt(g_f, 1024);
         g.SetValue(GetBlockIdx(), 1.0f + GetBlockIdx());
       }},
      {"own_lines_ok", [] {  // block b writes g_f[16 b]: a line per core
         auto g = gt(g_f, 1024);
         g.SetValue(16 * GetBlockIdx(), 1.0f + GetBlockIdx());
       }},
      {"dma_store_ok", [] {  // block b stores g_f[b] from UB with a 4-byte DataCopyPad: no cache involved
         TPipe pipe;
         TBuf<TPosition::VECCALC> buf;
         pipe.InitBuffer(buf, 32);
         auto u = buf.Get<float>();
         u.SetValue(0, 1.0f + GetBlockIdx());
         DataCopyExtParams p{1, 4, 0, 0, 0};
         DataCopyPad(gt(g_f, 1024)[GetBlockIdx()], u, p);
       }},
      {"dma_then_scalar_other_core", [] {  // block 0 DMA-writes g_f[0..8), block 1 scalar-writes g_f[9]
         auto g = gt(g_f, 1024);
         if (GetBlockIdx() == 0) {
           TPipe pipe;
           TBuf<TPosition::VECCALC> buf;
           pipe.InitBuffer(buf, 32);
           Duplicate(buf.Get<float>(), 5.0f, 8);
           SetFlag<HardEvent::V_MTE3>(EVENT_ID0);  // pipe model: V -> MTE3 is not compiler-inserted
           WaitFlag<HardEvent::V_MTE3>(EVENT_ID0);
           DataCopy(g, buf.Get<float>(), 8);
         } else {
           g.SetValue(9, 2.0f);
         }
       }},
      {"scalar_write_then_dma_read", [] {  // the DMA reads GM, not the core's dirty cache line
         if (GetBlockIdx() != 0) return;
         auto g = gt(g_f, 1024);
         g.SetValue(0, 7.0f);
         TPipe pipe;
         TBuf<TPosition::VECCALC> buf;
         pipe.InitBuffer(buf, 32);
         DataCopy(buf.Get<float>(), g, 8);
         g_result = buf.Get<float>().GetValue(0) == 7.0f ? "saw new" : "saw old";
       }},
      {"scalar_write_clean_then_dma_read", [] {  // the corrected twin: clean the line first
         if (GetBlockIdx() != 0) return;
         auto g = gt(g_f, 1024);
         g.SetValue(0, 7.0f);
         dcci(g);
         TPipe pipe;
         TBuf<TPosition::VECCALC> buf;
         pipe.InitBuffer(buf, 32);
         DataCopy(buf.Get<float>(), g, 8);
         g_result = buf.Get<float>().GetValue(0) == 7.0f ? "saw new" : "saw old";
       }},
      {"dma_over_own_dirty_line", [] {
         if (GetBlockIdx() != 0) return;
         auto g = gt(g_f, 1024);
         g.SetValue(3, 7.0f);
         TPipe pipe;
         TBuf<TPosition::VECCALC> buf;
         pipe.InitBuffer(buf, 32);
         Duplicate(buf.Get<float>(), 1.0f, 8);
         SetFlag<HardEvent::V_MTE3>(EVENT_ID0);  // pipe model: V -> MTE3 is not compiler-inserted
         WaitFlag<HardEvent::V_MTE3>(EVENT_ID0);
         DataCopy(g, buf.Get<float>(), 8);
       }},
  };
}

// Two launches: the first reads g_f[0] through the scalar cache, the host changes it, the second
// reads again -- stale unless the kernel invalidates the line first.
static void stale_read(bool invalidate) {
  auto kernel = [invalidate] {
    auto g = gt(g_f, 1024);
    if (invalidate) dcci(g);
    g_result = std::to_string(static_cast<int>(g.GetValue(0)));
  };
  g_f[0] = 1.0f;
  ascend_emu::set_kernel(invalidate ? "stale_read_invalidated" : "stale_read");
  ascend_emu::launch(1, 4096, kernel);
  g_f[0] = 2.0f;  // the host (or another kernel) writes GM between the launches
  ascend_emu::set_kernel(invalidate ? "stale_read_invalidated" : "stale_read");
  ascend_emu::launch(1, 4096, kernel);
}

int main(int argc, char** argv) {
  const auto outcome = emu_driver::run_case_by_name(argc, argv, [](const std::string& name) {
    auto cc = cube_cases();
    auto vc = vec_cases();
    if (cc.count(name)) {
      ascend_emu::set_kernel(name.c_str());
      ascend_emu::launch_cube(1, emu_driver::a2_cube_mem(), cc[name]);
    } else if (vc.count(name)) {
      ascend_emu::set_kernel(name.c_str());
      ascend_emu::launch(2, 4096, vc[name]);
      if (name == "own_lines_ok" || name == "dma_store_ok")
        g_result = std::to_string(static_cast<int>(g_f[name == "own_lines_ok" ? 16 : 1]));
    } else if (name == "reduce_max_small_work") {
      ascend_emu::set_kernel(name.c_str());
      ascend_emu::launch(1, 8192, [] { reduce_max(8); });
    } else if (name == "reduce_max_ok") {
      ascend_emu::launch(1, 8192, [] { reduce_max(16); });
    } else if (name == "stale_read") {
      stale_read(false);
    } else if (name == "stale_read_invalidated") {
      stale_read(true);
    } else {
      return false;
    }
    return true;
  });
  if (outcome != emu_driver::kRan) return emu_driver::exit_code(outcome);
  std::printf("%s\n", g_result.c_str());
  return 0;
}
