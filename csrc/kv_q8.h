// The draft copy of the KV cache (docs/architecture.md, "The KV cache"), derived from the BF16 bits
// only and written by the forward passes; the MX draft passes attend over it. Two formats
// (KvCacheView::k_bits / v_bits):
//   "int8": K and V rows as INT8, one E8M0 scale per 32 values (51.6% of the BF16 bytes);
//   "int4": V rows as rotated INT4 (below), K as INT4 per channel over each group of G rows (a
//           page of the pool): 28.1% at G = 32 for head_dim 128. 4-bit K rows quantized per row,
//           in every form tried (MXFP4, INT4, finer scales, blocks of 8, rotated or not), cost the
//           drafts most of their acceptance: a few K channels are far larger than the rest, and
//           the error a per-row scale leaves lands where q is large too. Per channel it does not
//           (KIVI; README, "Long prompts").
// A row's V copy (and INT8 K copy) is a function of that row, written in the same pass as the BF16
// row; a group's K copy is a function of the group's G rows, written once all of them are
// committed (kv_k4_group; the forward of a target pass finalizes the groups below its first
// position, attention reads a group's copy only once its flag is set and the BF16 K rows
// otherwise), so prefix reuse, verify overwrites and tree moves keep both consistent.
//
// INT8 (8 bits): 1 + 1/32 bytes per value instead of 2. Quantization of a block x[0..32): s = the
// smallest integer with max|x| <= 127 · 2^s (clamped to [-126, 127]); q = round-half-even(x / 2^s),
// clamped to [-127, 127]; scale byte = s + 127. Every x / 2^s is exact, so is the rounding;
// dequantization q · 2^s is exact in FP32.
//
// INT4 V (4 bits): 1/2 + 1/32 bytes per value, in a rotated basis. Each head's row of head_dim
// values is cut into blocks of P = the largest power of two dividing head_dim, and each block x
// becomes H·D·x: D a fixed ±1 diagonal (kv_rot_flip), H the unnormalized P×P Walsh-Hadamard
// matrix (H·H = P·I), as a fast transform whose butterflies run in a fixed order (kv_rotate), so
// a block's values come out near-Gaussian and a 4-bit grid fits them. Quantization of a block
// y[0..32) of the rotated values: the scale is the smallest UE5M3 value s (one byte e: 3 mantissa
// bits m = e & 7, exponent field e >> 3, s = (1 + m/8) · 2^((e >> 3) - 16); e = 0 is 0, the
// block's values all 0; e = 0xFF is NaN, a block with a non-finite value, as the BF16 rows it
// copies hold NaN or Inf) with 7·s >= max|y|, clamped to [kv_q4_scale(1), kv_q4_scale(0xFE)];
// q = round-half-even(y / s) clamped to [-7, 7], two's complement nibbles two a byte (element 2i
// in the low nibble of byte i). Attention never rotates V back per key: Σ w_j·v'_j =
// H·D·(Σ w_j·v_j), undone once per output row (kv_unrotate).
#pragma once
#include <cstdint>
#include <cstring>

namespace qspec {

constexpr int64_t kQ8Block = 32;

// n BF16 values (n a multiple of kQ8Block) -> n int8 values and n / kQ8Block scale bytes.
void kv_q8_quantize(const uint16_t* bf16, int64_t n, int8_t* q, uint8_t* scale);

// n BF16 values (n a multiple of head_dim, head_dim of kQ8Block) -> n / 2 bytes of packed INT4
// values in the rotated basis and n / kQ8Block UE5M3 scale bytes.
void kv_q4_quantize(const uint16_t* bf16, int64_t n, int64_t head_dim, uint8_t* packed, uint8_t* scale);

// INT4 K over a group of g rows x[g][n] (n = kv_heads · head_dim BF16 values, head_dim a multiple
// of kQ8Block): per head and channel c, over the g values: lo, hi = their min and max; center =
// the BF16 value nearest (lo + hi) / 2 (ties to even); r = the largest |x - center|; the scale is
// the smallest UE5M3 value s with 7·s >= r (the INT4 V scale's rule; 0 when r = 0); q =
// round-half-even((x - center) / s) clamped to [-7, 7], dequantized center + q · s. A channel with
// a non-finite value gets scale byte 0xFF (NaN) and center 0. Out: packed[g][n / 2] (element c of
// row i in nibble c & 1 of byte c / 2, two's complement) and params[3 · n]: per head h at
// h · 3 · head_dim, its head_dim centers (BF16 bits, little-endian) then its head_dim scale bytes.
void kv_k4_group(const uint16_t* x, int64_t g, int64_t n, int64_t head_dim, uint8_t* packed, uint8_t* params);

// The rotation's block size for a head_dim (a multiple of kQ8Block): its largest power-of-two divisor.
inline int64_t kv_rot_size(int64_t head_dim) { return head_dim & -head_dim; }

// D's entry i: -1 where the top bit of i · 0x9E3779B9 (mod 2^32) is set, else +1.
inline bool kv_rot_flip(int64_t i) { return (uint32_t(i) * 0x9E3779B9u) >> 31; }

// The fast Walsh-Hadamard transform of each block of p values of x[0..n), in place: stages
// h = 1, 2, 4, .. p / 2, each pair (j, j + h) -> (x_j + x_{j+h}, x_j - x_{j+h}) in index order.
inline void kv_fwht(float* x, int64_t n, int64_t p) {
  for (int64_t b = 0; b < n; b += p)
    for (int64_t h = 1; h < p; h *= 2)
      for (int64_t i = b; i < b + p; i += 2 * h)
        for (int64_t j = i; j < i + h; ++j) {
          const float u = x[j], v = x[j + h];
          x[j] = u + v;
          x[j + h] = u - v;
        }
}

// x <- H·D·x per block of p (the copy's basis); x <- D·H·x / p undoes it.
inline void kv_rotate(float* x, int64_t n, int64_t p) {
  for (int64_t i = 0; i < n; ++i)
    if (kv_rot_flip(i & (p - 1))) x[i] = -x[i];  // p a power of two
  kv_fwht(x, n, p);
}
inline void kv_unrotate(float* x, int64_t n, int64_t p) {
  kv_fwht(x, n, p);
  const float inv = 1.f / float(p);  // exact: p a power of two
  for (int64_t i = 0; i < n; ++i) x[i] = (kv_rot_flip(i & (p - 1)) ? -x[i] : x[i]) * inv;
}

// The UE5M3 scale of an INT4 block's byte (see above).
inline float kv_q4_scale(uint8_t e) {
  if (e == 0) return 0.f;
  if (e == 0xFF) return __builtin_nanf("");
  const uint32_t u = (uint32_t(e) << 20) + (111u << 23);  // exponent field (e >> 3) + 111, mantissa e & 7
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// The INT4 value of nibble c (two's complement).
inline int kv_q4_value(uint8_t c) { return (c & 7) - (c & 8); }

// 2^(e - 127): the INT8 copy's scale of byte e (in [1, 254]).
inline float kv_q8_scale(uint8_t e) {
  const uint32_t u = uint32_t(e) << 23;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

}  // namespace qspec
