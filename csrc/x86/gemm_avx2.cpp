// AVX2 + FMA + F16C GEMM kernels (compiled with -mavx2 -mfma -mf16c; chosen at run time).
// Outer-product form over the packed 16-row blocks: a vector holds 8 output rows, x is
// broadcast, so each output element is one FMA chain in exactly the order `ref` uses
// (gemm.h): bit-identical to ref, whatever M, the other rows or the thread count.
// Everything here is static / anonymous-namespace except the entry points (gemm_internal.h).
#include <immintrin.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "gemm_avx2.h"

namespace qspec {
namespace detail {
namespace {

using avx2::acc_row;
using avx2::e8m0x16;
using avx2::kL1Bytes;
using avx2::store_rows;
using avx2::TileFn;

constexpr int kMaxMB = 6;  // rows of x per register tile

// Output rows r of block group nbg (NB blocks): acc layout [m][kAccCols], column j*16 + r.

// A tile's fp32 accumulators [row i][block j][8-row half h] <-> the scratch columns j*16 + h*8.
template <int MB, int NB>
__attribute__((always_inline)) inline void load_acc(float* acc, bool init, __m256 (&c)[MB][NB][2]) {
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j)
      for (int h = 0; h < 2; ++h)
        c[i][j][h] = init ? _mm256_setzero_ps() : _mm256_loadu_ps(acc_row(acc, i) + j * 16 + h * 8);
}

template <int MB, int NB>
__attribute__((always_inline)) inline void store_acc(float* acc, const __m256 (&c)[MB][NB][2]) {
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j)
      for (int h = 0; h < 2; ++h) _mm256_storeu_ps(acc_row(acc, i) + j * 16 + h * 8, c[i][j][h]);
}


// ----------------------------------------------------------------------------- BF16
// y = fma chain over k ascending. Block j, k pair p: 64 bytes = rows 0-7 then rows 8-15,
// each 32 bytes = 8 x (even k, odd k).
template <int MB, int NB>
void bf16_tile(const GemmArgs& a, int64_t nb, int64_t m0, int64_t k0, int64_t k1, float* acc, bool init) {
  acc = acc_row(acc, m0);  // rows from the tile's first: see acc_row
  __m256 c[MB][NB][2];
  load_acc<MB, NB>(acc, init, c);
  const uint16_t* w[NB];
  for (int j = 0; j < NB; ++j) w[j] = reinterpret_cast<const uint16_t*>(a.data) + (nb + j) * a.kp * 16;
  const float* x[MB];
  for (int i = 0; i < MB; ++i) x[i] = a.x + (m0 + i) * a.ldx;
  const __m256i hi16 = _mm256_set1_epi32(int(0xFFFF0000u));
  for (int64_t k = k0; k < k1; k += 2) {
    for (int j = 0; j < NB; ++j) _mm_prefetch(stream_ahead(w[j], k * 32, a.prefetch, a.kp * 32, NB * a.kp * 32), _MM_HINT_T0);
    // One 8-row half at a time keeps few temporaries live (GCC otherwise spills accumulators).
    for (int j = 0; j < NB; ++j)
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[j] + k * 16 + h * 16));
        const __m256 e = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        const __m256 o = _mm256_castsi256_ps(_mm256_and_si256(v, hi16));
        for (int i = 0; i < MB; ++i) {
          c[i][j][h] = _mm256_fmadd_ps(e, _mm256_broadcast_ss(x[i] + k), c[i][j][h]);
          c[i][j][h] = _mm256_fmadd_ps(o, _mm256_broadcast_ss(x[i] + k + 1), c[i][j][h]);
        }
      }
  }
  store_acc<MB, NB>(acc, c);
}

// c = fma(o, x[1], fma(e, x[0], c)): one row's step of a k pair. Inline asm so that GCC 12 keeps
// the broadcast in one scratch register right before its FMA: from intrinsics it hoisted the
// broadcasts and spilled accumulators at 10-12 of them (objdump of the 5 x 2 and 6 x 2 tiles).
__attribute__((always_inline)) inline void fma_pair(__m256& c, __m256 e, __m256 o, const float* x) {
  __m256 b;
  asm("vbroadcastss %2, %1\n\tvfmadd231ps %1, %3, %0\n\tvbroadcastss %4, %1\n\tvfmadd231ps %1, %5, %0"
      : "+x"(c), "=&x"(b)
      : "m"(x[0]), "x"(e), "m"(x[1]), "x"(o));
}

