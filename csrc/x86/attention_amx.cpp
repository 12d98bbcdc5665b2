// AMX-BF16 attention (the amx level): QKᵀ and PV of one call's (row, head) pairs of ONE KV head
// on tiles (attention.h's driver, segments and partials are unchanged). Same three passes as
// attention_avx512.cpp; what differs is how the two products are summed.
//
// Exact BF16 operands. K and V are BF16 already. An FP32 value x (a q element, a softmax weight)
// is split x = hi + mid + lo into three BF16 values by truncation (each remainder is exact in
// FP32 and the last one has at most 8 significant bits), so each product TDPBF16PS forms is
// exact and only the FP32 sums round, as on the FMA paths: nothing is rounded to BF16 that the
// FMA paths keep in FP32 (AMX flushes BF16 denormals: parts below 2^-126 are lost).
//
//   scores  Sᵀ[key][pair] = Σ_part Σ_c K[key][32c ..] · q_part[pair][32c ..]: A = 16 keys × 32
//           columns of K (staged BF16 rows), B = the pairs' q parts (VNNI pairs of columns),
//           C = 16 keys × 16 pairs; parts lo, mid, hi (the small sums first, so the rounding is
//           that of the hi sum: close to the FMA paths'), chunks c of 32 columns in order.
//           A score depends on its q and its key's row only (never on which keys or pairs share
//           a tile), so key blocks may start anywhere.
//   values  out[pair][col] += Σ_part w_part[pair][32 keys] · V[32 keys][col]: A = 16 pairs × a
//           32-key block of the weights' parts, B = the block's V rows as VNNI key pairs,
//           C = 16 pairs × 16 columns from zero per block (parts lo, mid, hi), then added to the
//           FP32 running sums; blocks of 32 keys counted from key 0 in key order. Keys a pair does not attend carry weight 0
//           (an exact zero product), so a pair's sums depend on its own weights only.
// Each C row reads only its own A row (the SDM's TDPBF16PS), so a pair's bits do not depend on
// m, the other pairs of its tile, the thread count or how the driver grouped pairs: the batch
// invariance of attention.h holds, and the choice of this path depends on the ISA level only
// (attn_choose). Tree rows: the keys every row shares (the prefix rounded down to 32) are
// streamed for all pairs; each row's remaining logical keys are gathered from their slots into
// the same 32-key blocks from key 0, so a tree row's arithmetic is a linear row's at its position.
//
// Vector work around the tiles: each pair's q parts are built 16 pairs at a time and put into
// the B layout by a 16 x 16 dword transpose; a score tile is transposed back so each pair's 16
// scores are one vector (scale, masked store, running max in 16 lanes). Up to 4 C tiles are in
// flight (score_tiles: 2 key blocks x 2 pair blocks or 4 key blocks x 1; value_tiles: 4 column
// tiles). None of this changes a bit: every C element sees the same TDPBF16PS sequence.
//
// Checked against the float64 oracle, for batch invariance and tree == linear rows on a Sapphire
// Rapids VM and under emulation (tests/test_isa_emulation.py). Speed there (`qspec bench
// attention --contexts 2048,8192 --ms 1,16 --prefill --paths avx512,amx`, 2 threads,
// Qwen2.5-Coder-1.5B's 12/2 heads of 128, read bandwidth ~30 GB/s): a whole 2,048-token prompt
// 0.57x the AVX-512 kernel's time (was 1.07x with scalar q parts and score gathers), 8,192 tokens
// 0.58x; 16 rows at 2k-8k keys 0.58-0.65x; one row level (0.97-0.98x). Tried and measured no
// faster, so not kept: one BF16 part for q and the weights (a third of the TDPBF16PS), K read in
// place from the cache, all four K chunks held in tiles, software prefetch, AVX-512 V staging.
// Tried and not kept for batch invariance: one C chain per element through a whole segment in
// the V pass (~10% faster), since trailing zero-weight TDPBF16PS of a pair whose keys end early
// could flush a denormal running sum depending on which pairs share its tile. Left: the K/V
// staging copies and the 3-part split's tile work.
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "amx_tiles.h"
#include "attention.h"
#include "attention_avx512.h"

