// AVX-512F attention: one call computes several (row, head) pairs of ONE KV head (see
// attention.h), head_dim a multiple of 8. The three passes of the buffer path of
// attention_avx2.cpp (read that file's header for the batch-invariance argument), in natural
// column order (no even/odd layout, no register-tile path), with its own score sums; per pair:
//   1. scores: per key ONE FMA chain over head_dim in order (d = 0, 1, .., hd - 1), · scale.
//      Keys sit in the lanes: a K super-block is transposed once into [dim][keys] FP32 (shared by
//      every pair of the call) and 8-12 chains are summed at once (6 pairs x 32 keys, 3 x 64),
//      each step a load of the keys' dim d and a broadcast of each pair's q[d]: no horizontal
//      sums, and the loads shared by the pairs. A score depends only on its q and its key's row,
//      so how keys and pairs are grouped (m, tree tails, partial blocks) never changes its bits.
//      With the V pairs and prefetch below, against the former per-key 16-lane chains and hadd
//      tree (model-167 Xeon at QSPEC_ISA=avx512_bf16, 2 threads, Qwen2.5-Coder-1.5B, `qspec
//      bench breakdown --context 2048 / 8192 --ms 1,9`, builds alternated twice): a 9-row
//      verify's attention 19.7-20.3 -> 17.9 ms a step at 2k, 74-82 -> 66-67 ms at 8k; one row
//      5.0-5.2 -> 4.9 and 18.6-19.9 -> 18.5-18.6 (its K/V reads, not its arithmetic, bound it);
//   2. exp(s - max) with Σ as 16 lane-wise partial sums over blocks from key 0, then one
//      horizontal reduction;
//   3. per output column one FMA chain over keys 0..p in order, then · (1/Σ); two pairs at a
//      time share each V load (16 chains in flight), each pair still over its keys in order.
// Each K / V block's conversion prefetches the next block's rows, one row per row converted
// (after the last K block, the first V block's): decode rows wait on the cache otherwise.
// K and V are streamed in super-blocks (multiple of 8 keys, ~16 KB FP32) converted once (exact)
// into an FP32 block shared by all pairs of the call (K transposed, V in row order); each pair
// uses only keys 0..p of it (a partial last block computes lanes for keys it then drops; each
// lane depends on its own key only). No cache row beyond the call's last row is read. Tree rows
// (attention.h AttnTree): the keys all rows share (below the prefix, rounded down to 8) are
// streamed as above, then each row's remaining logical keys are gathered from their slots into
// a block of the same form and run through the same functions, continuing the same max, Σ
// blocks and V chains.
//
// The avx512_bf16 path (attn_group_avx512_bf16, head_dim a multiple of 32) is the same code with
// BF16 operands for both products, the roundings of the amx path (attention_amx.cpp: q and each
// softmax weight exp(s - max) rounded to nearest BF16, Σ from the unrounded weights): the K block
// is kept as the transposed rows' BF16 pairs (one dword per key and dim pair, no conversion) and
// each score is one vdpbf16ps chain over the dim pairs in order; V is staged as key pairs (the
// two keys' rows interleaved, a zero row after an odd last key) and each output column is one
// vdpbf16ps chain over the key pairs from key 0, a pair's weights one dword (a weight past the
// pair's last key is 0, so it adds exact zero products). Blocks start at multiples of 8 keys, so
// key pairs never straddle them and a pair's arithmetic still depends on its q and p only. Half
// the instructions of the FP32 chains: on a Zen 5 (EPYC, 2 cores, `qspec bench attention
// --contexts 512,2048,8192 --ms 1,9 --prefill --paths avx512,avx512_bf16`) one decode row took
// 0.67-0.74 of the FP32 path's time, 9 rows 0.65-0.66 and a whole prompt 0.63-0.66. Where
// vdpbf16ps issues at half the FMAs' rate (Intel cores) the FP32 path stays the choice
// (attention.h, set_attn_bf16).
//
// tests/test_attention.py checks it against the float64 oracle and for bit-exact batch invariance
// on AVX-512 hardware (a Sapphire Rapids VM; avx512_bf16 on a Zen 5) and under emulation
// (tests/test_isa_emulation.py).
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <utility>

