// Attention over the draft copy of the KV cache (csrc/kv_q8.h: INT8 or INT4), for the MX draft passes.
// Included by exactly one translation unit per build (attention_q8_avx2.cpp, _avx512.cpp,
// _avx512vnni.cpp, _amx.cpp) and wrapped in an anonymous namespace, so each gets a private copy
// compiled for its flags. `T` is the vector width of the head_dim loops (score dot products, V
// accumulation): 8 lanes (AVX2) or 16 (AVX-512); the per-key reductions, max, exp and Σ run on
// 8-lane AVX2 vectors.
//
// One call computes pairs [u0, u1) of one KV head over one fixed key segment (attention.h), the
// three passes of attention.cpp:
//   1. keys in blocks of 8 counted from key 0, dequantized into an FP32 block (natural order,
//      shared by every pair of the call; exactly, but INT4 K: center + q · scale in one FMA, and
//      the BF16 K row of a page whose group is not written yet); per key ONE T-wide FMA chain
//      over head_dim (d = 0, W, 2W, ..), folded to 8 lanes (AVX-512: low half + high half), then
//      the fixed tree ((x0+x1)+(x2+x3))+((x4+x5)+(x6+x7)); · scale; lane-wise running max.
//      The AVX-512 builds score a written INT4 K group's keys by integer dot products instead
//      (k4_table: q · scale rounded to int16 once per pair and group), a block's shared keys 16
//      at a time for all its pairs (k4_scores16) and other keys 8 at a time per pair (k4_dot8);
//   2. exp(s - max), Σ as 8 lane-wise partial sums over the segment's 8-key blocks, fixed tree;
//   3. per output column ONE FMA chain over the keys in order, then · (1/Σ) or the partial for
//      the driver's in-order segment merge (INT4 V: the sums rotated back, after the merge). The
//      amx build runs an INT4 V pass on AMX-BF16 tiles instead (v4_btiles).
// Windows (a sliding-window layer; the draft window with its sinks, AttnArgs::sink_keys): a pair
// attends keys [0, gap) and [lo, p] (attn_gap_lo, attn_key_lo); blocks wholly inside [gap, lo) are
// skipped for it (and not dequantized when every pair skips them), the rest of the gap gets -inf
// scores before the max (attn_gap_max), and a segment with no attended key leaves no partial.
// Every lane of a key block depends only on that key (keys past a pair's p are computed from the
// zero-padded or shared block and dropped), so a pair's result depends only on its q and p: not
// on m, the other rows, the grouping or the thread count. Tree rows gather their keys after the
// shared prefix (rounded down to 8) from their slots into a block of the same form, continuing
// the same 8-key blocks and chains: a tree row equals the linear row over its path, in bits.
#pragma once
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "attention.h"
#include "vec_avx2.h"
#ifdef QSPEC_Q8_AVX512
#include "vec_avx512.h"
#endif
#ifdef QSPEC_Q8_AMX
#include "amx_tiles.h"
#endif

namespace qspec {
namespace {

struct PairBounds {  // one pair of a q8_group call: attn_row_pos + 1 (n_full), attn_key_lo, attn_gap_lo, attn_recent_lo
  int64_t row, head, n_full, lo, gap, rec;
};

struct Lanes8 {
  using V = __m256;
  static constexpr int W = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V i8(const int8_t* p) {  // 8 int8 -> 8 FP32 (exact)
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static V i4(const int8_t* p);  // 8 INT4 (4 bytes, element 2i in the low nibble of byte i) -> FP32 (exact)
  static __m256 fold(V v) { return v; }
};

#ifdef QSPEC_Q8_AVX512
struct Lanes16 {
  using V = __m512;
  static constexpr int W = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V i8(const int8_t* p) {  // 16 int8 -> 16 FP32 (exact)
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static V i4(const int8_t* p) {  // 16 INT4 (8 bytes) -> 16 FP32 (exact): each byte twice, then its nibbles
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    const __m512i d = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(b, b));
    const __m512i sh = _mm512_set_epi32(24, 28, 24, 28, 24, 28, 24, 28, 24, 28, 24, 28, 24, 28, 24, 28);
    return _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_sllv_epi32(d, sh), 28));
  }
  static __m256 fold(V v) {  // lane l + lane l + 8
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  }
};
#endif

inline __m128 q8_tree4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
}

inline int64_t q8_round8(int64_t x) { return (x + 7) & ~int64_t(7); }

inline __m256 Lanes8::i4(const int8_t* p) {
  int32_t w;
  std::memcpy(&w, p, 4);
  const __m256i c = _mm256_sllv_epi32(_mm256_set1_epi32(w), _mm256_setr_epi32(28, 24, 20, 16, 12, 8, 4, 0));
  return _mm256_cvtepi32_ps(_mm256_srai_epi32(c, 28));
}

// kv_q4_scale of 8 scale bytes: the value's bits are (e << 20) + (111 << 23) for e in [1, 254].
inline __m256 q4_scales8(const uint8_t* e) {
  const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(e)));
  const __m256i bits = _mm256_add_epi32(_mm256_slli_epi32(v, 20), _mm256_set1_epi32(111 << 23));
  const __m256i zero = _mm256_cmpeq_epi32(v, _mm256_setzero_si256());
  const __m256i nan = _mm256_cmpeq_epi32(v, _mm256_set1_epi32(0xFF));
  return _mm256_castsi256_ps(_mm256_blendv_epi8(_mm256_andnot_si256(zero, bits), _mm256_set1_epi32(0x7FC00000), nan));
}

// hd BF16 values -> FP32 (exact).
inline void bf16_row_f32(const uint16_t* k, int64_t hd, float* dst) {
  for (int64_t c = 0; c < hd; c += 8) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(k + c)));
    _mm256_storeu_ps(dst + c, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
  }
}

// K group g's centers and scales of head kvh (kv_q8.h, kv_k4_group) as FP32.
inline void k4_params(const AttnArgs& a, int64_t kvh, int64_t g, float* cen, float* scl) {
  const int64_t hd = a.kv.head_dim;
  const uint8_t* ph = a.kv.k_group_params(a.layer, g) + kvh * 3 * hd;
  for (int64_t c = 0; c < hd; c += 8) {
    const __m256i b = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ph + 2 * c)));
    _mm256_storeu_ps(cen + c, _mm256_castsi256_ps(_mm256_slli_epi32(b, 16)));
    _mm256_storeu_ps(scl + c, q4_scales8(ph + 2 * hd + c));
  }
}

// One key's INT4 K row of its group (kv_q8.h, kv_k4_group): center + q · scale per column, with
// the group's centers and scales of this head in cen / scl (FP32).
template <class T>
inline void k4_row(const int8_t* q, const float* cen, const float* scl, int64_t hd, float* dst) {
  for (int64_t c = 0; c < hd; c += T::W) T::store(dst + c, T::fma(T::i4(q + c / 2), T::load(scl + c), T::load(cen + c)));
}

