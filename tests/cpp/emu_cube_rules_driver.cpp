// Tiny Cube-side kernels that break one rule each on the AscendC emulation layer
// (tests/test_ascend_grouped_gemm.py). Usage: emu_cube_rules_driver <case>; prints
// "EmuError: <message>", "ok", or "nan" (for the K-padding case).
#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "emu/kernel_operator_emu.h"
#include "emu_case_main.h"

using namespace AscendC;

static std::vector<half> g_a(64 * 64, half(1.0f)), g_b(64 * 64, half(1.0f));
static std::vector<half> g_c(64 * 64);
static std::vector<float> g_f(64 * 64, 1.0f);
static std::string g_result = "ok";

template <typename T>
static GlobalTensor<T> gt(std::vector<T>& v) {
  GlobalTensor<T> g;
  g.SetGlobalBuffer(v.data(), v.size());
  return g;
}

// A correct 32 x 32 x 32 tile through the whole path (ND2NZ, LoadData, Mmad, Fixpipe), with a
// hook to break one step.
struct Tile {
  TPipe pipe;
  TQue<TPosition::A1, 1> a1q;
  TQue<TPosition::B1, 1> b1q;
  TQue<TPosition::A2, 1> a2q;
  TQue<TPosition::B2, 1> b2q;
  TQue<TPosition::CO1, 1> cq;
  LocalTensor<half> a1, b1, a2, b2;
  LocalTensor<float> c;
  Tile() {
    pipe.InitBuffer(a1q, 1, 32 * 32 * 2);
    pipe.InitBuffer(b1q, 1, 32 * 32 * 2);
    pipe.InitBuffer(a2q, 1, 32 * 32 * 2);
    pipe.InitBuffer(b2q, 1, 32 * 32 * 2);
    pipe.InitBuffer(cq, 1, 32 * 32 * 4);
    a1 = a1q.AllocTensor<half>();
    b1 = b1q.AllocTensor<half>();
    a2 = a2q.AllocTensor<half>();
    b2 = b2q.AllocTensor<half>();
    c = cq.AllocTensor<float>();
  }
  void load(uint16_t k = 32) {
    Nd2NzParams p;
    p.nValue = 32;
    p.dValue = k;
    p.srcDValue = 64;
    p.dstNzC0Stride = 32;
    DataCopy(a1, gt(g_a), p);
    DataCopy(b1, gt(g_b), p);
    SetFlag<HardEvent::MTE2_MTE1>(EVENT_ID0);  // pipe model: L1 written by MTE2, read by MTE1
    WaitFlag<HardEvent::MTE2_MTE1>(EVENT_ID0);
    for (uint32_t mf = 0; mf < 2; ++mf) {
      LoadData2DParams l;
      l.startIndex = static_cast<uint16_t>(mf);
      l.repeatTimes = 2;
      l.srcStride = 2;
      LoadData(a2[mf * 512], a1, l);
      l.ifTranspose = true;
      LoadData(b2[mf * 512], b1, l);
    }
    SetFlag<HardEvent::MTE1_M>(EVENT_ID0);  // L0A/L0B written by MTE1, read by the Mmad (M)
    WaitFlag<HardEvent::MTE1_M>(EVENT_ID0);
  }
  void mmad(uint16_t k = 32) {
    MmadParams m;
    m.m = 32;
    m.n = 32;
    m.k = k;
    Mmad(c, a2, b2, m);
  }
  void out(QuantMode_t q = QuantMode_t::F322F16, uint16_t srcStride = 32) {
    FixpipeParamsV220 f;
    f.nSize = 32;
    f.mSize = 32;
    f.srcStride = srcStride;
    f.dstStride = 64;
    f.quantPre = q;
    SetFlag<HardEvent::M_FIX>(EVENT_ID0);  // L0C written by the Mmad, read by Fixpipe
    WaitFlag<HardEvent::M_FIX>(EVENT_ID0);
    Fixpipe(gt(g_c), c, f);
  }
  void done() {
    a1q.FreeTensor(a1);
    b1q.FreeTensor(b1);
    a2q.FreeTensor(a2);
    b2q.FreeTensor(b2);
    cq.FreeTensor(c);
  }
};

