// Vector helpers shared by the AVX2 translation units (csrc/x86/*_avx2.cpp) only. Everything here
// is `static inline`: each AVX2 file gets its own private copy, none can be linked into baseline code.
#pragma once
#include <immintrin.h>

namespace qspec {
namespace avx2 {

// Horizontal sum and max of 8 lanes in a fixed order: (lo128 + hi128), then lanes {2,3} onto
// {0,1}, then lane 0 + lane 1.
static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

static inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// e^x, 8 lanes. x = n ln2 + r with |r| <= ln2/2 (Cody-Waite split of ln2, exact n * hi), e^r by
// its degree-7 Taylor polynomial (relative error ~ 0.35^8/8! ~ 5e-9), then 2^n added to the
// exponent field. x < -87 (result below FLT_MIN) gives 0, so no denormals and e^-inf = 0;
// x > 88 is clamped (e^88 < FLT_MAX).
static inline __m256 exp(__m256 x) {
  const __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
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
  const __m256i pow2n = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);  // n in [-126, 127]
  const __m256 y = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(poly), pow2n));
  return _mm256_andnot_ps(tiny, y);
}

}  // namespace avx2
}  // namespace qspec
