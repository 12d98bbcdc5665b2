// Causal attention for decode / verify / prefill over the one shared KV cache.
//
// Cache layout (docs/architecture.md): [layers][2][max_seq][kv_heads][head_dim] BF16 bits (uint16),
// K at index 0, V at index 1. Query row i sits at position start_pos + i and attends keys
// 0 .. start_pos + i (causal); the caller has already written K/V for every such position.
//
// Batch invariance (docs/architecture.md invariant 2): the output of query row i is bit-identical
// whatever m is, whatever the other rows hold and whatever the thread count.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <climits>
#include <vector>

#include "cpu.h"
#include "kv_q8.h"

namespace qspec {

struct KvCacheView {
  uint16_t* data = nullptr;
  // layers, pool rows per layer and K/V (max_seq), kv_heads, head_dim
  int64_t layers = 0, max_seq = 0, kv_heads = 0, head_dim = 0;
  // The draft copy (csrc/kv_q8.h), or null, in arrays with the pool's rows: K values
  // [layers][max_seq][row_elems · k_bits / 8] (q8k), V values [..][row_elems · v_bits / 8] (q8v),
  // K scales [layers][max_seq][k_scale_bytes()] (k_bits 8: one per 32 values; k_bits 4: each group
  // of k_group rows holds its kv_k4_group params across its rows' bytes), V scales
  // [layers][max_seq][row_elems / 32], and per row a flag (k_final): the first row of a K group
  // (k_bits 4) holds 1 once the group's K copy is written. Every forward writes the V (and INT8 K)
  // copy of its rows; only MX draft passes read the copy (AttnArgs::draft_q8).
  int8_t* q8k = nullptr;
  int8_t* q8v = nullptr;
  uint8_t* k_scale = nullptr;
  uint8_t* v_scale = nullptr;
  uint8_t* k_final = nullptr;
  int k_bits = 8, v_bits = 8;
  int64_t k_group = 0;  // rows per K group (k_bits 4): the pool's page size
  int k_group_shift = -1;  // log2(k_group) when a power of two (kv_shift), else -1
  // Paged cache (qspec/kv_cache.py): the pool's rows are pages of page_size rows (a multiple of
  // 8), and the sequence's position p sits in pool row pages[p / page_size] · page_size +
  // p % page_size. Null: position p is pool row p (one contiguous sequence). Every accessor
  // below takes a position; rows are contiguous only within a page (run_end).
  const int32_t* pages = nullptr;
  int64_t page_size = 0;
  int page_shift = -1;  // log2(page_size) when a power of two (kv_shift), else -1: no division per key

