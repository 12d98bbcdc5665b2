// AVX2 + FMA attention: one call computes several (row, head) pairs of ONE KV head (see
// attention.h), head_dim a multiple of 8.
//
// Column layout. BF16 -> FP32 without shuffles: a 32-byte load of 16 BF16 values is 8 uint32;
// `<< 16` gives elements 0, 2, .., 14 and `& 0xFFFF0000` elements 1, 3, .., 15, exactly. So per
// 16-column chunk every vector quantity (q, K, V, the output accumulators) is kept in the
// "even/odd" layout  P[16c + l] = X[16c + 2l], P[16c + 8 + l] = X[16c + 2l + 1]  (l < 8); a
// head_dim % 16 == 8 tail stays in natural order. q is permuted once per pair, outputs back.
//
// Per pair, the three passes of attention.cpp, with a fixed arithmetic sequence:
//   1. scores: keys in blocks of 8 counted from key 0. Per key ONE FMA chain over head_dim in the
//      order E0, O0, E1, O1, .., tail; then per key the tree ((x0+x1)+(x2+x3))+((x4+x5)+(x6+x7))
//      over the 8 lanes (tree4 below); then · scale; lane-wise running max over the blocks.
//   2. exp(s - max) with Σ as 8 lane-wise partial sums over blocks from key 0, then a fixed tree.
//   3. per output column ONE FMA chain over keys 0..p in order, then · (1/Σ).
// Keys past the pair's own p are never read for it; in its last, partial 8-key block those
// keys' chains stay zero and their lanes are dropped (every tree lane depends on its key only).
//
// Two loop nests compute exactly this sequence (the FP32 values of K/V are exact either way, and
// which pairs share a loop never enters a pair's arithmetic):
//   - buffer path (many pairs per call): K and V are walked in super-blocks (a multiple of 8
//     keys, ~16 KB FP32), converted once into an FP32 block that every pair then reads;
//   - register path (few pairs, e.g. decode m = 1): up to 3 heads of one row form a register
//     tile; each K/V vector is converted in registers and used by all of them at once (no FP32
//     block to store and reload — those stores dominate when only 3 or 4 pairs share a block).
// A pair's last, partial key block is computed by the same function on both paths.
// Tree rows (attention.h AttnTree) take the buffer path: the keys all rows share (below the
// prefix, rounded down to 8) are streamed as above, then each row's remaining logical keys are
// gathered from their slots into an FP32 block of the same layout, zero-padded to 8 keys, and
// run through dot8_buf / v_buf, continuing the same 8-key blocks, max, Σ and V chains (on zero
// padding dot8_buf's dropped lanes differ from dot8_partial's only in lanes that are dropped). One call
// covers one fixed key segment (attention.h: kAttnSegKeys from key 0): the passes above run
// over the segment's keys (Σ's partial sums start at the segment start), and a pair with more
// than one segment leaves {max, Σ, unnormalized V sums} for the driver's in-order merge. So a pair's
// result depends only on its own q and p — not on m, the other rows, how the driver grouped
// pairs, which path the call took, or the thread count (docs/architecture.md invariant 2).
#include <immintrin.h>

#include "vec_avx2.h"

#include <cmath>
#include <cstdint>

#include "attention.h"

namespace qspec {
namespace {

// 8 BF16 values -> 8 FP32 (exact: BF16 is the top half of FP32).
inline __m256 load_bf16x8(const uint16_t* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}


// Pass 2: scores[j] = exp(scores[j] - max) in place for j < n; returns Σ in a fixed order
// (8 lane-wise partial sums over blocks from key 0, then one fixed horizontal tree).
float exp_pass(float* scores, int64_t n, float max_s) {
  const __m256 vmax = _mm256_set1_ps(max_s);
  __m256 vsum = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 e = avx2::exp(_mm256_sub_ps(_mm256_loadu_ps(scores + j), vmax));
    _mm256_storeu_ps(scores + j, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  if (j < n) {
    alignas(32) float tmp[8];
    for (int t = 0; t < 8; ++t) tmp[t] = j + t < n ? scores[j + t] : -INFINITY;
    const __m256 e = avx2::exp(_mm256_sub_ps(_mm256_load_ps(tmp), vmax));  // -inf lanes -> 0
    _mm256_store_ps(tmp, e);
    for (int64_t t = 0; j + t < n; ++t) scores[j + t] = tmp[t];
    vsum = _mm256_add_ps(vsum, e);
  }
  return avx2::hsum(vsum);
}

// 16 BF16 values -> even elements (lane l = element 2l) and odd elements (element 2l + 1).
inline void load_bf16x16_eo(const uint16_t* p, __m256& e, __m256& o) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  e = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
  o = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(int(0xFFFF0000u))));
}

