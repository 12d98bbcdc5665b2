// AMX-BF16 GEMM for BF16 weights at every M: decode, verify and prefill (gemm_supports).
// x is rounded to bf16 by the driver into [mpad][kp]: mpad = M rounded up to 16 (zero rows), or
// 1 for M = 1, whose A tile reads that row 16 times (stride 0) instead of 15 zero rows that the
// driver would write on every decode step.
// The packed BF16 layout is already the B-tile layout: one row block and 32 k = 16 rows of
// 64 bytes (k pair x 16 columns), 1 KB contiguous.
//
// Every output element is one C-tile element: zeroed, then one TDPBF16PS per 32 k in k order
// over all of K (no K split), from its own row of x and its row block of W. The SDM defines each
// C row from its own A row only, so neither the other rows of x nor how many tiles of rows a call
// has change a row's bits: M = 1..64 and prefill run the same arithmetic per row (batch
// invariant). Tiles always hold 16 rows (padding rows past M): one tile configuration for every
// call, and M = 1..16 issue the same instructions on the same weight bytes, so a 16-row verify
// should cost what one row does. Configuring exactly M rows would give the same bits
// (rows are independent) but would save only TMUL work, which is not the bound: one 1 KB B tile
// per 16-cycle TDPBF16PS is far more than a core's share of DRAM bandwidth.
//
// Decode/verify (mpad <= 64): each B tile is loaded once per k step and used by every row tile
// (the weight stream is read once for all M rows), with up to 4 independent C tiles in flight
// to cover TDPBF16PS latency (M <= 16: 4 row blocks at once) and a software prefetch of each
// row block's stream. Prefill (mpad > 64): 2 x 2 tiles per 32 rows, B re-read from cache.
// Tested against ref on a Sapphire Rapids VM and under emulation (tests/test_isa_emulation.py).
// There (Qwen2.5-Coder-1.5B shapes, 2 threads, `qspec bench kernels`): one row at ~80% of the
// read bandwidth, v(8) = 1.36 and v(16) = 1.53 one-row passes; prefill GEMMs 620-790 GFLOP/s
// (15-19% of the 4 TFLOP/s peak at 2 GHz: B and A tiles stream from L2 for every 4 TDPBF16PS).
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "amx_tiles.h"
#include "gemm_internal.h"

