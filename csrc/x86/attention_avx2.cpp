// AVX2 + FMA attention: one call computes several (row, head) pairs of ONE KV head (see
// attention.h), head_dim a multiple of 8. Per pair, the three passes of attention.cpp:
//   1. scores: keys in blocks of 8 counted from key 0; per key one FMA chain over head_dim in
//      chunks of 8 (q·K lane-wise), the 8 keys' chains reduced by one fixed hadd tree, · scale;
//   2. exp(s - max) with Σ as 8 lane-wise partial sums over blocks from key 0, then a fixed tree;
//   3. per output column one FMA chain over keys 0..p in order, then · (1/Σ).
// The batch is only a loop around these: K and V are streamed in super-blocks (a multiple of 8
// keys, ~16 KB of FP32) converted BF16 -> FP32 once (exact) and then used by every pair whose
// row reaches them. A pair with p inside a block uses keys up to p only: a partial 8-key score
// block computes lanes it then drops (every hadd-tree lane depends on its own key only), the V
// pass stops at p. Nothing beyond the last row's position is read from the cache. So each
// pair's instruction sequence depends only on its own q and p — not on m, the other rows, how
// the driver grouped pairs, or the thread count (DESIGN.md invariant 2).
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "attention.h"

namespace qspec {
namespace {

// 8 BF16 values -> 8 FP32 (exact: BF16 is the top half of FP32).
inline __m256 load_bf16x8(const uint16_t* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// exp(x) for x <= 0 (softmax after subtracting the max), accurate to ~2 ulp.
// Cody-Waite reduction x = n·ln2 + r, |r| <= ln2/2, then Taylor to degree 7 (truncation error
// 0.35^8/8! ≈ 5e-9 relative), then ·2^n via the exponent field. x < -87 (result below
// FLT_MIN ≈ e^-87.3) returns 0, so no denormals are produced and -inf gives 0.
inline __m256 exp_neg(__m256 x) {
  const __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln2 high part (exact n·hi)
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);      // ln2 low part
  __m256 poly = _mm256_set1_ps(1.f / 5040.f);
  poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(1.f / 720.f));
  poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(1.f / 120.f));
  poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(1.f / 24.f));
  poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(1.f / 6.f));
  poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(0.5f));
  poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(1.f));
  poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(1.f));
  const __m256i pow2n = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);  // n in [-126, 0]
  const __m256 y = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(poly), pow2n));
  return _mm256_andnot_ps(tiny, y);
}

// Horizontal sums of 8 vectors -> one vector [Σa0, Σa1, ..., Σa7]; a fixed add tree per lane.
inline __m256 hsum8x8(const __m256 a[8]) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]);
  const __m256 t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]);
  const __m256 t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1);
  const __m256 u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Per-thread scratch, 64-byte aligned, grows to the largest call seen and is then reused.
float* scratch_floats(int64_t n) {
  thread_local std::vector<float> buf;
  if (int64_t(buf.size()) < n + 16) buf.resize(n + 16);
  const uintptr_t p = reinterpret_cast<uintptr_t>(buf.data());
  return reinterpret_cast<float*>((p + 63) & ~uintptr_t(63));
}

inline int64_t round8(int64_t x) { return (x + 7) & ~int64_t(7); }

// dst[t · hd + d] = src key t (t < nk), exact BF16 -> FP32; keys nk .. nk_pad - 1 zeroed (never
// read from the cache).
void convert_block(const uint16_t* src, int64_t stride, int64_t nk, int64_t nk_pad, int64_t hd,
                   float* dst) {
  for (int64_t t = 0; t < nk; ++t)
    for (int64_t d = 0; d < hd; d += 8)
      _mm256_store_ps(dst + t * hd + d, load_bf16x8(src + t * stride + d));
  for (int64_t t = nk; t < nk_pad; ++t)
    for (int64_t d = 0; d < hd; d += 8) _mm256_store_ps(dst + t * hd + d, _mm256_setzero_ps());
}

// Scores of 8 consecutive keys (FP32 rows kb[t · hd ..]) for one q; lane t = q·K_t before
// scaling. One FMA chain per key over head_dim chunks in order, then the fixed tree.
template <int HD>
inline __m256 dot8(const float* q, const float* kb, int64_t hd_rt) {
  const int64_t hd = HD > 0 ? HD : hd_rt;
  __m256 acc[8];
  for (int t = 0; t < 8; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t d = 0; d < hd; d += 8) {
    const __m256 qv = _mm256_loadu_ps(q + d);
    for (int t = 0; t < 8; ++t) acc[t] = _mm256_fmadd_ps(qv, _mm256_load_ps(kb + t * hd + d), acc[t]);
  }
  return hsum8x8(acc);
}

// Pass 1 for one pair over keys [b0, e) of the current K super-block (kbuf holds key b0 at row
// 0; b0 is a multiple of 8; e <= n). Scores go to sc[j], the lane-wise running max to *vmax.
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

// Pass 2: scores[j] = exp(scores[j] - max) in place for j < n; returns Σ in a fixed order
// (8 lane-wise partial sums over blocks from key 0, then one fixed horizontal tree).
float exp_pass(float* scores, int64_t n, float max_s) {
  const __m256 vmax = _mm256_set1_ps(max_s);
  __m256 vsum = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(scores + j), vmax));
    _mm256_storeu_ps(scores + j, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  if (j < n) {
    alignas(32) float tmp[8];
    for (int t = 0; t < 8; ++t) tmp[t] = j + t < n ? scores[j + t] : -INFINITY;
    const __m256 e = exp_neg(_mm256_sub_ps(_mm256_load_ps(tmp), vmax));  // -inf lanes -> 0
    _mm256_store_ps(tmp, e);
    for (int64_t t = 0; j + t < n; ++t) scores[j + t] = tmp[t];
    vsum = _mm256_add_ps(vsum, e);
  }
  return hsum(vsum);
}