// Per-key reduction of 4 accumulators: lane t = ((a_t0+a_t1)+(a_t2+a_t3))+((a_t4+a_t5)+(a_t6+a_t7)).
inline __m128 tree4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
}

inline __m256 tree8(const __m256 a[8]) {
  return _mm256_set_m128(tree4(a[4], a[5], a[6], a[7]), tree4(a[0], a[1], a[2], a[3]));
}

// Per-thread scratch lives in baseline code (attention.cpp): STL templates instantiated in
// an ISA file could be the copy the linker keeps for baseline callers (SIGILL on older CPUs).
inline float* scratch_floats(int64_t n) { return attn_thread_scratch(n); }

inline int64_t round8(int64_t x) { return (x + 7) & ~int64_t(7); }

// Natural order -> even/odd layout.
void to_eo(const float* x, int64_t hd, float* p) {
  const int64_t hd16 = hd & ~int64_t(15);
  for (int64_t c = 0; c < hd16; c += 16)
    for (int l = 0; l < 8; ++l) p[c + l] = x[c + 2 * l], p[c + 8 + l] = x[c + 2 * l + 1];
  for (int64_t d = hd16; d < hd; ++d) p[d] = x[d];
}

// One pair's last, partial block: lane t = q·K_t (unscaled) for the nk < 8 keys that exist,
// straight from BF16; the other chains stay zero. Both paths use this.
__m256 dot8_partial(const float* qp, const uint16_t* kb, int64_t stride, int64_t hd, int nk) {
  const int64_t hd16 = hd & ~int64_t(15);
  __m256 acc[8];
  for (int t = 0; t < 8; ++t) acc[t] = _mm256_setzero_ps();
  for (int t = 0; t < nk; ++t) {
    const uint16_t* k = kb + t * stride;
    for (int64_t c = 0; c < hd16; c += 16) {
      __m256 ke, ko;
      load_bf16x16_eo(k + c, ke, ko);
      acc[t] = _mm256_fmadd_ps(_mm256_load_ps(qp + c), ke, acc[t]);
      acc[t] = _mm256_fmadd_ps(_mm256_load_ps(qp + c + 8), ko, acc[t]);
    }
    if (hd16 < hd)
      acc[t] = _mm256_fmadd_ps(_mm256_load_ps(qp + hd16), load_bf16x8(k + hd16), acc[t]);
  }
  return tree8(acc);
}

// Scale one block's dot products, store the nk live scores, fold them into the running max.
inline void emit_scores(__m256 dot, __m256 vscale, int nk, float* sc, __m256& vmax) {
  const __m256 s = _mm256_mul_ps(dot, vscale);
  if (nk == 8) {
    _mm256_storeu_ps(sc, s);
    vmax = _mm256_max_ps(vmax, s);
  } else {
    alignas(32) float tmp[8];
    _mm256_store_ps(tmp, s);
    for (int t = 0; t < nk; ++t) sc[t] = tmp[t];
    for (int t = nk; t < 8; ++t) tmp[t] = -INFINITY;  // lanes past p: dropped
    vmax = _mm256_max_ps(vmax, _mm256_load_ps(tmp));
  }
}

// ---- buffer path