namespace qspec {
namespace detail {
namespace {

constexpr int64_t kTileBytes = 1024;         // one B tile: 16 k pairs x 16 rows x 2 bf16
constexpr int64_t kDefaultPrefetch = 2 * kTileBytes;  // bytes ahead in each row block's stream

// Every tile 16 rows x 64 bytes. Tiles 0-3: C (16 x 16 fp32), 4-5: A (16 rows x 32 bf16),
// 6-7: B (16 k pairs x 16 x 2 bf16).
void configure_tiles() {
  amx::TileConfig cfg = amx::tile_config();
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  amx::load_tile_config(cfg);
}

// The tile intrinsics take tile numbers as literal tokens (pasted into the asm), so the
// numbers chosen at compile time are spelled out here.
template <int T>
inline void tile_zero() {
  static_assert(T >= 0 && T < 4, "C tiles are 0-3");
  if constexpr (T == 0) _tile_zero(0);
  if constexpr (T == 1) _tile_zero(1);
  if constexpr (T == 2) _tile_zero(2);
  if constexpr (T == 3) _tile_zero(3);
}

template <int T>
inline void tile_store(float* c) {
  static_assert(T >= 0 && T < 4, "C tiles are 0-3");
  if constexpr (T == 0) _tile_stored(0, c, 64);
  if constexpr (T == 1) _tile_stored(1, c, 64);
  if constexpr (T == 2) _tile_stored(2, c, 64);
  if constexpr (T == 3) _tile_stored(3, c, 64);
}

template <int T>
inline void tile_load(const uint8_t* p, int64_t stride) {
  static_assert(T >= 4 && T < 8, "A and B tiles are 4-7");
  if constexpr (T == 4) _tile_loadd(4, p, stride);
  if constexpr (T == 5) _tile_loadd(5, p, stride);
  if constexpr (T == 6) _tile_loadd(6, p, stride);
  if constexpr (T == 7) _tile_loadd(7, p, stride);
}

template <int C, int A, int B>
inline void tile_dp() {
  static_assert(C >= 0 && C < 4 && (A == 4 || A == 5) && (B == 6 || B == 7), "tile roles");
#define QSPEC_TDP(c, a, b) \
  if constexpr (C == c && A == a && B == b) _tile_dpbf16ps(c, a, b);
  QSPEC_TDP(0, 4, 6) QSPEC_TDP(0, 4, 7) QSPEC_TDP(0, 5, 6) QSPEC_TDP(0, 5, 7)
  QSPEC_TDP(1, 4, 6) QSPEC_TDP(1, 4, 7) QSPEC_TDP(1, 5, 6) QSPEC_TDP(1, 5, 7)
  QSPEC_TDP(2, 4, 6) QSPEC_TDP(2, 4, 7) QSPEC_TDP(2, 5, 6) QSPEC_TDP(2, 5, 7)
  QSPEC_TDP(3, 4, 6) QSPEC_TDP(3, 4, 7) QSPEC_TDP(3, 5, 6) QSPEC_TDP(3, 5, 7)
#undef QSPEC_TDP
}

// f(integral_constant<int, 0>), ..., f(integral_constant<int, N-1>): compile-time tile numbers.
template <class F, int... I>
inline void unrolled(F&& f, std::integer_sequence<int, I...>) {
  (f(std::integral_constant<int, I>{}), ...);
}
template <int N, class F>
inline void unrolled(F&& f) {
  unrolled(f, std::make_integer_sequence<int, N>{});
}

inline void store_tile_rows(const GemmArgs& a, const float* c, int64_t m0, int64_t n0) {
  const int64_t cols = a.n - n0 < 16 ? a.n - n0 : 16;
  for (int64_t r = 0; r < 16 && m0 + r < a.m; ++r)
    std::memcpy(a.y + (m0 + r) * a.ldy + n0, c + r * 16, size_t(cols) * 4);
}

// MT row tiles of x (16 rows each, from row m0) x NBB row blocks of W (from nb), over all of K.
// C tile of (row tile i, block j): i * NBB + j; A of row tile i: 4 + i % 2; B of block j:
// 6 + j % 2. Row tile i loads its A tile first, row tile 0 loads each B tile: with MT * NBB <= 4
// a tile is reloaded only after the products that read it (MT >= 2 means NBB <= 2).
template <int MT, int NBB>
void tile_step(const GemmArgs& a, int64_t nb, int64_t m0, int64_t prefetch) {
  static_assert(MT >= 1 && NBB >= 1 && MT * NBB <= 4, "4 C tiles");
  const int64_t xstride = a.kp * 2;      // bytes per row of x
  const int64_t astride = a.mpad == 1 ? 0 : xstride;  // M = 1: row 0 in every row of the A tile
  const int64_t bstride = a.kp * 32;     // bytes per row block of W: kp/2 pairs x 64 bytes
  const uint8_t* xa = reinterpret_cast<const uint8_t*>(a.xbf) + m0 * xstride;
  const uint8_t* wb = a.data + nb * bstride;
  unrolled<MT * NBB>([](auto t) { tile_zero<decltype(t)::value>(); });
  for (int64_t k0 = 0; k0 < a.kp; k0 += 32) {
    const uint8_t* bk = wb + k0 * 32;  // this k step's B tile of block 0 (k0/2 pairs x 64 bytes)
    if (prefetch > 0)
      for (int j = 0; j < NBB; ++j)
        for (int64_t line = 0; line < kTileBytes; line += 64)
          _mm_prefetch(reinterpret_cast<const char*>(bk + j * bstride + prefetch + line), _MM_HINT_T0);
    unrolled<MT>([&](auto i) {
      constexpr int I = decltype(i)::value;
      tile_load<4 + I % 2>(xa + I * 16 * xstride + k0 * 2, astride);
      unrolled<NBB>([&](auto j) {
        constexpr int J = decltype(j)::value;
        if constexpr (I == 0) tile_load<6 + J % 2>(bk + J * bstride, 64);
        tile_dp<I * NBB + J, 4 + I % 2, 6 + J % 2>();
      });
    });
  }
  alignas(64) float c[16 * 16];
  unrolled<MT>([&](auto i) {
    constexpr int I = decltype(i)::value;
    unrolled<NBB>([&](auto j) {
      constexpr int J = decltype(j)::value;
      tile_store<I * NBB + J>(c);
      store_tile_rows(a, c, m0 + I * 16, (nb + J) * kRows);
    });
  });
}

// Decode/verify: all MT row tiles per B tile, groups of 4 / MT row blocks.
template <int MT>
void verify_blocks(const GemmArgs& a, int64_t nb0, int64_t nb1, int64_t prefetch) {
  constexpr int kGroup = 4 / MT;
  for (int64_t nb = nb0; nb < nb1; nb += kGroup) {
    const int64_t left = nb1 - nb;
    if constexpr (kGroup == 4) {
      if (left >= 4) tile_step<MT, 4>(a, nb, 0, prefetch);
      else if (left == 3) tile_step<MT, 3>(a, nb, 0, prefetch);
      else if (left == 2) tile_step<MT, 2>(a, nb, 0, prefetch);
      else tile_step<MT, 1>(a, nb, 0, prefetch);
    } else if constexpr (kGroup == 2) {
      if (left >= 2) tile_step<MT, 2>(a, nb, 0, prefetch);
      else tile_step<MT, 1>(a, nb, 0, prefetch);
    } else {
      tile_step<MT, 1>(a, nb, 0, prefetch);
    }
  }
}

}  // namespace

void gemm_blocks_amx(const GemmArgs& a, int64_t nb0, int64_t nb1, float* acc) {
  const int64_t prefetch = a.prefetch > 0 ? a.prefetch : kDefaultPrefetch;
  configure_tiles();  // tile state is per thread: every thread of the pool configures its own
  switch ((a.mpad + 15) / 16) {
    case 1: verify_blocks<1>(a, nb0, nb1, prefetch); break;
    case 2: verify_blocks<2>(a, nb0, nb1, prefetch); break;
    case 3: verify_blocks<3>(a, nb0, nb1, prefetch); break;
    case 4: verify_blocks<4>(a, nb0, nb1, prefetch); break;
    default:  // prefill: 2 row blocks x 32 rows at a time, the blocks' B re-read from cache
      for (int64_t nb = nb0; nb < nb1; nb += 2) {
        const bool two_b = nb + 1 < nb1;
        for (int64_t m0 = 0; m0 < a.mpad; m0 += 32) {
          const bool two_a = m0 + 16 < a.mpad;
          if (two_a && two_b) tile_step<2, 2>(a, nb, m0, prefetch);
          else if (two_a) tile_step<2, 1>(a, nb, m0, prefetch);
          else if (two_b) tile_step<1, 2>(a, nb, m0, prefetch);
          else tile_step<1, 1>(a, nb, m0, prefetch);
        }
      }
  }
  _tile_release();
}

}  // namespace detail
}  // namespace qspec