  int64_t row_elems() const { return kv_heads * head_dim; }  // one position of K or V
  int64_t slot(int64_t pos) const {
    if (!pages) return pos;
    if (page_shift >= 0) return (int64_t(pages[pos >> page_shift]) << page_shift) | (pos & (page_size - 1));
    return int64_t(pages[pos / page_size]) * page_size + pos % page_size;
  }
  // End of the run of positions stored contiguously from pos on (its page's end).
  int64_t run_end(int64_t pos) const {
    return pages ? (pos / page_size + 1) * page_size : INT64_MAX;
  }
  uint16_t* k(int64_t layer, int64_t pos) const {
    return data + ((layer * 2 + 0) * max_seq + slot(pos)) * row_elems();
  }
  uint16_t* v(int64_t layer, int64_t pos) const {
    return data + ((layer * 2 + 1) * max_seq + slot(pos)) * row_elems();
  }
  // kv_index 0 = K, 1 = V; the row's first byte (4 bits: value 2i in the low nibble of byte i)
  int8_t* q8_row(int64_t layer, int kv_index, int64_t pos) const {
    const int64_t r = layer * max_seq + slot(pos);
    return kv_index ? q8v + r * row_elems() * v_bits / 8 : q8k + r * row_elems() * k_bits / 8;
  }
  int64_t q8_head_bytes(int kv_index) const { return head_dim * (kv_index ? v_bits : k_bits) / 8; }
  int64_t k_scale_bytes() const { return k_bits == 8 ? row_elems() / kQ8Block : 3 * row_elems() / k_group; }
  // The INT8 K or the V scales of a row (kv_index 0 with k_bits 4: use k_group_params)
  uint8_t* q8_scales(int64_t layer, int kv_index, int64_t pos) const {
    const int64_t r = layer * max_seq + slot(pos);
    return kv_index ? v_scale + r * (row_elems() / kQ8Block) : k_scale + r * k_scale_bytes();
  }
  // k_bits 4: the pool row starting pool row `slot`'s K group, its flag and its params
  int64_t k_group_row(int64_t pool_row) const {
    return k_group_shift >= 0 ? pool_row & -k_group : pool_row - pool_row % k_group;
  }
  uint8_t* k_group_params(int64_t layer, int64_t group_row) const {
    return k_scale + (layer * max_seq + group_row) * k_scale_bytes();
  }
};

// log2(n) for a power of two n > 0, else -1 (KvCacheView::page_shift, k_group_shift).
inline int kv_shift(int64_t n) { return n > 0 && (n & (n - 1)) == 0 ? __builtin_ctzll(uint64_t(n)) : -1; }

// Points kv at a sequence's page table (KvCacheView::pages) after checking it: page_size a
// positive multiple of 8 dividing kv.max_seq, positions 0..positions-1 covered by pages that lie
// in the pool. Throws std::invalid_argument otherwise. The table must outlive the view's use.
void kv_set_pages(KvCacheView& kv, const int32_t* pages, int64_t n_pages, int64_t page_size, int64_t positions);

// The INT4 K copy (kv.k_bits 4, kv_q8.h): writes the K groups of positions [pos0, pos1) (multiples
// of kv.k_group, all committed rows) whose flag is unset, newest first, stopping at the first one
// already written (a sequence's groups are written in order); kv_k4_unfinal clears the flags of
// the groups holding positions [pos0, pos1) (rows about to be written). kv_q8.cpp.
void kv_k4_finalize(const KvCacheView& kv, int64_t pos0, int64_t pos1);
void kv_k4_unfinal(const KvCacheView& kv, int64_t pos0, int64_t pos1);

// A draft tree over the cache (docs/architecture.md, "Tree attention"). Cache rows [0, prefix)
// are the committed linear prefix; every later slot holds one tree node. Query row i is the node
// at slot start_pos + i; its path (ancestor slots root first, then its own slot) is
// path[off[i] .. off[i + 1]), its depth off[i + 1] - off[i] - 1. It sits at logical position
// p = prefix + depth and attends logical keys 0..p: key j is cache row j for j < prefix and slot
// path[off[i] + j - prefix] after. Every kernel treats a tree row exactly like a linear row at
// position p whose cache rows prefix..p hold the path: same keys, same order, same 8-key blocks
// and kAttnSegKeys segments counted from logical key 0, so the bits are identical.
struct AttnTree {
  int64_t prefix = 0;
  const int64_t* off = nullptr;    // [m + 1]
  const int32_t* path = nullptr;   // [off[m]]
};

struct AttnArgs {
  const float* q = nullptr;  // [m, n_heads, head_dim] fp32, RoPE applied
  float* out = nullptr;      // [m, n_heads, head_dim] fp32
  int64_t m = 0, start_pos = 0, n_heads = 0;
  int64_t layer = 0;
  float scale = 0.f;  // usually 1/sqrt(head_dim)
  // Sliding-window attention (0: off): a row at logical position p attends logical keys
  // max(0, p - window + 1) .. p only (transformers' sliding_window_overlay: key > p - window).
  // The keys below are never weighted: the kernels still walk the 256-key segments from key 0
  // that contain a live key (so the block and segment boundaries, hence the bits, stay those of
  // position p), set the scores of the keys below the window to -inf and skip whole segments
  // below it; the result depends only on p and the window, as every other row's does.
  int64_t window = 0;
  // Attention sinks (draft passes over the draft copy only; 0: none): with a window, keys
  // 0 .. sink_keys - 1 are attended as well (StreamingLLM: the first tokens and the recent ones),
  // so a draft's attention costs O(sink_keys + window) at any context. sink_keys <= kAttnSegKeys.
  int64_t sink_keys = 0;
  // Recent keys (draft passes over the draft copy only; 0: none): a row at logical position p
  // reads keys p - recent_keys + 1 .. p from the BF16 rows (K and V) instead of the copy. The
  // quantization error of the copy costs the drafts most where the attention weight is: on the
  // latest keys (Qwen2.5-Coder-1.5B at 8k tokens: acceptance 0.81 over the INT4 copy, 0.88 with
  // its latest 256 keys in BF16, as over the BF16 rows). The result depends only on p.
  int64_t recent_keys = 0;
  // Sparse draft attention (draft passes over an INT4 copy; 0: off): of the pages wholly inside a
  // row's window and below its recent keys and a tree's prefix, the row attends page 0, the last
  // and the sparse_keys / k_group - 2 others whose keys can score highest (attn_select_pages,
  // Quest's bound). page_keep [m][kv_heads][page_stride] (0: dropped) is set by attention_path.
  int64_t sparse_keys = 0;
  const uint8_t* page_keep = nullptr;
  int64_t page_stride = 0;
  KvCacheView kv;
  const AttnTree* tree = nullptr;  // null: linear rows (row i at position start_pos + i)
  // Read K/V from the draft copy (kv.q8k / q8v, head_dim a multiple of kQ8Block) instead of BF16:
  // the MX draft passes. The same rules hold (causal, segments, batch invariance, tree rows ==
  // linear rows); the values are the dequantized copy, exact in FP32.
  bool draft_q8 = false;
};

// Logical position of query row i (its keys are 0..attn_row_pos).
inline int64_t attn_row_pos(const AttnArgs& a, int64_t i) {
  return a.tree ? a.tree->prefix + (a.tree->off[i + 1] - a.tree->off[i] - 1) : a.start_pos + i;
}
// Keys of the longest of query rows [r0, r1): max attn_row_pos + 1.
inline int64_t attn_max_keys(const AttnArgs& a, int64_t r0, int64_t r1) {
  if (!a.tree) return a.start_pos + r1;
  int64_t n = 0;
  for (int64_t i = r0; i < r1; ++i) n = attn_row_pos(a, i) + 1 > n ? attn_row_pos(a, i) + 1 : n;
  return n;
}
// First logical key query row i attends (0 without a sliding window).
inline int64_t attn_key_lo(const AttnArgs& a, int64_t i) {
  if (a.window <= 0) return 0;
  const int64_t lo = attn_row_pos(a, i) - a.window + 1;
  return lo > 0 ? lo : 0;
}
// Keys [attn_gap_lo, attn_key_lo) of query row i are not attended: below its window and past the
// sinks (an empty range without a window).
inline int64_t attn_gap_lo(const AttnArgs& a, int64_t i) {
  const int64_t lo = attn_key_lo(a, i);
  return a.sink_keys < lo ? a.sink_keys : lo;
}
// Smallest attn_key_lo of query rows [r0, r1).
inline int64_t attn_min_key_lo(const AttnArgs& a, int64_t r0, int64_t r1) {
  if (a.window <= 0) return 0;
  int64_t lo = attn_key_lo(a, r0);
  for (int64_t i = r0 + 1; i < r1 && a.tree; ++i) lo = attn_key_lo(a, i) < lo ? attn_key_lo(a, i) : lo;
  return lo;  // linear rows: positions grow with i
}
// Pass 2 with sinks and a window: keys [max(kbeg, gap), min(lo, n)) get -inf, the max of the others
// is returned (`folded` when no key of [kbeg, n) is masked). The pair attends some key of
// [kbeg, n): kbeg < gap or lo < n.
inline float attn_gap_max(float* scores, int64_t kbeg, int64_t n, int64_t gap, int64_t lo, float folded) {
  const int64_t g0 = gap > kbeg ? gap : kbeg, g1 = lo < n ? lo : n;
  if (g0 >= g1) return folded;
  float m = -INFINITY;
  for (int64_t j = g0; j < g1; ++j) scores[j] = -INFINITY;
  for (int64_t j = kbeg; j < g0; ++j) m = scores[j] > m ? scores[j] : m;
  for (int64_t j = g1; j < n; ++j) m = scores[j] > m ? scores[j] : m;
  return m;
}
// Pass 2 of a fast path for one pair over keys [kbeg, n) of a segment, with `lo` its first
// attended key (kbeg < n, lo < n): sets the scores of keys [kbeg, lo) to -inf and returns the
// max of the rest, exact (a max does not depend on order); `folded` is the max the pass-1 fold
// found over all of [kbeg, n), returned as it is when no key is masked.
inline float attn_window_max(float* scores, int64_t kbeg, int64_t n, int64_t lo, float folded) {
  return attn_gap_max(scores, kbeg, n, 0, lo, folded);  // a window without sinks
}

// Cache row holding logical key j of query row i.
inline int64_t attn_key_slot(const AttnArgs& a, int64_t i, int64_t j) {
  return (a.tree && j >= a.tree->prefix) ? a.tree->path[a.tree->off[i] + j - a.tree->prefix] : j;
}
// End of a fast path's block of keys from b0 (a multiple of 8): at most kb keys, not past n, and
// within one contiguous run of the cache (a page), so that keys [b0, end) are rows
// kv.k(layer, b0) + t · row_elems. Pages hold multiples of 8 rows: 8-key blocks never straddle.
inline int64_t attn_block_end(const AttnArgs& a, int64_t b0, int64_t kb, int64_t n) {
  int64_t e = b0 + kb < n ? b0 + kb : n;
  const int64_t r = a.kv.run_end(b0);
  return e < r ? e : r;
}
// First logical key that is not shared by all rows of the call, rounded down to a multiple of 8
// (an 8-key block never mixes the shared stream with per-row keys); linear: no such key.
inline int64_t attn_shared_end(const AttnArgs& a, int64_t n_max) {
  if (!a.tree) return n_max;
  const int64_t e = a.tree->prefix & ~int64_t(7);
  return e < n_max ? e : n_max;
}

// First logical key query row i reads from the BF16 rows in a pass over the draft copy (keys
// attn_recent_lo .. p; p + 1 without recent keys).
inline int64_t attn_recent_lo(const AttnArgs& a, int64_t i) {
  const int64_t lo = attn_row_pos(a, i) + 1 - a.recent_keys;
  return lo > 0 ? lo : 0;
}

// Key j's K group (page) of the draft copy, and the first key past it (no division when k_group
// is a power of two, as the pool's page size is).
inline int64_t attn_page_of(const AttnArgs& a, int64_t j) {
  return a.kv.k_group_shift >= 0 ? j >> a.kv.k_group_shift : j / a.kv.k_group;
}
inline int64_t attn_page_end(const AttnArgs& a, int64_t j) { return (attn_page_of(a, j) + 1) * a.kv.k_group; }
// Whether query row i attends logical key j of KV head kvh (false: its page is dropped by the
// sparse draft attention).
inline bool attn_key_kept(const AttnArgs& a, int64_t i, int64_t kvh, int64_t j) {
  if (!a.page_keep) return true;
  return a.page_keep[(i * a.kv.kv_heads + kvh) * a.page_stride + attn_page_of(a, j)] != 0;
}
// Whether any key of [j0, j1) of row i, KV head kvh is attended (j0 < j1).
inline bool attn_keys_kept(const AttnArgs& a, int64_t i, int64_t kvh, int64_t j0, int64_t j1) {
  if (!a.page_keep) return true;
  for (int64_t j = j0; j < j1; j = attn_page_end(a, j))
    if (attn_key_kept(a, i, kvh, j)) return true;
  return false;
}
// Pass 2 with dropped pages: the scores of row i's dropped keys of [kbeg, n) get -inf and the max
// of the others is returned (`folded` when none of them is dropped).
inline float attn_drop_max(const AttnArgs& a, int64_t i, int64_t kvh, float* scores, int64_t kbeg, int64_t n,
                           float folded) {
  if (!a.page_keep) return folded;
  bool any = false;
  for (int64_t j0 = kbeg; j0 < n; j0 = attn_page_end(a, j0)) {  // page by page
    if (attn_key_kept(a, i, kvh, j0)) continue;
    const int64_t j1 = attn_page_end(a, j0) < n ? attn_page_end(a, j0) : n;
    std::fill(scores + j0, scores + j1, -INFINITY);
    any = true;
  }
  if (!any) return folded;
  float lane[8] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY};
  int64_t j = kbeg;
  for (; j + 8 <= n; j += 8)  // a NaN is skipped, as by the fold (the max is exact in any order)
    for (int l = 0; l < 8; ++l) lane[l] = scores[j + l] > lane[l] ? scores[j + l] : lane[l];
  for (; j < n; ++j) lane[0] = scores[j] > lane[0] ? scores[j] : lane[0];
  float m = lane[0];
  for (int l = 1; l < 8; ++l) m = lane[l] > m ? lane[l] : m;
  return m;
}
// Bit t set for each key j0 + t (t < n <= 32) row i attends of KV head kvh's pages (all with no
// dropped pages).
inline uint32_t attn_kept_bits(const AttnArgs& a, int64_t i, int64_t kvh, int64_t j0, int64_t n) {
  const uint32_t all = n >= 32 ? ~uint32_t(0) : (uint32_t(1) << n) - 1;
  if (!a.page_keep) return all;
  uint32_t bits = 0;
  for (int64_t j = j0; j < j0 + n; j = attn_page_end(a, j)) {
    if (!attn_key_kept(a, i, kvh, j)) continue;
    const int64_t e = attn_page_end(a, j) - j0;  // the page's end, relative
    bits |= (e >= 32 ? ~uint32_t(0) : (uint32_t(1) << e) - 1) & ~((uint32_t(1) << (j - j0)) - 1);
  }
  return bits & all;
}
// Whether a pass may drop pages: sparse keys over an INT4 K copy.
inline bool attn_sparse(const AttnArgs& a) { return a.sparse_keys > 0 && a.draft_q8 && a.kv.k_bits == 4; }
// Fills page_keep (rows x kv_heads x page_stride bytes, all 1 on entry) for a.sparse_keys
// (csrc/draft_pages.cpp).
void attn_select_pages(const AttnArgs& a, uint8_t* keep);