// Small-M tile over 8-row halves: MB rows of x x NH halves (global half index g0..g0+NH-1,
// half g = rows 8g..8g+7 of the padded N), MB*NH <= 12 fp32 accumulators so the FMA latency
// (4 cycles x 2 pipes) is covered with slack; each weight vector is converted once for all MB
// rows. Same chains as bf16_tile (fma over k ascending), so every tile shape agrees in bits.
// acc points at the column of half g0 in the group's scratch. Every loop over the accumulators
// is unrolled outright: one left rolled (the loads from acc) made GCC keep the whole array in
// memory and store each accumulator at every k step.
template <int MB, int NH, int ORD>
void bf16_htile(const GemmArgs& a, int64_t g0, int64_t m0, int64_t k0, int64_t k1, float* acc, bool init) {
  acc = acc_row(acc, m0);  // rows from the tile's first: see acc_row
  __m256 c[MB][NH];
#pragma GCC unroll 16
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 16
    for (int t = 0; t < NH; ++t)
      c[i][t] = init ? _mm256_setzero_ps() : _mm256_loadu_ps(acc_row(acc, i) + t * 8);
  const uint16_t* w[NH];
#pragma GCC unroll 16
  for (int t = 0; t < NH; ++t)
    w[t] = reinterpret_cast<const uint16_t*>(a.data) + ((g0 + t) >> 1) * a.kp * 16 + ((g0 + t) & 1) * 16;
  const float* x[MB];
#pragma GCC unroll 16
  for (int i = 0; i < MB; ++i) x[i] = a.x + (m0 + i) * a.ldx;
  const __m256i hi16 = _mm256_set1_epi32(int(0xFFFF0000u));
  const int64_t prefetch = a.prefetch;
  for (int64_t k = k0; k < k1; k += 2) {
#pragma GCC unroll 16
    for (int t = 0; t < NH; ++t)
      if (((g0 + t) & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(w[t] + k * 16) + prefetch, _MM_HINT_T0);
    if (ORD == 0) {  // per half: convert, then every row (a broadcast per FMA)
#pragma GCC unroll 16
      for (int t = 0; t < NH; ++t) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[t] + k * 16));
        const __m256 e = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        const __m256 o = _mm256_castsi256_ps(_mm256_and_si256(v, hi16));
#pragma GCC unroll 16
        for (int i = 0; i < MB; ++i) fma_pair(c[i][t], e, o, x[i] + k);
      }
    } else if (ORD == 1) {  // all halves converted first (2*NH registers), then row by row
      __m256 e[NH], o[NH];
#pragma GCC unroll 16
      for (int t = 0; t < NH; ++t) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[t] + k * 16));
        e[t] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        o[t] = _mm256_castsi256_ps(_mm256_and_si256(v, hi16));
      }
#pragma GCC unroll 16
      for (int i = 0; i < MB; ++i) {
        const __m256 x0 = _mm256_broadcast_ss(x[i] + k), x1 = _mm256_broadcast_ss(x[i] + k + 1);
#pragma GCC unroll 16
        for (int t = 0; t < NH; ++t) c[i][t] = _mm256_fmadd_ps(e[t], x0, c[i][t]);
#pragma GCC unroll 16
        for (int t = 0; t < NH; ++t) c[i][t] = _mm256_fmadd_ps(o[t], x1, c[i][t]);
      }
    } else {  // all rows broadcast first (2*MB registers), then half by half
      __m256 x0[MB], x1[MB];
#pragma GCC unroll 16
      for (int i = 0; i < MB; ++i) {
        x0[i] = _mm256_broadcast_ss(x[i] + k);
        x1[i] = _mm256_broadcast_ss(x[i] + k + 1);
      }
#pragma GCC unroll 16
      for (int t = 0; t < NH; ++t) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[t] + k * 16));
        const __m256 e = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        const __m256 o = _mm256_castsi256_ps(_mm256_and_si256(v, hi16));
#pragma GCC unroll 16
        for (int i = 0; i < MB; ++i) c[i][t] = _mm256_fmadd_ps(e, x0[i], c[i][t]);
