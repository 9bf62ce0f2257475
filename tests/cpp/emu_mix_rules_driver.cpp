// Tiny mixed (AIC + 2 AIV) kernels on the AscendC emulation layer that follow or break one
// cross-core rule each (tests/test_ascend_flash_attention.py). Usage: emu_mix_rules_driver <case>;
// prints "EmuError: <message>" or the case's result line.
#include <cstdio>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "emu/kernel_operator_emu.h"
#include "emu_case_main.h"

using namespace AscendC;

static std::vector<float> g_gm(256, 0.0f);

// Scalar GM accesses go through each core's data cache (64-byte lines = 16 floats): every writer owns
// whole lines, writes are cleaned out and reads invalidated first.
template <typename T>
static void dcci(const GlobalTensor<T>& g) {
  DataCacheCleanAndInvalid<T, CacheLine::SINGLE_CACHE_LINE, DcciDst::CACHELINE_OUT>(g);
}
static std::string g_result = "ok";

// Ping-pong: 3 rounds of "AIC writes a value, both AIVs read it and write value + 1 + sub, AIC reads
// both" -- the result is right only if every flag orders the GM accesses.
static void pingpong() {
  GlobalTensor<float> gm;
  gm.SetGlobalBuffer(g_gm.data(), g_gm.size());
  const int64_t grp = GetBlockIdx() / GetTaskRatio(), base = grp * 64;
  for (int round = 0; round < 3; ++round) {
    if (g_coreType == AIC) {
      gm.SetValue(base, static_cast<float>(10 * round));
      dcci(gm[base]);
      CrossCoreSetFlag<2, PIPE_FIX>(0);
      CrossCoreWaitFlag(1);
      dcci(gm[base + 16]);
      dcci(gm[base + 32]);
      const float a = gm.GetValue(base + 16), b = gm.GetValue(base + 32);
      if (a != 10 * round + 1 || b != 10 * round + 2) g_result = "wrong";
    } else {
      CrossCoreWaitFlag(0);
      const int64_t sub = GetBlockIdx() % GetTaskRatio(), mine = base + 16 * (1 + sub);
      dcci(gm[base]);
      gm.SetValue(mine, gm.GetValue(base) + 1 + static_cast<float>(sub));
      dcci(gm[mine]);
      CrossCoreSetFlag<2, PIPE_MTE3>(1);
    }
  }
}

static std::map<std::string, std::function<void()>> kernels() {
  return {
      {"ok_pingpong", pingpong},
      {"racy_no_ack", [] {  // the AIC rewrites the slot without waiting for the AIVs to have read it
         GlobalTensor<float> gm;
         gm.SetGlobalBuffer(g_gm.data(), g_gm.size());
         const int64_t base = GetBlockIdx() / GetTaskRatio() * 64;
         for (int round = 0; round < 3; ++round) {
           if (g_coreType == AIC) {
             gm.SetValue(base, static_cast<float>(10 * round));
             dcci(gm[base]);
             CrossCoreSetFlag<2, PIPE_FIX>(0);
           } else {
             CrossCoreWaitFlag(0);
             dcci(gm[base]);
             if (gm.GetValue(base) != 10 * round) g_result = "wrong";
           }
         }
       }},
      {"deadlock", [] {
         if (g_coreType == AIC) CrossCoreWaitFlag(1);  // nobody sets flag 1
       }},
      {"one_aiv_sets", [] {  // the AIC's wait needs a set from BOTH AIVs
         if (g_coreType == AIC) CrossCoreWaitFlag(1);
         else if (GetBlockIdx() % 2 == 0) CrossCoreSetFlag<2, PIPE_MTE3>(1);
       }},
      {"set_never_waited", [] {
         if (g_coreType == AIC) CrossCoreSetFlag<2, PIPE_FIX>(3);
       }},
      {"mode0", [] {
         if (g_coreType == AIV) CrossCoreSetFlag<0, PIPE_MTE3>(0);
       }},
      {"flag_id_12", [] {  // 11..14 belong to SyncAll
         if (g_coreType == AIC) CrossCoreSetFlag<2, PIPE_FIX>(12);
       }},
      {"flag_id_16", [] {
         if (g_coreType == AIC) CrossCoreSetFlag<2, PIPE_FIX>(16);
       }},
      {"flag_id_15_ok", [] {  // the corrected twin: 15 is a free id
         if (g_coreType == AIC) CrossCoreSetFlag<2, PIPE_FIX>(15);
         else CrossCoreWaitFlag(15);
       }},
      {"too_many_sets", [] {
         if (g_coreType == AIC)
           for (int i = 0; i < 16; ++i) CrossCoreSetFlag<2, PIPE_FIX>(0);
       }},
      {"ids", [] {  // GetBlockIdx / GetBlockNum / GetTaskRatio / g_coreType per block
         GlobalTensor<float> gm;
         gm.SetGlobalBuffer(g_gm.data(), g_gm.size());
         const int64_t slot = 16 * (g_coreType == AIC ? GetBlockIdx() : 8 + GetBlockIdx());  // own 64 B line
         gm.SetValue(slot, static_cast<float>(100 * GetBlockNum() + 10 * GetTaskRatio() + (g_coreType == AIC ? 1 : 2)));
       }},
  };
}

int main(int argc, char** argv) {
  const auto outcome = emu_driver::run_named_case(argc, argv, kernels(), [](const std::function<void()>& k) {
    ascend_emu::launch_mix(3, 184 * 1024, emu_driver::a2_cube_mem(), k);
  });
  if (outcome != emu_driver::kRan) return emu_driver::exit_code(outcome);
  if (std::string(argv[1]) == "ids") {
    std::ostringstream o;
    for (int i = 0; i < 14; ++i) o << g_gm[16 * i] << (i + 1 < 14 ? " " : "");
    g_result = o.str();
  }
  std::printf("%s\n", g_result.c_str());
  return 0;
}
