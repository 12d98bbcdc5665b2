// Native forward pass of a Llama-family decoder over the shared KV cache.
//
// One call runs M tokens (decode M=1, verify M=K+1, prefill M=prompt) through every layer:
// embedding -> [RMSNorm -> QKV GEMM -> RoPE -> K/V rows into the cache -> attention -> O GEMM
// -> RMSNorm -> gate|up GEMM -> SiLU*up -> down GEMM] x L -> RMSNorm -> LM head.
// Per-architecture options (qspec/config.py says which family sets which): a scale on the
// embedding; per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3); RMSNorms of the attention
// and MLP outputs before their residual adds (Gemma 3); GELU(tanh)*up instead of SiLU*up; the
// attention scale; per layer, which RoPE table it uses (or none: NoPE) and a sliding window;
// RoPE on the first rope_dim columns of each head only (partial rotary).
// Weight sets share everything but the GEMM weights: set 0 is the "target" (BF16), sets 1..
// kWeightSets-1 are MX drafts (level 1 and the draft levels above it, qspec/levels.py).
// Every step works row by row in a fixed order, so each row's result is independent of M
// (docs/architecture.md invariant 2) as long as the GEMM and attention kernels are.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "aligned.h"
#include "attention.h"
#include "bf16.h"
#include "bindings.h"
#include "gemm.h"
#include "model_ops.h"
#include "pool.h"
#include "profile.h"
#include "shm_group.h"

namespace py = pybind11;

namespace qspec {
namespace {

struct LayerSet {
  std::shared_ptr<PackedWeight> wqkv, wo, wgu, wdown;  // [q;k;v], o, [gate;up], down
};

struct WeightSet {
  std::vector<LayerSet> layers;
  std::shared_ptr<PackedWeight> lm_head;
  bool complete(int64_t n_layers) const {
    if (!lm_head || int64_t(layers.size()) != n_layers) return false;
    for (const auto& l : layers)
      if (!l.wqkv || !l.wo || !l.wgu || !l.wdown) return false;
    return true;
  }
};

// Row-wise ops (norms, RoPE, SiLU) are split over threads from 4 rows (verify passes and up);
// each row is computed the same way whichever thread runs it. From 16 rows before: a 9-row
// verify of Qwen2.5-Coder-1.5B spent 2.8-3.0 ms a step in them on one thread, 2.2-2.3 split
// (model-167 AMX Xeon, 2 threads, `qspec bench breakdown --ms 1,5,9,12`, builds alternated).
constexpr int64_t kParallelRows = 4;

template <class F>
void for_rows(int64_t m, F&& f) {
  if (m < kParallelRows) {
    for (int64_t r = 0; r < m; ++r) f(r);
    return;
  }
  parallel_for(m, 1, [&](int, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) f(r);
  });
}

// The target and up to three MX drafts (a speculation chain of at most four levels above it,
// of which the top one may be the weightless n-gram drafter).
constexpr int kWeightSets = 4;

// Rotate-half RoPE (HF Llama): (x1, x2) -> (x1 c - x2 s, x2 c + x1 s) per head, over the head's
// first rd columns (rd = hd but for partial rotary; the rest pass through).
void rope(float* x, int64_t heads, int64_t hd, int64_t rd, const float* cos, const float* sin) {
  const int64_t half = rd / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* v = x + h * hd;
    for (int64_t i = 0; i < half; ++i) {
      const float a = v[i], b = v[i + half];
      v[i] = a * cos[i] - b * sin[i];
      v[i + half] = b * cos[i] + a * sin[i];
    }
  }
}

// One sequence's part of a batched forward: m rows at positions start_pos.. (or, with a tree,
// draft-tree nodes at slots start_pos..: RoPE at prefix + depth, attention over prefix and path;
// attention.h), writing and reading the cache through kv (its page table); logits of every row
// or of the last; draft_q8: its attention reads the draft copy (kv.q8k, q8v).
struct SeqPass {
  int64_t m = 0, start_pos = 0;
  KvCacheView kv;
  const AttnTree* tree = nullptr;
  bool all_logits = false, draft_q8 = false;
};

