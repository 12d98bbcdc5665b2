// Registration hooks: each subsystem's .cpp defines its own bind_* function.
#pragma once
#include <pybind11/pybind11.h>

namespace qspec {
void bind_mx(pybind11::module_& m);     // mx.cpp
void bind_gemm(pybind11::module_& m);   // gemm_bindings.cpp
void bind_attention(pybind11::module_& m);  // attention.cpp
void bind_kv_q8(pybind11::module_& m);  // kv_q8.cpp (the INT8 draft copy of the KV cache)
void bind_model(pybind11::module_& m);  // model.cpp
void bind_membw(pybind11::module_& m);  // membw.cpp (read-bandwidth probe for bench/)
void bind_shm_group(pybind11::module_& m);  // shm_group.cpp (tensor-parallel ranks on one host)
}  // namespace qspec
