// AVX-512F pieces shared by the attention kernels compiled with AVX-512 flags
// (attention_avx512.cpp, attention_amx.cpp): `static inline`, so each translation unit keeps a
// private copy built with its own flags and none can be linked into baseline code.
#pragma once
#include <immintrin.h>

#include <cmath>
#include <cstdint>

namespace qspec {
namespace avx512 {

// exp(x) for x <= 0; the AVX2 scheme on 16 lanes (Cody-Waite + degree-7 Taylor, ~2 ulp;
// x < -87 -> 0, so -inf -> 0 and no denormals).
static inline __m512 exp_neg(__m512 x) {
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

static inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Pass 2: scores[j] = exp(scores[j] - max) in place for j < n; Σ in a fixed order.
static inline float exp_pass(float* scores, int64_t n, float max_s) {
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

}  // namespace avx512
}  // namespace qspec