// dst[t · hd ..] = key t (t < nk) in the even/odd layout, exact. Each key's row of the next block
// (nk keys on, the same stride) is prefetched: a decode step streams the cache once and the
// hardware prefetcher alone left half of the 8k-key attention waiting on these loads (perf, Zen 3).
void convert_block(const uint16_t* src, int64_t stride, int64_t nk, int64_t hd, float* dst) {
  const int64_t hd16 = hd & ~int64_t(15);
  for (int64_t t = 0; t < nk; ++t) {
    for (int64_t b = 0; b < hd * 2; b += 64)
      _mm_prefetch(reinterpret_cast<const char*>(src + (t + nk) * stride) + b, _MM_HINT_T0);
    for (int64_t d = 0; d < hd16; d += 16) {
      __m256 e, o;
      load_bf16x16_eo(src + t * stride + d, e, o);
      _mm256_store_ps(dst + t * hd + d, e);
      _mm256_store_ps(dst + t * hd + d + 8, o);
    }
    if (hd16 < hd) _mm256_store_ps(dst + t * hd + hd16, load_bf16x8(src + t * stride + hd16));
  }
}

// 8 full keys from the FP32 block (same layout as q, so the chain is d = 0, 8, 16, ..).
template <int HD>
inline __m256 dot8_buf(const float* qp, const float* kb, int64_t hd_rt) {
  const int64_t hd = HD > 0 ? HD : hd_rt;
  __m256 acc[8];
  for (int t = 0; t < 8; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t d = 0; d < hd; d += 8) {
    const __m256 qv = _mm256_load_ps(qp + d);
    for (int t = 0; t < 8; ++t) acc[t] = _mm256_fmadd_ps(qv, _mm256_load_ps(kb + t * hd + d), acc[t]);
  }
  return tree8(acc);
}

// V: NC vectors of 8 columns of one pair over keys [b0, e) of the FP32 block (row 0 = key b0).
template <int NC>
inline void v_buf(const float* w, const float* vbuf, int64_t hd, int64_t b0, int64_t e,
                  float* accp) {
  __m256 acc[NC];
  for (int c = 0; c < NC; ++c) acc[c] = _mm256_load_ps(accp + c * 8);
  for (int64_t j = b0; j < e; ++j) {
    const __m256 wj = _mm256_broadcast_ss(w + j);
    const float* vj = vbuf + (j - b0) * hd;
    for (int c = 0; c < NC; ++c) acc[c] = _mm256_fmadd_ps(wj, _mm256_load_ps(vj + c * 8), acc[c]);
  }
  for (int c = 0; c < NC; ++c) _mm256_store_ps(accp + c * 8, acc[c]);
}

// ---- register path: R pairs of the same row (same keys), K/V converted once in registers.

// 4 full keys (kb row t = key t) for R pairs: res[r] lane t = q_r·K_t (unscaled).
template <int R, int HD>
inline void dot4_tile(const float* const* qp, const uint16_t* kb, int64_t stride, int64_t hd_rt,
                      __m128* res) {
  const int64_t hd = HD > 0 ? HD : hd_rt;
  const int64_t hd16 = hd & ~int64_t(15);
  __m256 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < 4; ++t) acc[r][t] = _mm256_setzero_ps();
  for (int64_t c = 0; c < hd16; c += 16)
    for (int t = 0; t < 4; ++t) {
      __m256 ke, ko;
      load_bf16x16_eo(kb + t * stride + c, ke, ko);
      for (int r = 0; r < R; ++r) {
        acc[r][t] = _mm256_fmadd_ps(_mm256_load_ps(qp[r] + c), ke, acc[r][t]);
        acc[r][t] = _mm256_fmadd_ps(_mm256_load_ps(qp[r] + c + 8), ko, acc[r][t]);
      }
    }
  if (hd16 < hd)
    for (int t = 0; t < 4; ++t) {
      const __m256 kt = load_bf16x8(kb + t * stride + hd16);
      for (int r = 0; r < R; ++r)
        acc[r][t] = _mm256_fmadd_ps(_mm256_load_ps(qp[r] + hd16), kt, acc[r][t]);
    }
  for (int r = 0; r < R; ++r) res[r] = tree4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
}

