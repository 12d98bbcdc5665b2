// AVX2 + FMA attention over the draft copy of the KV cache (attention_q8_impl.h, 8 lanes).
#include "attention_q8_impl.h"

namespace qspec {

void attn_group_q8_avx2(const AttnArgs& a, int64_t kvh, int64_t u_begin, int64_t u_end, int64_t seg,
                        const AttnPartials& part) {
  q8_group<Lanes8>(a, kvh, u_begin, u_end, seg, part);
}

}  // namespace qspec
