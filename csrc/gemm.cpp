// GEMM y[M,N] = x[M,K] · W[N,K]^T: packing (once, at load), the scalar reference path,
// the dispatcher and the threaded driver (csrc/pool.h; threads split row blocks of N only);
// the bindings are in gemm_bindings.cpp.
// Layouts and the arithmetic every path performs are described in gemm.h.
#include "gemm.h"

#include <omp.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <stdexcept>

#include "aligned.h"
#include "bindings.h"
#include "gemm_internal.h"
#include "pool.h"
#include "profile.h"

namespace qspec {

using detail::GemmArgs;
using detail::kKBlk;
using detail::kQ6BlockBytes;
using detail::kQ6PairBytes;
using detail::kRows;
using detail::rup;

// ---------------------------------------------------------------------------------------------
// PackedWeight

const uint8_t* PackedWeight::buf(const std::string& name) const {
  auto it = buffers.find(name);
  if (it == buffers.end()) throw std::invalid_argument("packed weight has no buffer '" + name + "'");
  return it->second.first;
}

size_t PackedWeight::nbytes() const {
  size_t s = 0;
  for (const auto& kv : buffers) s += kv.second.second;
  return s;
}

std::vector<std::pair<std::string, size_t>> packed_buffer_sizes(WFormat fmt, int64_t n, int64_t k) {
  if (n < 1 || k < 1) throw std::invalid_argument("weight shape must be at least [1, 1]");
  const size_t np = size_t((n + kRows - 1) / kRows * kRows);
  const size_t kp = size_t((k + kKBlk - 1) / kKBlk * kKBlk);
  switch (fmt) {
    case WFormat::bf16: return {{"data", np * kp * 2}};
    case WFormat::mxfp4: return {{"data", np * kp / 2}, {"scales", np * kp / kKBlk}};
    case WFormat::mxfp6_e2m3: return {{"data", np * kp * 3 / 4}, {"scales", np * kp / kKBlk}};
    default: return {{"data", np * kp}, {"scales", np * kp / kKBlk}};
  }
}

namespace {

std::shared_ptr<PackedWeight> new_packed(WFormat fmt, int64_t n, int64_t k) {
  auto pw = std::make_shared<PackedWeight>();
  pw->fmt = fmt;
  pw->n = n;
  pw->k = k;
  for (const auto& [name, size] : packed_buffer_sizes(fmt, n, k)) {
    pw->storage.emplace_back(size, uint8_t(0));
    pw->buffers[name] = {pw->storage.back().data(), size};
  }
  return pw;
}

int decode_kind(WFormat f) {
  switch (f) {
    case WFormat::bf16: return detail::kBf16;
    case WFormat::mxfp4: return detail::kQ4;
    case WFormat::mxfp8_e5m2:
    case WFormat::mxfp6_e3m2: return detail::kF16Shl;
    case WFormat::mxfp6_e2m3: return detail::kQ6;
    case WFormat::mxfp8_e4m3: return detail::kF16Sra;
    case WFormat::mxint8: return detail::kI8;
  }
  throw std::invalid_argument("unknown weight format");
}

// Element value = decoded * elem_factor: the fp16 re-encodings carry 2^(bias-15).
float elem_factor(WFormat f) {
  switch (decode_kind(f)) {
    case detail::kF16Shl:
    case detail::kF16Sra: return std::ldexp(1.0f, 15 - mx_format(f).bias);
    case detail::kI8: return 1.0f / 64.0f;
    case detail::kQ6: return 0.25f;  // xd = Q8 scale / 2, E2M3 codes held as value * 8
    default: return 1.0f;
  }
}

}  // namespace

std::shared_ptr<PackedWeight> pack_bf16(const uint16_t* w, int64_t n, int64_t k) {
  auto pw = new_packed(WFormat::bf16, n, k);
  const int64_t kp = pw->k_padded(), nblk = pw->n_padded() / kRows;
  uint16_t* d = reinterpret_cast<uint16_t*>(pw->storage[0].data());
#pragma omp parallel for schedule(static)
  for (int64_t nb = 0; nb < nblk; ++nb)
    for (int64_t r = 0; r < kRows; ++r) {
      const int64_t row = nb * kRows + r;
      if (row >= n) break;
      for (int64_t c = 0; c < k; ++c)
        d[(nb * (kp / 2) + c / 2) * 32 + r * 2 + (c & 1)] = w[row * k + c];
    }
  return pw;
}

std::shared_ptr<PackedWeight> pack_mx(WFormat fmt, const uint8_t* codes, const uint8_t* scales,
                                      int64_t n, int64_t k) {
  if (fmt == WFormat::bf16) throw std::invalid_argument("pack_mx: bf16 is not an MX format");
  const MxFormat& f = mx_format(fmt);
  auto pw = new_packed(fmt, n, k);
  const int64_t kp = pw->k_padded(), nblk = pw->n_padded() / kRows, kb = kp / kKBlk;
  const unsigned limit = 1u << f.bits;
  for (int64_t row = 0; row < n; ++row)
    for (int64_t c = 0; c < k; ++c)
      if (codes[row * kp + c] >= limit)
        throw std::invalid_argument(std::string("pack_mx: code out of range for ") + f.name +
                                    " at [" + std::to_string(row) + ", " + std::to_string(c) + "]");
  uint8_t* d = pw->storage[0].data();
  uint8_t* s = pw->storage[1].data();
  const bool fp6 = f.bits == 6;
  const bool e4m3 = fmt == WFormat::mxfp8_e4m3;
#pragma omp parallel for schedule(static)
  for (int64_t nb = 0; nb < nblk; ++nb)
    for (int64_t r = 0; r < kRows; ++r) {
      const int64_t row = nb * kRows + r;
      if (row >= n) break;
      const uint8_t* cr = codes + row * kp;
      for (int64_t b = 0; b < kb; ++b) {
        uint8_t sc = scales[row * kb + b];
        for (int64_t c = b * kKBlk; c < std::min(k, (b + 1) * kKBlk); ++c) {
          uint8_t code = cr[c];
          if (fmt == WFormat::mxfp4) {
            uint8_t& byte = d[(nb * (kp / 4) + c / 4) * 32 + (r % 8) * 4 + (c % 4)];
            byte |= r < 8 ? code : uint8_t(code << 4);
          } else if (fmt == WFormat::mxfp6_e2m3) {
            const int64_t slab = (c % kKBlk) / 4, j = (r % 8) * 4 + (c % 4);
            uint8_t* pair = d + (nb * kb + b) * detail::kQ6BlockBytes + (slab / 2) * detail::kQ6PairBytes;
            pair[(slab % 2) * 32 + j] |= r < 8 ? uint8_t(code & 15) : uint8_t((code & 15) << 4);
            const int t = int(slab % 2) * 2 + (r >= 8);
            pair[64 + j] |= uint8_t((((code >> 4) & 1) << (7 - t)) | ((code >> 5) << (3 - t)));
          } else {
            if (e4m3 && (code & 0x7F) == 0x7F) sc = kE8M0Nan;  // NaN element -> NaN block
            if (fp6) code = uint8_t(((code & 0x20) << 2) | (code & 0x1F));
            d[(nb * kp + c) * kRows + r] = code;
          }
        }
        s[(nb * kb + b) * kRows + r] = sc;
      }
    }
  return pw;
}

std::shared_ptr<PackedWeight> packed_from_buffers(
    WFormat fmt, int64_t n, int64_t k,
    const std::map<std::string, std::pair<const uint8_t*, size_t>>& bufs,
    std::shared_ptr<void> keepalive) {
  auto want = packed_buffer_sizes(fmt, n, k);
  if (bufs.size() != want.size())
    throw std::invalid_argument("packed " + std::string(mx_format(fmt).name) + " weight needs " +
                                std::to_string(want.size()) + " buffers, got " +
                                std::to_string(bufs.size()));
  auto pw = std::make_shared<PackedWeight>();
  pw->fmt = fmt;
  pw->n = n;
  pw->k = k;
  for (const auto& [name, size] : want) {
    auto it = bufs.find(name);
    if (it == bufs.end()) throw std::invalid_argument("packed weight is missing buffer '" + name + "'");
    if (it->second.second != size)
      throw std::invalid_argument("packed buffer '" + name + "' has " +
                                  std::to_string(it->second.second) + " bytes, expected " +
                                  std::to_string(size) + " for " + mx_format(fmt).name + " [" +
                                  std::to_string(n) + ", " + std::to_string(k) +
                                  "] (layout version " + std::to_string(kPackLayoutVersion) + ")");
    pw->buffers[name] = it->second;
  }
  pw->keepalive = std::move(keepalive);
  return pw;
}

// ---------------------------------------------------------------------------------------------
// Scalar reference: readable, every shape and format, the oracle of the fast paths.

namespace detail {
namespace {

float bf16_to_float(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

float half_to_float(uint16_t h) {  // exact, as vcvtph2ps
  const int e = (h >> 10) & 31, m = h & 1023;
  float v;
  if (e == 0) v = std::ldexp(float(m), -24);
  else if (e == 31) v = m ? NAN : INFINITY;
  else v = std::ldexp(float(m | 1024), e - 25);
  return (h & 0x8000) ? -v : v;
}

// The packed element (row, c), decoded but not scaled (value = decoded * elem_factor * scale).
float ref_element(const GemmArgs& a, int64_t row, int64_t c) {
  const int64_t nb = row / kRows, r = row % kRows;
  if (a.kind == kBf16) {
    const uint16_t* d = reinterpret_cast<const uint16_t*>(a.data);
    return bf16_to_float(d[(nb * (a.kp / 2) + c / 2) * 32 + r * 2 + (c & 1)]);
  }
  const uint8_t code = a.data[(nb * a.kp + c) * kRows + r];
  if (a.kind == kI8) return float(int8_t(code));
  uint16_t h = uint16_t(code << 8);
  if (a.kind == kF16Sra) h = uint16_t((int16_t(h) >> 1) & 0xBFFF);
  return half_to_float(h);
}

// MXFP6 E2M3 element held as an integer: 8 * E2M3 value in [-60, 60] (layout: gemm_internal.h).
int ref_q6_element(const GemmArgs& a, int64_t row, int64_t c) {
  const int64_t nb = row / kRows, r = row % kRows, b = c / kKBlk, slab = (c % kKBlk) / 4;
  const int64_t j = (r % 8) * 4 + (c % 4);
  const int t = int(slab % 2) * 2 + (r >= 8);
  const uint8_t* pair = a.data + (nb * (a.kp / kKBlk) + b) * kQ6BlockBytes + (slab / 2) * kQ6PairBytes;
  const uint8_t nib = r < 8 ? (pair[(slab % 2) * 32 + j] & 15) : (pair[(slab % 2) * 32 + j] >> 4);
  const int e1 = (pair[64 + j] >> (7 - t)) & 1, sign = (pair[64 + j] >> (3 - t)) & 1;
  const int e = e1 * 2 + (nib >> 3), m = nib & 7;
  const int mag = e == 0 ? m : (8 + m) << (e - 1);
  return sign ? -mag : mag;
}

// MXFP4 element held doubled as an integer: 2 * E2M1 value in [-12, 12].
int ref_q4_element(const GemmArgs& a, int64_t row, int64_t c) {
  static const int kDoubledE2M1[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
  const int64_t nb = row / kRows, r = row % kRows;
  const uint8_t byte = a.data[(nb * (a.kp / 4) + c / 4) * 32 + (r % 8) * 4 + (c % 4)];
  return kDoubledE2M1[r < 8 ? (byte & 15) : (byte >> 4)];
}

float ref_scale(const GemmArgs& a, int64_t row, int64_t b) {
  return e8m0_to_float(a.scales[((row / kRows) * (a.kp / kKBlk) + b) * kRows + row % kRows]);
}

float ref_dot(const GemmArgs& a, int64_t row, int64_t i) {
  float y = 0.f;
  if (a.kind == kBf16) {
    const float* x = a.x + i * a.ldx;
    for (int64_t c = 0; c < a.kp; ++c) y = std::fma(ref_element(a, row, c), x[c], y);
  } else if (a.kind == kQ4) {
    const int8_t* q = a.xq + i * a.kp;
    for (int64_t b = 0; b < a.kp / kKBlk; ++b) {
      int32_t isum = 0;  // exact
      for (int64_t c = b * kKBlk; c < (b + 1) * kKBlk; ++c) isum += ref_q4_element(a, row, c) * q[c];
      const float d = ref_scale(a, row, b) * a.xd[i * (a.kp / kKBlk) + b];
      y = std::fma(float(isum), d, y);
    }
  } else if (a.kind == kQ6) {
    const int8_t* q = a.xq + i * a.kp;
    for (int64_t b = 0; b < a.kp / kKBlk; ++b) {
      int32_t isum = 0;  // exact: |isum| <= 32 * 60 * 127
      for (int64_t c = b * kKBlk; c < (b + 1) * kKBlk; ++c) isum += ref_q6_element(a, row, c) * q[c];
      const float d = ref_scale(a, row, b) * (a.xd[i * (a.kp / kKBlk) + b] * a.elem_factor);
      y = std::fma(float(isum), d, y);
    }
  } else {
    const float* x = a.x + i * a.ldx;
    for (int64_t b = 0; b < a.kp / kKBlk; ++b) {
      float blk = 0.f;
      for (int64_t c = b * kKBlk; c < (b + 1) * kKBlk; ++c)
        blk = std::fma(ref_element(a, row, c), x[c], blk);
      y = std::fma(blk * a.elem_factor, ref_scale(a, row, b), y);
    }
  }
  return y;
}

}  // namespace

GemmArgs rows_of(const GemmArgs& a, int64_t m0, int64_t m) {
  GemmArgs c = a;
  c.m = c.mpad = m;
  if (a.x) c.x = a.x + m0 * a.ldx;
  if (a.xq) {
    c.xq = a.xq + m0 * a.kp;
    c.xd = a.xd + m0 * (a.kp / kKBlk);
    c.xc = a.xc + m0 * (a.kp / kKBlk);
  }
  if (a.xbf) c.xbf = a.xbf + m0 * a.kp;  // prefill chunks: row-major (xbf_ld = 0)
  c.y = a.y + m0 * a.ldy;
  return c;
}

void gemm_blocks_ref(const GemmArgs& a, int64_t nb0, int64_t nb1, float* acc) {
  for (int64_t row = nb0 * kRows; row < std::min(a.n, nb1 * kRows); ++row)
    for (int64_t i = 0; i < a.m; ++i) a.y[i * a.ldy + row] = ref_dot(a, row, i);
}

void quantize_q8_ref(const float* x, int64_t m, int64_t ldx, int64_t k, int64_t kp, int8_t* xq,
                     float* xd, int32_t* xc) {
  for (int64_t i = 0; i < m; ++i)
    for (int64_t b = 0; b < kp / kKBlk; ++b) {
      float v[kKBlk], amax = 0.f;
      for (int j = 0; j < kKBlk; ++j) {
        const int64_t c = b * kKBlk + j;
        v[j] = c < k ? x[i * ldx + c] : 0.f;
        const float av = std::fabs(v[j]);
        amax = av > amax ? av : amax;  // a NaN input is ignored, as max_ps(|x|, amax)
      }
      const float d = amax / 127.0f;
      const float id = d != 0.f ? 1.0f / d : 0.f;
      int32_t sum = 0;
      for (int j = 0; j < kKBlk; ++j) {
        const float t = std::nearbyint(v[j] * id);  // RNE, as cvtps2dq
        // NaN -> -127 as cvtps2dq's 0x80000000 clamped
        const int q = std::isnan(t) ? -127 : t >= 127.f ? 127 : t <= -127.f ? -127 : int(t);
        xq[i * kp + b * kKBlk + j] = int8_t(q);
        sum += q;
      }
      xd[i * (kp / kKBlk) + b] = d * 0.5f;
      xc[i * (kp / kKBlk) + b] = 12 * sum;
    }
}

}  // namespace detail

// ---------------------------------------------------------------------------------------------
// Paths and dispatch

const char* gemm_path_name(GemmPath p) {
  switch (p) {
    case GemmPath::ref: return "ref";
    case GemmPath::avx2: return "avx2";
    case GemmPath::avx512: return "avx512";
    case GemmPath::avx512_bf16: return "avx512_bf16";
    case GemmPath::amx: return "amx";
  }
  return "?";
}

GemmPath gemm_path_from_name(const std::string& name) {
  for (int i = 0; i <= int(GemmPath::amx); ++i)
    if (name == gemm_path_name(GemmPath(i))) return GemmPath(i);
  throw std::invalid_argument("unknown GEMM path '" + name +
                              "' (expected ref, avx2, avx512, avx512_bf16 or amx)");
}

namespace {
std::atomic<bool>& vnni_enabled() {
  static std::atomic<bool> on{true};
  return on;
}
// QSPEC_MX_PATH=amx starts a process with MXFP4 on the amx path at the amx level (wide trees,
// A/B runs of whole programs); avx512 or unset: the avx512 path.
std::atomic<bool>& tiles_enabled() {
  static std::atomic<bool> on{env_switch("QSPEC_MX_PATH", "amx", "avx512", false)};
  return on;
}
// QSPEC_BF16_DOT=fma | dpbf16 (gemm.h: bf16_fma); unset: FMAs on Intel.
std::atomic<bool>& bf16_fma_enabled() {
  static std::atomic<bool> on{env_switch("QSPEC_BF16_DOT", "fma", "dpbf16", cpu_features().vendor == "GenuineIntel")};
  return on;
}
}  // namespace

bool set_bf16_fma(bool enabled) { return bf16_fma_enabled().exchange(enabled); }
bool bf16_fma() { return bf16_fma_enabled().load(std::memory_order_relaxed); }
bool set_mx_vnni(bool enabled) { return vnni_enabled().exchange(enabled); }
bool set_mx_tiles(bool enabled) { return tiles_enabled().exchange(enabled); }
bool mx_tiles() { return tiles_enabled().load(std::memory_order_relaxed); }

bool mx_vnni() {
#ifdef QSPEC_ISA_EMULATION
  const bool have = true;  // the test build emulates vpdpbusd (csrc/emu/isa_emulation.h)
#else
  const bool have = cpu_features().avx512_vnni;
#endif
  return have && isa_selected() >= Isa::avx512 && vnni_enabled().load(std::memory_order_relaxed);
}

bool mx_avx_vnni() {
#ifdef QSPEC_ISA_EMULATION
  const bool have = true;  // the test build emulates AVX-VNNI's vpdpbusd too
#else
  const bool have = cpu_features().avx_vnni;
#endif
  return have && vnni_enabled().load(std::memory_order_relaxed);
}

namespace {
std::atomic<int>& row_blocks_forced() {
  static std::atomic<int> n{0};
  return n;
}
}  // namespace

int set_mx_row_blocks(int n) {
  if (n != 0 && n != 1 && n != 2 && n != 4)
    throw std::invalid_argument("set_mx_row_blocks: n is 0 (by CPU), 1, 2 or 4, not " + std::to_string(n));
  return row_blocks_forced().exchange(n);
}

int mx_row_blocks(int rows) {
  const int forced = row_blocks_forced().load(std::memory_order_relaxed);
  if (forced) return forced;
  static const bool amd = cpu_features().vendor == "AuthenticAMD";
  return amd ? 1 : 2;
}

bool gemm_supports(GemmPath p, const PackedWeight& w, int64_t m) {
  const int isa = int(isa_selected());
  switch (p) {
    case GemmPath::ref: return true;
    case GemmPath::avx2: return isa >= int(Isa::avx2);
    case GemmPath::avx512: return isa >= int(Isa::avx512);
    case GemmPath::avx512_bf16: return isa >= int(Isa::avx512_bf16) && w.fmt == WFormat::bf16;
    // Tiles for every M of BF16 weights: decode, verify and prefill share one path (gemm.h);
    // MXFP4 on int8 tiles / vpdpbusd (gemm_q4_amx.cpp), taken when mx_tiles().
    case GemmPath::amx: return isa >= int(Isa::amx) && (w.fmt == WFormat::bf16 || w.fmt == WFormat::mxfp4);
  }
  return false;
}

GemmPath gemm_choose(const PackedWeight& w, int64_t m) {
  for (int p = int(GemmPath::amx); p > int(GemmPath::ref); --p) {
    if (p == int(GemmPath::amx) && w.fmt == WFormat::mxfp4 && !mx_tiles()) continue;
    if (gemm_supports(GemmPath(p), w, m)) return GemmPath(p);
  }
  return GemmPath::ref;
}


GemmTiming& gemm_timing() {
  thread_local GemmTiming t;
  return t;
}

namespace {

template <typename V>
void fit(V& v, int64_t n) {  // grow only
  if (v.size() < size_t(n)) v.resize(size_t(n));
}

// The calling thread's buffer of bf16 activation rows (at least n; see gemm_path's buffers).
uint16_t* bf16_rows(int64_t n) {
  thread_local LineVector<uint16_t> xbf;
  fit(xbf, n);
  return xbf.data();
}

GemmArgs args_of(const PackedWeight& w, int64_t m, float* y, int64_t ldy) {
  GemmArgs a;
  a.kind = decode_kind(w.fmt);
  a.n = w.n;
  a.k = w.k;
  a.np = w.n_padded();
  a.kp = w.k_padded();
  a.data = w.buf("data");
  a.scales = w.fmt == WFormat::bf16 ? nullptr : w.buf("scales");
  a.elem_factor = elem_factor(w.fmt);
  a.m = m;
  a.y = y;
  a.ldy = ldy;
  return a;
}

// convert(r0, rows) over a call's m rows of K k: on the calling thread, or for large prefill calls
// on the pool, chunks of 16 rows from a shared counter (each chunk written by one thread).
template <typename F>
void convert_rows(int64_t m, int64_t k, const F& convert) {
  if (m * k < (int64_t(1) << 18) || Pool::instance().threads() == 1) {
    convert(0, m);
    return;
  }
  std::atomic<int64_t> next_row{0};
  auto body = [&](int) {
    for (int64_t r0; (r0 = next_row.fetch_add(16, std::memory_order_relaxed)) < m;)
      convert(r0, std::min<int64_t>(16, m - r0));
  };
  Pool::instance().run(body);
}

// x rows rounded to bf16 for the avx512_bf16 / amx kernels: [mpad][kp] (padding rows and
// columns zero), in the A-tile order (tiles, amx prefill), or with their k pairs interleaved over
// pairs_ld rows (avx512_bf16, a verify's 9-24 rows: GemmArgs::xbf_ld).
void round_bf16_act(const float* x, int64_t m, int64_t ldx, int64_t k, int64_t kp, int64_t mpad, bool tiles,
                    uint16_t* xb, int64_t pairs_ld) {
  // padding rows: zero (in the A-tile order they share the last row tile with real rows; the pairs
  // layout writes its own)
  if (tiles) std::fill(xb + (mpad - 16) * kp, xb + mpad * kp, uint16_t(0));
  else if (!pairs_ld) std::fill(xb + m * kp, xb + mpad * kp, uint16_t(0));
  convert_rows(m, k, [&](int64_t r0, int64_t rows) {  // both paths have AVX-512
    detail::round_bf16_rows_avx512(x + r0 * ldx, rows, ldx, k, kp, xb, r0, tiles, pairs_ld);
  });
}

// Runs kernel over row blocks [0, nblk) of a call on the pool (a.m rows prepared by the caller).
void run_on_pool(void (*kernel)(const GemmArgs&, int64_t, int64_t, float*), const GemmArgs& a, int64_t nblk,
                 size_t weight_bytes, ProfClock::time_point t_enter) {
  const int64_t m = a.m;
  // Threads split row blocks of N only (K is never split), so the thread count never
  // changes what a row computes. The blocks are claimed from a shared counter in shrinking
  // pieces (guided self-scheduling: remaining / (2 x threads), whole groups of 4 row blocks,
  // the kernels' tile groups): long contiguous streams first, small pieces at the end, so
  // neither a thread that loses its core on a shared machine nor an uneven finish holds the
  // other threads for long. Each piece is computed whole by one thread, so which thread
  // takes it changes nothing in the result. Tiny problems stay on one thread.
  Pool& pool = Pool::instance();
  int threads = pool.threads();
  if (weight_bytes * size_t(m) < (size_t(1) << 16)) threads = 1;
  threads = int(std::min<int64_t>(threads, nblk));
  const int64_t scratch = std::max(m * detail::kAccCols, a.xbf_tiles && a.mpad > detail::kAmxPrefillRows ? detail::kAmxPrefillScratch : 0);  // amx prefill
  thread_local LineVector<float> acc_buf;  // a slot each: any worker may join (kernels initialise it)
  fit(acc_buf, scratch * pool.threads());
  float* const acc = acc_buf.data();  // the caller's buffer (a worker's thread_local would be its own)
  GemmTiming& timing = gemm_timing();
  const auto t_region = ProfClock::now();
  timing.prep_s += seconds_between(t_enter, t_region);
  if (threads == 1) {
    kernel(a, 0, nblk, acc);
    return;
  }
  constexpr int64_t kGroup = 4;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> busy_ns{0};
  auto body = [&](int slot) {
    const auto t_work = ProfClock::now();
    float* my_acc = acc + slot * scratch;
    int64_t start = next.load(std::memory_order_relaxed);
    while (start < nblk) {
      const int64_t rem = nblk - start;
      const int64_t piece = std::min(rem, ((rem + 2 * threads - 1) / (2 * threads) + kGroup - 1) / kGroup * kGroup);
      if (next.compare_exchange_weak(start, start + piece, std::memory_order_relaxed)) {
        kernel(a, start, start + piece, my_acc);
        start = next.load(std::memory_order_relaxed);
      }  // else: start now holds the current counter; try again from there
    }
    busy_ns.fetch_add(nanoseconds_between(t_work, ProfClock::now()), std::memory_order_relaxed);
  };
  pool.run(body);
  // idle counts every configured thread: one that never joined was idle the whole region
  timing.region.add(seconds_between(t_region, ProfClock::now()), 1e-9 * double(busy_ns.load()), threads);
}

}  // namespace

void gemm_path(GemmPath p, const PackedWeight& w, const float* x, int64_t m, int64_t ldx, float* y,
               int64_t ldy) {
  const auto t_enter = ProfClock::now();
  if (!gemm_supports(p, w, m))
    throw std::invalid_argument(std::string("GEMM path '") + gemm_path_name(p) +
                                "' is not usable here (isa_selected=" + isa_name(isa_selected()) +
                                ", fmt=" + mx_format(w.fmt).name + ", m=" + std::to_string(m) + ")");
  if (m < 0 || ldx < w.k || ldy < w.n) throw std::invalid_argument("gemm: bad m / ldx / ldy");
  if (m == 0) return;

  GemmArgs a = args_of(w, m, y, ldy);

  // Activations as the kernels read them: rows zero-padded to kp, or Q8, or bf16. The buffers
  // are per calling thread and only grow: a verify pass's bf16 rows (16 x 8960 for a down
  // projection) are past malloc's mmap threshold, and a fresh mapping per call cost page faults.
  thread_local LineVector<float> xpad;
  thread_local LineVector<int8_t> xq;
  thread_local LineVector<float> xd;
  thread_local LineVector<int32_t> xc;
  thread_local LineVector<float> xf;
  const bool q4_tiles = p == GemmPath::amx && a.kind == detail::kQ4;
  const bool bf16_act = p == GemmPath::avx512_bf16 || (p == GemmPath::amx && !q4_tiles);
  if (q4_tiles) {  // two int8 parts per row (gemm_q4_amx.cpp)
    a.kq = rup(a.kp, 64);
    fit(xq, 2 * m * a.kq);
    fit(xd, m);
    fit(xc, 2 * m);
    detail::quantize_x_i8x2(x, m, ldx, w.k, a.kq, xq.data(), xd.data(), xc.data());
    a.xi8 = xq.data();
    a.xrow = xd.data();
    a.xsum = xc.data();
  } else if (!bf16_act && (a.kind == detail::kQ4 || a.kind == detail::kQ6)) {
    fit(xq, m * a.kp);
    fit(xd, m * a.kp / kKBlk);
    fit(xc, m * a.kp / kKBlk);
    auto quantize = p == GemmPath::ref ? detail::quantize_q8_ref : detail::quantize_q8_avx2;
    quantize(x, m, ldx, w.k, a.kp, xq.data(), xd.data(), xc.data());
    a.xq = xq.data();
    a.xd = xd.data();
    a.xc = xc.data();
  } else if (bf16_act) {
    a.mpad = p == GemmPath::amx && m > 1 ? rup(m, 16) : m;  // amx: whole 16-row tiles (gemm_amx.cpp)
    if (p == GemmPath::avx512_bf16 && bf16_fma() && m >= kBf16FmaRows) {  // fp32 pairs (gemm_bf16fma_avx512.cpp)
      a.xf_group = std::min<int64_t>(m, 16);
      fit(xf, rup(m, a.xf_group) * a.kp);
      float* const xfp = xf.data();  // the caller's (a worker's thread_local would be its own)
      convert_rows(m, w.k, [&](int64_t r0, int64_t rows) {
        detail::expand_bf16_pairs_avx512(x + r0 * ldx, rows, ldx, w.k, a.kp, a.xf_group, xfp, r0);
      });
      a.xf = xfp;
    } else {
      a.xbf_tiles = p == GemmPath::amx && a.mpad > 16;  // 2+ row tiles: A tiles of 1 KB (gemm_amx.cpp)
      // a verify's 9-24 rows: k pairs interleaved for the 16-row tiles (5 rows measured ~8% slower so)
      if (p == GemmPath::avx512_bf16 && m > 8 && m <= detail::kPrefillRows) a.xbf_ld = m;
      uint16_t* const xb = bf16_rows(a.mpad * a.kp);
      round_bf16_act(x, m, ldx, w.k, a.kp, a.mpad, a.xbf_tiles, xb, a.xbf_ld);
      a.xbf = xb;
    }
  } else if (w.k != a.kp) {
    fit(xpad, m * a.kp);
    for (int64_t i = 0; i < m; ++i) {
      std::memcpy(&xpad[size_t(i * a.kp)], x + i * ldx, size_t(w.k) * 4);
      std::fill(&xpad[size_t(i * a.kp + w.k)], &xpad[size_t(i * a.kp)] + a.kp, 0.f);
    }
    a.x = xpad.data();
    a.ldx = a.kp;
  } else {
    a.x = x;
    a.ldx = ldx;
  }

  void (*kernel)(const GemmArgs&, int64_t, int64_t, float*) = nullptr;
  switch (p) {
    case GemmPath::ref: kernel = detail::gemm_blocks_ref; break;
    case GemmPath::avx2:
      kernel = a.kind == detail::kQ4 && m >= kAvxVnniRows && mx_avx_vnni() ? detail::gemm_blocks_q4_avxvnni
                                                                             : detail::gemm_blocks_avx2;
      break;
    case GemmPath::avx512:
      kernel = a.kind == detail::kQ4 && mx_vnni() ? detail::gemm_blocks_q4_vnni : detail::gemm_blocks_avx512;
      break;
    case GemmPath::avx512_bf16: kernel = a.xf ? detail::gemm_blocks_bf16_fma : detail::gemm_blocks_avx512_bf16; break;
    case GemmPath::amx: kernel = a.kind == detail::kQ4 ? detail::gemm_blocks_q4_amx : detail::gemm_blocks_amx; break;
  }

  run_on_pool(kernel, a, a.np / kRows, w.nbytes(), t_enter);
}

void gemm(const PackedWeight& w, const float* x, int64_t m, int64_t ldx, float* y, int64_t ldy) {
  gemm_path(gemm_choose(w, m), w, x, m, ldx, y, ldy);
}

namespace {

// BF16 weights of a call of m rows that takes the amx kernel's prefill (x in the A-tile order)
// with a K in whole 32-column steps: what gemm_swiglu's two halves need of each weight.
bool amx_prefill_tiles(const PackedWeight& w, int64_t k, int64_t m) {
  return m > 0 && rup(m, 16) > detail::kAmxPrefillRows && w.fmt == WFormat::bf16 && k % kKBlk == 0 &&
         gemm_choose(w, m) == GemmPath::amx;
}

}  // namespace

bool gemm_swiglu_supported(const PackedWeight& gate_up, const PackedWeight& down, int64_t m) {
  return gate_up.n % 2 == 0 && down.k == gate_up.n / 2 && amx_prefill_tiles(gate_up, gate_up.n / 2, m) &&
         amx_prefill_tiles(down, down.k, m);
}

void gemm_swiglu(const PackedWeight& gate_up, const float* x, int64_t m, int64_t ldx, uint16_t* act) {
  const auto t_enter = ProfClock::now();
  const int64_t f = gate_up.n / 2;
  if (gate_up.n % 2 != 0 || !amx_prefill_tiles(gate_up, f, m) || ldx < gate_up.k)
    throw std::invalid_argument("gemm_swiglu: needs BF16 gate|up weights on the amx path, more than " +
                                std::to_string(detail::kAmxPrefillRows) + " rows and n / 2 a multiple of 32");
  GemmArgs a = args_of(gate_up, m, nullptr, 0);
  a.mpad = rup(m, 16);
  a.xbf_tiles = true;
  uint16_t* const xb = bf16_rows(a.mpad * a.kp);
  round_bf16_act(x, m, ldx, gate_up.k, a.kp, a.mpad, true, xb, 0);
  a.xbf = xb;
  a.act = act;
  a.act_kp = f;
  run_on_pool(detail::gemm_blocks_amx_swiglu, a, f / kRows, gate_up.nbytes(), t_enter);
}

void gemm_act_tiles(const PackedWeight& w, const uint16_t* act, int64_t m, float* y, int64_t ldy) {
  const auto t_enter = ProfClock::now();
  if (!amx_prefill_tiles(w, w.k, m) || ldy < w.n)
    throw std::invalid_argument("gemm_act_tiles: needs BF16 weights on the amx path, more than " +
                                std::to_string(detail::kAmxPrefillRows) + " rows and k a multiple of 32");
  GemmArgs a = args_of(w, m, y, ldy);
  a.mpad = rup(m, 16);
  a.xbf_tiles = true;
  a.xbf = act;
  run_on_pool(detail::gemm_blocks_amx, a, a.np / kRows, w.nbytes(), t_enter);
}

}  // namespace qspec
