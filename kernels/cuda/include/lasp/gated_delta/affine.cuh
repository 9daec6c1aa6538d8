// The affine maps of Gated DeltaNet's segments and shards, S_end = A S_start + b, composed on the
// CUDA cores in fp32 with every sum in one fixed, ascending order, so that the same inputs give the
// same bits whatever the grid, the exchange mode or the schedule. They serve the fold of the
// segments' prefixes (gated_delta/forward.cu) and, in LASP-2, the shard's summary and the fold of
// the summaries the earlier PEs sent (gated_delta/lasp2_forward.cu).
//
// The unit of work is one column tile of 64: P [Dk][64] fp32 in shared memory, held by
// LASP_GDN_FOLD_THREADS threads, thread (c, r) computing column c of rows r, r + 4, ...; a row of A
// is then read by a whole warp at one address. A [Dk x Dk] is stored as Dk/64 column blocks [Dk][64]
// (lasp/gated_delta/forward_params.h), so that one column tile of a product A X is the same step as
// a fold: X's column block in P, no b.
#pragma once
#include <stdint.h>

#include "lasp/gated_delta/forward_params.h"

namespace lasp {
namespace gdn {

// How a step reads A and b: through the L1 where an earlier kernel wrote them (the workspace), or
// through L2 only (ld.global.cg) where another PE put them during this kernel (the exchange's slots).
enum class Source { kWorkspace, kLanded };

template <Source kFrom>
__device__ __forceinline__ float load_operand(const float* x) {
  if constexpr (kFrom == Source::kLanded)
    return __ldcg(x);
  else
    return __ldg(x);
}

template <int DK>
struct AffineTile {
  static constexpr int kRowStep = LASP_GDN_FOLD_THREADS / 64;
  static constexpr int kRows = DK / kRowStep;
  static constexpr int kBlocks = DK / 64;

  float* p;  // shared [DK][64]
  int c, r;

  __device__ __forceinline__ explicit AffineTile(float* tile) : p(tile), c(threadIdx.x & 63), r(threadIdx.x >> 6) {}

  // P = the [DK][64] tile at `src` (row pitch `ld`), or zero for NULL.
  template <Source kFrom = Source::kWorkspace>
  __device__ __forceinline__ void load(const float* src, int64_t ld) {
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const int d = r + kRowStep * i;
      p[d * 64 + c] = src ? load_operand<kFrom>(src + d * ld + c) : 0.f;
    }
    __syncthreads();
  }

  // The tile at `dst` (row pitch `ld`) = P.
  __device__ __forceinline__ void store(float* dst, int64_t ld) const {
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const int d = r + kRowStep * i;
      dst[d * ld + c] = p[d * 64 + c];
    }
  }

  // P = A P + b, A given by its column blocks (`a_block(jb)`: [DK][64], jb < DK/64), b the tile at
  // `b` (row pitch `ld_b`) or NULL for none. Each element: b, then the products in ascending order
  // of the inner index.
  template <Source kFrom, class ABlock>
  __device__ __forceinline__ void apply(ABlock&& a_block, const float* b, int64_t ld_b) {
    float acc[kRows];
#pragma unroll
    for (int i = 0; i < kRows; ++i) acc[i] = b ? load_operand<kFrom>(b + (r + kRowStep * i) * ld_b + c) : 0.f;
#pragma unroll
    for (int jb = 0; jb < kBlocks; ++jb) {
      const float* a = a_block(jb);
#pragma unroll 2  // two columns' loads in flight: a deeper unroll spills at Dk = 128
      for (int jj = 0; jj < 64; ++jj) {
        const float pe = p[(jb * 64 + jj) * 64 + c];
#pragma unroll
        for (int i = 0; i < kRows; ++i) acc[i] = fmaf(load_operand<kFrom>(a + (r + kRowStep * i) * 64 + jj), pe, acc[i]);
      }
    }
    __syncthreads();  // every thread has read P
#pragma unroll
    for (int i = 0; i < kRows; ++i) p[(r + kRowStep * i) * 64 + c] = acc[i];
    __syncthreads();
  }
};

// Column block jb of A_s in the workspace: ws_a [B*H, num_summaries, Dk/64, Dk, 64].
template <int DK>
__device__ __forceinline__ float* summary_a_block(const lasp_gated_delta_params& p, int64_t bh, int s, int jb) {
  return p.ws_a + ((bh * p.num_summaries + s) * (DK / 64) + jb) * DK * 64;
}

// Columns 64 vt.. of b_s in the workspace: ws_b [B*H, num_summaries, Dk, Dv] (row pitch Dv).
template <int DK>
__device__ __forceinline__ float* summary_b_tile(const lasp_gated_delta_params& p, int64_t bh, int s, int vt) {
  return p.ws_b + (bh * p.num_summaries + s) * DK * p.Dv + vt * 64;
}

// Columns 64 vt.. of the state entering segment s: ws_p [B*H, S, Dk, Dv] (row pitch Dv).
template <int DK>
__device__ __forceinline__ float* prefix_tile(const lasp_gated_delta_params& p, int64_t bh, int s, int vt) {
  return p.ws_p + (bh * p.num_segments + s) * DK * p.Dv + vt * 64;
}

// The prefixes of Dv tile vt of b*H+h: from the state entering segment 0 (already in P), the
// states entering segments 1..S-1 by the segments' summaries, each stored in ws_p.
template <int DK>
__device__ __forceinline__ void fold_segments(const lasp_gated_delta_params& p, AffineTile<DK>& tile, int64_t bh,
                                              int vt) {
  tile.store(prefix_tile<DK>(p, bh, 0, vt), p.Dv);
  for (int s = 0; s + 1 < p.num_segments; ++s) {
    tile.template apply<Source::kWorkspace>([&](int jb) { return summary_a_block<DK>(p, bh, s, jb); },
                                            summary_b_tile<DK>(p, bh, s, vt), p.Dv);
    tile.store(prefix_tile<DK>(p, bh, s + 1, vt), p.Dv);
  }
}

}  // namespace gdn
}  // namespace lasp
