// The draft copies of the KV cache: the quantizers (kv_q8.h) and their Python bindings.
#include "kv_q8.h"

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cmath>
#include <stdexcept>
#include <utility>
#include <vector>

#include "attention.h"
#include "bf16.h"
#include "bindings.h"

namespace qspec {

void kv_q8_quantize(const uint16_t* bf16, int64_t n, int8_t* q, uint8_t* scale) {
  for (int64_t b = 0; b < n; b += kQ8Block) {
    float x[kQ8Block];
    float amax = 0.f;
    for (int64_t i = 0; i < kQ8Block; ++i) {
      x[i] = bf16_to_f32(bf16[b + i]);
      const float ax = std::fabs(x[i]);
      if (ax > amax) amax = ax;  // NaN never compares greater: a NaN value quantizes to 0
    }
    int s = -126;
    if (amax > 0.f && std::isfinite(amax)) {
      s = std::ilogb(amax) - 6;  // amax / 2^s in [64, 128)
      if (amax > std::ldexp(127.f, s)) ++s;
      s = s < -126 ? -126 : s > 127 ? 127 : s;
    }
    const float inv = std::ldexp(1.f, -s);  // exact: a power of two in FP32 range for s in [-126, 127]
    for (int64_t i = 0; i < kQ8Block; ++i) {
      float r = std::nearbyint(x[i] * inv);  // round half to even (the default rounding mode)
      r = r > 127.f ? 127.f : r < -127.f ? -127.f : r;
      q[b + i] = int8_t(r == r ? r : 0.f);
    }
    scale[b / kQ8Block] = uint8_t(s + 127);
  }
}

namespace {

// The smallest UE5M3 scale byte whose value s has 7·s >= amax (kv_q8.h), clamped to [1, 0xFE].
uint8_t q4_scale_byte(float amax) {
  const float t = amax / 7.f;
  if (!(t > 0.f)) return 0;
  int f = std::ilogb(t);
  int m = int(std::ceil((std::ldexp(t, -f) - 1.f) * 8.f));  // t / 2^f in [1, 2): exact
  if (m == 8) m = 0, ++f;
  const int ef = f + 16;
  if (ef < 0) return 1;
  if (ef > 31 || (ef == 31 && m == 7)) return 0xFE;
  const int e = ef << 3 | m;
  return uint8_t(e ? e : 1);
}

}  // namespace

void kv_q4_quantize(const uint16_t* bf16, int64_t n, int64_t head_dim, uint8_t* packed, uint8_t* scale) {
  const int64_t p = kv_rot_size(head_dim);  // >= kQ8Block: head_dim is a multiple of it
  std::vector<float> y(static_cast<size_t>(p));
  for (int64_t r = 0; r < n; r += p) {
    for (int64_t i = 0; i < p; ++i) y[i] = bf16_to_f32(bf16[r + i]);
    kv_rotate(y.data(), p, p);
    for (int64_t b = 0; b < p; b += kQ8Block) {
      float amax = 0.f;
      bool finite = true;
      for (int64_t i = b; i < b + kQ8Block; ++i) {
        finite = finite && std::isfinite(y[i]);
        amax = std::fabs(y[i]) > amax ? std::fabs(y[i]) : amax;
      }
      const uint8_t e = finite ? q4_scale_byte(amax) : 0xFF;
      const float s = kv_q4_scale(e);
      uint8_t* out = packed + (r + b) / 2;
      for (int64_t i = 0; i < kQ8Block; i += 2) {
        int c[2];
        for (int t = 0; t < 2; ++t) {
          float v = finite && e ? std::nearbyint(y[b + i + t] / s) : 0.f;  // round half to even
          v = v > 7.f ? 7.f : v < -7.f ? -7.f : v;
          c[t] = int(v) & 15;
        }
        out[i / 2] = uint8_t(c[0] | c[1] << 4);
      }
      scale[(r + b) / kQ8Block] = e;
    }
  }
}

void kv_k4_group(const uint16_t* x, int64_t g, int64_t n, int64_t head_dim, uint8_t* packed, uint8_t* params) {
  for (int64_t c = 0; c < n; ++c) {
    float lo = INFINITY, hi = -INFINITY;
    bool finite = true;
    for (int64_t i = 0; i < g; ++i) {
      const float v = bf16_to_f32(x[i * n + c]);
      finite = finite && std::isfinite(v);
      lo = v < lo ? v : lo;
      hi = v > hi ? v : hi;
    }
    const uint16_t center = finite ? f32_to_bf16(lo * 0.5f + hi * 0.5f) : 0;
    const float cf = bf16_to_f32(center);
    const float r = finite ? std::fmax(hi - cf, cf - lo) : 0.f;
    const uint8_t e = finite ? q4_scale_byte(r) : 0xFF;
    const float s = kv_q4_scale(e);
    for (int64_t i = 0; i < g; ++i) {
      float v = finite && e ? std::nearbyint((bf16_to_f32(x[i * n + c]) - cf) / s) : 0.f;
      v = v > 7.f ? 7.f : v < -7.f ? -7.f : v;
      uint8_t& byte = packed[i * (n / 2) + c / 2];
      const uint8_t nib = uint8_t(int(v) & 15);
      byte = c & 1 ? uint8_t((byte & 0x0F) | nib << 4) : uint8_t((byte & 0xF0) | nib);
    }
    uint8_t* ph = params + (c / head_dim) * 3 * head_dim;
    const int64_t d = c % head_dim;
    ph[2 * d] = uint8_t(center & 0xFF);
    ph[2 * d + 1] = uint8_t(center >> 8);
    ph[2 * head_dim + d] = e;
  }
}

namespace py = pybind11;

void kv_set_copy(KvCacheView& kv, const py::tuple& copy, const char* who) {
  const int64_t hd = kv.head_dim;
  auto fail = [&] {
    throw std::invalid_argument(std::string(who) + " must be the draft copy of qspec/kv_cache.py: (K values, V values "
                                "[layers, 1, rows, kv_heads, head_dim or head_dim / 2] int8, K scales, V scales "
                                "[layers, 1, rows, kv_heads, n] uint8, flags [1, 1, rows, 1, 1] uint8) matching "
                                "the cache, with head_dim a multiple of 32");
  };
  if (copy.size() != 5 || hd % kQ8Block != 0) fail();
  py::array a[5];
  for (int i = 0; i < 5; ++i) {
    if (!py::isinstance<py::array>(copy[i])) fail();
    a[i] = copy[i].cast<py::array>();
    if (a[i].ndim() != 5 || a[i].itemsize() != 1 || !(a[i].flags() & py::array::c_style) ||
        a[i].dtype().kind() != (i < 2 ? 'i' : 'u') || !a[i].writeable() || a[i].shape(1) != 1 ||
        a[i].shape(2) != kv.max_seq || a[i].shape(0) != (i < 4 ? kv.layers : 1) ||
        a[i].shape(3) != (i < 4 ? kv.kv_heads : 1))
      fail();
  }
  const int64_t kv_n = a[0].shape(4), vv_n = a[1].shape(4), ks_n = a[2].shape(4);
  if ((kv_n != hd && kv_n != hd / 2) || (vv_n != hd && vv_n != hd / 2) || a[3].shape(4) != hd / kQ8Block ||
      a[4].shape(4) != 1)
    fail();
  kv.k_bits = kv_n == hd ? 8 : 4;
  kv.v_bits = vv_n == hd ? 8 : 4;
  if (kv.k_bits == 8 ? ks_n != hd / kQ8Block : ks_n <= 0 || (3 * hd) % ks_n != 0 || hd > 512) fail();
  kv.k_group = kv.k_bits == 4 ? 3 * hd / ks_n : 0;  // rows per K group
  kv.k_group_shift = kv_shift(kv.k_group);
  if (kv.k_bits == 4 && (kv.k_group % 8 != 0 || kv.max_seq % kv.k_group != 0))
    throw std::invalid_argument(std::string(who) + ": the INT4 K copy's groups (" + std::to_string(kv.k_group) +
                                " rows) must be a multiple of 8 dividing the pool's rows");
  kv.q8k = static_cast<int8_t*>(a[0].mutable_data());
  kv.q8v = static_cast<int8_t*>(a[1].mutable_data());
  kv.k_scale = static_cast<uint8_t*>(a[2].mutable_data());
  kv.v_scale = static_cast<uint8_t*>(a[3].mutable_data());
  kv.k_final = static_cast<uint8_t*>(a[4].mutable_data());
}

void kv_k4_finalize(const KvCacheView& kv, int64_t pos0, int64_t pos1) {
  const int64_t g = kv.k_group, n = kv.row_elems();
  for (int64_t p = pos1 - g; p >= pos0; p -= g) {  // newest first: stop at a group already written
    const int64_t row = kv.slot(p);
    if (kv.k_final[row]) break;
    for (int64_t l = 0; l < kv.layers; ++l)
      kv_k4_group(kv.k(l, p), g, n, kv.head_dim, reinterpret_cast<uint8_t*>(kv.q8_row(l, 0, p)),
                  kv.k_group_params(l, row));
    kv.k_final[row] = 1;
  }
}

void kv_k4_unfinal(const KvCacheView& kv, int64_t pos0, int64_t pos1) {
  for (int64_t p = pos0 - pos0 % kv.k_group; p < pos1; p += kv.k_group) kv.k_final[kv.slot(p)] = 0;
}

void bind_kv_q8(py::module_& m) {
  m.def("kv_q8_quantize", [](py::array_t<uint16_t, py::array::c_style> x) {
    const int64_t n = x.ndim() ? x.shape(x.ndim() - 1) : 0;
    if (x.ndim() < 1 || n % kQ8Block != 0)
      throw std::invalid_argument("kv_q8_quantize: the last dimension must be a multiple of 32");
    std::vector<py::ssize_t> shape(x.shape(), x.shape() + x.ndim());
    py::array_t<int8_t> q(shape);
    shape.back() = n / kQ8Block;
    py::array_t<uint8_t> e(shape);
    const int64_t rows = n ? x.size() / n : 0;
    for (int64_t r = 0; r < rows; ++r)
      kv_q8_quantize(x.data() + r * n, n, q.mutable_data() + r * n, e.mutable_data() + r * (n / kQ8Block));
    return std::make_pair(q, e);
  }, py::arg("bf16"),
     "INT8 draft copy of BF16 bits [..., n] (n a multiple of 32): (int8 values, E8M0 scale bytes "
     "[..., n / 32]); value = q * 2^(scale - 127)");
  m.def("kv_q4_quantize", [](py::array_t<uint16_t, py::array::c_style> x) {
    const int64_t n = x.ndim() ? x.shape(x.ndim() - 1) : 0;
    if (x.ndim() < 1 || n % kQ8Block != 0 || n == 0)
      throw std::invalid_argument("kv_q4_quantize: the last dimension (head_dim) must be a positive multiple of 32");
    std::vector<py::ssize_t> shape(x.shape(), x.shape() + x.ndim());
    shape.back() = n / 2;
    py::array_t<int8_t> q(shape);
    shape.back() = n / kQ8Block;
    py::array_t<uint8_t> e(shape);
    kv_q4_quantize(x.data(), x.size(), n, reinterpret_cast<uint8_t*>(q.mutable_data()), e.mutable_data());
    return std::make_pair(q, e);
  }, py::arg("bf16"),
     "INT4 draft copy of BF16 bits [..., head_dim] (head_dim a multiple of 32), in the rotated basis of "
     "csrc/kv_q8.h: (packed two's complement nibbles [..., head_dim / 2] as int8 bytes, element 2i in "
     "the low nibble of byte i; UE5M3 scale bytes [..., head_dim / 32])");
  m.def("kv_k4_group", [](py::array_t<uint16_t, py::array::c_style> x, int64_t head_dim) {
    if (x.ndim() < 2 || head_dim <= 0 || head_dim % kQ8Block != 0 || x.shape(x.ndim() - 1) % head_dim != 0)
      throw std::invalid_argument("kv_k4_group: x must be BF16 bits [..., g, n] with n a multiple of head_dim, "
                                  "head_dim a positive multiple of 32");
    const int64_t g = x.shape(x.ndim() - 2), n = x.shape(x.ndim() - 1), groups = g * n ? x.size() / (g * n) : 0;
    std::vector<py::ssize_t> shape(x.shape(), x.shape() + x.ndim());
    shape.back() = n / 2;
    py::array_t<int8_t> q(shape);
    shape.pop_back();
    shape.back() = 3 * n;
    py::array_t<uint8_t> params(shape);
    for (int64_t i = 0; i < groups; ++i)
      kv_k4_group(x.data() + i * g * n, g, n, head_dim, reinterpret_cast<uint8_t*>(q.mutable_data()) + i * g * n / 2,
                  params.mutable_data() + i * 3 * n);
    return std::make_pair(q, params);
  }, py::arg("bf16"), py::arg("head_dim"),
     "INT4 K copy of groups of g BF16 rows [..., g, n] (kv_q8.h kv_k4_group): (packed nibbles [..., g, n / 2] "
     "as int8, params [..., 3 n]: per head its head_dim BF16 centers then its head_dim UE5M3 scale bytes)");
}

}  // namespace qspec