#pragma GCC unroll 16
        for (int i = 0; i < MB; ++i) c[i][t] = _mm256_fmadd_ps(o, x1[i], c[i][t]);
      }
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < MB; ++i)
#pragma GCC unroll 16
    for (int t = 0; t < NH; ++t) _mm256_storeu_ps(acc_row(acc, i) + t * 8, c[i][t]);
}

// ----------------------------------------------------------------------------- FP6/FP8/INT8
// 16 codes (one k, 16 rows) -> two vectors of 8 rows, exactly as ref_element.
template <int KIND>
inline void decode16(const uint8_t* p, __m256& lo, __m256& hi) {
  if (KIND == kI8) {
    lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))));
  } else {
    __m256i h = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 8);
    if (KIND == kF16Sra) h = _mm256_and_si256(_mm256_srai_epi16(h, 1), _mm256_set1_epi16(int16_t(0xBFFF)));
    lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
  }
}

template <int KIND, int MB, int NB>
void fp_tile(const GemmArgs& a, int64_t nb, int64_t m0, int64_t k0, int64_t k1, float* acc, bool init) {
  acc = acc_row(acc, m0);  // rows from the tile's first: see acc_row
  const int64_t kb = a.kp / kKBlk;
  if (init)
    for (int i = 0; i < MB; ++i) std::memset(acc_row(acc, i), 0, NB * 16 * 4);
  const uint8_t* w[NB];
  const uint8_t* s[NB];
  for (int j = 0; j < NB; ++j) {
    w[j] = a.data + (nb + j) * a.kp * kRows;
    s[j] = a.scales + (nb + j) * kb * kRows;
  }
  const float* x[MB];
  for (int i = 0; i < MB; ++i) x[i] = a.x + (m0 + i) * a.ldx;
  const __m256 f = _mm256_set1_ps(a.elem_factor);
  for (int64_t b = k0 / kKBlk; b < k1 / kKBlk; ++b) {
    __m256 c[MB][NB][2];
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < NB; ++j) c[i][j][0] = c[i][j][1] = _mm256_setzero_ps();
    for (int64_t k = b * kKBlk; k < (b + 1) * kKBlk; ++k) {
      __m256 v[NB][2];
      for (int j = 0; j < NB; ++j) decode16<KIND>(w[j] + k * kRows, v[j][0], v[j][1]);
      for (int i = 0; i < MB; ++i) {
        const __m256 xv = _mm256_broadcast_ss(x[i] + k);
        for (int j = 0; j < NB; ++j)
          for (int h = 0; h < 2; ++h) c[i][j][h] = _mm256_fmadd_ps(v[j][h], xv, c[i][j][h]);
      }
    }
    for (int j = 0; j < NB; ++j) {
      __m256 d[2];
      e8m0x16(s[j] + b * kRows, d[0], d[1]);
      for (int h = 0; h < 2; ++h)
        for (int i = 0; i < MB; ++i) {
          float* pa = acc_row(acc, i) + j * 16 + h * 8;
          _mm256_storeu_ps(pa, _mm256_fmadd_ps(_mm256_mul_ps(c[i][j][h], f), d[h], _mm256_loadu_ps(pa)));
        }
    }
  }
}

