// Attention over the draft copy of the KV cache at the amx level (attention_q8_impl.h): the
// AVX-512 + VNNI kernel whose INT4 V pass runs on AMX-BF16 tiles (v4_btiles); INT8 copies and K
// as in attention_q8_avx512vnni.cpp.
#define QSPEC_Q8_AVX512 1
#define QSPEC_Q8_VNNI 1
#define QSPEC_Q8_AMX 1
#include "attention_q8_impl.h"

namespace qspec {

void attn_group_q8_amx(const AttnArgs& a, int64_t kvh, int64_t u_begin, int64_t u_end, int64_t seg,
                       const AttnPartials& part) {
  detail::amx::configure_16x64();  // tile state is per thread
  q8_group<Lanes16>(a, kvh, u_begin, u_end, seg, part);
  _tile_release();
}

}  // namespace qspec
