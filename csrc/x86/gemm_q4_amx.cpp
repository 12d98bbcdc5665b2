// MXFP4 on AMX-INT8 tiles: the draft's passes at the amx level after set_mx_tiles(true) (gemm.h).
//
// The block scale is what keeps MX weights off the tiles: it changes every 32 k, and a tile sums
// over k. Folded into integer weights it no longer does. Per row block (16 outputs) let S_n be
// the largest E8M0 scale of output n over all of K and d = S_n - e the binades a block lies below
// it; then w = e2m1 * 2^(e - 127) = (e2m1 * 2^(4 - d)) * 2^(S_n - 131), and e2m1 * 2^(4 - d) is
// an integer in [-96, 96] for d <= 3: 99.9% of the blocks of real checkpoints (Qwen2.5-Coder-1.5B
// cast to MXFP4: d = 0 36%, 1 57%, 2 7%, 3 0.4%, 4+ 0.09%). Blocks with d = 4..6 are rounded to
// the nearest integer (ties to even), blocks 7 or more binades down drop out. The per-output
// factor 2^(S_n - 131) is applied once, to the int32 C tile, after the whole K.
//
// Decode, per slab of 64 weights (16 outputs x 4 k: exactly one row of a TDPBSSD B tile, bytes
// 4n + c): a broadcast load, a vpsrlvw (high nibbles of outputs 8-15 down), a vpternlogd that
// keeps the code and ors in d << 4 (min(d, 7): 7 is the all-zero table), and a vpermb through
// the 64-entry table of e2m1 * 2^(4 - d), d <= 3 (a block with an output 4+ binades down: a
// vpermi2b through all 128): 3 ALU ops per 64 weights, once per pass whatever M is. Rare over
// the model, such blocks are not rare everywhere: in the 1.5B's down projections 1.4% of the
// blocks, in a fifth of the (row block, block) pairs.
//
// x is quantized once per pass, per row, in two int8 parts: u = x * 127 / max|x|, hi = rne(u),
// lo = rne((u - hi) * 128), so x = (hi + lo / 128) * max|x| / 127 within max|x| * 2^-8 / 127
// (14 bits of the row's range). Per 16 rows x 16 outputs x 64 k: two TDPBSSD (hi, lo) into two
// int32 C tiles; y = ((128 C_hi + C_lo) * rowf_m) * 2^(S_n - 131), rowf_m = 1 / (128 * 127 / max|x|).
//
// What it computes (tests/test_gemm.py emulates it in numpy): the integer sums are exact, so a
// row's bits depend only on its own x row, never on M or the other rows (batch invariant in the
// bits); not ref's Q8 arithmetic: drafts are exempt from bit equality with ref (invariant 2).
// A row with a NaN or infinity gives a NaN row; a NaN block scale (0xFF) a NaN column.
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "amx_tiles.h"
#include "gemm_avx512.h"
#include "gemm_internal.h"