// ----------------------------------------------------------------------------- MXFP6 E2M3 (Q8)
// Element * 8 is an integer in [-60, 60]: magnitude = nibble (e1 = 0: e0 m2 m1 m0 is already
// 8*value) or LUT[nibble] (e1 = 1: 16 + 2m or 32 + 4m), the sign goes onto the activation byte.
// The plane bit for vector t is moved to bit 7 of each byte by a 16-bit shift (blendv reads
// bit 7 only). Bounds: a vpmaddubsw pair <= 2*60*127 = 15240, two slabs summed in int16 <= 30480.
template <int MB, int NB>
void q6_tile(const GemmArgs& a, int64_t nb, int64_t m0, int64_t k0, int64_t k1, float* acc, bool init) {
  acc = acc_row(acc, m0);  // rows from the tile's first: see acc_row
  const int64_t kb = a.kp / kKBlk;
  __m256 facc[MB][NB][2];
  load_acc<MB, NB>(acc, init, facc);
  const uint8_t* w[NB];
  const uint8_t* s[NB];
  for (int j = 0; j < NB; ++j) {
    w[j] = a.data + (nb + j) * kb * kQ6BlockBytes;
    s[j] = a.scales + (nb + j) * kb * kRows;
  }
  const int8_t* q[MB];
  for (int i = 0; i < MB; ++i) q[i] = a.xq + (m0 + i) * a.kp;
  const __m256i lut1 = _mm256_setr_epi8(16, 18, 20, 22, 24, 26, 28, 30, 32, 36, 40, 44, 48, 52, 56, 60,
                                        16, 18, 20, 22, 24, 26, 28, 30, 32, 36, 40, 44, 48, 52, 56, 60);
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = k0 / kKBlk; b < k1 / kKBlk; ++b) {
    __m256i isum[MB][NB][2];
    for (int p = 0; p < 4; ++p) {
      if (p % 2 == 0)
        for (int j = 0; j < NB; ++j) {
          const char* pf = reinterpret_cast<const char*>(w[j] + b * kQ6BlockBytes + p * kQ6PairBytes + a.prefetch);
          _mm_prefetch(pf, _MM_HINT_T0);
          _mm_prefetch(pf + 64, _MM_HINT_T0);
          _mm_prefetch(pf + 128, _MM_HINT_T0);
        }
      __m256i s16[MB][NB][2];
      for (int sp = 0; sp < 2; ++sp) {
        __m256i xq[MB], nq[MB];
        for (int i = 0; i < MB; ++i) {
          int32_t q4;
          std::memcpy(&q4, q[i] + b * kKBlk + (2 * p + sp) * 4, 4);
          xq[i] = _mm256_set1_epi32(q4);
          nq[i] = _mm256_sub_epi8(_mm256_setzero_si256(), xq[i]);
        }
        for (int j = 0; j < NB; ++j) {
          const uint8_t* base = w[j] + b * kQ6BlockBytes + p * kQ6PairBytes;
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + sp * 32));
          const __m256i pl = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + 64));
          for (int h = 0; h < 2; ++h) {
            const int t = sp * 2 + h;
            const __m256i idx = h == 0 ? _mm256_and_si256(v, low4) : _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
            const __m256i em = t == 0 ? pl : _mm256_slli_epi16(pl, t);
            const __m256i sm = _mm256_slli_epi16(pl, 4 + t);
            const __m256i mag = _mm256_blendv_epi8(idx, _mm256_shuffle_epi8(lut1, idx), em);
            for (int i = 0; i < MB; ++i) {
              const __m256i prod = _mm256_maddubs_epi16(mag, _mm256_blendv_epi8(xq[i], nq[i], sm));
              s16[i][j][h] = sp == 0 ? prod : _mm256_add_epi16(s16[i][j][h], prod);
            }
          }
        }
      }
      for (int i = 0; i < MB; ++i)
        for (int j = 0; j < NB; ++j)
          for (int h = 0; h < 2; ++h) {
            const __m256i s32 = _mm256_madd_epi16(s16[i][j][h], ones);
            isum[i][j][h] = p == 0 ? s32 : _mm256_add_epi32(isum[i][j][h], s32);
          }
    }
    for (int j = 0; j < NB; ++j) {
      __m256 d[2];
      e8m0x16(s[j] + b * kRows, d[0], d[1]);
      for (int i = 0; i < MB; ++i) {
        const __m256 xd = _mm256_set1_ps(a.xd[(m0 + i) * kb + b] * a.elem_factor);
        for (int h = 0; h < 2; ++h)
          facc[i][j][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[i][j][h]), _mm256_mul_ps(d[h], xd), facc[i][j][h]);
      }
    }
  }
  store_acc<MB, NB>(acc, facc);
}

// ----------------------------------------------------------------------------- driver


#define QSPEC_TILE_TABLE(name, tmpl)                                                         \
  const TileFn name[kMaxMB][4] = {{tmpl<1, 1>, tmpl<1, 2>, tmpl<1, 3>, tmpl<1, 4>},            \
                                  {tmpl<2, 1>, tmpl<2, 2>, tmpl<2, 3>, nullptr},               \
                                  {tmpl<3, 1>, tmpl<3, 2>, nullptr, nullptr},                  \
                                  {tmpl<4, 1>, tmpl<4, 2>, nullptr, nullptr},                  \
                                  {tmpl<5, 1>, nullptr, nullptr, nullptr},                     \
                                  {tmpl<6, 1>, nullptr, nullptr, nullptr}};
