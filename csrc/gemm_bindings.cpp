// Python bindings of the GEMM (csrc/gemm.h): PackedWeight (packed once at load, or borrowed
// zero-copy from Python buffers), packing, the dispatcher and the path queries.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "bindings.h"
#include "gemm.h"
#include "gemm_internal.h"

namespace qspec {

using detail::kKBlk;
using detail::rup;

namespace py = pybind11;

namespace {

// Python buffers borrowed by a PackedWeight: released (under the GIL) when the last owner goes.
struct BorrowedBuffers {
  std::vector<Py_buffer> views;
  ~BorrowedBuffers() {
    if (views.empty() || !Py_IsInitialized()) return;
    py::gil_scoped_acquire gil;
    for (auto& v : views) PyBuffer_Release(&v);
  }
};

py::array ro_view(const uint8_t* p, size_t n, py::handle base) {
  py::array a(py::dtype::of<uint8_t>(), {py::ssize_t(n)}, {py::ssize_t(1)}, p, base);
  a.attr("setflags")(py::arg("write") = false);
  return a;
}

void check_2d(const py::array& a, const char* what, const py::dtype& dt) {
  if (!a.dtype().is(dt) && !a.dtype().equal(dt))
    throw std::invalid_argument(std::string(what) + ": expected dtype " +
                                py::str(dt).cast<std::string>() + ", got " +
                                py::str(a.dtype()).cast<std::string>());
  if (a.ndim() != 2)
    throw std::invalid_argument(std::string(what) + ": expected a 2-D array, got " +
                                std::to_string(a.ndim()) + "-D");
}

}  // namespace

void bind_gemm(py::module_& m) {
  py::class_<PackedWeight, std::shared_ptr<PackedWeight>>(
      m, "PackedWeight", "Weights packed once for the GEMM kernels (layout: csrc/gemm.h)")
      .def_property_readonly("fmt", [](const PackedWeight& w) { return std::string(mx_format(w.fmt).name); })
      .def_property_readonly("n", [](const PackedWeight& w) { return w.n; })
      .def_property_readonly("k", [](const PackedWeight& w) { return w.k; })
      .def_property_readonly("nbytes", &PackedWeight::nbytes, "bytes one full pass streams")
      .def("buffers", [](py::object self) {
        const PackedWeight& w = self.cast<const PackedWeight&>();
        py::dict d;
        for (const auto& [name, pb] : w.buffers) d[py::str(name)] = ro_view(pb.first, pb.second, self);
        return d;
      }, "Named read-only uint8 views of the packed buffers (zero copy)")
      .def_static("from_buffers", [](const std::string& fmt, int64_t n, int64_t k, py::dict bufs) {
        WFormat f = wformat_from_name(fmt);
        auto owner = std::make_shared<BorrowedBuffers>();
        std::map<std::string, std::pair<const uint8_t*, size_t>> views;
        for (auto item : bufs) {
          std::string name = py::str(item.first);
          Py_buffer v;
          if (PyObject_GetBuffer(item.second.ptr(), &v, PyBUF_C_CONTIGUOUS) != 0) {
            PyErr_Clear();
            throw std::invalid_argument("buffer '" + name + "' is not a C-contiguous buffer");
          }
          owner->views.push_back(v);
          views[name] = {static_cast<const uint8_t*>(v.buf), size_t(v.len)};
        }
        return packed_from_buffers(f, n, k, views, owner);
      }, py::arg("fmt"), py::arg("n"), py::arg("k"), py::arg("buffers"),
         "Borrow packed buffers (zero copy; the objects are kept alive); sizes are checked")
      .def("__repr__", [](const PackedWeight& w) {
        return "PackedWeight(fmt=" + std::string(mx_format(w.fmt).name) + ", n=" + std::to_string(w.n) +
               ", k=" + std::to_string(w.k) + ", nbytes=" + std::to_string(w.nbytes()) + ")";
      });

  m.attr("PACK_LAYOUT_VERSION") = kPackLayoutVersion;

  m.def("pack_bf16", [](py::array w) {
    check_2d(w, "pack_bf16 w", py::dtype::of<uint16_t>());
    auto wc = py::array_t<uint16_t, py::array::c_style>::ensure(w);
    const int64_t n = wc.shape(0), k = wc.shape(1);
    py::gil_scoped_release nogil;
    return pack_bf16(wc.data(), n, k);
  }, py::arg("w"), "Pack BF16 weight bits (numpy uint16 [N, K])");

  m.def("pack_mx", [](const std::string& fmt, py::array codes, py::array scales, int64_t k) {
    WFormat f = wformat_from_name(fmt);
    if (f == WFormat::bf16) throw std::invalid_argument("pack_mx: use pack_bf16 for bf16");
    check_2d(codes, "pack_mx codes", py::dtype::of<uint8_t>());
    check_2d(scales, "pack_mx scales", py::dtype::of<uint8_t>());
    const int64_t n = codes.shape(0), kp = rup(k, kKBlk);
    if (k < 1 || codes.shape(1) != kp)
      throw std::invalid_argument("pack_mx: codes must be [N, ceil(k/32)*32] = [N, " +
                                  std::to_string(kp) + "], got [" + std::to_string(n) + ", " +
                                  std::to_string(codes.shape(1)) + "]");
    if (scales.shape(0) != n || scales.shape(1) != kp / kKBlk)
      throw std::invalid_argument("pack_mx: scales must be [N, " + std::to_string(kp / kKBlk) + "]");
    auto cc = py::array_t<uint8_t, py::array::c_style>::ensure(codes);
    auto sc = py::array_t<uint8_t, py::array::c_style>::ensure(scales);
    py::gil_scoped_release nogil;
    return pack_mx(f, cc.data(), sc.data(), n, k);
  }, py::arg("fmt"), py::arg("codes"), py::arg("scales"), py::arg("k"),
     "Pack MX codes (uint8 one per byte [N, Kpad]) and E8M0 scales (uint8 [N, Kpad/32])");

  m.def("gemm_swiglu_supported", &gemm_swiglu_supported, py::arg("gate_up"), py::arg("down"), py::arg("m"),
        "Whether a prefill of m rows takes the fused amx MLP (gemm_swiglu + gemm_act_tiles).");
  m.def("mlp_swiglu", [](const PackedWeight& gate_up, const PackedWeight& down, py::array_t<float, py::array::c_style> x) {
    check_2d(x, "mlp_swiglu x", py::dtype::of<float>());
    const int64_t mrows = x.shape(0);
    if (x.shape(1) != gate_up.k) throw std::invalid_argument("mlp_swiglu: x columns != gate_up k");
    if (!gemm_swiglu_supported(gate_up, down, mrows))
      throw std::invalid_argument("mlp_swiglu: not usable here (gemm_swiglu_supported is false)");
    std::vector<uint16_t> act(size_t(((mrows + 15) / 16) * 16 * down.k));
    py::array_t<float> y({mrows, down.n});
    {
      py::gil_scoped_release nogil;
      gemm_swiglu(gate_up, x.data(), mrows, gate_up.k, act.data());
      gemm_act_tiles(down, act.data(), mrows, y.mutable_data(), down.n);
    }
    return y;
  }, py::arg("gate_up"), py::arg("down"), py::arg("x"),
  "The fused amx prefill MLP: down(silu(gate) * up) of x's rows through gemm_swiglu and gemm_act_tiles.");
  m.def("gemm", [](const PackedWeight& w, py::array x, std::optional<py::array> out,
                   std::optional<std::string> path) {
    check_2d(x, "gemm x", py::dtype::of<float>());
    if (x.shape(1) != w.k)
      throw std::invalid_argument("gemm: x has " + std::to_string(x.shape(1)) +
                                  " columns, weight k = " + std::to_string(w.k));
    const int64_t mrows = x.shape(0);
    if (x.strides(1) != 4 || (mrows > 1 && (x.strides(0) % 4 != 0 || x.strides(0) / 4 < w.k)))
      throw std::invalid_argument("gemm: x must be C-contiguous rows (row stride >= k)");
    const int64_t ldx = mrows > 1 ? x.strides(0) / 4 : w.k;
    py::array y;
    if (out) {
      y = *out;
      check_2d(y, "gemm out", py::dtype::of<float>());
      if (y.shape(0) != mrows || y.shape(1) != w.n)
        throw std::invalid_argument("gemm: out must be [" + std::to_string(mrows) + ", " +
                                    std::to_string(w.n) + "]");
      if (!y.writeable()) throw std::invalid_argument("gemm: out is read-only");
      if (y.strides(1) != 4 || (mrows > 1 && (y.strides(0) % 4 != 0 || y.strides(0) / 4 < w.n)))
        throw std::invalid_argument("gemm: out must be C-contiguous rows");
    } else {
      y = py::array_t<float>({mrows, w.n});
    }
    const int64_t ldy = mrows > 1 ? y.strides(0) / 4 : w.n;
    const GemmPath p = path ? gemm_path_from_name(*path) : gemm_choose(w, mrows);
    if (!gemm_supports(p, w, mrows))
      throw std::invalid_argument(std::string("GEMM path '") + gemm_path_name(p) +
                                  "' is not usable here (isa_selected=" + isa_name(isa_selected()) +
                                  ", fmt=" + mx_format(w.fmt).name + ", m=" + std::to_string(mrows) + ")");
    const float* xp = static_cast<const float*>(x.data());
    float* yp = static_cast<float*>(y.mutable_data());
    {
      py::gil_scoped_release nogil;
      gemm_path(p, w, xp, mrows, ldx, yp, ldy);
    }
    return y;
  }, py::arg("w"), py::arg("x"), py::arg("out") = py::none(), py::arg("path") = py::none(),
     "y[M, N] = x[M, K] @ W[N, K]^T (fp32); path None = dispatcher");

  m.def("round_bf16", [](py::array x) {
    check_2d(x, "round_bf16 x", py::dtype::of<float>());
    if (int(isa_selected()) < int(Isa::avx512)) throw std::invalid_argument("round_bf16: needs the avx512 level or above");
    auto xc = py::array_t<float, py::array::c_style>::ensure(x);
    const int64_t m = xc.shape(0), k = xc.shape(1);
    py::array_t<uint16_t> out({m, k});
    {
      py::gil_scoped_release nogil;
      const int64_t kp = rup(k, kKBlk);
      std::vector<uint16_t> buf(size_t(m * kp)), tiled(size_t(rup(m, 16) * kp)), pairs(size_t(m * kp));
      detail::round_bf16_rows_avx512(xc.data(), m, k, k, kp, buf.data(), 0, false);
      detail::round_bf16_rows_avx512(xc.data(), m, k, k, kp, tiled.data(), 0, true);
      detail::round_bf16_rows_avx512(xc.data(), m, k, k, kp, pairs.data(), 0, false, m);
      const int64_t ld = m;
      for (int64_t i = 0; i < m; ++i) {
        for (int64_t c = 0; c < kp; ++c) {  // the three layouts hold the same bits
          if (tiled[size_t((i / 16) * 16 * kp + (c / 32) * 512 + (i % 16) * 32 + c % 32)] != buf[size_t(i * kp + c)])
            throw std::logic_error("round_bf16: the A-tile layout differs from the rows");
          if (pairs[size_t((c / 2 * ld + i) * 2 + c % 2)] != buf[size_t(i * kp + c)])
            throw std::logic_error("round_bf16: the pairs layout differs from the rows");
        }
        std::memcpy(out.mutable_data() + i * k, buf.data() + i * kp, size_t(k) * 2);
      }
    }
    return out;
  }, py::arg("x"), "x (float32 [M, K]) rounded to bf16 bits as the avx512_bf16 / amx kernels see it");

  m.def("gemm_paths", [](const PackedWeight& w, int64_t mrows) {
    std::vector<std::string> r;
    for (int p = 0; p <= int(GemmPath::amx); ++p)
      if (gemm_supports(GemmPath(p), w, mrows)) r.push_back(gemm_path_name(GemmPath(p)));
    return r;
  }, py::arg("w"), py::arg("m"), "GEMM paths usable on this CPU for this weight and M");

  m.def("set_bf16_fma", &set_bf16_fma, py::arg("enabled"),
        "Let the avx512_bf16 path sum BF16 k pairs from BF16_FMA_ROWS rows with two FMAs under FTZ/DAZ "
        "(vdpbf16ps's arithmetic, default on Intel) instead of vdpbf16ps (default elsewhere); returns the "
        "previous setting");
  m.def("bf16_fma", &bf16_fma, "Whether the avx512_bf16 path uses FMAs (csrc/gemm.h)");
  m.attr("BF16_FMA_ROWS") = kBf16FmaRows;
  m.def("set_mx_vnni", &set_mx_vnni, py::arg("enabled"),
        "Let the avx512 path sum MXFP4 x Q8 products with vpdpbusd (and the draft copy's attention "
        "its INT4 K scores with vpdpwssd) where the CPU has AVX512-VNNI, and the avx2 path where it has "
        "AVX-VNNI (default; the same bits); returns the previous setting");
  m.def("mx_vnni", &mx_vnni, "Whether those sums use VNNI (available and enabled)");
  m.def("mx_avx_vnni", &mx_avx_vnni,
        "Whether the avx2 path sums MXFP4 x Q8 products with AVX-VNNI from AVX_VNNI_ROWS rows (available and "
        "enabled; set_mx_vnni switches it too)");
  m.attr("AVX_VNNI_ROWS") = kAvxVnniRows;
  m.def("set_mx_row_blocks", &set_mx_row_blocks, py::arg("n"),
        "Row blocks the VNNI MXFP4 kernel streams at once: 1, 2 or 4 at every M, or 0 for the choice "
        "by CPU (csrc/gemm.h; the same bits either way); returns the previous setting");
  m.def("mx_row_blocks", &mx_row_blocks, py::arg("rows"),
        "Row blocks the VNNI MXFP4 kernel streams for a tile of that many rows");
  m.def("set_mx_tiles", &set_mx_tiles, py::arg("enabled"),
        "MXFP4 at the amx level: the amx path (int8 tiles / vpdpbusd) at every M (True) or the avx512 "
        "path (False, default unless QSPEC_MX_PATH=amx); returns the previous setting");
  m.def("mx_tiles", &mx_tiles, "Whether MXFP4 takes the amx path at the amx level (csrc/gemm.h)");

  m.def("gemm_choose", [](const PackedWeight& w, int64_t mrows) {
    return std::string(gemm_path_name(gemm_choose(w, mrows)));
  }, py::arg("w"), py::arg("m"), "The path the dispatcher takes for this weight and M");
}

}  // namespace qspec