#include "attention.h"
#include "attention_avx512.h"

namespace qspec {
namespace {

// 16 BF16 values -> 16 FP32 (exact).
inline __m512 load_bf16x16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// 8 BF16 values -> FP32 in lanes 0..7, lanes 8..15 zero; never reads past the 8 values.
inline __m512 load_bf16x8_lo(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_zextsi128_si256(h));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

// Per-thread scratch lives in baseline code (attention.cpp): STL templates instantiated in
// an ISA file could be the copy the linker keeps for baseline callers (SIGILL on older CPUs).
inline float* scratch_floats(int64_t n) { return attn_thread_scratch(n); }

inline int64_t round8(int64_t x) { return (x + 7) & ~int64_t(7); }
inline int64_t round16(int64_t x) { return (x + 15) & ~int64_t(15); }

using avx512::prefetch_row;

// dst[t · hd + d] = src key t (t < nk), exact BF16 -> FP32; keys nk .. nk_pad - 1 zeroed. Rows
// ahead[t · stride], t < n_ahead (the next block's), are prefetched one per row converted.
void convert_block(const uint16_t* src, int64_t stride, int64_t nk, int64_t nk_pad, int64_t hd,
                   float* dst, const uint16_t* ahead = nullptr, int64_t n_ahead = 0) {
  const int64_t hd16 = hd & ~int64_t(15);
  for (int64_t t = 0; t < nk; ++t) {
    if (t < n_ahead) prefetch_row(ahead + t * stride, hd);
    for (int64_t d = 0; d < hd16; d += 16)
      _mm512_storeu_ps(dst + t * hd + d, load_bf16x16(src + t * stride + d));
    if (hd16 < hd)
      _mm256_storeu_ps(dst + t * hd + hd16, _mm512_castps512_ps256(load_bf16x8_lo(src + t * stride + hd16)));
  }
  for (int64_t t = nk; t < nk_pad; ++t)
    for (int64_t d = 0; d < hd; d += 8) _mm256_storeu_ps(dst + t * hd + d, _mm256_setzero_ps());
}

// kt[d · ldk + t] = K of key t (row row(t), t < nk), exact BF16 -> FP32, for t < round16(nk)
// (keys nk .. zero): the keys of a block in the lanes. Per 16 keys and 32 dims one 16 x 16
// transpose of the rows' BF16 pairs (dwords), then each pair's even dim (<< 16) and odd dim (its
// high half). ldk >= round16(nk), a multiple of 16.
// Rows ahead[t · stride], t < n_ahead, are prefetched as convert_block does.
// Pairs (the avx512_bf16 path): kt[dp · ldk + t] = the BF16 pair (dims 2dp, 2dp + 1) of key t as one
// dword, vdpbf16ps's operand, unconverted.
template <bool Pairs = false, class Row>
void transpose_block(Row&& row, int64_t nk, int64_t hd, float* kt, int64_t ldk,
                     const uint16_t* ahead = nullptr, int64_t stride = 0, int64_t n_ahead = 0) {
  const __m512i top = _mm512_set1_epi32(int(0xFFFF0000u));
  for (int64_t t0 = 0; t0 < nk; t0 += 16) {
    for (int64_t t = t0; t < t0 + 16 && t < n_ahead; ++t) prefetch_row(ahead + t * stride, hd);
    for (int64_t c = 0; c < hd; c += 32) {
      const __mmask32 cols = hd - c >= 32 ? __mmask32(0xFFFFFFFFu) : __mmask32((1u << (hd - c)) - 1u);
      __m512 r[16];
      for (int64_t t = 0; t < 16; ++t)
        r[t] = t0 + t < nk ? _mm512_castsi512_ps(_mm512_maskz_loadu_epi16(cols, row(t0 + t) + c)) : _mm512_setzero_ps();
      avx512::transpose16(r);  // r[j]: dims c + 2j, c + 2j + 1 of keys t0 .. t0 + 15
      if constexpr (Pairs) {
        for (int64_t j = 0; j < 16; ++j) _mm512_storeu_ps(kt + (c / 2 + j) * ldk + t0, r[j]);
        continue;
      }
      for (int64_t j = 0; j < 16 && c + 2 * j < hd; ++j) {
        const __m512i w = _mm512_castps_si512(r[j]);
        _mm512_storeu_ps(kt + (c + 2 * j) * ldk + t0, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
        _mm512_storeu_ps(kt + (c + 2 * j + 1) * ldk + t0, _mm512_castsi512_ps(_mm512_and_si512(w, top)));
      }
    }
  }
}

// Keeps v in a register, so that one load feeds several FMAs: GCC folds a copy of the load into
// each FMA instead, and twice the loads made the loops load-bound.
inline void in_register(__m512& v) {
#ifndef QSPEC_ISA_EMULATION  // an emulated __m512 is not a vector register
  asm("" : "+v"(v));
#endif
}

// Scores (unscaled) of P pairs (q rows) x KB blocks of 16 keys (columns kt[d · ldk + 16 kb ..]):
// per lane one FMA chain over d = 0 .. hd - 1 in order; out[p · KB + kb]. P · KB <= 12 chains in
// flight (two FMAs a cycle at a latency of 4 need 8).
// BF (the avx512_bf16 path): q[p] and kt hold BF16 pairs (dwords), one vdpbf16ps chain per lane
// over the dim pairs dp = 0 .. hd / 2 - 1 in order.
template <int P, int KB, bool BF>
void scores_t(const float* const* q, const float* kt, int64_t ldk, int64_t hd, __m512* out) {
  __m512 acc[P][KB];
  for (int p = 0; p < P; ++p)
    for (int b = 0; b < KB; ++b) acc[p][b] = _mm512_setzero_ps();
  for (int64_t d = 0; d < (BF ? hd / 2 : hd); ++d) {
    __m512 k[KB];
    for (int b = 0; b < KB; ++b) {
      k[b] = _mm512_loadu_ps(kt + d * ldk + 16 * b);
      if constexpr (P > 1) in_register(k[b]);
    }
    for (int p = 0; p < P; ++p) {
      const __m512 qd = _mm512_set1_ps(q[p][d]);  // BF: the pair's bits, moved as they are
      for (int b = 0; b < KB; ++b) {
        if constexpr (BF) acc[p][b] = _mm512_dpbf16_ps(acc[p][b], (__m512bh)k[b], (__m512bh)qd);
        else acc[p][b] = _mm512_fmadd_ps(qd, k[b], acc[p][b]);
      }
    }
  }
  for (int p = 0; p < P; ++p)
    for (int b = 0; b < KB; ++b) out[p * KB + b] = acc[p][b];
}

constexpr int kMaxChains = 12;
using ScoresFn = void (*)(const float* const*, const float*, int64_t, int64_t, __m512*);
template <int P, int KB, bool BF>
constexpr ScoresFn scores_or_null() {
  if constexpr (P * KB <= kMaxChains) return scores_t<P, KB, BF>;
  else return nullptr;
}
// kScores<BF>[P - 1][KB - 1], P <= 12, KB <= 4, P · KB <= kMaxChains.
template <bool BF, int... I>
constexpr auto scores_table(std::integer_sequence<int, I...>) {
  return std::array<std::array<ScoresFn, 4>, sizeof...(I)>{{{scores_or_null<I + 1, 1, BF>(), scores_or_null<I + 1, 2, BF>(),
                                                              scores_or_null<I + 1, 3, BF>(), scores_or_null<I + 1, 4, BF>()}...}};
}
template <bool BF>
constexpr auto kScores = scores_table<BF>(std::make_integer_sequence<int, kMaxChains>{});

// Pass 3 for NC·16 columns of NP pairs over keys [j0, e) of the current V super-block (row 0 =
// key b0); running sums in accp[p] between super-blocks (one FMA chain per column over keys 0..p
// in order). Two pairs at once share each V load and keep 16 chains in flight (one pair's 8 are
// at the FMA latency's limit).
// BF (the avx512_bf16 path): j counts key pairs, w[p][j] is the BF16 weight pair of keys 2j, 2j + 1
// (one dword) and vbuf row j - b0 the two keys' V rows interleaved (stage_v_pairs): one vdpbf16ps
// chain per column over the key pairs in order.
template <int NP, int NC, bool BF = false>
inline void v_block(const float* const* w, const float* vbuf, int64_t hd, int64_t b0, int64_t j0,
                    int64_t e, float* const* accp) {
  __m512 acc[NP][NC];
  for (int p = 0; p < NP; ++p)
    for (int c = 0; c < NC; ++c) acc[p][c] = _mm512_loadu_ps(accp[p] + c * 16);
  for (int64_t j = j0; j < e; ++j) {
    __m512 wj[NP];
    for (int p = 0; p < NP; ++p) wj[p] = _mm512_set1_ps(w[p][j]);
    const float* vj = vbuf + (j - b0) * hd;
    for (int c = 0; c < NC; ++c) {
      __m512 v = _mm512_loadu_ps(vj + c * 16);
      if constexpr (NP > 1) in_register(v);
      for (int p = 0; p < NP; ++p) {
        if constexpr (BF) acc[p][c] = _mm512_dpbf16_ps(acc[p][c], (__m512bh)v, (__m512bh)wj[p]);
        else acc[p][c] = _mm512_fmadd_ps(wj[p], v, acc[p][c]);
      }
    }
  }
  for (int p = 0; p < NP; ++p)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(accp[p] + c * 16, acc[p][c]);
}

// The avx512_bf16 path's V staging: dst[i · hd + c] (dwords) = the BF16 pair (V[key 2i][c],
// V[key 2i + 1][c]) for i < (nk + 1) / 2, key nk zero when nk is odd; hd a multiple of 32. Rows
// ahead[t · stride], t < n_ahead, are prefetched one per row staged.
template <class Row>
void stage_v_pairs(Row&& row, int64_t nk, int64_t hd, float* dst, const uint16_t* ahead = nullptr,
                   int64_t stride = 0, int64_t n_ahead = 0) {
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                      37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int64_t i = 0; 2 * i < nk; ++i) {
    for (int64_t t = 2 * i; t < 2 * i + 2 && t < n_ahead; ++t) prefetch_row(ahead + t * stride, hd);
    const uint16_t* r0 = row(2 * i);
    const uint16_t* r1 = 2 * i + 1 < nk ? row(2 * i + 1) : nullptr;
    float* d = dst + i * hd;
    for (int64_t c = 0; c < hd; c += 32) {
      const __m512i a = _mm512_loadu_si512(r0 + c);
      const __m512i b = r1 ? _mm512_loadu_si512(r1 + c) : _mm512_setzero_si512();
      _mm512_storeu_si512(d + c, _mm512_permutex2var_epi16(a, lo, b));
      _mm512_storeu_si512(d + c + 16, _mm512_permutex2var_epi16(a, hi, b));
    }
  }
}

// dst (n / 2 dwords, n even) = src[0 .. n) rounded to BF16 pairs (vcvtne2ps2bf16). dst may be src
// (in place: each step writes below what it has read).
inline void round_bf16_pairs(const float* src, int64_t n, float* dst) {
  for (int64_t j = 0; j < n; j += 32) {
    const __mmask16 m0 = n - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - j)) - 1u);
    const __mmask16 m1 = n - j >= 32 ? __mmask16(0xFFFF) : n - j > 16 ? __mmask16((1u << (n - j - 16)) - 1u) : 0;
    const __m512 x0 = _mm512_maskz_loadu_ps(m0, src + j), x1 = _mm512_maskz_loadu_ps(m1, src + j + 16);
    const int64_t pairs = (n - j + 1) / 2;
    const __mmask16 mp = pairs >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << pairs) - 1u);
    _mm512_mask_storeu_epi32(dst + j / 2, mp, (__m512i)_mm512_cvtne2ps_pbh(x1, x0));
  }
}

