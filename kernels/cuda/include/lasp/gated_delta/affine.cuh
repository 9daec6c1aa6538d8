// The affine maps of Gated DeltaNet's segments and shards, S_end = A S_start + b, composed on the
// CUDA cores in fp32 with every sum in one fixed, ascending order, so that the same inputs give the
// same bits whatever the grid, the exchange mode or the schedule. They serve the fold of the
// segments' prefixes (gated_delta/forward.cu), the backward's fold of the state gradient down the
// segments (gated_delta/backward.cu) and, in LASP-2, the shard's summary and the fold of the
// summaries the other PEs sent (gated_delta/lasp2_forward.cu, gated_delta/lasp2_backward.cu).
//
// The unit of work is one column tile of 64: P [Dk][64] fp32 in shared memory, held by
// LASP_GDN_FOLD_THREADS = 256 threads, each computing a block of Dk/32 rows by 8 columns (two quads,
// 4 c .. 4 c + 3 and 32 + 4 c .. 32 + 4 c + 3, so that a quarter-warp's 16-byte reads of a row of P
// hit every bank once). Per 4 inner indices a thread reads 4 x Dk/32 values of A as float4 (rows
// of A are contiguous in the inner index) and 8 float4 of P, for 32 x Dk/32 FMAs. A [Dk x Dk] is
// stored as Dk/64 column blocks [Dk][64] (lasp/gated_delta/forward_params.h), so that one column
// tile of a product A X is the same step as a fold: X's column block in P, no b.
#pragma once
#include <stdint.h>

#include "lasp/chunk/state_tile.cuh"
#include "lasp/gated_delta/forward_params.h"

namespace lasp {
namespace gdn {

// How a step reads A and b: through the L1 where an earlier kernel wrote them (the workspace), or
// through L2 only (ld.global.cg) where another PE put them during this kernel (the exchange's slots).
enum class Source { kWorkspace, kLanded };

template <Source kFrom, class V>
__device__ __forceinline__ V load_operand(const float* x) {
  if constexpr (kFrom == Source::kLanded)
    return __ldcg(reinterpret_cast<const V*>(x));
  else
    return __ldg(reinterpret_cast<const V*>(x));
}

template <int DK>
struct AffineTile {
  static_assert(LASP_GDN_FOLD_THREADS == 256, "32 row blocks x 8 column quads");
  static constexpr int kRows = DK / 32;  // rows of a thread's block
  static constexpr int kBlocks = DK / 64;

  float* p;  // shared [DK][64]
  int r0;    // the thread's rows r0 .. r0 + kRows - 1
  int c0;    // and columns c0 .. c0 + 3, c0 + 32 .. c0 + 35

  __device__ __forceinline__ explicit AffineTile(float* tile)
      : p(tile), r0((threadIdx.x >> 3) * kRows), c0((threadIdx.x & 7) * 4) {}

  // Column e (0..7) of the thread's block.
  __device__ __forceinline__ int column(int e) const { return c0 + (e & 3) + 32 * (e >> 2); }

  // P = the [DK][64] tile at `src` (row pitch `ld`; 8-byte aligned, as h0 is), or zero for NULL.
  template <Source kFrom = Source::kWorkspace>
  __device__ __forceinline__ void load(const float* src, int64_t ld) {
#pragma unroll
    for (int i = 0; i < kRows; ++i)
#pragma unroll
      for (int e = 0; e < 8; e += 2) {
        const int d = r0 + i, c = column(e);
        const float2 x = src ? load_operand<kFrom, float2>(src + d * ld + c) : make_float2(0.f, 0.f);
        *reinterpret_cast<float2*>(p + d * 64 + c) = x;
      }
    __syncthreads();
  }

  // The tile at `dst` (row pitch `ld`, 8-byte aligned) = P.
  __device__ __forceinline__ void store(float* dst, int64_t ld) const {
#pragma unroll
    for (int i = 0; i < kRows; ++i)
#pragma unroll
      for (int e = 0; e < 8; e += 2) {
        const int d = r0 + i, c = column(e);
        *reinterpret_cast<float2*>(dst + d * ld + c) = *reinterpret_cast<const float2*>(p + d * 64 + c);
      }
  }

