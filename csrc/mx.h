// OCP Microscaling (MX) v1.0 element formats: the facts every MX codec and kernel shares.
// Codes are kept one per byte in this canonical form (sign in the element's top bit);
// packed layouts (two FP4 codes a byte, ...) belong to the packers that use them.
#pragma once
#include <array>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace qspec {

constexpr int kMxBlock = 32;           // elements per shared scale (OCP MX v1.0, k = 32)
constexpr uint8_t kE8M0Nan = 0xFF;     // E8M0 NaN scale
constexpr int kE8M0Bias = 127;

enum class WFormat : int {
  bf16 = 0,
  mxfp4 = 1,       // FP4 E2M1
  mxfp6_e2m3 = 2,  // FP6 E2M3
  mxfp6_e3m2 = 3,  // FP6 E3M2
  mxfp8_e4m3 = 4,  // FP8 E4M3 (NaN only)
  mxfp8_e5m2 = 5,  // FP8 E5M2 (IEEE Inf/NaN)
  mxint8 = 6,      // INT8, value = code * 2^-6
};

struct MxFormat {
  const char* name;
  int bits;         // element width
  int ebits, mbits; // exponent / mantissa bits (0/7 for INT8)
  int bias;
  int emax;         // emax_elem of the spec table
  float max_normal;
};

inline const MxFormat& mx_format(WFormat f) {
  static const MxFormat table[] = {
      {"bf16", 16, 8, 7, 127, 127, 3.3895314e38f},
      {"mxfp4", 4, 2, 1, 1, 2, 6.0f},
      {"mxfp6_e2m3", 6, 2, 3, 1, 2, 7.5f},
      {"mxfp6_e3m2", 6, 3, 2, 3, 4, 28.0f},
      {"mxfp8_e4m3", 8, 4, 3, 7, 8, 448.0f},
      {"mxfp8_e5m2", 8, 5, 2, 15, 15, 57344.0f},
      {"mxint8", 8, 0, 7, 0, 0, 1.984375f},
  };
  int i = int(f);
  if (i < 0 || i > int(WFormat::mxint8)) throw std::invalid_argument("unknown weight format");
  return table[i];
}

inline WFormat wformat_from_name(const std::string& name) {
  for (int i = 0; i <= int(WFormat::mxint8); ++i)
    if (name == mx_format(WFormat(i)).name) return WFormat(i);
  throw std::invalid_argument("unknown format '" + name +
                              "' (expected bf16, mxfp4, mxfp6_e2m3, mxfp6_e3m2, mxfp8_e4m3, "
                              "mxfp8_e5m2 or mxint8)");
}

// Value of one element code (canonical one-code-per-byte form), before the shared scale.
inline float mx_decode(WFormat f, uint8_t code) {
  const MxFormat& m = mx_format(f);
  if (f == WFormat::mxint8) return float(int8_t(code)) * (1.0f / 64.0f);
  const int sign = (code >> (m.bits - 1)) & 1;
  const int e = (code >> m.mbits) & ((1 << m.ebits) - 1);
  const int man = code & ((1 << m.mbits) - 1);
  float v;
  if (f == WFormat::mxfp8_e4m3 && e == 15 && man == 7) {
    v = NAN;
  } else if (f == WFormat::mxfp8_e5m2 && e == 31) {
    v = man == 0 ? INFINITY : NAN;
  } else if (e == 0) {
    v = std::ldexp(float(man) / float(1 << m.mbits), 1 - m.bias);
  } else {
    v = std::ldexp(1.0f + float(man) / float(1 << m.mbits), e - m.bias);
  }
  return sign ? -v : v;
}

// All codes of a format decoded (256 entries; codes past 2^bits are unused).
inline std::array<float, 256> mx_decode_table(WFormat f) {
  std::array<float, 256> t{};
  const int n = 1 << mx_format(f).bits;
  for (int c = 0; c < n && c < 256; ++c) t[c] = mx_decode(f, uint8_t(c));
  return t;
}

// E8M0 scale byte -> float (0xFF -> NaN). 2^-127 is an FP32 subnormal, still exact.
inline float e8m0_to_float(uint8_t s) {
  return s == kE8M0Nan ? NAN : std::ldexp(1.0f, int(s) - kE8M0Bias);
}

// Per-format constants of the direct cast (built by csrc/mx.cpp, shared with its ISA variants).
struct MxCastConsts {
  int emax;         // emax_elem
  int emin;         // exponent of the smallest normal element: 1 - bias
  int mbits;
  int qmin;         // log2 of the subnormal spacing: emin - mbits
  int bits;
  uint32_t maxmag;  // largest finite code magnitude (sign clear): max normal
  bool is_int;      // INT8: value = code * 2^-6, two's complement
  bool mse;         // the "mse" scale rule (MxRule::mse): set by csrc/mx.cpp's cast_consts only
};

// How a block's shared exponent is chosen. ocp: the spec's direct cast, floor(log2 max|V|) -
// emax_elem. mse: that exponent or the one above, whichever gives the block the smaller squared
// error (ties keep the spec's): the spec's exponent saturates every |V| in [max normal, 2^(emax+1))
// * X to max normal (FP4: [6, 8) -> 6), and one binade up halves the resolution instead. Defined
// for the 4- and 6-bit FP formats (the drafts' cast), where the error difference is exact in
// 64-bit integers; the codes are valid MX either way.
enum class MxRule { ocp, mse };

// One row of the cast, AVX2 (csrc/x86/mx_avx2.cpp); call only when isa_selected() >= avx2.
void mx_quantize_row_avx2(const float* x, int64_t k, uint8_t* codes, uint8_t* scales,
                          const MxCastConsts& c);

// MX direct cast of fp32 rows x[rows, k] along k (csrc/mx.cpp): codes [rows, kpad] one canonical
// code per byte, scales [rows, kpad/32] E8M0, kpad = ceil(k/32)*32. Throws for bf16.
// rule: MxRule (mse throws std::invalid_argument for the 8-bit formats).
void mx_quantize_rows(WFormat f, const float* x, int64_t rows, int64_t k, uint8_t* codes,
                      uint8_t* scales, MxRule rule = MxRule::ocp);
// Inverse: out[rows, k] = element value * 2^(scale-127) (scale 0xFF -> NaN), exact in fp32.
void mx_dequantize_rows(WFormat f, const uint8_t* codes, const uint8_t* scales, int64_t rows,
                        int64_t k, float* out);

}  // namespace qspec
