// GLA's LASP-2 backward, for sm_90a: the forward's exchange run down the chain
// (LASP2_CHAIN_DESCENDING). Each PE walks its shard's state gradient from zero at its end for its
// summary (M', Lambda), sends it to every EARLIER PE, and walks the shard again from the gradient
// leaving it (dht folded with the later PEs' summaries), storing the gradient leaving every chunk;
// the single-GPU grads kernel (gla/backward.cu) then takes the shard's chunks on their own. The
// summary and advance kernels are the forward's (gla/lasp2_forward.cu). Maths and call order:
// lasp/gla/lasp2_params.h.
#include "lasp/exchange/chain.cuh"
#include "lasp/gla/lasp2_fold.cuh"
#include "lasp/gla/lasp2_params.h"
#include "lasp/gla/walk.cuh"

namespace lasp {
namespace gla {

// Kernel 1: segment s = blockIdx.y of the shard from a zero gradient at its end, into piece
// S-1-s of (b*H+h = blockIdx.z): the pieces in ascending order run down the shard, as the
// summary kernel folds them.
template <int DK, int DV, bool kPacked>
__device__ __forceinline__ void lasp2_bwd_states(const lasp_gla_lasp2_params& p) {
  const int seg = blockIdx.y, col = 64 * (threadIdx.x >> 7);
  const Segment sg = segment_of(p, seg * p.chunks_per_segment, p.chunks_per_segment);
  const StateLane ln = walk_lane();
  StateRegs<DK> s;
  chunk::state_zero<DK>(s, ln);
  float2 lambda;
  run_walk<DK, DV, kPacked>(p, sg, s, nullptr, lambda);
  const int64_t piece = (int64_t)blockIdx.z * p.num_segments + (p.num_segments - 1 - seg);
  chunk::state_store<DK>(s, ln, p.ws_m + piece * DK * DV + col, DV);
  const GateLane<DK, WalkLayout<DK, DV>::kThreads> gl(threadIdx.x);
  if (gl.first == 0) reinterpret_cast<float2*>(p.ws_lambda + piece * DK)[gl.pair] = lambda;
}

// Kernel 3: segment s = blockIdx.y of the shard. The gradient leaving it: dht (on the last PE) or
// 0, the later PEs' tiles in chain order, then the pieces of this shard's segments after s, from
// the last down; the same fold in every mode. Its walk writes dh; PE 0's first segment, dh0.
template <int DK, int DV, bool kPacked, class Schedule>
__device__ __forceinline__ void lasp2_bwd_walk(const lasp_gla_lasp2_params& p) {
  const int seg = blockIdx.y, group = threadIdx.x >> 7;
  const int64_t bh = blockIdx.z, tile = (int64_t)DK * DV;
  const uint64_t tile_floats = lasp_gla_lasp2_tile_floats(DK);
  const Segment sg = segment_of(p, seg * p.chunks_per_segment, p.chunks_per_segment);
  const StateLane ln = walk_lane();
  StateRegs<DK> s;
  if (p.dht)
    chunk::state_load<DK>(s, ln, p.dht + bh * tile + group * 64, DV);
  else
    chunk::state_zero<DK>(s, ln);
  for (int vt = 0; vt < DV / 64; ++vt) {
    if (!Schedule::wait(p, static_cast<int>(bh), vt)) return;  // the host reports p.diag
    // Folded where they landed (read through L2), by the warpgroup whose columns they hold, one
    // tile per round (as the forward's output kernel).
    const float* arrived = nullptr;
    Schedule::fold_arrived(
        p, static_cast<int>(bh), vt, tile_floats, 1, [&](int, const float* landed) { arrived = landed; },
        [&](int) {
          if (group == vt) fold_landed_tile<DK>(s, ln, arrived);
        });
  }
  for (int u = 0; u < p.num_segments - 1 - seg; ++u) {
    const int64_t piece = bh * p.num_segments + u;
    fold_tile<DK>(s, ln, p.ws_m + piece * tile + group * 64, DV, p.ws_lambda + piece * DK);
  }
  float2 lambda;
  run_walk<DK, DV, kPacked>(p, sg, s, p.dh + bh * lasp_gla_num_chunks(p.T) * tile, lambda);
  if (seg == 0 && p.dh0) chunk::state_store<DK>(s, ln, p.dh0 + bh * tile + group * 64, DV);
}

}  // namespace gla
}  // namespace lasp

// The templated kernels are instantiated from kernels/instances.rs (geometry:
// lasp/gla/lasp2_params.h): lasp_gla_lasp2_bwd_states_dk*_dv{64,128},
// lasp_gla_lasp2_bwd_walk_dk*_dv{64,128} (all-gather schedule).
