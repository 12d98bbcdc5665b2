// MXFP4 x Q8 activations with AVX-VNNI (compiled with AVX2 + FMA + F16C + AVX-VNNI; chosen at run
// time on the avx2 path from kAvxVnniRows rows when the CPU has AVX-VNNI: gemm.h). AVX-VNNI is the VEX
// form of vpdpbusd on ymm, without AVX-512: the servers that have it and no AVX-512 are Intel's
// E-core Xeons (Sierra Forest, Clearwater Forest), whose cores are the avx2 level here.
//
// The row tiles and their schedule are the vpmaddubsw kernel's (gemm_avx2.h, q4_rows with Vnni =
// true): per row and half-slab one vpdpbusd instead of a vpmaddubsw, an int16 add and a share of
// the widening vpmaddwd. The integer block sums are exact either way, so this path computes
// ref's isum and its fp32 epilogue: bit-identical to ref, avx2 and avx512 (gemm.h) at any M.
// Tested against ref on a Sapphire Rapids VM at the avx2 level (it has AVX-VNNI) and under
// emulation (tests/test_isa_emulation.py: SIMDe's vpdpbusd on ymm).
#include "gemm_avx2.h"

namespace qspec {
namespace detail {

void gemm_blocks_q4_avxvnni(const GemmArgs& args, int64_t nb0, int64_t nb1, float* acc) {
  GemmArgs a = args;
  if (a.prefetch == 0) a.prefetch = avx2::kMxPrefetch;
  avx2::q4_blocks<true>(a, nb0, nb1, acc);
}

}  // namespace detail
}  // namespace qspec
