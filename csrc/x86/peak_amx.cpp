// Compute-peak loop on AMX-BF16 tiles (compiled with the AMX flags; chosen at run time). Four C
// tiles each take A · B from two A and two B tiles loaded once: TDPBF16PS back to back, no loads.
#include <immintrin.h>

#include <cstdint>

#include "amx_tiles.h"
#include "peak_internal.h"

namespace qspec {
namespace detail {

double peak_tdpbf16_amx(int64_t steps, float seed, float* sink) {
  amx::configure_16x64();  // tile state is per thread
  alignas(64) uint16_t ab[16 * 32];
  uint32_t bits;
  const float v = seed * 1e-3f;
  __builtin_memcpy(&bits, &v, 4);
  for (auto& e : ab) e = uint16_t(bits >> 16);
  amx::tile_load<4>(ab, 64);
  amx::tile_load<5>(ab, 64);
  amx::tile_load<6>(ab, 64);
  amx::tile_load<7>(ab, 64);
  amx::tile_zero<0>();
  amx::tile_zero<1>();
  amx::tile_zero<2>();
  amx::tile_zero<3>();
  for (int64_t s = 0; s < steps; ++s) {
    amx::tile_dpbf16<0, 4, 6>();
    amx::tile_dpbf16<1, 4, 7>();
    amx::tile_dpbf16<2, 5, 6>();
    amx::tile_dpbf16<3, 5, 7>();
  }
  alignas(64) float c[16 * 16];
  amx::tile_store<0>(c, 64);
  float t = c[0];
  amx::tile_store<3>(c, 64);
  *sink = t + c[255];
  _tile_release();
  return double(steps) * 4 * 16 * 16 * 32 * 2;
}

}  // namespace detail
}  // namespace qspec
