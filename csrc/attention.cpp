// Causal attention over the shared BF16 KV cache: scalar reference, dispatcher, OpenMP driver
// and Python bindings. The fast kernels are in csrc/x86/attention_{avx2,avx512}.cpp.
//
// Every path computes one (row, head) output with the same three passes over keys 0..p,
// p = start_pos + i (causal by construction: nothing beyond p is ever read for that row, and
// nothing beyond the last row's position for the call):
//   1. s_j = scale · q·K_j          (into per-thread scratch)
//   2. e_j = exp(s_j - max_j s_j),  sum = Σ e_j
//   3. out = (Σ e_j · V_j) / sum
// The order of every reduction depends only on p, so row i is bit-identical for any m, any
// content of the other rows and any thread count (docs/architecture.md invariant 2). The fast paths run
// the passes for all (row, head) pairs of one KV head together, block by block, so each K/V block
// is read and converted once per call rather than once per pair, and per fixed 256-key segment
// (positions counted from key 0), merging a row's segments in order afterwards (attention.h).
#include "attention.h"

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "aligned.h"
#include "bf16.h"
#include "bindings.h"
#include "gemm.h"
#include "pool.h"
#include "profile.h"

namespace qspec {

namespace {

int64_t head_dim_of(const AttnArgs& a) { return a.kv.head_dim; }

}  // namespace

void attn_row_head_ref(const AttnArgs& a, int64_t i, int64_t h, float* scores) {
  const int64_t hd = head_dim_of(a);
  const int64_t kvh = h / (a.n_heads / a.kv.kv_heads);
  const int64_t p = attn_row_pos(a, i);
  const float* q = a.q + (i * a.n_heads + h) * hd;
  float* out = a.out + (i * a.n_heads + h) * hd;

  const int64_t lo = attn_key_lo(a, i);
  float max_s = -INFINITY;
  for (int64_t j = lo; j <= p; ++j) {
    const uint16_t* k = a.kv.k(a.layer, attn_key_slot(a, i, j)) + kvh * hd;
    float dot = 0.f;
    for (int64_t d = 0; d < hd; ++d) dot += q[d] * bf16_to_f32(k[d]);
    scores[j] = a.scale * dot;
    if (scores[j] > max_s) max_s = scores[j];
  }
  float sum = 0.f;
  for (int64_t j = lo; j <= p; ++j) {
    scores[j] = std::exp(scores[j] - max_s);
    sum += scores[j];
  }
  for (int64_t d = 0; d < hd; ++d) out[d] = 0.f;
  for (int64_t j = lo; j <= p; ++j) {
    const uint16_t* v = a.kv.v(a.layer, attn_key_slot(a, i, j)) + kvh * hd;
    for (int64_t d = 0; d < hd; ++d) out[d] += scores[j] * bf16_to_f32(v[d]);
  }
  for (int64_t d = 0; d < hd; ++d) out[d] /= sum;
}

// As attn_row_head_ref over the draft copy (kv_q8.h; INT4 V rows are in the rotated basis, so their
// sum is rotated back): the same sequence over the dequantized values, the BF16 rows from
// attn_recent_lo on (their V summed apart, in the plain basis).
void attn_row_head_ref_q8(const AttnArgs& a, int64_t i, int64_t h, float* scores) {
  const int64_t hd = head_dim_of(a);
  const int64_t kvh = h / (a.n_heads / a.kv.kv_heads);
  const int64_t p = attn_row_pos(a, i);
  const float* q = a.q + (i * a.n_heads + h) * hd;
  float* out = a.out + (i * a.n_heads + h) * hd;
  const int64_t recent = attn_recent_lo(a, i);
  auto value = [&](int kv_index, int64_t j, int64_t d) {
    const int64_t slot = attn_key_slot(a, i, j);
    const int64_t c = kvh * hd + d;
    if (j >= recent) return bf16_to_f32((kv_index ? a.kv.v(a.layer, slot) : a.kv.k(a.layer, slot))[c]);
    const int8_t* row = a.kv.q8_row(a.layer, kv_index, slot);
    const float q4 = float(kv_q4_value(uint8_t(row[c / 2]) >> (4 * (c & 1)) & 15));
    if (kv_index == 0 && a.kv.k_bits == 4) {  // its group's copy once written, else the BF16 row
      const int64_t g = a.kv.k_group_row(a.kv.slot(slot));
      if (!a.kv.k_final[g]) return bf16_to_f32(a.kv.k(a.layer, slot)[c]);
      const uint8_t* ph = a.kv.k_group_params(a.layer, g) + kvh * 3 * hd;
      return bf16_to_f32(uint16_t(ph[2 * d] | ph[2 * d + 1] << 8)) + q4 * kv_q4_scale(ph[2 * hd + d]);
    }
    const uint8_t e = a.kv.q8_scales(a.layer, kv_index, slot)[c / kQ8Block];
    if (kv_index == 1 && a.kv.v_bits == 4) return q4 * kv_q4_scale(e);
    return float(row[c]) * kv_q8_scale(e);
  };
  // keys [0, gap) and [lo, p]: the sinks and the window (all of 0..p without a window), but the
  // pages the sparse draft attention drops
  const int64_t gap = attn_gap_lo(a, i), lo = attn_key_lo(a, i);
  auto step = [&](int64_t j) { return j + 1 == gap ? lo : j + 1; };
  auto next = [&](int64_t j) {
    for (j = step(j); j <= p && !attn_key_kept(a, i, kvh, j);) j = step(j);
    return j;
  };
  int64_t first = gap > 0 ? 0 : lo;
  while (first <= p && !attn_key_kept(a, i, kvh, first)) first = step(first);
  float max_s = -INFINITY;
  for (int64_t j = first; j <= p; j = next(j)) {
    float dot = 0.f;
    for (int64_t d = 0; d < hd; ++d) dot += q[d] * value(0, j, d);
    scores[j] = a.scale * dot;
    if (scores[j] > max_s) max_s = scores[j];
  }
  float sum = 0.f;
  for (int64_t j = first; j <= p; j = next(j)) {
    scores[j] = std::exp(scores[j] - max_s);
    sum += scores[j];
  }
  std::vector<float> plain(size_t(hd), 0.f);  // the recent keys' V sums
  for (int64_t d = 0; d < hd; ++d) out[d] = 0.f;
  for (int64_t j = first; j <= p; j = next(j))
    for (int64_t d = 0; d < hd; ++d) (j >= recent ? plain[d] : out[d]) += scores[j] * value(1, j, d);
  if (a.kv.v_bits == 4) kv_unrotate(out, hd, kv_rot_size(hd));
  for (int64_t d = 0; d < hd; ++d) out[d] = (out[d] + plain[d]) / sum;
}

AttnTreePaths::AttnTreePaths(int64_t prefix, const int64_t* parents, int64_t n_parents,
                             int64_t start_pos, int64_t m) {
  if (prefix < 0 || prefix > start_pos)
    throw std::invalid_argument("tree: prefix " + std::to_string(prefix) + " must be in [0, start_pos = " +
                                std::to_string(start_pos) + "]");
  if (n_parents != start_pos + m - prefix)
    throw std::invalid_argument("tree: parents has " + std::to_string(n_parents) +
                                " entries, expected start_pos + m - prefix = " +
                                std::to_string(start_pos + m - prefix));
  std::vector<int64_t> depth(static_cast<size_t>(n_parents));
  for (int64_t x = 0; x < n_parents; ++x) {
    const int64_t s = prefix + x, par = parents[x];
    if (par == -1) {
      depth[x] = 0;
      continue;
    }
    if (par < prefix || par >= s)
      throw std::invalid_argument("tree: parent " + std::to_string(par) + " of slot " + std::to_string(s) +
                                  " must be -1 or a slot in [prefix = " + std::to_string(prefix) + ", " +
                                  std::to_string(s) + ")");
    depth[x] = depth[par - prefix] + 1;
  }
  off.resize(size_t(m + 1));
  off[0] = 0;
  for (int64_t i = 0; i < m; ++i) off[i + 1] = off[i] + depth[start_pos - prefix + i] + 1;
  path.resize(size_t(off[m]));
  for (int64_t i = 0; i < m; ++i) {
    int64_t s = start_pos + i;
    for (int64_t t = off[i + 1] - 1; t >= off[i]; --t) {  // self, then ancestors up to the root
      path[t] = int32_t(s);
      s = parents[s - prefix];
    }
  }
  view.prefix = prefix;
  view.off = off.data();
  view.path = path.data();
}

float* attn_thread_scratch(int64_t n) {
  thread_local LineVector<float> buf;
  if (int64_t(buf.size()) < n) buf.resize(n);
  return buf.data();
}

const char* attn_path_name(AttnPath p) {
  switch (p) {
    case AttnPath::ref: return "ref";
    case AttnPath::avx2: return "avx2";
    case AttnPath::avx512: return "avx512";
    case AttnPath::amx: return "amx";
    case AttnPath::avx512_bf16: return "avx512_bf16";
  }
  return "?";
}

bool attn_supports(AttnPath p, const AttnArgs& a) {
  if (a.draft_q8 && (!a.kv.q8k || !a.kv.q8v || !a.kv.k_scale || a.kv.head_dim % kQ8Block != 0)) return false;
  if (a.sink_keys < 0 || a.sink_keys > kAttnSegKeys || (a.sink_keys > 0 && !a.draft_q8)) return false;
  if (a.recent_keys < 0 || (a.recent_keys > 0 && !a.draft_q8)) return false;
  if (a.sparse_keys < 0 || (a.sparse_keys > 0 && (a.sparse_keys < kAttnSegKeys || !a.draft_q8))) return false;
  switch (p) {
    case AttnPath::ref: return true;
    case AttnPath::avx2: return int(isa_selected()) >= int(Isa::avx2) && a.kv.head_dim % 8 == 0;
    case AttnPath::avx512:
      return int(isa_selected()) >= int(Isa::avx512) && a.kv.head_dim % 8 == 0;
    case AttnPath::amx: return int(isa_selected()) >= int(Isa::amx) && a.kv.head_dim % 8 == 0;
    case AttnPath::avx512_bf16: return int(isa_selected()) >= int(Isa::avx512_bf16) && a.kv.head_dim % 32 == 0;
  }
  return false;
}

namespace {
std::atomic<bool>& amx_attention_enabled() {
  static std::atomic<bool> on{true};
  return on;
}
}  // namespace

bool set_attn_amx(bool enabled) { return amx_attention_enabled().exchange(enabled); }

namespace {
std::atomic<bool>& bf16_attention_enabled() {
  static std::atomic<bool> on{env_switch("QSPEC_ATTN_DOT", "dpbf16", "fma", cpu_features().vendor != "GenuineIntel")};
  return on;
}
}  // namespace

bool set_attn_bf16(bool enabled) { return bf16_attention_enabled().exchange(enabled); }
bool attn_bf16() { return bf16_attention_enabled().load(std::memory_order_relaxed); }

// Depends on the ISA level, head_dim and the two switches only — never on m or positions
// (invariant 2).
AttnPath attn_choose(const AttnArgs& a) {
  for (AttnPath p : {AttnPath::amx, AttnPath::avx512_bf16, AttnPath::avx512, AttnPath::avx2}) {
    if (p == AttnPath::amx && !amx_attention_enabled().load(std::memory_order_relaxed)) continue;
    if (p == AttnPath::avx512_bf16 && !attn_bf16()) continue;
    if (attn_supports(p, a)) return p;
  }
  return AttnPath::ref;
}

namespace {

void run_ref(AttnRowHeadFn fn, const AttnArgs& a) {
  const int64_t units = a.m * a.n_heads;
  const int64_t max_keys = a.start_pos + a.m;  // longest row: p <= start_pos + m - 1 (tree too)
  const auto t_region = ProfClock::now();
  std::atomic<int64_t> busy_ns{0};
  parallel_for(units, 1, [&](int, int64_t u0, int64_t u1) {
    const auto t_work = ProfClock::now();
    // Per-thread scratch for one row's scores; grows to the longest context seen, kept across
    // calls (the pool's threads persist), so decode steps do not allocate.
    thread_local std::vector<float> scratch;
    if (int64_t(scratch.size()) < max_keys + 16) scratch.resize(max_keys + 16);
    for (int64_t u = u0; u < u1; ++u) fn(a, u / a.n_heads, u % a.n_heads, scratch.data());
    busy_ns.fetch_add(nanoseconds_between(t_work, ProfClock::now()), std::memory_order_relaxed);
  });
  attn_timing().add(seconds_between(t_region, ProfClock::now()), 1e-9 * double(busy_ns.load()),
                    Pool::instance().threads());
}

}  // namespace

// The segments of pair (row, head) that hold a partial, p = attn_row_pos >= kAttnSegKeys: those
// below nseg = ceil((p + 1) / S) that are not below its window (segment 0 holds sinks when it has
// them, sink_keys <= kAttnSegKeys) and whose keys the sparse draft attention keeps for its KV head.
bool pair_has_partial(const AttnArgs& a, int64_t row, int64_t head, int64_t s) {
  const int64_t p = attn_row_pos(a, row), S = kAttnSegKeys;
  const int64_t s0 = attn_key_lo(a, row) / S;
  if (s * S > p || (s < s0 && !(s == 0 && attn_gap_lo(a, row) > 0))) return false;
  const int64_t kvh = head / (a.n_heads / a.kv.kv_heads);
  return attn_keys_kept(a, row, kvh, s * S, (s + 1) * S < p + 1 ? (s + 1) * S : p + 1);
}

// A pair's segments are combined by one fold in segment order (online softmax over the partials):
// st = {M, Σ, A[0 .. hd)} starts empty (M = -inf) and for each partial {m, l, V} in order 0, 1, ..
//   M' = max(M, m),  a = exp(M - M'),  b = exp(m - M'),  Σ = Σ·a + l·b,  A = fma(V, b, A·a)
// (the first one is taken as it is; an empty partial, m = -inf, is skipped); out = A · (1 / Σ).
// A's loop runs as wide as the ISA level allows, each element one FMA (std::fma's bits), and
// exp(0) = 1 is not computed: an 8k prefill folds ~1.6 M partials a layer, and the scalar fold
// with its two exps was ~10% of the AMX kernel's attention.
// It depends only on the pair's own partials and their order, so a unit that folds its pairs'
// partials as it finishes each segment (run_chunk_units) and a merge after all units
// (run_grouped) give the same bits, and neither needs all of a pair's partials at once.
void fold_partial(float* st, float pm, float pl, const float* pv, int64_t hd) {
  if (pm == -INFINITY) return;
  if (st[0] == -INFINITY) {
    st[0] = pm;
    st[1] = pl;
    std::memcpy(st + 2, pv, size_t(hd) * 4);
    return;
  }
  const float m = st[0] > pm ? st[0] : pm;
  const float wa = st[0] == m ? 1.f : std::exp(st[0] - m), wb = pm == m ? 1.f : std::exp(pm - m);
  st[0] = m;
  st[1] = st[1] * wa + pl * wb;
  const Isa isa = isa_selected();
  if (isa >= Isa::avx512) return attn_fold_rows_avx512(st + 2, pv, hd, wa, wb);
  if (isa >= Isa::avx2) return attn_fold_rows_avx2(st + 2, pv, hd, wa, wb);
  for (int64_t c = 0; c < hd; ++c) st[2 + c] = std::fma(pv[c], wb, st[2 + c] * wa);
}

namespace {
void fold_partial(float* st, const float* ps, int64_t hd) { qspec::fold_partial(st, ps[0], ps[1], ps + 2, hd); }

void finish_pair(const AttnArgs& a, const float* st, int64_t row, int64_t head) {
  const int64_t hd = a.kv.head_dim;
  float* out = a.out + (row * a.n_heads + head) * hd;
  const float inv = 1.f / st[1];
  for (int64_t c = 0; c < hd; ++c) out[c] = st[2 + c] * inv;
  // an INT4 V copy's partials are sums in its rotated basis (attention_q8_impl.h): back once here
  if (a.draft_q8 && a.kv.v_bits == 4) kv_unrotate(out, hd, kv_rot_size(hd));
}

// Folds every partial of pair (row, head) from `part`; st: head_dim + 2 floats of scratch.
void merge_segments(const AttnArgs& a, const AttnPartials& part, int64_t row, int64_t head, float* st) {
  st[0] = -INFINITY;
  const int64_t nseg = (attn_row_pos(a, row) + kAttnSegKeys) / kAttnSegKeys;
  for (int64_t s = 0; s < nseg; ++s)
    if (pair_has_partial(a, row, head, s)) fold_partial(st, part.at(a, row, head, s), a.kv.head_dim);
  finish_pair(a, st, row, head);
}

// Fast paths: a work unit is (KV head, contiguous range of rows, key segment); it covers all G
// query heads of those rows, so it streams the segment's K/V of its KV head once for G · rows
// pairs. Each unit pays one pass over its K/V blocks (BF16 -> FP32 conversion), so units are
// kept as large as load balance and the cache allow: row chunks are added when KV heads ×
// segments give fewer than ~2 units per thread, and so that a unit holds at most
// kAttnUnitPairs pairs (prefill). Segments are fixed by key position (attention.h), and how
// pairs are grouped never changes a pair's arithmetic, so all of this may follow m and the
// thread count freely. Pairs with more than one segment are merged afterwards.
constexpr int64_t kAttnUnitPairs = 96;  // 16 rows of 6 heads per KV head measured best; 8-64 rows within 10%
// The AMX kernel's: its tiles make the pairs' arithmetic cheap enough that staging each unit's
// K/V from the cache (L3 at 8k keys) is what bounds a small unit. Qwen2.5-Coder-1.5B's shape on a
// model-167 AMX Xeon, 2 threads, `qspec bench attention --prefill`: 384 pairs (64 rows) 1.16x
// faster than 96 at 8,192 rows, 1.05x at 2,048.
constexpr int64_t kAttnUnitPairsAmx = 384;
// From this many rows (a long prompt's prefill) a unit is (KV head, row chunk) over all of its
// segments instead of one: it folds its pairs' partials as it finishes each segment
// (fold_partial, the same order as merge_segments: the same bits), and its q rows stay in cache
// from segment to segment. With one segment per unit, the partials of all rows (m x heads x segments x
// (head_dim + 2) floats: 1.6 GB for an 8k prompt of the 1.5B) went through memory and each
// segment reloaded every unit's q. Below it such units are taken too when they spread evenly over
// the threads (verify rows, tree rows, draft passes; chunk_units_pay), and one-segment units
// otherwise, whose K/V segments consecutive units share in cache.
constexpr int64_t kAttnChunkUnitRows = 256;

// Whether segment s holds a key some row of [r0, r1) attends: a row reaches it, it is not wholly
// below every row's window unless it holds sinks, and not wholly dropped by the sparse draft
// attention for every row and KV head.
bool segment_live(const AttnArgs& a, int64_t r0, int64_t r1, int64_t s) {
  const int64_t S = kAttnSegKeys;
  if (r0 == r1 || attn_max_keys(a, r0, r1) <= s * S) return false;
  if (!(attn_min_key_lo(a, r0, r1) < (s + 1) * S || s * S < a.sink_keys)) return false;
  for (int64_t i = r0; a.page_keep && i < r1; ++i)  // dropped by the sparse draft attention?
    for (int64_t h = 0; h < a.kv.kv_heads; ++h) {
      const int64_t n = attn_row_pos(a, i) + 1;
      if (s * S < n && attn_keys_kept(a, i, h, s * S, (s + 1) * S < n ? (s + 1) * S : n)) return true;
    }
  return !a.page_keep;
}

// Whether units of (KV head, row chunk) over all their segments (run_chunk_units) beat one-segment
// units for a pass of `units` such units on nt threads: a long prompt's always; below
// kAttnChunkUnitRows when they spread evenly over the threads, except one BF16 row. Qwen2.5-Coder-
// 1.5B's shape at 8,192 keys on the model-167 AMX Xeon, 2 threads (a throwaway script, one layer's
// call repeated, builds alternating twice): amx 9 rows 42-45 -> 33-34 ms a step, 16 rows 67-73 ->
// 51-54; the MX draft row over the INT4 copy (sparse budget 2,048) amx 11.2-11.4 -> 9.9-10.2,
// avx512 10.0-11.6 -> 8.8-9.4, avx2 10.1 -> 9.2; 9 BF16 rows avx512 88-89 -> 80-82, avx2 108 -> 103;
// one BF16 row avx512 13.7 -> 14.6-14.9 (slower: kept on one-segment units), amx 14.1-15.1 -> 13.8-14.0.
// With one thread (--threads 1, or a tensor-parallel rank's on a 2-core machine) a long prompt takes
// them too (run_grouped): the last 2,048 rows of an 8,192-row prefill took 338 ms on one-segment
// units (every row's partials of all 32 segments through memory) against 152-158 on these (amx);
// 512 of them avx512 244 -> 214, avx2 392 -> 366; the whole 8k prefill 162-165 -> 237-242 tok/s.
// Verify and draft rows stay on one-segment units there (`qspec bench attention --threads 1`: 9
// and 16 amx rows 10-20% faster at 2,048 keys on these but 8-11% slower at 8,192, the INT4 draft
// row at 8,192 slower): consecutive units share each segment's K/V in cache.
bool chunk_units_pay(const AttnArgs& a, int64_t units, int64_t nt) {
  if (a.m >= kAttnChunkUnitRows) return true;
  return (a.m > 1 || a.draft_q8) && (units % nt == 0 || units >= 4 * nt);
}

// Units of (KV head, row chunk) over all their segments (kAttnChunkUnitRows), the chunks with
// the most segments first.
void run_chunk_units(AttnGroupFn fn, const AttnArgs& a, int64_t chunks) {
  const int64_t group = a.n_heads / a.kv.kv_heads, kvh = a.kv.kv_heads, hd = a.kv.head_dim;
  const int64_t nt = Pool::instance().threads(), S = kAttnSegKeys;
  int64_t rows_max = 0, seg_max = 1;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t r0 = c * a.m / chunks, r1 = (c + 1) * a.m / chunks;
    rows_max = r1 - r0 > rows_max ? r1 - r0 : rows_max;
    const int64_t segs = (attn_max_keys(a, r0, r1) + S - 1) / S;
    seg_max = segs > seg_max ? segs : seg_max;
  }
  // Per thread: one segment's partials of a unit's rows (the kernel's `part`) and the pairs' fold
  // states (fold_partial), both rows x n_heads x (head_dim + 2) floats: a unit folds each segment
  // as it finishes it, so its partials stay in cache (all its segments' partials at once were
  // 12.8 MB a thread for an 8k prompt of the 1.5B, written and read back through memory).
  const int64_t slot_floats = 2 * rows_max * a.n_heads * (hd + 2);
  thread_local std::vector<float> part_buf;  // a slot per thread (allocated here: workers never throw)
  if (part_buf.size() < size_t(slot_floats * nt)) part_buf.resize(size_t(slot_floats * nt));
  float* const parts = part_buf.data();
  const auto t_region = ProfClock::now();
  std::atomic<int64_t> busy_ns{0};
  parallel_for(chunks * kvh, 1, [&](int slot, int64_t w0, int64_t w1) {
    const auto t_work = ProfClock::now();
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t c = chunks - 1 - w / kvh, h = w % kvh;
      const int64_t r0 = c * a.m / chunks, r1 = (c + 1) * a.m / chunks;
      if (r0 == r1) continue;
      AttnPartials part;
      part.data = parts + slot * slot_floats;
      part.max_seg = 1;
      part.row0 = r0;
      part.unit_continues = false;
      part.states = part.data + slot_floats / 2;
      auto state = [&](int64_t row, int64_t head) { return part.state(a, row, head); };
      for (int64_t row = r0; row < r1; ++row)
        for (int64_t head = h * group; head < (h + 1) * group; ++head) state(row, head)[0] = -INFINITY;
      for (int64_t s = 0; s < seg_max; ++s)
        if (segment_live(a, r0, r1, s)) {
          part.seg0 = s;
          part.kernel_folded = false;
          fn(a, h, r0 * group, r1 * group, s, part);
          part.unit_continues = true;
          for (int64_t row = r0; row < r1 && !part.kernel_folded; ++row)
            if (attn_row_pos(a, row) >= S)
              for (int64_t head = h * group; head < (h + 1) * group; ++head)
                if (pair_has_partial(a, row, head, s)) fold_partial(state(row, head), part.at(a, row, head, s), hd);
        }
      for (int64_t row = r0; row < r1; ++row)
        if (attn_row_pos(a, row) >= S)
          for (int64_t head = h * group; head < (h + 1) * group; ++head) finish_pair(a, state(row, head), row, head);
    }
    busy_ns.fetch_add(nanoseconds_between(t_work, ProfClock::now()), std::memory_order_relaxed);
  });
  attn_timing().add(seconds_between(t_region, ProfClock::now()), 1e-9 * double(busy_ns.load()), int(nt));
}

