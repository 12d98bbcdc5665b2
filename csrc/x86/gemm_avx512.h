// Helpers shared by the AVX-512 GEMM translation units only (csrc/x86/gemm*_avx512.cpp,
// gemm_q4_avx512vnni.cpp, gemm_q4_amx.cpp: each is compiled with AVX-512 among its flags).
// Everything here is `static inline`: each AVX-512 file gets its own private copy, none can be
// linked into baseline code (gemm_internal.h explains why that matters).
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "gemm_internal.h"
#include "vec_avx512.h"

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


// fp32 -> bf16 bits, round to nearest even (u + 0x7FFF + bit 16), NaN quieted (u | 0x400000):
// 16 values a step, the row's tail through masks, zeros from k to kp.
static inline __m256i round16_bf16(const float* src, int64_t c, int64_t k) {
  const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF), inf = _mm512_set1_epi32(0x7F800000);
  const __m512i quiet = _mm512_set1_epi32(0x00400000), bias = _mm512_set1_epi32(0x7FFF);
  const __m512i one = _mm512_set1_epi32(1);
  const __mmask16 in = c + 16 <= k ? __mmask16(0xFFFF) : c >= k ? __mmask16(0) : __mmask16((1u << (k - c)) - 1);
  const __m512i u = _mm512_maskz_loadu_epi32(in, src + c);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, abs_mask), inf);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
  __m512i v = _mm512_add_epi32(_mm512_add_epi32(u, bias), odd);
  v = _mm512_mask_or_epi32(v, nan, u, quiet);
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(v, 16));
}

// r[0..15] (16 x 16 int32) transposed in place (vec_avx512.h's transpose of 32-bit lanes).
static inline void transpose16(__m512i r[16]) { qspec::avx512::transpose16(reinterpret_cast<__m512*>(r)); }

// A register tile: rows [m0, m0 + mb) of x times nbn row blocks from nb, MX blocks of [k0, k1).
using TileFn = void (*)(const GemmArgs&, int64_t nb, int64_t m0, int64_t k0, int64_t k1, float* acc, bool init);

constexpr int64_t kRowTilesL1Bytes = 32768;  // K-chunk budget when several row tiles re-read weights

// x split into balanced row tiles of <= mbmax rows (17 rows: 9 + 8, never 16 + 1); groups of
// nbmax row blocks. With several row tiles, K is chunked so the group's weights are re-read from
// L1. table[(mb - 1) * row_stride + nbn - 1] is the tile of mb rows x nbn blocks.
static inline void run_row_tiles(const GemmArgs& a, int64_t nb0, int64_t nb1, float* acc, const TileFn* table, int row_stride,
                                 int mbmax, int nbmax, int64_t weight_bytes_per_k, int64_t x_bytes_per_k) {
  const int64_t ntiles = (a.m + mbmax - 1) / mbmax;
  int64_t kc = ntiles == 1 ? a.kp : (kRowTilesL1Bytes / (weight_bytes_per_k * nbmax + x_bytes_per_k * a.m)) / kKBlk * kKBlk;
  if (kc < kKBlk) kc = kKBlk;
  for (int64_t nb = nb0; nb < nb1; nb += nbmax) {
    const int nbn = int(nb1 - nb < nbmax ? nb1 - nb : nbmax);
    for (int64_t k0 = 0; k0 < a.kp; k0 += kc) {
      const int64_t k1 = k0 + kc < a.kp ? k0 + kc : a.kp;
      for (int64_t tile = 0, m0 = 0; tile < ntiles; ++tile) {
        const int mb = int(a.m * (tile + 1) / ntiles - m0);
        table[(mb - 1) * row_stride + nbn - 1](a, nb, m0, k0, k1, acc, k0 == 0);
        m0 += mb;
      }
    }
    store_rows(a, nb, nbn, acc);
  }
}


// One 32-byte MXFP4 slab (16 rows x 4 k as nibbles, csrc/gemm.h) -> 64 bytes through a 16-entry LUT:
// bytes 0-31 rows 0-7 (low nibbles), 32-63 rows 8-15 (high nibbles), row r's 4 k at 4 * (r % 8).
static inline __m512i q4_slab(const uint8_t* p, __m512i lut) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1);
  return _mm512_shuffle_epi8(lut, _mm512_and_si512(both, _mm512_set1_epi8(0x0F)));
}
// LUT of q4_slab: 2*E2M1 + 12 as unsigned bytes (the vpmaddubsw / vpdpbusd operand; 12*sum(q) is
// taken off per block).
static inline __m512i q4_lut_biased() {
  return _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
}

}  // namespace avx512
}  // namespace detail
}  // namespace qspec
