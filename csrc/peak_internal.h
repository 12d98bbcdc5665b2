// Shared between csrc/peak.cpp (driver, bindings) and the ISA files csrc/x86/peak_*.cpp: the
// compute-peak probe's inner loops. Declarations only (an inline function here could be compiled
// with AVX-512 flags and be the copy baseline callers get).
#pragma once
#include <cstdint>

namespace qspec {
namespace detail {

// `steps` steps of independent multiply-add chains of the GEMM kernel family's instruction, all
// operands in registers (tiles), so nothing but the issue rate limits them. Each returns the FLOPs
// it did; `seed` feeds the operands so the compiler cannot fold the chains, `sink` gets a value of
// the results so it cannot drop them.
double peak_fma_avx2(int64_t steps, float seed, float* sink);     // 12 x vfmadd231ps ymm a step
double peak_fma_avx512(int64_t steps, float seed, float* sink);   // 16 x vfmadd231ps zmm
double peak_dpbf16_avx512(int64_t steps, float seed, float* sink);  // 16 x vdpbf16ps zmm
double peak_tdpbf16_amx(int64_t steps, float seed, float* sink);  // 4 x TDPBF16PS 16x16x32

}  // namespace detail
}  // namespace qspec
