// AVX-512 attention for one (row, head). Placeholder: forwards to the scalar reference until
// the AVX-512F kernel lands (this file is compiled with AVX-512 flags; nothing here uses them).
#include "attention.h"

namespace qspec {
void attn_row_head_avx512(const AttnArgs& a, int64_t i, int64_t h, float* scratch) {
  attn_row_head_ref(a, i, h, scratch);
}
}  // namespace qspec
