// AMX-BF16 GEMM for BF16 weights at every M: decode, verify and prefill (gemm_supports).
// x is rounded to bf16 by the driver into [mpad][kp]: mpad = M rounded up to 16 (zero rows), or
// 1 for M = 1, whose A tile reads that row 16 times (stride 0) instead of 15 zero rows that the
// driver would write on every decode step. Two or more row tiles (mpad > 16) get x in the A-tile
// order instead (xbf_tiles: each 16 rows x 32 k one contiguous 1 KB tile, no 4 KB-strided rows).
// The packed BF16 layout is already the B-tile layout: one row block and 32 k = 16 rows of
// 64 bytes (k pair x 16 columns), 1 KB contiguous.
//
// Every output element is one C-tile element: zeroed, then one TDPBF16PS per 32 k in k order
// over all of K in k order (prefill may park the C tile in memory between K chunks: the same FP32
// bits come back), from its own row of x and its row block of W. The SDM defines each
// C row from its own A row only, so neither the other rows of x nor how many tiles of rows a call
// has change a row's bits: M = 1..64 and prefill run the same arithmetic per row (batch
// invariant). Tiles always hold 16 rows (padding rows past M): one tile configuration for every
// call, and M = 1..16 issue the same instructions on the same weight bytes, so a 16-row verify
// should cost what one row does. Configuring exactly M rows would give the same bits
// (rows are independent) but would save only TMUL work, which is not the bound: one 1 KB B tile
// per 16-cycle TDPBF16PS is far more than a core's share of DRAM bandwidth.
//
// Decode/verify (mpad <= kAmxPrefillRows = 64) reads the weight stream from DRAM once for all M
// rows, with a software prefetch of each row block's stream: M <= 16 loads each B tile once per
// k step for 4 independent C tiles (4 row blocks at once, covering TDPBF16PS latency); M > 16
// takes pairs of row blocks through 2 x 2 tile steps, one 32-row half of x after the other
// (verify_pairs). Prefill (mpad > 64): 2 x 2 tiles per 32 rows, blocked for the caches
// (prefill_blocks).
// Tested against ref on a Sapphire Rapids VM and under emulation (tests/test_isa_emulation.py).
// There (Qwen2.5-Coder-1.5B shapes, 2 threads, `qspec bench kernels`): one row at ~80% of the
// read bandwidth, v(8) = 1.36 and v(16) = 1.53 one-row passes. Prefill, [2048 x 1536] x
// [17920 x 1536]^T: 0.6x torch's oneDNN BF16 GEMM in the same process with the whole M per row
// block pair (x re-read from L3 for every 32 outputs, rows 4 KB apart), 0.8-0.9x blocked with
// x in tile order (1.1-1.2 TFLOP/s of the ~4 TFLOP/s peak; the down projection, K = 8960,
// ~0.5x: its fp32 -> bf16 rounding of x is ~18% of the call, a cost torch's bf16 input skips).
// Tried there, no faster: software prefetch of the next A tiles, K chunks of 512 (B of a pair
// of row blocks kept in L1), 32 or 64 row blocks per piece.
//
// gemm_swiglu (gemm.h): a prefill's gate|up projection pairs each gate row block nb with its up
// block nb + n / 32 as the two B tiles of a step, so one step's C tiles hold the gate and up
// sums of the same 16 rows x 16 columns; the epilogue (swiglu_rows) turns them into silu(gate)
// * up with silu_mul_avx2's arithmetic, rounded to bf16 as the driver rounds x, straight into
// the down projection's A-tile order. Nothing else changes (each C element's TDPBF16PS chain is
// the same), so the bits are those of the unfused sequence (tests/test_gemm.py). On a model-167
// AMX Xeon (2 threads, Qwen2.5-Coder-1.5B, 2,048-token prompt, in-process profile): gate|up
// 1.96 -> 1.41 s, down 1.05 -> 0.89 s, the row-wise ops 0.6 -> 0.29 s over the 28 layers; the
// FP32 gate|up rows (147 MB a layer) are never written. Tried on the same machine, no faster
// (env-switched builds, `[2048 x 1536] x [17920 x 1536]^T` and `[2048 x 8960] x [1536 x 8960]^T`):
// K chunks of 256-768 with 512-1,024-row chunks, 8-64 row blocks a piece, non-temporal y stores,
// a software prefetch of the next B pair into L2 or L1 (1.0-1.3 TFLOP/s against 1.14-1.27;
// K chunks of 512 and 1,024-row chunks 10-20% slower).
//
// What bounds the prefill loop (a model-167 AMX Xeon with 2 MB of L2 a core, one thread, standalone
// C++ loops with this file's tile steps; throwaway, not in the repository): TDPBF16PS alone runs
// at ~3.1 TFLOP/s; 2 x 2 steps over endless streams reach ~2.9 with one operand in L1 and the other
// in L2, ~2.3 with both in L2, ~0.9 from L3. Zeroing and storing the C tiles every 48 k steps (a
// tile step over K = 1,536: the tiles are not renamed, so the next step waits for the stores)
// costs ~20%, and restarting the four streams every tile step another ~20%: this loop's shape
// measures 1.2-1.35 TFLOP/s with C kept in scratch, ~1.05 storing fp32 y, the same as the driver
// reaches. No reordering got past that: K chunks of 256-512 with C partials (B of a pair in L1),
// an A layout contiguous per K chunk, 512-1,024-row chunks, prefetching the next tile step's A and
// B into L1 (or the next pair's B into L1 / L2), loads issued one step ahead of their products —
// 0.9-1.4 TFLOP/s in every combination. The driver's buffers must start on a cache line
// (csrc/aligned.h): 16-byte aligned rows (glibc's malloc) made these calls ~1.4x slower.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "amx_tiles.h"
#include "gemm_internal.h"
#include "vec_avx512.h"

