// BF16 <-> FP32 for the scalar code (the BF16 cache, the reference kernels, the draft copy).
#pragma once
#include <cstdint>
#include <cstring>

namespace qspec {

inline float bf16_to_f32(uint16_t b) {  // exact
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even; NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

}  // namespace qspec
