// AVX-512 attention over the draft copy of the KV cache with AVX512-VNNI (attention_q8_impl.h):
// the INT4 K scores' integer dot products by vpdpwssd, one instruction where the avx512 build
// needs vpmaddwd + an add. The sums are exact integers either way, so this build
// gives the avx512 one's bits (tests/test_draft_kv.py); chosen at run time by mx_vnni() (gemm.h).
#define QSPEC_Q8_AVX512 1
#define QSPEC_Q8_VNNI 1
#include "attention_q8_impl.h"

namespace qspec {

void attn_group_q8_avx512vnni(const AttnArgs& a, int64_t kvh, int64_t u_begin, int64_t u_end, int64_t seg,
                              const AttnPartials& part) {
  q8_group<Lanes16>(a, kvh, u_begin, u_end, seg, part);
}

}  // namespace qspec
