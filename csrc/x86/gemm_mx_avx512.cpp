// AVX-512 kernels of the MX formats other than MXFP4 (compiled with the avx512 level's flags,
// chosen at run time through gemm_blocks_avx512):
//   kQ6                  MXFP6-E2M3 at 6 bits: Q8 activations, exact integer dots per block
//   kF16Shl/kF16Sra/kI8  one byte per code (E3M2 / E5M2, E4M3, MXINT8): fp32 FMA chains
// Each output element is computed exactly as `ref` computes it (gemm.h), so these paths are
// bit-identical to ref and avx2 whatever M, the tile shape or the thread count. The weights of a
// tile are decoded once for all its rows of x (up to 16 rows for the byte formats, 8 for kQ6),
// so small M costs little more decode than M = 1.
// Everything here is static / anonymous-namespace except the entry point (gemm_internal.h).
#include <immintrin.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <utility>

#include "gemm_avx512.h"
#include "gemm_internal.h"

namespace qspec {
namespace detail {
namespace {

using avx512::acc_row;
using avx512::e8m0x16;
using avx512::store_rows;

// ----------------------------------------------------------------------------- one byte per code
// Two k of a row block (32 bytes: the 16 rows of k, then of k+1) -> two vectors of 16 rows, fp32,
// exactly as ref_element. fp16 kinds: vpermq moves rows 0-7 of both k to the low lane and rows
// 8-15 to the high lane, so unpacking under a zero byte yields code << 8 in row order, k from the
// low unpack and k+1 from the high one; then one vcvtph2ps per k.
template <int KIND>
inline void decode_pair(const uint8_t* p, __m512& v0, __m512& v1) {
  if (KIND == kI8) {
    v0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    v1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
    return;
  }
  const __m256i v = _mm256_permute4x64_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), 0xD8);
  __m256i h0 = _mm256_unpacklo_epi8(_mm256_setzero_si256(), v);
  __m256i h1 = _mm256_unpackhi_epi8(_mm256_setzero_si256(), v);
  if (KIND == kF16Sra) {  // (code << 8) >>arith 1, bit 14 cleared
    const __m256i keep = _mm256_set1_epi16(int16_t(0xBFFF));
    h0 = _mm256_and_si256(_mm256_srai_epi16(h0, 1), keep);
    h1 = _mm256_and_si256(_mm256_srai_epi16(h1, 1), keep);
  }
  v0 = _mm512_cvtph_ps(h0);
  v1 = _mm512_cvtph_ps(h1);
}

// MB rows of x x NB row blocks. Per 32-k block every (row, block) pair holds one FMA chain over k
// ascending (MB * NB independent chains cover the FMA latency), then y = fma(blk * f, scale, y)
// in the scratch columns j*16..j*16+15. Each k pair is decoded once for all MB rows.
template <int KIND, int MB, int NB>
void fp_tile(const GemmArgs& a, int64_t nb, int64_t m0, int64_t k0, int64_t k1, float* acc, bool init) {
  acc = acc_row(acc, m0);  // rows from the tile's first: see acc_row
  const int64_t kb = a.kp / kKBlk;
  if (init)
    for (int i = 0; i < MB; ++i) std::memset(acc_row(acc, i), 0, NB * kRows * 4);
  const uint8_t* w[NB];
  const uint8_t* s[NB];
  for (int j = 0; j < NB; ++j) {
    w[j] = a.data + (nb + j) * a.kp * kRows;
    s[j] = a.scales + (nb + j) * kb * kRows;
  }
  const float* x[MB];
  for (int i = 0; i < MB; ++i) x[i] = a.x + (m0 + i) * a.ldx;
  const __m512 f = _mm512_set1_ps(a.elem_factor);
  for (int64_t b = k0 / kKBlk; b < k1 / kKBlk; ++b) {
    __m512 c[MB][NB];
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < NB; ++j) c[i][j] = _mm512_setzero_ps();
    for (int64_t k4 = b * kKBlk; k4 < (b + 1) * kKBlk; k4 += 4) {  // one 64-byte line per stream
      for (int j = 0; j < NB; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(w[j] + k4 * kRows + a.prefetch), _MM_HINT_T0);
      for (int64_t k = k4; k < k4 + 4; k += 2) {
        __m512 v[NB][2];
        for (int j = 0; j < NB; ++j) decode_pair<KIND>(w[j] + k * kRows, v[j][0], v[j][1]);
        for (int i = 0; i < MB; ++i) {
          const __m512 x0 = _mm512_set1_ps(x[i][k]);
          for (int j = 0; j < NB; ++j) c[i][j] = _mm512_fmadd_ps(v[j][0], x0, c[i][j]);
          const __m512 x1 = _mm512_set1_ps(x[i][k + 1]);
          for (int j = 0; j < NB; ++j) c[i][j] = _mm512_fmadd_ps(v[j][1], x1, c[i][j]);
        }
      }
    }
    for (int j = 0; j < NB; ++j) {
      const __m512 d = e8m0x16(s[j] + b * kRows);
      for (int i = 0; i < MB; ++i) {
        float* pa = acc_row(acc, i) + j * kRows;
        _mm512_storeu_ps(pa, _mm512_fmadd_ps(_mm512_mul_ps(c[i][j], f), d, _mm512_loadu_ps(pa)));
      }
    }
  }
}