class Model {
 public:
  Model(const py::dict& cfg, py::array_t<uint16_t, py::array::c_style> embed,
        py::array_t<float, py::array::c_style> norm)
      : embed_(embed), norm_(norm.data(), norm.data() + norm.size()) {
    d_ = cfg["hidden_size"].cast<int64_t>();
    f_ = cfg["intermediate_size"].cast<int64_t>();
    n_layers_ = cfg["n_layers"].cast<int64_t>();
    n_heads_ = cfg["n_heads"].cast<int64_t>();
    n_kv_ = cfg["n_kv_heads"].cast<int64_t>();
    hd_ = cfg["head_dim"].cast<int64_t>();
    vocab_ = cfg["vocab_size"].cast<int64_t>();
    lm_rows_ = cfg.contains("lm_head_rows") ? cfg["lm_head_rows"].cast<int64_t>() : vocab_;
    eps_ = cfg["rms_norm_eps"].cast<float>();
    auto opt = [&](const char* k, auto dflt) { return cfg.contains(k) ? cfg[k].cast<decltype(dflt)>() : dflt; };
    embed_scale_ = opt("embed_scale", 1.0f);
    attn_scale_ = opt("attn_scale", 1.0f / std::sqrt(float(hd_)));
    rope_dim_ = opt("rope_dim", hd_);
    const std::string act = opt("hidden_act", std::string("silu"));
    if (act != "silu" && act != "gelu_tanh") throw std::invalid_argument("hidden_act must be silu or gelu_tanh");
    gelu_ = act == "gelu_tanh";
    if (rope_dim_ < 2 || rope_dim_ > hd_ || rope_dim_ % 2) throw std::invalid_argument("rope_dim must be even, in [2, head_dim]");
    if (lm_rows_ < 1 || lm_rows_ > vocab_) throw std::invalid_argument("lm_head_rows must be in [1, vocab_size]");
    if (embed.ndim() != 2 || embed.shape(0) != vocab_ || embed.shape(1) != d_)
      throw std::invalid_argument("embed must be uint16 (bf16 bits) [vocab, hidden]");
    if (int64_t(norm_.size()) != d_) throw std::invalid_argument("norm must be float32 [hidden]");
    for (auto& s : sets_) s.layers.resize(n_layers_);
    attn_norm_.resize(n_layers_);
    mlp_norm_.resize(n_layers_);
    bqkv_.resize(n_layers_);
    q_norm_.resize(n_layers_);
    k_norm_.resize(n_layers_);
    post_attn_norm_.resize(n_layers_);
    post_mlp_norm_.resize(n_layers_);
    layer_rope_.assign(n_layers_, 0);
    layer_window_.assign(n_layers_, 0);
  }

  void set_layer(int set, int64_t i, std::shared_ptr<PackedWeight> wqkv, std::shared_ptr<PackedWeight> wo,
                 std::shared_ptr<PackedWeight> wgu, std::shared_ptr<PackedWeight> wdown) {
    check_set(set);
    if (i < 0 || i >= n_layers_) throw std::invalid_argument("layer index out of range");
    const int64_t qkv = (n_heads_ + 2 * n_kv_) * hd_;
    check_shape(*wqkv, qkv, d_, "wqkv");
    check_shape(*wo, d_, n_heads_ * hd_, "wo");
    check_shape(*wgu, 2 * f_, d_, "w_gate_up");
    check_shape(*wdown, d_, f_, "w_down");
    sets_[set].layers[i] = {wqkv, wo, wgu, wdown};
  }

  void set_layer_norms(int64_t i, py::array_t<float, py::array::c_style> attn_norm,
                       py::array_t<float, py::array::c_style> mlp_norm, py::object bqkv, py::object q_norm,
                       py::object k_norm, py::object post_attn_norm, py::object post_mlp_norm) {
    auto vec = [](py::object o, int64_t n, const char* what) {
      std::vector<float> v;
      if (o.is_none()) return v;
      auto b = o.cast<py::array_t<float, py::array::c_style | py::array::forcecast>>();
      if (b.size() != n) throw std::invalid_argument(std::string(what) + " has the wrong size");
      v.assign(b.data(), b.data() + n);
      return v;
    };
    if (i < 0 || i >= n_layers_) throw std::invalid_argument("layer index out of range");
    if (attn_norm.size() != d_ || mlp_norm.size() != d_) throw std::invalid_argument("norms must be [hidden]");
    attn_norm_[i].assign(attn_norm.data(), attn_norm.data() + d_);
    mlp_norm_[i].assign(mlp_norm.data(), mlp_norm.data() + d_);
    bqkv_[i].clear();
    if (!bqkv.is_none()) {
      auto b = bqkv.cast<py::array_t<float, py::array::c_style | py::array::forcecast>>();
      if (b.size() != (n_heads_ + 2 * n_kv_) * hd_) throw std::invalid_argument("bqkv must be [(H+2KVH)*hd]");
      bqkv_[i].assign(b.data(), b.data() + b.size());
    }
    q_norm_[i] = vec(q_norm, hd_, "q_norm");
    k_norm_[i] = vec(k_norm, hd_, "k_norm");
    if (q_norm_[i].empty() != k_norm_[i].empty()) throw std::invalid_argument("q_norm and k_norm go together");
    post_attn_norm_[i] = vec(post_attn_norm, d_, "post_attn_norm");
    post_mlp_norm_[i] = vec(post_mlp_norm, d_, "post_mlp_norm");
  }

  // Layer i's RoPE table (-1: no RoPE, a NoPE layer) and sliding window (0: none).
  void set_layer_attention(int64_t i, int64_t rope_table, int64_t window) {
    if (i < 0 || i >= n_layers_) throw std::invalid_argument("layer index out of range");
    if (rope_table < -1 || rope_table >= kRopeTables) throw std::invalid_argument("rope table out of range");
    if (window < 0) throw std::invalid_argument("window must be >= 0");
    layer_rope_[i] = rope_table;
    layer_window_[i] = window;
  }