// Logical keys [j0, j0 + nk) of query row `row` (cache slots by attn_key_slot), KV head kvh,
// K (kv_index 0) or V (1), dequantized into dst rows 0..nk-1 (keys from bf_from on: their BF16
// rows, the row's recent keys); rows nk..nfill-1 are zeroed.
template <class T>
void q8_dequant(const AttnArgs& a, int kv_index, int64_t kvh, int64_t row, int64_t j0, int64_t nk,
                int64_t nfill, int64_t bf_from, float* dst) {
  const int64_t hd = a.kv.head_dim;
  const bool k4 = kv_index == 0 && a.kv.k_bits == 4;
  alignas(64) float cen[512], scl[512];  // k4: the current group's params (head_dim <= 512)
  int64_t cur = -1;
  for (int64_t t = 0; t < nk; ++t) {
    const int64_t slot = attn_key_slot(a, row, j0 + t);
    if (j0 + t >= bf_from) {
      bf16_row_f32((kv_index ? a.kv.v(a.layer, slot) : a.kv.k(a.layer, slot)) + kvh * hd, hd, dst + t * hd);
      continue;
    }
    if (k4) {
      const int64_t g = a.kv.k_group_row(a.kv.slot(slot));
      if (!a.kv.k_final[g]) {  // the group's copy is not written yet: the BF16 row
        bf16_row_f32(a.kv.k(a.layer, slot) + kvh * hd, hd, dst + t * hd);
        continue;
      }
      if (g != cur) {
        cur = g;
        k4_params(a, kvh, g, cen, scl);
      }
      k4_row<T>(a.kv.q8_row(a.layer, 0, slot) + kvh * hd / 2, cen, scl, hd, dst + t * hd);
      continue;
    }
    const uint8_t* e = a.kv.q8_scales(a.layer, kv_index, slot) + kvh * (hd / kQ8Block);
    if (kv_index == 1 && a.kv.v_bits == 4) {
      const int8_t* q = a.kv.q8_row(a.layer, kv_index, slot) + kvh * hd / 2;
      for (int64_t b = 0; b < hd; b += kQ8Block) {
        const typename T::V s = T::set1(kv_q4_scale(e[b / kQ8Block]));
        for (int64_t c = 0; c < kQ8Block; c += T::W) T::store(dst + t * hd + b + c, T::mul(T::i4(q + (b + c) / 2), s));
      }
      continue;
    }
    const int8_t* q = a.kv.q8_row(a.layer, kv_index, slot) + kvh * hd;
    for (int64_t b = 0; b < hd; b += kQ8Block) {
      const typename T::V s = T::set1(kv_q8_scale(e[b / kQ8Block]));
      for (int64_t c = 0; c < kQ8Block; c += T::W) T::store(dst + t * hd + b + c, T::mul(T::i8(q + b + c), s));
    }
  }
  for (int64_t x = nk * hd; x < nfill * hd; x += T::W) T::store(dst + x, T::zero());
}

// Lane t = q·K_t (unscaled) for the 8 keys of block kb (rows of hd floats).
template <class T>
inline __m256 q8_dot8(const float* qp, const float* kb, int64_t hd) {
  typename T::V acc[8];
  for (int t = 0; t < 8; ++t) acc[t] = T::zero();
  for (int64_t d = 0; d < hd; d += T::W) {
    const typename T::V qv = T::load(qp + d);
    for (int t = 0; t < 8; ++t) acc[t] = T::fma(qv, T::load(kb + t * hd + d), acc[t]);
  }
  __m256 f[8];
  for (int t = 0; t < 8; ++t) f[t] = T::fold(acc[t]);
  return _mm256_set_m128(q8_tree4(f[4], f[5], f[6], f[7]), q8_tree4(f[0], f[1], f[2], f[3]));
}

#ifdef QSPEC_Q8_AVX512
// INT4 K scores as integer dot products (AVX-512 builds). A written group's key is
// center + v · scale per channel (v in [-7, 7]), so q·k = q·center + Σ_c (q_c · scale_c) · v_c: per
// pair and group, q' = q ⊙ scale is rounded once to int16 (k4_table: qi = round-half-even(q' ·
// (32767 / max|q'|)), δ = max|q'| / 32767, both FP32), and each key's score is the exact integer
// Σ qi · v, then fma(that, δ, q·center). Per key this needs the row's 64 bytes as 128 int16, not a
// dequantized FP32 row: four vpdpwssd (vpmaddwd + an add without VNNI: the same exact sums) per
// key and pair for head_dim 128, where FP32 needs eight FMAs and the dequantization. The only
// error beyond the copy's own is q' rounding: |Δ score| <= δ / 2 · Σ_c |v_c| <= 7 · head_dim · δ / 2.
// (Rounding q' to int8 instead cost the drafts acceptance at 8k tokens: 0.813 -> 0.754 at K = 4.)
// tests/test_draft_kv.py holds each path to a float64 model of exactly this arithmetic. A score
// depends only on q, the key's row and its group's params: not on the block, pair or row mix.
inline __m512i k4_dot_step(__m512i acc, __m512i k, __m512i q) {
#ifdef QSPEC_Q8_VNNI
  return _mm512_dpwssd_epi32(acc, k, q);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(k, q));
#endif
}

// One pair's q against one written K group: qi (head_dim int16, even channels first, then odd),
// δ (NaN when q' is not finite: a NaN scale marks a channel that held one) and q·center.
struct K4Table {
  int64_t group = -1;
  float delta = 0.f, qc = 0.f;
  int32_t corr = 0;  // 8 · Σ qi (k4_table_bytes)
};

// 16 int32 in [-32767, 32767] -> 16 int16, in order (vpmovdw, from AVX2 packs).
inline __m256i k4_words16(__m512i v) {
  const __m256i w = _mm256_packs_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
  return _mm256_permute4x64_epi64(w, 0xD8);  // qwords 0, 2, 1, 3
}

inline void k4_table(const float* q, const float* cen, const float* scl, int64_t hd, int64_t g, K4Table& t,
                     int16_t* qi) {
  alignas(64) float qp[512];
  __m512 amax = _mm512_setzero_ps(), qc = _mm512_setzero_ps();
  __mmask16 bad = 0;
  for (int64_t c = 0; c < hd; c += 16) {
    const __m512 qv = _mm512_loadu_ps(q + c);
    const __m512 p = _mm512_mul_ps(qv, _mm512_loadu_ps(scl + c));
    _mm512_store_ps(qp + c, p);
    const __m512 ab = _mm512_abs_ps(p);
    bad |= _mm512_cmp_ps_mask(ab, _mm512_set1_ps(3.4028235e38f), _CMP_NLE_UQ);  // NaN or Inf
    amax = _mm512_max_ps(amax, ab);
    qc = _mm512_fmadd_ps(qv, _mm512_loadu_ps(cen + c), qc);
  }
  t.group = g;
  t.qc = avx2::hsum(Lanes16::fold(qc));
  const float mx = _mm512_reduce_max_ps(amax);
  if (bad || mx == 0.f) {
    t.delta = bad ? __builtin_nanf("") : 0.f;
    std::memset(qi, 0, size_t(hd) * 2);
    return;
  }
  t.delta = mx / 32767.f;
  const __m512 inv = _mm512_set1_ps(32767.f / mx);
  const __m512i ev = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i od = _mm512_add_epi32(ev, _mm512_set1_epi32(1));
  for (int64_t c = 0; c < hd; c += 32) {  // channels c .. c + 31: 16 even, 16 odd
    const __m512 lo = _mm512_load_ps(qp + c), hi = _mm512_load_ps(qp + c + 16);
    const __m512i ie = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_permutex2var_ps(lo, ev, hi), inv));
    const __m512i io = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_permutex2var_ps(lo, od, hi), inv));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qi + c / 2), k4_words16(ie));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qi + hd / 2 + c / 2), k4_words16(io));
  }
}

// A written key's INT4 K row (hd / 2 bytes, two's complement nibbles) as head_dim int16 in
// k4_table's order (even channels, then odd).
inline void k4_unpack(const int8_t* src, int64_t hd, int16_t* dst) {
  const int64_t half = hd / 2;  // a multiple of 16
  int64_t i = 0;
  for (; i + 32 <= half; i += 32) {  // v = (nibble ^ 8) - 8
    const __m256i m = _mm256_set1_epi8(0x0F), eight = _mm256_set1_epi8(8);
    const __m256i b = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)),
                                       _mm256_set1_epi8(int8_t(0x88)));
    const __m256i lo = _mm256_sub_epi8(_mm256_and_si256(b, m), eight);
    const __m256i hi = _mm256_sub_epi8(_mm256_and_si256(_mm256_srli_epi16(b, 4), m), eight);
    _mm512_storeu_si512(dst + i, _mm512_cvtepi8_epi16(lo));
    _mm512_storeu_si512(dst + half + i, _mm512_cvtepi8_epi16(hi));
  }
  if (i < half) {  // 16 bytes left
    const __m128i m = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
    const __m128i b = _mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)), _mm_set1_epi8(int8_t(0x88)));
    const __m128i lo = _mm_sub_epi8(_mm_and_si128(b, m), eight);
    const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(b, 4), m), eight);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm256_cvtepi8_epi16(lo));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + half + i), _mm256_cvtepi8_epi16(hi));
  }
}