namespace qspec {
namespace {

constexpr int kParts = 3;          // x = hi + mid + lo
constexpr int64_t kTile = 16;      // rows of every tile; keys of a score block
constexpr int64_t kVKeys = 32;     // keys of a value block (one A tile row of BF16)
constexpr int64_t kTileElems = 512;  // BF16 elements of one 16 x 64-byte tile

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

inline uint16_t bf16_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return uint16_t(u >> 16);
}
inline float bf16_value(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// x = p[0] + p[1] + p[2] exactly (truncation split).
inline void split3(float x, uint16_t* p, int64_t part_stride) {
  for (int k = 0; k < kParts; ++k) {
    const uint16_t h = bf16_bits(x);
    p[k * part_stride] = h;
    x -= bf16_value(h);
  }
}

// split3 of 16 values: parts p of x[0..16) to dst[p · part_stride + 0..16).
inline void split3x16(const float* x, uint16_t* dst, int64_t part_stride) {
  const __m256i top = _mm256_set1_epi32(int(0xFFFF0000u));
  __m256 r0 = _mm256_loadu_ps(x), r1 = _mm256_loadu_ps(x + 8);
  for (int k = 0; k < kParts; ++k) {
    const __m256i b0 = _mm256_and_si256(_mm256_castps_si256(r0), top);
    const __m256i b1 = _mm256_and_si256(_mm256_castps_si256(r1), top);
    const __m256i packed = _mm256_packus_epi32(_mm256_srli_epi32(b0, 16), _mm256_srli_epi32(b1, 16));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + k * part_stride), _mm256_permute4x64_epi64(packed, 0xD8));
    r0 = _mm256_sub_ps(r0, _mm256_castsi256_ps(b0));
    r1 = _mm256_sub_ps(r1, _mm256_castsi256_ps(b1));
  }
}

// r[i] = row i of a 16 x 16 matrix of 32-bit values; afterwards r[i] = its column i.
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0x88);
    t[4 + i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0xDD);
    t[8 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0x88);
    t[12 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0xDD);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
    r[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xDD);
    r[4 + i] = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0x88);
    r[12 + i] = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0xDD);
  }
}

inline __mmask16 first_lanes(int64_t n) {  // lanes [0, n), n clamped to [0, 16]
  return n >= 16 ? __mmask16(0xFFFF) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1);
}

using detail::amx::tile_dpbf16;
using detail::amx::tile_load;
using detail::amx::tile_store;
using detail::amx::tile_zero;
using detail::amx::unrolled;

constexpr int64_t kStageKeys = 64;  // keys staged per score step: up to 4 key blocks in tiles at once

// Scores Sᵀ of KB staged key blocks (16 keys each, from ks) x PB tile blocks of pairs (from
// block b) into the C tiles 0 .. KB·PB-1, stored to ct (256 floats each, tile kb·PB + pb). A
// (K chunk) of key block kb: tile 4 + kb % 2; B (q part) of pair block pb: 6 + pb; every C tile
// takes its parts lo, mid, hi and chunks c in that order (the sums of one C tile never depend on
// the other tiles in flight).
template <int KB, int PB>
void score_tiles(const uint16_t* ks, int64_t hdp, const uint16_t* qb, int64_t b, int64_t nch, float* ct) {
  static_assert(KB * PB <= 4 && PB <= 2 && KB <= 4, "4 C tiles, 2 B tiles");
  unrolled<KB * PB>([](auto t) { tile_zero<decltype(t)::value>(); });
  for (int p = kParts - 1; p >= 0; --p)  // lo, mid, hi: the small sums first
    for (int64_t c = 0; c < nch; ++c)
      unrolled<KB>([&](auto kb) {
        constexpr int K = decltype(kb)::value;
        tile_load<4 + K % 2>(ks + K * kTile * hdp + c * 32, hdp * 2);
        unrolled<PB>([&](auto pb) {
          constexpr int P = decltype(pb)::value;
          if constexpr (K == 0) tile_load<6 + P>(qb + (((b + P) * nch + c) * kParts + p) * kTileElems, 64);
          tile_dpbf16<K * PB + P, 4 + K % 2, 6 + P>();
        });
      });
  unrolled<KB * PB>([&](auto t) {
    constexpr int T = decltype(t)::value;
    tile_store<T>(ct + T * 256, 64);
  });
}

