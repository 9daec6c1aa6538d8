// Gated DeltaNet (the delta rule with a scalar decay per token and head), forward, chunkwise
// (C = 64), for sm_90a.
//
//   S_t = e^{a_t} (I - beta_t k_t^T k_t) S_{t-1} + beta_t k_t^T v_t,   o_t = sigma q_t S_t
//
// Four kernels (launch geometry and call order: lasp/gated_delta/forward_params.h):
//   1. lasp_gated_delta_wy_dk*       (lasp/gated_delta/wy.cuh) (I + L)^{-1} of every chunk, L_rj = beta_r e^{b_r - b_j} (k_r . k_j)
//                                    strictly lower: the part of the chunk's WY form that does not
//                                    depend on the state, for every chunk at once
//   2. lasp_gated_delta_summary_dk*  segment s < num_summaries (S-1; S in LASP-2): its affine map
//                                    S_end = A_s S_start + b_s, by the output loop without O: A_s
//                                    column tile by column tile from the identity's columns with V
//                                    taken as 0, b_s from zero
//   3. lasp_gated_delta_fold_dk*     P_0 = h0, P_{s+1} = A_s P_s + b_s (lasp/gated_delta/affine.cuh)
//   4. lasp_gated_delta_output_dk*   scalar decay's output loop with the values step of
//                                    lasp/gated_delta/values.cuh from P_s: per chunk, u from V, K S_n
//                                    and the chunk's (I + L)^{-1}, then O and S_{n+1} from u; the last
//                                    segment writes ht
// With S == 1 only kernels 1 and 4 run.
#include <math.h>
#include <stdint.h>

#include "lasp/gated_delta/affine.cuh"
#include "lasp/gated_delta/forward_params.h"
#include "lasp/gated_delta/values.cuh"
#include "lasp/gated_delta/wy.cuh"
#include "lasp/mma.cuh"
#include "lasp/scalar_decay/chunk.cuh"