void run_grouped(AttnGroupFn fn, const AttnArgs& a, int64_t unit_pairs = kAttnUnitPairs) {
  const int64_t group = a.n_heads / a.kv.kv_heads;
  const int64_t kvh = a.kv.kv_heads;
  const int64_t nt = Pool::instance().threads();
  const int64_t n_last = attn_max_keys(a, 0, a.m);  // keys of the longest row
  const int64_t max_seg = (n_last + kAttnSegKeys - 1) / kAttnSegKeys;
  int64_t chunks = 1;
  if (nt > 1 && kvh * max_seg < 2 * nt) {
    chunks = (2 * nt + kvh * max_seg - 1) / (kvh * max_seg);
    if (chunks > a.m) chunks = a.m;
  }
  // Prefill: at most ~kAttnUnitPairs pairs a unit, so a unit's q, scores and V sums stay in
  // cache while it sweeps the segment (one unit of all 2,048 rows streamed ~12 MB of them per
  // 32-key block: Zen 3 AVX2, 2 threads, 12/2 heads of 128, 2,048 rows: 57 -> 119 GFLOP/s).
  const int64_t unit_rows = unit_pairs / group > 0 ? unit_pairs / group : 1;
  if ((a.m + unit_rows - 1) / unit_rows > chunks) chunks = (a.m + unit_rows - 1) / unit_rows;
  if (max_seg > 1 && (nt > 1 || a.m >= kAttnChunkUnitRows) && chunk_units_pay(a, kvh * chunks, nt))
    return run_chunk_units(fn, a, chunks);
  struct Unit {
    int64_t kvh, r0, r1, seg;
  };
  thread_local std::vector<Unit> units;
  units.clear();
  for (int64_t s = 0; s < max_seg; ++s)  // full segments first: the last ones are short
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t r0 = c * a.m / chunks, r1 = (c + 1) * a.m / chunks;
      if (!segment_live(a, r0, r1, s)) continue;
      for (int64_t h = 0; h < kvh; ++h) units.push_back({h, r0, r1, s});
    }
  AttnPartials part;
  thread_local std::vector<float> part_buf;
  if (n_last > kAttnSegKeys) {
    const size_t need = size_t(a.m * a.n_heads * max_seg * (a.kv.head_dim + 2));
    if (part_buf.size() < need) part_buf.resize(need);
    part.data = part_buf.data();
    part.max_seg = max_seg;
  }
  // Rows whose p >= kAttnSegKeys have several segments and need merging: linear rows from
  // first_merged on, tree rows as listed in merged_rows.
  int64_t first_merged = kAttnSegKeys - a.start_pos > 0 ? kAttnSegKeys - a.start_pos : 0;
  thread_local std::vector<int64_t> merged_rows;
  merged_rows.clear();
  if (a.tree) {
    for (int64_t i = 0; i < a.m; ++i)
      if (attn_row_pos(a, i) >= kAttnSegKeys) merged_rows.push_back(i);
    first_merged = a.m - int64_t(merged_rows.size());
  }
  const int64_t merged = first_merged < a.m ? (a.m - first_merged) * a.n_heads : 0;
  const int64_t* mrows = a.tree ? merged_rows.data() : nullptr;
  auto merge_row = [&](int64_t x) { return mrows ? mrows[x / a.n_heads] : first_merged + x / a.n_heads; };
  const int64_t nu = int64_t(units.size());
  const Unit* us = units.data();
  auto run_unit = [&](int64_t w) {
    fn(a, us[w].kvh, us[w].r0 * group, us[w].r1 * group, us[w].seg, part);
  };
  if (nt <= 1 || (nu <= 1 && merged <= 1)) {
    for (int64_t w = 0; w < nu; ++w) run_unit(w);
    std::vector<float> st(size_t(a.kv.head_dim + 2));
    for (int64_t x = 0; x < merged; ++x)
      merge_segments(a, part, merge_row(x), x % a.n_heads, st.data());
    return;
  }
  // Two jobs: every unit is done before any pair is merged. Idle counts every configured
  // thread (one that never joined was idle the whole job).
  // A thread takes all KV heads of a (segment, chunk) at once when there are enough of those to
  // go round: the heads' K/V rows share cache lines (a cache row holds every head of a position),
  // and two threads reading halves of the same lines fetch each of them twice.
  const int64_t grain = nu / kvh >= 2 * nt ? kvh : 1;
  const auto t_region = ProfClock::now();
  std::atomic<int64_t> busy_ns{0};
  parallel_for(nu, grain, [&](int, int64_t w0, int64_t w1) {
    const auto t_work = ProfClock::now();
    for (int64_t w = w0; w < w1; ++w) run_unit(w);
    busy_ns.fetch_add(nanoseconds_between(t_work, ProfClock::now()), std::memory_order_relaxed);
  });
  if (merged > 0) {
    const int64_t grain = (merged + 2 * nt - 1) / (2 * nt);
    parallel_for(merged, grain, [&](int, int64_t x0, int64_t x1) {
      const auto t_work = ProfClock::now();
      thread_local std::vector<float> st;
      if (int64_t(st.size()) < a.kv.head_dim + 2) st.resize(size_t(a.kv.head_dim + 2));
      for (int64_t x = x0; x < x1; ++x)
        merge_segments(a, part, merge_row(x), x % a.n_heads, st.data());
      busy_ns.fetch_add(nanoseconds_between(t_work, ProfClock::now()), std::memory_order_relaxed);
    });
  }
  attn_timing().add(seconds_between(t_region, ProfClock::now()), 1e-9 * double(busy_ns.load()), int(nt));
}

}  // namespace

