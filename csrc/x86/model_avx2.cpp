// AVX2 row-wise op of the native forward: SwiGLU activation out = silu(gate) * up.
// One fixed instruction sequence per 8 elements (and a scalar tail that is the same math),
// so every row is computed identically whatever the batch size.
#include <immintrin.h>

#include <cmath>
#include <cstdint>

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

}  // namespace qspec
