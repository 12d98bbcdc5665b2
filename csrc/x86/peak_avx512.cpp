// Compute-peak loops with 512-bit FMAs and vdpbf16ps (compiled with the AVX-512 + AVX512-BF16
// flags; chosen at run time).
#include <immintrin.h>

#include <cstdint>

#include "peak_internal.h"

namespace qspec {
namespace detail {

namespace {
constexpr int kChains = 16;  // latency 4-6 x up to 2 pipes, + operands within 32 zmm

float reduce(const __m512* c) {
  __m512 t = c[0];
  for (int i = 1; i < kChains; ++i) t = _mm512_add_ps(t, c[i]);
  return _mm512_reduce_add_ps(t);
}
}  // namespace

double peak_fma_avx512(int64_t steps, float seed, float* sink) {
  __m512 c[kChains];
  for (int i = 0; i < kChains; ++i) c[i] = _mm512_set1_ps(seed * float(i));
  const __m512 x = _mm512_set1_ps(seed), y = _mm512_set1_ps(seed * 1e-7f);
  for (int64_t s = 0; s < steps; ++s)
    for (int i = 0; i < kChains; ++i) c[i] = _mm512_fmadd_ps(c[i], x, y);
  *sink = reduce(c);
  return double(steps) * kChains * 16 * 2;
}

double peak_dpbf16_avx512(int64_t steps, float seed, float* sink) {
  __m512 c[kChains];
  for (int i = 0; i < kChains; ++i) c[i] = _mm512_set1_ps(seed * float(i));
  // small products (~1e-6 each): the sums stay normal and finite for any number of steps used
  const float v = seed * 1e-3f;
  uint32_t bits;
  __builtin_memcpy(&bits, &v, 4);
  const __m512bh a = (__m512bh)_mm512_set1_epi32(int((bits >> 16) * 0x10001u));
  for (int64_t s = 0; s < steps; ++s)
    for (int i = 0; i < kChains; ++i) c[i] = _mm512_dpbf16_ps(c[i], a, a);
  *sink = reduce(c);
  return double(steps) * kChains * 32 * 2;
}

}  // namespace detail
}  // namespace qspec