template <int MB, int NB> void bf16_fn(const GemmArgs& a, int64_t nb, int64_t m0, int64_t k0, int64_t k1, float* acc, bool init) { bf16_tile<MB, NB>(a, nb, m0, k0, k1, acc, init); }
template <int MB, int NB> void q6_fn(const GemmArgs& a, int64_t nb, int64_t m0, int64_t k0, int64_t k1, float* acc, bool init) { q6_tile<MB, NB>(a, nb, m0, k0, k1, acc, init); }
template <int MB, int NB> void shl_fn(const GemmArgs& a, int64_t nb, int64_t m0, int64_t k0, int64_t k1, float* acc, bool init) { fp_tile<kF16Shl, MB, NB>(a, nb, m0, k0, k1, acc, init); }
template <int MB, int NB> void sra_fn(const GemmArgs& a, int64_t nb, int64_t m0, int64_t k0, int64_t k1, float* acc, bool init) { fp_tile<kF16Sra, MB, NB>(a, nb, m0, k0, k1, acc, init); }
template <int MB, int NB> void i8_fn(const GemmArgs& a, int64_t nb, int64_t m0, int64_t k0, int64_t k1, float* acc, bool init) { fp_tile<kI8, MB, NB>(a, nb, m0, k0, k1, acc, init); }

QSPEC_TILE_TABLE(kBf16Tiles, bf16_fn)

constexpr int kHMaxMB = 6, kHMaxNH = 8;
template <int MB, int NH, int ORD> void bf16h_fn(const GemmArgs& a, int64_t g0, int64_t m0, int64_t k0, int64_t k1, float* acc, bool init) { bf16_htile<MB, NH, ORD>(a, g0, m0, k0, k1, acc, init); }
template <int MB, int NH, int ORD> constexpr TileFn bf16h_or_null() {
  if constexpr (MB * NH <= 12 || MB == 1) return bf16h_fn<MB, NH, ORD>;
  else return nullptr;
}
#define QSPEC_HROW(MB, O) {bf16h_or_null<MB, 1, O>(), bf16h_or_null<MB, 2, O>(), bf16h_or_null<MB, 3, O>(), bf16h_or_null<MB, 4, O>(), \
                           bf16h_or_null<MB, 5, O>(), bf16h_or_null<MB, 6, O>(), bf16h_or_null<MB, 7, O>(), bf16h_or_null<MB, 8, O>()}
#define QSPEC_HTAB(O) {QSPEC_HROW(1, O), QSPEC_HROW(2, O), QSPEC_HROW(3, O), QSPEC_HROW(4, O), QSPEC_HROW(5, O), QSPEC_HROW(6, O)}
const TileFn kBf16HTiles[3][kHMaxMB][kHMaxNH] = {QSPEC_HTAB(0), QSPEC_HTAB(1), QSPEC_HTAB(2)};
#undef QSPEC_HTAB
#undef QSPEC_HROW
// Halves per tile and loop order for MB rows, picked by interleaved single-core measurements
// on Zen 3 (L2- and DRAM-resident, 1536x576 / 4096x4096): M=2 broadcasts its 4 x values once per
// k pair for 4 halves (8 accumulators); M=3 prefers 12 accumulators; M=4 converts 2 halves once
// for the 4 rows. Whole row blocks per tile: a block split over two tiles is streamed twice.
constexpr int kHalvesFor[kHMaxMB + 1] = {0, 8, 4, 4, 2, 2, 2};
constexpr int kOrderFor[kHMaxMB + 1] = {0, 0, 2, 0, 1, 0, 0};

