// Test build only (CMake option QSPEC_ISA_EMULATION): the AVX-512 (F/BW/VL/DQ/BF16) and AMX-BF16
// kernel sources compiled for an AVX2 host, their intrinsics emulated, so that the whole test
// suite can run the avx512, avx512_bf16 and amx paths against the scalar oracle on a machine
// without those instructions. Force-included (-include) ahead of csrc/x86/*_avx512.cpp and
// *_amx.cpp; never part of a release build.
//
// AVX-512: SIMDe (github.com/simd-everywhere/simde) with native aliases, so the kernels compile
// unchanged. The few intrinsics SIMDe 0.8 lacks are spelled out below with the semantics of
// the Intel SDM (and, for the horizontal sum, GCC's own order of operations).
// VDPBF16PS follows the SDM too (odd element first, DAZ / FTZ), as the FMA kernel that
// reproduces it on Intel needs.
// AMX: eight software tile registers per thread, configured by the 64-byte TILECFG layout;
// TDPBF16PS follows the SDM pseudo-code (fp32 products of bf16 pairs, even element first).
// AVX512-VNNI (vpdpbusd) and VBMI (vpermb) come from SIMDe, AVX-VNNI's vpdpbusd on ymm (the same
// operation, VEX-encoded) too.
#pragma once
#include <immintrin.h>

#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