  // Draft passes over the draft copy: on layers without a sliding window they attend only the
  // first `sinks` keys and the `window` most recent ones (attention.h sink_keys; window 0: every
  // key), and on every layer they read each row's `recent` latest keys from the BF16 rows
  // (attention.h recent_keys; 0: none); over an INT4 copy they attend about `sparse` keys of each
  // row's written pages (attention.h sparse_keys; 0: all).
  void set_draft_attention(int64_t sinks, int64_t window, int64_t recent, int64_t sparse) {
    if (window < 0) throw std::invalid_argument("draft window must be >= 0");
    if (sinks < 0 || sinks > kAttnSegKeys)
      throw std::invalid_argument("draft sinks must be in [0, " + std::to_string(kAttnSegKeys) + "]");
    if (recent < 0) throw std::invalid_argument("draft recent keys must be >= 0");
    if (sparse < 0 || (sparse > 0 && sparse < kAttnSegKeys))
      throw std::invalid_argument("draft sparse keys must be 0 or >= " + std::to_string(kAttnSegKeys));
    draft_window_ = window;
    draft_sinks_ = window > 0 ? sinks : 0;
    draft_recent_ = recent;
    draft_sparse_ = sparse;
  }

  void set_lm_head(int set, std::shared_ptr<PackedWeight> w) {
    check_set(set);
    check_shape(*w, lm_rows_, d_, "lm_head");
    sets_[set].lm_head = w;
  }

  // RoPE table `table` (layers pick theirs, set_layer_attention); every table in use must cover
  // the same positions: rope_positions is that of the last one set.
  void set_rope(py::array_t<float, py::array::c_style> cos, py::array_t<float, py::array::c_style> sin,
                int64_t table) {
    if (table < 0 || table >= kRopeTables) throw std::invalid_argument("rope table out of range");
    if (cos.ndim() != 2 || cos.shape(1) != rope_dim_ / 2 || sin.ndim() != 2 || sin.shape(0) != cos.shape(0) ||
        sin.shape(1) != rope_dim_ / 2)
      throw std::invalid_argument("rope tables must be float32 [positions, rope_dim/2]");
    cos_[table].assign(cos.data(), cos.data() + cos.size());
    sin_[table].assign(sin.data(), sin.data() + sin.size());
    rope_positions_ = cos.shape(0);
  }

  // Tensor parallelism (qspec/parallel): this model holds one rank's shard (its heads, its FFN
  // slice, its LM-head rows) and `reducer` is called, with the GIL, on the [m, hidden] partial sums
  // of the row-parallel O and down projections; it replaces them in place by the sum over ranks.
  // None: one process, nothing is called.
  void set_reducer(py::object reducer) {
    shm_ = py::isinstance<ShmGroup>(reducer) ? reducer.cast<std::shared_ptr<ShmGroup>>() : nullptr;
    reducer_ = shm_ ? py::none() : std::move(reducer);
  }

  bool parallel() const { return shm_ || !reducer_.is_none(); }

  void reduce(float* x, int64_t m) {
    if (shm_) return shm_->reduce(x, m * d_);  // ranks on one host: no GIL, no Python
    py::gil_scoped_acquire gil;
    auto base = py::capsule(x, [](void*) {});  // a view: the buffer outlives the call
    py::array_t<float> view({m, d_}, {d_ * int64_t(sizeof(float)), int64_t(sizeof(float))}, x, base);
    reducer_(view);
  }

  bool has_set(int set) const {
    check_set(set);
    return sets_[set].complete(n_layers_);
  }

  // Where forward()'s time goes since the last reset (seconds, summed over calls): the host
  // overhead outside the kernels and the kernels' own overheads, measured rather than guessed.
  // One clock read at each boundary between pieces cuts a forward into consecutive pieces, so
  // they add up to its total: each GEMM (wall time; of it, the activation preparation and the
  // idle share of its parallel region), attention (of it, the idle share), and the row-wise rest
  // between them (embedding, norms, RoPE + K/V row writes, SiLU*up, residual adds).
  enum GemmKind { kQkv, kO, kGateUp, kDown, kLmHead, kGemmKinds };
  static constexpr const char* kGemmKindNames[kGemmKinds] = {"qkv", "o", "gate_up", "down", "lm_head"};
  struct GemmProfile {
    double wall = 0, prep = 0, idle = 0, idle_thread = 0;  // idle: its share of the wall; idle_thread: thread-s
  };
  struct Profile {
    GemmProfile gemm[kGemmKinds];
    double attention = 0, attention_idle = 0, attention_idle_thread = 0, rowwise = 0, reduce = 0, total = 0;
    int64_t calls = 0;
  };
  const Profile& profile() const { return prof_; }
  void profile_reset() { prof_ = Profile(); }