RegionTiming& attn_timing() {
  thread_local RegionTiming t;
  return t;
}

namespace {
// a.page_keep = keep, as attn_select_pages fills it (csrc/draft_pages.cpp), a.page_stride pages a row.
void attn_choose_pages(AttnArgs& a, std::vector<uint8_t>& keep) {
  a.page_stride = (attn_max_keys(a, 0, a.m) + a.kv.k_group - 1) / a.kv.k_group;
  keep.assign(size_t(a.m * a.kv.kv_heads * a.page_stride), 1);
  attn_select_pages(a, keep.data());
  a.page_keep = keep.data();
}
}  // namespace

void attention_path(AttnPath p, const AttnArgs& a) {
  if (!attn_supports(p, a))
    throw std::invalid_argument(std::string("attention path '") + attn_path_name(p) +
                                "' is not supported on this CPU / ISA level / head_dim");
  if (a.m <= 0) return;
  if (attn_sparse(a) && !a.page_keep) {  // the pages each row attends first
    AttnArgs b = a;
    thread_local std::vector<uint8_t> keep;
    attn_choose_pages(b, keep);
    return attention_path(p, b);
  }
  const bool q8 = a.draft_q8;  // the draft copy (with windows and sinks: attention_q8_impl.h)
  const auto q8_avx512 = mx_vnni() ? attn_group_q8_avx512vnni : attn_group_q8_avx512;  // the same bits
  switch (p) {
    case AttnPath::ref: run_ref(q8 ? attn_row_head_ref_q8 : attn_row_head_ref, a); break;
    case AttnPath::avx2: run_grouped(q8 ? attn_group_q8_avx2 : attn_group_avx2, a); break;
    case AttnPath::avx512: run_grouped(q8 ? q8_avx512 : attn_group_avx512, a); break;
    case AttnPath::amx: run_grouped(q8 ? attn_group_q8_amx : attn_group_amx, a, kAttnUnitPairsAmx); break;
    case AttnPath::avx512_bf16: run_grouped(q8 ? q8_avx512 : attn_group_avx512_bf16, a); break;
  }
}