namespace qspec_emu {

// 16 bytes (signed or unsigned by T) widened to 16 int32 lanes.
template <typename T>
inline simde__m512i widen_bytes(simde__m128i a) {
  T b[16];
  std::memcpy(b, &a, 16);
  int32_t r[16];
  for (int i = 0; i < 16; ++i) r[i] = b[i];
  return simde_mm512_loadu_si512(r);
}

// Masked loads and stores touch only the lanes of the mask, as the hardware does (SIMDe 0.8
// reads all 16 lanes for a masked load and writes zeros to the unmasked lanes of a masked store:
// that would read past buffers and clobber the neighbouring data the kernels rely on).
inline simde__m512 mask_loadu_ps(simde__m512 src, simde__mmask16 k, const void* p) {
  float v[16];
  simde_mm512_storeu_ps(v, src);
  for (int i = 0; i < 16; ++i)
    if (k >> i & 1) std::memcpy(&v[i], static_cast<const float*>(p) + i, 4);
  return simde_mm512_loadu_ps(v);
}

inline simde__m512 maskz_loadu_ps(simde__mmask16 k, const void* p) {
  return mask_loadu_ps(simde_mm512_setzero_ps(), k, p);
}

inline void mask_storeu_ps(void* p, simde__mmask16 k, simde__m512 a) {
  float v[16];
  simde_mm512_storeu_ps(v, a);
  for (int i = 0; i < 16; ++i)
    if (k >> i & 1) std::memcpy(static_cast<float*>(p) + i, &v[i], 4);
}

inline void mask_storeu_epi32(void* p, simde__mmask16 k, simde__m512i a) {
  mask_storeu_ps(p, k, simde_mm512_castsi512_ps(a));
}

inline simde__m512i maskz_loadu_epi32(simde__mmask16 k, const void* p) {
  return simde_mm512_castps_si512(maskz_loadu_ps(k, p));
}

inline simde__mmask16 cmpgt_epu32_mask(simde__m512i a, simde__m512i b) {
  uint32_t x[16], y[16];
  simde_mm512_storeu_si512(x, a);
  simde_mm512_storeu_si512(y, b);
  simde__mmask16 k = 0;
  for (int i = 0; i < 16; ++i) k = simde__mmask16(k | (x[i] > y[i]) << i);
  return k;
}

inline simde__m256i cvtepi32_epi16(simde__m512i a) {  // vpmovdw: truncation
  uint32_t x[16];
  uint16_t r[16];
  simde_mm512_storeu_si512(x, a);
  for (int i = 0; i < 16; ++i) r[i] = uint16_t(x[i]);
  return simde_mm256_loadu_si256(r);
}

// GCC's _mm512_reduce_add_ps: (hi256 + lo256), then (hi128 + lo128), then lanes {2,3} onto
// {0,1}, then lane 0 + lane 1.
inline float reduce_add_ps(simde__m512 a) {
  float v[16];
  simde_mm512_storeu_ps(v, a);
  float t3[8], t6[4];
  for (int i = 0; i < 8; ++i) t3[i] = v[8 + i] + v[i];
  for (int i = 0; i < 4; ++i) t6[i] = t3[4 + i] + t3[i];
  const float t8_0 = t6[0] + t6[2], t8_1 = t6[1] + t6[3];
  return t8_0 + t8_1;
}

struct TileRegs {
  uint8_t rows[8] = {};
  uint16_t colsb[8] = {};
  bool configured = false;
  alignas(64) uint8_t data[8][16][64] = {};
};

inline TileRegs& tiles() {
  static thread_local TileRegs t;
  return t;
}

inline void check_tile(int t) {
  if (t < 0 || t > 7 || !tiles().configured) throw std::logic_error("emulated AMX: tile not configured");
}

inline void tile_loadconfig(const void* cfg) {
  const uint8_t* c = static_cast<const uint8_t*>(cfg);
  if (c[0] != 1) throw std::logic_error("emulated AMX: palette must be 1");
  TileRegs& r = tiles();
  for (int t = 0; t < 8; ++t) {
    std::memcpy(&r.colsb[t], c + 16 + 2 * t, 2);
    r.rows[t] = c[48 + t];
    if (r.rows[t] > 16 || r.colsb[t] > 64) throw std::logic_error("emulated AMX: tile larger than 16 x 64 bytes");
  }
  r.configured = true;
}

inline void tile_release() { tiles() = TileRegs(); }

inline void tile_zero(int t) {
  check_tile(t);
  std::memset(tiles().data[t], 0, sizeof(tiles().data[t]));
}

inline void tile_loadd(int t, const void* base, long stride) {
  check_tile(t);
  TileRegs& r = tiles();
  std::memset(r.data[t], 0, sizeof(r.data[t]));
  for (int i = 0; i < r.rows[t]; ++i)
    std::memcpy(r.data[t][i], static_cast<const uint8_t*>(base) + i * stride, r.colsb[t]);
}

inline void tile_stored(int t, void* base, long stride) {
  check_tile(t);
  TileRegs& r = tiles();
  for (int i = 0; i < r.rows[t]; ++i) std::memcpy(static_cast<uint8_t*>(base) + i * stride, r.data[t][i], r.colsb[t]);
}

// The tiles of a dot product C += A . B, checked as the hardware checks them (#UD otherwise).
inline TileRegs& dot_tiles(int c, int a, int b, const char* op) {
  check_tile(c);
  check_tile(a);
  check_tile(b);
  TileRegs& r = tiles();
  if (r.rows[c] != r.rows[a] || r.colsb[c] != r.colsb[b] || r.colsb[a] % 4 != 0 || r.colsb[a] / 4 != r.rows[b])
    throw std::logic_error(std::string("emulated AMX: ") + op + " tile shapes disagree");
  return r;
}

inline float bf16_at(const uint8_t* row, int i) {
  uint16_t h;
  std::memcpy(&h, row + 2 * i, 2);
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// VDPBF16PS as the SDM defines it (SIMDe's sums each pair's products in another order): per fp32
// lane, src += a.odd * b.odd, then src += a.even * b.even, each an fp32 fma (a bf16 product is
// exact), with denormal inputs read as zero and denormal results flushed (DAZ, FTZ). The kernels'
// FMA variant (gemm_bf16fma_avx512.cpp) must give these bits.
inline float flush_denormal(float v) { return std::fpclassify(v) == FP_SUBNORMAL ? std::copysign(0.0f, v) : v; }

inline simde__m512 dpbf16_ps(simde__m512 src, simde__m512bh a, simde__m512bh b) {
  float acc[16];
  uint8_t x[64], y[64];
  simde_mm512_storeu_ps(acc, src);
  std::memcpy(x, &a, 64);
  std::memcpy(y, &b, 64);
  for (int i = 0; i < 16; ++i) {
    float s = flush_denormal(acc[i]);
    for (int e = 1; e >= 0; --e)
      s = flush_denormal(std::fma(flush_denormal(bf16_at(x, 2 * i + e)), flush_denormal(bf16_at(y, 2 * i + e)), s));
    acc[i] = s;
  }
  return simde_mm512_loadu_ps(acc);
}

// VCVTNE2PS2BF16 (SDM): b's 16 floats to BF16 elements 0-15, a's to 16-31, rounded to nearest
// even; denormal inputs read as zero, a NaN made quiet.
inline simde__m512bh cvtne2ps_pbh(simde__m512 a, simde__m512 b) {
  float v[32];
  simde_mm512_storeu_ps(v, b);
  simde_mm512_storeu_ps(v + 16, a);
  uint16_t h[32];
  for (int i = 0; i < 32; ++i) {
    uint32_t u;
    std::memcpy(&u, &v[i], 4);
    if (std::isnan(v[i])) h[i] = uint16_t((u >> 16) | 0x40);
    else if (std::fpclassify(v[i]) == FP_SUBNORMAL) h[i] = uint16_t((u >> 16) & 0x8000);
    else h[i] = uint16_t((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
  }
  simde__m512bh r;
  std::memcpy(&r, h, 64);
  return r;
}

// C[m][n] += A.bf16[m][2k] * B.bf16[k][2n] + A.bf16[m][2k+1] * B.bf16[k][2n+1], k ascending.
// Row m of C reads only row m of A (and all of B): the configured row count never changes a
// row's result. Shapes the hardware rejects (#UD) are rejected here too.
inline void tile_dpbf16ps(int c, int a, int b) {
  TileRegs& r = dot_tiles(c, a, b, "tdpbf16ps");
  for (int m = 0; m < r.rows[c]; ++m) {
    float acc[16];
    std::memcpy(acc, r.data[c][m], 64);
    for (int k = 0; k < r.colsb[a] / 4; ++k)
      for (int n = 0; n < r.colsb[c] / 4; ++n) {
        acc[n] += bf16_at(r.data[a][m], 2 * k) * bf16_at(r.data[b][k], 2 * n);
        acc[n] += bf16_at(r.data[a][m], 2 * k + 1) * bf16_at(r.data[b][k], 2 * n + 1);
      }
    std::memcpy(r.data[c][m], acc, 64);
  }
}

// C.i32[m][n] += sum_k sum_{i<4} A.i8[m][4k+i] * B.i8[k][4n+i] (exact: int32 wraps as hardware).
inline void tile_dpbssd(int c, int a, int b) {
  TileRegs& r = dot_tiles(c, a, b, "tdpbssd");
  for (int m = 0; m < r.rows[c]; ++m) {
    uint32_t acc[16];
    std::memcpy(acc, r.data[c][m], 64);
    for (int k = 0; k < r.colsb[a] / 4; ++k)
      for (int n = 0; n < r.colsb[c] / 4; ++n)
        for (int i = 0; i < 4; ++i)
          acc[n] += uint32_t(int32_t(int8_t(r.data[a][m][4 * k + i])) * int32_t(int8_t(r.data[b][k][4 * n + i])));
    std::memcpy(r.data[c][m], acc, 64);
  }
}

}  // namespace qspec_emu

#undef _mm512_mask_loadu_ps
#define _mm512_mask_loadu_ps(src, k, p) qspec_emu::mask_loadu_ps(src, k, p)
#undef _mm512_maskz_loadu_ps
#define _mm512_maskz_loadu_ps(k, p) qspec_emu::maskz_loadu_ps(k, p)
#undef _mm512_mask_storeu_ps
#define _mm512_mask_storeu_ps(p, k, a) qspec_emu::mask_storeu_ps(p, k, a)
#undef _mm512_mask_storeu_epi32
#define _mm512_mask_storeu_epi32(p, k, a) qspec_emu::mask_storeu_epi32(p, k, a)
#undef _mm512_maskz_loadu_epi32
#define _mm512_maskz_loadu_epi32(k, p) qspec_emu::maskz_loadu_epi32(k, p)
#undef _mm512_cmpgt_epu32_mask
#define _mm512_cmpgt_epu32_mask(a, b) qspec_emu::cmpgt_epu32_mask(a, b)
#undef _mm512_cvtepi32_epi16
#define _mm512_cvtepi32_epi16(a) qspec_emu::cvtepi32_epi16(a)
#undef _mm512_cvtepi8_epi32
#define _mm512_cvtepi8_epi32(a) qspec_emu::widen_bytes<int8_t>(a)
#undef _mm512_cvtepu8_epi32
#define _mm512_cvtepu8_epi32(a) qspec_emu::widen_bytes<uint8_t>(a)
#undef _mm512_reduce_add_ps
#define _mm512_reduce_add_ps(a) qspec_emu::reduce_add_ps(a)

#undef _mm512_cvtne2ps_pbh
#define _mm512_cvtne2ps_pbh(a, b) qspec_emu::cvtne2ps_pbh(a, b)
#undef _mm512_dpbf16_ps
#define _mm512_dpbf16_ps(src, a, b) qspec_emu::dpbf16_ps(src, a, b)
#define _mm256_dpbusd_avx_epi32(src, a, b) _mm256_dpbusd_epi32(src, a, b)  // SIMDe's (AVX512VL + VNNI)

#undef _tile_loadconfig
#define _tile_loadconfig(cfg) qspec_emu::tile_loadconfig(cfg)
#undef _tile_release
#define _tile_release() qspec_emu::tile_release()
#undef _tile_zero
#define _tile_zero(t) qspec_emu::tile_zero(t)
#undef _tile_loadd
#define _tile_loadd(t, base, stride) qspec_emu::tile_loadd(t, base, stride)
#undef _tile_stored
#define _tile_stored(t, base, stride) qspec_emu::tile_stored(t, base, stride)
#undef _tile_dpbf16ps
#define _tile_dpbf16ps(c, a, b) qspec_emu::tile_dpbf16ps(c, a, b)
#undef _tile_dpbssd
#define _tile_dpbssd(c, a, b) qspec_emu::tile_dpbssd(c, a, b)
