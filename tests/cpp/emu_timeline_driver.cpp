// Small kernels with a known A2 timeline answer (tests/test_perfmodel_a2_timeline.py): each case
// runs one launch on the emulator with the timeline recorder on (csrc/ascend/emu/timeline.h) and
// prints the recording as JSON, or "EmuError: <message>" when the pipe model rejects the kernel.
// Usage: emu_timeline_driver <case>.
#include <cstdio>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "emu/kernel_operator_emu.h"

using namespace AscendC;

template <typename T>
static GlobalTensor<T> gt(std::vector<T>& v, uint64_t off = 0) {
  GlobalTensor<T> g;
  g.SetGlobalBuffer(v.data() + off, v.size() - off);
  return g;
}

// ---- a pure copy on every AIV: GM -> UB -> GM through a double-buffered VECIN -> VECOUT queue ----
constexpr uint32_t kCopyBlocks = 48, kCopyPerBlock = 256 * 1024, kCopyTile = 8192;  // floats
static std::vector<float> g_src(kCopyBlocks * kCopyPerBlock, 1.0f), g_dst(kCopyBlocks * kCopyPerBlock);

static void copy_kernel() {
  TPipe pipe;
  TQueBind<TPosition::VECIN, TPosition::VECOUT, 2> q;
  pipe.InitBuffer(q, 2, kCopyTile * sizeof(float));
  const uint64_t base = GetBlockIdx() * uint64_t(kCopyPerBlock);
  for (uint32_t t = 0; t < kCopyPerBlock / kCopyTile; ++t) {
    auto x = q.AllocTensor<float>();
    DataCopy(x, gt(g_src, base + t * kCopyTile), kCopyTile);
    q.EnQue(x);
    auto y = q.DeQue<float>();
    DataCopy(gt(g_dst, base + t * kCopyTile), y, kCopyTile);
    q.FreeTensor(y);
  }
}

// ---- a chain of Mmads on resident L0 tiles, on every AIC ------------------------------------------
constexpr uint32_t kCubeBlocks = 24, kMmads = 200, kMN = 128;
static std::vector<half> g_c(kCubeBlocks * kMN * kMN);

static void mmad_chain_kernel() {
  TPipe pipe;
  TQue<TPosition::A2, 1> aq;
  TQue<TPosition::B2, 1> bq;
  TQue<TPosition::CO1, 1> cq;
  pipe.InitBuffer(aq, 1, kMN * kMN * 2);
  pipe.InitBuffer(bq, 1, kMN * kMN * 2);
  pipe.InitBuffer(cq, 1, kMN * kMN * 4);
  auto a = aq.AllocTensor<half>();
  auto b = bq.AllocTensor<half>();
  auto c = cq.AllocTensor<float>();
  InitConstValueParams<half> f;
  f.repeatTimes = 1;
  f.blockNum = kMN * kMN * 2 / 512;
  f.initValue = half(0.5f);
  InitConstValue(a, f);
  InitConstValue(b, f);
  SetFlag<HardEvent::MTE1_M>(EVENT_ID0);
  WaitFlag<HardEvent::MTE1_M>(EVENT_ID0);
  for (uint32_t i = 0; i < kMmads; ++i) {
    MmadParams m;
    m.m = kMN;
    m.n = kMN;
    m.k = kMN;
    m.cmatrixInitVal = i == 0;
    Mmad(c, a, b, m);
  }
  SetFlag<HardEvent::M_FIX>(EVENT_ID0);
  WaitFlag<HardEvent::M_FIX>(EVENT_ID0);
  FixpipeParamsV220 fp;
  fp.nSize = kMN;
  fp.mSize = kMN;
  fp.srcStride = kMN;
  fp.dstStride = kMN;
  fp.quantPre = QuantMode_t::F322F16;
  Fixpipe(gt(g_c, GetBlockIdx() * uint64_t(kMN * kMN)), c, fp);
  aq.FreeTensor(a);
  bq.FreeTensor(b);
  cq.FreeTensor(c);
}

// ---- a load -> vector -> store pipeline on one AIV, single or double buffered ---------------------
constexpr uint32_t kPipeTiles = 64, kPipeTile = 4096;  // floats
static std::vector<float> g_pin(kPipeTiles * kPipeTile, 1.0f), g_pout(kPipeTiles * kPipeTile);

struct PipeVariant {
  int buffers = 1;
  bool mte2_v = true;       // the flag the vector op needs after the load (a race without it)
  bool redundant = false;   // an extra MTE3 -> MTE2 flag the queue already implies
  bool barrier = false;     // an extra PipeBarrier<PIPE_ALL> per tile (serializes everything)
};

