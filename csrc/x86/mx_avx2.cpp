// AVX2 MX direct cast: the integer algorithm of csrc/mx.cpp (cast_element) on 8 lanes, bit for
// bit the same codes and scales. Compiled with -mavx2 -mfma -mf16c (file suffix); every helper
// here is static so no AVX2 code can be linked into the baseline paths.
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "mx.h"

namespace qspec {

namespace {

// 8 elements -> 8 codes in 32-bit lanes (see cast_element in csrc/mx.cpp for the reasoning).
static inline __m256i cast8(__m256i v, int shared_exp, const MxCastConsts& c) {
  const __m256i abs_mask = _mm256_set1_epi32(0x7FFFFFFF);
  const __m256i a = _mm256_and_si256(v, abs_mask);
  const __m256i negative = _mm256_srai_epi32(v, 31);  // all ones where the sign bit is set
  const __m256i efield = _mm256_srli_epi32(a, 23);
  const __m256i is_sub = _mm256_cmpeq_epi32(efield, _mm256_setzero_si256());
  // |V| = m * 2^ev, m < 2^24 (FP32 subnormals: m = a, ev = -149).
  const __m256i m = _mm256_blendv_epi8(
      _mm256_or_si256(_mm256_and_si256(a, _mm256_set1_epi32(0x7FFFFF)), _mm256_set1_epi32(0x800000)),
      a, is_sub);
  const __m256i ev = _mm256_sub_epi32(_mm256_max_epi32(efield, _mm256_set1_epi32(1)),
                                      _mm256_set1_epi32(150));
  const __m256i s = _mm256_set1_epi32(shared_exp);
  __m256i q;
  if (c.is_int) {
    q = _mm256_set1_epi32(-6);
  } else {
    // floor(log2 m) exactly: m < 2^24 converts to FP32 exactly; read its exponent field.
    const __m256i log2m = _mm256_sub_epi32(
        _mm256_srli_epi32(_mm256_castps_si256(_mm256_cvtepi32_ps(m)), 23), _mm256_set1_epi32(127));
    const __m256i e = _mm256_sub_epi32(_mm256_add_epi32(log2m, ev), s);  // floor(log2 |P|)
    q = _mm256_sub_epi32(_mm256_max_epi32(e, _mm256_set1_epi32(c.emin)), _mm256_set1_epi32(c.mbits));
  }
  // shift = q - (ev - s) >= 6 for every input (see mx.cpp); clamp to [1, 31]: >= 26 gives 0.
  __m256i shift = _mm256_add_epi32(_mm256_sub_epi32(q, ev), s);
  shift = _mm256_min_epi32(_mm256_max_epi32(shift, _mm256_set1_epi32(1)), _mm256_set1_epi32(31));
  // Round half to even: (m + 2^(shift-1) - 1 + lsb) >> shift, lsb = bit `shift` of m.
  const __m256i one = _mm256_set1_epi32(1);
  const __m256i half_m1 = _mm256_sub_epi32(_mm256_sllv_epi32(one, _mm256_sub_epi32(shift, one)), one);
  const __m256i lsb = _mm256_and_si256(_mm256_srlv_epi32(m, shift), one);
  const __m256i n = _mm256_srlv_epi32(_mm256_add_epi32(_mm256_add_epi32(m, half_m1), lsb), shift);
  __m256i mag = n;
  if (!c.is_int)
    mag = _mm256_add_epi32(_mm256_slli_epi32(_mm256_sub_epi32(q, _mm256_set1_epi32(c.qmin)), c.mbits), n);
  mag = _mm256_min_epu32(mag, _mm256_set1_epi32(int(c.maxmag)));  // saturate
  const __m256i zero = _mm256_cmpeq_epi32(n, _mm256_setzero_si256());
  mag = _mm256_andnot_si256(zero, mag);  // zero (incl. -0) -> code 0
  if (c.is_int)  // two's complement: (mag ^ neg) - neg
    return _mm256_and_si256(_mm256_sub_epi32(_mm256_xor_si256(mag, negative), negative),
                            _mm256_set1_epi32(0xFF));
  const __m256i sign = _mm256_and_si256(negative, _mm256_set1_epi32(1 << (c.bits - 1)));
  return _mm256_or_si256(mag, _mm256_andnot_si256(zero, sign));
}

static inline uint8_t cast_block_avx2(const float* x, uint8_t* codes, const MxCastConsts& c) {
  __m256i v[4];
  for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 8 * i));
  const __m256i abs_mask = _mm256_set1_epi32(0x7FFFFFFF);
  __m256i amax = _mm256_max_epu32(_mm256_max_epu32(_mm256_and_si256(v[0], abs_mask), _mm256_and_si256(v[1], abs_mask)),
                                  _mm256_max_epu32(_mm256_and_si256(v[2], abs_mask), _mm256_and_si256(v[3], abs_mask)));
  amax = _mm256_max_epu32(amax, _mm256_permute2x128_si256(amax, amax, 1));
  amax = _mm256_max_epu32(amax, _mm256_shuffle_epi32(amax, _MM_SHUFFLE(1, 0, 3, 2)));
  amax = _mm256_max_epu32(amax, _mm256_shuffle_epi32(amax, _MM_SHUFFLE(2, 3, 0, 1)));
  const uint32_t amax_bits = uint32_t(_mm256_cvtsi256_si32(amax));
  // Block classes and step 1 exactly as cast_block in csrc/mx.cpp.
  if (amax_bits >= 0x7F800000u || amax_bits < 0x00800000u) {
    std::memset(codes, 0, kMxBlock);
    return amax_bits >= 0x7F800000u ? kE8M0Nan : 0;
  }
  int shared_exp = int(amax_bits >> 23) - 127 - c.emax;
  if (shared_exp > 127) {
    std::memset(codes, 0, kMxBlock);
    return kE8M0Nan;
  }
  if (shared_exp < -127) shared_exp = -127;
  const __m256i c0 = cast8(v[0], shared_exp, c), c1 = cast8(v[1], shared_exp, c);
  const __m256i c2 = cast8(v[2], shared_exp, c), c3 = cast8(v[3], shared_exp, c);
  // Codes are < 256: pack 32 -> 16 -> 8 bits, then undo the per-lane interleave of the packs.
  const __m256i p01 = _mm256_packus_epi32(c0, c1), p23 = _mm256_packus_epi32(c2, c3);
  const __m256i p = _mm256_packus_epi16(p01, p23);
  const __m256i out = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes), out);
  return uint8_t(shared_exp + kE8M0Bias);
}

}  // namespace

// One row: x[k] -> codes[kpad], scales[kpad/32]. The last, partial block goes through a
// zero-padded copy.
void mx_quantize_row_avx2(const float* x, int64_t k, uint8_t* codes, uint8_t* scales,
                          const MxCastConsts& c) {
  const int64_t full = k / kMxBlock;
  for (int64_t b = 0; b < full; ++b)
    scales[b] = cast_block_avx2(x + b * kMxBlock, codes + b * kMxBlock, c);
  if (k % kMxBlock) {
    alignas(32) float tail[kMxBlock] = {0};
    std::memcpy(tail, x + full * kMxBlock, size_t(k % kMxBlock) * sizeof(float));
    scales[full] = cast_block_avx2(tail, codes + full * kMxBlock, c);
  }
}

}  // namespace qspec