void attention(const AttnArgs& a) { attention_path(attn_choose(a), a); }

// ---------------------------------------------------------------------------------------------
// Python bindings

namespace py = pybind11;

namespace {

AttnPath attn_path_from_name(const std::string& name) {
  for (AttnPath p : {AttnPath::ref, AttnPath::avx2, AttnPath::avx512, AttnPath::avx512_bf16, AttnPath::amx})
    if (name == attn_path_name(p)) return p;
  throw std::invalid_argument("attention path '" + name + "' is not one of ref, avx2, avx512, avx512_bf16, amx");
}

// A probe AttnArgs with the given head_dim, for the shape-independent questions from Python.
AttnArgs probe_args(int64_t head_dim) {
  AttnArgs a;
  a.kv.head_dim = head_dim;
  return a;
}

}  // namespace

void kv_set_pages(KvCacheView& kv, const int32_t* pages, int64_t n_pages, int64_t page_size, int64_t positions) {
  if (page_size <= 0 || page_size % 8 != 0 || kv.max_seq % page_size != 0)
    throw std::invalid_argument("page_size must be a positive multiple of 8 that divides the pool's rows (" +
                                std::to_string(kv.max_seq) + ")");
  if (positions > n_pages * page_size)
    throw std::invalid_argument("positions up to " + std::to_string(positions - 1) + " exceed the " +
                                std::to_string(n_pages) + " pages of the page table");
  const int64_t pool_pages = kv.max_seq / page_size, used = (positions + page_size - 1) / page_size;
  for (int64_t i = 0; i < used; ++i)
    if (pages[i] < 0 || pages[i] >= pool_pages)
      throw std::invalid_argument("page table entry " + std::to_string(pages[i]) + " outside the pool's " +
                                  std::to_string(pool_pages) + " pages");
  kv.pages = pages;
  kv.page_size = page_size;
  kv.page_shift = kv_shift(page_size);
}

