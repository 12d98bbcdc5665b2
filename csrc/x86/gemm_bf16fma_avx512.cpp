// The avx512_bf16 path's BF16 GEMM with 512-bit FMAs instead of vdpbf16ps (bf16_fma(), gemm.h):
// the same bits, twice the multiply-add rate where the CPU issues two FMAs a cycle but one
// vdpbf16ps every two (Sapphire Rapids class: `_C.compute_peak` 430 GFLOP/s of FMAs against
// 216 of vdpbf16ps on 2 threads of a model-167 Xeon), which is what a verify of 9-16 rows and a
// prefill are bound by at that ISA level.
//
// Arithmetic. VDPBF16PS computes, per fp32 lane and k pair, acc += w_odd · x_odd, then
// acc += w_even · x_even, each product exact in fp32 (bf16 x bf16), each add rounded to nearest,
// with denormal inputs read as zero and denormal results flushed (DAZ, FTZ; Intel SDM). Two FMAs
// in that order under MXCSR.FTZ | DAZ do exactly that: bit-identical to vdpbf16ps on a model-167
// Xeon for 16 M lanes of random operands, 1.4 M of them with denormal results (throwaway C++
// check; the other order differs in 13-25% of lanes). So a call may take either kernel and a row
// keeps its bits: the driver (gemm.cpp) takes this one from kBf16FmaRows rows where bf16_fma() is
// on (Intel), and vdpbf16ps below, where this one measured 2-13% slower (its conversions of x and
// of the weights cost more than they save while the weights' bytes are the bound).
// tests/test_gemm.py compares the two bit for bit on AVX512-BF16 hardware, and batch invariance
// across M crosses the switch. AMD does not document its vdpbf16ps rounding, so bf16_fma() is off
// there (and Zen 4 issues one vdpbf16ps a cycle: no gain to take).
// Operands. x is rounded to bf16 as the vdpbf16ps variant rounds it (round16_bf16) and held as
// fp32 values, in groups of G rows (G = M up to 16, else 16): element (r, k) at
// xf + (r / G) * G * kp + (k / 2) * 2G + 2 (r % G) + k % 2, so a tile's rows are broadcast from
// one pointer at constant offsets and a k pair step moves 2G floats. The weights keep their
// packed layout (one k pair of a row block = 64 bytes: 16 outputs x (even, odd)); each vector is
// split into its even and odd fp32 halves once per k pair (a shift and an and) for all the tile's
// rows, whose x broadcasts are the FMAs' memory operands.
//
// Tiles: up to 16 rows x up to 4 row blocks, MB * NB accumulators + 2 NB weight halves <= 30 zmm.
// M <= 16: one tile of all rows over the whole K; more rows: chunks of kChunkRows rows, tiles of
// one 16-row group x 1 block, K chunked so a chunk's x and a block's weights stay in cache (as
// run_blocks does for the vdpbf16ps tiles). Partial sums between K chunks go through acc exactly.
#include <immintrin.h>

#include <cstdint>
#include <utility>

#include "gemm_avx512.h"
#include "gemm_internal.h"