namespace qspec {
namespace detail {
namespace {

constexpr int64_t kTileBytes = 1024;         // one B tile: 16 k pairs x 16 rows x 2 bf16
constexpr int64_t kDefaultPrefetch = 2 * kTileBytes;  // bytes ahead in each row block's stream
// Prefill blocking (prefill_blocks); kChunkRows * kSubBlocks * kRows = kAmxPrefillScratch.
constexpr int64_t kChunkRows = 256;
constexpr int64_t kSubBlocks = 16;
constexpr int64_t kChunkK = 2048;
static_assert(kChunkRows * kSubBlocks * kRows == kAmxPrefillScratch, "scratch of prefill_blocks");

using amx::tile_dpbf16;
using amx::tile_load;
using amx::tile_store;
using amx::tile_zero;
using amx::unrolled;

inline void store_tile_rows(const GemmArgs& a, const float* c, int64_t m0, int64_t n0) {
  const int64_t cols = a.n - n0 < 16 ? a.n - n0 : 16;
  for (int64_t r = 0; r < 16 && m0 + r < a.m; ++r)
    std::memcpy(a.y + (m0 + r) * a.ldy + n0, c + r * 16, size_t(cols) * 4);
}

// 16 rows (from row m0) x 16 columns (from col) of act = silu(g) * u (silu_mul_avx2's arithmetic),
// rounded to bf16 as round_bf16_rows_avx512 rounds the down projection's x, in its A-tile order.
inline void swiglu_rows(const float* g, const float* u, uint16_t* act, int64_t act_kp, int64_t m0, int64_t col) {
  const __m512 one = _mm512_set1_ps(1.0f), neg = _mm512_set1_ps(-0.0f);
  const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF), inf = _mm512_set1_epi32(0x7F800000);
  const __m512i quiet = _mm512_set1_epi32(0x00400000), bias = _mm512_set1_epi32(0x7FFF), lsb = _mm512_set1_epi32(1);
  uint16_t* dst = act + (m0 / 16) * 16 * act_kp + (col / 32) * 512 + col % 32;  // m0: a multiple of 16
  for (int r = 0; r < 16; ++r) {
    const __m512 gv = _mm512_load_ps(g + r * 16);
    const __m512 sv = _mm512_div_ps(gv, _mm512_add_ps(one, avx512::exp(_mm512_xor_ps(gv, neg))));
    const __m512i w = _mm512_castps_si512(_mm512_mul_ps(sv, _mm512_load_ps(u + r * 16)));
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(w, abs_mask), inf);
    __m512i v = _mm512_add_epi32(_mm512_add_epi32(w, bias), _mm512_and_si512(_mm512_srli_epi32(w, 16), lsb));
    v = _mm512_mask_or_epi32(v, nan, w, quiet);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + r * 32), _mm512_cvtepi32_epi16(_mm512_srli_epi32(v, 16)));
  }
}

