// MXFP4 x Q8 activations on AMX-INT8 tiles, for multi-row draft passes (tree levels, level-2
// checks) at the amx level: chosen by gemm_choose for M >= kAmxQ4MinRows (gemm.cpp).
//
// Per MX block (32 k) and row block: the 8 slabs are decoded once to signed bytes 2*E2M1 in
// [-12, 12] (one LUT shuffle per slab) into a 512-byte B tile, which is already the TDPBSSD
// layout: B row r = k 4r..4r+3 of the 16 output rows, 4 bytes each. A = 16 rows x 32 Q8 bytes of
// x; one TDPBSSD per block gives C = the exact signed integer dot sum(2*e2m1 * q) for 16 x 16
// outputs, which equals ref's isum - xc. The fp32 epilogue is ref's: y = fma(float(dot),
// e8m0 * xd, y) per block in k order, so this path is bit-identical to ref, avx2, avx512 and
// VNNI (gemm.h): the path may change with M without changing a bit.
// The TMUL work per block is fixed; what grows with M is the epilogue (a convert and an fma per
// row and 16 outputs), so extra rows cost a fraction of what they cost on vector paths, where
// each row also pays the multiply-adds.
// Not yet run on AMX hardware: tested against ref under emulation (tests/test_isa_emulation.py).
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "amx_tiles.h"
#include "gemm_avx512.h"
#include "gemm_internal.h"

