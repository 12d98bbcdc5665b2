// AMX-BF16 GEMM for prefill (gemm_supports: BF16 weights, M > 64). x is rounded to bf16 by the
// driver into [mpad][kp] (mpad = M rounded up to 16, zero rows). The packed BF16 layout is
// already the B-tile layout: one row block and 32 k = 16 rows of 64 bytes (k pair x 16 columns).
// C = 2 x 2 tiles of 16 x 16 fp32 per step; each output element accumulates over k in tile
// order, independent of the other rows (batch invariant within this path).
// Not yet run on AMX hardware: tested against ref under emulation (tests/test_isa_emulation.py,
// software tiles per the SDM pseudo-code), which checks the code, not TDPBF16PS's rounding.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "gemm_internal.h"

namespace qspec {
namespace detail {
namespace {

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles 0-3: C (16 x 16 fp32), 4-5: A (16 rows x 32 bf16), 6-7: B (16 k pairs x 16 x 2 bf16).
void configure_tiles() {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  // GCC 12's _tile_loadconfig under-declares its memory input: without this barrier the
  // stores to cfg above can be dropped as dead.
  asm volatile("" ::: "memory");
  _tile_loadconfig(&cfg);
}

inline void store_tile_rows(const GemmArgs& a, const float* c, int64_t m0, int64_t n0) {
  for (int64_t r = 0; r < 16 && m0 + r < a.m; ++r) {
    const int64_t cols = a.n - n0 < 16 ? a.n - n0 : 16;
    if (cols > 0) std::memcpy(a.y + (m0 + r) * a.ldy + n0, c + r * 16, size_t(cols) * 4);
  }
}

// NA row tiles of x (16 rows each) x NBB row blocks of W (16 columns of y each).
template <int NA, int NBB>
void amx_step(const GemmArgs& a, int64_t nb, int64_t m0) {
  const uint8_t* xa = reinterpret_cast<const uint8_t*>(a.xbf);
  const int64_t xstride = a.kp * 2;  // bytes per row of x
  _tile_zero(0);
  if (NBB > 1) _tile_zero(1);
  if (NA > 1) _tile_zero(2);
  if (NA > 1 && NBB > 1) _tile_zero(3);
  for (int64_t k0 = 0; k0 < a.kp; k0 += 32) {
    const uint8_t* b0 = a.data + ((nb * (a.kp / 2)) + k0 / 2) * 64;
    _tile_loadd(4, xa + m0 * xstride + k0 * 2, xstride);
    _tile_loadd(6, b0, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (NBB > 1) {
      _tile_loadd(7, b0 + a.kp * 32, 64);  // next row block: kp/2 pairs x 64 bytes further
      _tile_dpbf16ps(1, 4, 7);
    }
    if (NA > 1) {
      _tile_loadd(5, xa + (m0 + 16) * xstride + k0 * 2, xstride);
      _tile_dpbf16ps(2, 5, 6);
      if (NBB > 1) _tile_dpbf16ps(3, 5, 7);
    }
  }
  alignas(64) float c[16 * 16];
  _tile_stored(0, c, 64);
  store_tile_rows(a, c, m0, nb * kRows);
  if (NBB > 1) {
    _tile_stored(1, c, 64);
    store_tile_rows(a, c, m0, (nb + 1) * kRows);
  }
  if (NA > 1) {
    _tile_stored(2, c, 64);
    store_tile_rows(a, c, m0 + 16, nb * kRows);
    if (NBB > 1) {
      _tile_stored(3, c, 64);
      store_tile_rows(a, c, m0 + 16, (nb + 1) * kRows);
    }
  }
}

}  // namespace

void gemm_blocks_amx(const GemmArgs& a, int64_t nb0, int64_t nb1, float* acc) {
  configure_tiles();  // tile state is per thread: every OpenMP thread configures its own
  for (int64_t nb = nb0; nb < nb1; nb += 2) {
    const bool two_b = nb + 1 < nb1;
    for (int64_t m0 = 0; m0 < a.mpad; m0 += 32) {
      const bool two_a = m0 + 16 < a.mpad;
      if (two_a && two_b) amx_step<2, 2>(a, nb, m0);
      else if (two_a) amx_step<2, 1>(a, nb, m0);
      else if (two_b) amx_step<1, 2>(a, nb, m0);
      else amx_step<1, 1>(a, nb, m0);
    }
  }
  _tile_release();
}

}  // namespace detail
}  // namespace qspec
