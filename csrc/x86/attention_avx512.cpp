// AVX-512F attention: one call computes several (row, head) pairs of ONE KV head (see
// attention.h), head_dim a multiple of 8. Same structure as the buffer path of
// attention_avx2.cpp (read that file's header for the batch-invariance argument), in natural
// column order (no even/odd layout, no register-tile path); per pair:
//   1. scores: keys in blocks of 8 counted from key 0; per key one FMA chain over head_dim in
//      chunks of 16 (then 8 with zero upper lanes if head_dim % 16 == 8), each key's 16 lanes
//      folded to 8 and the 8 keys reduced by one fixed hadd tree, · scale;
//   2. exp(s - max) with Σ as 16 lane-wise partial sums over blocks from key 0, then one
//      horizontal reduction;
//   3. per output column one FMA chain over keys 0..p in order, then · (1/Σ).
// K and V are streamed in super-blocks (multiple of 8 keys, ~16 KB FP32) converted once (exact)
// into an FP32 block shared by all pairs of the call; each pair uses only keys 0..p of it (a
// partial last block computes lanes for keys it then drops; each tree lane depends on its own
// key only). No cache row beyond the call's last row is read. Tree rows (attention.h AttnTree):
// the keys all rows share (below the prefix, rounded down to 8) are streamed as above, then each
// row's remaining logical keys are gathered from their slots into an FP32 block of the same form
// and run through the same functions, continuing the same blocks of 8, max, Σ and V chains.
//
// tests/test_attention.py checks it against the float64 oracle and for bit-exact batch invariance
// on AVX-512 hardware (a Sapphire Rapids VM) and under emulation (tests/test_isa_emulation.py).
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

// 16 lanes -> 8 (lo + hi halves), then 8 such vectors -> [Σa0 .. Σa7] with a fixed add tree.
inline __m256 fold(__m512 a) {
  return _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
}

inline __m256 hsum8x8(const __m512 a[8]) {
  const __m256 t0 = _mm256_hadd_ps(fold(a[0]), fold(a[1]));
  const __m256 t1 = _mm256_hadd_ps(fold(a[2]), fold(a[3]));
  const __m256 t2 = _mm256_hadd_ps(fold(a[4]), fold(a[5]));
  const __m256 t3 = _mm256_hadd_ps(fold(a[6]), fold(a[7]));
  const __m256 u0 = _mm256_hadd_ps(t0, t1);
  const __m256 u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}


// Per-thread scratch lives in baseline code (attention.cpp): STL templates instantiated in
// an ISA file could be the copy the linker keeps for baseline callers (SIGILL on older CPUs).
inline float* scratch_floats(int64_t n) { return attn_thread_scratch(n); }

inline int64_t round8(int64_t x) { return (x + 7) & ~int64_t(7); }

// dst[t · hd + d] = src key t (t < nk), exact BF16 -> FP32; keys nk .. nk_pad - 1 zeroed.
void convert_block(const uint16_t* src, int64_t stride, int64_t nk, int64_t nk_pad, int64_t hd,
                   float* dst) {
  const int64_t hd16 = hd & ~int64_t(15);
  for (int64_t t = 0; t < nk; ++t) {
    for (int64_t d = 0; d < hd16; d += 16)
      _mm512_storeu_ps(dst + t * hd + d, load_bf16x16(src + t * stride + d));
    if (hd16 < hd)
      _mm256_storeu_ps(dst + t * hd + hd16, _mm512_castps512_ps256(load_bf16x8_lo(src + t * stride + hd16)));
  }
  for (int64_t t = nk; t < nk_pad; ++t)
    for (int64_t d = 0; d < hd; d += 8) _mm256_storeu_ps(dst + t * hd + d, _mm256_setzero_ps());
}

// Scores of 8 consecutive keys (FP32 rows kb[t · hd ..]); lane t = q·K_t before scaling.
template <int HD>
inline __m256 dot8(const float* q, const float* kb, int64_t hd_rt) {
  const int64_t hd = HD > 0 ? HD : hd_rt;
  const int64_t hd16 = hd & ~int64_t(15);
  __m512 acc[8];
  for (int t = 0; t < 8; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t d = 0; d < hd16; d += 16) {
    const __m512 qv = _mm512_loadu_ps(q + d);
    for (int t = 0; t < 8; ++t) acc[t] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(kb + t * hd + d), acc[t]);
  }
  if (hd16 < hd) {  // q and K lanes 8..15 zero, as in the single-pair kernel's tail
    const __m512 q_tail = _mm512_maskz_loadu_ps(0x00FF, q + hd16);
    for (int t = 0; t < 8; ++t)
      acc[t] = _mm512_fmadd_ps(q_tail, _mm512_maskz_loadu_ps(0x00FF, kb + t * hd + hd16), acc[t]);
  }
  return hsum8x8(acc);
}