static void pipeline_kernel(PipeVariant v) {
  TPipe pipe;
  TQueBind<TPosition::VECIN, TPosition::VECOUT, 2> q;
  pipe.InitBuffer(q, static_cast<uint8_t>(v.buffers), kPipeTile * sizeof(float));
  for (uint32_t t = 0; t < kPipeTiles; ++t) {
    if (v.redundant && t > 0) {
      SetFlag<HardEvent::MTE3_MTE2>(EVENT_ID1);
      WaitFlag<HardEvent::MTE3_MTE2>(EVENT_ID1);
    }
    auto x = q.AllocTensor<float>();
    DataCopy(x, gt(g_pin, uint64_t(t) * kPipeTile), kPipeTile);
    if (v.mte2_v) {
      SetFlag<HardEvent::MTE2_V>(EVENT_ID0);
      WaitFlag<HardEvent::MTE2_V>(EVENT_ID0);
    }
    Muls(x, x, 2.0f, kPipeTile);
    // the documented auto-sync set does not order V -> MTE3, and the VECIN->VECOUT queue orders MTE2 -> MTE3
    SetFlag<HardEvent::V_MTE3>(EVENT_ID2);
    WaitFlag<HardEvent::V_MTE3>(EVENT_ID2);
    q.EnQue(x);
    auto y = q.DeQue<float>();
    DataCopy(gt(g_pout, uint64_t(t) * kPipeTile), y, kPipeTile);
    q.FreeTensor(y);
    if (v.barrier) PipeBarrier<PIPE_ALL>();
  }
}

// ---- vector instructions of the repeat form: their cost is their iterations, not their span ------
// One AIV, a 64 x 128 fp32 tile: Add over two 64-column halves (2 instructions x 64 repeats, row
// stride 16 blocks), Sub over the whole tile in the count form (32 KB = 128 iterations), Mul with an
// 8-element mask (64 repeats that touch 32 B each, 2 KB in all, spread over the tile).
constexpr uint32_t kVecRows = 64, kVecCols = 128;

static void vec_repeat_kernel() {
  TPipe pipe;
  TBuf<TPosition::VECCALC> xb, yb;
  pipe.InitBuffer(xb, kVecRows * kVecCols * sizeof(float));
  pipe.InitBuffer(yb, kVecRows * kVecCols * sizeof(float));
  LocalTensor<float> x = xb.Get<float>(), y = yb.Get<float>();
  Duplicate(x, 1.0f, static_cast<int32_t>(kVecRows * kVecCols));
  Duplicate(y, 2.0f, static_cast<int32_t>(kVecRows * kVecCols));
  const uint8_t rep = kVecCols / 8;
  const BinaryRepeatParams p(1, 1, 1, rep, rep, rep);
  for (uint32_t c0 = 0; c0 < kVecCols; c0 += 64) Add(x[c0], x[c0], y[c0], 64, kVecRows, p);
  Sub(x, x, y, static_cast<int32_t>(kVecRows * kVecCols));
  Mul(x, x, y, 8, kVecRows, p);
}

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  const std::string name = argv[1];
  std::map<std::string, PipeVariant> pipes = {
      {"pipe_single", {1, true, false, false}},        {"pipe_double", {2, true, false, false}},
      {"pipe_single_redundant", {1, true, true, false}}, {"pipe_double_barrier", {2, true, false, true}},
      {"pipe_missing_flag", {2, false, false, false}},
  };
  try {
    if (name == "copy") {
      ascend_emu::timeline::start(false);
      ascend_emu::launch(kCopyBlocks, 192 * 1024, copy_kernel);
    } else if (name == "mmad_chain") {
      ascend_emu::timeline::start(true);  // 24 x 200 Mmads of 128^3: timing only
      ascend_emu::launch_cube(kCubeBlocks, ascend_emu::CubeMem{512 * 1024, 64 * 1024, 64 * 1024, 128 * 1024},
                              mmad_chain_kernel);
    } else if (name == "vec_repeat") {
      ascend_emu::timeline::start(false);
      ascend_emu::launch(1, 192 * 1024, vec_repeat_kernel);
    } else if (pipes.count(name)) {
      const PipeVariant v = pipes[name];
      ascend_emu::timeline::start(false);
      ascend_emu::launch(1, 192 * 1024, [v] { pipeline_kernel(v); });
    } else {
      std::printf("unknown case\n");
      return 2;
    }
  } catch (const ascend_emu::EmuError& e) {
    ascend_emu::timeline::take_json();
    std::printf("EmuError: %s\n", e.what());
    return 0;
  }
  std::printf("%s\n", ascend_emu::timeline::take_json().c_str());
  return 0;
}
