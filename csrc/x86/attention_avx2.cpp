// AVX2 + FMA attention for one (row, head); head_dim a multiple of 8. See attention.cpp for the
// three passes and the batch-invariance argument: every loop below runs over keys 0..p in a
// fixed order with block boundaries at multiples of 8 counted from key 0, so the instruction
// sequence for a row depends only on its own position p.
#include <immintrin.h>

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

// Pass 1: scores[j] = scale · q·K_j for j in [0, n); returns max_j scores[j].
// Keys go in blocks of 8 (one accumulator each, reduced together); a short last block
// leaves the missing accumulators at zero and never touches keys >= n.
float scores_pass(const float* q, const uint16_t* k0, int64_t kstride, int64_t hd, int64_t n,
                  float scale, float* scores) {
  const __m256 vscale = _mm256_set1_ps(scale);
  __m256 vmax = _mm256_set1_ps(-INFINITY);
  for (int64_t j0 = 0; j0 < n; j0 += 8) {
    const int nk = n - j0 < 8 ? int(n - j0) : 8;
    __m256 acc[8];
    for (int t = 0; t < 8; ++t) acc[t] = _mm256_setzero_ps();
    const uint16_t* kb = k0 + j0 * kstride;
    if (nk == 8) {
      for (int64_t d = 0; d < hd; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        for (int t = 0; t < 8; ++t)
          acc[t] = _mm256_fmadd_ps(qv, load_bf16x8(kb + t * kstride + d), acc[t]);
      }
    } else {
      for (int64_t d = 0; d < hd; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        for (int t = 0; t < nk; ++t)
          acc[t] = _mm256_fmadd_ps(qv, load_bf16x8(kb + t * kstride + d), acc[t]);
      }
    }
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
  return hmax(vmax);
}

// Pass 2: scores[j] = exp(scores[j] - max) in place; returns Σ in a fixed order
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

// Pass 3 over NC·8 output columns: out[c] = inv_sum · Σ_j w[j] · V_j[c], one accumulator per
// column, keys in order 0..n-1. Splitting head_dim into column blocks does not change any
// column's arithmetic, so the split is free to follow register pressure.
template <int NC>
void weighted_v(const float* w, const uint16_t* v0, int64_t vstride, int64_t n, float inv_sum,
                float* out) {
  __m256 acc[NC];
  for (int c = 0; c < NC; ++c) acc[c] = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const __m256 wj = _mm256_broadcast_ss(w + j);
    const uint16_t* vj = v0 + j * vstride;
    for (int c = 0; c < NC; ++c) acc[c] = _mm256_fmadd_ps(wj, load_bf16x8(vj + c * 8), acc[c]);
  }
  const __m256 vinv = _mm256_set1_ps(inv_sum);
  for (int c = 0; c < NC; ++c) _mm256_storeu_ps(out + c * 8, _mm256_mul_ps(acc[c], vinv));
}

}  // namespace

void attn_row_head_avx2(const AttnArgs& a, int64_t i, int64_t h, float* scratch) {
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
  for (; d + 64 <= hd; d += 64) weighted_v<8>(scratch, v0 + d, stride, n, inv_sum, out + d);
  if (d + 32 <= hd) weighted_v<4>(scratch, v0 + d, stride, n, inv_sum, out + d), d += 32;
  if (d + 16 <= hd) weighted_v<2>(scratch, v0 + d, stride, n, inv_sum, out + d), d += 16;
  if (d + 8 <= hd) weighted_v<1>(scratch, v0 + d, stride, n, inv_sum, out + d), d += 8;
}

}  // namespace qspec