namespace qspec {
namespace detail {
namespace {

using avx512::acc_row;
using avx512::store_rows;

constexpr int64_t kGroup = 16;       // rows of an x group past 16 rows
constexpr int64_t kChunkRows = 48;   // rows of a chunk past 16 rows (whole groups)
constexpr int64_t kPrefetchBytes = 4096;  // 9-16 rows 5-8% faster than 1 KB ahead
// Past 16 rows, each tile also prefetches its x group this many k pairs ahead (2 KB) into L1:
// a prefill's down projection (K = 8,960: a 48-row chunk's x is 1.7 MB, L2's edge) 249-258 ->
// 285-298 GFLOP/s on a model-167 Xeon at the avx512_bf16 level (2 threads, M = 2,048, three
// alternations; gate|up, K = 1,536, level). 8 k pairs ahead gave the same.
constexpr int64_t kXPrefetchPairs = 16;
constexpr int kMaxNB = 4;

// accumulators + weight halves within the register file (one spare for the address arithmetic)
constexpr bool fits(int mb, int nb) { return mb * nb + 2 * nb <= 30; }
constexpr int blocks_for(int mb) {  // the most row blocks a tile of mb rows fits
  int nb = kMaxNB;
  while (nb > 1 && !fits(mb, nb)) --nb;
  return nb;
}

// Rows [0, MB) of the tile at xg (its first row within its group; ld2 = 2G floats per k pair) x NB
// row blocks from nb, k in [k0, k1) (multiples of 32); x prefetched xpf k pairs ahead (0: not).
template <int MB, int NB>
void fma_tile(const GemmArgs& a, int64_t nb, const float* xg, int64_t k0, int64_t k1, float* acc, bool init,
              int64_t xpf) {
  __m512 c[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) c[i][j] = init ? _mm512_setzero_ps() : _mm512_loadu_ps(acc_row(acc, i) + j * 16);
  const int64_t block_bytes = a.kp * 32, ld2 = 2 * a.xf_group;
  const uint16_t* w[NB];
  for (int j = 0; j < NB; ++j) w[j] = reinterpret_cast<const uint16_t*>(a.data) + (nb + j) * a.kp * 16;
  const __m512i odd_mask = _mm512_set1_epi32(int(0xFFFF0000u));
  for (int64_t p = k0 / 2; p < k1 / 2; ++p) {
    __m512 we[NB], wo[NB];
    for (int j = 0; j < NB; ++j) {
      _mm_prefetch(stream_ahead(w[j], p * 64, kPrefetchBytes, block_bytes, NB * block_bytes), _MM_HINT_T0);
      const __m512i v = _mm512_loadu_si512(w[j] + p * 32);
      we[j] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
      wo[j] = _mm512_castsi512_ps(_mm512_and_si512(v, odd_mask));
    }
    const float* xp = xg + p * ld2;
    if (xpf) {  // the 2G floats of a k pair: two cache lines for a 16-row group
      const char* ahead = reinterpret_cast<const char*>(xp + xpf * ld2);
      _mm_prefetch(ahead, _MM_HINT_T0);
      _mm_prefetch(ahead + 64, _MM_HINT_T0);
    }
    for (int i = 0; i < MB; ++i) {  // vdpbf16ps's order: the odd element of the pair first
      const __m512 xo = _mm512_set1_ps(xp[2 * i + 1]);
      for (int j = 0; j < NB; ++j) c[i][j] = _mm512_fmadd_ps(xo, wo[j], c[i][j]);
    }
    for (int i = 0; i < MB; ++i) {
      const __m512 xe = _mm512_set1_ps(xp[2 * i]);
      for (int j = 0; j < NB; ++j) c[i][j] = _mm512_fmadd_ps(xe, we[j], c[i][j]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) _mm512_storeu_ps(acc_row(acc, i) + j * 16, c[i][j]);
}

using FmaTile = void (*)(const GemmArgs&, int64_t, const float*, int64_t, int64_t, float*, bool, int64_t);

struct FmaTable {
  FmaTile t[kGroup][kMaxNB] = {};
  template <int MB, int NB>
  void put() {
    if constexpr (fits(MB, NB)) t[MB - 1][NB - 1] = fma_tile<MB, NB>;
  }
  template <int MB>
  void row() { put<MB, 1>(); put<MB, 2>(); put<MB, 3>(); put<MB, 4>(); }
  template <int... I>
  void rows(std::integer_sequence<int, I...>) { (row<I + 1>(), ...); }
  FmaTable() { rows(std::make_integer_sequence<int, kGroup>()); }
};

const FmaTable& table() {
  static const FmaTable t;
  return t;
}

void run(const GemmArgs& a, int64_t nb0, int64_t nb1, float* acc) {
  const FmaTable& tab = table();
  if (a.m <= kGroup) {  // decode and verify: one tile of every row over the whole K
    const int mb = int(a.m), nbmax = blocks_for(mb);
    for (int64_t nb = nb0; nb < nb1; nb += nbmax) {
      const int nbn = int(nb1 - nb < nbmax ? nb1 - nb : nbmax);
      tab.t[mb - 1][nbn - 1](a, nb, a.xf, 0, a.kp, acc, true, 0);
      store_rows(a, nb, nbn, acc);
    }
    return;
  }
  // more rows: chunks of whole groups; a block's K chunk and the chunk's x stay in L2 (or L1 for
  // a verify of 17-24 rows, whose weights stream from DRAM once for both groups)
  const int64_t budget = a.m > kPrefillRows ? kL2Bytes : avx512::kRowTilesL1Bytes;
  for (int64_t m0 = 0; m0 < a.m; m0 += kChunkRows) {
    const int64_t mc = a.m - m0 < kChunkRows ? a.m - m0 : kChunkRows;
    int64_t kc = budget / (32 + 4 * mc) / kKBlk * kKBlk;
    if (kc < kKBlk) kc = kKBlk;
    const GemmArgs chunk = rows_of(a, m0, mc);  // y and m (xf is indexed by group below)
    for (int64_t nb = nb0; nb < nb1; ++nb) {
      for (int64_t k0 = 0; k0 < a.kp; k0 += kc) {
        const int64_t k1 = k0 + kc < a.kp ? k0 + kc : a.kp;
        for (int64_t g = 0; g < mc; g += kGroup) {
          const int mb = int(mc - g < kGroup ? mc - g : kGroup);
          const float* xg = a.xf + (m0 + g) * a.kp;  // group (m0 + g) / 16: G * kp floats each
          tab.t[mb - 1][0](a, nb, xg, k0, k1, acc_row(acc, g), k0 == 0, kXPrefetchPairs);
        }
      }
      store_rows(chunk, nb, 1, acc);
    }
  }
}

}  // namespace

void gemm_blocks_bf16_fma(const GemmArgs& a, int64_t nb0, int64_t nb1, float* acc) {
  const unsigned csr = _mm_getcsr();
  _mm_setcsr(csr | 0x8040);  // FTZ | DAZ: vdpbf16ps's treatment of denormals
  run(a, nb0, nb1, acc);
  _mm_setcsr(csr);
}

// x rows -> the groups of fp32 pairs above (rows row0.., row0 a multiple of G when m > G).
void expand_bf16_pairs_avx512(const float* x, int64_t m, int64_t ldx, int64_t k, int64_t kp, int64_t group,
                              float* out, int64_t row0) {
  // pair index of a row's (even, odd) halves in the two output vectors: rows 0-7, then 8-15
  alignas(64) static const int32_t kLo[16] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23};
  alignas(64) static const int32_t kHi[16] = {8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i lo_idx = _mm512_load_si512(kLo), hi_idx = _mm512_load_si512(kHi);
  const __m512i odd_mask = _mm512_set1_epi32(int(0xFFFF0000u));
  for (int64_t g = 0; g < m; g += 16) {
    const int rows = int(m - g < 16 ? m - g : 16);
    const int64_t r0 = row0 + g;  // the first row of these (a group's first, or its 16-row half)
    float* dst = out + (r0 / group) * group * kp + 2 * (r0 % group);
    const int live = int(group - r0 % group < rows ? group - r0 % group : rows);  // rows stored
    const __mmask16 m_lo = live >= 8 ? __mmask16(0xFFFF) : __mmask16((1u << (2 * live)) - 1);
    const __mmask16 m_hi = live <= 8 ? __mmask16(0) : __mmask16((1u << (2 * (live - 8))) - 1);
    for (int64_t c = 0; c < kp; c += 32) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) {
        const float* src = x + (g + i) * ldx;
        r[i] = i < rows ? _mm512_inserti64x4(_mm512_castsi256_si512(avx512::round16_bf16(src, c, k)),
                                             avx512::round16_bf16(src, c + 16, k), 1)
                        : _mm512_setzero_si512();
      }
      avx512::transpose16(r);  // r[t] = pair c / 2 + t of the 16 rows (bf16 even | odd << 16)
      for (int t = 0; t < 16; ++t) {
        const __m512i even = _mm512_slli_epi32(r[t], 16), odd = _mm512_and_si512(r[t], odd_mask);
        float* d = dst + (c / 2 + t) * 2 * group;
        _mm512_mask_storeu_ps(d, m_lo, _mm512_castsi512_ps(_mm512_permutex2var_epi32(even, lo_idx, odd)));
        _mm512_mask_storeu_ps(d + 16, m_hi, _mm512_castsi512_ps(_mm512_permutex2var_epi32(even, hi_idx, odd)));
      }
    }
  }
}

}  // namespace detail
}  // namespace qspec
