// Tiny kernels that break one AscendC rule each, run on the emulation layer: proves the emulator
// enforces the rules (tests/test_ascend_emu.py). Usage: emu_rules_driver <case>; prints
// "EmuError: <message>" or "ok".
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "emu/kernel_operator_emu.h"
#include "emu_case_main.h"

using namespace AscendC;

static std::vector<float> g_in(1024, 1.0f), g_out(1024, 0.0f);
static std::vector<bfloat16_t> g_bf(1024);

static GlobalTensor<float> gin(uint64_t n = 1024) {
  GlobalTensor<float> g;
  g.SetGlobalBuffer(g_in.data(), n);
  return g;
}
// Each block writes its own half of g_out (two cores storing the same bytes is a GM race, gm_model.h).
static GlobalTensor<float> gout() {
  GlobalTensor<float> g;
  g.SetGlobalBuffer(g_out.data() + 512 * GetBlockIdx(), 512);
  return g;
}

static std::map<std::string, std::function<void()>> kernels() {
  return {
      {"misaligned_datacopy", [] {  // 7 floats = 28 B: not whole 32-byte blocks
         TPipe pipe;
         TQue<TPosition::VECIN, 1> q;
         pipe.InitBuffer(q, 1, 256);
         auto t = q.AllocTensor<float>();
         DataCopy(t, gin(), 7);
         q.FreeTensor(t);
       }},
      {"ragged_datacopypad_ok", [] {  // the same 7 floats with DataCopyPad are fine
         TPipe pipe;
         TQueBind<TPosition::VECIN, TPosition::VECOUT, 1> q;  // hands the buffer from MTE2 to MTE3
         pipe.InitBuffer(q, 1, 256);
         auto t = q.AllocTensor<float>();
         DataCopyPad(t, gin(), DataCopyExtParams{1, 28, 0, 0, 0}, DataCopyPadExtParams<float>{true, 0, 1, 0.0f});
         q.EnQue(t);
         t = q.DeQue<float>();
         DataCopyPad(gout(), t, DataCopyExtParams{1, 28, 0, 0, 0});
         q.FreeTensor(t);
       }},
      {"ub_overflow", [] {  // 2 x 100 KiB > 184 KiB budget
         TPipe pipe;
         TQue<TPosition::VECIN, 2> q;
         pipe.InitBuffer(q, 2, 100 * 1024);
       }},
      {"unaligned_ub_operand", [] {
         TPipe pipe;
         TBuf<TPosition::VECCALC> b;
         pipe.InitBuffer(b, 256);
         auto t = b.Get<float>();
         Duplicate(t[3], 0.0f, 8);  // starts at byte 12
       }},
      {"alloc_without_free", [] {
         TPipe pipe;
         TQue<TPosition::VECIN, 2> q;
         pipe.InitBuffer(q, 2, 64);
         auto a = q.AllocTensor<float>();
         auto b = q.AllocTensor<float>();
         auto c = q.AllocTensor<float>();  // third buffer of two
       }},
      {"dequeue_empty", [] {
         TPipe pipe;
         TQue<TPosition::VECIN, 2> q;
         pipe.InitBuffer(q, 2, 64);
         auto t = q.DeQue<float>();
       }},
      {"enqueue_past_depth", [] {
         TPipe pipe;
         TQue<TPosition::VECIN, 1> q;
         pipe.InitBuffer(q, 2, 64);
         auto a = q.AllocTensor<float>();
         auto b = q.AllocTensor<float>();
         q.EnQue(a);
         q.EnQue(b);
       }},
      {"use_after_free", [] {
         TPipe pipe;
         TQue<TPosition::VECIN, 1> q;
         pipe.InitBuffer(q, 1, 64);
         auto t = q.AllocTensor<float>();
         q.FreeTensor(t);
         Duplicate(t, 1.0f, 8);
       }},
      {"use_while_queued", [] {
         TPipe pipe;
         TQue<TPosition::VECIN, 1> q;
         pipe.InitBuffer(q, 1, 64);
         auto t = q.AllocTensor<float>();
         q.EnQue(t);
         Duplicate(t, 1.0f, 8);
       }},
      {"leak_at_block_end", [] {
         TPipe pipe;
         TQue<TPosition::VECOUT, 1> q;
         pipe.InitBuffer(q, 1, 64);
         auto t = q.AllocTensor<float>();
         (void)t;
       }},
      {"free_foreign_tensor", [] {
         TPipe pipe;
         TQue<TPosition::VECIN, 1> q1;
         TQue<TPosition::VECOUT, 1> q2;
         pipe.InitBuffer(q1, 1, 64);
         pipe.InitBuffer(q2, 1, 64);
         auto t = q1.AllocTensor<float>();
         q2.FreeTensor(t);
       }},
      {"bf16_arithmetic", [] {
         TPipe pipe;
         TBuf<TPosition::VECCALC> b;
         pipe.InitBuffer(b, 256);
         auto t = b.Get<bfloat16_t>();
         Add(t, t, t, 16);
       }},
      {"partial_overlap", [] {
         TPipe pipe;
         TBuf<TPosition::VECCALC> b;
         pipe.InitBuffer(b, 512);
         auto t = b.Get<float>();
         Add(t[8], t, t, 32);
       }},
      {"narrowing_cast_without_rounding", [] {
         TPipe pipe;
         TBuf<TPosition::VECCALC> a, b;
         pipe.InitBuffer(a, 256);
         pipe.InitBuffer(b, 256);
         Cast(b.Get<half>(), a.Get<float>(), RoundMode::CAST_NONE, 16);
       }},
      {"gm_out_of_bounds", [] {
         TPipe pipe;
         TQue<TPosition::VECIN, 1> q;
         pipe.InitBuffer(q, 1, 256);
         auto t = q.AllocTensor<float>();
         DataCopy(t, gin(16)[8], 16);  // elements [8, 24) of a 16-element buffer
         q.FreeTensor(t);
       }},
      {"two_pipes", [] {
         TPipe a;
         TPipe b;
       }},
      {"uninitialized_ub_is_nan", [] {  // not an error: fresh UB reads as NaN
         TPipe pipe;
         TBuf<TPosition::VECCALC> b;
         pipe.InitBuffer(b, 64);
         float v = b.Get<float>().GetValue(0);
         if (v == v) throw ascend_emu::EmuError("fresh UB was not NaN");
       }},
  };
}

int main(int argc, char** argv) {
  const auto outcome = emu_driver::run_named_case(argc, argv, kernels(), [](const std::function<void()>& k) { ascend_emu::launch(2, 184 * 1024, k); });
  if (outcome != emu_driver::kRan) return emu_driver::exit_code(outcome);
  std::printf("ok\n");
  return 0;
}
