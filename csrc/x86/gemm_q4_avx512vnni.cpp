// MXFP4 x Q8 activations with AVX512-VNNI (compiled with AVX-512F/BW/VL/DQ + VNNI; chosen at run
// time on the avx512 path when the CPU has VNNI: gemm.cpp, mx_vnni_enabled()).
//
// One zmm = one 16-row x 4-k slab of a packed row block, decoded once (two nibble vectors, one
// LUT shuffle to 2*E2M1 + 12 as unsigned bytes) and applied to every row of the tile with one
// vpdpbusd per row: 64 multiply-adds and the int32 accumulation in one instruction, where the
// vpmaddubsw path needs a product, an int16 add and (per 4 slabs) a widening vpmaddwd. The
// integer block sums are exact (|sum| <= 32 * 24 * 127), so this path computes the same isum as
// ref and the same fp32 epilogue fma(float(isum - xc), e8m0 * xd, y) per block in k order:
// bit-identical to ref, avx2 and avx512 (gemm.h), whatever M or the other rows.
// Tested against ref on VNNI hardware (a Sapphire Rapids VM) and under emulation
// (tests/test_isa_emulation.py).
#include <immintrin.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <utility>

#include "gemm_avx512.h"
#include "gemm_internal.h"

namespace qspec {
namespace detail {
namespace {

using avx512::acc_row;
using avx512::e8m0x16;

constexpr int kMaxMB = 8, kMaxNB = 4;
constexpr int64_t kPrefetchSlabs = 64;   // 2 KB ahead in each row block's stream

// MB rows of Q8 x (from m0) times NB row blocks (from nb) over the MX blocks of [k0, k1).
// Accumulators: MB * NB int32 vectors per MX block (<= 16, + NB weights + 1 broadcast of 32 zmm);
// the fp32 sums live in acc (row i at acc_row(acc, i), block j at column j * 16).
template <int MB, int NB>
void q4_vnni_tile(const GemmArgs& a, int64_t nb, int64_t m0, int64_t k0, int64_t k1, float* acc, bool init) {
  acc = acc_row(acc, m0);  // rows from the tile's first: see acc_row
  const int64_t kb = a.kp / kKBlk;
  if (init)
    for (int i = 0; i < MB; ++i) std::memset(acc_row(acc, i), 0, NB * 16 * 4);
  const int64_t block_bytes = (a.kp / 4) * 32;
  const uint8_t* w[NB];
  const uint8_t* s[NB];
  for (int j = 0; j < NB; ++j) {
    w[j] = a.data + (nb + j) * block_bytes;
    s[j] = a.scales + (nb + j) * kb * kRows;
  }
  const int8_t* q[MB];
  for (int i = 0; i < MB; ++i) q[i] = a.xq + (m0 + i) * a.kp;
  const __m512i lut = avx512::q4_lut_biased();
  for (int64_t b = k0 / kKBlk; b < k1 / kKBlk; ++b) {
    __m512i isum[MB][NB];
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < NB; ++j) isum[i][j] = _mm512_setzero_si512();
    for (int g = 0; g < 8; ++g) {
      const int64_t slab = b * 8 + g;
      __m512i wv[NB];
      for (int j = 0; j < NB; ++j) {
        if (g % 2 == 0) _mm_prefetch(stream_ahead(w[j], slab * 32, kPrefetchSlabs * 32, block_bytes, NB * block_bytes), _MM_HINT_T0);
        wv[j] = avx512::q4_slab(w[j] + slab * 32, lut);
      }
      for (int i = 0; i < MB; ++i) {
        int32_t q4;
        std::memcpy(&q4, q[i] + slab * 4, 4);
        const __m512i xq = _mm512_set1_epi32(q4);
        for (int j = 0; j < NB; ++j) isum[i][j] = _mm512_dpbusd_epi32(isum[i][j], wv[j], xq);
      }
    }
    for (int j = 0; j < NB; ++j) {
      const __m512 d = e8m0x16(s[j] + b * kRows);
      for (int i = 0; i < MB; ++i) {
        const int64_t ib = (m0 + i) * kb + b;
        const __m512 fi = _mm512_cvtepi32_ps(_mm512_sub_epi32(isum[i][j], _mm512_set1_epi32(a.xc[ib])));
        const __m512 dd = _mm512_mul_ps(d, _mm512_set1_ps(a.xd[ib]));
        float* pa = acc_row(acc, i) + j * 16;
        _mm512_storeu_ps(pa, _mm512_fmadd_ps(fi, dd, _mm512_loadu_ps(pa)));
      }
    }
  }
}

using avx512::TileFn;

template <int I>
constexpr TileFn tile_entry() {
  return q4_vnni_tile<I / kMaxNB + 1, I % kMaxNB + 1>;
}
template <int... I>
constexpr std::array<TileFn, sizeof...(I)> make_tiles(std::integer_sequence<int, I...>) {
  return {tile_entry<I>()...};
}
constexpr auto kTiles = make_tiles(std::make_integer_sequence<int, kMaxMB * kMaxNB>());

}  // namespace

// x in balanced row tiles of <= 8 rows (M = 9: 5 + 4); with several row tiles the K chunk of a
// group's weights is re-read from L1 (and decoded again: the decode is a few ops per slab).
void gemm_blocks_q4_vnni(const GemmArgs& a, int64_t nb0, int64_t nb1, float* acc) {
  const int64_t ntiles = (a.m + kMaxMB - 1) / kMaxMB;
  const int nbmax = mx_row_blocks(int((a.m + ntiles - 1) / ntiles));  // per CPU: gemm.h
  avx512::run_row_tiles(a, nb0, nb1, acc, kTiles.data(), kMaxNB, kMaxMB, nbmax, 16, 1);
}

}  // namespace detail
}  // namespace qspec