// Σ k · qi over head_dim int16 (a multiple of 32), as 16 int32 partial sums.
inline __m512i k4_dot(const int16_t* k, const int16_t* qi, int64_t hd) {
  __m512i acc = _mm512_setzero_si512();
  for (int64_t c = 0; c < hd; c += 32) acc = k4_dot_step(acc, _mm512_loadu_si512(k + c), _mm512_loadu_si512(qi + c));
  return acc;
}

// The 8 keys' sums of a0 .. a7 (int32, exact in any order), lane t = key t.
inline __m256i k4_sum8(__m512i a0, __m512i a1, __m512i a2, __m512i a3, __m512i a4, __m512i a5, __m512i a6,
                       __m512i a7) {
  auto f = [](__m512i v) { return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1)); };
  const __m256i ab = _mm256_hadd_epi32(_mm256_hadd_epi32(f(a0), f(a1)), _mm256_hadd_epi32(f(a2), f(a3)));
  const __m256i cd = _mm256_hadd_epi32(_mm256_hadd_epi32(f(a4), f(a5)), _mm256_hadd_epi32(f(a6), f(a7)));
  return _mm256_add_epi32(_mm256_permute2x128_si256(ab, cd, 0x20), _mm256_permute2x128_si256(ab, cd, 0x31));
}

// The same scores 16 keys at a time for every pair of a block (k4_scores16): each key's row is
// turned so a vector lane holds a key (the 16 keys' rows as 16 × 16 dword transposes, dword i of a
// row holding channels 8i .. 8i + 7, two a byte), then per dword the low nibbles (channels 8i,
// 8i + 2, 8i + 4, 8i + 6) and the high ones (8i + 1, ..) as unsigned bytes u = v + 8 meet four bytes
// of the pair's table in one vpdpbusd (vpmaddubsw + vpmaddwd without VNNI: the same sums). With
// qi = 256 · qh + ql + 128 (qh = qi >> 8, ql = (qi & 255) - 128, both int8): Σ v · qi =
// 256 · Σ u · qh + Σ u · ql + 128 · Σ u - 8 · Σ qi, the very integer k4_dot8 sums, with no per-key
// reduction, and one transpose shared by every pair.
inline void k4_table_bytes(const int16_t* qi, int64_t hd, int8_t* qh, int8_t* ql, int32_t& corr) {
  __m512i sum = _mm512_setzero_si512();
  for (int64_t c = 0; c < hd; c += 32) {
    const __m512i v = _mm512_loadu_si512(qi + c);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qh + c), _mm512_cvtepi16_epi8(_mm512_srai_epi16(v, 8)));
    const __m512i lo = _mm512_sub_epi16(_mm512_and_si512(v, _mm512_set1_epi16(255)), _mm512_set1_epi16(128));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(ql + c), _mm512_cvtepi16_epi8(lo));
    sum = _mm512_add_epi32(sum, _mm512_madd_epi16(v, _mm512_set1_epi16(1)));
  }
  const __m256i h = _mm256_add_epi32(_mm512_castsi512_si256(sum), _mm512_extracti64x4_epi64(sum, 1));
  __m128i x = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
  x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0x4E));
  x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0xB1));
  corr = 8 * _mm_cvtsi128_si32(x);
}

inline __m512i k4_quad_step(__m512i acc, __m512i u, __m512i q) {
#ifdef QSPEC_Q8_VNNI
  return _mm512_dpbusd_epi32(acc, u, q);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, q), _mm512_set1_epi16(1)));
#endif
}

// tr[i · 16 + t] = dword i of rows[t] + off, i < 16.
inline void k4_transpose16(const int8_t* const* rows, int64_t off, int32_t* tr) {
  __m512 r[16];
  for (int t = 0; t < 16; ++t) r[t] = _mm512_castsi512_ps(_mm512_loadu_si512(rows[t] + off));
  avx512::transpose16(r);
  for (int i = 0; i < 16; ++i) _mm512_store_ps(reinterpret_cast<float*>(tr + i * 16), r[i]);
}

struct K4Pair {  // one pair of a k4_scores16 call
  const int8_t* qh;  // its table's bytes (k4_table_bytes), head_dim each
  const int8_t* ql;
  int32_t corr;
  float delta, qc;
  float* out;     // 16 scores
  float* vmax;    // its running max (8 lanes)
};

// P pairs over nd dwords of transposed keys tr (hd = 8 · nd channels), with su = Σ u per key.
template <int P>
inline void k4_pairs16(const int32_t* tr, int64_t nd, __m512i su, float scale, const K4Pair* ps) {
  const __m512i m = _mm512_set1_epi8(0x0F);
  const int64_t half = 4 * nd;  // bytes of a table's even channels
  __m512i sh[P], sl[P];
#pragma GCC unroll 8
  for (int p = 0; p < P; ++p) sh[p] = sl[p] = _mm512_setzero_si512();
  for (int64_t i = 0; i < nd; ++i) {
    const __m512i t = _mm512_load_si512(tr + i * 16);
    const __m512i lo = _mm512_and_si512(t, m), hi = _mm512_and_si512(_mm512_srli_epi32(t, 4), m);
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p) {
      int32_t a, b, c, d;
      std::memcpy(&a, ps[p].qh + 4 * i, 4);
      std::memcpy(&b, ps[p].qh + half + 4 * i, 4);
      std::memcpy(&c, ps[p].ql + 4 * i, 4);
      std::memcpy(&d, ps[p].ql + half + 4 * i, 4);
      sh[p] = k4_quad_step(k4_quad_step(sh[p], lo, _mm512_set1_epi32(a)), hi, _mm512_set1_epi32(b));
      sl[p] = k4_quad_step(k4_quad_step(sl[p], lo, _mm512_set1_epi32(c)), hi, _mm512_set1_epi32(d));
    }
  }
  const __m512i su7 = _mm512_slli_epi32(su, 7);
#pragma GCC unroll 8
  for (int p = 0; p < P; ++p) {
    const __m512i n = _mm512_sub_epi32(_mm512_add_epi32(_mm512_add_epi32(_mm512_slli_epi32(sh[p], 8), sl[p]), su7),
                                       _mm512_set1_epi32(ps[p].corr));
    const __m512 dot = _mm512_fmadd_ps(_mm512_cvtepi32_ps(n), _mm512_set1_ps(ps[p].delta), _mm512_set1_ps(ps[p].qc));
    const __m512 s = _mm512_mul_ps(dot, _mm512_set1_ps(scale));
    _mm512_storeu_ps(ps[p].out, s);
    __m256 v = _mm256_max_ps(_mm256_loadu_ps(ps[p].vmax), _mm512_castps512_ps256(s));  // keys 0-7, then 8-15
    v = _mm256_max_ps(v, _mm512_extractf32x8_ps(s, 1));
    _mm256_storeu_ps(ps[p].vmax, v);
  }
}