// Pass 1 for a tile over keys [b0, e), e <= n (b0 a multiple of 8); kb = key b0's row, the
// block's keys contiguous after it.
template <int R, int HD>
void scores_tile(const float* const* qp, const uint16_t* kb, int64_t stride, int64_t hd,
                 int64_t b0, int64_t e, __m256 vscale, float* const* sc, __m256* vmax) {
  int64_t j0 = b0;
  for (; j0 + 8 <= e; j0 += 8) {
    __m128 lo[R], hi[R];
    dot4_tile<R, HD>(qp, kb + (j0 - b0) * stride, stride, hd, lo);
    dot4_tile<R, HD>(qp, kb + (j0 + 4 - b0) * stride, stride, hd, hi);
    for (int r = 0; r < R; ++r)
      emit_scores(_mm256_set_m128(hi[r], lo[r]), vscale, 8, sc[r] + j0, vmax[r]);
  }
  if (j0 < e)  // the pairs' last, partial block (then e == n)
    for (int r = 0; r < R; ++r)
      emit_scores(dot8_partial(qp[r], kb + (j0 - b0) * stride, stride, hd, int(e - j0)), vscale,
                  int(e - j0), sc[r] + j0, vmax[r]);
}

// V for a tile: NCH chunks of 16 columns (even/odd) from column d0, keys [b0, e) in order
// (vb = key b0's row, the block's keys contiguous after it).
template <int R, int NCH>
inline void v_tile(const float* const* w, const uint16_t* vb, int64_t stride, int64_t b0,
                   int64_t e, float* const* accp, int64_t d0) {
  __m256 acc[R][2 * NCH];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 2 * NCH; ++c) acc[r][c] = _mm256_load_ps(accp[r] + d0 + c * 8);
  for (int64_t j = b0; j < e; ++j) {
    const uint16_t* vj = vb + (j - b0) * stride + d0;
    __m256 wj[R];
    for (int r = 0; r < R; ++r) wj[r] = _mm256_broadcast_ss(w[r] + j);
    for (int c = 0; c < NCH; ++c) {
      __m256 ve, vo;
      load_bf16x16_eo(vj + c * 16, ve, vo);
      for (int r = 0; r < R; ++r) acc[r][2 * c] = _mm256_fmadd_ps(wj[r], ve, acc[r][2 * c]);
      for (int r = 0; r < R; ++r) acc[r][2 * c + 1] = _mm256_fmadd_ps(wj[r], vo, acc[r][2 * c + 1]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 2 * NCH; ++c) _mm256_store_ps(accp[r] + d0 + c * 8, acc[r][c]);
}

template <int R>
inline void v_tile8(const float* const* w, const uint16_t* vb, int64_t stride, int64_t b0,
                    int64_t e, float* const* accp, int64_t d0) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_load_ps(accp[r] + d0);
  for (int64_t j = b0; j < e; ++j) {
    const __m256 vt = load_bf16x8(vb + (j - b0) * stride + d0);
    for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(w[r] + j), vt, acc[r]);
  }
  for (int r = 0; r < R; ++r) _mm256_store_ps(accp[r] + d0, acc[r]);
}

template <int R>
void v_tile_all(const float* const* w, const uint16_t* vb, int64_t stride, int64_t hd,
                int64_t b0, int64_t e, float* const* accp) {
  const int64_t hd16 = hd & ~int64_t(15);
  int64_t d = 0;
  // Accumulators R · 2N plus R broadcasts, 2 V vectors and the mask must fit 16 registers.
  constexpr int N = R == 1 ? 4 : R == 2 ? 2 : 1;
  for (; d + 16 * N <= hd16; d += 16 * N) v_tile<R, N>(w, vb, stride, b0, e, accp, d);
  for (; d < hd16; d += 16) v_tile<R, 1>(w, vb, stride, b0, e, accp, d);
  if (d < hd) v_tile8<R>(w, vb, stride, b0, e, accp, d);
}

// Pairs per call at or below which the register path is taken (SmolLM2-like 3 heads per KV
// head at m = 1; measured on Zen 3, 4 pairs of 128-dim heads were no faster than the buffer
// path). The choice changes speed only, never a result.
constexpr int64_t kRegisterPathMaxPairs = 3;