static std::map<std::string, std::function<void()>> cube_kernels() {
  return {
      {"ok_tile", [] {
         Tile t;
         t.load();
         t.mmad();
         t.out();
         t.done();
         if (static_cast<float>(g_c[0]) != 32.0f || static_cast<float>(g_c[31 * 64 + 31]) != 32.0f) g_result = "wrong";
       }},
      {"l0a_overflow", [] {
         TPipe pipe;
         TQue<TPosition::A2, 2> q;
         pipe.InitBuffer(q, 2, 40 * 1024);
       }},
      {"l0c_overflow", [] {
         TPipe pipe;
         TQue<TPosition::CO1, 2> q;
         pipe.InitBuffer(q, 2, 128 * 256 * 4);
       }},
      {"mmad_fp32_inputs", [] {
         TPipe pipe;
         TQue<TPosition::A2, 1> a;
         TQue<TPosition::B2, 1> b;
         TQue<TPosition::CO1, 1> c;
         pipe.InitBuffer(a, 1, 4096);
         pipe.InitBuffer(b, 1, 4096);
         pipe.InitBuffer(c, 1, 4096);
         auto ta = a.AllocTensor<float>();
         auto tb = b.AllocTensor<float>();
         auto tc = c.AllocTensor<float>();
         MmadParams m;
         m.m = m.n = m.k = 16;
         Mmad(tc, ta, tb, m);
       }},
      {"mmad_operand_in_wrong_memory", [] {  // right matrix taken from L0A
         Tile t;
         t.load();
         MmadParams m;
         m.m = m.n = m.k = 32;
         Mmad(t.c, t.a2, t.a2, m);
       }},
      {"mmad_unaligned_operand", [] {  // 16 elements = 32 B into L0A: not a fractal boundary
         Tile t;
         t.load();
         MmadParams m;
         m.m = 16;
         m.n = 16;
         m.k = 16;
         Mmad(t.c, t.a2[16], t.b2, m);
       }},
      {"mmad_operand_too_small", [] {  // 48 x 32 needs 3 x 2 fractals, the buffer holds 4
         Tile t;
         t.load();
         MmadParams m;
         m.m = 48;
         m.n = 32;
         m.k = 32;
         Mmad(t.c, t.a2, t.b2, m);
       }},
      {"mmad_k_zero", [] {
         Tile t;
         MmadParams m;
         m.m = 16;
         m.n = 16;
         m.k = 0;
         Mmad(t.c, t.a2, t.b2, m);
       }},
      {"nd2nz_overlapping_blocks", [] {
         Tile t;
         Nd2NzParams p;
         p.nValue = 32;
         p.dValue = 32;
         p.srcDValue = 64;
         p.dstNzC0Stride = 16;
         DataCopy(t.a1, gt(g_a), p);
       }},
      {"nd2nz_into_l0", [] {  // GM -> L0A directly is not a path
         Tile t;
         Nd2NzParams p;
         p.nValue = 16;
         p.dValue = 16;
         p.srcDValue = 64;
         p.dstNzC0Stride = 16;
         DataCopy(t.a2, gt(g_a), p);
       }},
      {"loaddata_past_l1", [] {
         Tile t;
         LoadData2DParams l;
         l.startIndex = 3;
         l.repeatTimes = 2;
         l.srcStride = 1;
         LoadData(t.a2, t.a1, l);
       }},
      {"fixpipe_quant_mismatch", [] {
         Tile t;
         t.load();
         t.mmad();
         t.out(QuantMode_t::NoQuant);
       }},
      {"fixpipe_src_stride", [] {
         Tile t;
         t.load();
         t.mmad();
         t.out(QuantMode_t::F322F16, 24);
       }},
      {"vector_op_on_l1", [] {  // vector instructions work on UB only
         Tile t;
         Duplicate(t.a1.ReinterpretCast<int16_t>(), static_cast<int16_t>(0), 16);
       }},
      {"ub_on_aic", [] {
         TPipe pipe;
         TQue<TPosition::VECIN, 1> q;
         pipe.InitBuffer(q, 1, 256);
       }},
      {"k_padding_not_zeroed", [] {  // k = 24: the second K fractal's pad columns are stale L1 (NaN)
         Tile t;
         t.load(24);
         t.mmad(24);
         t.out();
         t.done();
         if (std::isnan(static_cast<float>(g_c[0]))) g_result = "nan";
       }},
      {"k_padding_zeroed", [] {  // the same with L1 zero-filled first: exact result
         Tile t;
         InitConstValueParams<half> z;
         z.repeatTimes = 1;
         z.blockNum = 32 * 32 * 2 / 32;
         InitConstValue(t.a1, z);
         InitConstValue(t.b1, z);
         PipeBarrier<PIPE_MTE2>();  // the L1 fill and the ND2NZ copy both write L1 on MTE2
         t.load(24);
         t.mmad(24);
         t.out();
         t.done();
         if (static_cast<float>(g_c[0]) != 24.0f) g_result = "wrong";
       }},
  };
}

int main(int argc, char** argv) {
  const auto outcome = emu_driver::run_case_by_name(argc, argv, [](const std::string& name) {
    if (name == "l1_on_aiv") {
      // vector launch: Cube memories do not exist on an AIV core
      ascend_emu::launch(1, 184 * 1024, [] {
        TPipe pipe;
        TQue<TPosition::A1, 1> q;
        pipe.InitBuffer(q, 1, 256);
      });
    } else {
      auto ks = cube_kernels();
      auto it = ks.find(name);
      if (it == ks.end()) return false;
      ascend_emu::launch_cube(1, emu_driver::a2_cube_mem(), it->second);
    }
    return true;
  });
  if (outcome != emu_driver::kRan) return emu_driver::exit_code(outcome);
  std::printf("%s\n", g_result.c_str());
  return 0;
}