// Owns the path arrays of an AttnTree built from a parent array: parents[s - prefix] is the slot
// of slot s's parent (-1: a root) for s in [prefix, start_pos + m). Throws std::invalid_argument
// on a malformed tree (0 <= prefix <= start_pos, parents.size() == start_pos + m - prefix,
// -1 <= parent < own slot, parent >= prefix).
struct AttnTreePaths {
  AttnTree view;
  std::vector<int64_t> off;
  std::vector<int32_t> path;
  AttnTreePaths(int64_t prefix, const int64_t* parents, int64_t n_parents, int64_t start_pos,
                int64_t m);
  AttnTreePaths(const AttnTreePaths&) = delete;
  AttnTreePaths& operator=(const AttnTreePaths&) = delete;
};

// avx512_bf16: the avx512 kernels with BF16 operands for both products (vdpbf16ps; q and the
// softmax weights rounded to BF16 as on the amx path), head_dim a multiple of 32.
enum class AttnPath : int { ref = 0, avx2 = 1, avx512 = 2, amx = 3, avx512_bf16 = 4 };
const char* attn_path_name(AttnPath p);
bool attn_supports(AttnPath p, const AttnArgs& a);
AttnPath attn_choose(const AttnArgs& a);  // by isa_selected(); never changes with m
bool set_attn_amx(bool enabled);          // amx path allowed (default); returns the previous value
// avx512_bf16 path chosen at its level (QSPEC_ATTN_DOT=dpbf16 | fma; unset: where vdpbf16ps issues
// at the FMAs' rate or faster, i.e. not on Intel: csrc/gemm.h bf16_fma); returns the previous value.
bool set_attn_bf16(bool enabled);
bool attn_bf16();
void attention(const AttnArgs& a);         // dispatches
// Per-thread FP32 scratch of at least n floats, 64-byte aligned, reused across calls.
float* attn_thread_scratch(int64_t n);
void attention_path(AttnPath p, const AttnArgs& a);  // throws std::invalid_argument if unsupported

