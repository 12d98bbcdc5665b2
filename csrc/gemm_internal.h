// Shared between csrc/gemm.cpp (driver, packing, ref) and the ISA files csrc/x86/gemm_*.cpp.
// Plain data and declarations only: an inline function here would be compiled with AVX-512
// flags in gemm_avx512.cpp and could be the copy the linker keeps for baseline callers.
#pragma once
#include <cstddef>
#include <cstdint>

namespace qspec {

int mx_row_blocks(int rows);  // gemm.h: row blocks of the MXFP4 kernels (VNNI; AVX2 at one row), per CPU

namespace detail {

constexpr int kRows = 16;   // output rows per packed block
constexpr int kKBlk = 32;   // MX block (and K padding)
inline int64_t rup(int64_t a, int64_t b) { return (a + b - 1) / b * b; }  // a rounded up to a multiple of b
constexpr int kAccCols = 64;  // per-row accumulator scratch: up to 4 row blocks at once

// Element decode families (how one packed code becomes a float).
enum Kind : int {
  kBf16 = 0,    // bf16 VNNI pairs
  kQ4 = 1,      // MXFP4 nibbles, int8 activations (Q8)
  kF16Shl = 2,  // byte << 8 is an fp16 of the value * 2^(bias-15)   (E5M2, E3M2)
  kF16Sra = 3,  // (byte << 8) >>arith 1, bit 14 cleared: fp16 too   (E4M3, E2M3)
  kI8 = 4,      // int8 code                                          (MXINT8)
  kQ6 = 5,      // MXFP6 E2M3 at 6 bits (nibble slabs + 2-bit planes), int8 activations (Q8)
};

// kQ6 layout: per row block and MX block, 4 slab pairs of 96 bytes (kQ6PairBytes): the
// nibbles of slab 2p (32 bytes, the MXFP4 slab layout), of slab 2p+1, then a 32-byte plane
// whose byte j holds, for lane j of the four nibble vectors (slab parity sp, half h,
// t = 2*sp + h), bit 7-t = e1 (code bit 4) and bit 3-t = sign (code bit 5).
constexpr int kQ6PairBytes = 96;
constexpr int kQ6BlockBytes = 4 * kQ6PairBytes;  // 16 rows x 32 k x 6 bits

// One GEMM call as the kernels see it. Activations are already prepared by the driver:
// fp32 rows zero-padded to kp (x, ldx), or for kQ4 the Q8 rows (xq [m][kp], xd/xc [m][kp/32]).
struct GemmArgs {
  int kind = kBf16;
  int64_t n = 0, k = 0, np = 0, kp = 0;
  const uint8_t* data = nullptr;
  const uint8_t* scales = nullptr;
  float elem_factor = 1.f;  // f: element value = decoded * f (power of two)
  int64_t m = 0;
  const float* x = nullptr;
  int64_t ldx = 0;
  const int8_t* xq = nullptr;   // Q8 codes
  const float* xd = nullptr;    // Q8 scale * 0.5 (E2M1 codes are held doubled; kQ6: * elem_factor)
  const int32_t* xc = nullptr;  // 12 * sum(q): the LUT adds 12 so codes are unsigned
  const uint16_t* xbf = nullptr;  // x rounded to bf16, [mpad][kp] (avx512_bf16 / amx)
  int64_t mpad = 0;               // rows of xbf: M, or for amx M > 1 rounded up to 16 (zero rows)
  bool xbf_tiles = false;         // amx prefill: xbf in the A-tile order (round_bf16_rows_avx512)
  // avx512_bf16, 9 to kPrefillRows rows: xbf as k pairs interleaved over rows, pair (row r, k / 2)
  // the int32 at xbf + 2 * (k / 2 * xbf_ld + r) (xbf_ld = M), so a tile's rows are broadcast from
  // one pointer at constant offsets (gemm_avx512.cpp); 0: [mpad][kp].
  int64_t xbf_ld = 0;
  // avx512_bf16 with bf16_fma() from kBf16FmaRows rows (gemm.h): x rounded to bf16 as fp32 values
  // in groups of xf_group rows, each row's k pairs interleaved (gemm_bf16fma_avx512.cpp); nullptr:
  // the vdpbf16ps kernels.
  const float* xf = nullptr;
  int64_t xf_group = 0;
  const int8_t* xi8 = nullptr;    // amx MXFP4: x in two int8 parts, [2][m][kq] (hi rows, then lo rows)
  const float* xrow = nullptr;    // amx MXFP4: per row, 1 / (128 * 127 / max|x|) (NaN: a non-finite x)
  const int32_t* xsum = nullptr;  // amx MXFP4: per part and row, the sum of its int8 codes, [2][m]
  int64_t kq = 0;                 // amx MXFP4: kp rounded up to 64 (one TDPBSSD's k), zero-filled
  float* y = nullptr;
  int64_t ldy = 0;
  // amx prefill of a gate|up projection with SwiGLU (gemm_swiglu): instead of y, the row blocks
  // nb < n / 32 (gate) and nb + n / 32 (up) give act = silu(gate) * up rounded to bf16, written
  // in the A-tile order of the down projection's x ([mpad rows][act_kp], act_kp = n / 2).
  uint16_t* act = nullptr;
  int64_t act_kp = 0;
  int64_t prefetch = 0;  // software prefetch distance in bytes of a row block's stream (0: default)
};

// Where to prefetch `ahead` bytes past offset `off` of one row block's packed stream (`block`,
// block_bytes long): inside the block, or past its end the same distance into the block
// group_bytes further on — the same stream of the next group of row blocks, which a thread reads
// next (its row blocks are consecutive). Prefetching only inside the block left every group's
// streams but one to start cold. Sapphire Rapids VM, MXFP4 VNNI pass over the 1.5B's gate|up
// shape (K = 1,536: 12 KB blocks, groups of 2-4) at 1-4 rows: 12% faster with the weights in
// the (VM's 480 MB) last-level cache, level when they stream from DRAM (`qspec bench kernels
// --shapes 17920x1536`, alternating builds), where the hardware prefetchers keep up.
inline const char* stream_ahead(const void* block, int64_t off, int64_t ahead, int64_t block_bytes,
                                int64_t group_bytes) {
  const int64_t t = off + ahead;
  return static_cast<const char*>(block) + (t < block_bytes ? t : group_bytes + t - block_bytes);
}

// Prefill (M > kPrefillRows rows): the x86 drivers run rows in balanced chunks of at most
// kMChunk, with K chunks sized so a chunk's x and a group's weights stay in L2 (kL2Bytes): a
// row's sums are the same in any chunk. Zen 3 AVX2, 2 threads, BF16 [2048 x 1536] x [17920 x
// 1536]^T: 77 -> 126 GFLOP/s (chunks of 48 and 96 rows within 3%, 192 5% lower; budgets of
// 192-384 KB equal).
constexpr int64_t kPrefillRows = 24;
constexpr int64_t kMChunk = 48;
constexpr int64_t kL2Bytes = 262144;
// Per-thread scratch (floats) of the amx BF16 kernel's prefill (gemm_amx.cpp): partial sums of a
// chunk of 256 rows x 16 row blocks between its K chunks.
constexpr int64_t kAmxPrefillScratch = 256 * 16 * kRows;
// The amx BF16 kernel's prefill (blocked, x in the A-tile order) from more than this many rows.
constexpr int64_t kAmxPrefillRows = 64;

// Rows [m0, m0 + m) of a call as a call of their own (every activation pointer and y moved).
GemmArgs rows_of(const GemmArgs& a, int64_t m0, int64_t m);

// Kernels: compute y rows 0..m-1, columns of row blocks [nb0, nb1). acc: m * kAccCols floats
// of per-thread scratch. Never throw (they run on the pool's threads, csrc/pool.h).
void gemm_blocks_ref(const GemmArgs& a, int64_t nb0, int64_t nb1, float* acc);
void gemm_blocks_avx2(const GemmArgs& a, int64_t nb0, int64_t nb1, float* acc);
void gemm_blocks_avx512(const GemmArgs& a, int64_t nb0, int64_t nb1, float* acc);
void gemm_blocks_mx_avx512(const GemmArgs& a, int64_t nb0, int64_t nb1, float* acc);  // kQ6, byte codes
void gemm_blocks_avx512_bf16(const GemmArgs& a, int64_t nb0, int64_t nb1, float* acc);
void gemm_blocks_bf16_fma(const GemmArgs& a, int64_t nb0, int64_t nb1, float* acc);  // avx512_bf16, bf16_fma()
void gemm_blocks_amx(const GemmArgs& a, int64_t nb0, int64_t nb1, float* acc);
void gemm_blocks_amx_swiglu(const GemmArgs& a, int64_t nb0, int64_t nb1, float* acc);  // gate blocks [nb0, nb1)
void gemm_blocks_q4_vnni(const GemmArgs& a, int64_t nb0, int64_t nb1, float* acc);  // kQ4, AVX512-VNNI
void gemm_blocks_q4_avxvnni(const GemmArgs& a, int64_t nb0, int64_t nb1, float* acc);  // kQ4, AVX-VNNI (avx2 path)
void gemm_blocks_q4_amx(const GemmArgs& a, int64_t nb0, int64_t nb1, float* acc);   // kQ4, AMX-INT8 tiles / VNNI
// x rows -> xi8 / xrow of the amx MXFP4 kernel (gemm_q4_amx.cpp)
void quantize_x_i8x2(const float* x, int64_t m, int64_t ldx, int64_t k, int64_t kq, int8_t* out, float* rowf,
                     int32_t* sums);

// x rows -> bf16 (zero-filled from k to kp), fp32 rounded to nearest even, NaN kept NaN
// (quieted): the activations of the avx512_bf16 and amx BF16 kernels (tests/test_gemm.py checks
// it against numpy through _C.round_bf16). Row i of x is row row0 + i of out: [mpad][kp], or
// with tiles the AMX A-tile order [mpad / 16][kp / 32][16][32] (one 1 KB tile per 16 rows and 32 k),
// or with pairs_ld (the call's rows) the k pairs interleaved over rows (GemmArgs::xbf_ld).
void round_bf16_rows_avx512(const float* x, int64_t m, int64_t ldx, int64_t k, int64_t kp, uint16_t* out,
                            int64_t row0, bool tiles, int64_t pairs_ld = 0);

// x rows -> the fp32 pairs of gemm_blocks_bf16_fma (rounded as round_bf16_rows_avx512 rounds):
// row i of x is row row0 + i of out, in groups of `group` rows (row0 a multiple of 16).
void expand_bf16_pairs_avx512(const float* x, int64_t m, int64_t ldx, int64_t k, int64_t kp, int64_t group,
                              float* out, int64_t row0);
// Q8 activation quantization (per 32-block of a row); every implementation is bit-identical.
void quantize_q8_ref(const float* x, int64_t m, int64_t ldx, int64_t k, int64_t kp, int8_t* xq,
                     float* xd, int32_t* xc);
void quantize_q8_avx2(const float* x, int64_t m, int64_t ldx, int64_t k, int64_t kp, int8_t* xq,
                      float* xd, int32_t* xc);

}  // namespace detail
}  // namespace qspec
