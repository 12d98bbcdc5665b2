// AVX-512 attention over the draft copy of the KV cache (attention_q8_impl.h): head_dim loops
// 16 lanes wide (dot products, V accumulation, int8 -> FP32), the per-key steps on 8 lanes.
#define QSPEC_Q8_AVX512 1
#include "attention_q8_impl.h"

namespace qspec {

void attn_group_q8_avx512(const AttnArgs& a, int64_t kvh, int64_t u_begin, int64_t u_end, int64_t seg,
                          const AttnPartials& part) {
  q8_group<Lanes16>(a, kvh, u_begin, u_end, seg, part);
}

}  // namespace qspec