namespace qspec {
namespace detail {
namespace {

// Tiles 0-3: C (rows x 16 int32); 4-5: A (rows x 32 Q8 bytes, row tiles 0 and 1);
// 6-7: B (8 x 64 bytes). rows0 / rows1: the rows of row tile 0 / 1 (1..16).
void configure_tiles(int mt, int nbb, int rows0, int rows1) {
  amx::TileConfig cfg = amx::tile_config();
  for (int c = 0; c < 4; ++c) {
    cfg.colsb[c] = 64;
    cfg.rows[c] = uint8_t(mt == 2 && c >= nbb ? rows1 : rows0);
  }
  cfg.colsb[4] = cfg.colsb[5] = 32;
  cfg.rows[4] = uint8_t(rows0);
  cfg.rows[5] = uint8_t(mt == 2 ? rows1 : rows0);
  cfg.colsb[6] = cfg.colsb[7] = 64;
  cfg.rows[6] = cfg.rows[7] = 8;
  amx::load_tile_config(cfg);
}

// Tile numbers are literal tokens of the intrinsics: C tile t = i * nbb + j.
inline void zero_c(int t) {
  switch (t) {
    case 0: _tile_zero(0); break;
    case 1: _tile_zero(1); break;
    case 2: _tile_zero(2); break;
    default: _tile_zero(3); break;
  }
}
inline void store_c(int t, int32_t* c) {
  switch (t) {
    case 0: _tile_stored(0, c, 64); break;
    case 1: _tile_stored(1, c, 64); break;
    case 2: _tile_stored(2, c, 64); break;
    default: _tile_stored(3, c, 64); break;
  }
}
inline void load_a(int i, const int8_t* p, int64_t stride) {
  if (i == 0) _tile_loadd(4, p, stride);
  else _tile_loadd(5, p, stride);
}
inline void load_b(int j, const int8_t* p) {
  if (j % 2 == 0) _tile_loadd(6, p, 64);
  else _tile_loadd(7, p, 64);
}
// C(t) += A(i) . B(j % 2)
inline void dot(int t, int i, int j) {
#define QSPEC_TDP(c, a, b) \
  if (t == c && i == a - 4 && j % 2 == b - 6) { _tile_dpbssd(c, a, b); return; }
  QSPEC_TDP(0, 4, 6) QSPEC_TDP(0, 4, 7) QSPEC_TDP(1, 4, 6) QSPEC_TDP(1, 4, 7)
  QSPEC_TDP(2, 4, 6) QSPEC_TDP(2, 4, 7) QSPEC_TDP(3, 4, 6) QSPEC_TDP(3, 4, 7)
  QSPEC_TDP(2, 5, 6) QSPEC_TDP(2, 5, 7) QSPEC_TDP(3, 5, 6) QSPEC_TDP(3, 5, 7)
#undef QSPEC_TDP
}

// Rows [m0, m0 + rows) (rows <= 32: mt = 1 or 2 row tiles) x row blocks [nb0, nb1) over all K.
void q4_rows(const GemmArgs& a, int64_t nb0, int64_t nb1, int64_t m0, int64_t rows, float* acc) {
  const int mt = rows > 16 ? 2 : 1;
  const int nbb = mt == 2 ? 2 : 4;
  const int rows0 = int(rows < 16 ? rows : 16), rows1 = int(rows - rows0);
  configure_tiles(mt, nbb, rows0, mt == 2 ? rows1 : rows0);
  const int64_t kb = a.kp / kKBlk;
  const __m512i lut = avx512::q4_lut_signed();
  alignas(64) int8_t bbuf[4][8 * 64];
  alignas(64) int32_t cbuf[16 * 16];
  for (int64_t nb = nb0; nb < nb1; nb += nbb) {
    const int nbn = int(nb1 - nb < nbb ? nb1 - nb : nbb);
    for (int64_t r = 0; r < rows; ++r) std::memset(acc + (m0 + r) * kAccCols, 0, size_t(nbn) * 16 * 4);
    for (int64_t b = 0; b < kb; ++b) {
      for (int j = 0; j < nbn; ++j) {  // decode this block of row block nb + j into its B tile
        const uint8_t* w = a.data + ((nb + j) * (a.kp / 4) + b * 8) * 32;
        _mm_prefetch(reinterpret_cast<const char*>(w + 2048), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(w + 2048 + 64), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(w + 2048 + 128), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(w + 2048 + 192), _MM_HINT_T0);
        for (int g = 0; g < 8; ++g) _mm512_store_si512(bbuf[j] + g * 64, avx512::q4_slab(w + g * 32, lut));
      }
      for (int i = 0; i < mt; ++i) {
        load_a(i, a.xq + (m0 + 16 * i) * a.kp + b * kKBlk, a.kp);
        for (int j = 0; j < nbn; ++j) {
          const int t = i * nbb + j;
          zero_c(t);
          if (i == 0) load_b(j, bbuf[j]);  // mt = 2 has nbb = 2: B tiles 6, 7 still hold blocks 0, 1
          dot(t, i, j);
        }
      }
      for (int i = 0; i < mt; ++i) {
        const int64_t r0 = m0 + 16 * i, nr = i == 0 ? rows0 : rows1;
        for (int j = 0; j < nbn; ++j) {
          store_c(i * nbb + j, cbuf);
          const __m512 d = avx512::e8m0x16(a.scales + ((nb + j) * kb + b) * kRows);
          for (int64_t r = 0; r < nr; ++r) {
            const __m512 fi = _mm512_cvtepi32_ps(_mm512_load_si512(cbuf + r * 16));
            const __m512 dd = _mm512_mul_ps(d, _mm512_set1_ps(a.xd[(r0 + r) * kb + b]));
            float* pa = acc + (r0 + r) * kAccCols + j * 16;
            _mm512_storeu_ps(pa, _mm512_fmadd_ps(fi, dd, _mm512_loadu_ps(pa)));
          }
        }
      }
    }
    const int64_t left = a.n - nb * kRows;
    const int64_t cols = left < nbn * kRows ? left : nbn * kRows;
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(a.y + (m0 + r) * a.ldy + nb * kRows, acc + (m0 + r) * kAccCols, size_t(cols) * 4);
  }
}

}  // namespace

void gemm_blocks_q4_amx(const GemmArgs& a, int64_t nb0, int64_t nb1, float* acc) {
  for (int64_t m0 = 0; m0 < a.m; m0 += 32) q4_rows(a, nb0, nb1, m0, a.m - m0 < 32 ? a.m - m0 : 32, acc);
  _tile_release();
}

}  // namespace detail
}  // namespace qspec