// The last 8 columns when head_dim % 16 == 8 (lanes 8..15 zero).
inline void v_block8(const float* w, const float* vbuf, int64_t hd, int64_t b0, int64_t j0, int64_t e,
                     float* accp) {
  __m512 acc = _mm512_maskz_loadu_ps(0x00FF, accp);
  for (int64_t j = j0; j < e; ++j)
    acc = _mm512_fmadd_ps(_mm512_set1_ps(w[j]), _mm512_maskz_loadu_ps(0x00FF, vbuf + (j - b0) * hd),
                          acc);
  _mm512_mask_storeu_ps(accp, 0x00FF, acc);
}

template <int HD, bool BF>
void group_impl(const AttnArgs& a, int64_t kvh, int64_t u0, int64_t u1, int64_t seg,
                const AttnPartials& part) {
  const int64_t hd = HD > 0 ? HD : a.kv.head_dim;
  const int64_t G = a.n_heads / a.kv.kv_heads;
  const int64_t np = u1 - u0;
  if (np <= 0) return;
  const int64_t stride = a.kv.row_elems();
  // This call's keys: segment [kbeg, kcap) up to the last row's position.
  const int64_t kbeg = seg * kAttnSegKeys, kcap = kbeg + kAttnSegKeys;
  const int64_t n_max = attn_unit_keys(a, u0, u1, seg);
  if (n_max <= kbeg) return;
  // Keys [kbeg, n_sh) are streamed once for all pairs; a tree row's keys [t0, n) after them
  // (its path, plus < 8 prefix keys) are gathered per row into tbuf. Linear: n_sh = n_max.
  const int64_t n_sh = attn_shared_end(a, n_max);
  const int64_t t0 = n_sh > kbeg ? n_sh : kbeg;
  const int64_t tb = n_max > t0 ? round16(n_max - t0) : 0;
  const int64_t sc_stride = round8(n_max) + 16;
  int64_t kb = (4096 / hd) & ~int64_t(7);  // keys per super-block: ~16 KB of FP32
  if (kb < 8) kb = 8;
  const int64_t ldk = round16(kb);  // the transposed K block's keys

  // Scratch: K (transposed) / V super-block | scores per pair | V accumulators per pair | running
  // max per pair | tree tail | BF: q rounded to BF16 pairs.
  const int64_t qb_size = BF ? np * hd / 2 : 0;
  float* buf = scratch_floats(ldk * hd + np * sc_stride + np * hd + np * 8 + tb * hd + qb_size + 64);
  float* kvbuf = buf;
  float* scores = kvbuf + ldk * hd;
  float* accs = scores + np * sc_stride;
  float* vmaxs = accs + np * hd;
  float* tbuf = vmaxs + np * 8;
  float* qb = tbuf + tb * hd;

  auto row_of = [&](int64_t u) { return (u0 + u) / G; };
  auto head_of = [&](int64_t u) { return kvh * G + (u0 + u) % G; };
  auto n_full = [&](int64_t u) { return attn_row_pos(a, row_of(u)) + 1; };  // keys 0..p
  auto n_of = [&](int64_t u) { return n_full(u) < kcap ? n_full(u) : kcap; };  // in this segment

  for (int64_t u = 0; u < np; ++u) _mm256_storeu_ps(vmaxs + u * 8, _mm256_set1_ps(-INFINITY));
  if constexpr (BF)
    for (int64_t u = 0; u < np; ++u)
      round_bf16_pairs(a.q + (row_of(u) * a.n_heads + head_of(u)) * hd, hd, qb + u * (hd / 2));

  // Scores of pairs [ua, ua + P) over the keys of kt (lane t = key k0 + t, t < nk; ldk floats a
  // dim), · scale, stored at each pair's keys below min(k0 + nk, its n), with its running max.
  const __m512 vscale = _mm512_set1_ps(a.scale);
  auto score_group = [&](int64_t ua, int P, const float* kt, int64_t ld, int64_t k0, int64_t nk) {
    const float* q[kMaxChains];
    for (int p = 0; p < P; ++p)
      q[p] = BF ? qb + (ua + p) * (hd / 2) : a.q + (row_of(ua + p) * a.n_heads + head_of(ua + p)) * hd;
    const int kbmax = kMaxChains / P < 4 ? kMaxChains / P : 4;  // 16-key blocks a step
    for (int64_t c = 0; c < nk; c += 16 * kbmax) {
      const int KB = int((nk - c + 15) / 16 < kbmax ? (nk - c + 15) / 16 : kbmax);
      __m512 acc[kMaxChains];
      kScores<BF>[P - 1][KB - 1](q, kt + c, ld, hd, acc);
      for (int p = 0; p < P; ++p) {
        const int64_t u = ua + p, n = n_of(u), e = n < k0 + nk ? n : k0 + nk;
        __m512 vm = _mm512_set1_ps(-INFINITY);
        for (int b = 0; b < KB; ++b) {
          const int64_t j = k0 + c + 16 * b, live = e - j;  // lanes [0, live): the pair's keys
          if (live <= 0) break;
          const __mmask16 mk = live >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << live) - 1u);
          const __m512 sv = _mm512_mul_ps(acc[p * KB + b], vscale);
          _mm512_mask_storeu_ps(scores + u * sc_stride + j, mk, sv);
          vm = _mm512_mask_max_ps(vm, mk, vm, sv);
        }
        const __m256 v8 = _mm256_max_ps(_mm512_castps512_ps256(vm), _mm512_extractf32x8_ps(vm, 1));
        _mm256_storeu_ps(vmaxs + u * 8, _mm256_max_ps(_mm256_loadu_ps(vmaxs + u * 8), v8));
      }
    }
  };
  // Pairs [ua, ub) in groups as even as they go: each group x its blocks of 16 keys keeps 8-12
  // FMA chains in flight (6 pairs x 32 keys, or 3 x 64).
  const int pmax = int(kMaxChains / std::min<int64_t>(ldk / 16, 4));
  auto score_pairs = [&](int64_t ua, int64_t ub, const float* kt, int64_t ld, int64_t k0, int64_t nk) {
    const int64_t n = ub - ua, groups = (n + pmax - 1) / pmax;
    for (int64_t g = 0, u = ua; g < groups; ++g) {
      const int P = int(n / groups + (g < n % groups ? 1 : 0));
      score_group(u, P, kt, ld, k0, nk);
      u += P;
    }
  };

  // Tree tail of pair u's row: logical keys [t0, n) into tbuf (zero-padded to 8), as the
  // super-block would hold them; once per row (a row's pairs are consecutive).
  int64_t tail_row = -1;
  auto load_tail = [&](int64_t u, int kv_index) {
    if (row_of(u) == tail_row) return;
    tail_row = row_of(u);
    const int64_t n = n_of(u);
    for (int64_t j = t0; j < n; ++j) {
      const int64_t slot = attn_key_slot(a, tail_row, j);
      const uint16_t* src = (kv_index ? a.kv.v(a.layer, slot) : a.kv.k(a.layer, slot)) + kvh * hd;
      convert_block(src, stride, 1, 1, hd, tbuf + (j - t0) * hd);
    }
    convert_block(nullptr, stride, 0, round8(n - t0) - (n - t0), hd, tbuf + (n - t0) * hd);
  };

  // Pass 1: stream K once, each block transposed for all pairs.
  for (int64_t b0 = kbeg, b1; b0 < n_sh; b0 = b1) {
    b1 = attn_block_end(a, b0, kb, n_sh);  // within one page
    const uint16_t* k0 = a.kv.k(a.layer, b0) + kvh * hd;
    // the next block's K rows (after the last one: the first V block's) on their way meanwhile
    const int64_t nb0 = b1 < n_sh ? b1 : kbeg, nb1 = attn_block_end(a, nb0, kb, n_sh);
    const uint16_t* next = (b1 < n_sh ? a.kv.k(a.layer, nb0) : a.kv.v(a.layer, nb0)) + kvh * hd;
    transpose_block<BF>([&](int64_t t) { return k0 + t * stride; }, b1 - b0, hd, kvbuf, ldk, next, stride, nb1 - nb0);
    int64_t ua = 0;  // leading pairs with no key in this block are skipped (others: masked per pair)
    while (ua < np && n_of(ua) <= b0) ++ua;
    score_pairs(ua, np, kvbuf, ldk, b0, b1 - b0);
  }
  if (tb > 0)  // each tree row's tail, transposed once for its pairs
    for (int64_t u = 0; u < np;) {
      const int64_t r = row_of(u), n = n_of(u);
      int64_t ue = u;
      while (ue < np && row_of(ue) == r) ++ue;
      if (n > t0) {
        transpose_block<BF>([&](int64_t t) { return a.kv.k(a.layer, attn_key_slot(a, r, t0 + t)) + kvh * hd; },
                            n - t0, hd, tbuf, tb);
        score_pairs(u, ue, tbuf, tb, t0, n - t0);
      }
      u = ue;
    }

  // Pass 2: per pair, over its own keys of this segment; Σ and the max go to lanes 0 and 1 of
  // the pair's max slot.
  float* sums = vmaxs;
  for (int64_t u = 0; u < np; ++u) {
    if (n_of(u) <= kbeg || attn_key_lo(a, row_of(u)) >= kcap) continue;
    const float max_s = attn_window_max(scores + u * sc_stride, kbeg, n_of(u), attn_key_lo(a, row_of(u)),
                                        avx512::hmax8(_mm256_loadu_ps(vmaxs + u * 8)));
    sums[u * 8] = avx512::exp_pass(scores + u * sc_stride + kbeg, n_of(u) - kbeg, max_s);
    sums[u * 8 + 1] = max_s;
    if constexpr (BF)  // pair i (keys 2i, 2i + 1) at float i of the pair's row; key n_of(u) weighs 0
      round_bf16_pairs(scores + u * sc_stride + kbeg, n_of(u) - kbeg, scores + u * sc_stride + kbeg / 2);
  }

  // Pass 3: stream V once.
  for (int64_t x = 0; x < np * hd; x += 8) _mm256_storeu_ps(accs + x, _mm256_setzero_ps());
  // Pairs u and u + np2 - 1 (np2 = 1 or 2) over keys [j0, e) of vb (row 0 = key b0); BF: over the
  // key pairs [j0, e) of vb (row 0 = pair b0), in these units from here on.
  auto v_keys = [&](int64_t u, int np2, const float* vb, int64_t b0, int64_t j0, int64_t e) {
    const float* w[2] = {scores + u * sc_stride, scores + (u + np2 - 1) * sc_stride};
    float* accp[2] = {accs + u * hd, accs + (u + np2 - 1) * hd};
    auto step = [&](auto nc, int64_t d) {
      constexpr int NC = decltype(nc)::value;
      float* ap[2] = {accp[0] + d, accp[1] + d};
      if (np2 == 2) v_block<2, NC, BF>(w, vb + d, hd, b0, j0, e, ap);
      else v_block<1, NC, BF>(w, vb + d, hd, b0, j0, e, ap);
    };
    int64_t d = 0;
    for (; d + 128 <= hd; d += 128) step(std::integral_constant<int, 8>{}, d);
    if (d + 64 <= hd) step(std::integral_constant<int, 4>{}, d), d += 64;
    if (d + 32 <= hd) step(std::integral_constant<int, 2>{}, d), d += 32;
    if (d + 16 <= hd) step(std::integral_constant<int, 1>{}, d), d += 16;
    for (int p = 0; p < np2 && d + 8 <= hd; ++p) v_block8(w[p], vb + d, hd, b0, j0, e, accp[p] + d);
  };
  // Every pair over keys [b0, min(b1, its n)) of vb, two at a time: the keys both have together,
  // then the longer one's rest (each pair's chains still run over its keys in order).
  auto v_pairs = [&](const float* vb, int64_t kb0, int64_t kb1) {
    const int64_t b0 = BF ? kb0 / 2 : kb0;  // kb0 is even
    auto end_of = [&](int64_t u) {
      const int64_t e = kb1 < n_of(u) ? kb1 : n_of(u);
      return BF ? (e + 1) / 2 : e;  // a pair's odd end: its key e weighs 0
    };
    for (int64_t u = 0; u < np; u += 2) {
      const int64_t e0 = end_of(u), e1 = u + 1 < np ? end_of(u + 1) : b0;
      const int64_t both = std::max(b0, std::min(e0, e1));  // [b0, both): keys of both pairs
      if (both > b0) v_keys(u, 2, vb, b0, b0, both);
      if (e0 > both) v_keys(u, 1, vb, b0, both, e0);
      if (e1 > both) v_keys(u + 1, 1, vb, b0, both, e1);
    }
  };
  for (int64_t b0 = kbeg, b1; b0 < n_sh; b0 = b1) {
    b1 = attn_block_end(a, b0, kb, n_sh);
    const int64_t nb1 = b1 < n_sh ? attn_block_end(a, b1, kb, n_sh) : b1;
    const uint16_t* v0 = a.kv.v(a.layer, b0) + kvh * hd;
    const uint16_t* next = b1 < n_sh ? a.kv.v(a.layer, b1) + kvh * hd : nullptr;
    if constexpr (BF) stage_v_pairs([&](int64_t t) { return v0 + t * stride; }, b1 - b0, hd, kvbuf, next, stride, nb1 - b1);
    else convert_block(v0, stride, b1 - b0, b1 - b0, hd, kvbuf, next, nb1 - b1);
    v_pairs(kvbuf, b0, b1);
  }
  tail_row = -1;
  if (tb > 0)
    for (int64_t u = 0; u < np; ++u) {
      const int64_t n = n_of(u);
      if (n <= t0) continue;
      if constexpr (BF) {  // t0 is a multiple of 8
        if (row_of(u) != tail_row) {
          tail_row = row_of(u);
          stage_v_pairs([&](int64_t t) { return a.kv.v(a.layer, attn_key_slot(a, tail_row, t0 + t)) + kvh * hd; },
                        n - t0, hd, tbuf);
        }
        v_keys(u, 1, tbuf, t0 / 2, t0 / 2, (n + 1) / 2);
      } else {
        load_tail(u, 1);
        v_keys(u, 1, tbuf, t0, t0, n);
      }
    }

  // Single-segment pairs: out = acc · (1/Σ); others: this segment's partial (unnormalized).
  for (int64_t u = 0; u < np; ++u) {
    if (n_of(u) <= kbeg || attn_key_lo(a, row_of(u)) >= kcap) continue;  // below its window: no partial
    float* out;
    __m256 vinv;
    if (n_full(u) <= kAttnSegKeys) {
      out = a.out + (row_of(u) * a.n_heads + head_of(u)) * hd;
      vinv = _mm256_set1_ps(1.f / sums[u * 8]);
    } else {
      float* pp = part.at(a, row_of(u), head_of(u), seg);
      pp[0] = sums[u * 8 + 1];
      pp[1] = sums[u * 8];
      out = pp + 2;
      vinv = _mm256_set1_ps(1.f);
    }
    for (int64_t d = 0; d < hd; d += 8)
      _mm256_storeu_ps(out + d, _mm256_mul_ps(_mm256_loadu_ps(accs + u * hd + d), vinv));
  }
}

}  // namespace

