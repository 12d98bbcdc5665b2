// AVX-512F attention: one call computes several (row, head) pairs of ONE KV head (see
// attention.h), head_dim a multiple of 8. Per pair:
//   1. scores: per key one FMA chain over head_dim in order from element 0 (q[d] · K[d], d = 0,
//      1, ..), then · scale. K is turned so a vector lane holds a key (16 keys' rows as 16 x 16
//      dword transposes of BF16 pairs, split into FP32 exactly), once per block for every pair of
//      the call; tiles of up to 6 pairs x 32 keys broadcast q[d] and share each load of K, with no
//      reduction across lanes;
//   2. exp(s - max) with Σ as 16 lane-wise partial sums over blocks from key 0, then one
//      horizontal reduction;
//   3. per output column one FMA chain over keys 0..p in order, then · (1/Σ).
// K and V are streamed in super-blocks (multiple of 16 keys, ~16 KB FP32) converted once (exact)
// into an FP32 block shared by all pairs of the call; each pair uses only keys 0..p of it (the
// lanes of keys past p are computed and dropped: each lane depends on its own key only). No
// cache row beyond the call's last row is read. A score's bits depend only on q and its key, so
// a row's output is the same whatever the other rows, the tiles or the blocks (batch
// invariance). Tree rows (attention.h AttnTree): the keys all rows share (below the prefix,
// rounded down to 8) are streamed as above, then each row's remaining logical keys are gathered
// from their slots into a block of the same form and run through the same functions,
// continuing the same max, Σ and V chains.
//
// tests/test_attention.py checks it against the float64 oracle and for bit-exact batch invariance
// on AVX-512 hardware and under emulation (tests/test_isa_emulation.py).
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "attention.h"
#include "attention_avx512.h"

