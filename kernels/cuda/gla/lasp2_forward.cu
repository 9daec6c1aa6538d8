// GLA's LASP-2 forward with a device-initiated state exchange, for sm_90a. The chunk loops are the
// single-GPU forward's (lasp/gla/chunk.cuh); the summary is (M, Lambda) with Lambda per key
// dimension, folded as P = diag(e^{Lambda}) P + M; the protocol around it (epochs, credits, puts,
// bounded waits) is the generic exchange's (lasp/exchange/chain.cuh). Kernels and call order:
// lasp/gla/lasp2_params.h.
#include "lasp/exchange/chain.cuh"
#include "lasp/gla/chunk.cuh"
#include "lasp/gla/lasp2_fold.cuh"
#include "lasp/gla/lasp2_params.h"

namespace lasp {
namespace gla {

// Kernel 1: piece u = blockIdx.y of the shard (all S segments) -> ws_m / ws_lambda [bh][u].
template <int DK, bool kPacked>
__device__ __forceinline__ void lasp2_states(const lasp_gla_lasp2_params& p) {
  const int u = blockIdx.y, vt = blockIdx.x;
  const int64_t slot = (int64_t)blockIdx.z * p.num_segments * p.states_splits + u;
  const auto end = [&](StateRegs<DK>& s, const StateLane& ln, float2 lambda, const auto& gl) {
    chunk::state_store<DK>(s, ln, p.ws_m + slot * DK * p.Dv + vt * 64, p.Dv);
    if (vt == 0 && gl.first == 0) reinterpret_cast<float2*>(p.ws_lambda + slot * DK)[gl.pair] = lambda;
  };
  run_states_segment<DK, kPacked>(p, piece_of(p, u), vt, end);
}

// Kernel 2, one CTA per (Dv tile, head): the shard's summary tile, the fold of its pieces from zero
// (the backward's last PE: from dht) in order, into the own slot [parity][me][bh][vt], then
// published by the schedule. The backward's pieces run down the shard (lasp/gla/lasp2_params.h).
template <class Schedule>
__device__ __forceinline__ void lasp2_summary(const lasp_gla_lasp2_params& p) {
  const uint64_t epoch = exchange::call_epoch(p);
  const int parity = static_cast<int>(epoch & 1);
  const int vt = blockIdx.x, bh = blockIdx.y;
  const bool sent_credits = Schedule::send_credits(p, epoch, bh, vt);
  const int pieces = p.num_segments * p.states_splits;
  const int64_t tile = (int64_t)p.Dk * p.Dv;
  const uint64_t tile_floats = lasp_gla_lasp2_tile_floats(p.Dk);
  float* const own = p.slots + lasp2_slot_tile_offset(parity, p.me, bh, vt, p.npes, p.B, p.H, p.Dv, tile_floats);
  const float* const m = p.ws_m + (int64_t)bh * pieces * tile + vt * LASP2_TILE_V;
  const float* const lam = p.ws_lambda + (int64_t)bh * pieces * p.Dk;
  // The shard's own pieces first, into the own slot (each thread rereads only what it wrote).
  for (int e = threadIdx.x; e < p.Dk * LASP2_TILE_V; e += blockDim.x) {
    const int d = e / LASP2_TILE_V, c = e % LASP2_TILE_V;
    // The backward's last PE starts its tile from dht (NULL in the forward and elsewhere).
    float acc = p.dht ? __ldg(p.dht + (int64_t)bh * tile + (int64_t)d * p.Dv + vt * LASP2_TILE_V + c) : 0.f;
    for (int u = 0; u < pieces; ++u)
      acc = fold_step(acc, __ldg(lam + (int64_t)u * p.Dk + d), __ldg(m + u * tile + (int64_t)d * p.Dv + c));
    own[e] = acc;
  }
  // The pipelined chain: the tile is folded into the relayed prefix (the predecessor's tile, waited
  // for only now, so a hop costs one fold and one put; h0 at the forward's first PE; the
  // backward's first PE already started from dht) and carries a zero log-decay, so its successor
  // starts from it as it is.
  const bool relays = exchange::relays_prefix(p);
  bool arrived = true;
  const float* const prefix = Schedule::relayed_prefix(p, bh, vt, tile_floats, arrived);
  const bool from_h0 = relays && exchange::chain_position(p) == 0 && p.chain == LASP2_CHAIN_ASCENDING && p.h0;
  const float* const start = prefix ? prefix : from_h0 ? p.h0 + (int64_t)bh * tile + vt * LASP2_TILE_V : nullptr;
  const int64_t start_ld = prefix ? LASP2_TILE_V : p.Dv;
  // Lambda_me[d], summed in piece order: the prefix's decay over the shard, and the trailer.
  auto shard_lambda = [&](int d) {
    float lambda = 0.f;
    for (int u = 0; u < pieces; ++u) lambda += __ldg(lam + (int64_t)u * p.Dk + d);
    return lambda;
  };
  if (start) {
    for (int e = threadIdx.x; e < p.Dk * LASP2_TILE_V; e += blockDim.x) {
      const int d = e / LASP2_TILE_V, c = e % LASP2_TILE_V;
      own[e] = fold_step(__ldcg(start + d * start_ld + c), shard_lambda(d), own[e]);
    }
  }
  for (int d = threadIdx.x; d < p.Dk; d += blockDim.x) own[p.Dk * LASP2_TILE_V + d] = relays ? 0.f : shard_lambda(d);
  __syncthreads();  // the tile is complete before it is published
  // A CTA whose predecessor never sent sends nothing: its successor then names this PE.
  if (!arrived) return;
  Schedule::publish(p, epoch, own, tile_floats * 4u, bh, vt, sent_credits);
}

// Kernel 3: segment blockIdx.y of the shard. Its start: h0 (or 0), the earlier PEs' tiles in chain
// order, then this shard's pieces before the segment, in order; the same fold in every mode.
template <int DK, int DV, bool kPacked, class Schedule, bool kEntries = false>
__device__ __forceinline__ void lasp2_output(const lasp_gla_lasp2_params& p) {
  const Segment sg = segment_of(p, blockIdx.y * p.chunks_per_segment, p.chunks_per_segment);
  const int seg = blockIdx.y;
  const int64_t bh = blockIdx.z;
  const int64_t tile = (int64_t)DK * DV;
  const uint64_t tile_floats = lasp_gla_lasp2_tile_floats(DK);
  uint16_t* chunk_states = p.chunk_states ? p.chunk_states + bh * lasp_gla_num_chunks(p.T) * tile : nullptr;
  const auto start = [&](StateRegs<DK>& s, const StateLane& ln, int group) {
    if (p.h0 && Schedule::starts_from_h0(p))
      chunk::state_load<DK>(s, ln, p.h0 + bh * tile + group * 64, DV);
    else
      chunk::state_zero<DK>(s, ln);
    for (int vt = 0; vt < DV / 64; ++vt) {
      if (!Schedule::wait(p, static_cast<int>(bh), vt)) return false;  // the host reports p.diag
      // The tiles are folded where they landed (read through L2, as the signals' waits
      // acquired them), by the warpgroup whose columns they hold.
      // One tile per round (a batch would index its pointers at run time: local memory).
      const float* arrived = nullptr;
      Schedule::fold_arrived(
          p, static_cast<int>(bh), vt, tile_floats, 1, [&](int, const float* tile) { arrived = tile; },
          [&](int) {
            if (group == vt) fold_landed_tile<DK>(s, ln, arrived);
          });
    }
    const int pieces = p.num_segments * p.states_splits;
    for (int u = 0; u < seg * p.states_splits; ++u) {
      const int64_t piece = bh * pieces + u;
      fold_tile<DK>(s, ln, p.ws_m + piece * tile + group * 64, DV, p.ws_lambda + piece * DK);
    }
    return true;
  };
  const auto end = [&](StateRegs<DK>& s, const StateLane& ln, int group) {
    if (p.write_final_state && p.ht && seg == p.num_segments - 1)
      chunk::state_store<DK>(s, ln, p.ht + bh * tile + group * 64, DV);
  };
  run_output_segment<DK, DV, kPacked, kEntries>(p, sg, chunk_states, start, end);
}

}  // namespace gla
}  // namespace lasp

// Launched last in every call (all modes): the call's epoch is complete on this PE.
extern "C" __global__ void lasp_gla_lasp2_advance_epoch(const __grid_constant__ lasp_gla_lasp2_params p) {
  lasp::exchange::advance_epoch(p);
}

// Re-synchronises the all-gather's credits after LASP2_NO_COMM calls (the host brackets it with
// barriers). grid (1, 1, 1), block (1, 1, 1).
extern "C" __global__ void lasp_gla_lasp2_grant_credits(const __grid_constant__ lasp_gla_lasp2_params p) {
  lasp::exchange::Exchange::grant_credits(p);
}

// The templated kernels are instantiated from kernels/instances.rs (geometry:
// lasp/gla/lasp2_params.h): lasp_gla_lasp2_states_dk*, lasp_gla_lasp2_summary (both device
// schedules), lasp_gla_lasp2_output_dk*_dv{64,128}.
