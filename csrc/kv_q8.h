// The INT8 draft copy of the KV cache (docs/architecture.md, "The KV cache"): every BF16 K/V row
// is also stored as int8 values with one E8M0 (power-of-two) scale per kQ8Block values, written in
// the same pass as the BF16 row and derived from the BF16 bits only, so the copy of a row is a
// function of that row (prefix reuse, verify overwrites and tree moves keep it consistent). The
// MX draft passes attend over it: 1 + 1/32 bytes per value instead of 2.
//
// Quantization of a block x[0..32): s = the smallest integer with max|x| <= 127 · 2^s (clamped to
// [-126, 127]); q = round-half-even(x / 2^s), clamped to [-127, 127]; scale byte = s + 127. Every
// x / 2^s is exact, so is the rounding; dequantization q · 2^s is exact in FP32.
#pragma once
#include <cstdint>
#include <cstring>

namespace qspec {

constexpr int64_t kQ8Block = 32;

// n BF16 values (n a multiple of kQ8Block) -> n int8 values and n / kQ8Block scale bytes.
void kv_q8_quantize(const uint16_t* bf16, int64_t n, int8_t* q, uint8_t* scale);

// 2^(e - 127) for a scale byte e in [1, 254].
inline float kv_q8_scale(uint8_t e) {
  const uint32_t u = uint32_t(e) << 23;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

}  // namespace qspec