namespace qspec {
namespace {

// 16 BF16 values -> 16 FP32 (exact).
inline __m512 load_bf16x16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// 8 BF16 values -> FP32 in lanes 0..7, lanes 8..15 zero; never reads past the 8 values.
inline __m512 load_bf16x8_lo(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_zextsi128_si256(h));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

// Per-thread scratch lives in baseline code (attention.cpp): STL templates instantiated in
// an ISA file could be the copy the linker keeps for baseline callers (SIGILL on older CPUs).
inline float* scratch_floats(int64_t n) { return attn_thread_scratch(n); }

inline int64_t round8(int64_t x) { return (x + 7) & ~int64_t(7); }
inline int64_t round16(int64_t x) { return (x + 15) & ~int64_t(15); }

// V rows: dst[t · hd + d] = src key t (t < nk), exact BF16 -> FP32.
void convert_block(const uint16_t* src, int64_t stride, int64_t nk, int64_t hd, float* dst) {
  const int64_t hd16 = hd & ~int64_t(15);
  for (int64_t t = 0; t < nk; ++t) {
    for (int64_t d = 0; d < hd16; d += 16)
      _mm512_storeu_ps(dst + t * hd + d, load_bf16x16(src + t * stride + d));
    if (hd16 < hd)
      _mm256_storeu_ps(dst + t * hd + hd16, _mm512_castps512_ps256(load_bf16x8_lo(src + t * stride + hd16)));
  }
}

// kT + 16 · g · hd: keys 16g .. 16g + 15 of a block as hd rows of 16 FP32 lanes (row d = element
// d of each key, exact), rows[t] = key t's BF16 row (t < nk); lanes of keys past nk are zero.
void transpose_keys(const uint16_t* const* rows, int64_t nk, int64_t hd, float* kT) {
  const __m512i hi_half = _mm512_set1_epi32(int32_t(0xFFFF0000u));
  for (int64_t g = 0; g * 16 < nk; ++g) {
    const int64_t live = nk - 16 * g < 16 ? nk - 16 * g : 16;
    float* dst = kT + 16 * g * hd;
    for (int64_t c = 0; c < hd; c += 32) {  // 16 dwords (BF16 pairs) of each key
      const int64_t units = hd - c < 32 ? (hd - c) / 2 : 16;
      const __mmask16 m = units == 16 ? __mmask16(0xFFFF) : __mmask16((1u << units) - 1);
      __m512 r[16];
      for (int64_t t = 0; t < 16; ++t)
        r[t] = t < live ? _mm512_castsi512_ps(_mm512_maskz_loadu_epi32(m, rows[16 * g + t] + c))
                        : _mm512_setzero_ps();
      avx512::transpose16(r);
      for (int64_t i = 0; i < units; ++i) {  // dword i: elements c + 2i (low half), c + 2i + 1
        const __m512i v = _mm512_castps_si512(r[i]);
        _mm512_storeu_ps(dst + (c + 2 * i) * 16, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
        _mm512_storeu_ps(dst + (c + 2 * i + 1) * 16, _mm512_castsi512_ps(_mm512_and_si512(v, hi_half)));
      }
    }
  }
}

struct ScorePair {  // one pair's share of a block in pass 1
  const float* q;   // head_dim values
  float* sc;        // the score of the block's key t goes to sc[t]
  float* vmax;      // running max (8 lanes)
  int64_t nk;       // keys of the block it keeps
};

// Pass 1 for P pairs over NG 16-key groups from group g0 of the transposed block kT: per key one
// FMA chain over d from 0, · scale; lanes past a pair's nk are neither stored nor maxed.
template <int HD, int P, int NG>
inline void score_tile(const float* kT, int64_t hd_rt, int64_t g0, const ScorePair* ps, __m512 vscale) {
  const int64_t hd = HD > 0 ? HD : hd_rt;
  const float* k = kT + 16 * g0 * hd;
  const float* q[P];
  __m512 acc[P][NG];
#pragma GCC unroll 8
  for (int p = 0; p < P; ++p) {
    q[p] = ps[p].q;
    for (int g = 0; g < NG; ++g) acc[p][g] = _mm512_setzero_ps();
  }
  for (int64_t d = 0; d < hd; ++d) {
    __m512 kv[NG];
    for (int g = 0; g < NG; ++g) kv[g] = _mm512_loadu_ps(k + g * 16 * hd + d * 16);
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p) {
      const __m512 qb = _mm512_set1_ps(q[p][d]);
      for (int g = 0; g < NG; ++g) acc[p][g] = _mm512_fmadd_ps(qb, kv[g], acc[p][g]);
    }
  }
#pragma GCC unroll 8
  for (int p = 0; p < P; ++p) {
    __m256 vmax = _mm256_loadu_ps(ps[p].vmax);
    for (int g = 0; g < NG; ++g) {
      const int64_t live = ps[p].nk - 16 * (g0 + g);
      if (live <= 0) break;
      const __mmask16 m = live >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << live) - 1);
      const __m512 s = _mm512_mul_ps(acc[p][g], vscale);
      _mm512_mask_storeu_ps(ps[p].sc + 16 * (g0 + g), m, s);
      const __m512 sm = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), m, s);
      vmax = _mm256_max_ps(vmax, _mm256_max_ps(_mm512_castps512_ps256(sm), _mm512_extractf32x8_ps(sm, 1)));
    }
    _mm256_storeu_ps(ps[p].vmax, vmax);
  }
}

template <int HD, int P>
inline void score_pairs_p(const float* kT, int64_t hd, int64_t ng, const ScorePair* ps, __m512 vscale) {
  int64_t g = 0;
  for (; g + 2 <= ng; g += 2) score_tile<HD, P, 2>(kT, hd, g, ps, vscale);
  if (g < ng) score_tile<HD, P, 1>(kT, hd, g, ps, vscale);
}

