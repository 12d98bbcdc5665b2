// AMX tile configuration shared by the AMX translation units (csrc/x86/*_amx.cpp) only: `static
// inline`, so each gets a private copy compiled with its own flags (gemm_internal.h says why).
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

namespace qspec {
namespace detail {
namespace amx {

// The 64-byte LDTILECFG operand, palette 1: per tile its row count and bytes per row.
struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// A zeroed palette-1 configuration for the caller to fill in.
static inline TileConfig tile_config() {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  return cfg;
}

static inline void load_tile_config(const TileConfig& cfg) {
  // GCC 12's _tile_loadconfig under-declares its memory input: without this barrier the
  // stores to cfg can be dropped as dead.
  asm volatile("" ::: "memory");
  _tile_loadconfig(&cfg);
}

// Every tile 16 rows x 64 bytes (the one configuration the BF16 kernels use). Their roles:
// tiles 0-3 C (16 x 16 fp32), 4-5 A (16 rows x 32 bf16), 6-7 B (16 pairs x 16 x 2 bf16).
static inline void configure_16x64() {
  TileConfig cfg = tile_config();
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  load_tile_config(cfg);
}

// The tile intrinsics take tile numbers as literal tokens (pasted into the asm), so numbers
// chosen at compile time are spelled out here. Internal linkage: a private copy per AMX unit.
namespace {

template <int T>
inline void tile_zero() {
  static_assert(T >= 0 && T < 4, "C tiles are 0-3");
  if constexpr (T == 0) _tile_zero(0);
  if constexpr (T == 1) _tile_zero(1);
  if constexpr (T == 2) _tile_zero(2);
  if constexpr (T == 3) _tile_zero(3);
}

template <int T>
inline void tile_load(const void* p, int64_t stride) {
  static_assert(T >= 0 && T < 8, "tiles are 0-7");
  if constexpr (T == 0) _tile_loadd(0, p, stride);
  if constexpr (T == 1) _tile_loadd(1, p, stride);
  if constexpr (T == 2) _tile_loadd(2, p, stride);
  if constexpr (T == 3) _tile_loadd(3, p, stride);
  if constexpr (T == 4) _tile_loadd(4, p, stride);
  if constexpr (T == 5) _tile_loadd(5, p, stride);
  if constexpr (T == 6) _tile_loadd(6, p, stride);
  if constexpr (T == 7) _tile_loadd(7, p, stride);
}

template <int T>
inline void tile_store(void* p, int64_t stride) {
  static_assert(T >= 0 && T < 4, "C tiles are 0-3");
  if constexpr (T == 0) _tile_stored(0, p, stride);
  if constexpr (T == 1) _tile_stored(1, p, stride);
  if constexpr (T == 2) _tile_stored(2, p, stride);
  if constexpr (T == 3) _tile_stored(3, p, stride);
}

// C += A · B (TDPBF16PS): C one of tiles 0-3, A and B two different tiles of 4-7.
template <int C, int A, int B>
inline void tile_dpbf16() {
  static_assert(C >= 0 && C < 4 && A >= 4 && A < 8 && B >= 4 && B < 8 && A != B, "tile roles");
#define QSPEC_TDP(c, a, b) \
  if constexpr (C == c && A == a && B == b) _tile_dpbf16ps(c, a, b);
#define QSPEC_TDP_AB(a, b) QSPEC_TDP(0, a, b) QSPEC_TDP(1, a, b) QSPEC_TDP(2, a, b) QSPEC_TDP(3, a, b)
  QSPEC_TDP_AB(4, 5) QSPEC_TDP_AB(4, 6) QSPEC_TDP_AB(4, 7) QSPEC_TDP_AB(5, 4) QSPEC_TDP_AB(5, 6) QSPEC_TDP_AB(5, 7)
  QSPEC_TDP_AB(6, 4) QSPEC_TDP_AB(6, 5) QSPEC_TDP_AB(6, 7) QSPEC_TDP_AB(7, 4) QSPEC_TDP_AB(7, 5) QSPEC_TDP_AB(7, 6)
#undef QSPEC_TDP_AB
#undef QSPEC_TDP
}

// f(integral_constant<int, 0>), ..., f(integral_constant<int, N-1>): compile-time tile numbers.
template <class F, int... I>
inline void unrolled(F&& f, std::integer_sequence<int, I...>) {
  (f(std::integral_constant<int, I>{}), ...);
}
template <int N, class F>
inline void unrolled(F&& f) {
  unrolled(f, std::make_integer_sequence<int, N>{});
}

}  // namespace

}  // namespace amx
}  // namespace detail
}  // namespace qspec
