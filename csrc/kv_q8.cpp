// The INT8 draft copy of the KV cache: the quantizer (kv_q8.h) and its Python binding.
#include "kv_q8.h"

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cmath>
#include <stdexcept>
#include <utility>
#include <vector>

#include "bindings.h"
#include "mx.h"

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

void kv_fp4_quantize(const uint16_t* bf16, int64_t n, uint8_t* packed, uint8_t* scale) {
  constexpr int64_t kChunk = 8 * kQ8Block;
  for (int64_t b = 0; b < n; b += kChunk) {
    const int64_t c = n - b < kChunk ? n - b : kChunk;
    float x[kChunk];
    uint8_t codes[kChunk];
    for (int64_t i = 0; i < c; ++i) x[i] = bf16_value(bf16[b + i]);
    mx_quantize_row(WFormat::mxfp4, x, c, codes, scale + b / kQ8Block);
    for (int64_t i = 0; i < c; i += 2) packed[(b + i) / 2] = uint8_t(codes[i] | codes[i + 1] << 4);
  }
}

namespace py = pybind11;

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
  m.def("kv_fp4_quantize", [](py::array_t<uint16_t, py::array::c_style> x) {
    const int64_t n = x.ndim() ? x.shape(x.ndim() - 1) : 0;
    if (x.ndim() < 1 || n % kQ8Block != 0)
      throw std::invalid_argument("kv_fp4_quantize: the last dimension must be a multiple of 32");
    std::vector<py::ssize_t> shape(x.shape(), x.shape() + x.ndim());
    shape.back() = n / 2;
    py::array_t<int8_t> q(shape);
    shape.back() = n / kQ8Block;
    py::array_t<uint8_t> e(shape);
    const int64_t rows = n ? x.size() / n : 0;
    for (int64_t r = 0; r < rows; ++r)
      kv_fp4_quantize(x.data() + r * n, n, reinterpret_cast<uint8_t*>(q.mutable_data()) + r * (n / 2),
                      e.mutable_data() + r * (n / kQ8Block));
    return std::make_pair(q, e);
  }, py::arg("bf16"),
     "MXFP4 draft copy of BF16 bits [..., n] (n a multiple of 32): (packed E2M1 codes [..., n / 2] as int8 "
     "bytes, element 2i in the low nibble of byte i; E8M0 scale bytes [..., n / 32])");
}

}  // namespace qspec
