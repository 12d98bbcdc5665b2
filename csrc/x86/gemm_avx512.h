// Helpers shared by the AVX-512 GEMM translation units (csrc/x86/gemm*_avx512.cpp) only.
// Everything here is `static inline`: each AVX-512 file gets its own private copy, none can be
// linked into baseline code (gemm_internal.h explains why that matters).
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "gemm_internal.h"

namespace qspec {
namespace detail {
namespace avx512 {

// A tile rebases acc to its first row on entry (acc = acc_row(acc, m0)) and indexes rows from
// there: with acc_row(acc, m0 + i) GCC 12 kept a stack copy of every accumulator, stored at
// each k step (objdump of the M = 2 BF16 tile: 8 stores per 16 FMAs; none after).
static inline float* acc_row(float* acc, int64_t i) { return acc + i * kAccCols; }

// Copy the scratch columns of nbn row blocks from nb on (row i at acc + i * kAccCols) to y.
static inline void store_rows(const GemmArgs& a, int64_t nb, int nbn, const float* acc) {
  const int64_t left = a.n - nb * kRows;
  const int64_t cols = left < nbn * kRows ? left : nbn * kRows;
  for (int64_t i = 0; i < a.m; ++i)
    std::memcpy(a.y + i * a.ldy + nb * kRows, acc + i * kAccCols, size_t(cols) * 4);
}

// 16 E8M0 bytes -> 2^(s-127); 0x00 -> 2^-127 (subnormal), 0xFF -> NaN (as ref / avx2). The
// special bytes are found on the 16 bytes before widening (two xmm compares).
static inline __m512 e8m0x16(const uint8_t* p) {
  const __m128i s = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  __m512i bits = _mm512_slli_epi32(_mm512_cvtepu8_epi32(s), 23);
  const __mmask16 zero = __mmask16(_mm_movemask_epi8(_mm_cmpeq_epi8(s, _mm_setzero_si128())));
  const __mmask16 nan = __mmask16(_mm_movemask_epi8(_mm_cmpeq_epi8(s, _mm_set1_epi8(-1))));
  bits = _mm512_mask_mov_epi32(bits, zero, _mm512_set1_epi32(0x00400000));
  bits = _mm512_mask_mov_epi32(bits, nan, _mm512_set1_epi32(0x7FC00000));
  return _mm512_castsi512_ps(bits);
}

}  // namespace avx512
}  // namespace detail
}  // namespace qspec