// Pass 1 for n pairs over a transposed block of ng groups.
template <int HD>
void score_pairs(const float* kT, int64_t hd, int64_t ng, const ScorePair* ps, int64_t n, __m512 vscale) {
  int64_t p = 0;
  for (; p + 6 <= n; p += 6) score_pairs_p<HD, 6>(kT, hd, ng, ps + p, vscale);
  switch (n - p) {
    case 5: score_pairs_p<HD, 5>(kT, hd, ng, ps + p, vscale); break;
    case 4: score_pairs_p<HD, 4>(kT, hd, ng, ps + p, vscale); break;
    case 3: score_pairs_p<HD, 3>(kT, hd, ng, ps + p, vscale); break;
    case 2: score_pairs_p<HD, 2>(kT, hd, ng, ps + p, vscale); break;
    case 1: score_pairs_p<HD, 1>(kT, hd, ng, ps + p, vscale); break;
  }
}

// Pass 3 for NC·16 columns of one pair over keys [b0, e) of the current V super-block; running
// sums in accp between super-blocks (one FMA chain per column over keys 0..p).
template <int NC>
inline void v_block(const float* w, const float* vbuf, int64_t hd, int64_t b0, int64_t e,
                    float* accp) {
  __m512 acc[NC];
  for (int c = 0; c < NC; ++c) acc[c] = _mm512_loadu_ps(accp + c * 16);
  for (int64_t j = b0; j < e; ++j) {
    const __m512 wj = _mm512_set1_ps(w[j]);
    const float* vj = vbuf + (j - b0) * hd;
    for (int c = 0; c < NC; ++c) acc[c] = _mm512_fmadd_ps(wj, _mm512_loadu_ps(vj + c * 16), acc[c]);
  }
  for (int c = 0; c < NC; ++c) _mm512_storeu_ps(accp + c * 16, acc[c]);
}

// The last 8 columns when head_dim % 16 == 8 (lanes 8..15 zero).
inline void v_block8(const float* w, const float* vbuf, int64_t hd, int64_t b0, int64_t e,
                     float* accp) {
  __m512 acc = _mm512_maskz_loadu_ps(0x00FF, accp);
  for (int64_t j = b0; j < e; ++j)
    acc = _mm512_fmadd_ps(_mm512_set1_ps(w[j]), _mm512_maskz_loadu_ps(0x00FF, vbuf + (j - b0) * hd),
                          acc);
  _mm512_mask_storeu_ps(accp, 0x00FF, acc);
}

