// Vector helpers shared by the translation units compiled with AVX-512 flags (attention_avx512.cpp,
// attention_amx.cpp, gemm_amx.cpp, attention_q8_impl.h's AVX-512 builds) only: `static inline`, so each keeps a private copy built with
// its own flags and none can be linked into baseline code.
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace qspec {
namespace avx512 {

// e^x in 16 lanes, lane for lane the arithmetic of avx2::exp (csrc/x86/vec_avx2.h): Cody-Waite
// split of ln2 and a degree-7 Taylor polynomial (~2 ulp); x < -87 gives 0 (so -inf gives 0 and no
// denormals), x > 88 is clamped. The same bits as the AVX2 code, so a kernel using it (the fused
// SwiGLU of gemm_amx.cpp) reproduces silu_mul_avx2.
static inline __m512 exp(__m512 x) {
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln2 high part (exact n·hi)
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);      // ln2 low part
  __m512 poly = _mm512_set1_ps(1.f / 5040.f);
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.f / 720.f));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.f / 120.f));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.f / 24.f));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.f / 6.f));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(0.5f));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.f));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.f));
  const __m512i pow2n = _mm512_slli_epi32(_mm512_cvtps_epi32(n), 23);  // n in [-126, 127]
  const __m512 y = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(poly), pow2n));
  return _mm512_maskz_mov_ps(__mmask16(~tiny), y);
}

// One KV head's part of a cache row (hd BF16 values) into L1 ahead of its use: the attention
// kernels' copies of decode and verify rows are latency-bound on the cache.
static inline void prefetch_row(const uint16_t* row, int64_t hd) {
  for (int64_t b = 0; b < hd * 2; b += 64) _mm_prefetch(reinterpret_cast<const char*>(row) + b, _MM_HINT_T0);
}

// r[i] = row i of a 16 x 16 matrix of 32-bit values; afterwards r[i] = its column i.
static inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0x88);
    t[4 + i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0xDD);
    t[8 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0x88);
    t[12 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0xDD);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
    r[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xDD);
    r[4 + i] = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0x88);
    r[12 + i] = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0xDD);
  }
}

}  // namespace avx512
}  // namespace qspec
