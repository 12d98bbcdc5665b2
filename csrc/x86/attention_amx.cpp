// AMX-BF16 attention (the amx level): QKᵀ and PV of one call's (row, head) pairs of ONE KV head
// on tiles (attention.h's driver, segments and partials are unchanged). Same three passes as
// attention_avx512.cpp; what differs is how the two products are summed.
//
// BF16 operands, as BF16 flash attention has them (PyTorch's CPU kernel, transformers in BF16):
// K and V are BF16 already; each q element (FP32) and each softmax weight w = exp(s - m) (FP32,
// m the max of the pair's keys in this segment) are rounded to nearest BF16 for the products, and
// TDPBF16PS sums them in FP32; Σ w (the normaliser) is summed from the unrounded weights. What it
// costs: a weight's rounding moves an output by at most 2^-9 · max|V| (the V rows are BF16
// already, 2^-9 each), q's moves the scores by about 2^-9 of Σ|q_d · k_d| (a q of amplitude 30,
// scores in the hundreds: up to ~1% in an output). Against the float64 oracle over random caches
// (tests/test_attention.py models these roundings) the outputs are otherwise FP32-exact. Qwen2.5-
// Coder-1.5B's final logits against transformers in FP32 (14 prompts of 35-3,000 tokens, model-167
// Xeon): max |Δ| median 0.069 / max 0.089, against 0.066 / 0.096 with q and w kept to 24 and 17
// bits (three and two BF16 parts, the previous version of this file), the argmax the same for
// all: the BF16 cache and the BF16 activations of the GEMMs (gemm.h) dominate. Both products need
// a third and a half of the TDPBF16PS, tile loads and split work they took with parts: an 8,192-
// row prefill's attention 1.44-1.47x faster (`_C.attention` over a synthetic cache, the last 2,048
// rows of 8,192, 2 threads, builds alternated). The FMA paths (avx2, avx512) keep FP32 q and
// weights. AMX flushes BF16 denormals (VCVTNE2PS2BF16 reads FP32 denormals as 0): weights below
// 2^-126 are lost.
//
//   scores  Sᵀ[key][pair] = Σ_c K[key][32c ..] · q[pair][32c ..]: A = 16 keys × 32 columns of K
//           (staged BF16 rows), B = the pairs' q (VNNI pairs of columns), C = 16 keys × 16 pairs;
//           chunks c of 32 columns in order. A score depends on its q and its key's row only
//           (never on which keys or pairs share a tile), so key blocks may start anywhere.
//   values  out[pair][col] = Σ_blocks w[pair][32 keys] · V[32 keys][col]: A = 16 pairs × a 32-key
//           block of the weights, B = the block's V rows as VNNI key pairs, C = 16 pairs × 16
//           columns, ONE chain per element through the segment: blocks of 32 keys counted from
//           key 0 in key order. Keys a pair does not attend carry weight 0 (exact zero
//           products), and adding zero products leaves a C element as it is: TDPBF16PS flushes
//           denormal results (inputs too), so a C element is never denormal and never -0
//           (checked on the hardware: a -2^-140 product gives +0). So a pair's sums are those of
//           its own blocks, whatever pairs share its tile and however far their keys run.
// Each C row reads only its own A row (the SDM's TDPBF16PS), so a pair's bits do not depend on
// m, the other pairs of its tile, the thread count or how the driver grouped pairs: the batch
// invariance of attention.h holds, and the choice of this path depends on the ISA level only
// (attn_choose). Tree rows: the keys every row shares (the prefix rounded down to 32) are
// streamed for all pairs; each row's remaining logical keys are gathered from their slots into
// the same 32-key blocks from key 0 and continue its chain, so a tree row's arithmetic is a
// linear row's at its position.
//
// Tiles and the vector work around them. A tile load costs about what a TDPBF16PS does (more
// from L2): scores hold a chunk's q in B tile 7 for up to 4 key blocks' K chunks (A, tile 4);
// values hold two tile blocks' weights in A tiles 4-5 for 2 column tiles' V (B, tile 7; a block
// alone: 4 column tiles), each V tile read from the staged segment in L2 once for two blocks
// (1.03x on an 8k prefill's attention over one block a V tile). Per unit (driver's
// run_chunk_units) q is rounded into B tiles once for all its segments (16 pairs at a time, a
// 16 x 16 dword transpose into the B layout); scores and weights are kept per segment; a score
// tile is transposed back so each pair's 16 scores are one vector (scale, masked store, running
// max in 16 lanes); the weights are rounded 32 keys per vector step. A block's weights for the
// whole segment are made before its chains, and V of the segment's blocks is staged once for
// all tile blocks.
//
// Checked against the float64 oracle, for batch invariance and tree == linear rows on a Sapphire
// Rapids VM and under emulation (tests/test_isa_emulation.py). Speed there (`qspec bench
// attention --contexts 2048,8192 --ms 1,16 --prefill --paths avx512,amx`, 2 threads,
// Qwen2.5-Coder-1.5B's 12/2 heads of 128, read bandwidth ~30 GB/s): see the README's long-prompt
// section for the current figures. Tried and measured no faster, so not kept: K read in
// place from the cache, prefetching the next work unit's K/V during this unit's tile and vector
// work (4-15% slower for decode rows), extracting one group's score tiles while the next
// group's TDPBF16PS run (2 x 4 C tile buffers), scores as pairs x
// keys (q as A rows, K transposed into B tiles when staged, no score transposes; the same
// bits: level at 2k, 4% slower at 8k, 15% slower for one decode row). Decode and verify
// rows wait on the cache rows their staging copies read (perf: ~75% of one row's kernel at 8k
// keys): K rows are prefetched 16 keys ahead of the copy and V rows one 32-key block ahead
// (one row at 8,192 keys 5-8% faster, 9 rows 3-11%; a whole prompt level). Units of a prefill
// are 384 pairs (attention.cpp, kAttnUnitPairsAmx): perf of an 8,192-row prefill with 96 showed a
// sixth of the time in the K staging copy and its prefetches (K/V of a layer re-read from L3 by
// every unit). The exponentials (softmax_exp: 2^t by vscalefps) run per tile block right before
// its chains, fused with their rounding to BF16 (no FP32 weights stored and re-read); with the
// score extraction reading its bounds through locals, an 8,192-row prefill's attention ran
// 1.12-1.18x faster (model-167 Xeon, 2 threads, one layer's `_C.attention` call, alternating
// builds). Knocking the exponentials out of a throwaway build took another 15% off: the vector
// work is on the critical path beside the tiles. Tried and no faster: making the next tile
// block's weights a pair at a time between this block's V blocks (the exponentials interleaved
// with the TDPBF16PS they could overlap; again later as 32-key steps after every column's
// TDPBF16PS, the weights double-buffered: level), larger prefill units (768, 1,536 pairs), and the segment
// fold's V sums in 512-bit vectors alone. Throwaway loops on the model-167 Xeon show why: the
// tile unit and the vector units do overlap when the instruction stream interleaves them a few
// TDPBF16PS at a time (48 TDPBF16PS and 4 score tiles' extraction: 741 and 194 TSC cycles alone,
// 993 one after the other, 798 interleaved), but not when the B tiles come from L2 (each V tile
// here is read once per tile block from the 64 KB staged segment: 34 and 32 cycles a column
// alone, 66 interleaved). What did pay: the segment fold. Each pair's segment (1.6 M a
// layer at 8k) was copied into a partial, read back by the driver and folded by scalar SSE code
// with two exps; it is now folded here straight from the V sums (part.states, run_chunk_units),
// 512 bits wide, exp(0) = 1 not computed: 1.08-1.12x on the whole 8k prefill attention.
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "amx_tiles.h"
#include "attention.h"
#include "vec_avx512.h"