namespace {
template <bool BF>
void group_by_head_dim(const AttnArgs& a, int64_t kvh, int64_t u_begin, int64_t u_end, int64_t seg,
                       const AttnPartials& part) {
  switch (a.kv.head_dim) {
    case 64: group_impl<64, BF>(a, kvh, u_begin, u_end, seg, part); break;
    case 128: group_impl<128, BF>(a, kvh, u_begin, u_end, seg, part); break;
    default: group_impl<0, BF>(a, kvh, u_begin, u_end, seg, part); break;
  }
}
}  // namespace

void attn_group_avx512(const AttnArgs& a, int64_t kvh, int64_t u_begin, int64_t u_end,
                       int64_t seg, const AttnPartials& part) {
  group_by_head_dim<false>(a, kvh, u_begin, u_end, seg, part);
}

void attn_group_avx512_bf16(const AttnArgs& a, int64_t kvh, int64_t u_begin, int64_t u_end,
                            int64_t seg, const AttnPartials& part) {
  group_by_head_dim<true>(a, kvh, u_begin, u_end, seg, part);
}

void attn_fold_rows_avx512(float* st, const float* ps, int64_t n, float wa, float wb) {
  const __m512 va = _mm512_set1_ps(wa), vb = _mm512_set1_ps(wb);
  for (int64_t c = 0; c < n; c += 16) {
    const __mmask16 m = n - c >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - c)) - 1);
    const __m512 x = _mm512_maskz_loadu_ps(m, st + c), p = _mm512_maskz_loadu_ps(m, ps + c);
    _mm512_mask_storeu_ps(st + c, m, _mm512_fmadd_ps(p, vb, _mm512_mul_ps(x, va)));
  }
}

}  // namespace qspec