// Where a tile_step's C tiles start and end: zero and y (in = out = nullptr), or 16 x 16 fp32
// tiles of partial sums (a prefill chunk's, between its K chunks): tile (i, j) at
// in / out + i * row_stride + j * 256 floats. A tile stored and loaded again holds the same FP32
// bits, so splitting K into chunks keeps every C element's sequence of TDPBF16PS.
struct CTiles {
  const float* in = nullptr;
  float* out = nullptr;
  int64_t row_stride = 0;
};

// MT row tiles of x (16 rows each, from row m0) x NBB row blocks of W (from nb), over k in
// [k0, k1) (multiples of 32). C tile of (row tile i, block j): i * NBB + j; A of row tile i:
// 4 + i % 2; B of block j: 6 + j % 2. Row tile i loads its A tile first, row tile 0 loads each
// B tile: with MT * NBB <= 4 a tile is reloaded only after the products that read it (MT >= 2
// means NBB <= 2). prefetch: bytes ahead in each block's B stream (0: none).
template <int MT, int NBB>
void tile_step(const GemmArgs& a, int64_t nb, int64_t m0, int64_t k0, int64_t k1, int64_t prefetch,
               const CTiles& ct = {}, int64_t jblocks = 1) {
  static_assert(MT >= 1 && NBB >= 1 && MT * NBB <= 4, "4 C tiles");
  const int64_t xstride = a.kp * 2;      // bytes per row of x
  // M = 1: row 0 in every row of the A tile; prefill: 1 KB A tiles (xbf_tiles), k step after k step
  const int64_t astride = a.xbf_tiles ? 64 : a.mpad == 1 ? 0 : xstride;
  const int64_t akstep = a.xbf_tiles ? 32 : 2;  // bytes of a row tile's x per k
  const int64_t bstride = a.kp * 32;     // bytes per row block of W: kp/2 pairs x 64 bytes
  const uint8_t* xa = reinterpret_cast<const uint8_t*>(a.xbf) + m0 * xstride;
  const uint8_t* wb = a.data + nb * bstride;
  unrolled<MT>([&](auto i) {
    unrolled<NBB>([&](auto j) {
      constexpr int I = decltype(i)::value, J = decltype(j)::value;
      if (ct.in) tile_load<I * NBB + J>(ct.in + I * ct.row_stride + J * 256, 64);
      else tile_zero<I * NBB + J>();
    });
  });
  for (int64_t k = k0; k < k1; k += 32) {
    const uint8_t* bk = wb + k * 32;  // this k step's B tile of block 0 (k/2 pairs x 64 bytes)
    if (prefetch > 0)
      for (int j = 0; j < NBB; ++j)
        for (int64_t line = 0; line < kTileBytes; line += 64)
          _mm_prefetch(stream_ahead(wb + j * bstride, k * 32, prefetch + line, bstride, NBB * bstride), _MM_HINT_T0);
    unrolled<MT>([&](auto i) {
      constexpr int I = decltype(i)::value;
      tile_load<4 + I % 2>(xa + I * 16 * xstride + k * akstep, astride);
      unrolled<NBB>([&](auto j) {
        constexpr int J = decltype(j)::value;
        if constexpr (I == 0) tile_load<6 + J % 2>(bk + J * jblocks * bstride, 64);
        tile_dpbf16<I * NBB + J, 4 + I % 2, 6 + J % 2>();
      });
    });
  }
  if constexpr (NBB == 2) {
    if (a.act && !ct.out) {  // gemm_swiglu: C tiles (i, 0) gate and (i, 1) up -> act
      alignas(64) float g[16 * 16], u[16 * 16];
      unrolled<MT>([&](auto i) {
        constexpr int I = decltype(i)::value;
        tile_store<I * NBB>(g, 64);
        tile_store<I * NBB + 1>(u, 64);
        swiglu_rows(g, u, a.act, a.act_kp, m0 + I * 16, nb * kRows);
      });
      return;
    }
  }
  alignas(64) float c[16 * 16];
  unrolled<MT>([&](auto i) {
    constexpr int I = decltype(i)::value;
    unrolled<NBB>([&](auto j) {
      constexpr int J = decltype(j)::value;
      if (ct.out) {
        tile_store<I * NBB + J>(ct.out + I * ct.row_stride + J * 256, 64);
      } else if (m0 + I * 16 + 16 <= a.m && (nb + J + 1) * kRows <= a.n) {  // a whole tile of y
        tile_store<I * NBB + J>(a.y + (m0 + I * 16) * a.ldy + (nb + J) * kRows, a.ldy * 4);
      } else {
        tile_store<I * NBB + J>(c, 64);
        store_tile_rows(a, c, m0 + I * 16, (nb + J) * kRows);
      }
    });
  });
}

