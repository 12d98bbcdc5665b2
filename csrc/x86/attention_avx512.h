// AVX-512F pieces of attention_avx512.cpp (the AMX kernel has its own exponentials, fused with its
// weight split): `static inline`, so a translation unit keeps a private copy built with its own
// flags and none can be linked into baseline code.
#pragma once
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "vec_avx512.h"

namespace qspec {
namespace avx512 {

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
    const __m512 e = exp(_mm512_sub_ps(s, vmax));  // dead lanes: exp(-inf) = 0
    _mm512_mask_storeu_ps(scores + j, live, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  return _mm512_reduce_add_ps(vsum);
}

}  // namespace avx512
}  // namespace qspec
