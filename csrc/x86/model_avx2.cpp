// AVX2 row-wise ops of the native forward: the SwiGLU activation, RMSNorm and the rounding of
// K/V rows to BF16. One fixed instruction sequence per row whatever the batch size, so every
// row is computed identically in a prefill, a verify and a decode pass.
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "bf16.h"
#include "model_ops.h"
#include "vec_avx2.h"

namespace qspec {
void silu_mul_avx2(const float* gate, const float* up, float* out, int64_t n) {
  int64_t i = 0;
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 neg = _mm256_set1_ps(-0.0f);
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 s = _mm256_div_ps(g, _mm256_add_ps(one, avx2::exp(_mm256_xor_ps(g, neg))));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(s, _mm256_loadu_ps(up + i)));
  }
  if (i < n) {  // tail through the same vector code on a padded copy
    alignas(32) float g[8] = {}, u[8] = {}, o[8];
    for (int64_t j = i; j < n; ++j) g[j - i] = gate[j], u[j - i] = up[j];
    const __m256 gv = _mm256_load_ps(g);
    const __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, avx2::exp(_mm256_xor_ps(gv, neg))));
    _mm256_store_ps(o, _mm256_mul_ps(s, _mm256_load_ps(u)));
    for (int64_t j = i; j < n; ++j) out[j] = o[j - i];
  }
}

// Σ x² in 32 lanes (element i in lane i mod 32; a tail's missing elements add +0), the lanes
// then folded in a fixed order: 4 accumulators pairwise, 8 lanes as 4 + 4, 2 + 2, 1 + 1.
void rms_norm_avx2(const float* x, const float* w, float eps, int64_t d, float* out) {
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  int64_t i = 0;
  for (; i + 32 <= d; i += 32)
    for (int a = 0; a < 4; ++a) {
      const __m256 v = _mm256_loadu_ps(x + i + 8 * a);
      acc[a] = _mm256_fmadd_ps(v, v, acc[a]);
    }
  if (i < d) {
    alignas(32) float t[32] = {};
    for (int64_t j = i; j < d; ++j) t[j - i] = x[j];
    for (int a = 0; a < 4; ++a) {
      const __m256 v = _mm256_load_ps(t + 8 * a);
      acc[a] = _mm256_fmadd_ps(v, v, acc[a]);
    }
  }
  const __m256 s8 = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  const float ss = _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
  const float r = 1.0f / std::sqrt(ss / float(d) + eps);
  const __m256 rv = _mm256_set1_ps(r);
  i = 0;
  for (; i + 8 <= d; i += 8)  // (x · r) · w, as the scalar loop
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), rv), _mm256_loadu_ps(w + i)));
  for (; i < d; ++i) out[i] = x[i] * r * w[i];
}

// f32_to_bf16 of n values (round to nearest even, NaN stays NaN): the same bits, 8 at a time.
void round_bf16_row_avx2(const float* x, uint16_t* out, int64_t n) {
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
  const __m256i half = _mm256_set1_epi32(0x7fff), one = _mm256_set1_epi32(1), quiet = _mm256_set1_epi32(0x40);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256i h[2];
    for (int p = 0; p < 2; ++p) {
      const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i + 8 * p));
      const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, abs_mask), inf);
      const __m256i rounded = _mm256_srli_epi32(
          _mm256_add_epi32(u, _mm256_add_epi32(half, _mm256_and_si256(_mm256_srli_epi32(u, 16), one))), 16);
      const __m256i quieted = _mm256_or_si256(_mm256_srli_epi32(u, 16), quiet);
      h[p] = _mm256_blendv_epi8(rounded, quieted, nan);
    }
    // packus works per 128-bit lane: (a0 b0 a1 b1) -> a0 a1 b0 b1
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(h[0], h[1]), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), packed);
  }
  for (; i < n; ++i) out[i] = f32_to_bf16(x[i]);
}

}  // namespace qspec
