// Sparse draft attention over the INT4 copy of the KV cache (AttnArgs::sparse_keys): which of its
// written pages each row's drafts attend.
//
// The copy quantizes K per channel over each page (kv_q8.h, kv_k4_group): every key of a page lies
// per channel within center ± 7 · scale, so for any key k of page g
//     q · k <= U(q, g) = Σ_c q_c · center_c + 7 · |q_c| · scale_c
// (Quest, Tang et al. 2024: an upper bound on a page's scores from per-channel extremes). Of the
// pages wholly inside its window (if any) and below its recent keys and a tree's prefix, a row
// drops all but the sparse_keys / k_group - 2 with the largest bound (the max over the query heads
// of the KV head: they share the loads); page 0 and the last of them are never dropped, and
// everything else the row attends stays attended. A page whose copy is
// not written yet (its BF16 K rows) or whose bound is not finite is always kept. The choice
// depends only on the row's q, its position and the cache, so every row's result still does.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "attention.h"
#include "bf16.h"
#include "kv_q8.h"
#include "pool.h"

namespace qspec {

namespace {
constexpr int kLanes = 16;  // partial sums of a bound (lanes the compiler may vectorize)

struct Scale7 {  // 7 · kv_q4_scale(e) for every byte e
  float v[256];
  Scale7() {
    for (int e = 0; e < 256; ++e) v[e] = 7.f * kv_q4_scale(uint8_t(e));
  }
  float operator[](uint8_t e) const { return v[e]; }
};
const Scale7 scale7;
}  // namespace

void attn_select_pages(const AttnArgs& a, uint8_t* keep) {
  const int64_t P = a.kv.k_group, hd = a.kv.head_dim, kvh_n = a.kv.kv_heads;
  const int64_t G = a.n_heads / kvh_n;
  const int64_t budget = a.sparse_keys / P - 2;  // besides the first and the last page
  parallel_for(a.m * kvh_n, 1, [&](int, int64_t w0, int64_t w1) {
    // per page its centers and 7 · scales (FP32); per (row, KV head) its heads' q and |q|
    std::vector<float> cen(static_cast<size_t>(hd)), scl(static_cast<size_t>(hd)), bound;
    std::vector<float> qs(static_cast<size_t>(G * hd)), qa(static_cast<size_t>(G * hd));
    std::vector<uint16_t> cbits(static_cast<size_t>(hd));
    std::vector<int64_t> order;
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t i = w / kvh_n, kvh = w % kvh_n;
      int64_t end = attn_recent_lo(a, i);
      if (a.tree && a.tree->prefix < end) end = a.tree->prefix;
      const int64_t last = end / P - 1;  // pages first .. last - 1 may be dropped
      const int64_t lo_page = (attn_key_lo(a, i) + P - 1) / P, first = lo_page > 1 ? lo_page : 1;
      if (last - first <= budget) continue;
      const float* q = a.q + (i * a.n_heads + kvh * G) * hd;  // the KV head's G query heads
      for (int64_t c = 0; c < G * hd; ++c) qs[size_t(c)] = q[c], qa[size_t(c)] = std::fabs(q[c]);
      bound.assign(size_t(last), INFINITY);
      for (int64_t g = first; g < last; ++g) {
        const int64_t grow = a.kv.k_group_row(a.kv.slot(g * P));
        if (!a.kv.k_final[grow]) continue;  // BF16 K rows: kept
        const uint8_t* ph = a.kv.k_group_params(a.layer, grow) + kvh * 3 * hd;
        std::memcpy(cbits.data(), ph, size_t(hd) * 2);  // BF16 centers, little-endian
        for (int64_t c = 0; c < hd; ++c) cen[size_t(c)] = bf16_to_f32(cbits[size_t(c)]);
        for (int64_t c = 0; c < hd; ++c) scl[size_t(c)] = scale7[ph[2 * hd + c]];
        float best = -INFINITY;
        for (int64_t h = 0; h < G; ++h) {
          const float* qh = qs.data() + h * hd;
          const float* ah = qa.data() + h * hd;
          float acc[kLanes] = {};  // lane c % kLanes (head_dim is a multiple of kQ8Block), then a fixed tree
          for (int64_t c = 0; c < hd; c += kLanes)
            for (int l = 0; l < kLanes; ++l) acc[l] += qh[c + l] * cen[size_t(c + l)] + ah[c + l] * scl[size_t(c + l)];
          for (int w2 = kLanes / 2; w2 > 0; w2 /= 2)
            for (int l = 0; l < w2; ++l) acc[l] += acc[l + w2];
          best = acc[0] > best ? acc[0] : best;
        }
        if (std::isfinite(best)) bound[g] = best;
      }
      order.clear();
      for (int64_t g = first; g < last; ++g) order.push_back(g);
      // the budget's pages of largest bound (ties: the later page), the rest dropped
      auto higher = [&](int64_t x, int64_t y) { return bound[x] != bound[y] ? bound[x] > bound[y] : x > y; };
      std::nth_element(order.begin(), order.begin() + budget, order.end(), higher);
      uint8_t* k = keep + w * a.page_stride;
      for (size_t r = size_t(budget); r < order.size(); ++r)
        if (bound[order[r]] != INFINITY) k[order[r]] = 0;
    }
  });
}

}  // namespace qspec