// Scalar reference kernel for ONE (query row i, head h): out[i, h, :] from logical keys
// 0 .. p = attn_row_pos(a, i), sequentially in a fixed order that depends only on p. `scratch` holds at least
// p + 1 floats (per-thread, owned by the driver). The driver splits (row, head) pairs
// over the pool's threads (csrc/pool.h) for this path.
using AttnRowHeadFn = void (*)(const AttnArgs& a, int64_t i, int64_t h, float* scratch);
void attn_row_head_ref(const AttnArgs& a, int64_t i, int64_t h, float* scratch);

// Fast-path kernels (csrc/x86; may only run when attn_supports() says so) work on ONE KV head
// for several (row, head) pairs at once, so that the K/V of that head is streamed once per call
// instead of once per pair. With G = n_heads / kv_heads, the pairs of KV head `kvh` are numbered
// u = row · G + g (row-major), u in [0, m · G), and pair u is (row u / G, head kvh · G + u % G).
//
// Keys are split into fixed segments of kAttnSegKeys counted from key 0 (segment s = keys
// [s · S, (s + 1) · S)); one call computes pairs [u_begin, u_end) of that KV head over segment
// `seg` only (pairs whose position p lies before the segment are skipped). A pair with p < S
// (a single segment) gets its final output written directly; otherwise the call writes the
// segment's partial result (score max, Σ exp, unnormalized Σ exp · V) to `part`, and the
// driver folds a pair's partials in segment order 0, 1, .. (attention.cpp). The segment
// count of a pair depends only on its own p, so segments give the driver parallelism over keys
// (decode: m = 1) without making any result depend on m or the thread count.
//
// Batch invariance: the arithmetic of one pair (score FMAs over head_dim, the horizontal-sum
// tree, max, exp and Σ order, the V accumulation order, the final scaling, the merge) depends
// only on that pair's q and its position p, never on which other pairs share the call. The K/V
// blocks are converted BF16 -> FP32 exactly, in blocks whose boundaries are multiples of 8
// counted from key 0, and each pair only ever uses keys 0..p of them. So the driver may group
// pairs into calls however it likes (by m and thread count) without changing a single bit.
constexpr int64_t kAttnSegKeys = 256;