namespace qspec {
namespace detail {
namespace {

constexpr int kTileK = 64;               // k per TDPBSSD: 16 B rows of 4 k
constexpr int kBTileBytes = 16 * 64;     // one B tile
constexpr int kDropBinades = 7;          // d >= 7: the block drops out (all-zero table)
constexpr int kBias = 96;                // |weight| <= 96: + 96 makes the vpdpbusd operand unsigned
constexpr int kVnniRows = 2;             // rows <= this: vpdpbusd (q4_vnni), more: tiles (q4_rows)

// Tiles 0-3: C (rows x 16 int32): block j hi = 2j, lo = 2j + 1; 4 / 5: A hi / lo; 6 / 7: B of block 0 / 1.
void configure_tiles(int rows) {
  amx::TileConfig cfg = amx::tile_config();
  for (int t = 0; t < 6; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = uint8_t(rows);
  }
  cfg.colsb[6] = cfg.colsb[7] = 64;
  cfg.rows[6] = cfg.rows[7] = 16;
  amx::load_tile_config(cfg);
}

// The decoder's constants: the table of e2m1 * 2^(4 - d) at index d << 4 | code in 128 bytes
// (d = 7: all zero), its first 64 (d <= 3: the exact ones), the per-word nibble shifts (words
// 16-31 = outputs 8-15 take the high nibbles) and the vpermb index that repeats byte n of a
// 16-byte vector at bytes 4n..4n+3.
struct Decoder {
  __m512i tab_lo, tab_hi, shifts, rep4;
  __m512i utab_lo, utab_hi;  // the same values + kBias, as unsigned bytes (the vpdpbusd operand)
  Decoder() {
    alignas(64) int8_t tab[128];
    static const float kE2M1[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
    for (int d = 0; d < 8; ++d)
      for (int c = 0; c < 16; ++c) {
        const float v = d < kDropBinades ? std::nearbyint(std::ldexp(kE2M1[c & 7], 4 - d)) : 0.f;  // ties to even
        tab[16 * d + c] = int8_t(c & 8 ? -v : v);
      }
    alignas(64) uint16_t sh[32];
    for (int i = 0; i < 32; ++i) sh[i] = i < 16 ? 0 : 4;
    alignas(64) uint8_t rep[64];
    for (int i = 0; i < 64; ++i) rep[i] = uint8_t(i / 4);
    tab_lo = _mm512_load_si512(tab);
    tab_hi = _mm512_load_si512(tab + 64);
    alignas(64) uint8_t utab[128];
    for (int i = 0; i < 128; ++i) utab[i] = uint8_t(tab[i] + kBias);
    utab_lo = _mm512_load_si512(utab);
    utab_hi = _mm512_load_si512(utab + 64);
    shifts = _mm512_load_si512(sh);
    rep4 = _mm512_load_si512(rep);
  }
};

// One MX block of a row block, per byte 4n + c of a slab: min(S_n - e_n, 7) << 4, and whether
// every output of the block is within 3 binades of its S_n (the 64-entry table then holds all).
struct BlockBits {
  __m512i bits;
  bool exact;
};
inline BlockBits block_bits(const Decoder& dc, const uint8_t* smax, const uint8_t* e) {
  __m128i d = _mm_sub_epi8(_mm_load_si128(reinterpret_cast<const __m128i*>(smax)),
                           _mm_loadu_si128(reinterpret_cast<const __m128i*>(e)));
  d = _mm_min_epu8(d, _mm_set1_epi8(kDropBinades));
  const bool exact = _mm_cmpge_epu8_mask(d, _mm_set1_epi8(4)) == 0;
  d = _mm_slli_epi16(d, 4);  // <= 0x70: no carry across bytes
  return {_mm512_permutexvar_epi8(dc.rep4, _mm512_castsi128_si512(d)), exact};
}

// One 32-byte slab -> its 64 weights (16 outputs x 4 k, byte 4n + c) through the table lo | hi:
// one row of a TDPBSSD B tile (signed table), or one vpdpbusd operand (biased table). Exact: every
// output of the block is within 3 binades (nearly all blocks), so the single-register vpermb of
// the table's first 64 bytes serves: the two-register vpermi2b costs twice its issue slots.
template <bool Exact>
inline __m512i decode_slab(const Decoder& dc, const uint8_t* p, __m512i bits, __m512i lo, __m512i hi) {
  __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  v = _mm512_srlv_epi16(v, dc.shifts);
  v = _mm512_ternarylogic_epi32(v, _mm512_set1_epi8(0x0F), bits, 0xEA);  // (v & 0x0F) | bits
  return Exact ? _mm512_permutexvar_epi8(v, lo) : _mm512_permutex2var_epi8(lo, v, hi);
}
inline __m512i decode_slab(const Decoder& dc, const uint8_t* p, const BlockBits& bb, __m512i lo, __m512i hi) {
  return bb.exact ? decode_slab<true>(dc, p, bb.bits, lo, hi) : decode_slab<false>(dc, p, bb.bits, lo, hi);
}

// S_n: each output's largest scale over K, for row blocks nb .. nb + nbn - 1.
inline void column_maxima(const GemmArgs& a, int64_t nb, int nbn, uint8_t (*smax)[16]) {
  const int64_t kb = a.kp / kKBlk;
  for (int j = 0; j < nbn; ++j) {
    const uint8_t* s = a.scales + (nb + j) * kb * kRows;
    __m128i m = _mm_setzero_si128();
    for (int64_t b = 0; b < kb; ++b) m = _mm_max_epu8(m, _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + b * kRows)));
    _mm_store_si128(reinterpret_cast<__m128i*>(smax[j]), m);
  }
}

// y[m, row block nb] = ((128 C_hi + C_lo) * rowf_m) * 2^(S_n - 131): both kernels, the same ops
// (the power of two last, so tiny scales do not pass through fp32 subnormals).
inline void store_row(const GemmArgs& a, int64_t m, int64_t nb, const uint8_t* smax, __m512i chi, __m512i clo) {
  const __m512 f = _mm512_mul_ps(avx512::e8m0x16(smax), _mm512_set1_ps(1.f / 16));  // 2^(S_n - 131)
  const __m512 s = _mm512_fmadd_ps(_mm512_cvtepi32_ps(chi), _mm512_set1_ps(128.f), _mm512_cvtepi32_ps(clo));
  const int64_t left = a.n - nb * kRows, cols = left < kRows ? left : kRows;
  _mm512_mask_storeu_ps(a.y + m * a.ldy + nb * kRows, __mmask16((1u << cols) - 1u),
                        _mm512_mul_ps(_mm512_mul_ps(s, _mm512_set1_ps(a.xrow[m])), f));
}

// K tile t of row block nb (MX blocks 2t, 2t + 1) -> a B tile; a missing second block reads zero.
inline void decode_tile(const GemmArgs& a, const Decoder& dc, int64_t nb, int64_t t, const uint8_t* smax, int8_t* out) {
  const int64_t kb = a.kp / kKBlk;
  for (int h = 0; h < 2; ++h) {
    const int64_t b = 2 * t + h;
    int8_t* o = out + h * 8 * 64;
    if (b >= kb) {
      std::memset(o, 0, 8 * 64);
      continue;
    }
    const int64_t block_bytes = (a.kp / 4) * 32;
    const uint8_t* w = a.data + nb * block_bytes + b * 256;
    // q4_rows takes row blocks in pairs: past this block's end, block nb + 2 is streamed next
    const char* pf = stream_ahead(a.data + nb * block_bytes, b * 256, 2048, block_bytes, 2 * block_bytes);
    _mm_prefetch(pf, _MM_HINT_T0);
    _mm_prefetch(pf + 64, _MM_HINT_T0);
    _mm_prefetch(pf + 128, _MM_HINT_T0);
    _mm_prefetch(pf + 192, _MM_HINT_T0);
    const BlockBits bb = block_bits(dc, smax, a.scales + (nb * kb + b) * kRows);
    if (bb.exact)
      for (int g = 0; g < 8; ++g) _mm512_store_si512(o + g * 64, decode_slab<true>(dc, w + 32 * g, bb.bits, dc.tab_lo, dc.tab_hi));
    else
      for (int g = 0; g < 8; ++g) _mm512_store_si512(o + g * 64, decode_slab<false>(dc, w + 32 * g, bb.bits, dc.tab_lo, dc.tab_hi));
  }
}

// Rows [m0, m0 + rows) (rows <= 16) x row blocks [nb0, nb1), two row blocks at a time, all K.
void q4_rows(const GemmArgs& a, const Decoder& dc, int64_t nb0, int64_t nb1, int64_t m0, int rows) {
  configure_tiles(rows);
  const int64_t kt = a.kq / kTileK;
  alignas(64) int8_t bbuf[2][2][kBTileBytes];  // double-buffered: a K tile's B tiles, then the next's
  alignas(64) int32_t chi[16 * 16], clo[16 * 16];
  alignas(16) uint8_t smax[2][16];
  const int8_t* ahi = a.xi8 + m0 * a.kq;
  const int8_t* alo = a.xi8 + (a.m + m0) * a.kq;
  for (int64_t nb = nb0; nb < nb1; nb += 2) {
    const int nbn = nb1 - nb < 2 ? 1 : 2;
    column_maxima(a, nb, nbn, smax);
    _tile_zero(0);
    _tile_zero(1);
    if (nbn == 2) {
      _tile_zero(2);
      _tile_zero(3);
    }
    for (int j = 0; j < nbn; ++j) decode_tile(a, dc, nb + j, 0, smax[j], bbuf[0][j]);
    for (int64_t t = 0; t < kt; ++t) {
      // decode K tile t + 1 before the tiles read K tile t (the B tiles a tile load reads were
      // stored an iteration earlier): 4-8% less time at 3-8 rows with the weights in cache
      if (t + 1 < kt)
        for (int j = 0; j < nbn; ++j) decode_tile(a, dc, nb + j, t + 1, smax[j], bbuf[(t + 1) & 1][j]);
      int8_t(*bt)[kBTileBytes] = bbuf[t & 1];
      _tile_loadd(4, ahi + t * kTileK, a.kq);
      _tile_loadd(5, alo + t * kTileK, a.kq);
      _tile_loadd(6, bt[0], 64);
      _tile_dpbssd(0, 4, 6);
      _tile_dpbssd(1, 5, 6);
      if (nbn == 2) {
        _tile_loadd(7, bt[1], 64);
        _tile_dpbssd(2, 4, 7);
        _tile_dpbssd(3, 5, 7);
      }
    }
    for (int j = 0; j < nbn; ++j) {
      if (j == 0) {
        _tile_stored(0, chi, 64);
        _tile_stored(1, clo, 64);
      } else {
        _tile_stored(2, chi, 64);
        _tile_stored(3, clo, 64);
      }
      for (int r = 0; r < rows; ++r)
        store_row(a, m0 + r, nb + j, smax[j], _mm512_load_si512(chi + 16 * r), _mm512_load_si512(clo + 16 * r));
    }
  }
}

// All rows (3 <= m <= 8) x row blocks [nb0, nb1), kStackBlocks row blocks at a time, all K. The
// two int8 parts of the m rows are 2m consecutive rows of xi8 (quantize_x_i8x2), so one A tile
// of 2m rows holds both and one TDPBSSD per row block and K tile gives C rows 0..m-1 (hi) and
// m..2m-1 (lo): half the tile instructions of q4_rows, the same integer sums (the same bits).
// Tiles 0..2: C of block j; 3: A; 4..6: B of block j.
constexpr int kStackBlocks = 3;
void q4_stacked(const GemmArgs& a, const Decoder& dc, int64_t nb0, int64_t nb1) {
  const int rows = int(a.m);
  amx::TileConfig cfg = amx::tile_config();
  for (int t = 0; t < 7; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = uint8_t(t <= kStackBlocks ? 2 * rows : 16);
  }
  amx::load_tile_config(cfg);
  const int64_t kt = a.kq / kTileK;
  alignas(64) int8_t bbuf[2][kStackBlocks][kBTileBytes];
  alignas(64) int32_t c[16 * 16];
  alignas(16) uint8_t smax[kStackBlocks][16];
  for (int64_t nb = nb0; nb < nb1; nb += kStackBlocks) {
    const int nbn = nb1 - nb < kStackBlocks ? int(nb1 - nb) : kStackBlocks;
    column_maxima(a, nb, nbn, smax);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    for (int j = 0; j < nbn; ++j) decode_tile(a, dc, nb + j, 0, smax[j], bbuf[0][j]);
    for (int64_t t = 0; t < kt; ++t) {
      if (t + 1 < kt)
        for (int j = 0; j < nbn; ++j) decode_tile(a, dc, nb + j, t + 1, smax[j], bbuf[(t + 1) & 1][j]);
      int8_t(*bt)[kBTileBytes] = bbuf[t & 1];
      _tile_loadd(3, a.xi8 + t * kTileK, a.kq);
      _tile_loadd(4, bt[0], 64);
      _tile_dpbssd(0, 3, 4);
      if (nbn > 1) {
        _tile_loadd(5, bt[1], 64);
        _tile_dpbssd(1, 3, 5);
      }
      if (nbn > 2) {
        _tile_loadd(6, bt[2], 64);
        _tile_dpbssd(2, 3, 6);
      }
    }
    for (int j = 0; j < nbn; ++j) {
      if (j == 0) _tile_stored(0, c, 64);
      if (j == 1) _tile_stored(1, c, 64);
      if (j == 2) _tile_stored(2, c, 64);
      for (int r = 0; r < rows; ++r)
        store_row(a, r, nb + j, smax[j], _mm512_load_si512(c + 16 * r), _mm512_load_si512(c + 16 * (rows + r)));
    }
  }
}

// MB <= kVnniRows rows x NB row blocks from nb, all K, with vpdpbusd: the same integer sums as the
// tiles (exact int32, any order), so the same bits. Per slab: one decode per row block, then per
// row two broadcasts (hi, lo) and two vpdpbusd per row block; the bias comes off once at the end
// (kBias * sum_k x, from quantize_x_i8x2).
template <int MB, int NB>
void q4_vnni(const GemmArgs& a, const Decoder& dc, int64_t nb, int64_t m0) {
  const int64_t kb = a.kp / kKBlk;
  alignas(16) uint8_t smax[NB][16];
  column_maxima(a, nb, NB, smax);
  const int64_t block_bytes = (a.kp / 4) * 32;
  const uint8_t* w[NB];
  for (int j = 0; j < NB; ++j) w[j] = a.data + (nb + j) * block_bytes;
  const int8_t* xh[MB];
  const int8_t* xl[MB];
  for (int i = 0; i < MB; ++i) {
    xh[i] = a.xi8 + (m0 + i) * a.kq;
    xl[i] = a.xi8 + (a.m + m0 + i) * a.kq;
  }
  __m512i hi[MB][NB], lo[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) hi[i][j] = lo[i][j] = _mm512_setzero_si512();
  // one MX block of the NB row blocks: Exact when all of them take the 64-entry table
  auto block = [&](auto exact, int64_t b, const BlockBits* bb) {
    for (int g = 0; g < 8; ++g) {
      const int64_t slab = b * 8 + g;
      __m512i wv[NB];
      for (int j = 0; j < NB; ++j) {
        if (g % 2 == 0) _mm_prefetch(stream_ahead(w[j], slab * 32, 2048, block_bytes, NB * block_bytes), _MM_HINT_T0);
        wv[j] = exact ? decode_slab<true>(dc, w[j] + slab * 32, bb[j].bits, dc.utab_lo, dc.utab_hi)
                      : decode_slab(dc, w[j] + slab * 32, bb[j], dc.utab_lo, dc.utab_hi);
      }
      for (int i = 0; i < MB; ++i) {
        int32_t qh, ql;
        std::memcpy(&qh, xh[i] + slab * 4, 4);
        std::memcpy(&ql, xl[i] + slab * 4, 4);
        const __m512i bh = _mm512_set1_epi32(qh), bl = _mm512_set1_epi32(ql);
        for (int j = 0; j < NB; ++j) {
          hi[i][j] = _mm512_dpbusd_epi32(hi[i][j], wv[j], bh);
          lo[i][j] = _mm512_dpbusd_epi32(lo[i][j], wv[j], bl);
        }
      }
    }
  };
  for (int64_t b = 0; b < kb; ++b) {
    BlockBits bb[NB];
    bool exact = true;
    for (int j = 0; j < NB; ++j) {
      bb[j] = block_bits(dc, smax[j], a.scales + ((nb + j) * kb + b) * kRows);
      exact = exact && bb[j].exact;
    }
    if (exact)
      block(std::true_type{}, b, bb);
    else
      block(std::false_type{}, b, bb);
  }
  for (int i = 0; i < MB; ++i) {
    const __m512i bh = _mm512_set1_epi32(kBias * a.xsum[m0 + i]), bl = _mm512_set1_epi32(kBias * a.xsum[a.m + m0 + i]);
    for (int j = 0; j < NB; ++j)
      store_row(a, m0 + i, nb + j, smax[j], _mm512_sub_epi32(hi[i][j], bh), _mm512_sub_epi32(lo[i][j], bl));
  }
}

using VnniFn = void (*)(const GemmArgs&, const Decoder&, int64_t, int64_t);
template <int MB>
constexpr VnniFn vnni_fn(int nbn) {
  return nbn == 1 ? q4_vnni<MB, 1> : nbn == 2 ? q4_vnni<MB, 2> : nbn == 3 ? q4_vnni<MB, 3> : q4_vnni<MB, 4>;
}
// Row blocks per pass of the vpdpbusd kernel: 4 streams for a GEMV, 2 for 2-4 rows (registers).
constexpr int vnni_blocks(int64_t m) { return m == 1 ? 4 : 2; }

}  // namespace

void quantize_x_i8x2(const float* x, int64_t m, int64_t ldx, int64_t k, int64_t kq, int8_t* out, float* rowf,
                     int32_t* sums) {
  alignas(64) uint8_t idx[64];
  for (int j = 0; j < 64; ++j) idx[j] = uint8_t(4 * (j % 16));  // byte 0 of each int32 (|v| <= 127)
  const __m512i low_bytes = _mm512_load_si512(idx);
  for (int64_t i = 0; i < m; ++i) {
    const float* src = x + i * ldx;
    int8_t* hi = out + i * kq;
    int8_t* lo = out + (m + i) * kq;
    __m512 amax = _mm512_setzero_ps();
    __mmask16 bad = 0;
    for (int64_t c = 0; c < k; c += 16) {
      const __mmask16 in = c + 16 <= k ? __mmask16(0xFFFF) : __mmask16((1u << (k - c)) - 1u);
      const __m512 v = _mm512_abs_ps(_mm512_maskz_loadu_ps(in, src + c));
      bad |= _mm512_cmp_ps_mask(v, _mm512_set1_ps(std::numeric_limits<float>::max()), _CMP_NLE_UQ);  // inf, NaN
      amax = _mm512_max_ps(amax, v);
    }
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, amax);
    float mx = 0.f;
    for (float v : lanes) mx = v > mx ? v : mx;
    const float inv = bad || mx == 0.f ? 0.f : 127.f / mx;
    rowf[i] = bad ? std::numeric_limits<float>::quiet_NaN() : mx == 0.f ? 0.f : 1.f / (inv * 128.f);
    const __m512 vinv = _mm512_set1_ps(inv);
    __m512i sh = _mm512_setzero_si512(), sl = _mm512_setzero_si512();
    for (int64_t c = 0; c < kq; c += 16) {
      const __mmask16 in = c + 16 <= k ? __mmask16(0xFFFF) : c < k ? __mmask16((1u << (k - c)) - 1u) : __mmask16(0);
      const __m512 u = _mm512_mul_ps(_mm512_maskz_loadu_ps(in, src + c), vinv);
      const __m512 h = _mm512_roundscale_ps(u, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m512 l = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_sub_ps(u, h), _mm512_set1_ps(128.f)),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m512i ih = _mm512_cvtps_epi32(h), il = _mm512_cvtps_epi32(l);
      sh = _mm512_add_epi32(sh, ih);
      sl = _mm512_add_epi32(sl, il);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + c), _mm512_castsi512_si128(_mm512_permutexvar_epi8(low_bytes, ih)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + c), _mm512_castsi512_si128(_mm512_permutexvar_epi8(low_bytes, il)));
    }
    alignas(64) int32_t part[2][16];
    _mm512_store_si512(part[0], sh);
    _mm512_store_si512(part[1], sl);
    sums[i] = sums[m + i] = 0;
    for (int j = 0; j < 16; ++j) {
      sums[i] += part[0][j];
      sums[m + i] += part[1][j];
    }
  }
}

void gemm_blocks_q4_amx(const GemmArgs& a, int64_t nb0, int64_t nb1, float* /*acc*/) {
  const Decoder dc;
  if (a.m <= kVnniRows) {
    const int nbmax = vnni_blocks(a.m);
    for (int64_t nb = nb0; nb < nb1; nb += nbmax) {
      const int nbn = int(nb1 - nb < nbmax ? nb1 - nb : nbmax);
      const VnniFn f = a.m == 1 ? vnni_fn<1>(nbn) : a.m == 2 ? vnni_fn<2>(nbn) : a.m == 3 ? vnni_fn<3>(nbn) : vnni_fn<4>(nbn);
      f(a, dc, nb, 0);
    }
    return;
  }
  if (2 * a.m <= 16)
    q4_stacked(a, dc, nb0, nb1);
  else
    for (int64_t m0 = 0; m0 < a.m; m0 += 16) q4_rows(a, dc, nb0, nb1, m0, int(a.m - m0 < 16 ? a.m - m0 : 16));
  _tile_release();
}

}  // namespace detail
}  // namespace qspec