namespace {

py::object attention_py(py::array q_in, py::array kv_in, int64_t layer, int64_t start_pos,
                                std::optional<float> scale, std::optional<std::string> path,
                                std::optional<std::pair<int64_t, py::object>> tree, int64_t window,
                                std::optional<py::tuple> q8,
                                std::optional<py::array_t<int32_t, py::array::c_style | py::array::forcecast>> pages,
                                int64_t page_size, int64_t sinks, int64_t recent, int64_t sparse, bool kept_pages) {
  if (!py::isinstance<py::array_t<float>>(q_in) || q_in.dtype().kind() != 'f' ||
      q_in.itemsize() != 4)
    throw std::invalid_argument("attention: q must be a float32 array");
  if (kv_in.dtype().kind() != 'u' || kv_in.itemsize() != 2)
    throw std::invalid_argument("attention: kv must be a uint16 array of bf16 bits");
  if (q_in.ndim() != 3)
    throw std::invalid_argument("attention: q must be [m, n_heads, head_dim]");
  if (kv_in.ndim() != 5)
    throw std::invalid_argument("attention: kv must be [layers, 2, max_seq, kv_heads, head_dim]");
  if (!(kv_in.flags() & py::array::c_style))
    throw std::invalid_argument("attention: kv must be C-contiguous (it is the shared cache)");
  auto q = py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(q_in);

  AttnArgs a;
  a.m = q.shape(0);
  a.n_heads = q.shape(1);
  a.kv.layers = kv_in.shape(0);
  a.kv.max_seq = kv_in.shape(2);
  a.kv.kv_heads = kv_in.shape(3);
  a.kv.head_dim = kv_in.shape(4);
  a.layer = layer;
  a.start_pos = start_pos;
  if (kv_in.shape(1) != 2) throw std::invalid_argument("attention: kv dim 1 must be 2 (K, V)");
  if (a.kv.head_dim <= 0 || a.kv.kv_heads <= 0)
    throw std::invalid_argument("attention: kv_heads and head_dim must be positive");
  if (q.shape(2) != a.kv.head_dim)
    throw std::invalid_argument("attention: q head_dim " + std::to_string(q.shape(2)) +
                                " != kv head_dim " + std::to_string(a.kv.head_dim));
  if (a.n_heads <= 0 || a.n_heads % a.kv.kv_heads != 0)
    throw std::invalid_argument("attention: n_heads " + std::to_string(a.n_heads) +
                                " must be a positive multiple of kv_heads " +
                                std::to_string(a.kv.kv_heads));
  if (layer < 0 || layer >= a.kv.layers)
    throw std::invalid_argument("attention: layer " + std::to_string(layer) + " out of range [0, " +
                                std::to_string(a.kv.layers) + ")");
  if (start_pos < 0) throw std::invalid_argument("attention: start_pos must be >= 0");
  if (pages)
    kv_set_pages(a.kv, pages->data(), pages->size(), page_size, start_pos + a.m);
  else if (start_pos + a.m > a.kv.max_seq)
    throw std::invalid_argument("attention: positions up to " + std::to_string(start_pos + a.m - 1) +
                                " exceed max_seq " + std::to_string(a.kv.max_seq));
  a.scale = scale ? *scale : 1.f / std::sqrt(float(a.kv.head_dim));
  if (!std::isfinite(a.scale)) throw std::invalid_argument("attention: scale must be finite");
  if (window < 0) throw std::invalid_argument("attention: window must be >= 0");
  a.window = window;
  std::optional<AttnTreePaths> paths;
  if (tree) {
    auto par = py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(tree->second);
    if (!par || par.ndim() != 1) throw std::invalid_argument("attention: tree parents must be a 1-D int array");
    paths.emplace(tree->first, par.data(), par.shape(0), start_pos, a.m);
    a.tree = &paths->view;
  }
  if (q8) {  // attend over the draft copy instead of the BF16 rows
    kv_set_copy(a.kv, *q8, "attention: q8");
    if (a.kv.k_bits == 4 && pages && page_size != a.kv.k_group)
      throw std::invalid_argument("attention: q8's INT4 K groups must be the pages");
    a.draft_q8 = true;
  }
  if (sinks < 0 || sinks > kAttnSegKeys || (sinks > 0 && !a.draft_q8))
    throw std::invalid_argument("attention: sinks must be in [0, " + std::to_string(kAttnSegKeys) +
                                "] and need q8 (the draft copy)");
  a.sink_keys = sinks;
  if (recent < 0 || (recent > 0 && !a.draft_q8))
    throw std::invalid_argument("attention: recent must be >= 0 and needs q8 (the draft copy)");
  a.recent_keys = recent;
  if (sparse < 0 || (sparse > 0 && (sparse < kAttnSegKeys || !a.draft_q8)))
    throw std::invalid_argument("attention: sparse must be 0 or >= " + std::to_string(kAttnSegKeys) +
                                " and needs q8 (the draft copy)");
  a.sparse_keys = sparse;
  AttnPath p = path ? attn_path_from_name(*path) : attn_choose(a);
  if (!attn_supports(p, a))
    throw std::invalid_argument(std::string("attention: path '") + attn_path_name(p) +
                                "' is not usable here (ISA level " + isa_name(isa_selected()) +
                                ", head_dim " + std::to_string(a.kv.head_dim) + ")");

  py::array_t<float> out({a.m, a.n_heads, a.kv.head_dim});
  a.q = q.data();
  a.out = out.mutable_data();
  a.kv.data = static_cast<uint16_t*>(const_cast<void*>(kv_in.data()));
  std::vector<uint8_t> keep;
  {
    py::gil_scoped_release release;
    if (kept_pages && attn_sparse(a)) attn_choose_pages(a, keep);  // here, to be returned
    attention_path(p, a);
  }
  if (!kept_pages) return std::move(out);
  py::array_t<bool> kept({a.m, a.kv.kv_heads, a.page_stride});
  for (size_t x = 0; x < keep.size(); ++x) kept.mutable_data()[x] = keep[x] != 0;
  return py::make_tuple(out, kept);
}

}  // namespace