template <int HD>
void group_impl(const AttnArgs& a, int64_t kvh, int64_t u0, int64_t u1, int64_t seg,
                const AttnPartials& part) {
  const int64_t hd = HD > 0 ? HD : a.kv.head_dim;
  const int64_t G = a.n_heads / a.kv.kv_heads;
  const int64_t np = u1 - u0;
  if (np <= 0) return;
  const int64_t stride = a.kv.row_elems();
  // This call's keys: segment [kbeg, kcap) up to the last row's position.
  const int64_t kbeg = seg * kAttnSegKeys, kcap = kbeg + kAttnSegKeys;
  const int64_t n_max = attn_unit_keys(a, u0, u1, seg);
  if (n_max <= kbeg) return;
  // Keys [kbeg, n_sh) are streamed once for all pairs; a tree row's keys [t0, n) after them
  // (its path, plus < 8 prefix keys) are gathered per row into tbuf. Linear: n_sh = n_max.
  const int64_t n_sh = attn_shared_end(a, n_max);
  const int64_t t0 = n_sh > kbeg ? n_sh : kbeg;
  const int64_t tb = n_max > t0 ? round16(n_max - t0) : 0;
  const int64_t sc_stride = round8(n_max) + 16;
  int64_t kb = (4096 / hd) & ~int64_t(15);  // keys per super-block: ~16 KB of FP32
  if (kb < 16) kb = 16;

  // Scratch: K/V super-block | scores per pair | V accumulators per pair | running max per pair
  // | tree tail.
  float* buf = scratch_floats(kb * hd + np * sc_stride + np * hd + np * 8 + tb * hd + 64);
  float* kvbuf = buf;
  float* scores = kvbuf + kb * hd;
  float* accs = scores + np * sc_stride;
  float* vmaxs = accs + np * hd;
  float* tbuf = vmaxs + np * 8;

  auto row_of = [&](int64_t u) { return (u0 + u) / G; };
  auto head_of = [&](int64_t u) { return kvh * G + (u0 + u) % G; };
  auto q_of = [&](int64_t u) { return a.q + (row_of(u) * a.n_heads + head_of(u)) * hd; };
  auto n_full = [&](int64_t u) { return attn_row_pos(a, row_of(u)) + 1; };  // keys 0..p
  auto n_of = [&](int64_t u) { return n_full(u) < kcap ? n_full(u) : kcap; };  // in this segment

  const __m512 vscale = _mm512_set1_ps(a.scale);
  for (int64_t u = 0; u < np; ++u) _mm256_storeu_ps(vmaxs + u * 8, _mm256_set1_ps(-INFINITY));

  // Pass 1: stream K once, each block turned keys-in-lanes for every pair that reads it.
  constexpr int64_t kListPairs = 48;
  ScorePair ps[kListPairs];
  const uint16_t* rows[kAttnSegKeys];
  for (int64_t b0 = kbeg, b1; b0 < n_sh; b0 = b1) {
    b1 = attn_block_end(a, b0, kb, n_sh);  // within one page
    const uint16_t* k0 = a.kv.k(a.layer, b0) + kvh * hd;
    for (int64_t t = 0; t < b1 - b0; ++t) rows[t] = k0 + t * stride;
    transpose_keys(rows, b1 - b0, hd, kvbuf);
    int64_t n_ps = 0;
    for (int64_t u = 0; u < np; ++u) {
      const int64_t e = b1 < n_of(u) ? b1 : n_of(u);
      if (e <= b0) continue;
      ps[n_ps++] = {q_of(u), scores + u * sc_stride + b0, vmaxs + u * 8, e - b0};
      if (n_ps == kListPairs) score_pairs<HD>(kvbuf, hd, round16(b1 - b0) / 16, ps, n_ps, vscale), n_ps = 0;
    }
    if (n_ps) score_pairs<HD>(kvbuf, hd, round16(b1 - b0) / 16, ps, n_ps, vscale);
  }
  // Tree tails: a row's logical keys [t0, n) gathered from their slots (a row's pairs are
  // consecutive), in the super-block's form.
  auto gather_tail = [&](int64_t row, int kv_index) {
    const int64_t p1 = attn_row_pos(a, row) + 1, n = p1 < kcap ? p1 : kcap;
    for (int64_t j = t0; j < n; ++j) {
      const int64_t slot = attn_key_slot(a, row, j);
      rows[j - t0] = (kv_index ? a.kv.v(a.layer, slot) : a.kv.k(a.layer, slot)) + kvh * hd;
    }
    return n - t0;
  };
  // A tree row's pairs (consecutive) share its gathered tail.
  auto row_end = [&](int64_t u) {
    const int64_t row = row_of(u);
    while (u < np && row_of(u) == row) ++u;
    return u;
  };
  if (tb > 0)
    for (int64_t u = 0, end; u < np; u = end) {
      const int64_t row = row_of(u), n = n_of(u);
      end = row_end(u);
      if (n <= t0) continue;
      const int64_t nk = gather_tail(row, 0);
      transpose_keys(rows, nk, hd, tbuf);
      for (int64_t v = u; v < end; v += kListPairs) {
        const int64_t n_ps = end - v < kListPairs ? end - v : kListPairs;
        for (int64_t i = 0; i < n_ps; ++i)
          ps[i] = {q_of(v + i), scores + (v + i) * sc_stride + t0, vmaxs + (v + i) * 8, n - t0};
        score_pairs<HD>(tbuf, hd, round16(nk) / 16, ps, n_ps, vscale);
      }
    }

  // Pass 2: per pair, over its own keys of this segment; Σ and the max go to lanes 0 and 1 of
  // the pair's max slot.
  float* sums = vmaxs;
  for (int64_t u = 0; u < np; ++u) {
    if (n_of(u) <= kbeg || attn_key_lo(a, row_of(u)) >= kcap) continue;
    const float max_s = attn_window_max(scores + u * sc_stride, kbeg, n_of(u), attn_key_lo(a, row_of(u)),
                                        avx512::hmax8(_mm256_loadu_ps(vmaxs + u * 8)));
    sums[u * 8] = avx512::exp_pass(scores + u * sc_stride + kbeg, n_of(u) - kbeg, max_s);
    sums[u * 8 + 1] = max_s;
  }

  // Pass 3: stream V once.
  for (int64_t x = 0; x < np * hd; x += 8) _mm256_storeu_ps(accs + x, _mm256_setzero_ps());
  auto v_keys = [&](int64_t u, const float* vb, int64_t b0, int64_t e) {
    const float* w = scores + u * sc_stride;
    float* accp = accs + u * hd;
    int64_t d = 0;
    for (; d + 128 <= hd; d += 128) v_block<8>(w, vb + d, hd, b0, e, accp + d);
    if (d + 64 <= hd) v_block<4>(w, vb + d, hd, b0, e, accp + d), d += 64;
    if (d + 32 <= hd) v_block<2>(w, vb + d, hd, b0, e, accp + d), d += 32;
    if (d + 16 <= hd) v_block<1>(w, vb + d, hd, b0, e, accp + d), d += 16;
    if (d + 8 <= hd) v_block8(w, vb + d, hd, b0, e, accp + d);
  };
  for (int64_t b0 = kbeg, b1; b0 < n_sh; b0 = b1) {
    b1 = attn_block_end(a, b0, kb, n_sh);
    convert_block(a.kv.v(a.layer, b0) + kvh * hd, stride, b1 - b0, hd, kvbuf);
    for (int64_t u = 0; u < np; ++u) {
      const int64_t n = n_of(u);
      const int64_t e = b1 < n ? b1 : n;
      if (e <= b0) continue;
      v_keys(u, kvbuf, b0, e);
    }
  }
  if (tb > 0)
    for (int64_t u = 0, tail_row = -1; u < np; ++u) {
      if (n_of(u) <= t0) continue;
      if (row_of(u) != tail_row) {
        tail_row = row_of(u);
        const int64_t nk = gather_tail(tail_row, 1);
        for (int64_t t = 0; t < nk; ++t) convert_block(rows[t], stride, 1, hd, tbuf + t * hd);
      }
      v_keys(u, tbuf, t0, n_of(u));
    }

  // Single-segment pairs: out = acc · (1/Σ); others: this segment's partial (unnormalized).
  for (int64_t u = 0; u < np; ++u) {
    if (n_of(u) <= kbeg || attn_key_lo(a, row_of(u)) >= kcap) continue;  // below its window: no partial
    float* out;
    __m256 vinv;
    if (n_full(u) <= kAttnSegKeys) {
      out = a.out + (row_of(u) * a.n_heads + head_of(u)) * hd;
      vinv = _mm256_set1_ps(1.f / sums[u * 8]);
    } else {
      float* pp = part.at(a, row_of(u), head_of(u), seg);
      pp[0] = sums[u * 8 + 1];
      pp[1] = sums[u * 8];
      out = pp + 2;
      vinv = _mm256_set1_ps(1.f);
    }
    for (int64_t d = 0; d < hd; d += 8)
      _mm256_storeu_ps(out + d, _mm256_mul_ps(_mm256_loadu_ps(accs + u * hd + d), vinv));
  }
}

}  // namespace

void attn_group_avx512(const AttnArgs& a, int64_t kvh, int64_t u_begin, int64_t u_end,
                       int64_t seg, const AttnPartials& part) {
  switch (a.kv.head_dim) {
    case 64: group_impl<64>(a, kvh, u_begin, u_end, seg, part); break;
    case 128: group_impl<128>(a, kvh, u_begin, u_end, seg, part); break;
    default: group_impl<0>(a, kvh, u_begin, u_end, seg, part); break;
  }
}

}  // namespace qspec