  // One forward over a ragged batch: the rows of seqs[0], then seqs[1], .. (tokens holds them in
  // that order) run through every layer together, so each GEMM streams its weights once for all
  // of them; each sequence's rows write and attend over its own cache rows (its view's pages).
  // logits: per sequence, [m or 1, lm_head_rows] rows in sequence order.
  void forward(const int32_t* tokens, const std::vector<SeqPass>& seqs, int set, float* logits) {
    const auto t_start = ProfClock::now();
    auto t = t_start;  // the last boundary between profile pieces
    auto lap = [&](double& piece) {
      const auto now = ProfClock::now();
      piece += seconds_between(t, now);
      t = now;
    };
    auto timed = [&](GemmKind kind, auto&& call) {
      lap(prof_.rowwise);  // everything since the last kernel
      GemmTiming& timing = gemm_timing();
      timing = GemmTiming();
      call();
      GemmProfile& g = prof_.gemm[kind];
      lap(g.wall);
      g.prep += timing.prep_s;
      g.idle += timing.region.idle_s;
      g.idle_thread += timing.region.idle_thread_s;
    };
    auto timed_gemm = [&](GemmKind kind, const PackedWeight& w, const float* x, int64_t ldx, float* y,
                          int64_t ldy, int64_t rows) { timed(kind, [&] { gemm(w, x, rows, ldx, y, ldy); }); };
    const WeightSet& ws = sets_[set];
    // row r of the batch is row r - row0[s] of sequence s = row_seq[r]
    int64_t m = 0;
    row_seq_.clear();
    std::vector<int64_t> row0(seqs.size());
    for (size_t s = 0; s < seqs.size(); ++s) {
      row0[s] = m;
      m += seqs[s].m;
      row_seq_.insert(row_seq_.end(), seqs[s].m, int32_t(s));
    }
    const int64_t qkv_n = (n_heads_ + 2 * n_kv_) * hd_, q_n = n_heads_ * hd_, kv_n = n_kv_ * hd_;
    h_.resize(m * d_);
    x_.resize(m * d_);
    qkv_.resize(m * qkv_n);
    q_.resize(m * q_n);
    att_.resize(m * q_n);
    // A prefill's MLP on AMX tiles goes gate|up -> bf16 act without the FP32 gate|up rows
    // (gemm_swiglu, gemm.h): the same bits, without writing and reading them (147 MB a layer for
    // 2,048 rows of the 1.5B) or a SwiGLU and a bf16 rounding pass of their own.
    const bool fused_mlp = !gelu_ && !ws.layers.empty() &&
                           gemm_swiglu_supported(*ws.layers[0].wgu, *ws.layers[0].wdown, m);
    if (fused_mlp) {
      if (act_bf_.size() < size_t((m + 15) / 16 * 16 * f_)) act_bf_.resize(size_t((m + 15) / 16 * 16 * f_));
    } else {
      gu_.resize(m * 2 * f_);
      act_.resize(m * f_);
    }
    tmp_.resize(m * std::max(d_, int64_t(1)));
    const uint16_t* emb = embed_.data();
    for (int64_t r = 0; r < m; ++r) {
      const uint16_t* e = emb + int64_t(tokens[r]) * d_;
      if (embed_scale_ == 1.0f)
        for (int64_t i = 0; i < d_; ++i) h_[r * d_ + i] = bf16_to_f32(e[i]);
      else
        for (int64_t i = 0; i < d_; ++i) h_[r * d_ + i] = bf16_to_f32(e[i]) * embed_scale_;
    }
    for (const SeqPass& sp : seqs)  // the INT4 K copy: groups below a target pass are committed
      if (sp.kv.q8k && sp.kv.k_bits == 4) {
        kv_k4_unfinal(sp.kv, sp.start_pos, sp.start_pos + sp.m);
        if (set == 0) kv_k4_finalize(sp.kv, 0, sp.start_pos / sp.kv.k_group * sp.kv.k_group);
      }
    const int64_t half = rope_dim_ / 2;
    auto add_residual = [&](int64_t r) {  // h += tmp, row r
      for (int64_t i = r * d_; i < (r + 1) * d_; ++i) h_[i] += tmp_[i];
    };
    for (int64_t l = 0; l < n_layers_; ++l) {
      const LayerSet& L = ws.layers[l];
      for_rows(m, [&](int64_t r) { rms_norm(&h_[r * d_], attn_norm_[l].data(), eps_, d_, &x_[r * d_]); });
      timed_gemm(kQkv, *L.wqkv, x_.data(), d_, qkv_.data(), qkv_n, m);
      for_rows(m, [&](int64_t r) {
        float* row = &qkv_[r * qkv_n];
        if (!bqkv_[l].empty())
          for (int64_t i = 0; i < qkv_n; ++i) row[i] += bqkv_[l][i];
        if (!q_norm_[l].empty()) {  // per-head RMSNorm of q and k, in place
          for (int64_t h = 0; h < n_heads_; ++h) rms_norm(row + h * hd_, q_norm_[l].data(), eps_, hd_, row + h * hd_);
          for (int64_t h = n_heads_; h < n_heads_ + n_kv_; ++h)
            rms_norm(row + h * hd_, k_norm_[l].data(), eps_, hd_, row + h * hd_);
        }
        const SeqPass& sp = seqs[row_seq_[r]];
        const int64_t i = r - row0[row_seq_[r]];
        const int64_t pos = sp.start_pos + i;  // the row's cache slot
        const AttnTree* tree = sp.tree;
        const int64_t rpos = tree ? tree->prefix + (tree->off[i + 1] - tree->off[i] - 1) : pos;
        const KvCacheView& kv = sp.kv;
        if (layer_rope_[l] >= 0) {
          const float* c = &cos_[layer_rope_[l]][rpos * half];
          const float* s = &sin_[layer_rope_[l]][rpos * half];
          rope(row, n_heads_ + n_kv_, hd_, rope_dim_, c, s);  // q heads then k heads are contiguous
        }
        std::memcpy(&q_[r * q_n], row, q_n * sizeof(float));
        uint16_t* kd = kv.k(l, pos);
        uint16_t* vd = kv.v(l, pos);
        round_bf16_row(row + q_n, kd, kv_n);
        round_bf16_row(row + q_n + kv_n, vd, kv_n);
        if (kv.q8k) {  // the draft copy of the rows just written (INT4 K: per group, kv_k4_finalize)
          for (int kv_index = kv.k_bits == 4 ? 1 : 0; kv_index < 2; ++kv_index) {
            const uint16_t* src = kv_index ? vd : kd;
            if (kv_index == 1 && kv.v_bits == 4)
              kv_q4_quantize(src, kv_n, hd_, reinterpret_cast<uint8_t*>(kv.q8_row(l, kv_index, pos)),
                              kv.q8_scales(l, kv_index, pos));
            else
              kv_q8_quantize(src, kv_n, kv.q8_row(l, kv_index, pos), kv.q8_scales(l, kv_index, pos));
          }
        }
      });
      lap(prof_.rowwise);
      for (size_t s = 0; s < seqs.size(); ++s) {  // each sequence over its own rows
        AttnArgs a;
        a.q = q_.data() + row0[s] * q_n;
        a.out = att_.data() + row0[s] * q_n;
        a.m = seqs[s].m;
        a.start_pos = seqs[s].start_pos;
        a.n_heads = n_heads_;
        a.layer = l;
        a.scale = attn_scale_;
        a.window = layer_window_[l];
        a.kv = seqs[s].kv;
        a.tree = seqs[s].tree;
        a.draft_q8 = seqs[s].draft_q8;
        if (a.draft_q8 && a.window == 0 && draft_window_ > 0) a.window = draft_window_, a.sink_keys = draft_sinks_;
        if (a.draft_q8) a.recent_keys = draft_recent_, a.sparse_keys = draft_sparse_;
        RegionTiming& attn_idle = attn_timing();
        attn_idle = RegionTiming();
        attention(a);
        prof_.attention_idle += attn_idle.idle_s;
        prof_.attention_idle_thread += attn_idle.idle_thread_s;
      }
      lap(prof_.attention);
      timed_gemm(kO, *L.wo, att_.data(), q_n, tmp_.data(), d_, m);
      if (parallel()) {
        reduce(tmp_.data(), m);
        lap(prof_.reduce);
      }
      post_norm(post_attn_norm_[l], m);
      for_rows(m, [&](int64_t r) {
        add_residual(r);
        rms_norm(&h_[r * d_], mlp_norm_[l].data(), eps_, d_, &x_[r * d_]);
      });
      if (fused_mlp) {
        timed(kGateUp, [&] { gemm_swiglu(*L.wgu, x_.data(), m, d_, act_bf_.data()); });
        timed(kDown, [&] { gemm_act_tiles(*L.wdown, act_bf_.data(), m, tmp_.data(), d_); });
      } else {
        timed_gemm(kGateUp, *L.wgu, x_.data(), d_, gu_.data(), 2 * f_, m);
        for_rows(m, [&](int64_t r) {
          (gelu_ ? gelu_tanh_mul : silu_mul)(&gu_[r * 2 * f_], &gu_[r * 2 * f_ + f_], &act_[r * f_], f_);
        });
        timed_gemm(kDown, *L.wdown, act_.data(), f_, tmp_.data(), d_, m);
      }
      if (parallel()) {
        reduce(tmp_.data(), m);
        lap(prof_.reduce);
      }
      post_norm(post_mlp_norm_[l], m);
      for_rows(m, add_residual);
    }
    int64_t rows = 0;  // the rows that get logits, packed into x_
    for (size_t s = 0; s < seqs.size(); ++s)
      for (int64_t r = seqs[s].all_logits ? row0[s] : row0[s] + seqs[s].m - 1; r < row0[s] + seqs[s].m; ++r)
        rms_norm(&h_[r * d_], norm_.data(), eps_, d_, &x_[rows++ * d_]);
    timed_gemm(kLmHead, *ws.lm_head, x_.data(), d_, logits, lm_rows_, rows);
    prof_.total += seconds_between(t_start, t);
    prof_.calls += 1;
  }