// The keys a fast-path call over pairs [u0, u1) (numbered as above) covers in
// segment seg: the longest of their rows, capped at the segment's end; at most the segment's
// start means the call has nothing to do.
inline int64_t attn_unit_keys(const AttnArgs& a, int64_t u0, int64_t u1, int64_t seg) {
  const int64_t G = a.n_heads / a.kv.kv_heads, cap = (seg + 1) * kAttnSegKeys;
  const int64_t n = attn_max_keys(a, u0 / G, (u1 - 1) / G + 1);
  return n < cap ? n : cap;
}

struct AttnPartials {
  // [rows from row0][n_heads][max_seg segments from seg0][head_dim + 2]: {max, Σ exp, Σ exp ·
  // V[0 .. head_dim)} per segment, V sums in natural column order.
  float* data = nullptr;
  int64_t max_seg = 0;
  int64_t row0 = 0, seg0 = 0;
  // True when this thread's previous call was the same unit's previous segment (run_chunk_units):
  // a kernel may keep per-unit work (the AMX kernel's q parts) in its thread scratch between them.
  bool unit_continues = false;
  // run_chunk_units: the unit's fold states, [rows from row0][n_heads][head_dim + 2] (fold_partial's
  // st). A kernel may fold each pair's segment into them itself (the AMX kernel: no partial
  // written and read back) and then sets kernel_folded; otherwise the driver folds the partials.
  float* states = nullptr;
  mutable bool kernel_folded = false;
  float* at(const AttnArgs& a, int64_t row, int64_t head, int64_t seg) const {
    return data + (((row - row0) * a.n_heads + head) * max_seg + seg - seg0) * (a.kv.head_dim + 2);
  }
  float* state(const AttnArgs& a, int64_t row, int64_t head) const {
    return states + ((row - row0) * a.n_heads + head) * (a.kv.head_dim + 2);
  }
};

