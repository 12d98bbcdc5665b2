// Read-bandwidth probe kernel with 32-byte (ymm) loads; compiled with -mavx2 (chosen at run time).
// Everything here is static / anonymous-namespace except the entry point (membw_internal.h).
#include <immintrin.h>

#include <array>
#include <cstdint>
#include <utility>

#include "membw_internal.h"

namespace qspec {
namespace detail {
namespace {

// S streams in lockstep: per step 128 bytes of each (4 ymm loads), 4 accumulators (vpaddq has a
// latency of one cycle; the loads, not the adds, are the limit).
template <int S>
uint64_t sum_s(const uint8_t* p, int64_t sb, int64_t prefetch) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t off = 0; off < sb; off += 128) {
    for (int s = 0; s < S; ++s) {
      const uint8_t* q = p + s * sb + off;
      if (prefetch > 0) {
        _mm_prefetch(reinterpret_cast<const char*>(q + prefetch), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(q + prefetch + 64), _MM_HINT_T0);
      }
      const __m256i* v = reinterpret_cast<const __m256i*>(q);
      a0 = _mm256_add_epi64(a0, _mm256_loadu_si256(v + 0));
      a1 = _mm256_add_epi64(a1, _mm256_loadu_si256(v + 1));
      a2 = _mm256_add_epi64(a2, _mm256_loadu_si256(v + 2));
      a3 = _mm256_add_epi64(a3, _mm256_loadu_si256(v + 3));
    }
  }
  const __m256i t = _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3));
  alignas(32) uint64_t w[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(w), t);
  return w[0] + w[1] + w[2] + w[3];
}

template <int... I>
constexpr auto table(std::integer_sequence<int, I...>) {
  using Fn = uint64_t (*)(const uint8_t*, int64_t, int64_t);
  return std::array<Fn, sizeof...(I)>{&sum_s<I + 1>...};
}

}  // namespace

uint64_t read_streams_avx2(const uint8_t* p, int64_t stream_bytes, int streams, int64_t prefetch) {
  static constexpr auto kFns = table(std::make_integer_sequence<int, kMaxReadStreams>{});
  return kFns[streams - 1](p, stream_bytes, prefetch);
}

}  // namespace detail
}  // namespace qspec
