// Helpers shared by the AVX2 GEMM translation units only (csrc/x86/gemm_avx2.cpp and
// gemm_q4_avxvnni.cpp: each is compiled with AVX2 + FMA + F16C among its flags), and the MXFP4
// row tiles of both: vpmaddubsw there, vpdpbusd (AVX-VNNI) here. Everything is `static inline` or
// a template in an unnamed namespace: each file gets its own copy, none is linked into baseline
// code or into the other file (gemm_internal.h explains why that matters).
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "gemm_internal.h"

namespace qspec {
namespace detail {
namespace avx2 {
namespace {

constexpr int64_t kL1Bytes = 16384;  // K-chunk budget when several row tiles re-read weights

using TileFn = void (*)(const GemmArgs&, int64_t, int64_t, int64_t, int64_t, float*, bool);

// A tile rebases acc to its first row on entry (acc = acc_row(acc, m0)) and indexes rows from
// there: with acc_row(acc, m0 + i) GCC 12 kept a stack copy of every accumulator, stored at
// each k step (objdump of the M = 2 BF16 tile: 8 stores per 16 FMAs; none after).
inline float* acc_row(float* acc, int64_t i) { return acc + i * kAccCols; }

inline void store_rows(const GemmArgs& a, int64_t nb, int nbn, const float* acc) {
  for (int64_t i = 0; i < a.m; ++i) {
    const float* src = acc + i * kAccCols;
    float* dst = a.y + i * a.ldy + nb * kRows;
    const int64_t cols = a.n - nb * kRows < nbn * kRows ? a.n - nb * kRows : nbn * kRows;
    std::memcpy(dst, src, size_t(cols) * 4);
  }
}

// E8M0 bytes -> 8 floats 2^(s-127); 0x00 -> 2^-127 (subnormal), 0xFF -> NaN.
inline __m256 e8m0x8_special(const uint8_t* p) {
  const __m256i s = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  __m256i bits = _mm256_slli_epi32(s, 23);
  bits = _mm256_blendv_epi8(bits, _mm256_set1_epi32(0x00400000), _mm256_cmpeq_epi32(s, _mm256_setzero_si256()));
  bits = _mm256_blendv_epi8(bits, _mm256_set1_epi32(0x7FC00000), _mm256_cmpeq_epi32(s, _mm256_set1_epi32(255)));
  return _mm256_castsi256_ps(bits);
}

// The 16 scales of one block of rows; the 0x00 / 0xFF fix-ups only when one is present.
inline void e8m0x16(const uint8_t* p, __m256& lo, __m256& hi) {
  const __m128i s = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i special = _mm_or_si128(_mm_cmpeq_epi8(s, _mm_setzero_si128()), _mm_cmpeq_epi8(s, _mm_set1_epi8(-1)));
  if (__builtin_expect(_mm_movemask_epi8(special) != 0, 0)) {
    lo = e8m0x8_special(p);
    hi = e8m0x8_special(p + 8);
    return;
  }
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu8_epi32(s), 23));
  hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(s, s)), 23));
}