// 16 written keys of one group: rows[t] = key t's INT4 K bytes of this head (hd / 2, hd a multiple
// of 128); the n pairs' scores and running maxima as k4_dot8 and q8_emit give them, in bits.
inline void k4_scores16(const int8_t* const* rows, int64_t hd, const K4Pair* ps, int64_t n, float scale) {
  alignas(64) int32_t tr[16 * 64];  // head_dim <= 512
  const int64_t nd = hd / 8;
  const __m512i m = _mm512_set1_epi8(0x0F), ones = _mm512_set1_epi8(1);
  __m512i su = _mm512_setzero_si512();
  for (int64_t c = 0; c < nd; c += 16) {
    k4_transpose16(rows, 4 * c, tr + c * 16);
    for (int64_t i = c; i < c + 16; ++i) {  // two's complement nibbles v -> u = v + 8 = v ^ 8
      const __m512i t = _mm512_xor_si512(_mm512_load_si512(tr + i * 16), _mm512_set1_epi8(int8_t(0x88)));
      _mm512_store_si512(tr + i * 16, t);
      su = k4_quad_step(su, _mm512_and_si512(t, m), ones);
      su = k4_quad_step(su, _mm512_and_si512(_mm512_srli_epi32(t, 4), m), ones);
    }
  }
  int64_t p = 0;
  for (; p + 6 <= n; p += 6) k4_pairs16<6>(tr, nd, su, scale, ps + p);
  switch (n - p) {
    case 5: k4_pairs16<5>(tr, nd, su, scale, ps + p); break;
    case 4: k4_pairs16<4>(tr, nd, su, scale, ps + p); break;
    case 3: k4_pairs16<3>(tr, nd, su, scale, ps + p); break;
    case 2: k4_pairs16<2>(tr, nd, su, scale, ps + p); break;
    case 1: k4_pairs16<1>(tr, nd, su, scale, ps + p); break;
  }
}

// K of logical keys [j0, j0 + nk) of query row `row`, KV head kvh, for k4_dot8: a written group's
// key below bf_from unpacked into ub (row t at t * hd) with grp[t] = its group row; any other
// key's BF16 row in fb (row t at t * hd) with grp[t] = -1. Rows nk .. nfill - 1 get grp -2 (dropped lanes). In an
// 8-key block with a BF16 row the other rows of fb are zeroed (its FP32 dots read all 8).
inline void k4_prepare(const AttnArgs& a, int64_t kvh, int64_t row, int64_t j0, int64_t nk, int64_t nfill,
                       int64_t bf_from, float* fb, int16_t* ub, int64_t* grp) {
  const int64_t hd = a.kv.head_dim;
  for (int64_t t = 0; t < nk; ++t) {
    const int64_t slot = attn_key_slot(a, row, j0 + t);
    const int64_t g = a.kv.k_group_row(a.kv.slot(slot));
    if (a.kv.k_final[g] && j0 + t < bf_from) {
      grp[t] = g;
      k4_unpack(a.kv.q8_row(a.layer, 0, slot) + kvh * hd / 2, hd, ub + t * hd);
    } else {
      grp[t] = -1;
      bf16_row_f32(a.kv.k(a.layer, slot) + kvh * hd, hd, fb + t * hd);
    }
  }
  for (int64_t t = nk; t < nfill; ++t) grp[t] = -2;
  for (int64_t t0 = 0; t0 < nfill; t0 += 8) {
    bool bf = false;
    for (int64_t t = t0; t < t0 + 8; ++t) bf |= grp[t] == -1;
    if (bf)
      for (int64_t t = t0; t < t0 + 8; ++t)
        if (grp[t] != -1) std::memset(fb + t * hd, 0, size_t(hd) * 4);
  }
}
#endif

#ifdef QSPEC_Q8_AMX
// INT4 V on AMX tiles (the amx build): out[pair][c] = Σ_j w[pair][j] · s[j][c / 32] · v[j][c] as
// TDPBF16PS with A = the pairs' w · s of a 32-column block in BF16 (16 pairs × 32 keys, ONE BF16
// rounding of each weight: a draft's precision, 2^-9 relative), B = the keys' v as BF16 (exact:
// |v| <= 8), VNNI key pairs × 16 columns. The 16 columns of a B tile are one 32-channel block's
// even or odd channels (byte i of a block holds channels 2i and 2i + 1), so the scale of every
// column of a tile is its block's; tile (block b, parity p) column i is channel 32b + 2i + p.
// C tiles hold 16 pairs × 16 columns through a segment, as FP32; steps of 32 keys counted from key
// 0 in key order, so each C element is ONE chain over its pair's keys. Keys a pair does not
// attend weigh exact zeros (zero products leave a C element as it is: attention_amx.cpp), so a
// pair's sums do not depend on the pairs sharing its tile; tree rows gather their own keys into
// the same 32-key steps from the prefix rounded down to 32 (a linear row's steps, in bits).
// The segment's tiles are staged first (per key pair and block one interleave and two vpermw, the
// nibble -> BF16 table; per pair and block a product and a rounding), then each row tile's C tiles
// run through every step four at a time. Measured on a Sapphire Rapids VM (2 threads, 2 KV heads
// of 128, 28 calls): as fast as the FP32 pass for one row, 10-13% faster for 4-16 rows.
inline __m512i v4_lut() {  // BF16 of the two's complement nibble k & 15, for vpermw's 5-bit index
  alignas(64) uint16_t t[32];
  for (int k = 0; k < 32; ++k) {
    const float f = float(kv_q4_value(uint8_t(k & 15)));
    uint32_t u;
    std::memcpy(&u, &f, 4);
    t[k] = uint16_t(u >> 16);  // exact: small integers
  }
  return _mm512_load_si512(t);
}

// B tiles of the 32-key step of keys j0 .. j0 + n - 1 (n <= 32) of `row`, KV head kvh: tile
// 2b + p at bt + (2b + p) * 512 (16 rows of 32 BF16); sc[b * 32 + t] = key t's block-b scale (0
// past n, whose rows are zero).
inline void v4_btiles(const AttnArgs& a, int64_t kvh, int64_t row, int64_t j0, int64_t n, const __m512i lut,
                      uint16_t* bt, float* sc) {
  const int64_t hd = a.kv.head_dim, nblk = hd / kQ8Block;
  const __m128i zero = _mm_setzero_si128();
  for (int64_t r = 0; r < 16; ++r) {
    const int8_t* x[2] = {nullptr, nullptr};
    for (int e = 0; e < 2; ++e) {
      const int64_t t = 2 * r + e;
      if (t >= n) {
        for (int64_t b = 0; b < nblk; ++b) sc[b * 32 + t] = 0.f;
        continue;
      }
      const int64_t slot = attn_key_slot(a, row, j0 + t);
      x[e] = a.kv.q8_row(a.layer, 1, slot) + kvh * hd / 2;
      const uint8_t* es = a.kv.q8_scales(a.layer, 1, slot) + kvh * nblk;
      for (int64_t b = 0; b < nblk; ++b) sc[b * 32 + t] = kv_q4_scale(es[b]);
    }
    for (int64_t b = 0; b < nblk; ++b) {
      const __m128i xa = x[0] ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(x[0] + 16 * b)) : zero;
      const __m128i xb = x[1] ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(x[1] + 16 * b)) : zero;
      // bytes a0 b0 a1 b1 .. a15 b15 as words: word 2i = key 2r's byte i, 2i + 1 = key 2r + 1's
      const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_cvtepu8_epi16(_mm_unpacklo_epi8(xa, xb))),
                                           _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(xa, xb)), 1);
      _mm512_storeu_si512(bt + (2 * b) * 512 + r * 32, _mm512_permutexvar_epi16(w, lut));
      _mm512_storeu_si512(bt + (2 * b + 1) * 512 + r * 32, _mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), lut));
    }
  }
}