template <int HD>
void group_impl(const AttnArgs& a, int64_t kvh, int64_t u0, int64_t u1, int64_t seg,
                const AttnPartials& part) {
  const int64_t hd = HD > 0 ? HD : a.kv.head_dim;
  const int64_t hd16 = hd & ~int64_t(15);
  const int64_t G = a.n_heads / a.kv.kv_heads;
  const int64_t np = u1 - u0;
  if (np <= 0) return;
  const int64_t stride = a.kv.row_elems();
  // This call's keys: segment [kbeg, kcap) up to the last row's position.
  const int64_t kbeg = seg * kAttnSegKeys, kcap = kbeg + kAttnSegKeys;
  const int64_t n_max = attn_unit_keys(a, u0, u1, seg);
  if (n_max <= kbeg) return;
  // Keys [kbeg, n_sh) are streamed for all pairs; a tree row's keys [t0, n) after them (its
  // path, plus < 8 prefix keys) are gathered per row into tbuf. Linear: n_sh = n_max.
  const int64_t n_sh = attn_shared_end(a, n_max);
  const int64_t t0 = n_sh > kbeg ? n_sh : kbeg;
  const int64_t tb = n_max > t0 ? round8(n_max - t0) : 0;
  const int64_t sc_stride = round8(n_max) + 8;
  const bool use_buf = np > kRegisterPathMaxPairs || a.tree;
  int64_t kb = (4096 / hd) & ~int64_t(7);  // keys per super-block: 16 KB FP32 / 8 KB BF16
  if (kb < 8) kb = 8;

  // Scratch: FP32 K/V block (buffer path) | scores | V accumulators | permuted q | running max
  // (then 1/Σ in lane 0), per pair | tree tail.
  const int64_t blk = use_buf ? kb * hd : 0;
  float* buf = scratch_floats(blk + np * sc_stride + 2 * np * hd + np * 8 + tb * hd + 64);
  float* kvbuf = buf;
  float* scores = kvbuf + blk;
  float* accs = scores + np * sc_stride;
  float* qps = accs + np * hd;
  __m256* vmax = reinterpret_cast<__m256*>(qps + np * hd);
  float* tbuf = qps + np * hd + np * 8;

  auto row_of = [&](int64_t u) { return (u0 + u) / G; };
  auto head_of = [&](int64_t u) { return kvh * G + (u0 + u) % G; };
  auto n_full = [&](int64_t u) { return attn_row_pos(a, row_of(u)) + 1; };  // keys 0..p
  auto n_of = [&](int64_t u) { return n_full(u) < kcap ? n_full(u) : kcap; };  // in this segment

  const __m256 vscale = _mm256_set1_ps(a.scale);
  for (int64_t u = 0; u < np; ++u) {
    vmax[u] = _mm256_set1_ps(-INFINITY);
    to_eo(a.q + (row_of(u) * a.n_heads + head_of(u)) * hd, hd, qps + u * hd);
  }
  for (int64_t x = 0; x < np * hd; x += 8) _mm256_store_ps(accs + x, _mm256_setzero_ps());

  // Register tiles: runs of up to 3 consecutive pairs of one row (a run of 4: 2 + 2).
  int64_t tile_u[kRegisterPathMaxPairs], tile_r[kRegisterPathMaxPairs];
  int ntiles = 0;
  if (!use_buf)
    for (int64_t u = 0; u < np;) {
      int64_t run = 1;
      while (u + run < np && row_of(u + run) == row_of(u)) ++run;
      const int64_t r = run == 4 ? 2 : run < 3 ? run : 3;
      tile_u[ntiles] = u, tile_r[ntiles] = r, ++ntiles;
      u += r;
    }

  // Tree tail of pair u's row: logical keys [t0, n) into tbuf in the buffer layout, zero-padded
  // to 8 (so dot8_buf on the zero keys of the last block gives the zero chains that
  // dot8_partial leaves); once per row (a row's pairs are consecutive).
  int64_t tail_row = -1;
  auto load_tail = [&](int64_t u, int kv_index) {
    if (row_of(u) == tail_row) return;
    tail_row = row_of(u);
    const int64_t n = n_of(u);
    for (int64_t j = t0; j < n; ++j) {
      const int64_t slot = attn_key_slot(a, tail_row, j);
      const uint16_t* src = (kv_index ? a.kv.v(a.layer, slot) : a.kv.k(a.layer, slot)) + kvh * hd;
      convert_block(src, stride, 1, hd, tbuf + (j - t0) * hd);
    }
    for (int64_t x = (n - t0) * hd; x < round8(n - t0) * hd; x += 8)
      _mm256_store_ps(tbuf + x, _mm256_setzero_ps());
  };

  // Pass 1 over K, in blocks of up to kb keys within a page (kblk: key b0's row).
  for (int64_t b0 = kbeg, b1; b0 < n_sh; b0 = b1) {
    b1 = attn_block_end(a, b0, kb, n_sh);
    const uint16_t* kblk = a.kv.k(a.layer, b0) + kvh * hd;
    if (use_buf) {
      // Full 8-key blocks only: a partial block is some pair's last and read from BF16.
      convert_block(kblk, stride, (b1 - b0) & ~int64_t(7), hd, kvbuf);
      for (int64_t u = 0; u < np; ++u) {
        const int64_t n = n_of(u);
        const int64_t e = b1 < n ? b1 : n;
        if (e <= b0) continue;
        const float* qp = qps + u * hd;
        float* sc = scores + u * sc_stride;
        int64_t j0 = b0;
        for (; j0 + 8 <= e; j0 += 8)
          emit_scores(dot8_buf<HD>(qp, kvbuf + (j0 - b0) * hd, hd), vscale, 8, sc + j0, vmax[u]);
        if (j0 < e)
          emit_scores(dot8_partial(qp, kblk + (j0 - b0) * stride, stride, hd, int(e - j0)), vscale,
                      int(e - j0), sc + j0, vmax[u]);
      }
    } else {
      for (int t = 0; t < ntiles; ++t) {
        const int64_t u = tile_u[t], n = n_of(u);
        const int64_t e = b1 < n ? b1 : n;
        if (e <= b0) continue;
        const float* qp[3] = {qps + u * hd, qps + (u + 1) * hd, qps + (u + 2) * hd};
        float* sc[3] = {scores + u * sc_stride, scores + (u + 1) * sc_stride,
                        scores + (u + 2) * sc_stride};
        switch (tile_r[t]) {
          case 3: scores_tile<3, HD>(qp, kblk, stride, hd, b0, e, vscale, sc, vmax + u); break;
          case 2: scores_tile<2, HD>(qp, kblk, stride, hd, b0, e, vscale, sc, vmax + u); break;
          default: scores_tile<1, HD>(qp, kblk, stride, hd, b0, e, vscale, sc, vmax + u); break;
        }
      }
    }
  }
  if (tb > 0)
    for (int64_t u = 0; u < np; ++u) {
      const int64_t n = n_of(u);
      if (n <= t0) continue;
      load_tail(u, 0);
      const float* qp = qps + u * hd;
      float* sc = scores + u * sc_stride;
      for (int64_t j0 = t0; j0 < n; j0 += 8)
        emit_scores(dot8_buf<HD>(qp, tbuf + (j0 - t0) * hd, hd), vscale,
                    int(n - j0 < 8 ? n - j0 : 8), sc + j0, vmax[u]);
    }

  // Pass 2: per pair, over its own keys of this segment; Σ and the max go to lanes 0 and 1 of
  // the pair's max slot.
  float* sums = reinterpret_cast<float*>(vmax);
  for (int64_t u = 0; u < np; ++u) {
    if (n_of(u) <= kbeg || attn_key_lo(a, row_of(u)) >= kcap) continue;
    const float max_s = attn_window_max(scores + u * sc_stride, kbeg, n_of(u), attn_key_lo(a, row_of(u)),
                                        avx2::hmax(vmax[u]));
    sums[u * 8] = exp_pass(scores + u * sc_stride + kbeg, n_of(u) - kbeg, max_s);
    sums[u * 8 + 1] = max_s;
  }

  // Pass 3 over V.
  auto v_keys = [&](int64_t u, const float* vb, int64_t b0, int64_t e) {
    const float* w = scores + u * sc_stride;
    float* accp = accs + u * hd;
    int64_t d = 0;
    for (; d + 64 <= hd; d += 64) v_buf<8>(w, vb + d, hd, b0, e, accp + d);
    if (d + 32 <= hd) v_buf<4>(w, vb + d, hd, b0, e, accp + d), d += 32;
    if (d + 16 <= hd) v_buf<2>(w, vb + d, hd, b0, e, accp + d), d += 16;
    if (d + 8 <= hd) v_buf<1>(w, vb + d, hd, b0, e, accp + d), d += 8;
  };
  for (int64_t b0 = kbeg, b1; b0 < n_sh; b0 = b1) {
    b1 = attn_block_end(a, b0, kb, n_sh);
    const uint16_t* vblk = a.kv.v(a.layer, b0) + kvh * hd;
    if (use_buf) {
      convert_block(vblk, stride, b1 - b0, hd, kvbuf);
      for (int64_t u = 0; u < np; ++u) {
        const int64_t n = n_of(u);
        const int64_t e = b1 < n ? b1 : n;
        if (e <= b0) continue;
        v_keys(u, kvbuf, b0, e);
      }
    } else {
      for (int t = 0; t < ntiles; ++t) {
        const int64_t u = tile_u[t], n = n_of(u);
        const int64_t e = b1 < n ? b1 : n;
        if (e <= b0) continue;
        const float* w[3] = {scores + u * sc_stride, scores + (u + 1) * sc_stride,
                             scores + (u + 2) * sc_stride};
        float* accp[3] = {accs + u * hd, accs + (u + 1) * hd, accs + (u + 2) * hd};
        switch (tile_r[t]) {
          case 3: v_tile_all<3>(w, vblk, stride, hd, b0, e, accp); break;
          case 2: v_tile_all<2>(w, vblk, stride, hd, b0, e, accp); break;
          default: v_tile_all<1>(w, vblk, stride, hd, b0, e, accp); break;
        }
      }
    }
  }
  tail_row = -1;
  if (tb > 0)
    for (int64_t u = 0; u < np; ++u) {
      if (n_of(u) <= t0) continue;
      load_tail(u, 1);
      v_keys(u, tbuf, t0, n_of(u));
    }

  // Single-segment pairs: out = acc · (1/Σ); others: this segment's partial. Natural order.
  for (int64_t u = 0; u < np; ++u) {
    if (n_of(u) <= kbeg || attn_key_lo(a, row_of(u)) >= kcap) continue;  // below its window: no partial
    const float* acc = accs + u * hd;
    float* out;
    float inv;
    if (n_full(u) <= kAttnSegKeys) {
      out = a.out + (row_of(u) * a.n_heads + head_of(u)) * hd;
      inv = 1.f / sums[u * 8];
    } else {
      float* pp = part.at(a, row_of(u), head_of(u), seg);
      pp[0] = sums[u * 8 + 1];
      pp[1] = sums[u * 8];
      out = pp + 2;
      inv = 1.f;  // exact: the partial keeps the unnormalized sums
    }
    for (int64_t c = 0; c < hd16; c += 16)
      for (int l = 0; l < 8; ++l)
        out[c + 2 * l] = acc[c + l] * inv, out[c + 2 * l + 1] = acc[c + 8 + l] * inv;
    for (int64_t d = hd16; d < hd; ++d) out[d] = acc[d] * inv;
  }
}

}  // namespace

void attn_group_avx2(const AttnArgs& a, int64_t kvh, int64_t u_begin, int64_t u_end, int64_t seg,
                     const AttnPartials& part) {
  switch (a.kv.head_dim) {
    case 64: group_impl<64>(a, kvh, u_begin, u_end, seg, part); break;
    case 128: group_impl<128>(a, kvh, u_begin, u_end, seg, part); break;
    default: group_impl<0>(a, kvh, u_begin, u_end, seg, part); break;
  }
}

void attn_fold_rows_avx2(float* st, const float* ps, int64_t n, float wa, float wb) {
  const __m256 va = _mm256_set1_ps(wa), vb = _mm256_set1_ps(wb);
  int64_t c = 0;
  for (; c + 8 <= n; c += 8)
    _mm256_storeu_ps(st + c, _mm256_fmadd_ps(_mm256_loadu_ps(ps + c), vb, _mm256_mul_ps(_mm256_loadu_ps(st + c), va)));
  for (; c < n; ++c) st[c] = std::fma(ps[c], wb, st[c] * wa);
}

}  // namespace qspec
