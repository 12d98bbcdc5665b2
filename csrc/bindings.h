// Registration hooks: each subsystem's .cpp defines its own bind_* function.
#pragma once
#include <pybind11/pybind11.h>

namespace qspec {
struct KvCacheView;

// Points kv (its BF16 fields already set) at a draft copy given as (K values, V values, scales)
// (KvCacheView::q8k) after checking dtypes, layout and shapes; std::invalid_argument naming `who`
// otherwise. kv_q8.cpp.
void kv_set_copy(KvCacheView& kv, const pybind11::tuple& copy, const char* who);

void bind_mx(pybind11::module_& m);     // mx.cpp
void bind_gemm(pybind11::module_& m);   // gemm_bindings.cpp
void bind_attention(pybind11::module_& m);  // attention.cpp
void bind_kv_q8(pybind11::module_& m);  // kv_q8.cpp (the draft copy of the KV cache)
void bind_model(pybind11::module_& m);  // model.cpp
void bind_membw(pybind11::module_& m);  // membw.cpp (read-bandwidth probe for bench/)
void bind_peak(pybind11::module_& m);   // peak.cpp (compute-peak probe for bench/)
void bind_shm_group(pybind11::module_& m);  // shm_group.cpp (tensor-parallel ranks on one host)
}  // namespace qspec