  // P = A P + b, A given by its column blocks (`a_block(jb)`: [DK][64], 16-byte aligned, jb <
  // DK/64), b the tile at `b` (row pitch `ld_b`) or NULL for none. Each element: b, then the
  // products in ascending order of the inner index.
  template <Source kFrom, class ABlock>
  __device__ __forceinline__ void apply(ABlock&& a_block, const float* b, int64_t ld_b) {
    float acc[kRows][8];
#pragma unroll
    for (int i = 0; i < kRows; ++i)
#pragma unroll
      for (int e = 0; e < 8; e += 2) {
        const float2 x =
            b ? load_operand<kFrom, float2>(b + (r0 + i) * ld_b + column(e)) : make_float2(0.f, 0.f);
        acc[i][e] = x.x;
        acc[i][e + 1] = x.y;
      }
#pragma unroll
    for (int jb = 0; jb < kBlocks; ++jb) {
      const float* a = a_block(jb);
#pragma unroll 2
      for (int j4 = 0; j4 < 64; j4 += 4) {
        float4 arow[kRows];  // A[r0 + i][j4 .. j4 + 3]
#pragma unroll
        for (int i = 0; i < kRows; ++i) arow[i] = load_operand<kFrom, float4>(a + (r0 + i) * 64 + j4);
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
          const float* row = p + (jb * 64 + j4 + jj) * 64;
          const float4 lo = *reinterpret_cast<const float4*>(row + c0);
          const float4 hi = *reinterpret_cast<const float4*>(row + c0 + 32);
          const float pj[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
          for (int i = 0; i < kRows; ++i) {
            const float aij = (&arow[i].x)[jj];
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[i][e] = fmaf(aij, pj[e], acc[i][e]);
          }
        }
      }
    }
    __syncthreads();  // every thread has read P
#pragma unroll
    for (int i = 0; i < kRows; ++i)
#pragma unroll
      for (int e = 0; e < 8; e += 2)
        *reinterpret_cast<float2*>(p + (r0 + i) * 64 + column(e)) = make_float2(acc[i][e], acc[i][e + 1]);
    __syncthreads();
  }

  // P = A^T P + b (the backward's step down a chain of transitions), A and b as in apply. Each
  // element: b, then the products in ascending order of the inner index. A thread's rows are one
  // run of Dk/32 columns of A, read from each of A's rows at once.
  template <Source kFrom, class ABlock>
  __device__ __forceinline__ void apply_transposed(ABlock&& a_block, const float* b, int64_t ld_b) {
    float acc[kRows][8];
#pragma unroll
    for (int i = 0; i < kRows; ++i)
#pragma unroll
      for (int e = 0; e < 8; e += 2) {
        const float2 x =
            b ? load_operand<kFrom, float2>(b + (r0 + i) * ld_b + column(e)) : make_float2(0.f, 0.f);
        acc[i][e] = x.x;
        acc[i][e + 1] = x.y;
      }
    const float* a = a_block(r0 / 64) + r0 % 64;  // A[r][r0 + i] at a[r * 64 + i]
#pragma unroll 4
    for (int r = 0; r < DK; ++r) {
      float acol[kRows];
#pragma unroll
      for (int i = 0; i < kRows; ++i) acol[i] = load_operand<kFrom, float>(a + r * 64 + i);
      const float* row = p + r * 64;
      const float4 lo = *reinterpret_cast<const float4*>(row + c0);
      const float4 hi = *reinterpret_cast<const float4*>(row + c0 + 32);
      const float pr[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
      for (int i = 0; i < kRows; ++i)
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[i][e] = fmaf(acol[i], pr[e], acc[i][e]);
    }
    __syncthreads();  // every thread has read P
#pragma unroll
    for (int i = 0; i < kRows; ++i)
#pragma unroll
      for (int e = 0; e < 8; e += 2)
        *reinterpret_cast<float2*>(p + (r0 + i) * 64 + column(e)) = make_float2(acc[i][e], acc[i][e + 1]);
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

// The state Dv tile vt of segment s of b*H+h starts from (the prologue of the output kernels and of
// the backward's chain): the fold's prefix where one ran (ws_p), else h0, else zero.
template <int DK>
__device__ __forceinline__ void load_segment_start(const lasp_gated_delta_params& p, int64_t bh, int s, uint32_t vt,
                                                   chunk::StateRegs<DK>& regs, const chunk::StateLane& ln) {
  const float* prefix = p.ws_p ? prefix_tile<DK>(p, bh, s, 0) : p.h0 ? p.h0 + bh * DK * p.Dv : nullptr;
  if (prefix)
    chunk::state_load<DK>(regs, ln, prefix + vt * 64, p.Dv);
  else
    chunk::state_zero<DK>(regs, ln);
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

// Columns 64 vt.. of slot s of a per-segment state gradient `ds` [B*H, S, Dk, Dv] (row pitch Dv).
template <int DK>
__device__ __forceinline__ float* segment_ds_tile(const lasp_gated_delta_params& p, float* ds, int64_t bh, int s,
                                                  int vt) {
  return ds + (bh * p.num_segments + s) * DK * p.Dv + vt * 64;
}

// The backward's fold down the segments of Dv tile vt of b*H+h: from the dS leaving the last
// segment (already in P), E <- A_s^T E + c_s for s = S-1 .. 1, each over c_s in slot s of `ds`: the
// dS entering segment s (the summaries' A_s, num_summaries = S).
template <int DK>
__device__ __forceinline__ void fold_segments_down(const lasp_gated_delta_params& p, float* ds, AffineTile<DK>& tile,
                                                   int64_t bh, int vt) {
  for (int s = p.num_segments - 1; s >= 1; --s) {
    float* slot = segment_ds_tile<DK>(p, ds, bh, s, vt);
    tile.template apply_transposed<Source::kWorkspace>([&](int jb) { return summary_a_block<DK>(p, bh, s, jb); },
                                                       slot, p.Dv);
    tile.store(slot, p.Dv);
  }
}

}  // namespace gdn
}  // namespace lasp