namespace lasp {
namespace gdn {

using chunk::StateLane;
using chunk::StateRegs;

// Kernel 2's CTAs in grid order (x, then y) are the summaries' column tiles, segment by segment,
// Dk/64 + Dv/64 tiles each: A_s's column blocks first, then b_s's Dv tiles. Grid (Dk/64 + Dv/64,
// num_summaries, B*H) runs every tile; a grid whose x holds fewer CTAs leaves out the last tiles,
// as the backward's does with the last segment's b, which none of its kernels reads
// (lasp/gated_delta/backward_params.h).
struct SummaryTile {
  int segment, tile;
};
template <int DK>
__device__ __forceinline__ SummaryTile summary_tile(const lasp_gated_delta_params& p) {
  const int tiles = DK / 64 + p.Dv / 64;
  const int i = blockIdx.y * gridDim.x + blockIdx.x;
  const int segment = i / tiles;
  return {segment, i - segment * tiles};
}

// Kernel 2: column tile x of segment s's summary (summary_tile), b*H+h = blockIdx.z. Tiles below
// Dk/64 are A_s's column blocks (the loop from the identity's columns 64x.., V taken as 0), the
// others b_s's (from zero, V's tile x - Dk/64). Into workspace slot (b*H+h, s). The prologue and
// epilogue take the tile from the grid afresh (as the output kernel does: no register lives across
// the loop for it).
template <int DK, bool kOfA>
__device__ __forceinline__ void run_summary_tile(const lasp_gated_delta_params& p, sd::SegmentArgs a) {
  const SummaryTile at = summary_tile<DK>(p);
  const int col0 = 64 * (kOfA ? at.tile : at.tile - DK / 64);
  a.vt = kOfA ? 0 : at.tile - DK / 64;  // the V tile the loop loads (unused for A)
  sd::run_segment_with<DK, sd::Probe::kNone, false, false>(
      a,
      [&](StateRegs<DK>& s, const StateLane& ln) {
        if constexpr (kOfA) {
          chunk::for_each_state_pair<DK>(s, ln, [&](float& x0, float& x1, int d, int c) {
            x0 = d == col0 + c ? 1.f : 0.f;
            x1 = d == col0 + c + 1 ? 1.f : 0.f;
          });
        } else {
          chunk::state_zero<DK>(s, ln);
        }
        return true;
      },
      [&](StateRegs<DK>& s, const StateLane& ln, float) {
        const SummaryTile end = summary_tile<DK>(p);
        if constexpr (kOfA)
          chunk::state_store<DK>(s, ln, summary_a_block<DK>(p, blockIdx.z, end.segment, end.tile), 64);
        else
          chunk::state_store<DK>(s, ln, summary_b_tile<DK>(p, blockIdx.z, end.segment, end.tile - DK / 64), p.Dv);
      },
      sd::NoChunkHook{}, Values<DK, kOfA, ValuesLayout<DK, false>>{p});
}

template <int DK>
__device__ __forceinline__ void run_summary(const lasp_gated_delta_params& p) {
  const SummaryTile at = summary_tile<DK>(p);
  sd::SegmentArgs a = sd::segment_args(p);  // its segment is blockIdx.y's: set from the tile's
  a.c_begin = at.segment * p.chunks_per_segment;
  a.n_chunks = min(p.chunks_per_segment, lasp_gdn_num_chunks(p.T) - a.c_begin);
  if (at.tile < DK / 64)
    run_summary_tile<DK, true>(p, a);
  else
    run_summary_tile<DK, false>(p, a);
}

// Kernel 3: the prefixes of Dv tile blockIdx.x of b*H+h = blockIdx.y: P_0 = h0 (or 0), then
// P_{s+1} = A_s P_s + b_s over the segments in order, each into ws_p (lasp/gated_delta/affine.cuh).
template <int DK>
__device__ __forceinline__ void run_fold(const lasp_gated_delta_params& p) {
  __shared__ __align__(16) float s_prefix[DK * 64];
  const int64_t bh = blockIdx.y;
  const int vt = blockIdx.x;
  AffineTile<DK> tile(s_prefix);
  tile.load(p.h0 ? p.h0 + bh * DK * p.Dv + vt * 64 : nullptr, p.Dv);
  fold_segments<DK>(p, tile, bh, vt);
}

// Kernel 4: Dv tile blockIdx.x of segment blockIdx.y of b*H+h = blockIdx.z, from the state the
// fold left in ws_p (without a fold: h0 or zero); the last segment writes ht. The prologue and epilogue read the grid and the
// parameters afresh instead of capturing values of their own: at Dk = 128 the loop has no register
// to spare for values that live across it.
template <int DK>
__device__ __forceinline__ void run_output(const lasp_gated_delta_params& p) {
  const sd::SegmentArgs a = sd::segment_args(p);
  sd::run_segment_with<DK>(
      a,
      [&](StateRegs<DK>& s, const StateLane& ln) {
        load_segment_start<DK>(p, blockIdx.z, blockIdx.y, blockIdx.x, s, ln);
        return true;
      },
      [&](StateRegs<DK>& s, const StateLane& ln, float) {
        if (blockIdx.y == p.num_segments - 1 && p.ht)
          chunk::state_store<DK>(s, ln, p.ht + (int64_t)blockIdx.z * DK * p.Dv + blockIdx.x * sd::kTileV, p.Dv);
      },
      sd::NoChunkHook{}, Values<DK>{p});
}

// The walk that stores the states the final states of packed documents start from
// (sd::store_document_entry): Dv tile blockIdx.x of segment blockIdx.y of b*H+h = blockIdx.z, from
// the segment's start state as kernel 4, the loop without O (the summary's smem), its values
// step and state update only. For LASP-2 shards, from the state the forward saved as entering
// the shard (h0).
template <int DK>
__device__ __forceinline__ void run_document_entries_walk(const lasp_gated_delta_params& p) {
  const sd::SegmentArgs a = sd::segment_args(p);
  sd::run_segment_with<DK, sd::Probe::kNone, false, false>(
      a,
      [&](StateRegs<DK>& s, const StateLane& ln) {
        load_segment_start<DK>(p, blockIdx.z, blockIdx.y, blockIdx.x, s, ln);
        return true;
      },
      [](StateRegs<DK>&, const StateLane&, float) {},
      [&](StateRegs<DK>& s, const StateLane& ln, int chunk) { sd::store_document_entry<DK>(p, a, s, ln, chunk); },
      Values<DK, false, ValuesLayout<DK, false>>{p});
}

}  // namespace gdn
}  // namespace lasp

// The templated kernels are instantiated from kernels/instances.rs (per Dk in {64, 128}); their
// grids, blocks and shared memory: lasp/gated_delta/forward_params.h.
