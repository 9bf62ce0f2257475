// The tensor high-dimension forms of the emulated AscendC vector API (repeatTimes, continuous and bit
// masks, block / repeat strides, WholeReduceMax / WholeReduceSum, Brcb) against answers computed by
// hand in this file (tests/test_ascend_emu_vec_repeat.py). Usage: emu_vec_repeat_driver <case>;
// prints "ok", "FAIL: <what>" or "EmuError: <message>".
#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <string>

#include "emu/kernel_operator_emu.h"
#include "emu_case_main.h"

using namespace AscendC;

static std::string g_fail;
static void expect(bool ok, const std::string& what) {
  if (!ok && g_fail.empty()) g_fail = what;
}
static void expect_eq(float got, float want, const std::string& what) {
  const bool same = (std::isnan(got) && std::isnan(want)) || got == want;
  if (!same) expect(false, what + ": got " + std::to_string(got) + ", want " + std::to_string(want));
}

// Two UB buffers of n floats each: a filled with i, b with 1000 + i, d with -1 (unselected elements stay -1).
struct Bufs {
  TPipe pipe;
  TBuf<TPosition::VECCALC> ba, bb, bd;
  LocalTensor<float> a, b, d;
  explicit Bufs(uint32_t n) {
    pipe.InitBuffer(ba, n * 4);
    pipe.InitBuffer(bb, n * 4);
    pipe.InitBuffer(bd, n * 4);
    a = ba.Get<float>();
    b = bb.Get<float>();
    d = bd.Get<float>();
    for (uint32_t i = 0; i < n; ++i) {
      a.SetValue(i, float(i));
      b.SetValue(i, 1000.0f + i);
      d.SetValue(i, -1.0f);
    }
    SetFlag<HardEvent::S_V>(EVENT_ID0);
    WaitFlag<HardEvent::S_V>(EVENT_ID0);
  }
  void sync_read() {
    SetFlag<HardEvent::V_S>(EVENT_ID0);
    WaitFlag<HardEvent::V_S>(EVENT_ID0);
  }
};