// ----------------------------------------------------------------------------- MXFP4 (Q8)
// Slab of 16 rows x 4 k = 32 bytes: low nibbles are rows 0-7 ([row][4 k] bytes, the vpmaddubsw /
// vpdpbusd order), high nibbles rows 8-15. The LUT returns 2*E2M1 + 12 in [0, 24] so the weight
// is the unsigned operand; 12*sum(q) (xc) is taken off per block. Bounds (vpmaddubsw): a pair is
// <= 2*24*127 = 6096, four slabs summed in int16 <= 24384 < 2^15: exact. VNNI (AVX-VNNI's VEX
// vpdpbusd, no AVX-512 needed) sums each row's 4 products straight into int32: exact too, one
// instruction per row and half-slab where vpmaddubsw needs a product, an int16 add and (per 4
// slabs) a widening vpmaddwd.
//
// MB = 1-4 rows of x at once: one decode of each slab serves every row; NB row blocks side by
// side (NB = 2 at one row: two weight streams). Per half-block (4 slabs) the
// sums of every row stay in registers: an empty asm after each row's adds pins them there
// (GCC otherwise reassociates the integer adds, hoists the products of all four slabs ahead of
// them and spills them, ~1.4x the time of this form at 3-4 rows). The fp32 sums live in acc (L1),
// one load, fma and store per row and block. Integer sums are exact and the per-block fma is the
// same as ref's: bit-identical to ref for any M, row tile, thread count or instruction.
template <int MB, int NB, bool Vnni>
void q4_rows(const GemmArgs& a, int64_t nb, int64_t m0, int64_t k0, int64_t k1, float* acc, bool init) {
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
  const __m256i lut = _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0,
                                       12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0);
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  // VNNI with few rows: each accumulator would take a vpdpbusd (latency ~5) every slab; two
  // sets, even and odd slabs, added at the block's end (exact), keep the chains short.
  constexpr int kSets = Vnni && MB * NB <= 2 ? 2 : 1;
  for (int64_t b = k0 / kKBlk; b < k1 / kKBlk; ++b) {
    __m256i isum[kSets][MB][NB][2];  // the block's int32 sums (VNNI: accumulated in place)
    for (int t = 0; t < kSets; ++t)
      for (int i = 0; i < MB; ++i)
        for (int j = 0; j < NB; ++j) isum[t][i][j][0] = isum[t][i][j][1] = _mm256_setzero_si256();
    for (int half = 0; half < 2; ++half) {
      __m256i s16[MB][NB][2];  // vpmaddubsw: the half block's int16 sums
      for (int i = 0; i < MB; ++i)
        for (int j = 0; j < NB; ++j) s16[i][j][0] = s16[i][j][1] = _mm256_setzero_si256();
      for (int g = 0; g < 4; ++g) {
        const int64_t slab = b * 8 + half * 4 + g;
        for (int j = 0; j < NB; ++j) {
          if (g % 2 == 0)
            _mm_prefetch(stream_ahead(w[j], slab * 32, a.prefetch, block_bytes, NB * block_bytes), _MM_HINT_T0);
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[j] + slab * 32));
          const __m256i wl = _mm256_shuffle_epi8(lut, _mm256_and_si256(v, low4));
          const __m256i wh = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(v, 4), low4));
          for (int i = 0; i < MB; ++i) {
            int32_t q4;
            std::memcpy(&q4, q[i] + slab * 4, 4);
            const __m256i xq = _mm256_set1_epi32(q4);
            if constexpr (Vnni) {
              __m256i(&acc32)[2] = isum[g % kSets][i][j];
              acc32[0] = _mm256_dpbusd_avx_epi32(acc32[0], wl, xq);
              acc32[1] = _mm256_dpbusd_avx_epi32(acc32[1], wh, xq);
              asm("" : "+x"(acc32[0]), "+x"(acc32[1]));
            } else {
              s16[i][j][0] = _mm256_add_epi16(s16[i][j][0], _mm256_maddubs_epi16(wl, xq));
              s16[i][j][1] = _mm256_add_epi16(s16[i][j][1], _mm256_maddubs_epi16(wh, xq));
              asm("" : "+x"(s16[i][j][0]), "+x"(s16[i][j][1]));
            }
          }
        }
      }
      if constexpr (!Vnni)
        for (int i = 0; i < MB; ++i)
          for (int j = 0; j < NB; ++j)
            for (int h = 0; h < 2; ++h)
              isum[0][i][j][h] = _mm256_add_epi32(isum[0][i][j][h], _mm256_madd_epi16(s16[i][j][h], ones));
    }
    if constexpr (kSets == 2)
      for (int i = 0; i < MB; ++i)
        for (int j = 0; j < NB; ++j)
          for (int h = 0; h < 2; ++h) isum[0][i][j][h] = _mm256_add_epi32(isum[0][i][j][h], isum[1][i][j][h]);
    for (int j = 0; j < NB; ++j) {
      __m256 d[2];
      e8m0x16(s[j] + b * kRows, d[0], d[1]);
      for (int i = 0; i < MB; ++i) {
        const int64_t ib = (m0 + i) * kb + b;
        const __m256i xc = _mm256_set1_epi32(a.xc[ib]);
        const __m256 xd = _mm256_set1_ps(a.xd[ib]);
        for (int h = 0; h < 2; ++h) {
          const __m256 fi = _mm256_cvtepi32_ps(_mm256_sub_epi32(isum[0][i][j][h], xc));
          float* pa = acc_row(acc, i) + j * 16 + h * 8;
          _mm256_storeu_ps(pa, _mm256_fmadd_ps(fi, _mm256_mul_ps(d[h], xd), _mm256_loadu_ps(pa)));
        }
      }
    }
  }
}

