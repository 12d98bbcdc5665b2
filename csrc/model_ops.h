// Row-wise ops of the native forward with ISA-specific versions (csrc/x86/model_<isa>.cpp).
#pragma once
#include <cstdint>

namespace qspec {

// out[i] = gate[i] / (1 + exp(-gate[i])) * up[i]
void silu_mul_ref(const float* gate, const float* up, float* out, int64_t n);
void silu_mul_avx2(const float* gate, const float* up, float* out, int64_t n);
void silu_mul_avx512(const float* gate, const float* up, float* out, int64_t n);  // avx2's bits
// By isa_selected(): the same function for every row and batch size.
void silu_mul(const float* gate, const float* up, float* out, int64_t n);
// out[i] = x[i] · (1 / sqrt(Σ x² / d + eps)) · w[i]; the avx2 version sums in 32 lanes.
void rms_norm_ref(const float* x, const float* w, float eps, int64_t d, float* out);
void rms_norm_avx2(const float* x, const float* w, float eps, int64_t d, float* out);
void rms_norm(const float* x, const float* w, float eps, int64_t d, float* out);  // by isa_selected()
// f32_to_bf16 of a row (the same bits on every path; round_bf16_rows_avx512 is the GEMMs' own,
// into their x layouts).
void round_bf16_row_ref(const float* x, uint16_t* out, int64_t n);
void round_bf16_row_avx2(const float* x, uint16_t* out, int64_t n);
void round_bf16_row(const float* x, uint16_t* out, int64_t n);
// out[i] = gelu_tanh(gate[i]) * up[i] (Gemma's GeGLU), scalar on every level.
void gelu_tanh_mul(const float* gate, const float* up, float* out, int64_t n);

}  // namespace qspec
