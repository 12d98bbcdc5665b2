// MXFP4 on AMX-BF16 tiles: the draft's passes at the amx level after set_mx_tiles(true) (gemm.h).
//
// The block scale is what keeps MX weights off the tiles: it changes every 32 k, and a tile sums
// over k. Folded into the weights it no longer does. Per row block (16 outputs) let S_n be the
// largest E8M0 scale of output n over all of K; then w = e2m1 * 2^(e - 127) = (e2m1 * 2^-(S_n - e))
// * 2^(S_n - 127), the first factor is an exact BF16 number (S_n - e <= 125), and the second is a
// per-column factor applied once, to the fp32 C tile, after the whole K. Each MX block (16 outputs
// x 32 k, 256 bytes) is decoded straight into a B tile in VNNI pairs (16 rows of 16 outputs x 2 k):
//   codes -> bytes      one broadcast load, a masked shift and an and: 64 nibbles as bytes
//   bytes -> B row      vpermb places each code in both bytes of its BF16 word (16 added to the
//                       high byte's), a second vpermb looks both up in a 32-entry table (E2M1
//                       as BF16, both zeros as +0); vpsubusw takes (S_n - e) << 7
//                       off the exponent (zeros saturate to zero; a block 2^126 or more below
//                       its column's largest is dropped: the whole word saturates to zero)
// so a block costs 4 permutes per 64 weights, once per pass, whatever M is; the rows then cost one
// TDPBF16PS per 32 k and 16 outputs in a 16-row tile. x is rounded to BF16 (RNE) once per pass.
//
// What it computes (tests/test_gemm.py holds it to a float64 oracle): y = sum_k bf16(x_k) * w_k,
// exact weights (blocks under 2^-125 of their column's largest dropped, BF16 denormals read as
// zero by the tiles), fp32 sums in the tile's order, times 2^(S_n - 127). Not ref's Q8 arithmetic:
// drafts are exempt from bit equality (invariant 2); each row's C row reads only its own A row,
// so a row's bits depend on its own inputs only, whatever M is (tests/test_native_model.py).
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "amx_tiles.h"
#include "gemm_avx512.h"
#include "gemm_internal.h"