// MXFP4: one row reads two row blocks at once where mx_row_blocks (gemm.h) says streams pay
// (Intel; AMD keeps one, as its VNNI kernel does: not measured on an AVX2-only Zen 3). With a
// single stream the hardware prefetcher ran too short a distance ahead of a loop this busy
// (model-167 Xeon at QSPEC_ISA=avx2, one thread, weights from DRAM: 11.0-11.4 GB/s against 16.5
// for a plain read; with two streams 12.7-14.2; 2 threads 21-23 -> 24-28 GB/s; longer, shorter
// or L2-only software prefetches all gave 10.3-11.5; four streams spill). More rows: balanced
// row tiles of at most 4 rows (M = 5: 3 + 2; a 5-row tile measured no faster), one row block at
// a time; with several row tiles, K is chunked so the block's weights are re-read from L1.
template <bool Vnni>
void q4_blocks(const GemmArgs& a, int64_t nb0, int64_t nb1, float* acc) {
  constexpr int kMaxRows = 4;
  const TileFn rows_tiles[kMaxRows] = {q4_rows<1, 1, Vnni>, q4_rows<2, 1, Vnni>, q4_rows<3, 1, Vnni>,
                                       q4_rows<4, 1, Vnni>};
  if (a.m == 1 && mx_row_blocks(1) >= 2) {  // two row blocks' streams at once
    for (int64_t nb = nb0; nb < nb1; nb += 2) {
      if (nb + 1 < nb1) q4_rows<1, 2, Vnni>(a, nb, 0, 0, a.kp, acc, true);
      else q4_rows<1, 1, Vnni>(a, nb, 0, 0, a.kp, acc, true);
      store_rows(a, nb, nb + 1 < nb1 ? 2 : 1, acc);
    }
    return;
  }
  const int64_t ntiles = (a.m + kMaxRows - 1) / kMaxRows;
  int64_t kc = ntiles == 1 ? a.kp : (kL1Bytes / (16 + a.m)) / kKBlk * kKBlk;
  if (kc < kKBlk) kc = kKBlk;
  for (int64_t nb = nb0; nb < nb1; ++nb) {
    for (int64_t k0 = 0; k0 < a.kp; k0 += kc) {
      const int64_t k1 = k0 + kc < a.kp ? k0 + kc : a.kp;
      for (int64_t tile = 0, m0 = 0; tile < ntiles; ++tile) {
        const int mb = int(a.m * (tile + 1) / ntiles - m0);
        rows_tiles[mb - 1](a, nb, m0, k0, k1, acc, k0 == 0);
        m0 += mb;
      }
    }
    store_rows(a, nb, 1, acc);
  }
}

constexpr int64_t kMxPrefetch = 4096;  // bytes ahead in each MX row block's stream (GemmArgs::prefetch)

}  // namespace
}  // namespace avx2
}  // namespace detail
}  // namespace qspec