namespace qspec {
namespace {

constexpr int64_t kTile = 16;      // rows of every tile; keys of a score block
constexpr int64_t kVKeys = 32;     // keys of a value block (one A tile row of BF16)
constexpr int64_t kTileElems = 512;  // BF16 elements of one 16 x 64-byte tile

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// 32 softmax weights r0 (keys 0-15), r1 (16-31) rounded to BF16 (nearest even, VCVTNE2PS2BF16:
// a denormal weight, below 2^-126, becomes 0, as TDPBF16PS would flush it) into dst[0 .. 32), a
// row of the weights' A tile.
inline void round32(__m512 r0, __m512 r1, uint16_t* dst) {
  const __m512bh w = _mm512_cvtne2ps_pbh(r1, r0);  // keys 0-15 in the low half
  std::memcpy(dst, &w, 64);
}
// The same for x[0 .. e) (e <= 32; zeros from e); x is only read when e > 0.
inline void round32(const float* x, int64_t e, uint16_t* dst) {
  const __mmask16 m0 = e >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (e > 0 ? e : 0)) - 1u);
  const __mmask16 m1 = e >= 32 ? __mmask16(0xFFFF) : e <= 16 ? __mmask16(0) : __mmask16((1u << (e - 16)) - 1u);
  round32(_mm512_maskz_loadu_ps(m0, x), _mm512_maskz_loadu_ps(m1, x + 16), dst);
}

