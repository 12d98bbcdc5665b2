// Causal attention for decode / verify / prefill over the one shared KV cache.
//
// Cache layout (docs/architecture.md): [layers][2][max_seq][kv_heads][head_dim] BF16 bits (uint16),
// K at index 0, V at index 1. Query row i sits at position start_pos + i and attends keys
// 0 .. start_pos + i (causal); the caller has already written K/V for every such position.
//
// Batch invariance (docs/architecture.md invariant 2): the output of query row i is bit-identical
// whatever m is, whatever the other rows hold and whatever the thread count.
#pragma once
#include <cstdint>

#include "cpu.h"

namespace qspec {

struct KvCacheView {
  uint16_t* data = nullptr;
  int64_t layers = 0, max_seq = 0, kv_heads = 0, head_dim = 0;

  int64_t row_elems() const { return kv_heads * head_dim; }  // one position of K or V
  uint16_t* k(int64_t layer, int64_t pos) const {
    return data + ((layer * 2 + 0) * max_seq + pos) * row_elems();
  }
  uint16_t* v(int64_t layer, int64_t pos) const {
    return data + ((layer * 2 + 1) * max_seq + pos) * row_elems();
  }
};

struct AttnArgs {
  const float* q = nullptr;  // [m, n_heads, head_dim] fp32, RoPE applied
  float* out = nullptr;      // [m, n_heads, head_dim] fp32
  int64_t m = 0, start_pos = 0, n_heads = 0;
  int64_t layer = 0;
  float scale = 0.f;  // usually 1/sqrt(head_dim)
  KvCacheView kv;
};

enum class AttnPath : int { ref = 0, avx2 = 1, avx512 = 2 };
const char* attn_path_name(AttnPath p);
bool attn_supports(AttnPath p, const AttnArgs& a);
AttnPath attn_choose(const AttnArgs& a);  // by isa_selected(); never changes with m
void attention(const AttnArgs& a);         // dispatches
// Per-thread FP32 scratch of at least n floats, 64-byte aligned, reused across calls.
float* attn_thread_scratch(int64_t n);
void attention_path(AttnPath p, const AttnArgs& a);  // throws std::invalid_argument if unsupported

// Scalar reference kernel for ONE (query row i, head h): out[i, h, :] from keys 0 .. start_pos + i,
// sequentially in a fixed order that depends only on start_pos + i. `scratch` holds at least
// start_pos + i + 1 floats (per-thread, owned by the driver). The driver splits (row, head) pairs
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
// segment's partial result (score max, Σ exp, unnormalized Σ exp · V) to `part`, and
// attn_merge_segments() combines a pair's segments in order 0, 1, .. afterwards. The segment
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

struct AttnPartials {
  // [m][n_heads][max_seg][head_dim + 2]: {max, Σ exp, Σ exp · V[0 .. head_dim)} per segment,
  // V sums in natural column order.
  float* data = nullptr;
  int64_t max_seg = 0;
  float* at(const AttnArgs& a, int64_t row, int64_t head, int64_t seg) const {
    return data + ((row * a.n_heads + head) * max_seg + seg) * (a.kv.head_dim + 2);
  }
};

using AttnGroupFn = void (*)(const AttnArgs& a, int64_t kvh, int64_t u_begin, int64_t u_end,
                             int64_t seg, const AttnPartials& part);
void attn_group_avx2(const AttnArgs& a, int64_t kvh, int64_t u_begin, int64_t u_end, int64_t seg,
                     const AttnPartials& part);
void attn_group_avx512(const AttnArgs& a, int64_t kvh, int64_t u_begin, int64_t u_end,
                       int64_t seg, const AttnPartials& part);

}  // namespace qspec