// 32 FP32 -> 32 BF16 in order (round to nearest even; NaN stays NaN).
inline __m512i v4_bf16x32(__m512 lo, __m512 hi) {
  auto r = [](__m512 x) {
    __m512i u = _mm512_castps_si512(x);
    u = _mm512_mask_mov_epi32(u, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000));
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    return _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd)), 16);
  };
  // packus works per 128-bit lane: qwords lo 0-3, hi 0-3, lo 4-7, .. back in order
  return _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7), _mm512_packus_epi32(r(lo), r(hi)));
}

// C tiles 0 .. 2·NB-1 = blocks b0 .. b0+NB-1 × parities 0, 1 of one row tile: zeroed, then through
// ns staged steps of step_tiles tiles (1 KB; B tile 2b + p at index 2b + p, this row tile's A tile
// of block b at a0 + b): C += A(block) · B(block, parity); stored to its cacc tiles.
template <int NB>
inline void v4_chains(float* cacc, const uint16_t* tiles, int64_t ns, int64_t step_tiles, int64_t a0, int64_t b0) {
  using namespace detail::amx;
  unrolled<2 * NB>([&](auto i) { tile_zero<decltype(i)::value>(); });
  for (int64_t st = 0; st < ns; ++st) {
    const uint16_t* t = tiles + st * step_tiles * 512;
    unrolled<NB>([&](auto i) { tile_load<4 + decltype(i)::value>(t + (a0 + b0 + decltype(i)::value) * 512, 64); });
    unrolled<NB>([&](auto i) {
      constexpr int B = decltype(i)::value;
      tile_load<6>(t + (2 * (b0 + B)) * 512, 64);
      tile_dpbf16<2 * B, 4 + B, 6>();
      tile_load<7>(t + (2 * (b0 + B) + 1) * 512, 64);
      tile_dpbf16<2 * B + 1, 4 + B, 7>();
    });
  }
  unrolled<2 * NB>([&](auto i) { tile_store<decltype(i)::value>(cacc + (2 * b0 + decltype(i)::value) * 256, 64); });
}
#endif

inline void q8_emit(__m256 dot, __m256 vscale, int64_t nk, float* sc, __m256& vmax) {
  if (nk == 8) {  // a full block: the same values, no staging
    const __m256 s = _mm256_mul_ps(dot, vscale);
    _mm256_storeu_ps(sc, s);
    vmax = _mm256_max_ps(vmax, s);
    return;
  }
  alignas(32) float tmp[8];
  _mm256_store_ps(tmp, _mm256_mul_ps(dot, vscale));
  for (int64_t t = 0; t < nk; ++t) sc[t] = tmp[t];
  for (int64_t t = nk; t < 8; ++t) tmp[t] = -INFINITY;  // lanes past p: dropped
  vmax = _mm256_max_ps(vmax, _mm256_load_ps(tmp));
}

