// GEMM y[M,N] = x[M,K] · W[N,K]^T with weights packed once at load (BF16 or MX).
//
// Contract every path keeps (docs/architecture.md invariant 2, batch invariance): y[i, n] is computed
// with the same instructions in the same order whatever M is and whatever the other rows of
// x hold, and whatever the thread count (threads split N only; K is never split).
//
// Packed layouts (kPackLayoutVersion 2). N is padded to a multiple of 16 (one row block),
// K to a multiple of 32 (one MX block); padding holds zero weights.
//   bf16          "data"   [N/16][K/2][16 rows][2 k] bf16   (VNNI pairs: AVX512-BF16 / AMX B tile)
//   mxfp4         "data"   [N/16][K/4][32 bytes]: one 16-row x 4-k slab as nibbles; byte j<16
//                          holds rows 0-3 (low nibble) / rows 8-11 (high nibble), byte 16+j rows
//                          4-7 / 12-15, element (row r, k c) at j = (r%4)*4 + c
//                 "scales" [N/16][K/32][16 rows] E8M0
//   mxfp6_e2m3    "data"   [N/16][K/32][4 slab pairs][96 bytes], 6 bits/weight: per pair the
//                          nibbles (code bits 0-3) of two 16-row x 4-k slabs in the mxfp4 slab
//                          layout, then a 32-byte plane of code bits 4 (e1) and 5 (sign), bit
//                          order in gemm_internal.h (kQ6); "scales" as mxfp4
//   other MX      "data"   [N/16][K][16 rows], one byte per code (E3M2: 8 bits/weight),
//                          sign moved to bit 7 (FP6); "scales" as mxfp4. An E4M3 NaN code
//                          makes its block scale NaN at pack time (same result: y is NaN).
//
// Arithmetic (what every path computes; `ref` spells it out in scalar code):
//   bf16          y = fma chain over k ascending (x fp32, +0 start). avx2 / avx512 / ref are
//                 bit-identical. avx512_bf16 rounds x to bf16 (RNE) and uses vdpbf16ps over k
//                 pairs (or its arithmetic with FMAs, bf16_fma() below); amx rounds x alike
//                 and accumulates each y in an fp32 C tile (zeroed) with one tdpbf16ps per
//                 32 k, k ascending, over all of K: both agree with ref only to a tolerance.
//
// Paths per ISA level (gemm_choose). The amx level serves BF16 weights with tiles at every M
// (decode, verify and prefill: each C row comes from its own x row only, so a row's bits do not
// depend on M); MXFP4 takes the avx512 path at every M, or the amx path (int8 weights folded per
// output, below) at every M after set_mx_tiles(true) or with QSPEC_MX_PATH=amx; the other MX
// formats keep the avx512 paths. Below the amx level every M takes that level's path for the
// format (BF16: avx512_bf16, avx512 or avx2).
//   mxfp4         x quantized per 32-block to int8 (Q8: d = max|x|/127, q = rne(x/d)); per block
//                 the exact integer dot sum(2*e2m1 * q) then y = fma(float(isum), e8m0*d/2, y).
//                 ref, avx2 and avx512 are bit-identical (vpmaddubsw or, with VNNI, vpdpbusd).
//                 amx: weights as int8 e2m1 * 2^(4 - d) relative to each output's largest block
//                 scale (exact for d <= 3, rounded for d = 4-6, dropped below), x in two int8
//                 parts per row (14 bits of the row's range), exact int32 sums over all of K
//                 (TDPBSSD tiles from 3 rows, vpdpbusd below: the same integers), then
//                 y = ((128 C_hi + C_lo) * rowf) * 2^(S - 131) (gemm_q4_amx.cpp): a draft path,
//                 not ref's bits (invariant 2 exempts drafts), but a row's bits never depend on M.
//   mxfp6_e2m3    as mxfp4 (same Q8 activations) with the exact integer dot sum(8*e2m3 * q),
//                 then y = fma(float(isum), e8m0 * (d/2 * 0.25), y). Bit-identical to ref.
//   E3M2/FP8/INT8 per block b = fma chain over the 32 k (element decoded exactly, shifted by
//                 a power of two f), then y = fma(b*f, e8m0, y). Every path bit-identical to ref.
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "aligned.h"
#include "cpu.h"
#include "mx.h"