// Whether pair (row, head) has a partial in segment s (it attends keys there and has more than one
// segment), and the fold of one segment's partial {m = pm, Σ = pl, V sums pv} into the pair's state
// st = {M, Σ, A[hd]} (csrc/attention.cpp: a pair's segments are folded in segment order).
bool pair_has_partial(const AttnArgs& a, int64_t row, int64_t head, int64_t s);
void fold_partial(float* st, float pm, float pl, const float* pv, int64_t hd);
// st[c] = fma(ps[c], wb, st[c] · wa) for c < n: the V sums of a segment fold (fold_partial), one
// element at a time, so the AVX2 / AVX-512 loops give std::fma's bits.
void attn_fold_rows_avx2(float* st, const float* ps, int64_t n, float wa, float wb);
void attn_fold_rows_avx512(float* st, const float* ps, int64_t n, float wa, float wb);

using AttnGroupFn = void (*)(const AttnArgs& a, int64_t kvh, int64_t u_begin, int64_t u_end,
                             int64_t seg, const AttnPartials& part);
void attn_group_avx2(const AttnArgs& a, int64_t kvh, int64_t u_begin, int64_t u_end, int64_t seg,
                     const AttnPartials& part);
void attn_group_avx512(const AttnArgs& a, int64_t kvh, int64_t u_begin, int64_t u_end,
                       int64_t seg, const AttnPartials& part);
