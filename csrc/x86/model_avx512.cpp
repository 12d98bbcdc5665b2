// AVX-512 row-wise op of the native forward: silu_mul_avx2's arithmetic 16 lanes at a time
// (avx512::exp is avx2::exp lane for lane), so every element gets the AVX2 kernel's bits.
#include <immintrin.h>

#include <cstdint>

#include "model_ops.h"
#include "vec_avx512.h"

namespace qspec {
void silu_mul_avx512(const float* gate, const float* up, float* out, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 neg = _mm512_set1_ps(-0.0f);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 live = n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
    const __m512 g = _mm512_maskz_loadu_ps(live, gate + i);
    const __m512 s = _mm512_div_ps(g, _mm512_add_ps(one, avx512::exp(_mm512_xor_ps(g, neg))));
    _mm512_mask_storeu_ps(out + i, live, _mm512_mul_ps(s, _mm512_maskz_loadu_ps(live, up + i)));
  }
}

}  // namespace qspec
