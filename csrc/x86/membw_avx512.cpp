// Read-bandwidth probe kernel with 64-byte (zmm) loads; compiled with the AVX-512 flags (chosen at
// run time; under QSPEC_ISA_EMULATION the intrinsics are emulated, so the tests check it anywhere).
// Everything here is static / anonymous-namespace except the entry point (membw_internal.h).
#include <immintrin.h>

#include <array>
#include <cstdint>
#include <utility>

#include "membw_internal.h"

namespace qspec {
namespace detail {
namespace {

// S streams in lockstep: per step 128 bytes of each (2 zmm loads), 4 accumulators.
template <int S>
uint64_t sum_s(const uint8_t* p, int64_t sb, int64_t prefetch) {
  __m512i a[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                  _mm512_setzero_si512()};
  for (int64_t off = 0; off < sb; off += 128) {
    for (int s = 0; s < S; ++s) {
      const uint8_t* q = p + s * sb + off;
      if (prefetch > 0) {
        _mm_prefetch(reinterpret_cast<const char*>(q + prefetch), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(q + prefetch + 64), _MM_HINT_T0);
      }
      a[(2 * s) & 3] = _mm512_add_epi64(a[(2 * s) & 3], _mm512_loadu_si512(q));
      a[(2 * s + 1) & 3] = _mm512_add_epi64(a[(2 * s + 1) & 3], _mm512_loadu_si512(q + 64));
    }
  }
  const __m512i t = _mm512_add_epi64(_mm512_add_epi64(a[0], a[1]), _mm512_add_epi64(a[2], a[3]));
  alignas(64) uint64_t w[8];
  _mm512_store_si512(w, t);
  uint64_t r = 0;
  for (int i = 0; i < 8; ++i) r += w[i];
  return r;
}

template <int... I>
constexpr auto table(std::integer_sequence<int, I...>) {
  using Fn = uint64_t (*)(const uint8_t*, int64_t, int64_t);
  return std::array<Fn, sizeof...(I)>{&sum_s<I + 1>...};
}

}  // namespace

uint64_t read_streams_avx512(const uint8_t* p, int64_t stream_bytes, int streams, int64_t prefetch) {
  static constexpr auto kFns = table(std::make_integer_sequence<int, kMaxReadStreams>{});
  return kFns[streams - 1](p, stream_bytes, prefetch);
}

}  // namespace detail
}  // namespace qspec