// scores[j] = exp(scores[j] - max) for j < n; Σ in a fixed order. Full 8-key blocks for which
// dropped(j) holds (all their scores -inf: the sparse draft attention's) get zeros without an exp:
// their exact zero terms would leave the sums as they are.
template <class Dropped>
inline float q8_exp_pass(float* scores, int64_t n, float max_s, Dropped&& dropped) {
  const __m256 vmax = _mm256_set1_ps(max_s);
  __m256 vsum = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {  // full blocks in place; the partial one below, the same arithmetic
    if (dropped(j)) {
      _mm256_storeu_ps(scores + j, _mm256_setzero_ps());
      continue;
    }
    const __m256 e = avx2::exp(_mm256_sub_ps(_mm256_loadu_ps(scores + j), vmax));
    _mm256_storeu_ps(scores + j, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  for (; j < n; j += 8) {
    alignas(32) float tmp[8];
    for (int t = 0; t < 8; ++t) tmp[t] = j + t < n ? scores[j + t] : -INFINITY;
    const __m256 e = avx2::exp(_mm256_sub_ps(_mm256_load_ps(tmp), vmax));  // -inf lanes -> 0
    _mm256_store_ps(tmp, e);
    for (int64_t t = 0; t < 8 && j + t < n; ++t) scores[j + t] = tmp[t];
    vsum = _mm256_add_ps(vsum, e);
  }
  return avx2::hsum(vsum);
}

// acc[c] += Σ_j w[j] · V_j[c] over keys [j0, j1) in order; vb row (j - jb) holds key j.
template <class T, int NC>
inline void q8_v_chunk(const float* w, const float* vb, int64_t hd, int64_t jb, int64_t j0, int64_t j1,
                       float* acc, int64_t d0) {
  typename T::V r[NC];
  for (int c = 0; c < NC; ++c) r[c] = T::load(acc + d0 + c * T::W);
  for (int64_t j = j0; j < j1; ++j) {
    const typename T::V wj = T::set1(w[j]);
    const float* v = vb + (j - jb) * hd + d0;
    for (int c = 0; c < NC; ++c) r[c] = T::fma(wj, T::load(v + c * T::W), r[c]);
  }
  for (int c = 0; c < NC; ++c) T::store(acc + d0 + c * T::W, r[c]);
}

template <class T>
void q8_v_keys(const float* w, const float* vb, int64_t hd, int64_t jb, int64_t j0, int64_t j1, float* acc) {
  int64_t d = 0;  // 8 chains a chunk where head_dim allows (a column's chain is the same in any chunk)
  for (; d + 8 * T::W <= hd; d += 8 * T::W) q8_v_chunk<T, 8>(w, vb, hd, jb, j0, j1, acc, d);
  for (; d + 4 * T::W <= hd; d += 4 * T::W) q8_v_chunk<T, 4>(w, vb, hd, jb, j0, j1, acc, d);
  for (; d < hd; d += T::W) q8_v_chunk<T, 1>(w, vb, hd, jb, j0, j1, acc, d);
}

template <class T>
void q8_group(const AttnArgs& a, int64_t kvh, int64_t u0, int64_t u1, int64_t seg, const AttnPartials& part) {
  const int64_t hd = a.kv.head_dim;
  const int64_t G = a.n_heads / a.kv.kv_heads;
  const int64_t np = u1 - u0;
  if (np <= 0) return;
  const int64_t kbeg = seg * kAttnSegKeys, kcap = kbeg + kAttnSegKeys;
  const int64_t n_max = attn_unit_keys(a, u0, u1, seg);
  if (n_max <= kbeg) return;
  // Keys [kbeg, n_sh) are shared by every pair; a row's keys [t0, n) are its own: a tree row's
  // past the shared prefix, and with recent keys (AttnArgs::recent_keys, read from the BF16 rows
  // from attn_recent_lo on) every row's from the first pair's recent ones rounded down to 8.
  const bool own = a.tree || a.recent_keys > 0;
  int64_t n_sh = attn_shared_end(a, n_max);
  for (int64_t r = u0 / G; a.recent_keys > 0 && r <= (u1 - 1) / G; ++r)
    n_sh = (attn_recent_lo(a, r) & ~int64_t(7)) < n_sh ? attn_recent_lo(a, r) & ~int64_t(7) : n_sh;
  const int64_t t0 = n_sh > kbeg ? n_sh : kbeg;
  const int64_t tb = n_max > t0 ? q8_round8(n_max - t0) : 0;
  const int64_t sc_stride = q8_round8(n_max) + 8;
  int64_t kb = (4096 / hd) & ~int64_t(7);  // keys per block: 16 KB FP32
  if (kb < 8) kb = 8;

#ifdef QSPEC_Q8_AVX512
  const bool int_k = a.kv.k_bits == 4;  // INT4 K scores by integer dot products (k4_table)
#else
  const bool int_k = false;
#endif
  // scratch: FP32 K/V block | own keys | scores | V accumulators | the recent keys' V sums (in
  // the plain basis) | q | running max, then Σ;
  // int_k: unpacked K rows of the block and the tail (int16) | their groups | per pair a table
  const int64_t k4_floats = int_k ? ((kb + tb) * hd + 2 * np * hd) / 2 + 2 * (kb + tb) + 8 * np + 16 : 0;
#ifdef QSPEC_Q8_AMX
  const bool amx_v = a.kv.v_bits == 4;  // INT4 V on tiles (v4_btiles)
#else
  const bool amx_v = false;
#endif
  // amx_v: per step its B tiles and its A tiles per row tile and block | one step's scales | C tiles
  const int64_t nblk = hd / kQ8Block, nrt = (np + 15) / 16;
  // steps of 32 keys: the segment's shared ones, and a tree row's own from the prefix on
  const int64_t v4_steps = kAttnSegKeys / 32 + (own ? np * ((tb + 31) / 32 + 1) : 0);
  const int64_t v4_floats = amx_v ? v4_steps * (2 * nblk + nrt * nblk) * 256 + nblk * 32 + nrt * 2 * nblk * 256 + 64 : 0;
  const int64_t base_floats = kb * hd + tb * hd + np * (sc_stride + 3 * hd + 8) + 64;
  float* kvbuf = attn_thread_scratch(base_floats + k4_floats + v4_floats);
  float* tbuf = kvbuf + kb * hd;
  float* scores = tbuf + tb * hd;
  float* accs = scores + np * sc_stride;
  float* raccs = accs + np * hd;
  float* qs = raccs + np * hd;
  float* stat = qs + np * hd;  // per pair 8 floats: running max (8 lanes), then {Σ, max}
  int16_t* kub = reinterpret_cast<int16_t*>(stat + np * 8);  // (kb + tb) rows of head_dim int16
  int64_t* kgrp = reinterpret_cast<int64_t*>(kub + (kb + tb) * hd);  // kb + tb
  int16_t* qtab = reinterpret_cast<int16_t*>(kgrp + kb + tb);  // np rows of head_dim int16, then per pair
  // its table's bytes (k4_table_bytes: head_dim qh, head_dim ql)
  float* v4 = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(kvbuf + base_floats + k4_floats) + 63) &
                                       ~uintptr_t(63));  // amx_v's tiles, 64-byte aligned
#ifdef QSPEC_Q8_AVX512
  static_assert(sizeof(K4Table) <= 8 * sizeof(float), "k4_floats: 8 floats a table");
  int8_t* qbytes = reinterpret_cast<int8_t*>(qtab + np * hd);
  K4Table* ktab = reinterpret_cast<K4Table*>(qbytes + 2 * np * hd);  // np
  for (int64_t u = 0; int_k && u < np; ++u) ktab[u] = K4Table{};
  alignas(64) float pcen[512], pscl[512];  // the params of group pg (k4_params)
  int64_t pg = -1;
  const bool k16 = int_k && hd % 128 == 0;  // k4_scores16 can score this head's K (its table's bytes)
  auto table_for = [&](int64_t u, int64_t group) {  // pair u's table for this group (kept while it repeats)
    K4Table& tab = ktab[u];
    if (tab.group == group) return;
    if (pg != group) k4_params(a, kvh, pg = group, pcen, pscl);
    int16_t* qi = qtab + u * hd;
    k4_table(qs + u * hd, pcen, pscl, hd, group, tab, qi);
    if (k16) k4_table_bytes(qi, hd, qbytes + 2 * u * hd, qbytes + 2 * u * hd + hd, tab.corr);
  };
  // Lane t = the score (unscaled) of key t of the 8 at row t of the prepared block (k4_prepare)
  auto k4_dot8 = [&](int64_t u, const float* fb, const int16_t* ub, const int64_t* g) {
    K4Table& tab = ktab[u];
    int16_t* qi = qtab + u * hd;
    bool one = g[0] >= 0;  // the usual block: 8 written keys of one group (a page)
    for (int t = 1; t < 8; ++t) one &= g[t] == g[0];
    if (one) {
      table_for(u, g[0]);
      __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
      for (int64_t c = 0; c < hd; c += 32) {
        const __m512i w = _mm512_loadu_si512(qi + c);
        const int16_t* k = ub + c;
        a0 = k4_dot_step(a0, _mm512_loadu_si512(k), w);
        a1 = k4_dot_step(a1, _mm512_loadu_si512(k + hd), w);
        a2 = k4_dot_step(a2, _mm512_loadu_si512(k + 2 * hd), w);
        a3 = k4_dot_step(a3, _mm512_loadu_si512(k + 3 * hd), w);
        a4 = k4_dot_step(a4, _mm512_loadu_si512(k + 4 * hd), w);
        a5 = k4_dot_step(a5, _mm512_loadu_si512(k + 5 * hd), w);
        a6 = k4_dot_step(a6, _mm512_loadu_si512(k + 6 * hd), w);
        a7 = k4_dot_step(a7, _mm512_loadu_si512(k + 7 * hd), w);
      }
      const __m256i sum = k4_sum8(a0, a1, a2, a3, a4, a5, a6, a7);
      return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(tab.delta), _mm256_set1_ps(tab.qc));
    }
    bool any_bf = false, any_int = false;
    for (int t = 0; t < 8; ++t) any_bf |= g[t] == -1, any_int |= g[t] >= 0;
    const __m256 fp = any_bf ? q8_dot8<T>(qs + u * hd, fb, hd) : _mm256_setzero_ps();
    if (!any_int) return fp;
    __m512i acc[8];
    alignas(32) float dl[8], ql[8];
    alignas(32) int32_t bf[8];
    for (int t = 0; t < 8; ++t) {
      bf[t] = g[t] == -1 ? -1 : 0;
      if (g[t] < 0) {
        acc[t] = _mm512_setzero_si512();
        dl[t] = ql[t] = 0.f;
        continue;
      }
      table_for(u, g[t]);
      acc[t] = k4_dot(ub + t * hd, qi, hd);
      dl[t] = tab.delta;
      ql[t] = tab.qc;
    }
    const __m256i sum = k4_sum8(acc[0], acc[1], acc[2], acc[3], acc[4], acc[5], acc[6], acc[7]);
    const __m256 r = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_load_ps(dl), _mm256_load_ps(ql));
    return any_bf ? _mm256_blendv_ps(r, fp, _mm256_load_ps(reinterpret_cast<const float*>(bf))) : r;
  };
#endif

  // Per pair, once: its row and head, keys, window bounds and first recent key (the lambdas below
  // run per key block and step; a division by G there cost as much as a step's arithmetic).
  thread_local std::vector<PairBounds> bounds;  // PairBounds has internal linkage (K4Pair's note)
  if (bounds.size() < size_t(np)) bounds.resize(size_t(np));
  PairBounds* const pb = bounds.data();
  for (int64_t u = 0; u < np; ++u) {
    const int64_t row = (u0 + u) / G;
    pb[u] = {row, kvh * G + (u0 + u) % G, attn_row_pos(a, row) + 1, attn_key_lo(a, row), attn_gap_lo(a, row),
             attn_recent_lo(a, row)};
  }
  auto row_of = [pb](int64_t u) { return pb[u].row; };
  auto head_of = [pb](int64_t u) { return pb[u].head; };
  auto n_full = [pb](int64_t u) { return pb[u].n_full; };
  auto n_of = [pb, kcap](int64_t u) { return pb[u].n_full < kcap ? pb[u].n_full : kcap; };
  // Keys [gap_of, lo_of) are not attended (a window, past the sinks); a pair is live in this
  // segment when it attends one of its keys, and skips the blocks inside its gap.
  auto lo_of = [pb](int64_t u) { return pb[u].lo; };
  auto gap_of = [pb](int64_t u) { return pb[u].gap; };
  auto live = [&](int64_t u) { return n_of(u) > kbeg && (kbeg < gap_of(u) || n_of(u) > lo_of(u)); };
  auto in_gap = [&](int64_t u, int64_t b0, int64_t e) { return b0 >= gap_of(u) && e <= lo_of(u); };
  auto rec_of = [pb](int64_t u) { return pb[u].rec; };  // its BF16 keys from here