// Softmax weights exp(x - max) = 2^t, t = (x - max) · log2(e) = n + f (n nearest, |f| <= 1/2): 2^f
// by its degree-6 Taylor polynomial (relative error < 2^-22, far below the weight's BF16 rounding)
// scaled by 2^n with vscalefps (12 vector operations against avx512::exp's 18 and a subtraction).
// Lanes outside `live`, a NaN and x - max < -87 give 0: a masked key (-inf) weighs nothing, and
// no weight is denormal (AMX would flush it).
inline __m512 softmax_exp(__m512 x, __m512 vmax, __mmask16 live) {
  const __m512 d = _mm512_sub_ps(x, vmax);
  const __mmask16 keep = live & _mm512_cmp_ps_mask(d, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
  const __m512 t = _mm512_mul_ps(d, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.54035304e-4f);               // ln2^6 / 6!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.33335581e-3f));  // ln2^5 / 5!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.61812911e-3f));  // ln2^4 / 4!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.55041087e-2f));  // ln2^3 / 3!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.40226507e-1f));  // ln2^2 / 2!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.93147181e-1f));  // ln2
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_maskz_scalef_ps(keep, p, n);
}

// n BF16 values (one head's K row; a library memcpy of a run-time size costs a call per key).
inline void copy_bf16(uint16_t* dst, const uint16_t* src, int64_t n) {
  for (int64_t c = 0; c < n; c += 32) {
    const __mmask32 m = n - c >= 32 ? __mmask32(0xFFFFFFFFu) : __mmask32((1u << (n - c)) - 1u);
    _mm512_mask_storeu_epi16(dst + c, m, _mm512_maskz_loadu_epi16(m, src + c));
  }
}

using avx512::prefetch_row;
constexpr int64_t kPrefetchKeys = 16;  // K rows prefetched this many keys ahead of the copy

inline __mmask16 first_lanes(int64_t n) {  // lanes [0, n), n clamped to [0, 16]
  return n >= 16 ? __mmask16(0xFFFF) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1);
}

using detail::amx::tile_dpbf16;
using detail::amx::tile_load;
using detail::amx::tile_store;
using detail::amx::tile_zero;
using detail::amx::unrolled;

constexpr int64_t kStageKeys = 64;  // keys staged per score step: up to 4 key blocks in tiles at once

// Scores Sᵀ of KB staged key blocks (16 keys each, from ks) x one tile block b of pairs into the
// C tiles 0 .. KB-1, stored to ct (256 floats each, tile kb). Per 32-column chunk c the block's
// q (B, tile 7) feeds each key block's K chunk (A, tile 4): every C tile sums chunk by chunk in
// column order. A C tile's sums never depend on the other tiles in flight.
template <int KB>
void score_tiles(const uint16_t* ks, int64_t hdp, const uint16_t* qb, int64_t b, int64_t nch, float* ct) {
  static_assert(KB >= 1 && KB <= 4, "4 C tiles");
  unrolled<KB>([](auto t) { tile_zero<decltype(t)::value>(); });
  for (int64_t c = 0; c < nch; ++c) {
    tile_load<7>(qb + (b * nch + c) * kTileElems, 64);
    unrolled<KB>([&](auto kb) {
      constexpr int K = decltype(kb)::value;
      tile_load<4>(ks + K * kTile * hdp + c * 32, hdp * 2);
      tile_dpbf16<K, 4, 7>();
    });
  }
  unrolled<KB>([&](auto t) {
    constexpr int T = decltype(t)::value;
    tile_store<T>(ct + T * 256, 64);
  });
}

// V sums of NB tile blocks x NC column tiles (C tile (CB + i) · NC + c for block i, column c; one
// chain each: chain_begin, chain_blocks ..., chain_end). Block i's weights stay in A tile 4 + i
// (ws + i · ws_stride: [16 pairs][width] BF16, block jb at column 32 jb) for the NC columns' B
// tiles (7: vs + jb · vblock + c · 512), each V tile feeding NB TDPBF16PS: the staged segment's
// V (64 KB at head_dim 128) comes from L2, at 1 KB a TDPBF16PS more than L2 delivers.
template <int N>
void chain_begin() {
  static_assert(N >= 1 && N <= 4, "4 C tiles");
  unrolled<N>([](auto t) { tile_zero<decltype(t)::value>(); });
}
template <int NB, int NC, int CB = 0>
void chain_blocks(const uint16_t* ws, int64_t ws_stride, int64_t width, int64_t nb, const uint16_t* vs,
                  int64_t vblock) {
  static_assert(NB >= 1 && NB <= 2 && (CB + NB) * NC <= 4, "4 C tiles, A tiles 4-5");
  for (int64_t jb = 0; jb < nb; ++jb) {
    unrolled<NB>([&](auto i) { tile_load<4 + decltype(i)::value>(ws + i * ws_stride + jb * kVKeys, width * 2); });
    unrolled<NC>([&](auto c) {
      constexpr int C = decltype(c)::value;
      tile_load<7>(vs + jb * vblock + C * kTileElems, 64);
      unrolled<NB>([&](auto i) {
        constexpr int I = decltype(i)::value;
        tile_dpbf16<(CB + I) * NC + C, 4 + I, 7>();
      });
    });
  }
}
// C tile (CB + i) · NC + c -> out + i · out_stride + c · 16, 16 rows ld floats apart.
template <int NB, int NC, int CB = 0>
void chain_end(float* out, int64_t out_stride, int64_t ld) {
  unrolled<NB>([&](auto i) {
    unrolled<NC>([&](auto c) {
      constexpr int I = decltype(i)::value, C = decltype(c)::value;
      tile_store<(CB + I) * NC + C>(out + I * out_stride + C * 16, ld * 4);
    });
  });
}

