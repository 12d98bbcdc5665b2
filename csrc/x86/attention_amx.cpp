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
// Checked against the float64 oracle, for batch invariance and tree == linear rows on a Sapphire
// Rapids VM and under emulation (tests/test_isa_emulation.py). Speed there (`qspec bench
// attention`, 2 threads): level with the AVX-512 path (0.84-1.05x its time at 5-16 rows, 1.1-1.2x
// at one row), ~130 GFLOP/s at 16 rows, far below the tiles' peak. Tried there and measured no
// faster, so not kept: one BF16 part for q and the weights (a third of the TDPBF16PS), K read in
// place from the cache, all four K chunks held in tiles, software prefetch, a vectorized q split,
// AVX-512 V staging; the profile was spread over the strided K/V row loads, the per-pair score
// gathers and maxima, and the V-sum tile loads/stores of each 256-key unit.
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

// Every tile 16 rows x 64 bytes. Tile 0: C (FP32), 1: A, 2: B.
void configure_tiles() {
  detail::amx::TileConfig cfg = detail::amx::tile_config();
  for (int t = 0; t < 3; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  detail::amx::load_tile_config(cfg);
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

  // Scratch (64-byte aligned regions): scores | V sums [pairs][hdp] | max, Σ per pair | C tile |
  // q parts as B tiles [block][chunk][part] | staged K [16][hdp] | staged V [hdp / 16 tiles] |
  // weight parts [part][16 pairs][32 keys].
  const int64_t f_scores = np * sc_stride, f_accs = nblk * kTile * hdp, f_max = 2 * round_up(np, 16);
  const int64_t h_q = nblk * nch * kParts * kTileElems, h_k = kTile * hdp, h_v = (hdp / 16) * kTileElems,
                h_w = kParts * kTileElems;
  float* buf = attn_thread_scratch(f_scores + f_accs + f_max + 256 + (h_q + h_k + h_v + h_w) / 2 + 64);
  float* scores = buf;
  float* accs = scores + round_up(f_scores, 16);
  float* maxs = accs + f_accs;
  float* sums = maxs + f_max / 2;
  float* ctile = maxs + f_max;
  uint16_t* qb = reinterpret_cast<uint16_t*>(ctile + 256);
  uint16_t* kst = qb + h_q;
  uint16_t* vst = kst + h_k;
  uint16_t* wst = vst + h_v;

  auto row_of = [&](int64_t u) { return (u0 + u) / G; };
  auto head_of = [&](int64_t u) { return kvh * G + (u0 + u) % G; };
  auto n_full = [&](int64_t u) { return attn_row_pos(a, row_of(u)) + 1; };  // keys 0..p
  auto n_of = [&](int64_t u) { return n_full(u) < kcap ? n_full(u) : kcap; };  // in this segment

  configure_tiles();

  // q parts as B tiles: B[r][pair][i] = part of q_pair[32c + 2r + i]; padding pairs and
  // columns zero.
  std::memset(qb, 0, size_t(h_q) * 2);
  for (int64_t u = 0; u < np; ++u) {
    const float* q = a.q + (row_of(u) * a.n_heads + head_of(u)) * hd;
    const int64_t b = u / kTile, pr = u % kTile;
    for (int64_t d = 0; d < hd; ++d) {
      const int64_t c = d / 32, r = (d % 32) / 2, i = d % 2;
      split3(q[d], qb + ((b * nch + c) * kParts) * kTileElems + (r * kTile + pr) * 2 + i, kTileElems);
    }
    maxs[u] = -INFINITY;
  }
  std::memset(kst, 0, size_t(h_k) * 2);

  // Scores of staged keys [j0, j0 + nk) for the pairs of tile blocks [b0, b1) that `want`.
  auto score_block = [&](int64_t j0, int64_t nk, int64_t b0, int64_t b1, auto&& want) {
    for (int64_t t = nk; t < kTile; ++t) std::memset(kst + t * hdp, 0, size_t(hd) * 2);
    for (int64_t b = b0; b < b1; ++b) {
      _tile_zero(0);
      for (int p = kParts - 1; p >= 0; --p)  // lo, mid, hi: the small sums first
        for (int64_t c = 0; c < nch; ++c) {
          _tile_loadd(1, kst + c * 32, hdp * 2);
          _tile_loadd(2, qb + ((b * nch + c) * kParts + p) * kTileElems, 64);
          _tile_dpbf16ps(0, 1, 2);
        }
      _tile_stored(0, ctile, 64);
      for (int64_t pr = 0; pr < kTile && b * kTile + pr < np; ++pr) {
        const int64_t u = b * kTile + pr;
        if (!want(u)) continue;
        const int64_t e = n_of(u) - j0 < nk ? n_of(u) - j0 : nk;
        float* sc = scores + u * sc_stride + j0;
        for (int64_t t = 0; t < e; ++t) {
          sc[t] = ctile[t * kTile + pr] * a.scale;
          maxs[u] = sc[t] > maxs[u] ? sc[t] : maxs[u];
        }
      }
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
  for (int64_t j0 = kbeg; j0 < n_sh; j0 += kTile) {
    const int64_t nk = n_sh - j0 < kTile ? n_sh - j0 : kTile;
    for (int64_t t = 0; t < nk; ++t) std::memcpy(kst + t * hdp, a.kv.k(a.layer, j0 + t) + kvh * hd, size_t(hd) * 2);
    score_block(j0, nk, 0, nblk, all_pairs);
  }
  // Pass 1, each tree row's own keys.
  tree_blocks(kTile, [&](int64_t row, int64_t j0, int64_t nk, int64_t b0, int64_t b1, auto&& mine) {
    for (int64_t t = 0; t < nk; ++t)
      std::memcpy(kst + t * hdp, a.kv.k(a.layer, attn_key_slot(a, row, j0 + t)) + kvh * hd, size_t(hd) * 2);
    score_block(j0, nk, b0, b1, mine);
  });

  // Pass 2: per pair, over its own keys of this segment.
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
    for (int64_t c = 0; c < hdp / 16; ++c) {
      _tile_zero(0);
      _tile_loadd(2, vst + c * kTileElems, 64);
      for (int p = kParts - 1; p >= 0; --p) {  // lo, mid, hi
        _tile_loadd(1, wst + p * kTileElems, 64);
        _tile_dpbf16ps(0, 1, 2);
      }
      _tile_stored(0, ctile, 64);
      float* cp = accs + b * kTile * hdp + c * 16;  // the block's sums join the running ones
      for (int64_t r = 0; r < kTile; ++r)
        _mm512_storeu_ps(cp + r * hdp, _mm512_add_ps(_mm512_loadu_ps(cp + r * hdp), _mm512_loadu_ps(ctile + r * 16)));
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
