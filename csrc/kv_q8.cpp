// The draft copies of the KV cache: the quantizers (kv_q8.h) and their Python bindings.
#include "kv_q8.h"

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cmath>
#include <stdexcept>
#include <utility>
#include <vector>

#include "attention.h"
#include "bindings.h"

namespace qspec {

namespace {

float bf16_value(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

}  // namespace

void kv_q8_quantize(const uint16_t* bf16, int64_t n, int8_t* q, uint8_t* scale) {
  for (int64_t b = 0; b < n; b += kQ8Block) {
    float x[kQ8Block];
    float amax = 0.f;
    for (int64_t i = 0; i < kQ8Block; ++i) {
      x[i] = bf16_value(bf16[b + i]);
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
  const int64_t p = kv_rot_size(head_dim), c = p > kQ8Block ? p : kQ8Block;
  std::vector<float> y(static_cast<size_t>(c));
  for (int64_t r = 0; r < n; r += c) {
    for (int64_t i = 0; i < c; ++i) y[i] = bf16_value(bf16[r + i]);
    kv_rotate(y.data(), c, p);
    for (int64_t b = 0; b < c; b += kQ8Block) {
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

namespace py = pybind11;

void kv_set_copy(KvCacheView& kv, const py::tuple& copy, const char* who) {
  const int64_t hd = kv.head_dim;
  auto fail = [&] {
    throw std::invalid_argument(std::string(who) + " must be (int8 K values [layers, 1, rows, kv_heads, head_dim], "
                                "int8 V values [.., head_dim or head_dim / 2], uint8 scales [layers, 2, rows, "
                                "kv_heads, head_dim / 32]) matching the cache, with head_dim a multiple of 32");
  };
  if (copy.size() != 3 || hd % kQ8Block != 0) fail();
  py::array a[3];
  for (int i = 0; i < 3; ++i) {
    if (!py::isinstance<py::array>(copy[i])) fail();
    a[i] = copy[i].cast<py::array>();
    if (a[i].ndim() != 5 || a[i].itemsize() != 1 || !(a[i].flags() & py::array::c_style) ||
        a[i].dtype().kind() != (i < 2 ? 'i' : 'u') || !a[i].writeable())
      fail();
    if (a[i].shape(0) != kv.layers || a[i].shape(1) != (i < 2 ? 1 : 2) || a[i].shape(2) != kv.max_seq ||
        a[i].shape(3) != kv.kv_heads)
      fail();
  }
  if (a[0].shape(4) != hd || (a[1].shape(4) != hd && a[1].shape(4) != hd / 2) || a[2].shape(4) != hd / kQ8Block) fail();
  kv.q8k = static_cast<int8_t*>(a[0].mutable_data());
  kv.q8v = static_cast<int8_t*>(a[1].mutable_data());
  kv.q8_scale = static_cast<uint8_t*>(a[2].mutable_data());
  kv.v_bits = a[1].shape(4) == hd ? 8 : 4;
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
}

}  // namespace qspec