// Decode/verify, M <= 16: one row tile, 4 row blocks at a time (4 C tiles in flight).
void verify_blocks(const GemmArgs& a, int64_t nb0, int64_t nb1, int64_t prefetch) {
  for (int64_t nb = nb0; nb < nb1; nb += 4) {
    const int64_t left = nb1 - nb;
    if (left >= 4) tile_step<1, 4>(a, nb, 0, 0, a.kp, prefetch);
    else if (left == 3) tile_step<1, 3>(a, nb, 0, 0, a.kp, prefetch);
    else if (left == 2) tile_step<1, 2>(a, nb, 0, 0, a.kp, prefetch);
    else tile_step<1, 1>(a, nb, 0, 0, a.kp, prefetch);
  }
}

// Decode/verify, 16 < M <= 64: pairs of row blocks, each pair's 2 x 2 tile steps over one
// 32-row half of x after the other. The first half streams the pair's B tiles from DRAM (with
// the prefetch); the later halves read them again from L2 (a pair's K = 8,960 is 573 KB). x is
// in the A-tile order (gemm.cpp: each A tile 1 KB contiguous). Against one tile_step of all the
// row tiles per B tile (4 row tiles x 1 row block for M > 32: one DRAM stream and four
// 16-row-strided A loads per B tile), model-167 AMX Xeon, 2 threads, Qwen2.5-Coder-1.5B:
// a 33-row target pass 2.12-2.25 -> 1.76-1.77 one-row passes (`qspec bench breakdown --ms
// 1,9,16,17,33`, two alternations), 17 rows 1.31-1.36 -> 1.29-1.34.
void verify_pairs(const GemmArgs& a, int64_t nb0, int64_t nb1, int64_t prefetch) {
  for (int64_t nb = nb0; nb < nb1; nb += 2) {
    const bool two_b = nb + 1 < nb1;
    for (int64_t m0 = 0; m0 < a.mpad; m0 += 32) {
      const int64_t pf = m0 == 0 ? prefetch : 0;
      const bool two_a = m0 + 16 < a.mpad;
      if (two_a && two_b) tile_step<2, 2>(a, nb, m0, 0, a.kp, pf);
      else if (two_a) tile_step<2, 1>(a, nb, m0, 0, a.kp, pf);
      else if (two_b) tile_step<1, 2>(a, nb, m0, 0, a.kp, pf);
      else tile_step<1, 1>(a, nb, m0, 0, a.kp, pf);
    }
  }
}

