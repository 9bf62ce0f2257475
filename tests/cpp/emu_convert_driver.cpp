// Reads raw float32 values from stdin and writes, per value, the fp16 bits and the bf16 bits the
// emulator's half/bfloat16_t conversions produce, then the float each 16-bit value converts back
// to (tests/test_ascend_emu.py compares all four with torch).
#include <cstdio>
#include <vector>

#include "emu/kernel_operator_emu.h"

int main() {
  std::vector<float> in;
  float f;
  while (std::fread(&f, sizeof f, 1, stdin) == 1) in.push_back(f);
  std::vector<uint16_t> h(in.size()), b(in.size());
  std::vector<float> hb(in.size()), bb(in.size());
  for (size_t i = 0; i < in.size(); ++i) {
    AscendC::half x(in[i]);
    AscendC::bfloat16_t y(in[i]);
    h[i] = x.bits;
    b[i] = y.bits;
    hb[i] = static_cast<float>(x);
    bb[i] = static_cast<float>(y);
  }
  std::fwrite(h.data(), 2, h.size(), stdout);
  std::fwrite(b.data(), 2, b.size(), stdout);
  std::fwrite(hb.data(), 4, hb.size(), stdout);
  std::fwrite(bb.data(), 4, bb.size(), stdout);
  return 0;
}