void group_impl(const AttnArgs& a, int64_t kvh, int64_t u0, int64_t u1, int64_t seg,
                const AttnPartials& part) {
  const int64_t hd = a.kv.head_dim, hdp = round_up(hd, 32);
  const int64_t G = a.n_heads / a.kv.kv_heads;
  const int64_t np = u1 - u0;
  if (np <= 0) return;
  const int64_t kbeg = seg * kAttnSegKeys, kcap = kbeg + kAttnSegKeys;
  const int64_t n_max = attn_unit_keys(a, u0, u1, seg);
  if (n_max <= kbeg) return;
  // Keys [kbeg, n_sh) are streamed for every pair; a tree row's logical keys [t0, n) are
  // gathered per row (t0 a multiple of 32: value blocks never mix the two).
  const int64_t shared = a.tree ? a.tree->prefix & ~(kVKeys - 1) : n_max;
  const int64_t n_sh = shared < n_max ? shared : n_max;
  const int64_t t0 = n_sh > kbeg ? n_sh : kbeg;
  const int64_t nblk = round_up(np, kTile) / kTile;  // tiles of 16 pairs
  const int64_t nch = hdp / 32;                      // 32-column chunks of K
  // Scores are kept per segment: key j of a pair at scores[u * sc_stride + j - kbeg].
  const int64_t sc_stride = kAttnSegKeys + 16;

  // Scratch (64-byte aligned regions): q as B tiles [block][chunk] | scores [pairs]
  // [segment keys] | V sums [pairs][hdp] | max, Σ per pair | 4 C tiles | running max lanes
  // [pairs][16] | staged K [kStageKeys][hdp] | staged V [segment blocks + 1][hdp / 16 tiles] |
  // weights 2 x [16 pairs][segment keys] + one tree block [16 pairs][32 keys] | keys
  // per pair (int32). Every size depends on the unit's pairs only, not on the segment, so a unit
  // that continues (part.unit_continues) finds its q tiles where it left them.
  const int64_t f_scores = np * sc_stride, f_accs = nblk * kTile * hdp, f_max = 2 * round_up(np, 16),
                f_vmax = round_up(np, 16);  // a vector per tile block
  const int64_t h_q = nblk * nch * kTileElems, h_k = kStageKeys * hdp, h_v = (kAttnSegKeys / kVKeys + 1) * (hdp / 16) * kTileElems,
                h_w = kTile * (2 * kAttnSegKeys + kVKeys);
  float* buf = attn_thread_scratch(f_scores + f_accs + f_max + f_vmax + 4 * 256 + (h_q + h_k + h_v + h_w) / 2 + np + 64);
  uint16_t* qb = reinterpret_cast<uint16_t*>(buf);
  float* scores = buf + h_q / 2;  // h_q is a multiple of 512
  float* accs = scores + round_up(f_scores, 16);
  float* maxs = accs + f_accs;
  float* sums = maxs + f_max / 2;
  float* ctile = maxs + f_max;
  float* vmax = ctile + 4 * 256;  // ctile: 4 C tiles
  uint16_t* kst = reinterpret_cast<uint16_t*>(vmax + f_vmax);
  uint16_t* vst = kst + h_k;
  uint16_t* wst = vst + h_v;

  auto row_of = [&](int64_t u) { return (u0 + u) / G; };
  auto head_of = [&](int64_t u) { return kvh * G + (u0 + u) % G; };
  int32_t* const nfull = reinterpret_cast<int32_t*>(wst + h_w);  // per pair: keys 0..p
  for (int64_t u = 0; u < np; ++u) nfull[u] = int32_t(attn_row_pos(a, row_of(u)) + 1);
  auto n_full = [&](int64_t u) { return int64_t(nfull[u]); };
  auto n_of = [&](int64_t u) { return n_full(u) < kcap ? n_full(u) : kcap; };  // in this segment

  detail::amx::configure_16x64();

  // q as B tiles: B[r][pair][i] = q_pair[32c + 2r + i] rounded to BF16; padding pairs and
  // columns zero. Per tile block and 32-column chunk: each pair's 32 dims rounded in order are its
  // 16 dwords (dims 2r, 2r + 1), the 16 x 16 dwords transposed into the tile's rows r.
  for (int64_t b = 0; b < nblk && !part.unit_continues; ++b)
    for (int64_t c = 0; c < nch; ++c) {
      __m512 r[kTile];
      for (int64_t pr = 0; pr < kTile; ++pr) {
        const int64_t u = b * kTile + pr;
        if (u >= np) {
          r[pr] = _mm512_setzero_ps();
          continue;
        }
        const float* q = a.q + (row_of(u) * a.n_heads + head_of(u)) * hd + c * 32;
        const __m512 x0 = _mm512_maskz_loadu_ps(first_lanes(hd - c * 32), q);
        const __m512 x1 = _mm512_maskz_loadu_ps(first_lanes(hd - c * 32 - 16), q + 16);
        r[pr] = __m512(_mm512_cvtne2ps_pbh(x1, x0));
      }
      avx512::transpose16(r);
      uint16_t* dst = qb + (b * nch + c) * kTileElems;
      for (int64_t rr = 0; rr < kTile; ++rr) _mm512_storeu_ps(reinterpret_cast<float*>(dst + rr * 2 * kTile), r[rr]);
    }
  for (int64_t b = 0; b < nblk; ++b) _mm512_storeu_ps(vmax + b * 16, _mm512_set1_ps(-INFINITY));
  if (hdp != hd) std::memset(kst, 0, size_t(h_k) * 2);  // columns hd .. hdp stay zero

  const __m512 vscale = _mm512_set1_ps(a.scale);
  // Scores of staged keys [j0, j0 + nk) (nk <= kStageKeys) for the pairs of tile blocks [b0, b1)
  // that `want`; the running max of tile block b's pairs in one vector (vmax + 16 b, lane = pair),
  // folded row by row of the score tile (a row is a key: its lanes the pairs that attend it)
  // before the tile is transposed for the stores. Per pair a vector of 16 lanes loaded, folded and
  // stored again for every 16 keys cost 10-13% of an 8k prefill's attention.
  // (The loop reads everything through locals: through the lambdas' captured references every
  // pair reloaded its bounds after each store, a fifth of the vector work.)
  auto extract = [&](const float* ct, int64_t jb, int64_t nkb, int64_t b, auto&& want) {
    const int32_t* const nf = nfull;
    const int64_t u0b = b * kTile, npairs = np - u0b < kTile ? np - u0b : kTile, stride = sc_stride;
    __mmask16 wanted = 0;
    for (int pr = 0; pr < npairs; ++pr) wanted |= __mmask16(want(u0b + pr) ? 1u << pr : 0u);
    // each pair's keys in this segment, 0 for the lanes not wanted (they attend no key here)
    const __m512i nvec = _mm512_min_epi32(_mm512_maskz_loadu_epi32(wanted, nf + u0b), _mm512_set1_epi32(int(kcap)));
    const __m512 scale = vscale;
    __m512 r[kTile];  // Sᵀ[key][pair] -> per pair its 16 keys' scores
    __m512 mx = _mm512_loadu_ps(vmax + b * 16);
    // Most of a prefill's tiles: every pair attends every key of the block (`whole`): no per-pair
    // bounds then, the same max and stores.
    const __mmask16 all = npairs >= kTile ? __mmask16(0xFFFF) : __mmask16((1u << npairs) - 1u);
    const bool whole = _mm512_cmpge_epi32_mask(nvec, _mm512_set1_epi32(int(jb + nkb))) == all;
    for (int64_t t = 0; t < kTile; ++t) {
      r[t] = _mm512_mul_ps(_mm512_loadu_ps(ct + t * kTile), scale);
      // the pairs that attend key jb + t; a NaN score is skipped (max_ps returns its second operand)
      const __mmask16 att = t >= nkb ? __mmask16(0) : whole ? all : _mm512_cmpgt_epi32_mask(nvec, _mm512_set1_epi32(int(jb + t)));
      mx = _mm512_mask_max_ps(mx, att, r[t], mx);
    }
    _mm512_storeu_ps(vmax + b * 16, mx);
    avx512::transpose16(r);
    float* const sc0 = scores + u0b * sc_stride + jb - kbeg;
    const int64_t cap = kcap;
    const __mmask16 keys = first_lanes(nkb);
#pragma GCC unroll 16
    for (int pr = 0; pr < kTile; ++pr) {  // unrolled: r[pr] stays in its register
      if (pr >= npairs) break;
      if (whole) {
        _mm512_mask_storeu_ps(sc0 + pr * stride, keys, r[pr]);
        continue;
      }
      if (!(wanted >> pr & 1)) continue;
      const int64_t n = nf[u0b + pr] < cap ? nf[u0b + pr] : cap;
      _mm512_mask_storeu_ps(sc0 + pr * stride, first_lanes(n - jb < nkb ? n - jb : nkb), r[pr]);
    }
  };
  auto score_keys = [&](int64_t j0, int64_t nk, int64_t b0, int64_t b1, auto&& want) {
    const int64_t nkb = (nk + kTile - 1) / kTile;  // key blocks staged
    for (int64_t t = nk; t < nkb * kTile; ++t) std::memset(kst + t * hdp, 0, size_t(hd) * 2);
    auto keys_of = [&](int64_t kb) { return nk - kb * kTile < kTile ? nk - kb * kTile : kTile; };
    for (int64_t b = b0; b < b1; ++b) {
      switch (nkb) {
        case 4: score_tiles<4>(kst, hdp, qb, b, nch, ctile); break;
        case 3: score_tiles<3>(kst, hdp, qb, b, nch, ctile); break;
        case 2: score_tiles<2>(kst, hdp, qb, b, nch, ctile); break;
        default: score_tiles<1>(kst, hdp, qb, b, nch, ctile);
      }
      for (int64_t kb = 0; kb < nkb; ++kb) extract(ctile + kb * 256, j0 + kb * kTile, keys_of(kb), b, want);
    }
  };
  auto all_pairs = [](int64_t) { return true; };
  // Each tree row's own keys [t0, n) in blocks of `step` from t0: fn(row, j0, keys, tile blocks
  // [b0, b1) holding the row's pairs, which pairs are the row's). A row's pairs are consecutive.
  auto tree_blocks = [&](int64_t step, auto&& fn) {
    if (t0 >= n_max) return;
    for (int64_t row = u0 / G; row <= (u1 - 1) / G; ++row) {
      const int64_t ua = row * G - u0 > 0 ? row * G - u0 : 0;
      const int64_t ub = (row + 1) * G - u0 < np ? (row + 1) * G - u0 : np;
      const int64_t n = n_of(ua);
      auto mine = [ua, ub](int64_t u) { return u >= ua && u < ub; };
      for (int64_t j0 = t0; j0 < n; j0 += step)
        fn(row, j0, n - j0 < step ? n - j0 : step, ua / kTile, (ub - 1) / kTile + 1, mine);
    }
  };
  // Pass 1, shared keys.
  for (int64_t j0 = kbeg; j0 < n_sh; j0 += kStageKeys) {
    const int64_t nk = n_sh - j0 < kStageKeys ? n_sh - j0 : kStageKeys;
    for (int64_t t = 0; t < nk; ++t) {
      if (j0 + t + kPrefetchKeys < n_sh) prefetch_row(a.kv.k(a.layer, j0 + t + kPrefetchKeys) + kvh * hd, hd);
      copy_bf16(kst + t * hdp, a.kv.k(a.layer, j0 + t) + kvh * hd, hd);
    }
    score_keys(j0, nk, 0, nblk, all_pairs);
  }
  // Pass 1, each tree row's own keys.
  tree_blocks(kStageKeys, [&](int64_t row, int64_t j0, int64_t nk, int64_t b0, int64_t b1, auto&& mine) {
    for (int64_t t = 0; t < nk; ++t)
      copy_bf16(kst + t * hdp, a.kv.k(a.layer, attn_key_slot(a, row, j0 + t)) + kvh * hd, hd);
    score_keys(j0, nk, b0, b1, mine);
  });

  // Pass 2: per pair, over its own keys of this segment.
  for (int64_t u = 0; u < np; ++u) maxs[u] = vmax[u];  // vmax + 16 b: block b's lanes
  // Pass 3: V sums in tiles of 16 pairs x 16 columns, in blocks of 32 keys from kbeg. Each C tile
  // sums one tile block's 16 columns through all of its blocks in key order (shared blocks, then a
  // tree row's own): one TDPBF16PS chain per element. A pair with
  // no key in a block (other pairs' keys run on, a window starts later, another tree row's own
  // block) gets weight 0 there, and adding exact zero products leaves a C element as it is: TDPBF16PS
  // flushes denormal results, so a C element is never denormal, and it is never -0. So a pair's
  // sums are those of its own blocks, whatever pairs share its tile.
  //
  // V of the shared blocks is staged once as B tiles: vst[block][col / 16][r][col % 16][i] =
  // V[key 2r + i][col]; keys past the end and columns hd.. zero (the columns past hd are zeroed
  // once: only whole 16- or 8-column pieces below hd are written). A tree row's own block goes to
  // the slot after them when it is used.
  const int64_t ncol = hdp / 16, vblock = ncol * kTileElems;
  const int64_t nsb = n_sh > kbeg ? (n_sh - kbeg + kVKeys - 1) / kVKeys : 0;  // shared blocks
  if (hd % 16 != 0 || hdp != hd) std::memset(vst, 0, size_t(h_v) * 2);
  auto stage_v = [&](uint16_t* vs, int64_t nk, auto&& vrow) {
    const int64_t hd16 = hd & ~int64_t(15);
    for (int64_t r = 0; r < kTile; ++r) {
      const uint16_t* v0 = 2 * r < nk ? vrow(2 * r) : nullptr;
      const uint16_t* v1 = 2 * r + 1 < nk ? vrow(2 * r + 1) : nullptr;
      uint16_t* dst = vs + r * kTile * 2;
      for (int64_t d = 0; d < hd16; d += 16) {  // interleave two rows' 16 columns: 64 bytes
        const __m256i x0 = v0 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0 + d)) : _mm256_setzero_si256();
        const __m256i x1 = v1 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v1 + d)) : _mm256_setzero_si256();
        const __m256i lo = _mm256_unpacklo_epi16(x0, x1), hi = _mm256_unpackhi_epi16(x0, x1);
        __m256i* o = reinterpret_cast<__m256i*>(dst + (d / 16) * kTileElems);
        _mm256_storeu_si256(o, _mm256_permute2x128_si256(lo, hi, 0x20));
        _mm256_storeu_si256(o + 1, _mm256_permute2x128_si256(lo, hi, 0x31));
      }
      if (hd16 < hd) {  // 8 columns
        const __m128i x0 = v0 ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(v0 + hd16)) : _mm_setzero_si128();
        const __m128i x1 = v1 ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(v1 + hd16)) : _mm_setzero_si128();
        __m128i* o = reinterpret_cast<__m128i*>(dst + (hd16 / 16) * kTileElems);
        _mm_storeu_si128(o, _mm_unpacklo_epi16(x0, x1));
        _mm_storeu_si128(o + 1, _mm_unpackhi_epi16(x0, x1));
      }
    }
  };
  for (int64_t jb = 0; jb < nsb; ++jb) {
    const int64_t j0 = kbeg + jb * kVKeys, nk = n_sh - j0 < kVKeys ? n_sh - j0 : kVKeys;
    for (int64_t t = j0 + kVKeys; t < j0 + 2 * kVKeys && t < n_sh; ++t) prefetch_row(a.kv.v(a.layer, t) + kvh * hd, hd);
    stage_v(vst + jb * vblock, nk, [&](int64_t t) { return a.kv.v(a.layer, j0 + t) + kvh * hd; });
  }
  uint16_t* const vown = vst + nsb * vblock;
  // Weights of tile block b's pairs that `want`, keys [j0, j0 + 32 · nb) (others zero), as nb
  // blocks side by side: ws[16 pairs][nb · 32 keys].
  auto round_weights = [&](uint16_t* ws, int64_t j0, int64_t nb, int64_t b, auto&& want) {
    const int64_t w = nb * kVKeys;
    for (int64_t pr = 0; pr < kTile; ++pr) {
      const int64_t u = b * kTile + pr;
      const bool live = u < np && want(u);
      for (int64_t jb = 0; jb < nb; ++jb) {
        const int64_t j = j0 + jb * kVKeys, left = live ? n_of(u) - j : 0;
        const int64_t e = left <= 0 ? 0 : left < kVKeys ? left : kVKeys;
        round32(scores + u * sc_stride + j - kbeg, e, ws + pr * w + jb * kVKeys);
      }
    }
  };
  // Two tile blocks at a time (the last one alone): the weights of their shared blocks, then per
  // group of column tiles (two; up to four for a block alone) one chain per C tile through the
  // shared blocks and, for tree rows, each row's own blocks. Block b + i's weights at
  // wst + i · ws_stride.
  uint16_t* const wown = wst + 2 * kTile * kAttnSegKeys;  // one own block: [16][32]
  const int64_t ws_width = nsb * kVKeys, ws_stride = kTile * ws_width;
  auto chain = [&](auto nb_const, auto nc_const, int64_t b, int64_t c) {
    constexpr int NB = decltype(nb_const)::value, NC = decltype(nc_const)::value;
    chain_begin<NB * NC>();
    chain_blocks<NB, NC>(wst, ws_stride, ws_width, nsb, vst + c * kTileElems, vblock);
    auto own = [&](auto cb_const) {  // block b + CB's tree rows
      constexpr int CB = decltype(cb_const)::value;
      tree_blocks(kVKeys, [&](int64_t row, int64_t j0, int64_t nk, int64_t b0, int64_t b1, auto&& mine) {
        if (b + CB < b0 || b + CB >= b1) return;
        stage_v(vown, nk, [&](int64_t t) { return a.kv.v(a.layer, attn_key_slot(a, row, j0 + t)) + kvh * hd; });
        round_weights(wown, j0, 1, b + CB, mine);
        chain_blocks<1, NC, CB>(wown, 0, kVKeys, 1, vown + c * kTileElems, vblock);
      });
    };
    own(std::integral_constant<int, 0>());
    if constexpr (NB == 2) own(std::integral_constant<int, 1>());
    chain_end<NB, NC>(accs + b * kTile * hdp + c * 16, kTile * hdp, hdp);
  };
  // Pass 2's exponentials, a tile block at a time right before its chains: each pair's weights
  // of the shared blocks go straight into their A tile, rounded (ws[16 pairs][32 · nsb keys], keys
  // a pair does not attend 0), Σ of the unrounded weights in key order 16 keys at a time; a tree
  // row's own keys past them are exponentiated in place, for their blocks' rounding in the chains.
  auto weights_block = [&](int64_t b, uint16_t* wsb) {
    const int64_t w = nsb * kVKeys;
    for (int64_t pr = 0; pr < kTile; ++pr) {
      const int64_t u = b * kTile + pr;
      uint16_t* const ws = wsb + pr * w;
      if (u >= np || n_of(u) <= kbeg || attn_key_lo(a, row_of(u)) >= kcap) {  // no key here
        for (int64_t j = 0; j < w; j += kVKeys) round32(_mm512_setzero_ps(), _mm512_setzero_ps(), ws + j);
        continue;
      }
      float* const sc = scores + u * sc_stride;  // key kbeg
      const int64_t n = n_of(u) - kbeg;
      maxs[u] = attn_window_max(sc, 0, n, attn_key_lo(a, row_of(u)) - kbeg, maxs[u]);
      const __m512 vm = _mm512_set1_ps(maxs[u]);
      __m512 vsum = _mm512_setzero_ps();
      for (int64_t j = 0; j < w; j += kVKeys) {
        const __mmask16 l0 = first_lanes(n - j), l1 = first_lanes(n - j - 16);
        const __m512 e0 = softmax_exp(_mm512_maskz_loadu_ps(l0, sc + j), vm, l0);
        const __m512 e1 = softmax_exp(_mm512_maskz_loadu_ps(l1, sc + j + 16), vm, l1);
        vsum = _mm512_add_ps(_mm512_add_ps(vsum, e0), e1);
        round32(e0, e1, ws + j);
      }
      for (int64_t j = w; j < n; j += kTile) {  // a tree row's own keys
        const __mmask16 l = first_lanes(n - j);
        const __m512 e = softmax_exp(_mm512_maskz_loadu_ps(l, sc + j), vm, l);
        _mm512_mask_storeu_ps(sc + j, l, e);
        vsum = _mm512_add_ps(vsum, e);
      }
      sums[u] = _mm512_reduce_add_ps(vsum);
    }
  };
  using One = std::integral_constant<int, 1>;
  using Two = std::integral_constant<int, 2>;
  for (int64_t b = 0; b < nblk; b += 2) {
    weights_block(b, wst);
    if (b + 1 < nblk) {
      weights_block(b + 1, wst + ws_stride);
      for (int64_t c = 0; c < ncol; c += 2) {
        if (ncol - c >= 2) chain(Two(), Two(), b, c);
        else chain(Two(), One(), b, c);
      }
      continue;
    }
    for (int64_t c = 0; c < ncol; c += 4) {
      switch (ncol - c < 4 ? ncol - c : 4) {
        case 4: chain(One(), std::integral_constant<int, 4>(), b, c); break;
        case 3: chain(One(), std::integral_constant<int, 3>(), b, c); break;
        case 2: chain(One(), Two(), b, c); break;
        default: chain(One(), One(), b, c);
      }
    }
  }
  _tile_release();

  // Single-segment pairs: out = acc · (1/Σ); others: this segment's partial (unnormalized).
  for (int64_t u = 0; u < np; ++u) {
    if (n_of(u) <= kbeg || attn_key_lo(a, row_of(u)) >= kcap) continue;  // below its window: no partial
    const float s = sums[u];
    const float* acc = accs + u * hdp;
    if (n_full(u) <= kAttnSegKeys) {
      float* out = a.out + (row_of(u) * a.n_heads + head_of(u)) * hd;
      const float inv = 1.f / s;
      for (int64_t d = 0; d < hd; ++d) out[d] = acc[d] * inv;
    } else if (part.states) {  // run_chunk_units: folded here, not written and read back
      // (pair_has_partial holds here: the checks above are its own for BF16 rows, which have
      // no sinks and no sparse budget: attention.cpp refuses those without a draft copy)
      fold_partial(part.state(a, row_of(u), head_of(u)), maxs[u], s, acc, hd);
    } else {
      float* pp = part.at(a, row_of(u), head_of(u), seg);
      pp[0] = maxs[u];
      pp[1] = s;
      std::memcpy(pp + 2, acc, size_t(hd) * 4);
    }
  }
  part.kernel_folded = part.states != nullptr;
}

}  // namespace

void attn_group_amx(const AttnArgs& a, int64_t kvh, int64_t u_begin, int64_t u_end, int64_t seg,
                    const AttnPartials& part) {
  group_impl(a, kvh, u_begin, u_end, seg, part);
}

}  // namespace qspec
