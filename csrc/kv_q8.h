// The draft copy of the KV cache (docs/architecture.md, "The KV cache"): every BF16 K/V row is
// also stored in a compact form with one E8M0 (power-of-two) scale per kQ8Block values, written in
// the same pass as the BF16 row and derived from the BF16 bits only, so the copy of a row is a
// function of that row (prefix reuse, verify overwrites and tree moves keep it consistent). The
// MX draft passes attend over it. Two forms (KvCacheView::q_bits):
//
// INT8 (8 bits): 1 + 1/32 bytes per value instead of 2. Quantization of a block x[0..32): s = the
// smallest integer with max|x| <= 127 · 2^s (clamped to [-126, 127]); q = round-half-even(x / 2^s),
// clamped to [-127, 127]; scale byte = s + 127. Every x / 2^s is exact, so is the rounding;
// dequantization q · 2^s is exact in FP32.
//
// MXFP4 (4 bits): 1/2 + 1/32 bytes per value (26.6% of BF16). The OCP MX direct cast of the block
// (csrc/mx.h, the drafts' weight cast): E2M1 codes two a byte (element 2i in the low nibble of byte
// i, 2i + 1 in the high one) and the E8M0 scale; dequantization is exact in FP32.
#pragma once
#include <cstdint>
#include <cstring>

namespace qspec {

constexpr int64_t kQ8Block = 32;

// n BF16 values (n a multiple of kQ8Block) -> n int8 values and n / kQ8Block scale bytes.
void kv_q8_quantize(const uint16_t* bf16, int64_t n, int8_t* q, uint8_t* scale);

// n BF16 values (n a multiple of kQ8Block) -> n / 2 bytes of packed E2M1 codes and n / kQ8Block
// E8M0 scale bytes (the MX direct cast of each block).
void kv_fp4_quantize(const uint16_t* bf16, int64_t n, uint8_t* packed, uint8_t* scale);

// The value of an E2M1 code (bit 3 the sign), before the scale.
inline float kv_fp4_value(uint8_t code) {
  static constexpr float kMag[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
  return code & 8 ? -kMag[code & 7] : kMag[code & 7];
}

// 2^(e - 127) for a scale byte e in [1, 254]; 0 gives 0 (an MX block flushed to zero) and 0xFF
// infinity (the MX NaN scale: its values become NaN, as the BF16 rows they copy hold NaN or Inf).
inline float kv_q8_scale(uint8_t e) {
  const uint32_t u = uint32_t(e) << 23;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

}  // namespace qspec
