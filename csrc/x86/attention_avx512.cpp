// AVX-512F attention for one (row, head); head_dim a multiple of 8. Same three passes and the
// same batch-invariance argument as attention_avx2.cpp (see attention.cpp): every loop runs over
// keys 0..p in a fixed order with block boundaries counted from key 0, so the instruction
// sequence for a row depends only on its own position p.
//
// UNTESTED on hardware so far: it was written on an AVX2-only machine (the dispatcher cannot
// select it there). tests/test_attention.py runs it against the float64 oracle wherever the
// CPU probe reports AVX-512.
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "attention.h"

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

// exp(x) for x <= 0; the AVX2 scheme on 16 lanes (Cody-Waite + degree-7 Taylor, ~2 ulp;
// x < -87 -> 0, so -inf -> 0 and no denormals).
inline __m512 exp_neg(__m512 x) {
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 poly = _mm512_set1_ps(1.f / 5040.f);
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.f / 720.f));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.f / 120.f));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.f / 24.f));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.f / 6.f));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(0.5f));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.f));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.f));
  const __m512i pow2n = _mm512_slli_epi32(_mm512_cvtps_epi32(n), 23);  // n in [-126, 0]
  const __m512 y = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(poly), pow2n));
  return _mm512_maskz_mov_ps(__mmask16(~tiny), y);
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

inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Pass 1: scores[j] = scale · q·K_j for j in [0, n); returns the max. Keys in blocks of 8
// (missing accumulators of a short last block stay zero; keys >= n are never read); head_dim
// in chunks of 16, then 8 if head_dim % 16 == 8 (q lanes 8..15 zero there).
float scores_pass(const float* q, const uint16_t* k0, int64_t kstride, int64_t hd, int64_t n,
                  float scale, float* scores) {
  const __m256 vscale = _mm256_set1_ps(scale);
  __m256 vmax = _mm256_set1_ps(-INFINITY);
  const int64_t hd16 = hd & ~int64_t(15);
  const __m512 q_tail = hd16 < hd ? _mm512_maskz_loadu_ps(0x00FF, q + hd16) : _mm512_setzero_ps();
  for (int64_t j0 = 0; j0 < n; j0 += 8) {
    const int nk = n - j0 < 8 ? int(n - j0) : 8;
    __m512 acc[8];
    for (int t = 0; t < 8; ++t) acc[t] = _mm512_setzero_ps();
    const uint16_t* kb = k0 + j0 * kstride;
    for (int64_t d = 0; d < hd16; d += 16) {
      const __m512 qv = _mm512_loadu_ps(q + d);
      for (int t = 0; t < nk; ++t)
        acc[t] = _mm512_fmadd_ps(qv, load_bf16x16(kb + t * kstride + d), acc[t]);
    }
    if (hd16 < hd)
      for (int t = 0; t < nk; ++t)
        acc[t] = _mm512_fmadd_ps(q_tail, load_bf16x8_lo(kb + t * kstride + hd16), acc[t]);
    const __m256 s = _mm256_mul_ps(hsum8x8(acc), vscale);
    if (nk == 8) {
      _mm256_storeu_ps(scores + j0, s);
      vmax = _mm256_max_ps(vmax, s);
    } else {
      alignas(32) float tmp[8];
      _mm256_store_ps(tmp, s);
      for (int t = 0; t < nk; ++t) scores[j0 + t] = tmp[t];
      for (int t = nk; t < 8; ++t) tmp[t] = -INFINITY;
      vmax = _mm256_max_ps(vmax, _mm256_load_ps(tmp));
    }
  }
  return hmax8(vmax);
}

// Pass 2: scores[j] = exp(scores[j] - max) in place; Σ in a fixed order (16 lane-wise partial
// sums over blocks from key 0, then one horizontal reduction).
float exp_pass(float* scores, int64_t n, float max_s) {
  const __m512 vmax = _mm512_set1_ps(max_s);
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 live = n - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - j)) - 1);
    const __m512 s = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), live, scores + j);
    const __m512 e = exp_neg(_mm512_sub_ps(s, vmax));  // dead lanes: exp(-inf) = 0
    _mm512_mask_storeu_ps(scores + j, live, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  return _mm512_reduce_add_ps(vsum);
}

// Pass 3 over NC·16 output columns: one accumulator per column, keys in order 0..n-1.
template <int NC>
void weighted_v(const float* w, const uint16_t* v0, int64_t vstride, int64_t n, float inv_sum,
                float* out) {
  __m512 acc[NC];
  for (int c = 0; c < NC; ++c) acc[c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const __m512 wj = _mm512_set1_ps(w[j]);
    const uint16_t* vj = v0 + j * vstride;
    for (int c = 0; c < NC; ++c) acc[c] = _mm512_fmadd_ps(wj, load_bf16x16(vj + c * 16), acc[c]);
  }
  const __m512 vinv = _mm512_set1_ps(inv_sum);
  for (int c = 0; c < NC; ++c) _mm512_storeu_ps(out + c * 16, _mm512_mul_ps(acc[c], vinv));
}

// The last 8 columns when head_dim % 16 == 8.
void weighted_v8(const float* w, const uint16_t* v0, int64_t vstride, int64_t n, float inv_sum,
                 float* out) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j)
    acc = _mm512_fmadd_ps(_mm512_set1_ps(w[j]), load_bf16x8_lo(v0 + j * vstride), acc);
  _mm512_mask_storeu_ps(out, 0x00FF, _mm512_mul_ps(acc, _mm512_set1_ps(inv_sum)));
}

}  // namespace

void attn_row_head_avx512(const AttnArgs& a, int64_t i, int64_t h, float* scratch) {
  const int64_t hd = a.kv.head_dim;
  const int64_t kvh = h / (a.n_heads / a.kv.kv_heads);
  const int64_t n = a.start_pos + i + 1;  // keys 0..p
  const int64_t stride = a.kv.row_elems();
  const float* q = a.q + (i * a.n_heads + h) * hd;
  float* out = a.out + (i * a.n_heads + h) * hd;
  const uint16_t* k0 = a.kv.k(a.layer, 0) + kvh * hd;
  const uint16_t* v0 = a.kv.v(a.layer, 0) + kvh * hd;

  const float max_s = scores_pass(q, k0, stride, hd, n, a.scale, scratch);
  const float inv_sum = 1.f / exp_pass(scratch, n, max_s);
  int64_t d = 0;
  for (; d + 128 <= hd; d += 128) weighted_v<8>(scratch, v0 + d, stride, n, inv_sum, out + d);
  if (d + 64 <= hd) weighted_v<4>(scratch, v0 + d, stride, n, inv_sum, out + d), d += 64;
  if (d + 32 <= hd) weighted_v<2>(scratch, v0 + d, stride, n, inv_sum, out + d), d += 32;
  if (d + 16 <= hd) weighted_v<1>(scratch, v0 + d, stride, n, inv_sum, out + d), d += 16;
  if (d + 8 <= hd) weighted_v8(scratch, v0 + d, stride, n, inv_sum, out + d);
}

}  // namespace qspec
