// The one fp32 -> bf16 rounding of the CPU side (native kernels, the AscendC emulator): round to
// nearest, ties to even; every NaN becomes the quiet NaN 0x7FC0; fp32 subnormals are rounded, not
// flushed; overflow rounds to +-inf. These are the semantics of c10::BFloat16 (and so of
// `tensor.to(torch.bfloat16)`), bit for bit. Header-only and free of torch so that the emulator
// and the C++ test drivers can use it; the 16-lane AVX-512 form in common/vec.h
// (vec::f32_to_bf16_bits) is the same integer arithmetic, lane by lane.
#pragma once

#include <cstdint>
#include <cstring>

namespace amo {
namespace bf16 {

inline uint16_t from_f32(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof(x));
  if ((x & 0x7fffffffu) > 0x7f800000u) return 0x7FC0u;  // NaN
  return static_cast<uint16_t>((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

inline float to_f32(uint16_t b) {
  const uint32_t x = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &x, sizeof(f));
  return f;
}

}  // namespace bf16
}  // namespace amo