// BF16, M >= 2: groups of GB row blocks; x split into balanced row tiles of <= 3 rows up to 6
// rows, <= 6 rows from 7; each row tile sweeps the group's halves in tiles of kHalvesFor[mb].
// With several row tiles, K is chunked so the group's weights are re-read from L1. 4-6 rows as
// two tiles, whose second computes while the next K chunk arrives (below), rather than one that
// streams and computes at once: model-167 Xeon at QSPEC_ISA=avx2, 2 threads, the 1.5B's gate|up
// and down shapes from DRAM: 4 rows 76-78 -> 91-100 GFLOP/s, 5 rows 88-94 -> 107-111, 6 rows
// 102-114 -> 112-118. From 7 rows (one thread) tiles of 3 were slower than 6 and tiles of 4
// level, but for 12 rows (4 + 4 + 4: 75-76 / 83 against 69-70 / 79-80 GFLOP/s, one run).
void bf16_blocks_small_m(const GemmArgs& a, int64_t nb0, int64_t nb1, float* acc) {
  const int max_rows = a.m <= kHMaxMB ? 3 : kHMaxMB;
  const int64_t ntiles = (a.m + max_rows - 1) / max_rows;
  const int mb_first = int((a.m + ntiles - 1) / ntiles);
  int gb = (8 % kHalvesFor[mb_first]) == 0 ? 4 : 3;  // whole tiles per group
  gb = gb > kAccCols / kRows ? int(kAccCols / kRows) : gb;
  const int64_t bytes_per_k = 32 * gb + 4 * a.m;
  const int64_t budget = a.m > kPrefillRows ? kL2Bytes : kL1Bytes;
  int64_t kc = ntiles == 1 ? a.kp : (budget / bytes_per_k) / kKBlk * kKBlk;
  if (kc < kKBlk) kc = kKBlk;
  // With several row tiles, the first streams a K chunk in and the others re-read it from L1:
  // the last prefetches the next chunk (kc * 32 bytes on in each block's stream) so that the
  // weights keep arriving while it computes. Model-167 Xeon at QSPEC_ISA=avx2, one thread, 9
  // rows, weights from DRAM: 54-56 -> 67-69 GFLOP/s (two alternations); 16 rows level.
  GemmArgs ahead = a;
  if (ntiles > 1) ahead.prefetch = kc * 32;
  for (int64_t nb = nb0; nb < nb1; nb += gb) {
    const int nbn = int(nb1 - nb < gb ? nb1 - nb : gb);
    const int64_t gh0 = nb * 2, nh_total = nbn * 2;
    for (int64_t k0 = 0; k0 < a.kp; k0 += kc) {
      const int64_t k1 = k0 + kc < a.kp ? k0 + kc : a.kp;
      for (int64_t tile = 0, m0 = 0; tile < ntiles; ++tile) {
        const int mb = int((a.m * (tile + 1)) / ntiles - m0);
        const int nhmax = kHalvesFor[mb];
        const GemmArgs& at = tile == ntiles - 1 ? ahead : a;
        for (int64_t h = 0; h < nh_total; h += nhmax) {
          const int nh = int(nh_total - h < nhmax ? nh_total - h : nhmax);
          kBf16HTiles[kOrderFor[mb]][mb - 1][nh - 1](at, gh0 + h, m0, k0, k1, acc + h * 8, k0 == 0);
        }
        m0 += mb;
      }
    }
    store_rows(a, nb, nbn, acc);
  }
}

QSPEC_TILE_TABLE(kQ6Tiles, q6_fn)
QSPEC_TILE_TABLE(kShlTiles, shl_fn)
QSPEC_TILE_TABLE(kSraTiles, sra_fn)
QSPEC_TILE_TABLE(kI8Tiles, i8_fn)
#undef QSPEC_TILE_TABLE

}  // namespace