void attn_group_avx512_bf16(const AttnArgs& a, int64_t kvh, int64_t u_begin, int64_t u_end,
                            int64_t seg, const AttnPartials& part);
// QKᵀ and PV on AMX-BF16 tiles (csrc/x86/attention_amx.cpp); the draft copy keeps the AVX-512 kernels.
void attn_group_amx(const AttnArgs& a, int64_t kvh, int64_t u_begin, int64_t u_end, int64_t seg,
                    const AttnPartials& part);
// The same over the draft copy (a.draft_q8; csrc/x86/attention_q8_impl.h).
void attn_row_head_ref_q8(const AttnArgs& a, int64_t i, int64_t h, float* scratch);
void attn_group_q8_avx2(const AttnArgs& a, int64_t kvh, int64_t u_begin, int64_t u_end, int64_t seg,
                        const AttnPartials& part);
void attn_group_q8_avx512(const AttnArgs& a, int64_t kvh, int64_t u_begin, int64_t u_end,
                          int64_t seg, const AttnPartials& part);
// The avx512 one with vpdpwssd for the INT4 K scores (the same bits; taken when mx_vnni()).
void attn_group_q8_avx512vnni(const AttnArgs& a, int64_t kvh, int64_t u_begin, int64_t u_end,
                              int64_t seg, const AttnPartials& part);
// The amx level's: an INT4 V pass on AMX-BF16 tiles (its weights rounded to BF16 once).
void attn_group_q8_amx(const AttnArgs& a, int64_t kvh, int64_t u_begin, int64_t u_end, int64_t seg,
                       const AttnPartials& part);

}  // namespace qspec
