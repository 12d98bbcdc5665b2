// GEMM y[M,N] = x[M,K] · W[N,K]^T with weights packed once at load (BF16 or MX).
//
// Contract every path keeps (DESIGN.md invariant 2, batch invariance): y[i, n] is computed
// with the same instructions in the same order whatever M is and whatever the other rows of
// x hold, and whatever the thread count (threads split N only; K is never split).
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cpu.h"
#include "mx.h"

namespace qspec {

// Packed weights: layout private to the kernels, described by named byte buffers so that
// `qspec quantize` can store them and a later load can borrow them zero-copy (mmap).
struct PackedWeight {
  WFormat fmt = WFormat::bf16;
  int64_t n = 0, k = 0;  // logical shape [N, K]
  // Named buffers of the packed layout (e.g. "data", "scales"). Either owned (storage)
  // or borrowed from memory that outlives this object (keepalive holds the owner).
  std::map<std::string, std::pair<const uint8_t*, size_t>> buffers;
  std::vector<std::vector<uint8_t>> storage;
  std::shared_ptr<void> keepalive;

  const uint8_t* buf(const std::string& name) const;
  size_t nbytes() const;  // bytes a full pass streams (weights + scales)
};

constexpr int kPackLayoutVersion = 1;  // bump when any packed layout changes

std::shared_ptr<PackedWeight> pack_bf16(const uint16_t* w, int64_t n, int64_t k);
// codes: one code per byte [n, kpad], kpad = ceil(k/32)*32; scales: E8M0 [n, kpad/32].
std::shared_ptr<PackedWeight> pack_mx(WFormat fmt, const uint8_t* codes, const uint8_t* scales,
                                      int64_t n, int64_t k);

// Paths in ISA order; "ref" is the scalar oracle and the fallback for every shape.
enum class GemmPath : int { ref = 0, avx2 = 1, avx512 = 2, avx512_bf16 = 3, amx = 4 };
const char* gemm_path_name(GemmPath p);
bool gemm_supports(GemmPath p, const PackedWeight& w, int64_t m);
// The path the dispatcher takes for this weight and M at the selected ISA level.
GemmPath gemm_choose(const PackedWeight& w, int64_t m);

// x: fp32 [m, ldx]; y: fp32 [m, ldy].
void gemm(const PackedWeight& w, const float* x, int64_t m, int64_t ldx, float* y, int64_t ldy);
void gemm_path(GemmPath p, const PackedWeight& w, const float* x, int64_t m, int64_t ldx, float* y,
               int64_t ldy);

}  // namespace qspec