  int64_t vocab() const { return vocab_; }
  int64_t lm_head_rows() const { return lm_rows_; }
  int64_t n_layers() const { return n_layers_; }
  int64_t n_kv() const { return n_kv_; }
  int64_t head_dim() const { return hd_; }
  int64_t rope_positions() const { return rope_positions_; }
  static constexpr int kRopeTables = 2;  // Gemma 3: global and local layers' tables
  static void check_set(int set) {
    if (set < 0 || set >= kWeightSets)
      throw std::invalid_argument("weight set must be 0 (target) or 1.." + std::to_string(kWeightSets - 1) +
                                  " (drafts)");
  }

 private:
  // RMSNorm of the [m, hidden] block output in tmp_ (in place) before its residual add; no-op
  // for an empty weight (architectures without the norm).
  void post_norm(const std::vector<float>& w, int64_t m) {
    if (w.empty()) return;
    for_rows(m, [&](int64_t r) { rms_norm(&tmp_[r * d_], w.data(), eps_, d_, &tmp_[r * d_]); });
  }

  static void check_shape(const PackedWeight& w, int64_t n, int64_t k, const char* what) {
    if (w.n != n || w.k != k)
      throw std::invalid_argument(std::string(what) + ": packed weight has shape [" + std::to_string(w.n) +
                                  ", " + std::to_string(w.k) + "], expected [" + std::to_string(n) + ", " +
                                  std::to_string(k) + "]");
  }