// Pass 1 for one pair over keys [b0, e) of the current K super-block (kbuf row 0 = key b0).
template <int HD>
void scores_block(const float* q, const float* kbuf, int64_t hd, int64_t b0, int64_t e,
                  int64_t n, __m256 vscale, float* sc, __m256* vmax_io) {
  __m256 vmax = *vmax_io;
  for (int64_t j0 = b0; j0 < e; j0 += 8) {
    const __m256 s = _mm256_mul_ps(dot8<HD>(q, kbuf + (j0 - b0) * hd, hd), vscale);
    const int64_t nk = n - j0 < 8 ? n - j0 : 8;
    if (nk == 8) {
      _mm256_storeu_ps(sc + j0, s);
      vmax = _mm256_max_ps(vmax, s);
    } else {
      alignas(32) float tmp[8];
      _mm256_store_ps(tmp, s);
      for (int t = 0; t < nk; ++t) sc[j0 + t] = tmp[t];
      for (int t = int(nk); t < 8; ++t) tmp[t] = -INFINITY;  // lanes past p: dropped
      vmax = _mm256_max_ps(vmax, _mm256_load_ps(tmp));
    }
  }
  *vmax_io = vmax;
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
  const int64_t tb = n_max > t0 ? round8(n_max - t0) : 0;
  const int64_t sc_stride = round8(n_max) + 16;
  int64_t kb = (4096 / hd) & ~int64_t(7);  // keys per super-block: ~16 KB of FP32
  if (kb < 8) kb = 8;

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
  auto n_full = [&](int64_t u) { return attn_row_pos(a, row_of(u)) + 1; };  // keys 0..p
  auto n_of = [&](int64_t u) { return n_full(u) < kcap ? n_full(u) : kcap; };  // in this segment

  const __m256 vscale = _mm256_set1_ps(a.scale);
  for (int64_t u = 0; u < np; ++u) _mm256_storeu_ps(vmaxs + u * 8, _mm256_set1_ps(-INFINITY));

  // Tree tail of pair u's row: logical keys [t0, n) into tbuf (zero-padded to 8), as the
  // super-block would hold them; once per row (a row's pairs are consecutive).
  int64_t tail_row = -1;
  auto load_tail = [&](int64_t u, int kv_index) {
    if (row_of(u) == tail_row) return;
    tail_row = row_of(u);
    const int64_t n = n_of(u);
    for (int64_t j = t0; j < n; ++j) {
      const int64_t slot = attn_key_slot(a, tail_row, j);
      const uint16_t* src = (kv_index ? a.kv.v(a.layer, slot) : a.kv.k(a.layer, slot)) + kvh * hd;
      convert_block(src, stride, 1, 1, hd, tbuf + (j - t0) * hd);
    }
    convert_block(nullptr, stride, 0, round8(n - t0) - (n - t0), hd, tbuf + (n - t0) * hd);
  };

  // Pass 1: stream K once.
  for (int64_t b0 = kbeg, b1; b0 < n_sh; b0 = b1) {
    b1 = attn_block_end(a, b0, kb, n_sh);  // within one page
    convert_block(a.kv.k(a.layer, b0) + kvh * hd, stride, b1 - b0, round8(b1 - b0), hd, kvbuf);
    for (int64_t u = 0; u < np; ++u) {
      const int64_t n = n_of(u);
      const int64_t e = b1 < n ? b1 : n;
      if (e <= b0) continue;
      const float* q = a.q + (row_of(u) * a.n_heads + head_of(u)) * hd;
      __m256 vmax = _mm256_loadu_ps(vmaxs + u * 8);
      scores_block<HD>(q, kvbuf, hd, b0, e, n, vscale, scores + u * sc_stride, &vmax);
      _mm256_storeu_ps(vmaxs + u * 8, vmax);
    }
  }
  if (tb > 0)
    for (int64_t u = 0; u < np; ++u) {
      const int64_t n = n_of(u);
      if (n <= t0) continue;
      load_tail(u, 0);
      const float* q = a.q + (row_of(u) * a.n_heads + head_of(u)) * hd;
      __m256 vmax = _mm256_loadu_ps(vmaxs + u * 8);
      scores_block<HD>(q, tbuf, hd, t0, n, n, vscale, scores + u * sc_stride, &vmax);
      _mm256_storeu_ps(vmaxs + u * 8, vmax);
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
    convert_block(a.kv.v(a.layer, b0) + kvh * hd, stride, b1 - b0, b1 - b0, hd, kvbuf);
    for (int64_t u = 0; u < np; ++u) {
      const int64_t n = n_of(u);
      const int64_t e = b1 < n ? b1 : n;
      if (e <= b0) continue;
      v_keys(u, kvbuf, b0, e);
    }
  }
  tail_row = -1;
  if (tb > 0)
    for (int64_t u = 0; u < np; ++u) {
      if (n_of(u) <= t0) continue;
      load_tail(u, 1);
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

void attn_fold_rows_avx512(float* st, const float* ps, int64_t n, float wa, float wb) {
  const __m512 va = _mm512_set1_ps(wa), vb = _mm512_set1_ps(wb);
  for (int64_t c = 0; c < n; c += 16) {
    const __mmask16 m = n - c >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - c)) - 1);
    const __m512 x = _mm512_maskz_loadu_ps(m, st + c), p = _mm512_maskz_loadu_ps(m, ps + c);
    _mm512_mask_storeu_ps(st + c, m, _mm512_fmadd_ps(p, vb, _mm512_mul_ps(x, va)));
  }
}

}  // namespace qspec