#ifdef QSPEC_Q8_AVX512
  // The shared keys [b0, b1) of a K block by k4_scores16 (the same bits as k4_dot8), when they are
  // whole 16-key blocks of written groups and every pair that does not skip the block attends all
  // of it (end_of(u) == b1); false, nothing computed, otherwise.
  auto k4_block16 = [&](int64_t b0, int64_t b1, auto&& end_of, auto&& skips) {
    if (!k16 || b0 % 16 != 0 || (b1 - b0) % 16 != 0 || b1 - b0 > 32) return false;
    for (int64_t u = 0; u < np; ++u)
      if (!skips(u) && end_of(u) != b1) return false;
    const int8_t* rows[32];
    int64_t grp[2];
    for (int64_t t = 0; t < b1 - b0; ++t) {
      const int64_t slot = attn_key_slot(a, 0, b0 + t);
      const int64_t g = a.kv.k_group_row(a.kv.slot(slot));
      if (!a.kv.k_final[g] || (t % 16 != 0 && g != grp[t / 16])) return false;
      grp[t / 16] = g;
      rows[t] = a.kv.q8_row(a.layer, 0, slot) + kvh * hd / 2;
    }
    thread_local std::vector<K4Pair> ps;  // K4Pair has internal linkage: no instantiation shared with baseline code
    for (int64_t h = 0; h < (b1 - b0) / 16; ++h) {
      ps.clear();
      for (int64_t u = 0; u < np; ++u) {
        if (skips(u)) continue;
        table_for(u, grp[h]);
        const K4Table& tab = ktab[u];
        ps.push_back({qbytes + 2 * u * hd, qbytes + 2 * u * hd + hd, tab.corr, tab.delta, tab.qc,
                      scores + u * sc_stride + b0 + 16 * h, stat + u * 8});
      }
      k4_scores16(rows + 16 * h, hd, ps.data(), int64_t(ps.size()), a.scale);
    }
    return true;
  };
#endif

  const __m256 vscale = _mm256_set1_ps(a.scale);
  for (int64_t u = 0; u < np; ++u) {
    const float* q = a.q + (row_of(u) * a.n_heads + head_of(u)) * hd;
    for (int64_t d = 0; d < hd; ++d) qs[u * hd + d] = q[d], accs[u * hd + d] = raccs[u * hd + d] = 0.f;
    _mm256_storeu_ps(stat + u * 8, _mm256_set1_ps(-INFINITY));
  }

#ifdef QSPEC_Q8_AMX
  // The V pass on tiles (v4_btiles): the steps shared by every pair (keys from kbeg below the
  // shared keys rounded down to 32), then each tree row's own steps from there to its keys' end.
  auto v4_pass = [&]() {
    // per step: 2 · nblk B tiles, then nrt · nblk A tiles (1 KB each); the scales of one step; C
    const int64_t step_tiles = 2 * nblk + nrt * nblk;
    uint16_t* tiles = reinterpret_cast<uint16_t*>(v4);
    float* sc = v4 + v4_steps * step_tiles * 256;  // nblk × 32
    float* cacc = sc + nblk * 32;                  // nrt × 2 · nblk C tiles
    const __m512i lut = v4_lut();
    const int64_t sh32 = n_sh & ~int64_t(31);  // shared steps end here (kbeg is a multiple of 256)
    // keys t of the step (j0 + t, t < n) that pair u attends: below its end, outside its gap
    auto step_mask = [&](int64_t u, int64_t row, int64_t j0, int64_t n) -> __mmask32 {
      if (!live(u) || (row >= 0 && row_of(u) != row)) return 0;
      const int64_t end = n_of(u) < rec_of(u) ? n_of(u) : rec_of(u);  // the copy's keys end here
      const int64_t e = end - j0 < n ? end - j0 : n;
      if (e <= 0) return 0;
      __mmask32 k = e >= 32 ? ~__mmask32(0) : __mmask32((uint32_t(1) << e) - 1);
      const int64_t g0 = gap_of(u) - j0, g1 = lo_of(u) - j0;  // [g0, g1) not attended
      for (int64_t t = g0 < 0 ? 0 : g0; t < g1 && t < 32; ++t) k &= ~(__mmask32(1) << t);
      return k & attn_kept_bits(a, row_of(u), kvh, j0, n);  // not the pages the sparse draft attention drops
    };
    int64_t ns = 0;  // steps staged
    auto stage = [&](int64_t row, int64_t j0, int64_t n) {  // row -1: shared by every pair
      __mmask32 any = 0;
      for (int64_t u = 0; u < np; ++u) any |= step_mask(u, row, j0, n);
      if (!any) return;
      uint16_t* bt = tiles + ns * step_tiles * 512;
      uint16_t* at = bt + 2 * nblk * 512;
      ++ns;
      v4_btiles(a, kvh, row < 0 ? 0 : row, j0, n, lut, bt, sc);
      std::memset(at, 0, size_t(nrt * nblk * 512) * 2);  // pairs that do not attend: zero rows
      for (int64_t u = 0; u < np; ++u) {
        const __mmask32 k = step_mask(u, row, j0, n);
        if (!k) continue;
        const __mmask16 k0 = __mmask16(k), k1 = __mmask16(k >> 16);
        const float* w = scores + u * sc_stride + j0;
        const __m512 w0 = _mm512_maskz_loadu_ps(k0, w), w1 = _mm512_maskz_loadu_ps(k1, w + 16);
        uint16_t* arow = at + (u / 16) * nblk * 512 + (u % 16) * 32;
        for (int64_t b = 0; b < nblk; ++b) {  // w · s, exact zeros where not attended (a NaN scale stays out)
          const __m512 p0 = _mm512_maskz_mul_ps(k0, w0, _mm512_loadu_ps(sc + b * 32));
          const __m512 p1 = _mm512_maskz_mul_ps(k1, w1, _mm512_loadu_ps(sc + b * 32 + 16));
          _mm512_storeu_si512(arow + b * 512, v4_bf16x32(p0, p1));
        }
      }
    };
    const int64_t sh_end = own ? sh32 : n_sh;  // linear rows without recent keys share every key
    for (int64_t j0 = kbeg; j0 < sh_end; j0 += 32) stage(-1, j0, (sh_end < j0 + 32 ? sh_end : j0 + 32) - j0);
    const int64_t t32 = sh32 > kbeg ? sh32 : kbeg;
    int64_t done_row = -1;
    for (int64_t u = 0; own && u < np; ++u) {  // a row's pairs are consecutive
      if (row_of(u) == done_row) continue;
      done_row = row_of(u);
      const int64_t n = n_of(u) < rec_of(u) ? n_of(u) : rec_of(u);
      for (int64_t j0 = t32; j0 < n; j0 += 32) stage(done_row, j0, (n < j0 + 32 ? n : j0 + 32) - j0);
    }
    // C tiles stay in registers through every step, two blocks (4 tiles) at a time
    for (int64_t rt = 0; rt < nrt; ++rt)
      for (int64_t b = 0; b < nblk; b += 2) {
        const int64_t a0 = 2 * nblk + rt * nblk;
        if (b + 2 <= nblk) v4_chains<2>(cacc + rt * 2 * nblk * 256, tiles, ns, step_tiles, a0, b);
        else v4_chains<1>(cacc + rt * 2 * nblk * 256, tiles, ns, step_tiles, a0, b);
      }
    for (int64_t u = 0; u < np; ++u) {  // C tiles -> accs in channel order
      const int64_t rt = u / 16, m = u % 16;
      for (int64_t b = 0; b < nblk; ++b)
        for (int p = 0; p < 2; ++p) {
          const float* src = cacc + (rt * 2 * nblk + 2 * b + p) * 256 + m * 16;
          for (int64_t i = 0; i < 16; ++i) accs[u * hd + 32 * b + 2 * i + p] = src[i];
        }
    }
  };