void gemm_blocks_avx2(const GemmArgs& args, int64_t nb0, int64_t nb1, float* acc) {
  GemmArgs a = args;
  if (a.prefetch == 0) a.prefetch = a.kind == kQ4 || a.kind == kQ6 ? avx2::kMxPrefetch : 1024;
  if (a.kind == kBf16 && a.m >= 2) {
    const int64_t chunks = (a.m + kMChunk - 1) / kMChunk;  // one unless prefill (gemm_internal.h)
    for (int64_t i = 0; i < chunks; ++i)
      bf16_blocks_small_m(rows_of(a, a.m * i / chunks, a.m * (i + 1) / chunks - a.m * i / chunks), nb0, nb1, acc);
    return;
  }
  if (a.kind == kQ4) {
    avx2::q4_blocks<false>(a, nb0, nb1, acc);
    return;
  }
  const TileFn(*table)[4] = a.kind == kBf16 ? kBf16Tiles
                          : a.kind == kQ6   ? kQ6Tiles
                          : a.kind == kF16Shl ? kShlTiles
                          : a.kind == kF16Sra ? kSraTiles
                                              : kI8Tiles;
  // Register tiles (MB rows of x, NB row blocks), picked by pinned single-core measurements on
  // Zen 3: 8 FMA chains is what 16 ymm registers hold without spilling, and 2 x-rows x 2 row
  // blocks needs half the broadcasts of 4 x 1 (BF16 2x2: ~28 vs ~25 GMAC/s from L1). The Q8
  // kernel (MXFP6 E2M3) holds 4 int vectors per (row, block): 1 block at a time.
  const bool q6 = a.kind == kQ6;
  const bool bf16 = a.kind == kBf16;
  const int mbmax = q6 || (bf16 && a.m == 2) ? 2 : 4;
  const int nbmax = q6 ? 1 : a.m == 1 ? 4 : a.m == 2 ? 2 : 1;
  // With several row tiles of x, a K chunk of weights and x is re-read from L1.
  const int64_t bytes_per_k = (q6 ? 12 : 32) * nbmax + (q6 ? 1 : 4) * a.m;
  int64_t kc = a.m <= mbmax ? a.kp : (kL1Bytes / bytes_per_k) / kKBlk * kKBlk;
  if (kc < kKBlk) kc = kKBlk;
  for (int64_t nb = nb0; nb < nb1; nb += nbmax) {
    const int nbn = int(nb1 - nb < nbmax ? nb1 - nb : nbmax);
    for (int64_t k0 = 0; k0 < a.kp; k0 += kc) {
      const int64_t k1 = k0 + kc < a.kp ? k0 + kc : a.kp;
      for (int64_t m0 = 0; m0 < a.m; m0 += mbmax) {
        const int mb = int(a.m - m0 < mbmax ? a.m - m0 : mbmax);
        // Shapes missing from the table fall back to one block at a time: same arithmetic.
        TileFn fn = table[mb - 1][nbn - 1];
        if (fn) {
          fn(a, nb, m0, k0, k1, acc + 0, k0 == 0);
        } else {
          for (int j = 0; j < nbn; ++j) table[mb - 1][0](a, nb + j, m0, k0, k1, acc + j * 16, k0 == 0);
        }
      }
    }
    store_rows(a, nb, nbn, acc);
  }
}

// ----------------------------------------------------------------------------- Q8 activations
// Bit-identical to quantize_q8_ref: same max, same IEEE divide, RNE conversion.
void quantize_q8_avx2(const float* x, int64_t m, int64_t ldx, int64_t k, int64_t kp, int8_t* xq,
                      float* xd, int32_t* xc) {
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int64_t i = 0; i < m; ++i)
    for (int64_t b = 0; b < kp / kKBlk; ++b) {
      float buf[kKBlk];
      const float* src = x + i * ldx + b * kKBlk;
      if ((b + 1) * kKBlk > k) {
        for (int j = 0; j < kKBlk; ++j) buf[j] = b * kKBlk + j < k ? src[j] : 0.f;
        src = buf;
      }
      __m256 v[4];
      __m256 amax = _mm256_setzero_ps();
      for (int t = 0; t < 4; ++t) {
        v[t] = _mm256_loadu_ps(src + 8 * t);
        amax = _mm256_max_ps(_mm256_and_ps(v[t], absmask), amax);
      }
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
      const float am = _mm_cvtss_f32(m4);
      const float d = am / 127.0f;
      const float id = d != 0.f ? 1.0f / d : 0.f;
      const __m256 vid = _mm256_set1_ps(id);
      __m256i qi[4];
      __m256i sum = _mm256_setzero_si256();
      for (int t = 0; t < 4; ++t) {
        qi[t] = _mm256_cvtps_epi32(_mm256_mul_ps(v[t], vid));
        qi[t] = _mm256_max_epi32(_mm256_min_epi32(qi[t], _mm256_set1_epi32(127)), _mm256_set1_epi32(-127));
        sum = _mm256_add_epi32(sum, qi[t]);
      }
      const __m256i p01 = _mm256_packs_epi32(qi[0], qi[1]);
      const __m256i p23 = _mm256_packs_epi32(qi[2], qi[3]);
      __m256i p = _mm256_packs_epi16(p01, p23);
      p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + i * kp + b * kKBlk), p);
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
      xd[i * (kp / kKBlk) + b] = d * 0.5f;
      xc[i * (kp / kKBlk) + b] = 12 * _mm_cvtsi128_si32(s4);
    }
}

}  // namespace detail
}  // namespace qspec
