// AMX tile configuration shared by the AMX translation units (csrc/x86/*_amx.cpp) only: `static
// inline`, so each gets a private copy compiled with its own flags (gemm_internal.h says why).
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>

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

}  // namespace amx
}  // namespace detail
}  // namespace qspec