// Pass 3 for NC·8 columns of one pair over keys [b0, e) of the current V super-block (vbuf row
// 0 = key b0, row stride hd): acc[c] += w[j] · V_j[c], keys in order; the running sums live in
// accp (FP32, per pair) between super-blocks, so each column is one FMA chain over 0..p.
template <int NC>
inline void v_block(const float* w, const float* vbuf, int64_t hd, int64_t b0, int64_t e,
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

template <int HD>
void group_impl(const AttnArgs& a, int64_t kvh, int64_t u0, int64_t u1) {
  const int64_t hd = HD > 0 ? HD : a.kv.head_dim;
  const int64_t G = a.n_heads / a.kv.kv_heads;
  const int64_t np = u1 - u0;
  if (np <= 0) return;
  const int64_t stride = a.kv.row_elems();
  const int64_t n_max = a.start_pos + (u1 - 1) / G + 1;  // keys 0 .. last row's position
  const int64_t sc_stride = round8(n_max) + 8;
  int64_t kb = (4096 / hd) & ~int64_t(7);  // keys per super-block: ~16 KB of FP32
  if (kb < 8) kb = 8;

  // Scratch: K/V super-block | scores per pair | V accumulators per pair | running max per pair.
  float* buf = scratch_floats(kb * hd + np * sc_stride + np * hd + np * 8 + 64);
  float* kvbuf = buf;
  float* scores = kvbuf + kb * hd;
  float* accs = scores + np * sc_stride;
  float* vmaxs = accs + np * hd;

  auto row_of = [&](int64_t u) { return (u0 + u) / G; };
  auto head_of = [&](int64_t u) { return kvh * G + (u0 + u) % G; };
  auto n_of = [&](int64_t u) { return a.start_pos + row_of(u) + 1; };

  const __m256 vscale = _mm256_set1_ps(a.scale);
  for (int64_t u = 0; u < np; ++u) _mm256_store_ps(vmaxs + u * 8, _mm256_set1_ps(-INFINITY));

  // Pass 1: stream K once.
  const uint16_t* k0 = a.kv.k(a.layer, 0) + kvh * hd;
  for (int64_t b0 = 0; b0 < n_max; b0 += kb) {
    const int64_t b1 = b0 + kb < n_max ? b0 + kb : n_max;
    convert_block(k0 + b0 * stride, stride, b1 - b0, round8(b1 - b0), hd, kvbuf);
    for (int64_t u = 0; u < np; ++u) {
      const int64_t n = n_of(u);
      const int64_t e = b1 < n ? b1 : n;
      if (e <= b0) continue;
      const float* q = a.q + (row_of(u) * a.n_heads + head_of(u)) * hd;
      __m256 vmax = _mm256_load_ps(vmaxs + u * 8);
      scores_block<HD>(q, kvbuf, hd, b0, e, n, vscale, scores + u * sc_stride, &vmax);
      _mm256_store_ps(vmaxs + u * 8, vmax);
    }
  }

  // Pass 2: per pair, over its own keys only.
  float* inv_sums = vmaxs;  // lane 0 of each pair's slot, after its max is read
  for (int64_t u = 0; u < np; ++u) {
    const float max_s = hmax(_mm256_load_ps(vmaxs + u * 8));
    inv_sums[u * 8] = 1.f / exp_pass(scores + u * sc_stride, n_of(u), max_s);
  }

  // Pass 3: stream V once.
  for (int64_t x = 0; x < np * hd; x += 8) _mm256_store_ps(accs + x, _mm256_setzero_ps());
  const uint16_t* v0 = a.kv.v(a.layer, 0) + kvh * hd;
  for (int64_t b0 = 0; b0 < n_max; b0 += kb) {
    const int64_t b1 = b0 + kb < n_max ? b0 + kb : n_max;
    convert_block(v0 + b0 * stride, stride, b1 - b0, b1 - b0, hd, kvbuf);
    for (int64_t u = 0; u < np; ++u) {
      const int64_t n = n_of(u);
      const int64_t e = b1 < n ? b1 : n;
      if (e <= b0) continue;
      const float* w = scores + u * sc_stride;
      float* accp = accs + u * hd;
      int64_t d = 0;
      for (; d + 64 <= hd; d += 64) v_block<8>(w, kvbuf + d, hd, b0, e, accp + d);
      if (d + 32 <= hd) v_block<4>(w, kvbuf + d, hd, b0, e, accp + d), d += 32;
      if (d + 16 <= hd) v_block<2>(w, kvbuf + d, hd, b0, e, accp + d), d += 16;
      if (d + 8 <= hd) v_block<1>(w, kvbuf + d, hd, b0, e, accp + d), d += 8;
    }
  }

  for (int64_t u = 0; u < np; ++u) {
    const __m256 vinv = _mm256_set1_ps(inv_sums[u * 8]);
    float* out = a.out + (row_of(u) * a.n_heads + head_of(u)) * hd;
    for (int64_t d = 0; d < hd; d += 8)
      _mm256_storeu_ps(out + d, _mm256_mul_ps(_mm256_load_ps(accs + u * hd + d), vinv));
  }
}

}  // namespace

void attn_group_avx2(const AttnArgs& a, int64_t kvh, int64_t u_begin, int64_t u_end) {
  switch (a.kv.head_dim) {
    case 64: group_impl<64>(a, kvh, u_begin, u_end); break;
    case 128: group_impl<128>(a, kvh, u_begin, u_end); break;
    default: group_impl<0>(a, kvh, u_begin, u_end); break;
  }
}

}  // namespace qspec