  py::array_t<uint16_t, py::array::c_style> embed_;  // keeps the BF16 embedding alive
  std::vector<float> norm_;
  int64_t d_ = 0, f_ = 0, n_layers_ = 0, n_heads_ = 0, n_kv_ = 0, hd_ = 0, vocab_ = 0, lm_rows_ = 0;
  py::object reducer_ = py::none();
  std::shared_ptr<ShmGroup> shm_;
  float eps_ = 1e-5f, embed_scale_ = 1.0f, attn_scale_ = 1.0f;
  int64_t rope_dim_ = 0;
  bool gelu_ = false;
  WeightSet sets_[kWeightSets];
  std::vector<std::vector<float>> attn_norm_, mlp_norm_, bqkv_, q_norm_, k_norm_, post_attn_norm_, post_mlp_norm_;
  std::vector<int64_t> layer_rope_, layer_window_;
  int64_t draft_window_ = 0, draft_sinks_ = 0, draft_recent_ = 0, draft_sparse_ = 0;
  std::vector<float> cos_[kRopeTables], sin_[kRopeTables];
  int64_t rope_positions_ = 0;
  LineVector<float> h_, x_, qkv_, q_, att_, gu_, act_, tmp_;  // scratch, reused across calls
  LineVector<uint16_t> act_bf_;  // the fused prefill MLP's bf16 act rows (gemm_swiglu)
  std::vector<int32_t> row_seq_;
  Profile prof_;
};

}  // namespace

