// AMX-BF16 GEMM kernels (placeholder, not offered by gemm_supports yet).
#include "gemm_internal.h"

namespace qspec {
namespace detail {
void gemm_blocks_amx(const GemmArgs& a, int64_t nb0, int64_t nb1, float* acc) {}
}  // namespace detail
}  // namespace qspec
