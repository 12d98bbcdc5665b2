// AVX-512 GEMM kernels (compiled with AVX-512F/BW/VL/DQ + AVX512-BF16; chosen at run time).
//   avx512       one zmm = the 16 rows of a packed block; same arithmetic as ref (gemm.h),
//                so bit-identical to ref and avx2 for every format. BF16 and MXFP4 here, the
//                other MX formats in gemm_mx_avx512.cpp.
//   avx512_bf16  BF16 weights only: x rounded to bf16 by the driver, vdpbf16ps per k pair
//                (one chain per output element over k pairs: batch invariant). From
//                kBf16FmaRows rows on Intel the same arithmetic runs on FMAs instead
//                (gemm_bf16fma_avx512.cpp, bf16_fma() in gemm.h).
// Tested against ref on AVX-512 hardware (a Sapphire Rapids VM) and under emulation
// (tests/test_isa_emulation.py).
// Everything here is static / anonymous-namespace except the entry points (gemm_internal.h).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>

#include "gemm_avx512.h"
#include "gemm_internal.h"

namespace qspec {
namespace detail {
namespace {

constexpr int64_t kPrefetchK = 32;

using avx512::acc_row;
using avx512::e8m0x16;
using avx512::round16_bf16;
using avx512::transpose16;
using avx512::store_rows;

// ----------------------------------------------------------------------------- BF16, fp32 x
template <int MB, int NB>
void bf16_tile(const GemmArgs& a, int64_t nb, int64_t m0, int64_t k0, int64_t k1, float* acc, bool init) {
  acc = acc_row(acc, m0);  // rows from the tile's first: see acc_row
  __m512 c[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j)
      c[i][j] = init ? _mm512_setzero_ps() : _mm512_loadu_ps(acc_row(acc, i) + j * 16);
  const uint16_t* w[NB];
  for (int j = 0; j < NB; ++j) w[j] = reinterpret_cast<const uint16_t*>(a.data) + (nb + j) * a.kp * 16;
  const float* x[MB];
  for (int i = 0; i < MB; ++i) x[i] = a.x + (m0 + i) * a.ldx;
  const __m512i hi16 = _mm512_set1_epi32(int(0xFFFF0000u));
  for (int64_t k = k0; k < k1; k += 2) {
    __m512 e[NB], o[NB];
    for (int j = 0; j < NB; ++j) {
      _mm_prefetch(stream_ahead(w[j], k * 32, kPrefetchK * 32, a.kp * 32, NB * a.kp * 32), _MM_HINT_T0);
      const __m512i v = _mm512_loadu_si512(w[j] + k * 16);
      e[j] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
      o[j] = _mm512_castsi512_ps(_mm512_and_si512(v, hi16));
    }
    for (int i = 0; i < MB; ++i) {
      const __m512 xe = _mm512_set1_ps(x[i][k]);
      for (int j = 0; j < NB; ++j) c[i][j] = _mm512_fmadd_ps(e[j], xe, c[i][j]);
      const __m512 xo = _mm512_set1_ps(x[i][k + 1]);
      for (int j = 0; j < NB; ++j) c[i][j] = _mm512_fmadd_ps(o[j], xo, c[i][j]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) _mm512_storeu_ps(acc_row(acc, i) + j * 16, c[i][j]);
}

// ----------------------------------------------------------------------------- BF16, bf16 x
// x row-major (one pointer a row: tiles of <= 8 rows) or, with PAIRS, its k pairs interleaved over
// the rows (a verify's tiles of 9-16 rows: one pointer, rows at constant offsets).
template <int MB, int NB, bool PAIRS>
void dpbf16_tile(const GemmArgs& a, int64_t nb, int64_t m0, int64_t k0, int64_t k1, float* acc, bool init) {
  acc = acc_row(acc, m0);  // rows from the tile's first: see acc_row
  __m512 c[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j)
      c[i][j] = init ? _mm512_setzero_ps() : _mm512_loadu_ps(acc_row(acc, i) + j * 16);
  const uint16_t* w[NB];
  for (int j = 0; j < NB; ++j) w[j] = reinterpret_cast<const uint16_t*>(a.data) + (nb + j) * a.kp * 16;
  const int64_t ld = PAIRS ? a.xbf_ld : 1;  // pair (row i, k / 2) at x[0] + k * ld + 2 * i with PAIRS
  const uint16_t* x[PAIRS ? 1 : MB];
  for (int i = 0; i < (PAIRS ? 1 : MB); ++i) x[i] = a.xbf + (PAIRS ? 2 * m0 : (m0 + i) * a.kp);
  for (int64_t k = k0; k < k1; k += 2) {
    __m512i v[NB];
    for (int j = 0; j < NB; ++j) {
      _mm_prefetch(stream_ahead(w[j], k * 32, kPrefetchK * 32, a.kp * 32, NB * a.kp * 32), _MM_HINT_T0);
      v[j] = _mm512_loadu_si512(w[j] + k * 16);
    }
    for (int i = 0; i < MB; ++i) {
      int32_t pair;
      std::memcpy(&pair, PAIRS ? x[0] + k * ld + 2 * i : x[i] + k, 4);
      const __m512i xp = _mm512_set1_epi32(pair);
      for (int j = 0; j < NB; ++j) c[i][j] = _mm512_dpbf16_ps(c[i][j], (__m512bh)v[j], (__m512bh)xp);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) _mm512_storeu_ps(acc_row(acc, i) + j * 16, c[i][j]);
}

// ----------------------------------------------------------------------------- MXFP4 (Q8)
// zmm = [low nibbles | high nibbles] of a 32-byte slab = rows 0-15 x 4 k, as avx2's two ymm.
template <int MB, int NB>
void q4_tile(const GemmArgs& a, int64_t nb, int64_t m0, int64_t k0, int64_t k1, float* acc, bool init) {
  acc = acc_row(acc, m0);  // rows from the tile's first: see acc_row
  const int64_t kb = a.kp / kKBlk;
  if (init)
    for (int i = 0; i < MB; ++i) std::memset(acc_row(acc, i), 0, NB * 16 * 4);
  const uint8_t* w[NB];
  const uint8_t* s[NB];
  for (int j = 0; j < NB; ++j) {
    w[j] = a.data + (nb + j) * (a.kp / 4) * 32;
    s[j] = a.scales + (nb + j) * kb * kRows;
  }
  const int8_t* q[MB];
  for (int i = 0; i < MB; ++i) q[i] = a.xq + (m0 + i) * a.kp;
  const __m512i lut = avx512::q4_lut_biased();
  const __m512i ones = _mm512_set1_epi16(1);
  for (int64_t b = k0 / kKBlk; b < k1 / kKBlk; ++b) {
    __m512i isum[MB][NB];
    for (int half = 0; half < 2; ++half) {
      __m512i s16[MB][NB];
      for (int g = 0; g < 4; ++g) {
        const int64_t slab = b * 8 + half * 4 + g;
        __m512i wv[NB];
        for (int j = 0; j < NB; ++j) {
          if (g % 2 == 0)
            _mm_prefetch(stream_ahead(w[j], slab * 32, 2 * kPrefetchK * 32, (a.kp / 4) * 32, NB * (a.kp / 4) * 32), _MM_HINT_T0);
          wv[j] = avx512::q4_slab(w[j] + slab * 32, lut);
        }
        for (int i = 0; i < MB; ++i) {
          int32_t q4;
          std::memcpy(&q4, q[i] + slab * 4, 4);
          const __m512i xq = _mm512_set1_epi32(q4);
          for (int j = 0; j < NB; ++j) {
            const __m512i p = _mm512_maddubs_epi16(wv[j], xq);
            s16[i][j] = g == 0 ? p : _mm512_add_epi16(s16[i][j], p);
          }
        }
      }
      for (int i = 0; i < MB; ++i)
        for (int j = 0; j < NB; ++j) {
          const __m512i s32 = _mm512_madd_epi16(s16[i][j], ones);
          isum[i][j] = half == 0 ? s32 : _mm512_add_epi32(isum[i][j], s32);
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

// ----------------------------------------------------------------------------- driver
using TileFn = void (*)(const GemmArgs&, int64_t, int64_t, int64_t, int64_t, float*, bool);
constexpr int kMB = 8, kNB = 4;

// Tiles of 1..MaxMB rows x 1..kNB row blocks; those past the register budget (more than 24
// accumulators with 2+ blocks) are never chosen and left out.
template <template <int, int> class F, int MaxMB = kMB>
struct TileTable {
  TileFn t[MaxMB][kNB] = {};
  template <int MB, int NB>
  static void fn(const GemmArgs& a, int64_t nb, int64_t m0, int64_t k0, int64_t k1, float* acc, bool init) {
    F<MB, NB>::run(a, nb, m0, k0, k1, acc, init);
  }
  template <int MB, int NB>
  void put() {
    if constexpr (MB * NB <= 24 || NB == 1) t[MB - 1][NB - 1] = fn<MB, NB>;
  }
  template <int MB>
  void row() { put<MB, 1>(); put<MB, 2>(); put<MB, 3>(); put<MB, 4>(); }
  template <int... I>
  void rows(std::integer_sequence<int, I...>) { (row<I + 1>(), ...); }
  TileTable() { rows(std::make_integer_sequence<int, MaxMB>()); }
};

template <int MB, int NB> struct DpT { static void run(const GemmArgs& a, int64_t nb, int64_t m0, int64_t k0, int64_t k1, float* acc, bool init) { dpbf16_tile<MB, NB, false>(a, nb, m0, k0, k1, acc, init); } };
template <int MB, int NB> struct DpPairsT { static void run(const GemmArgs& a, int64_t nb, int64_t m0, int64_t k0, int64_t k1, float* acc, bool init) { dpbf16_tile<MB, NB, true>(a, nb, m0, k0, k1, acc, init); } };
template <int MB, int NB> struct Bf16T { static void run(const GemmArgs& a, int64_t nb, int64_t m0, int64_t k0, int64_t k1, float* acc, bool init) { bf16_tile<MB, NB>(a, nb, m0, k0, k1, acc, init); } };
template <int MB, int NB> struct Q4T { static void run(const GemmArgs& a, int64_t nb, int64_t m0, int64_t k0, int64_t k1, float* acc, bool init) { q4_tile<MB, NB>(a, nb, m0, k0, k1, acc, init); } };

// Register budget (32 zmm): MB*NB accumulators; Q8 needs 2 int vectors per (row, block).
void run_blocks(const GemmArgs& a, int64_t nb0, int64_t nb1, float* acc, const TileFn (*table)[kNB],
                int mbmax, int bytes_per_k16, int nbmax) {
  if (a.m > kMChunk) {  // prefill: chunks of rows whose K chunks stay in L2 (gemm_internal.h)
    const int64_t chunks = (a.m + kMChunk - 1) / kMChunk;
    for (int64_t i = 0; i < chunks; ++i)
      run_blocks(rows_of(a, a.m * i / chunks, a.m * (i + 1) / chunks - a.m * i / chunks), nb0, nb1, acc, table,
                 mbmax, bytes_per_k16, nbmax);
    return;
  }
  const int64_t bytes_per_k = int64_t(bytes_per_k16) * nbmax + 4 * a.m;
  const int64_t budget = a.m > kPrefillRows ? kL2Bytes : 32768;
  int64_t kc = a.m <= mbmax ? a.kp : (budget / bytes_per_k) / kKBlk * kKBlk;
  if (kc < kKBlk) kc = kKBlk;
  for (int64_t nb = nb0; nb < nb1; nb += nbmax) {
    const int nbn = int(nb1 - nb < nbmax ? nb1 - nb : nbmax);
    for (int64_t k0 = 0; k0 < a.kp; k0 += kc) {
      const int64_t k1 = k0 + kc < a.kp ? k0 + kc : a.kp;
      for (int64_t m0 = 0; m0 < a.m; m0 += mbmax) {
        const int mb = int(a.m - m0 < mbmax ? a.m - m0 : mbmax);
        table[mb - 1][nbn - 1](a, nb, m0, k0, k1, acc, k0 == 0);
      }
    }
    store_rows(a, nb, nbn, acc);
  }
}

// Row blocks per tile of the fp32-activation paths: 4 for a GEMV, 2 up to 4 rows, then 1.
int narrow_blocks(int64_t m) { return m == 1 ? 4 : m <= 4 ? 2 : 1; }

constexpr int kDpMB = 16;  // vdpbf16ps tiles over interleaved k pairs: up to 16 rows

const TileTable<Bf16T>& bf16_table() { static const TileTable<Bf16T> t; return t; }
const TileTable<DpT>& dp_table() { static const TileTable<DpT> t; return t; }
const TileTable<DpPairsT, kDpMB>& dp_pairs_table() { static const TileTable<DpPairsT, kDpMB> t; return t; }
const TileTable<Q4T>& q4_table() { static const TileTable<Q4T> t; return t; }

}  // namespace

void gemm_blocks_avx512(const GemmArgs& a, int64_t nb0, int64_t nb1, float* acc) {
  switch (a.kind) {
    case kBf16: run_blocks(a, nb0, nb1, acc, bf16_table().t, a.m == 1 ? 1 : 6, 32, narrow_blocks(a.m)); break;
    case kQ4: run_blocks(a, nb0, nb1, acc, q4_table().t, 4, 16, narrow_blocks(a.m)); break;
    default: gemm_blocks_mx_avx512(a, nb0, nb1, acc); break;  // kQ6, kF16Shl, kF16Sra, kI8
  }
}

void round_bf16_rows_avx512(const float* x, int64_t m, int64_t ldx, int64_t k, int64_t kp, uint16_t* out,
                            int64_t row0, bool tiles, int64_t pairs_ld) {
  if (pairs_ld) {  // 16 rows x 16 k pairs at a time, transposed: pair j of row r at j * pairs_ld + r
    int32_t* dst = reinterpret_cast<int32_t*>(out);
    for (int64_t g = 0; g < m; g += 16) {
      const int rows = int(m - g < 16 ? m - g : 16);
      const __mmask16 live = __mmask16((1u << rows) - 1);
      for (int64_t c = 0; c < kp; c += 32) {
        __m512i r[16];
        for (int i = 0; i < 16; ++i) {
          const float* src = x + (g + i) * ldx;
          r[i] = i < rows ? _mm512_inserti64x4(_mm512_castsi256_si512(round16_bf16(src, c, k)), round16_bf16(src, c + 16, k), 1)
                          : _mm512_setzero_si512();
        }
        transpose16(r);
        for (int t = 0; t < 16; ++t) _mm512_mask_storeu_epi32(dst + (c / 2 + t) * pairs_ld + row0 + g, live, r[t]);
      }
    }
    return;
  }
  for (int64_t i = 0; i < m; ++i) {
    const float* src = x + i * ldx;
    const int64_t r = row0 + i;
    uint16_t* dst = tiles ? out + (r / 16) * 16 * kp + (r % 16) * 32 : out + r * kp;
    const int64_t block_stride = tiles ? 512 : 32;  // elements from one 32-column block to the next
    for (int64_t c = 0; c < kp; c += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + (c / 32) * block_stride + c % 32), round16_bf16(src, c, k));
  }
}

// vdpbf16ps: M > 1 in row tiles split evenly, of at most 8 rows, or 16 for a verify of 9-24 rows
// (x in interleaved k pairs, xbf_ld: 9-16 rows in one pass over the weights, 17-24 in two), and as
// many row blocks as keep ~24 accumulator chains in flight (rows x blocks; + blocks weight vectors +
// one broadcast <= 32 zmm), so the product latency is covered and each broadcast pair of x serves
// several weight vectors. Zen 4, Qwen2.5-Coder-1.5B's GEMMs, 2 threads, paired with a one-row pass:
// 9 rows 1.09-1.34 one-row passes against 1.91-1.96 as two tiles (5 + 4), 12 rows 1.13-1.48 against
// 2.04-2.06, 17 rows (9 + 8) 1.74-2.46 against 2.60-2.95 as three. Which tile a row lands in never
// changes its arithmetic (one chain per output over k, spilled to acc exactly between k chunks):
// rows stay batch invariant.
void gemm_blocks_avx512_bf16(const GemmArgs& a, int64_t nb0, int64_t nb1, float* acc) {
  if (a.m == 1) return run_blocks(a, nb0, nb1, acc, dp_table().t, 1, 32, 4);
  const int64_t mb = a.xbf_ld ? kDpMB : kMB;
  const int64_t tiles = (a.m + mb - 1) / mb;
  const int rows = int((a.m + tiles - 1) / tiles);
  run_blocks(a, nb0, nb1, acc, a.xbf_ld ? dp_pairs_table().t : dp_table().t, rows, 32, std::max(1, std::min(kNB, 24 / rows)));
}

}  // namespace detail
}  // namespace qspec