namespace qspec {
namespace detail {
namespace {

constexpr int kBTileWords = 16 * 32;  // one B tile: 16 rows of 32 BF16

// Tiles 0-3: C (rows x 16 fp32); 4-5: A (rows x 32 bf16, row tiles 0 and 1); 6-7: B.
// rows0 / rows1: the rows of row tile 0 / 1 (1..16).
void configure_tiles(int mt, int nbb, int rows0, int rows1) {
  amx::TileConfig cfg = amx::tile_config();
  for (int c = 0; c < 4; ++c) {
    cfg.colsb[c] = 64;
    cfg.rows[c] = uint8_t(mt == 2 && c >= nbb ? rows1 : rows0);
  }
  cfg.colsb[4] = cfg.colsb[5] = 64;
  cfg.rows[4] = uint8_t(rows0);
  cfg.rows[5] = uint8_t(mt == 2 ? rows1 : rows0);
  cfg.colsb[6] = cfg.colsb[7] = 64;
  cfg.rows[6] = cfg.rows[7] = 16;
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
inline void store_c(int t, float* c) {
  switch (t) {
    case 0: _tile_stored(0, c, 64); break;
    case 1: _tile_stored(1, c, 64); break;
    case 2: _tile_stored(2, c, 64); break;
    default: _tile_stored(3, c, 64); break;
  }
}
inline void load_a(int i, const uint16_t* p, int64_t stride) {
  if (i == 0) _tile_loadd(4, p, stride);
  else _tile_loadd(5, p, stride);
}
inline void load_b(int j, const uint16_t* p) {
  if (j % 2 == 0) _tile_loadd(6, p, 64);
  else _tile_loadd(7, p, 64);
}
// C(t) += A(i) . B(j % 2)
inline void dot(int t, int i, int j) {
#define QSPEC_TDP(c, a, b) \
  if (t == c && i == a - 4 && j % 2 == b - 6) { _tile_dpbf16ps(c, a, b); return; }
  QSPEC_TDP(0, 4, 6) QSPEC_TDP(0, 4, 7) QSPEC_TDP(1, 4, 6) QSPEC_TDP(1, 4, 7)
  QSPEC_TDP(2, 4, 6) QSPEC_TDP(2, 4, 7) QSPEC_TDP(3, 4, 6) QSPEC_TDP(3, 4, 7)
  QSPEC_TDP(2, 5, 6) QSPEC_TDP(2, 5, 7) QSPEC_TDP(3, 5, 6) QSPEC_TDP(3, 5, 7)
#undef QSPEC_TDP
}

// The decoder's constants: per half h of a slab (k 4g + 2h, +1) the vpermb index that puts code
// (n, 4g + 2h + j) in both bytes of word 2n + j, and the 32-entry byte table of E2M1 codes as BF16
// (entries 0-15 the low bytes, 16-31 the high bytes: the high byte's index has 16 added).
struct Decoder {
  __m512i place[2];
  __m512i table;
  Decoder() {
    alignas(64) uint8_t idx[2][64];
    for (int h = 0; h < 2; ++h)
      for (int n = 0; n < 16; ++n)
        for (int j = 0; j < 2; ++j)  // the code's byte in the slab (q4_slab order: 4n + c)
          idx[h][2 * (2 * n + j)] = idx[h][2 * (2 * n + j) + 1] = uint8_t(4 * n + 2 * h + j);
    static const uint16_t kMag[8] = {0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0};
    alignas(64) uint8_t tab[64] = {};
    for (int c = 0; c < 16; ++c) {
      const uint16_t v = (c & 7) ? uint16_t(kMag[c & 7] | ((c & 8) ? 0x8000 : 0)) : 0;  // -0 -> +0
      tab[c] = uint8_t(v & 0xFF);
      tab[16 + c] = uint8_t(v >> 8);
    }
    place[0] = _mm512_load_si512(idx[0]);
    place[1] = _mm512_load_si512(idx[1]);
    table = _mm512_load_si512(tab);
  }
};

// Per word of a B row: (S_n - e) << 7, or all ones (the block drops out) when S_n - e > 125.
inline __m512i exponent_drop(const uint8_t* smax, const uint8_t* e) {
  const __m128i d = _mm_sub_epi8(_mm_load_si128(reinterpret_cast<const __m128i*>(smax)),
                                 _mm_loadu_si128(reinterpret_cast<const __m128i*>(e)));
  const __m512i dd = _mm512_cvtepu8_epi32(d);
  const __mmask16 gone = _mm512_cmpgt_epi32_mask(dd, _mm512_set1_epi32(125));
  const __m512i sh = _mm512_or_si512(_mm512_slli_epi32(dd, 7), _mm512_slli_epi32(dd, 23));
  return _mm512_mask_mov_epi32(sh, gone, _mm512_set1_epi32(-1));
}

// One MX block of a row block (8 slabs of 32 bytes) -> a B tile (16 rows x 32 BF16).
inline void decode_block(const Decoder& dc, const uint8_t* w, __m512i drop, uint16_t* out) {
  const __m512i low4 = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi16(0x1000);
  for (int g = 0; g < 8; ++g) {
    __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * g)));
    v = _mm512_mask_blend_epi16(__mmask32(0xFFFF0000u), v, _mm512_srli_epi16(v, 4));  // upper half: high nibbles
    const __m512i codes = _mm512_and_si512(v, low4);              // the 64 codes, byte 4n + c
    for (int h = 0; h < 2; ++h) {
      const __m512i t = _mm512_or_si512(_mm512_permutexvar_epi8(dc.place[h], codes), high);
      const __m512i b = _mm512_subs_epu16(_mm512_permutexvar_epi8(t, dc.table), drop);
      _mm512_store_si512(out + (2 * g + h) * 32, b);
    }
  }
}

// Rows [m0, m0 + rows) (rows <= 32: mt = 1 or 2 row tiles) x row blocks [nb0, nb1) over all K.
void q4_rows(const GemmArgs& a, const Decoder& dc, int64_t nb0, int64_t nb1, int64_t m0, int64_t rows) {
  const int mt = rows > 16 ? 2 : 1;
  const int nbb = mt == 2 ? 2 : 4;
  const int rows0 = int(rows < 16 ? rows : 16), rows1 = int(rows - rows0);
  configure_tiles(mt, nbb, rows0, mt == 2 ? rows1 : rows0);
  const int64_t kb = a.kp / kKBlk;
  alignas(64) uint16_t bbuf[2][4][kBTileWords];  // double-buffered: a block's B tiles, then the next's
  alignas(64) float cbuf[16 * 16];
  alignas(16) uint8_t smax[4][16];
  for (int64_t nb = nb0; nb < nb1; nb += nbb) {
    const int nbn = int(nb1 - nb < nbb ? nb1 - nb : nbb);
    for (int j = 0; j < nbn; ++j) {  // S_n: each output's largest scale over K
      const uint8_t* s = a.scales + (nb + j) * kb * kRows;
      __m128i m = _mm_setzero_si128();
      for (int64_t b = 0; b < kb; ++b)
        m = _mm_max_epu8(m, _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + b * kRows)));
      _mm_store_si128(reinterpret_cast<__m128i*>(smax[j]), m);
    }
    for (int t = 0; t < mt * nbb; ++t)
      if (t % nbb < nbn) zero_c(t);
    for (int64_t b = 0; b < kb; ++b) {
      uint16_t(*bt)[kBTileWords] = bbuf[b & 1];
      for (int j = 0; j < nbn; ++j) {
        const uint8_t* w = a.data + ((nb + j) * (a.kp / 4) + b * 8) * 32;
        _mm_prefetch(reinterpret_cast<const char*>(w + 2048), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(w + 2048 + 64), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(w + 2048 + 128), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(w + 2048 + 192), _MM_HINT_T0);
        decode_block(dc, w, exponent_drop(smax[j], a.scales + ((nb + j) * kb + b) * kRows), bt[j]);
      }
      for (int i = 0; i < mt; ++i) {
        load_a(i, a.xbf + (m0 + 16 * i) * a.kp + b * kKBlk, a.kp * 2);
        for (int j = 0; j < nbn; ++j) {
          if (i == 0) load_b(j, bt[j]);  // mt = 2 has nbb = 2: B tiles 6, 7 still hold blocks 0, 1
          dot(i * nbb + j, i, j);
        }
      }
    }
    const int64_t left = a.n - nb * kRows;
    for (int i = 0; i < mt; ++i) {
      const int64_t r0 = m0 + 16 * i, nr = i == 0 ? rows0 : rows1;
      for (int j = 0; j < nbn; ++j) {
        store_c(i * nbb + j, cbuf);
        const __m512 f = avx512::e8m0x16(smax[j]);
        const int64_t cols = left - j * kRows < kRows ? left - j * kRows : kRows;
        const __mmask16 keep = __mmask16((1u << cols) - 1u);
        for (int64_t r = 0; r < nr; ++r)
          _mm512_mask_storeu_ps(a.y + (r0 + r) * a.ldy + (nb + j) * kRows, keep,
                                _mm512_mul_ps(_mm512_load_ps(cbuf + r * 16), f));
      }
    }
  }
}

}  // namespace

void gemm_blocks_q4_amx(const GemmArgs& a, int64_t nb0, int64_t nb1, float* /*acc*/) {
  const Decoder dc;
  for (int64_t m0 = 0; m0 < a.m; m0 += 32) q4_rows(a, dc, nb0, nb1, m0, a.m - m0 < 32 ? a.m - m0 : 32);
  _tile_release();
}

}  // namespace detail
}  // namespace qspec