#endif
  for (int kv_index = 0; kv_index < 2; ++kv_index) {
    if (kv_index == 1)  // pass 2, between K and V
      for (int64_t u = 0; u < np; ++u) {
        if (!live(u)) continue;
        float* sc = scores + u * sc_stride;
        float m = attn_gap_max(sc, kbeg, n_of(u), gap_of(u), lo_of(u), avx2::hmax(_mm256_loadu_ps(stat + u * 8)));
        m = attn_drop_max(a, row_of(u), kvh, sc, kbeg, n_of(u), m);
        if (m == -INFINITY) {  // every key of the segment dropped (sparse): an empty partial
          for (int64_t j = kbeg; j < n_of(u); ++j) sc[j] = 0.f;
          stat[u * 8] = 0.f;
          stat[u * 8 + 1] = m;
          continue;
        }
        stat[u * 8] = q8_exp_pass(sc + kbeg, n_of(u) - kbeg, m,
                                  [&](int64_t j) { return !attn_key_kept(a, row_of(u), kvh, kbeg + j); });
        stat[u * 8 + 1] = m;
      }
    // blk: the block's FP32 rows from key jb on (int_k K: k4_prepare's, with ub and g)
    // scores (K) or V sums into vsum (V) of pair u over keys [j0, e) of blk (row j - jb: key j)
    auto run = [&](int64_t u, const float* blk, const int16_t* ub, const int64_t* g, int64_t jb, int64_t j0,
                   int64_t e, float* vsum) {
      if (kv_index == 1) {
        q8_v_keys<T>(scores + u * sc_stride, blk, hd, jb, j0, e, vsum + u * hd);
        return;
      }
      __m256 vmax = _mm256_loadu_ps(stat + u * 8);
      for (int64_t j = j0; j < e; j += 8) {
        const float* fb = blk + (j - jb) * hd;
#ifdef QSPEC_Q8_AVX512
        const __m256 dot = int_k ? k4_dot8(u, fb, ub + (j - jb) * hd, g + (j - jb)) : q8_dot8<T>(qs + u * hd, fb, hd);
#else
        const __m256 dot = q8_dot8<T>(qs + u * hd, fb, hd);
#endif
        q8_emit(dot, vscale, e - j < 8 ? e - j : 8, scores + u * sc_stride + j, vmax);
      }
      _mm256_storeu_ps(stat + u * 8, vmax);
    };
    // K or V of keys [j0, j0 + nk) of `row` into fb (int_k K: with ub and g), zero-filled to nfill;
    // keys from bf_from on from the BF16 rows
    auto load = [&](int64_t row, int64_t j0, int64_t nk, int64_t nfill, int64_t bf_from, float* fb, int16_t* ub,
                    int64_t* g) {
#ifdef QSPEC_Q8_AVX512
      if (int_k && kv_index == 0) return k4_prepare(a, kvh, row, j0, nk, nfill, bf_from, fb, ub, g);
#endif
      q8_dequant<T>(a, kv_index, kvh, row, j0, nk, nfill, bf_from, fb);
    };
    // Each row's own keys [t0, n) (recent_only: its recent keys only), loaded once per row (a row's
    // pairs are consecutive): K scores, or V sums: the copy's keys into accs, the recent keys'
    // BF16 rows into raccs (a live pair has some of them in this segment iff rec_of(u) < n_of(u)).
    auto own_keys = [&](bool recent_only) {
      int64_t own_row = -1;
      for (int64_t u = 0; tb > 0 && u < np; ++u) {
        const int64_t n = n_of(u), rec = rec_of(u) > t0 ? rec_of(u) : t0;
        const int64_t from = recent_only ? rec : t0;
        if (n <= from || !live(u)) continue;
        int16_t* ub = kub + kb * hd;
        int64_t* g = kgrp + kb;
        if (row_of(u) != own_row) {
          own_row = row_of(u);
          load(own_row, from, n - from, q8_round8(n - from), rec, tbuf, ub, g);
        }
        if (kv_index == 0) {
          run(u, tbuf, ub, g, from, from, n, nullptr);
          continue;
        }
        if (rec > from) run(u, tbuf, ub, g, from, from, rec < n ? rec : n, accs);
        if (rec < n) run(u, tbuf, ub, g, from, rec, n, raccs);
      }
    };
#ifdef QSPEC_Q8_AMX
    if (kv_index == 1 && amx_v) {
      v4_pass();  // the copy's keys; the recent ones on the FP32 path
      own_keys(true);
      break;
    }
#endif
    for (int64_t b0 = kbeg; b0 < n_sh; b0 += kb) {
      const int64_t b1 = b0 + kb < n_sh ? b0 + kb : n_sh;
      auto end_of = [&](int64_t u) { return b1 < n_of(u) ? b1 : n_of(u); };  // pair u's keys end here
      auto skips = [&](int64_t u) {
        return !live(u) || end_of(u) <= b0 || in_gap(u, b0, end_of(u)) || !attn_keys_kept(a, row_of(u), kvh, b0, end_of(u));
      };
      bool all_skip = true;
      for (int64_t u = 0; u < np && all_skip; ++u) all_skip = skips(u);
      if (all_skip) continue;  // every pair's gap (or past its keys): not even dequantized
      // the next block's rows, while this one is computed (as convert_block in attention_avx2.cpp)
      for (int64_t j = b1; j < b1 + kb && j < n_sh; ++j) {
        const char* row = reinterpret_cast<const char*>(a.kv.q8_row(a.layer, kv_index, attn_key_slot(a, 0, j)));
        const int64_t hb = a.kv.q8_head_bytes(kv_index);
        for (int64_t x = 0; x < hb; x += 64) _mm_prefetch(row + kvh * hb + x, _MM_HINT_T0);
      }
#ifdef QSPEC_Q8_AVX512
      if (kv_index == 0 && k4_block16(b0, b1, end_of, skips)) continue;
#endif
      load(0, b0, b1 - b0, q8_round8(b1 - b0), n_sh, kvbuf, kub, kgrp);
      for (int64_t u = 0; u < np; ++u)
        if (!skips(u)) run(u, kvbuf, kub, kgrp, b0, b0, end_of(u), accs);
    }
    own_keys(false);
  }

  for (int64_t u = 0; u < np; ++u) {
    if (!live(u)) continue;  // below its window and past its sinks: no partial
    float* acc = accs + u * hd;
    const float* racc = raccs + u * hd;
    const bool recent = rec_of(u) < n_of(u);  // V sums of recent keys in raccs
    float* out;
    float inv;
    if (n_full(u) <= kAttnSegKeys) {
      // INT4 V: sums in the rotated basis, turned back once per output row (a partial stays
      // rotated: merge_segments turns the merged row back), then the recent keys' sums added
      if (a.kv.v_bits == 4) kv_unrotate(acc, hd, kv_rot_size(hd));
      for (int64_t d = 0; recent && d < hd; ++d) acc[d] += racc[d];
      out = a.out + (row_of(u) * a.n_heads + head_of(u)) * hd;
      inv = 1.f / stat[u * 8];
    } else {
      float* pp = part.at(a, row_of(u), head_of(u), seg);
      pp[0] = stat[u * 8 + 1];
      pp[1] = stat[u * 8];
      out = pp + 2;
      inv = 1.f;  // the partial keeps the unnormalized sums (INT4 V: in the rotated basis)
      if (recent && a.kv.v_bits == 4) kv_rotate(raccs + u * hd, hd, kv_rot_size(hd));
      for (int64_t d = 0; recent && d < hd; ++d) acc[d] += racc[d];
    }
    for (int64_t d = 0; d < hd; ++d) out[d] = acc[d] * inv;
  }
}

}  // namespace
}  // namespace qspec
