// Row-wise ops of the native forward with ISA-specific versions (csrc/x86/model_<isa>.cpp).
#pragma once
#include <cstdint>

namespace qspec {

// out[i] = gate[i] / (1 + exp(-gate[i])) * up[i]
void silu_mul_ref(const float* gate, const float* up, float* out, int64_t n);
void silu_mul_avx2(const float* gate, const float* up, float* out, int64_t n);
// By isa_selected(): the same function for every row and batch size.
void silu_mul(const float* gate, const float* up, float* out, int64_t n);
// out[i] = gelu_tanh(gate[i]) * up[i] (Gemma's GeGLU), scalar on every level.
void gelu_tanh_mul(const float* gate, const float* up, float* out, int64_t n);

}  // namespace qspec