static std::map<std::string, std::function<void()>> kernels() {
  return {
      // Add, continuous mask 64 (whole fp32 repeat), 2 repeats, default strides = the count form
      {"add_contiguous", [] {
         Bufs u(256);
         Add(u.d, u.a, u.b, 64, 2, BinaryRepeatParams());
         u.sync_read();
         for (int i = 0; i < 128; ++i) expect_eq(u.d.GetValue(i), 1000.0f + 2 * i, "add d[" + std::to_string(i) + "]");
         for (int i = 128; i < 256; ++i) expect_eq(u.d.GetValue(i), -1.0f, "add beyond repeats d[" + std::to_string(i) + "]");
       }},
      // continuous mask 10: elements 0..9 of each repeat; repeat strides 16 blocks (= 128 floats: one
      // row of a 128-wide tile per repeat), 2 repeats
      {"sub_mask_rows", [] {
         Bufs u(512);
         Sub(u.d, u.b, u.a, 10, 2, BinaryRepeatParams(1, 1, 1, 16, 16, 16));
         u.sync_read();
         for (int i = 0; i < 256; ++i) {
           const bool on = (i % 128) < 10;
           expect_eq(u.d.GetValue(i), on ? 1000.0f : -1.0f, "sub d[" + std::to_string(i) + "]");
         }
       }},
      // bit mask 0b1011 << 60 | 1: elements 0, 60, 61, 63 of one repeat
      {"mul_bitmask", [] {
         Bufs u(64);
         const uint64_t mask[2] = {1ull | (0xBull << 60), 0};
         Mul(u.d, u.a, u.a, mask, 1, BinaryRepeatParams());
         u.sync_read();
         for (int i = 0; i < 64; ++i) {
           const bool on = i == 0 || i == 60 || i == 61 || i == 63;
           expect_eq(u.d.GetValue(i), on ? float(i * i) : -1.0f, "mul d[" + std::to_string(i) + "]");
         }
       }},
      // src1 block stride 0, repeat stride 1: every element of repeat r reads block r of b (a per-row
      // broadcast operand as Brcb lays it out)
      {"max_broadcast_operand", [] {
         Bufs u(256);
         Max(u.d, u.a, u.b, 64, 3, BinaryRepeatParams(1, 1, 0, 8, 8, 1));
         u.sync_read();
         for (int r = 0; r < 3; ++r)
           for (int i = 0; i < 64; ++i) {
             const float want = std::max(float(r * 64 + i), 1000.0f + r * 8 + i % 8);
             expect_eq(u.d.GetValue(r * 64 + i), want, "max d[" + std::to_string(r * 64 + i) + "]");
           }
       }},
      // destination block stride 2: the 8 blocks of a repeat land every other block
      {"adds_dst_block_stride", [] {
         Bufs u(256);
         Adds(u.d, u.a, 0.5f, 64, 1, UnaryRepeatParams(2, 1, 8, 8));
         u.sync_read();
         for (int i = 0; i < 128; ++i) {
           const int blk = i / 8;
           const float want = blk % 2 == 0 ? float((blk / 2) * 8 + i % 8) + 0.5f : -1.0f;
           expect_eq(u.d.GetValue(i), want, "adds d[" + std::to_string(i) + "]");
         }
       }},
      {"muls_exp_masked", [] {
         Bufs u(128);
         Muls(u.d, u.a, 2.0f, 3, 2, UnaryRepeatParams(1, 1, 8, 8));
         Exp(u.a, u.a, 5, 1, UnaryRepeatParams());
         u.sync_read();
         for (int i = 0; i < 128; ++i)
           expect_eq(u.d.GetValue(i), (i % 64) < 3 ? 2.0f * i : -1.0f, "muls d[" + std::to_string(i) + "]");
         for (int i = 0; i < 64; ++i)
           expect_eq(u.a.GetValue(i), i < 5 ? std::exp(float(i)) : float(i), "exp a[" + std::to_string(i) + "]");
       }},
      // half: 128 elements per repeat; bit mask word 1 selects elements 64..127
      {"half_duplicate_bitmask", [] {
         TPipe pipe;
         TBuf<TPosition::VECCALC> bh;
         pipe.InitBuffer(bh, 512);
         LocalTensor<half> h = bh.Get<half>();
         Duplicate(h, half(0.0f), 128, 2, 1, 8);
         const uint64_t mask[2] = {0, 1ull << 3};
         Duplicate(h, half(3.0f), mask, 2, 1, 8);
         SetFlag<HardEvent::V_S>(EVENT_ID0);
         WaitFlag<HardEvent::V_S>(EVENT_ID0);
         for (int i = 0; i < 256; ++i)
           expect_eq(float(h.GetValue(i)), (i % 128) == 67 ? 3.0f : 0.0f, "dup h[" + std::to_string(i) + "]");
       }},
      // per-row max and sum of a 4 x 128 tile: two WholeReduce per row chunk (mask 64, srcRepStride 16)
      {"whole_reduce_rows", [] {
         Bufs u(512);
         WholeReduceMax(u.d, u.a, 64, 4, 1, 1, 16, ReduceOrder::ORDER_ONLY_VALUE);
         WholeReduceSum(u.d[8], u.a[64], 64, 4, 1, 1, 16);
         WholeReduceSum(u.d[16], u.a, 10, 4, 2, 1, 16);  // masked lanes count 0; results 2 apart
         u.sync_read();
         for (int r = 0; r < 4; ++r) {
           expect_eq(u.d.GetValue(r), float(r * 128 + 63), "max row " + std::to_string(r));
           float s = 0;
           for (int i = 0; i < 64; ++i) s += float(r * 128 + 64 + i);
           expect_eq(u.d.GetValue(8 + r), s, "sum row " + std::to_string(r));
           float s10 = 0;
           for (int i = 0; i < 10; ++i) s10 += float(r * 128 + i);
           expect_eq(u.d.GetValue(16 + 2 * r), s10, "masked sum row " + std::to_string(r));
           expect_eq(u.d.GetValue(16 + 2 * r + 1), -1.0f, "between strided results " + std::to_string(r));
         }
       }},
      // the in-repeat sum order is the binary tree: 1e8 + 1 + (-1e8) + 1 ... pairs first
      {"whole_reduce_sum_tree_order", [] {
         Bufs u(64);
         for (int i = 0; i < 64; ++i) u.a.SetValue(i, 0.0f);
         u.a.SetValue(0, 1e8f);
         u.a.SetValue(1, 1.0f);
         u.a.SetValue(2, -1e8f);
         u.a.SetValue(3, 1.0f);
         SetFlag<HardEvent::S_V>(EVENT_ID0);
         WaitFlag<HardEvent::S_V>(EVENT_ID0);
         WholeReduceSum(u.d, u.a, 64, 1, 1, 1, 8);
         u.sync_read();
         // tree: (1e8 + 1) + (-1e8 + 1) = 1e8 + -1e8 = 0 in fp32 (1e8 + 1 rounds to 1e8); in order: 1
         expect_eq(u.d.GetValue(0), 0.0f, "tree order");
       }},
      {"brcb_rows", [] {
         Bufs u(256);
         Brcb(u.d, u.a, 2, BrcbRepeatParams(1, 8));
         u.sync_read();
         for (int i = 0; i < 128; ++i) expect_eq(u.d.GetValue(i), float(i / 8), "brcb d[" + std::to_string(i) + "]");
         for (int i = 128; i < 256; ++i) expect_eq(u.d.GetValue(i), -1.0f, "brcb beyond d[" + std::to_string(i) + "]");
       }},
      {"brcb_strided", [] {
         Bufs u(256);
         Brcb(u.d, u.a, 1, BrcbRepeatParams(2, 16));
         u.sync_read();
         for (int i = 0; i < 128; ++i) {
           const int blk = i / 8;
           expect_eq(u.d.GetValue(i), blk % 2 == 0 ? float(blk / 2) : -1.0f, "brcb strided d[" + std::to_string(i) + "]");
         }
       }},
      // rule cases
      {"mask_too_large", [] {
         Bufs u(128);
         Add(u.d, u.a, u.b, 65, 1, BinaryRepeatParams());
       }},
      {"bitmask_high_word_fp32", [] {
         Bufs u(128);
         const uint64_t mask[2] = {1, 1};
         Add(u.d, u.a, u.b, mask, 1, BinaryRepeatParams());
       }},
      {"repeat_past_operand", [] {
         Bufs u(128);
         Add(u.d, u.a, u.b, 64, 3, BinaryRepeatParams());  // 3 repeats = 192 floats of 128
       }},
      {"stride_past_operand", [] {
         Bufs u(128);
         Exp(u.d, u.a, 8, 2, UnaryRepeatParams(1, 1, 8, 16));  // repeat 1 reads from element 128
       }},
      {"whole_reduce_index_order", [] {
         Bufs u(128);
         WholeReduceMax(u.d, u.a, 64, 1, 1, 1, 8);
       }},
      {"brcb_overlap", [] {
         Bufs u(128);
         Brcb(u.a, u.a[8], 1, BrcbRepeatParams(1, 8));  // dst [0, 64) covers src [8, 16)
       }},
  };
}

int main(int argc, char** argv) {
  const auto outcome = emu_driver::run_named_case(argc, argv, kernels(), [](const std::function<void()>& k) { ascend_emu::launch(1, 184 * 1024, k); });
  if (outcome != emu_driver::kRan) return emu_driver::exit_code(outcome);
  if (!g_fail.empty()) std::printf("FAIL: %s\n", g_fail.c_str());
  else std::printf("ok\n");
  return 0;
}
