// Shared between csrc/membw.cpp (driver, SSE2 baseline, bindings) and the ISA files
// csrc/x86/membw_*.cpp: the read-bandwidth probe's inner kernels. Declarations only (an inline
// function here could be compiled with AVX-512 flags and be the copy baseline callers get).
#pragma once
#include <cstdint>

namespace qspec {
namespace detail {

// Sum of the little-endian uint64 words of `streams` contiguous streams of `stream_bytes` each
// (stream s starts at p + s * stream_bytes; stream_bytes a multiple of 128; unaligned loads),
// read in lockstep, 128 bytes per stream per step, modulo 2^64: every width gives the same value.
// prefetch > 0: software prefetch that many bytes ahead in each stream.
uint64_t read_streams_sse2(const uint8_t* p, int64_t stream_bytes, int streams, int64_t prefetch);
uint64_t read_streams_avx2(const uint8_t* p, int64_t stream_bytes, int streams, int64_t prefetch);
uint64_t read_streams_avx512(const uint8_t* p, int64_t stream_bytes, int streams, int64_t prefetch);

constexpr int kMaxReadStreams = 16;

}  // namespace detail
}  // namespace qspec