// out (NC tiles of 16 pairs x 16 columns, 256 floats each) = Σ_part w_part · V for the value
// columns of B tiles vs[0 .. NC): C tiles 0 .. NC-1 from zero, parts lo, mid, hi in that order
// per tile; A (the part) tile 4, B tiles 6 + c % 2.
template <int NC>
void value_tiles(const uint16_t* ws, const uint16_t* vs, float* out) {
  static_assert(NC >= 1 && NC <= 4, "4 C tiles");
  unrolled<NC>([](auto t) { tile_zero<decltype(t)::value>(); });
  for (int p = kParts - 1; p >= 0; --p) {  // lo, mid, hi
    tile_load<4>(ws + p * kTileElems, 64);
    unrolled<NC>([&](auto c) {
      constexpr int C = decltype(c)::value;
      tile_load<6 + C % 2>(vs + C * kTileElems, 64);
      tile_dpbf16<C, 4, 6 + C % 2>();
    });
  }
  unrolled<NC>([&](auto t) {
    constexpr int T = decltype(t)::value;
    tile_store<T>(out + T * 256, 64);
  });
}

void group_impl(const AttnArgs& a, int64_t kvh, int64_t u0, int64_t u1, int64_t seg,
                const AttnPartials& part) {
  const int64_t hd = a.kv.head_dim, hdp = round_up(hd, 32);
  const int64_t G = a.n_heads / a.kv.kv_heads;
  const int64_t np = u1 - u0;
  if (np <= 0) return;
  const int64_t kbeg = seg * kAttnSegKeys, kcap = kbeg + kAttnSegKeys;
  const int64_t n_max = attn_unit_keys(a, u0, u1, seg);
  if (n_max <= kbeg) return;
  // Keys [kbeg, n_sh) are streamed for every pair; a tree row's logical keys [t0, n) are
  // gathered per row (t0 a multiple of 32: value blocks never mix the two).
  const int64_t shared = a.tree ? a.tree->prefix & ~(kVKeys - 1) : n_max;
  const int64_t n_sh = shared < n_max ? shared : n_max;
  const int64_t t0 = n_sh > kbeg ? n_sh : kbeg;
  const int64_t nblk = round_up(np, kTile) / kTile;  // tiles of 16 pairs
  const int64_t nch = hdp / 32;                      // 32-column chunks of K
  const int64_t sc_stride = round_up(n_max, kVKeys) + 16;

  // Scratch (64-byte aligned regions): scores | V sums [pairs][hdp] | max, Σ per pair | 4 C tiles |
  // running max lanes [pairs][16] | q parts as B tiles [block][chunk][part] | staged K
  // [kStageKeys][hdp] | staged V [hdp / 16 tiles] | weight parts [part][16 pairs][32 keys] |
  // keys per pair (int32).
  const int64_t f_scores = np * sc_stride, f_accs = nblk * kTile * hdp, f_max = 2 * round_up(np, 16),
                f_vmax = round_up(np, 16) * 16;
  const int64_t h_q = nblk * nch * kParts * kTileElems, h_k = kStageKeys * hdp, h_v = (hdp / 16) * kTileElems,
                h_w = kParts * kTileElems;
  float* buf = attn_thread_scratch(f_scores + f_accs + f_max + f_vmax + 4 * 256 + (h_q + h_k + h_v + h_w) / 2 + np + 64);
  float* scores = buf;
  float* accs = scores + round_up(f_scores, 16);
  float* maxs = accs + f_accs;
  float* sums = maxs + f_max / 2;
  float* ctile = maxs + f_max;
  float* vmax = ctile + 4 * 256;  // ctile: 4 C tiles
  uint16_t* qb = reinterpret_cast<uint16_t*>(vmax + f_vmax);
  uint16_t* kst = qb + h_q;
  uint16_t* vst = kst + h_k;
  uint16_t* wst = vst + h_v;

  auto row_of = [&](int64_t u) { return (u0 + u) / G; };
  auto head_of = [&](int64_t u) { return kvh * G + (u0 + u) % G; };
  int32_t* const nfull = reinterpret_cast<int32_t*>(wst + h_w);  // per pair: keys 0..p
  for (int64_t u = 0; u < np; ++u) nfull[u] = int32_t(attn_row_pos(a, row_of(u)) + 1);
  auto n_full = [&](int64_t u) { return int64_t(nfull[u]); };
  auto n_of = [&](int64_t u) { return n_full(u) < kcap ? n_full(u) : kcap; };  // in this segment

  detail::amx::configure_16x64();

  // q parts as B tiles: B[r][pair][i] = part of q_pair[32c + 2r + i] (split3's parts, the
  // truncations of the remainder); padding pairs and columns zero. Per tile block and 32-column
  // chunk: each pair's part as 16 dwords (dims 2r, 2r + 1), the 16 x 16 dwords transposed into
  // the tile's rows r.
  const __m512i top = _mm512_set1_epi32(int(0xFFFF0000u));
  const __m512i evens = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odds = _mm512_add_epi32(evens, _mm512_set1_epi32(1));
  for (int64_t b = 0; b < nblk; ++b)
    for (int64_t c = 0; c < nch; ++c) {
      __m512 x0[kTile], x1[kTile];  // each pair's dims 32c .. 32c + 15, + 16 .. 31 (remainders)
      for (int64_t pr = 0; pr < kTile; ++pr) {
        const int64_t u = b * kTile + pr;
        if (u >= np) {
          x0[pr] = x1[pr] = _mm512_setzero_ps();
          continue;
        }
        const float* q = a.q + (row_of(u) * a.n_heads + head_of(u)) * hd + c * 32;
        x0[pr] = _mm512_maskz_loadu_ps(first_lanes(hd - c * 32), q);
        x1[pr] = _mm512_maskz_loadu_ps(first_lanes(hd - c * 32 - 16), q + 16);
      }
      for (int p = 0; p < kParts; ++p) {
        __m512 r[kTile];
        for (int64_t pr = 0; pr < kTile; ++pr) {
          const __m512i h0 = _mm512_and_si512(_mm512_castps_si512(x0[pr]), top);
          const __m512i h1 = _mm512_and_si512(_mm512_castps_si512(x1[pr]), top);
          const __m512i lo = _mm512_srli_epi32(_mm512_permutex2var_epi32(h0, evens, h1), 16);
          r[pr] = _mm512_castsi512_ps(_mm512_or_si512(lo, _mm512_permutex2var_epi32(h0, odds, h1)));
          x0[pr] = _mm512_sub_ps(x0[pr], _mm512_castsi512_ps(h0));
          x1[pr] = _mm512_sub_ps(x1[pr], _mm512_castsi512_ps(h1));
        }
        transpose16(r);
        uint16_t* dst = qb + ((b * nch + c) * kParts + p) * kTileElems;
        for (int64_t rr = 0; rr < kTile; ++rr) _mm512_storeu_ps(reinterpret_cast<float*>(dst + rr * 2 * kTile), r[rr]);
      }
    }
  for (int64_t u = 0; u < round_up(np, kTile); ++u) _mm512_storeu_ps(vmax + u * 16, _mm512_set1_ps(-INFINITY));
  std::memset(kst, 0, size_t(h_k) * 2);

  const __m512 vscale = _mm512_set1_ps(a.scale), neg_inf = _mm512_set1_ps(-INFINITY);
  // Scores of staged keys [j0, j0 + nk) (nk <= kStageKeys) for the pairs of tile blocks [b0, b1)
  // that `want`; each pair's running max as 16 lanes (vmax), folded into maxs before pass 2.
  // Tiles: 2 key blocks x 2 pair blocks, or up to 4 key blocks of one pair block.
  auto extract = [&](const float* ct, int64_t jb, int64_t nkb, int64_t b, auto&& want) {
    __m512 r[kTile];  // Sᵀ[key][pair] -> per pair its 16 keys' scores
    for (int64_t t = 0; t < kTile; ++t) r[t] = _mm512_loadu_ps(ct + t * kTile);
    transpose16(r);
    for (int64_t pr = 0; pr < kTile && b * kTile + pr < np; ++pr) {
      const int64_t u = b * kTile + pr;
      if (!want(u)) continue;
      const __mmask16 live = first_lanes(n_of(u) - jb < nkb ? n_of(u) - jb : nkb);
      const __m512 sc = _mm512_mul_ps(r[pr], vscale);
      _mm512_mask_storeu_ps(scores + u * sc_stride + jb, live, sc);
      // a NaN score is skipped (max_ps returns its second operand), as a scalar fold would
      const __m512 folded = _mm512_max_ps(_mm512_mask_blend_ps(live, neg_inf, sc), _mm512_loadu_ps(vmax + u * 16));
      _mm512_storeu_ps(vmax + u * 16, folded);
    }
  };
  auto score_keys = [&](int64_t j0, int64_t nk, int64_t b0, int64_t b1, auto&& want) {
    const int64_t nkb = (nk + kTile - 1) / kTile;  // key blocks staged
    for (int64_t t = nk; t < nkb * kTile; ++t) std::memset(kst + t * hdp, 0, size_t(hd) * 2);
    auto keys_of = [&](int64_t kb) { return nk - kb * kTile < kTile ? nk - kb * kTile : kTile; };
    int64_t b = b0;
    for (; b + 1 < b1; b += 2)
      for (int64_t kb = 0; kb < nkb; kb += 2) {
        const int64_t two = kb + 1 < nkb;
        if (two) score_tiles<2, 2>(kst + kb * kTile * hdp, hdp, qb, b, nch, ctile);
        else score_tiles<1, 2>(kst + kb * kTile * hdp, hdp, qb, b, nch, ctile);
        for (int64_t k = 0; k <= two; ++k)
          for (int64_t pb = 0; pb < 2; ++pb)
            extract(ctile + (k * 2 + pb) * 256, j0 + (kb + k) * kTile, keys_of(kb + k), b + pb, want);
      }
    if (b < b1) {
      switch (nkb) {
        case 4: score_tiles<4, 1>(kst, hdp, qb, b, nch, ctile); break;
        case 3: score_tiles<3, 1>(kst, hdp, qb, b, nch, ctile); break;
        case 2: score_tiles<2, 1>(kst, hdp, qb, b, nch, ctile); break;
        default: score_tiles<1, 1>(kst, hdp, qb, b, nch, ctile);
      }
      for (int64_t kb = 0; kb < nkb; ++kb) extract(ctile + kb * 256, j0 + kb * kTile, keys_of(kb), b, want);
    }
  };
  auto all_pairs = [](int64_t) { return true; };
  // Each tree row's own keys [t0, n) in blocks of `step` from t0: fn(row, j0, keys, tile blocks
  // [b0, b1) holding the row's pairs, which pairs are the row's). A row's pairs are consecutive.
  auto tree_blocks = [&](int64_t step, auto&& fn) {
    if (t0 >= n_max) return;
    for (int64_t row = u0 / G; row <= (u1 - 1) / G; ++row) {
      const int64_t ua = row * G - u0 > 0 ? row * G - u0 : 0;
      const int64_t ub = (row + 1) * G - u0 < np ? (row + 1) * G - u0 : np;
      const int64_t n = n_of(ua);
      auto mine = [ua, ub](int64_t u) { return u >= ua && u < ub; };
      for (int64_t j0 = t0; j0 < n; j0 += step)
        fn(row, j0, n - j0 < step ? n - j0 : step, ua / kTile, (ub - 1) / kTile + 1, mine);
    }
  };
  // Pass 1, shared keys.
  for (int64_t j0 = kbeg; j0 < n_sh; j0 += kStageKeys) {
    const int64_t nk = n_sh - j0 < kStageKeys ? n_sh - j0 : kStageKeys;
    for (int64_t t = 0; t < nk; ++t) std::memcpy(kst + t * hdp, a.kv.k(a.layer, j0 + t) + kvh * hd, size_t(hd) * 2);
    score_keys(j0, nk, 0, nblk, all_pairs);
  }
  // Pass 1, each tree row's own keys.
  tree_blocks(kStageKeys, [&](int64_t row, int64_t j0, int64_t nk, int64_t b0, int64_t b1, auto&& mine) {
    for (int64_t t = 0; t < nk; ++t)
      std::memcpy(kst + t * hdp, a.kv.k(a.layer, attn_key_slot(a, row, j0 + t)) + kvh * hd, size_t(hd) * 2);
    score_keys(j0, nk, b0, b1, mine);
  });

  // Pass 2: per pair, over its own keys of this segment.
  for (int64_t u = 0; u < np; ++u) {
    float m = -INFINITY;
    for (int l = 0; l < 16; ++l) m = vmax[u * 16 + l] > m ? vmax[u * 16 + l] : m;
    maxs[u] = m;
  }
  for (int64_t u = 0; u < np; ++u) {
    if (n_of(u) <= kbeg || attn_key_lo(a, row_of(u)) >= kcap) continue;
    float* sc = scores + u * sc_stride;
    maxs[u] = attn_window_max(sc, kbeg, n_of(u), attn_key_lo(a, row_of(u)), maxs[u]);
    sums[u] = avx512::exp_pass(sc + kbeg, n_of(u) - kbeg, maxs[u]);
  }

  // Pass 3: V sums in tiles of 16 pairs x 16 columns, blocks of 32 keys from kbeg.
  std::memset(accs, 0, size_t(f_accs) * 4);
  // Stage keys [j0, j0 + nk) of V (row of key t at vrow(t)) as B tiles, one per 16 columns:
  // vst[col / 16][r][col % 16][i] = V[key 2r + i][col]; keys nk.. and columns hd.. zero (the
  // columns past hd are zeroed once: only whole 16- or 8-column pieces below hd are written).
  std::memset(vst, 0, size_t(h_v) * 2);
  auto stage_v = [&](int64_t nk, auto&& vrow) {
    const int64_t hd16 = hd & ~int64_t(15);
    for (int64_t r = 0; r < kTile; ++r) {
      const uint16_t* v0 = 2 * r < nk ? vrow(2 * r) : nullptr;
      const uint16_t* v1 = 2 * r + 1 < nk ? vrow(2 * r + 1) : nullptr;
      uint16_t* dst = vst + r * kTile * 2;
      for (int64_t d = 0; d < hd16; d += 16) {  // interleave two rows' 16 columns: 64 bytes
        const __m256i x0 = v0 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0 + d)) : _mm256_setzero_si256();
        const __m256i x1 = v1 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v1 + d)) : _mm256_setzero_si256();
        const __m256i lo = _mm256_unpacklo_epi16(x0, x1), hi = _mm256_unpackhi_epi16(x0, x1);
        __m256i* o = reinterpret_cast<__m256i*>(dst + (d / 16) * kTileElems);
        _mm256_storeu_si256(o, _mm256_permute2x128_si256(lo, hi, 0x20));
        _mm256_storeu_si256(o + 1, _mm256_permute2x128_si256(lo, hi, 0x31));
      }
      if (hd16 < hd) {  // 8 columns
        const __m128i x0 = v0 ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(v0 + hd16)) : _mm_setzero_si128();
        const __m128i x1 = v1 ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(v1 + hd16)) : _mm_setzero_si128();
        __m128i* o = reinterpret_cast<__m128i*>(dst + (hd16 / 16) * kTileElems);
        _mm_storeu_si128(o, _mm_unpacklo_epi16(x0, x1));
        _mm_storeu_si128(o + 1, _mm_unpackhi_epi16(x0, x1));
      }
    }
  };
  // Weight parts of keys [j0, j0 + 32) for tile block b, pairs that `want` (others zero), then
  // per 16 columns: C = Σ_part A_part · B from zero, added to the pairs' running sums.
  auto value_block = [&](int64_t j0, int64_t b, auto&& want) {
    std::memset(wst, 0, size_t(h_w) * 2);
    for (int64_t pr = 0; pr < kTile && b * kTile + pr < np; ++pr) {
      const int64_t u = b * kTile + pr;
      if (!want(u) || n_of(u) <= j0) continue;
      const int64_t e = n_of(u) - j0 < kVKeys ? n_of(u) - j0 : kVKeys;
      const float* w = scores + u * sc_stride + j0;
      int64_t t = 0;
      for (; t + 16 <= e; t += 16) split3x16(w + t, wst + pr * kVKeys + t, kTileElems);
      for (; t < e; ++t) split3(w[t], wst + pr * kVKeys + t, kTileElems);
    }
    const int64_t ncol = hdp / 16;  // column tiles, up to 4 at once
    for (int64_t c = 0; c < ncol; c += 4) {
      switch (ncol - c < 4 ? ncol - c : 4) {
        case 4: value_tiles<4>(wst, vst + c * kTileElems, ctile); break;
        case 3: value_tiles<3>(wst, vst + c * kTileElems, ctile); break;
        case 2: value_tiles<2>(wst, vst + c * kTileElems, ctile); break;
        default: value_tiles<1>(wst, vst + c * kTileElems, ctile);
      }
      for (int64_t t = 0; t < 4 && c + t < ncol; ++t) {
        float* cp = accs + b * kTile * hdp + (c + t) * 16;  // the block's sums join the running ones
        const float* ct = ctile + t * 256;
        for (int64_t r = 0; r < kTile; ++r)
          _mm512_storeu_ps(cp + r * hdp, _mm512_add_ps(_mm512_loadu_ps(cp + r * hdp), _mm512_loadu_ps(ct + r * 16)));
      }
    }
  };
  for (int64_t j0 = kbeg; j0 < n_sh; j0 += kVKeys) {
    const int64_t nk = n_sh - j0 < kVKeys ? n_sh - j0 : kVKeys;
    stage_v(nk, [&](int64_t t) { return a.kv.v(a.layer, j0 + t) + kvh * hd; });
    for (int64_t b = 0; b < nblk; ++b) value_block(j0, b, all_pairs);
  }
  tree_blocks(kVKeys, [&](int64_t row, int64_t j0, int64_t nk, int64_t b0, int64_t b1, auto&& mine) {
    stage_v(nk, [&](int64_t t) { return a.kv.v(a.layer, attn_key_slot(a, row, j0 + t)) + kvh * hd; });
    for (int64_t b = b0; b < b1; ++b) value_block(j0, b, mine);
  });
  _tile_release();

  // Single-segment pairs: out = acc · (1/Σ); others: this segment's partial (unnormalized).
  for (int64_t u = 0; u < np; ++u) {
    if (n_of(u) <= kbeg || attn_key_lo(a, row_of(u)) >= kcap) continue;  // below its window: no partial
    const float s = sums[u];
    const float* acc = accs + u * hdp;
    if (n_full(u) <= kAttnSegKeys) {
      float* out = a.out + (row_of(u) * a.n_heads + head_of(u)) * hd;
      const float inv = 1.f / s;
      for (int64_t d = 0; d < hd; ++d) out[d] = acc[d] * inv;
    } else {
      float* pp = part.at(a, row_of(u), head_of(u), seg);
      pp[0] = maxs[u];
      pp[1] = s;
      std::memcpy(pp + 2, acc, size_t(hd) * 4);
    }
  }
}

}  // namespace

void attn_group_amx(const AttnArgs& a, int64_t kvh, int64_t u_begin, int64_t u_end, int64_t seg,
                    const AttnPartials& part) {
  group_impl(a, kvh, u_begin, u_end, seg, part);
}

}  // namespace qspec
