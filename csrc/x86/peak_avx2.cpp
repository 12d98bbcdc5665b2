// Compute-peak loop with 256-bit FMAs (compiled with the AVX2 flags; chosen at run time).
#include <immintrin.h>

#include "peak_internal.h"

namespace qspec {
namespace detail {

double peak_fma_avx2(int64_t steps, float seed, float* sink) {
  constexpr int kChains = 12;  // latency 4-5 x 2 FMA pipes, + 2 operands within 16 ymm
  __m256 c[kChains];
  for (int i = 0; i < kChains; ++i) c[i] = _mm256_set1_ps(seed * float(i));
  const __m256 x = _mm256_set1_ps(seed), y = _mm256_set1_ps(seed * 1e-7f);
  for (int64_t s = 0; s < steps; ++s)
    for (int i = 0; i < kChains; ++i) c[i] = _mm256_fmadd_ps(c[i], x, y);
  __m256 t = c[0];
  for (int i = 1; i < kChains; ++i) t = _mm256_add_ps(t, c[i]);
  *sink = _mm256_cvtss_f32(t);
  return double(steps) * kChains * 8 * 2;
}

}  // namespace detail
}  // namespace qspec