namespace qspec {

// Packed weights: layout private to the kernels, described by named byte buffers so that
// `qspec quantize` can store them and a later load can borrow them zero-copy (mmap).
struct PackedWeight {
  WFormat fmt = WFormat::bf16;
  int64_t n = 0, k = 0;  // logical shape [N, K]
  // Named buffers of the packed layout (e.g. "data", "scales"). Either owned (storage, each
  // starting on a 64-byte line: aligned.h; a first load runs on these until the weight cache has
  // the model) or borrowed from memory that outlives this object (keepalive holds the owner).
  std::map<std::string, std::pair<const uint8_t*, size_t>> buffers;
  std::vector<LineVector<uint8_t>> storage;
  std::shared_ptr<void> keepalive;

  const uint8_t* buf(const std::string& name) const;
  size_t nbytes() const;  // bytes a full pass streams (weights + scales)
  int64_t n_padded() const { return (n + 15) / 16 * 16; }
  int64_t k_padded() const { return (k + 31) / 32 * 32; }
};

// Names and byte sizes of the buffers of a packed weight of this format and shape.
std::vector<std::pair<std::string, size_t>> packed_buffer_sizes(WFormat fmt, int64_t n, int64_t k);
// Borrow buffers (zero copy); sizes are checked against packed_buffer_sizes. keepalive owns them.
std::shared_ptr<PackedWeight> packed_from_buffers(
    WFormat fmt, int64_t n, int64_t k, const std::map<std::string, std::pair<const uint8_t*, size_t>>& bufs,
    std::shared_ptr<void> keepalive);

constexpr int kPackLayoutVersion = 2;  // bump when any packed layout changes

std::shared_ptr<PackedWeight> pack_bf16(const uint16_t* w, int64_t n, int64_t k);
// codes: one code per byte [n, kpad], kpad = ceil(k/32)*32; scales: E8M0 [n, kpad/32].
std::shared_ptr<PackedWeight> pack_mx(WFormat fmt, const uint8_t* codes, const uint8_t* scales,
                                      int64_t n, int64_t k);

// Paths in ISA order; "ref" is the scalar oracle and the fallback for every shape.
enum class GemmPath : int { ref = 0, avx2 = 1, avx512 = 2, avx512_bf16 = 3, amx = 4 };
const char* gemm_path_name(GemmPath p);
GemmPath gemm_path_from_name(const std::string& name);  // throws std::invalid_argument
bool gemm_supports(GemmPath p, const PackedWeight& w, int64_t m);
// The path the dispatcher takes for this weight and M at the selected ISA level.
GemmPath gemm_choose(const PackedWeight& w, int64_t m);
// MXFP4 at the amx level: the avx512 path (default) or the amx path (set_mx_tiles(true), or
// QSPEC_MX_PATH=amx at start), the same for every M either way, so a draft row's bits never depend
// on how many rows (or sequences) share its pass: seeded sampling stays reproducible under any
// server load. Measured on a 2-core Sapphire Rapids VM (`qspec bench kernels`, Qwen2.5-Coder-1.5B
// shapes, 2 threads, whole model, in one-row VNNI passes): amx 1.0 at one row, 1.2 at 2, 1.3 at
// 4, 1.4 at 8, 1.6 at 16; the avx512 path (VNNI) 1.0 / 1.05 / 1.2 / 1.8 / 3.4. End to end the
// default chains and trees (frontiers of 2-3 rows) ran 2-20% faster on VNNI there, so VNNI stays
// the default; the amx path is for wide passes (wide trees, level-2 checks). Returns the previous
// setting.
bool set_mx_tiles(bool enabled);
bool mx_tiles();

// The avx512 path sums MXFP4 x Q8 products with vpdpbusd when the CPU has AVX512-VNNI (same bits
// as vpmaddubsw), and the draft copy's attention its INT4 K scores with vpdpwssd (attention_q8_impl.h);
// the avx2 path its MXFP4 sums with AVX-VNNI's vpdpbusd on ymm where the CPU has that (CPUs with
// AVX2 and no AVX-512: Sierra Forest Xeons, Alder Lake and later cores; gemm_q4_avxvnni.cpp).
// The avx2 path takes AVX-VNNI from kAvxVnniRows rows: below, VNNI measured no faster (the
// same bits either way). set_mx_vnni(false) forces vpmaddubsw on both (tests, A/B benchmarks);
// returns the previous setting. mx_vnni(): the avx512 path's VNNI is available and enabled;
// mx_avx_vnni(): the avx2 path's.
bool set_mx_vnni(bool enabled);
bool mx_vnni();
bool mx_avx_vnni();
constexpr int64_t kAvxVnniRows = 3;

// The avx512_bf16 path's BF16 GEMM sums each k pair with vdpbf16ps, or from kBf16FmaRows rows
// with two FMAs under FTZ | DAZ, odd element first (gemm_bf16fma_avx512.cpp): vdpbf16ps's
// arithmetic as Intel's SDM defines it, checked bit for bit on Intel hardware, so a row keeps its
// bits whichever a call takes (batch invariance). Intel issues two 512-bit FMAs a cycle but one
// vdpbf16ps every other cycle (a model-167 Xeon: 430 against 216 GFLOP/s, 2 threads), so the FMAs
// are the default there: a 9-16-row verify and a prefill are compute-bound at that level. AMD
// (Zen 4 issues one of either a cycle, and does not document its vdpbf16ps rounding) and
// anything else keep vdpbf16ps at every M. QSPEC_BF16_DOT=fma | dpbf16 at start, or
// set_bf16_fma(), sets it for the process (tests, A/B runs). Returns the previous setting.
constexpr int64_t kBf16FmaRows = 7;
bool set_bf16_fma(bool enabled);
bool bf16_fma();

// Row blocks (16 outputs each) the VNNI MXFP4 kernel streams at once for a tile of `rows` rows.
// Each output keeps its own integer sums and per-block fma in k order, so the count never
// changes a bit; it is chosen per CPU by measurement (Qwen2.5-Coder-1.5B shapes, whole model, 2
// threads). Intel: 2 streams at every M (a Sapphire Rapids VM: 2 rather than 4 at M = 2 was 15%
// faster; an AMX Xeon of model 167: at M = 1 28.0-28.6 ms against 29.9-30.6 for 4 and 31-32 for
// one, and 9.5% less draft time per token end to end). AMD (a Zen 4 VM): one stream at every M,
// 4 at M = 1 took 1.2x as long (as long as the AVX2 kernel's one stream) and 2 at M = 8 1.1-1.4x.
// The AVX2 MXFP4 kernel follows the count at one row (2 streams when it is 2 or more).
// set_mx_row_blocks(n) forces n (1, 2 or 4) at every M, 0 restores the choice by CPU; returns the
// previous setting.
int set_mx_row_blocks(int n);
int mx_row_blocks(int rows);

// x: fp32 [m, ldx]; y: fp32 [m, ldy].
void gemm(const PackedWeight& w, const float* x, int64_t m, int64_t ldx, float* y, int64_t ldy);
void gemm_path(GemmPath p, const PackedWeight& w, const float* x, int64_t m, int64_t ldx, float* y,
               int64_t ldy);

// A prefill's MLP on AMX tiles without its FP32 gate|up output: gemm_swiglu computes the gate|up
// projection (gate rows [0, n/2), up rows [n/2, n)) of m rows and writes act = silu(gate) * up,
// rounded to bf16, into act ([rup(m, 16)][n / 2] bf16 in the amx kernel's A-tile order: 16 rows x
// 32 columns a contiguous 1 KB tile); gemm_act_tiles runs the down projection from it. Every
// element is the unfused sequence's: the same C tile chains (gemm_amx.cpp), silu_mul_avx2's
// arithmetic lane for lane and the rounding gemm applies to x, so a prefill row keeps the bits
// of a decode row. Usable when gemm_swiglu_supported (BF16 weights, amx chosen, more than
// kAmxPrefillRows rows, n / 2 = down.k a multiple of 32); std::invalid_argument otherwise.
bool gemm_swiglu_supported(const PackedWeight& gate_up, const PackedWeight& down, int64_t m);
void gemm_swiglu(const PackedWeight& gate_up, const float* x, int64_t m, int64_t ldx, uint16_t* act);
void gemm_act_tiles(const PackedWeight& w, const uint16_t* act, int64_t m, float* y, int64_t ldy);

}  // namespace qspec