// Prefill (mpad > 64), blocked for the caches: chunks of kChunkRows rows (their x of one K chunk,
// at most 1 MB, stays in L2 while every row block of the piece passes), pieces of kSubBlocks row
// blocks (their partial sums, chunk rows x 256 fp32, stay in L2 between K chunks), K chunks
// balanced to at most kChunkK (a pair of row blocks' B tiles of a chunk, <= 128 KB, stay in L2
// while the chunk's 32-row groups pass). cbuf: kAmxPrefillScratch floats.
void prefill_blocks(const GemmArgs& a, int64_t nb0, int64_t nb1, float* cbuf) {
  // gemm_swiglu: each of blocks [nb0, nb1) (gate) with its up block: 2 C tiles a block
  const int64_t up = a.act ? a.n / 2 / kRows : 0, per_block = a.act ? 2 : 1;
  const int64_t sub = kSubBlocks / per_block;
  for (int64_t m0 = 0; m0 < a.mpad; m0 += kChunkRows) {
    const int64_t mc = a.mpad - m0 < kChunkRows ? a.mpad - m0 : kChunkRows;  // a multiple of 16
    for (int64_t s0 = nb0; s0 < nb1; s0 += sub) {
      const int64_t s1 = nb1 - s0 < sub ? nb1 : s0 + sub;
      CTiles ct;
      ct.row_stride = (s1 - s0) * per_block * 256;
      const int64_t nk = (a.kp + kChunkK - 1) / kChunkK;          // K chunks of at most kChunkK,
      const int64_t kc = ((a.kp + nk - 1) / nk + 31) / 32 * 32;  // balanced, whole k steps
      for (int64_t k0 = 0; k0 < a.kp; k0 += kc) {
        const int64_t k1 = a.kp - k0 < kc ? a.kp : k0 + kc;
        for (int64_t nb = s0; nb < s1; nb += 2 / per_block) {
          const bool two_b = nb + 1 < s1;  // (gemm_swiglu: always gate and up)
          for (int64_t r = 0; r < mc; r += 32) {
            const bool two_a = r + 16 < mc;
            float* t = cbuf + (r / 16) * ct.row_stride + (nb - s0) * per_block * 256;
            ct.in = k0 == 0 ? nullptr : t;
            ct.out = k1 == a.kp ? nullptr : t;
            const int64_t m = m0 + r;
            if (up) {
              if (two_a) tile_step<2, 2>(a, nb, m, k0, k1, 0, ct, up);
              else tile_step<1, 2>(a, nb, m, k0, k1, 0, ct, up);
            } else if (two_a && two_b) tile_step<2, 2>(a, nb, m, k0, k1, 0, ct);
            else if (two_a) tile_step<2, 1>(a, nb, m, k0, k1, 0, ct);
            else if (two_b) tile_step<1, 2>(a, nb, m, k0, k1, 0, ct);
            else tile_step<1, 1>(a, nb, m, k0, k1, 0, ct);
          }
        }
      }
    }
  }
}

}  // namespace

void gemm_blocks_amx(const GemmArgs& a, int64_t nb0, int64_t nb1, float* acc) {
  const int64_t prefetch = a.prefetch > 0 ? a.prefetch : kDefaultPrefetch;
  amx::configure_16x64();  // tile state is per thread: every thread of the pool configures its own
  if (a.mpad <= 16) verify_blocks(a, nb0, nb1, prefetch);
  else if (a.mpad <= kAmxPrefillRows) verify_pairs(a, nb0, nb1, prefetch);
  else prefill_blocks(a, nb0, nb1, acc);
  _tile_release();
}

void gemm_blocks_amx_swiglu(const GemmArgs& a, int64_t nb0, int64_t nb1, float* acc) {
  amx::configure_16x64();
  prefill_blocks(a, nb0, nb1, acc);
  _tile_release();
}

}  // namespace detail
}  // namespace qspec
