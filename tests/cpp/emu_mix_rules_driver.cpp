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

using namespace AscendC;

static std::vector<float> g_gm(64, 0.0f);
static std::string g_result = "ok";

// Ping-pong: 3 rounds of "AIC writes a value, both AIVs read it and write value + 1 + sub, AIC reads
// both" -- the result is right only if every flag orders the GM accesses.
static void pingpong() {
  GlobalTensor<float> gm;
  gm.SetGlobalBuffer(g_gm.data(), g_gm.size());
  const int64_t grp = GetBlockIdx() / GetTaskRatio();
  for (int round = 0; round < 3; ++round) {
    if (g_coreType == AIC) {
      gm.SetValue(grp * 4, static_cast<float>(10 * round));
      CrossCoreSetFlag<2, PIPE_FIX>(0);
      CrossCoreWaitFlag(1);
      const float a = gm.GetValue(grp * 4 + 1), b = gm.GetValue(grp * 4 + 2);
      if (a != 10 * round + 1 || b != 10 * round + 2) g_result = "wrong";
    } else {
      CrossCoreWaitFlag(0);
      const int64_t sub = GetBlockIdx() % GetTaskRatio();
      gm.SetValue(grp * 4 + 1 + sub, gm.GetValue(grp * 4) + 1 + static_cast<float>(sub));
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
         const int64_t grp = GetBlockIdx() / GetTaskRatio();
         for (int round = 0; round < 3; ++round) {
           if (g_coreType == AIC) {
             gm.SetValue(grp * 4, static_cast<float>(10 * round));
             CrossCoreSetFlag<2, PIPE_FIX>(0);
           } else {
             CrossCoreWaitFlag(0);
             if (gm.GetValue(grp * 4) != 10 * round) g_result = "wrong";
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
      {"flag_id_11", [] {
         if (g_coreType == AIC) CrossCoreSetFlag<2, PIPE_FIX>(11);
       }},
      {"too_many_sets", [] {
         if (g_coreType == AIC)
           for (int i = 0; i < 16; ++i) CrossCoreSetFlag<2, PIPE_FIX>(0);
       }},
      {"ids", [] {  // GetBlockIdx / GetBlockNum / GetTaskRatio / g_coreType per block
         GlobalTensor<float> gm;
         gm.SetGlobalBuffer(g_gm.data(), g_gm.size());
         const int64_t slot = g_coreType == AIC ? GetBlockIdx() : 8 + GetBlockIdx();
         gm.SetValue(slot, static_cast<float>(100 * GetBlockNum() + 10 * GetTaskRatio() + (g_coreType == AIC ? 1 : 2)));
       }},
  };
}

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  auto ks = kernels();
  auto it = ks.find(argv[1]);
  if (it == ks.end()) {
    std::printf("unknown case\n");
    return 2;
  }
  try {
    ascend_emu::CubeMem caps{512 * 1024, 64 * 1024, 64 * 1024, 128 * 1024};
    ascend_emu::launch_mix(3, 184 * 1024, caps, it->second);
  } catch (const ascend_emu::EmuError& e) {
    std::printf("EmuError: %s\n", e.what());
    return 0;
  }
  if (std::string(argv[1]) == "ids") {
    std::ostringstream o;
    for (int i = 0; i < 14; ++i) o << g_gm[i] << (i + 1 < 14 ? " " : "");
    g_result = o.str();
  }
  std::printf("%s\n", g_result.c_str());
  return 0;
}