// ----------------------------------------------------------------------------- MXFP6 E2M3 (Q8)
// One zmm per slab (16 rows x 4 k, 64 codes): the 32 nibble bytes broadcast to both halves, the
// high half shifted right by 4, so byte lane L is row L/4, k L%4 (rows 0-7 from the low nibbles,
// 8-15 from the high ones), the vpmaddubsw / vpmaddwd order. The 32-byte plane, broadcast the
// same way, gives per byte lane two mask bits (vptestmb): e1 selects the magnitude LUT (16 + 2m,
// 32 + 4m) over the nibble itself (8 * value when e1 = 0), the sign negates that lane's
// activation byte (|q| <= 127). Element * 8 is an integer in [0, 60] times the sign, so a
// vpmaddubsw pair is <= 2*60*127 = 15240 and the two slabs of a pair summed in int16 <= 30480:
// exact. The weight side (5 instructions per slab) is shared by the MB rows of x.
template <int MB>
void q6_tile(const GemmArgs& a, int64_t nb, int64_t m0, int64_t k0, int64_t k1, float* acc, bool init) {
  acc = acc_row(acc, m0);  // rows from the tile's first: see acc_row
  const int64_t kb = a.kp / kKBlk;
  if (init)
    for (int i = 0; i < MB; ++i) std::memset(acc_row(acc, i), 0, kRows * 4);
  const uint8_t* w = a.data + nb * kb * kQ6BlockBytes;
  const uint8_t* s = a.scales + nb * kb * kRows;
  const int8_t* q[MB];
  for (int i = 0; i < MB; ++i) q[i] = a.xq + (m0 + i) * a.kp;
  const __m512i lut1 = _mm512_broadcast_i32x4(_mm_setr_epi8(16, 18, 20, 22, 24, 26, 28, 30, 32, 36, 40, 44, 48, 52, 56, 60));
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512i ones = _mm512_set1_epi16(1);
  const __m512i zero = _mm512_setzero_si512();
  const __m512i high_nibbles = _mm512_inserti64x4(zero, _mm256_set1_epi16(4), 1);  // per-word shift counts
  // Plane bits of vector t = 2*sp + h (gemm_internal.h): e1 at bit 7-t, sign at bit 3-t.
  auto per_half = [](int lo, int hi) { return _mm512_inserti64x4(_mm512_set1_epi8(char(lo)), _mm256_set1_epi8(char(hi)), 1); };
  const __m512i e1_bit[2] = {per_half(0x80, 0x40), per_half(0x20, 0x10)};
  const __m512i sign_bit[2] = {per_half(0x08, 0x04), per_half(0x02, 0x01)};
  for (int64_t b = k0 / kKBlk; b < k1 / kKBlk; ++b) {
    __m512i isum[MB];
    for (int p = 0; p < 4; ++p) {
      const uint8_t* pair = w + b * kQ6BlockBytes + p * kQ6PairBytes;
      if (p % 2 == 0) {  // the 3 lines of two pairs
        const char* pf = reinterpret_cast<const char*>(pair + a.prefetch);
        _mm_prefetch(pf, _MM_HINT_T0);
        _mm_prefetch(pf + 64, _MM_HINT_T0);
        _mm_prefetch(pf + 128, _MM_HINT_T0);
      }
      const __m512i plane = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(pair + 64)));
      __m512i mag[2];
      __mmask64 neg[2];
      for (int sp = 0; sp < 2; ++sp) {
        const __m512i nib = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(pair + sp * 32)));
        const __m512i idx = _mm512_and_si512(_mm512_srlv_epi16(nib, high_nibbles), low4);
        mag[sp] = _mm512_mask_shuffle_epi8(idx, _mm512_test_epi8_mask(plane, e1_bit[sp]), lut1, idx);
        neg[sp] = _mm512_test_epi8_mask(plane, sign_bit[sp]);
      }
      for (int i = 0; i < MB; ++i) {
        int32_t q0, q1;  // the 4 activation bytes of each slab's k
        std::memcpy(&q0, q[i] + b * kKBlk + p * 8, 4);
        std::memcpy(&q1, q[i] + b * kKBlk + p * 8 + 4, 4);
        const __m512i x0 = _mm512_set1_epi32(q0), x1 = _mm512_set1_epi32(q1);
        const __m512i p0 = _mm512_maddubs_epi16(mag[0], _mm512_mask_sub_epi8(x0, neg[0], zero, x0));
        const __m512i p1 = _mm512_maddubs_epi16(mag[1], _mm512_mask_sub_epi8(x1, neg[1], zero, x1));
        const __m512i s32 = _mm512_madd_epi16(_mm512_add_epi16(p0, p1), ones);
        isum[i] = p == 0 ? s32 : _mm512_add_epi32(isum[i], s32);
      }
    }
    const __m512 d = e8m0x16(s + b * kRows);
    for (int i = 0; i < MB; ++i) {
      const __m512 xd = _mm512_set1_ps(a.xd[(m0 + i) * kb + b] * a.elem_factor);
      float* pa = acc_row(acc, i);
      _mm512_storeu_ps(pa, _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[i]), _mm512_mul_ps(d, xd), _mm512_loadu_ps(pa)));
    }
  }
}

