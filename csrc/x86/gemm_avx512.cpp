// AVX-512 GEMM kernels (placeholder: the avx512 path runs the reference arithmetic, which it
// must match bit for bit anyway; avx512_bf16 / amx are not offered by gemm_supports yet).
#include "gemm_internal.h"

namespace qspec {
namespace detail {
void gemm_blocks_avx512(const GemmArgs& a, int64_t nb0, int64_t nb1, float* acc) {
  gemm_blocks_ref(a, nb0, nb1, acc);
}
void gemm_blocks_avx512_bf16(const GemmArgs& a, int64_t nb0, int64_t nb1, float* acc) {}
}  // namespace detail
}  // namespace qspec
