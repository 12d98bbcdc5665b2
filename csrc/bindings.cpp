// The one place where Python meets the native code: module definition, CPU probe, threads.
// Each subsystem registers its own functions (bind_mx, bind_gemm, bind_model).
#include <omp.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings.h"
#include "cpu.h"
#include "pool.h"

namespace py = pybind11;

namespace qspec {
namespace {

py::dict cpu_info_dict() {
  const CpuFeatures& f = cpu_features();
  py::dict features;
  features["avx2"] = f.avx2;
  features["fma"] = f.fma;
  features["f16c"] = f.f16c;
  features["avx512f"] = f.avx512f;
  features["avx512bw"] = f.avx512bw;
  features["avx512vl"] = f.avx512vl;
  features["avx512dq"] = f.avx512dq;
  features["avx512_bf16"] = f.avx512_bf16;
  features["avx512_fp16"] = f.avx512_fp16;
  features["avx512_vnni"] = f.avx512_vnni;
  features["avx_vnni"] = f.avx_vnni;
  features["amx_tile"] = f.amx_tile;
  features["avx512_vbmi"] = f.avx512_vbmi;
  features["amx_bf16"] = f.amx_bf16;
  features["amx_int8"] = f.amx_int8;
  py::dict os;
  os["avx"] = f.os_avx;
  os["avx512"] = f.os_avx512;
  os["amx"] = f.os_amx;
  os["amx_permitted"] = f.amx_permitted;
  py::list levels;
  for (int i = 0; i <= int(isa_detected()); ++i) levels.append(isa_name(Isa(i)));
  py::dict d;
  d["vendor"] = f.vendor;
  d["model"] = f.model;
  d["features"] = features;
  d["os_enabled"] = os;
  d["isa_detected"] = isa_name(isa_detected());
  d["isa_selected"] = isa_name(isa_selected());
  d["isa_levels"] = levels;
  d["threads"] = Pool::instance().threads();
#ifdef QSPEC_ISA_EMULATION
  d["isa_emulation"] = true;  // a test build: avx512/amx levels are emulated, not this CPU's
#else
  d["isa_emulation"] = false;
#endif
  return d;
}

}  // namespace
}  // namespace qspec

PYBIND11_MODULE(_C, m) {
  using namespace qspec;
  m.doc() = "qspec native kernels (no libtorch): CPU probe, MX codecs, GEMM, model forward";
  m.def("cpu_info", &cpu_info_dict, "CPU vendor/model, features, OS enablement, ISA levels, threads");
  m.def("isa_selected", [] { return std::string(isa_name(isa_selected())); });
  m.def("isa_detected", [] { return std::string(isa_name(isa_detected())); });
  m.def("set_isa_limit", [](const std::string& name) {
    return std::string(isa_name(set_isa_limit(isa_from_name(name))));
  }, py::arg("name"), "Lower the ISA level used from now on (never raises it past detection)");
  m.def("set_num_threads", [](int n) {
    if (n < 1) throw std::invalid_argument("threads must be >= 1");
    Pool::instance().set_threads(n);  // the forward pass
    omp_set_num_threads(n);           // packing, casting, the bandwidth probe
  }, py::arg("n"));
  m.def("get_num_threads", [] { return Pool::instance().threads(); });
  bind_mx(m);
  bind_gemm(m);
  bind_attention(m);
  bind_kv_q8(m);
  bind_model(m);
  bind_membw(m);
  bind_peak(m);
  bind_shm_group(m);
}