void bind_attention(py::module_& m) {
  m.def("attention", &attention_py, py::arg("q"), py::arg("kv"), py::arg("layer"),
        py::arg("start_pos"), py::arg("scale") = py::none(), py::arg("path") = py::none(),
        py::arg("tree") = py::none(), py::arg("window") = 0, py::arg("q8") = py::none(),
        py::arg("pages") = py::none(), py::arg("page_size") = 0, py::arg("sinks") = 0,
        py::arg("recent") = 0, py::arg("sparse") = 0, py::arg("kept_pages") = false,
        "Causal attention of q [m, n_heads, head_dim] f32 (row i at position start_pos + i) over "
        "the BF16 cache kv [layers, 2, max_seq, kv_heads, head_dim] (uint16 bits); "
        "scale defaults to 1/sqrt(head_dim), path to attn_choose(); tree = (prefix, parents): "
        "row i is the tree node at slot start_pos + i (csrc/attention.h AttnTree); window > 0: sliding "
        "window, a row at position p attends keys p - window + 1 .. p; q8 = a draft copy's "
        "five arrays (qspec/kv_cache.py: K values, V values, K scales, V scales, page flags): attend over it "
        "instead of kv's BF16 rows; "
        "pages (int32) with page_size: a paged cache, position p in pool row pages[p / page_size] * "
        "page_size + p % page_size; sinks (with q8 and a window): keys 0 .. sinks - 1 are attended too; "
        "recent (with q8): a row at position p reads keys p - recent + 1 .. p from kv's BF16 rows; "
        "sparse (with an INT4 q8): each row attends about that many keys of its written "
        "pages (csrc/draft_pages.cpp); kept_pages: return (out, kept [m, kv_heads, pages] bool)");
  m.def("attn_paths", [] {
    std::vector<std::string> names;
    AttnArgs a = probe_args(64);
    for (AttnPath p : {AttnPath::ref, AttnPath::avx2, AttnPath::avx512, AttnPath::avx512_bf16, AttnPath::amx})
      if (attn_supports(p, a)) names.push_back(attn_path_name(p));
    return names;
  }, "Attention paths usable at the selected ISA level (for head_dim a multiple of 8)");
  m.attr("attn_seg_keys") = kAttnSegKeys;  // the key segments a pair's softmax is normalised by, from key 0
  m.def("set_attn_amx", &set_attn_amx, py::arg("enabled"),
        "Let attention() take the AMX path at the amx level (default True); False: the AVX-512 one. "
        "Returns the previous setting. For A/B runs: set it before loading a model, not between a "
        "generation's passes (plain and speculative passes must take the same path)");
  m.def("set_attn_bf16", &set_attn_bf16, py::arg("enabled"),
        "Let attention() take the avx512_bf16 path (vdpbf16ps, BF16 q and weights) at its level; False: the "
        "FP32 avx512 one. Default from QSPEC_ATTN_DOT=dpbf16|fma, unset: not on Intel. Returns the previous "
        "setting; set it before loading a model, as set_attn_amx");
  m.def("attn_bf16", &attn_bf16, "Whether attention() takes the avx512_bf16 path at its level");
  m.def("attn_choose", [](int64_t head_dim) {
    if (head_dim <= 0) throw std::invalid_argument("attn_choose: head_dim must be positive");
    return std::string(attn_path_name(attn_choose(probe_args(head_dim))));
  }, py::arg("head_dim") = 64, "The path attention() takes at the selected ISA level");
}

}  // namespace qspec