void silu_mul_ref(const float* gate, const float* up, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

// GELU with the tanh approximation (PyTorch's approximate="tanh", HF gelu_pytorch_tanh) times up;
// scalar on every ISA level, so its bits never depend on the level or the batch.
void gelu_tanh_mul(const float* gate, const float* up, float* out, int64_t n) {
  const float beta = 0.7978845608028654f, kappa = 0.044715f;  // sqrt(2/pi)
  for (int64_t i = 0; i < n; ++i) {
    const float x = gate[i];
    out[i] = 0.5f * x * (1.0f + std::tanh(beta * (x + kappa * x * x * x))) * up[i];
  }
}

void silu_mul(const float* gate, const float* up, float* out, int64_t n) {
  const Isa isa = isa_selected();
  if (int(isa) >= int(Isa::avx512))
    silu_mul_avx512(gate, up, out, n);
  else if (isa == Isa::avx2)
    silu_mul_avx2(gate, up, out, n);
  else
    silu_mul_ref(gate, up, out, n);
}

void rms_norm_ref(const float* x, const float* w, float eps, int64_t d, float* out) {
  float ss = 0.f;
  for (int64_t i = 0; i < d; ++i) ss += x[i] * x[i];
  const float r = 1.0f / std::sqrt(ss / float(d) + eps);
  for (int64_t i = 0; i < d; ++i) out[i] = x[i] * r * w[i];
}

void rms_norm(const float* x, const float* w, float eps, int64_t d, float* out) {
  (int(isa_selected()) >= int(Isa::avx2) ? rms_norm_avx2 : rms_norm_ref)(x, w, eps, d, out);
}

void round_bf16_row_ref(const float* x, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = f32_to_bf16(x[i]);
}

void round_bf16_row(const float* x, uint16_t* out, int64_t n) {
  (int(isa_selected()) >= int(Isa::avx2) ? round_bf16_row_avx2 : round_bf16_row_ref)(x, out, n);
}

void bind_model(py::module_& m) {
  py::class_<Model>(m, "Model", "Native Llama-family forward over the shared KV cache")
      .def(py::init<const py::dict&, py::array_t<uint16_t, py::array::c_style>,
                    py::array_t<float, py::array::c_style>>(),
           py::arg("config"), py::arg("embed"), py::arg("norm"))
      .def("set_layer", &Model::set_layer, py::arg("set"), py::arg("layer"), py::arg("wqkv"), py::arg("wo"),
           py::arg("w_gate_up"), py::arg("w_down"))
      .def("set_layer_norms", &Model::set_layer_norms, py::arg("layer"), py::arg("attn_norm"),
           py::arg("mlp_norm"), py::arg("bqkv") = py::none(), py::arg("q_norm") = py::none(),
           py::arg("k_norm") = py::none(), py::arg("post_attn_norm") = py::none(),
           py::arg("post_mlp_norm") = py::none())
      .def("set_layer_attention", &Model::set_layer_attention, py::arg("layer"), py::arg("rope_table"),
           py::arg("window"), "rope_table: -1 (no RoPE) or a table of set_rope; window: sliding window, 0 none")
      .def("set_draft_attention", &Model::set_draft_attention, py::arg("sinks"), py::arg("window"), py::arg("recent"),
           py::arg("sparse"),
           "draft passes over the draft copy attend the first `sinks` and the last `window` keys (0: all), "
           "read each row's `recent` latest keys from the BF16 rows (0: none) and, over an INT4 copy, "
           "about `sparse` keys of each row's written pages (0: all)")
      .def("set_lm_head", &Model::set_lm_head, py::arg("set"), py::arg("w"))
      .def("set_rope", &Model::set_rope, py::arg("cos"), py::arg("sin"), py::arg("table") = 0)
      .def("has_set", &Model::has_set, py::arg("set"))
      .def("set_reducer", &Model::set_reducer, py::arg("reducer"),
           "reducer(x): called with the GIL on the [m, hidden] float32 partial sums of the O and down "
           "projections, replaces them in place by the sum over tensor-parallel ranks; a ShmGroup: its "
           "reduce() is called directly; None: off")
      .def_property_readonly("rope_positions", &Model::rope_positions)
      .def("profile", [](const Model& self) {
        const auto& p = self.profile();
        py::dict d;
        double gemm = 0, prep = 0, idle = 0, idle_thread = 0;
        for (int k = 0; k < Model::kGemmKinds; ++k) {
          const auto& g = p.gemm[k];
          const std::string name = std::string("gemm_") + Model::kGemmKindNames[k];
          d[py::str(name + "_s")] = g.wall;
          d[py::str(name + "_prep_s")] = g.prep;
          d[py::str(name + "_idle_s")] = g.idle;
          gemm += g.wall;
          prep += g.prep;
          idle += g.idle;
          idle_thread += g.idle_thread;
        }
        d["gemm_s"] = gemm;
        d["gemm_prep_s"] = prep;
        d["gemm_idle_s"] = idle;
        d["gemm_idle_thread_s"] = idle_thread;
        d["attention_s"] = p.attention;
        d["attention_idle_s"] = p.attention_idle;
        d["attention_idle_thread_s"] = p.attention_idle_thread;
        d["rowwise_s"] = p.rowwise;
        d["reduce_s"] = p.reduce;
        d["other_s"] = p.total - gemm - p.attention - p.reduce;  // = rowwise_s up to rounding (older name)
        d["total_s"] = p.total;
        d["calls"] = p.calls;
        return d;
      }, "seconds of forward() by piece since profile_reset(): gemm_{qkv,o,gate_up,down,lm_head}_s (wall; "
         "of each, _prep_s activation preparation and _idle_s the idle share of its parallel region), "
         "gemm_s / gemm_prep_s / gemm_idle_s their sums, gemm_idle_thread_s idle thread-seconds, "
         "attention_s (attention_idle_s, attention_idle_thread_s), rowwise_s, reduce_s (tensor-parallel "
         "reductions), other_s (= total - gemm - attention - reduce), total_s, calls")
      .def("profile_reset", &Model::profile_reset)
      .def(
          "forward",
          [](Model& self, py::array_t<int32_t, py::array::c_style | py::array::forcecast> tokens, py::list seqs,
             py::array_t<uint16_t, py::array::c_style> kv, int set, py::array_t<float, py::array::c_style> out,
             std::optional<py::tuple> kv_q8,
             int64_t page_size) {
            Model::check_set(set);
            if (!self.has_set(set)) throw std::invalid_argument("weight set is not fully loaded");
            if (kv.ndim() != 5 || kv.shape(0) != self.n_layers() || kv.shape(1) != 2 ||
                kv.shape(3) != self.n_kv() || kv.shape(4) != self.head_dim())
              throw std::invalid_argument("kv must be uint16 [layers, 2, pool rows, kv_heads, head_dim]");
            KvCacheView pool;
            pool.data = kv.mutable_data();
            pool.layers = kv.shape(0);
            pool.max_seq = kv.shape(2);
            pool.kv_heads = kv.shape(3);
            pool.head_dim = kv.shape(4);
            if (kv_q8) {  // the draft copy
              kv_set_copy(pool, *kv_q8, "kv_q8");
              if (pool.k_bits == 4 && page_size != pool.k_group)
                throw std::invalid_argument("kv_q8's INT4 K groups must be the pages");
            }
            if (seqs.empty()) throw std::invalid_argument("forward needs at least one sequence");
            // per sequence: (m, start_pos, pages or None, all_logits, tree or None, draft_q8)
            std::vector<SeqPass> passes(seqs.size());
            std::vector<py::array_t<int32_t, py::array::c_style | py::array::forcecast>> tables(seqs.size());
            std::vector<std::optional<AttnTreePaths>> paths(seqs.size());
            int64_t m = 0, rows = 0;
            for (size_t s = 0; s < seqs.size(); ++s) {
              auto t = seqs[s].cast<py::tuple>();
              if (t.size() != 6) throw std::invalid_argument("a sequence is (m, start_pos, pages, all_logits, tree, draft_q8)");
              SeqPass& p = passes[s];
              p.m = t[0].cast<int64_t>();
              p.start_pos = t[1].cast<int64_t>();
              p.all_logits = t[3].cast<bool>();
              p.draft_q8 = t[5].cast<bool>();
              if (p.m < 1) throw std::invalid_argument("forward needs at least one token per sequence");
              if (p.start_pos < 0) throw std::invalid_argument("start_pos must be >= 0");
              if (p.start_pos + p.m > self.rope_positions()) throw std::invalid_argument("positions exceed the RoPE table");
              p.kv = pool;
              if (!t[2].is_none()) {
                tables[s] = py::array_t<int32_t, py::array::c_style | py::array::forcecast>::ensure(t[2]);
                if (!tables[s] || tables[s].ndim() != 1) throw std::invalid_argument("pages must be a 1-D int array");
                kv_set_pages(p.kv, tables[s].data(), tables[s].size(), page_size, p.start_pos + p.m);
              } else if (p.start_pos + p.m > pool.max_seq) {
                throw std::invalid_argument("positions exceed the KV cache capacity");
              }
              if (p.draft_q8 && !pool.q8k) throw std::invalid_argument("draft_q8 needs kv_q8");
              if (!t[4].is_none()) {
                auto tr = t[4].cast<std::pair<int64_t, py::object>>();
                auto par = py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(tr.second);
                if (!par || par.ndim() != 1) throw std::invalid_argument("tree parents must be a 1-D int array");
                paths[s].emplace(tr.first, par.data(), par.shape(0), p.start_pos, p.m);
                p.tree = &paths[s]->view;
              }
              m += p.m;
              rows += p.all_logits ? p.m : 1;
            }
            if (tokens.size() != m) throw std::invalid_argument("tokens must hold every sequence's rows");
            if (out.ndim() != 2 || out.shape(0) < rows || out.shape(1) != self.lm_head_rows())
              throw std::invalid_argument("out must be float32 [rows, lm_head_rows]");
            const int32_t* t = tokens.data();
            for (int64_t i = 0; i < m; ++i)
              if (t[i] < 0 || t[i] >= self.vocab()) throw std::invalid_argument("token id outside the vocabulary");
            float* o = out.mutable_data();
            py::gil_scoped_release release;
            self.forward(t, passes, set, o);
          },
          py::arg("tokens"), py::arg("seqs"), py::arg("kv"), py::arg("set"), py::arg("out"),
          py::arg("kv_q8") = py::none(), py::arg("page_size") = 0,
          "One forward of weight set `set` over a ragged batch. tokens: every sequence's rows, in order; "
          "seqs: per sequence (m, start_pos, pages, all_logits, tree, draft_q8) with pages an int32 page "
          "table of the pool kv (page_size rows a page; None: positions are pool rows), tree = (prefix, "
          "parents): its rows are draft-tree nodes at slots start_pos.. (attention.h), draft_q8: its "
          "attention reads the draft copy kv_q8 (qspec/kv_cache.py), which forward keeps written. "
          "out: the logits, per sequence m rows (all_logits) or its last, in order");
  // Row-wise kernels by path, for tests: "ref" (scalar), "avx2", "avx512" (silu_mul only).
  auto need = [](const std::string& path, bool avx512) {
    if (path != "ref" && path != "avx2" && !(avx512 && path == "avx512"))
      throw std::invalid_argument(avx512 ? "path must be ref, avx2 or avx512" : "path must be ref or avx2");
    const Isa isa = path == "avx512" ? Isa::avx512 : path == "avx2" ? Isa::avx2 : Isa::scalar;
    if (int(isa_detected()) < int(isa)) throw std::invalid_argument("no " + path + " here");
  };
  m.def("silu_mul", [need](py::array_t<float, py::array::c_style> gate, py::array_t<float, py::array::c_style> up,
                           const std::string& path) {
    if (gate.ndim() != 1 || up.ndim() != 1 || gate.size() != up.size())
      throw std::invalid_argument("gate and up must be float32 vectors of one length");
    need(path, true);
    py::array_t<float> out(gate.size());
    (path == "ref" ? silu_mul_ref : path == "avx2" ? silu_mul_avx2 : silu_mul_avx512)(
        gate.data(), up.data(), out.mutable_data(), gate.size());
    return out;
  }, py::arg("gate"), py::arg("up"), py::arg("path"), "SwiGLU activation kernel (for tests)");
  m.def("rms_norm", [need](py::array_t<float, py::array::c_style> x, py::array_t<float, py::array::c_style> w,
                           float eps, const std::string& path) {
    if (x.ndim() != 1 || w.ndim() != 1 || x.size() != w.size() || x.size() == 0)
      throw std::invalid_argument("x and w must be non-empty float32 vectors of one length");
    need(path, false);
    py::array_t<float> out(x.size());
    (path == "ref" ? rms_norm_ref : rms_norm_avx2)(x.data(), w.data(), eps, x.size(), out.mutable_data());
    return out;
  }, py::arg("x"), py::arg("w"), py::arg("eps"), py::arg("path"), "RMSNorm of one row (for tests)");
  m.def("round_bf16_row", [need](py::array_t<float, py::array::c_style> x, const std::string& path) {
    if (x.ndim() != 1) throw std::invalid_argument("x must be a float32 vector");
    need(path, false);
    py::array_t<uint16_t> out(x.size());
    (path == "ref" ? round_bf16_row_ref : round_bf16_row_avx2)(x.data(), out.mutable_data(), x.size());
    return out;
  }, py::arg("x"), py::arg("path"), "f32 -> bf16 of one row, nearest even (for tests)");
}

}  // namespace qspec