// ----------------------------------------------------------------------------- driver
using avx512::TileFn;

constexpr int kFpMaxMB = 16, kFpMaxNB = 4, kQ6MaxMB = 8;

// Row blocks per tile of MB rows: at least 8 independent FMA chains (MB * NB) from two rows of x
// on, 4 with one row (whose decode work per k pair already spans the FMA latency), at most 16
// accumulators, and the fewest weight streams that achieve that.
constexpr int fp_blocks_for(int mb) { return mb <= 3 ? 4 : mb <= 7 ? 2 : 1; }

template <int KIND, int I>
constexpr TileFn fp_entry() {
  constexpr int mb = I / kFpMaxNB + 1, nbn = I % kFpMaxNB + 1;
  if constexpr (nbn <= fp_blocks_for(mb)) return fp_tile<KIND, mb, nbn>;
  else return nullptr;
}
template <int KIND, int... I>
constexpr std::array<TileFn, sizeof...(I)> fp_tiles(std::integer_sequence<int, I...>) {
  return {fp_entry<KIND, I>()...};
}
template <int MB> void q6_fn(const GemmArgs& a, int64_t nb, int64_t m0, int64_t k0, int64_t k1, float* acc, bool init) {
  q6_tile<MB>(a, nb, m0, k0, k1, acc, init);
}
template <int... I>
constexpr std::array<TileFn, sizeof...(I)> q6_tiles(std::integer_sequence<int, I...>) {
  return {q6_fn<I + 1>...};
}

constexpr auto kShlTiles = fp_tiles<kF16Shl>(std::make_integer_sequence<int, kFpMaxMB * kFpMaxNB>());
constexpr auto kSraTiles = fp_tiles<kF16Sra>(std::make_integer_sequence<int, kFpMaxMB * kFpMaxNB>());
constexpr auto kI8Tiles = fp_tiles<kI8>(std::make_integer_sequence<int, kFpMaxMB * kFpMaxNB>());
constexpr auto kQ6Tiles = q6_tiles(std::make_integer_sequence<int, kQ6MaxMB>());

}  // namespace

void gemm_blocks_mx_avx512(const GemmArgs& args, int64_t nb0, int64_t nb1, float* acc) {
  GemmArgs a = args;
  if (a.prefetch == 0) a.prefetch = a.kind == kQ6 ? 4096 : 1024;
  if (a.kind == kQ6) {
    avx512::run_row_tiles(a, nb0, nb1, acc, kQ6Tiles.data(), 1, kQ6MaxMB, 1, kQ6BlockBytes / kKBlk, 1);
    return;
  }
  const TileFn* table = a.kind == kF16Shl ? kShlTiles.data() : a.kind == kF16Sra ? kSraTiles.data() : kI8Tiles.data();
  const int nbmax = fp_blocks_for(a.m < kFpMaxMB ? int(a.m) : kFpMaxMB);
  avx512::run_row_tiles(a, nb0, nb1, acc, table, kFpMaxNB, kFpMaxMB, nbmax, kRows, 4);
}

}  // namespace detail
}  // namespace qspec
