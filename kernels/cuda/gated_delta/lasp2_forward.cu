// Gated DeltaNet's LASP-2 forward with a device-initiated exchange of the shards' affine summaries,
// for sm_90a. The chunk passes are the single-GPU forward's (gated_delta/forward.cu); this file adds
// the shard's summary (its segments' maps composed into the exchanged tile; the backward's too) and
// the fold of the earlier PEs' summaries into the shard's start state, both on
// lasp/gated_delta/affine.cuh; the protocol around them (epochs, credits, puts, bounded waits) is
// the generic exchange's (lasp/exchange/chain.cuh). Kernels and call order:
// lasp/gated_delta/lasp2_params.h.
#include "lasp/gated_delta/lasp2_fold.cuh"

namespace lasp {
namespace gdn {

// Kernel 3 (the backward's 4), one CTA per (Dv tile, head): the shard's summary composed from its
// segments' into the own slot tile [parity][me][bh][vt], then published by the schedule. Its first
// block, on the forward's chain, b = b_{S-1} + A_{S-1}(... (b_1 + A_1 b_0)); on the backward's, c' =
// c_0 + A_0^T (c_1 + ... A_{S-1}^T (c_{S-1} + A_{S-1}^T dht)), dht on the last PE only (else zero).
// Then A's column blocks jb = A_{S-1} ... A_1 A_0[:, jb], in both.
template <int DK, class Schedule>
__device__ __forceinline__ void lasp2_summary_tile(const lasp_gated_delta_lasp2_params& p) {
  __shared__ __align__(16) float s_tile[DK * 64];
  const lasp_gated_delta_params& f = p.fwd;
  const uint64_t epoch = exchange::call_epoch(p);
  const int parity = static_cast<int>(epoch & 1);
  const int vt = blockIdx.x, bh = blockIdx.y;
  const bool sent_credits = Schedule::send_credits(p, epoch, bh, vt);
  const uint64_t tile_floats = lasp_gdn_lasp2_tile_floats(DK, p.Dv);
  float* const own = p.slots + lasp2_slot_tile_offset(parity, p.me, bh, vt, p.npes, p.B, p.H, p.Dv, tile_floats);
  auto a_of = [&](int s) { return [&, s](int jb) { return summary_a_block<DK>(f, bh, s, jb); }; };

  AffineTile<DK> tile(s_tile);
  if (p.chain == LASP2_CHAIN_DESCENDING) {
    tile.load(p.dht ? p.dht + (int64_t)bh * DK * f.Dv + vt * 64 : nullptr, f.Dv);
    for (int s = f.num_segments - 1; s >= 0; --s)
      tile.template apply_transposed<Source::kWorkspace>(a_of(s), segment_ds_tile<DK>(f, p.ws_ds, bh, s, vt), f.Dv);
  } else {
    tile.load(summary_b_tile<DK>(f, bh, 0, vt), f.Dv);
    for (int s = 1; s < f.num_summaries; ++s)
      tile.template apply<Source::kWorkspace>(a_of(s), summary_b_tile<DK>(f, bh, s, vt), f.Dv);
  }
  tile.store(own, 64);
  // Under the pipelined chain a PE that relays folds its map into the prefix: that needs every
  // column block of A_me, so it composes all of them into this CTA's scratch before it waits, and
  // the own tile's blocks are copied from there (the same bits), leaving only the fold after the
  // wait. Elsewhere the own tile's blocks are composed straight into the slot.
  const int position = exchange::chain_position(p);
  const bool relays = exchange::relays_prefix(p);
  const bool from_h0 = relays && position == 0 && p.chain == LASP2_CHAIN_ASCENDING && f.h0;
  const bool folds_prefix = relays && position > 0 && position < p.npes - 1;  // relayed_prefix's
  float* const relay_a =
      from_h0 || folds_prefix ? p.ws_relay_a + ((int64_t)bh * (p.Dv / 64) + vt) * DK * DK : nullptr;
  // A thread stores and loads only its own elements of the tile: no barrier between them.
  auto compose_block = [&](int jb, float* dst) {
    tile.load(summary_a_block<DK>(f, bh, 0, jb), 64);
    for (int s = 1; s < f.num_summaries; ++s) tile.template apply<Source::kWorkspace>(a_of(s), nullptr, 0);
    tile.store(dst, 64);
  };
  int blocks = 1;
  if (relay_a) {
    for (int jb = 0; jb < DK / 64; ++jb) compose_block(jb, relay_a + jb * DK * 64);
    for (int jb = vt; jb < DK / 64; jb += p.Dv / 64, ++blocks) {
      tile.template load<Source::kLanded>(relay_a + jb * DK * 64, 64);  // written in this kernel
      tile.store(own + blocks * DK * 64, 64);
    }
    __syncthreads();  // the scratch is complete before any thread folds with it
  } else {
    for (int jb = vt; jb < DK / 64; jb += p.Dv / 64, ++blocks) compose_block(jb, own + blocks * DK * 64);
  }
  // The map folded into the relayed prefix (waited for only now, so that a hop costs one fold and
  // one put), or at the forward's first position into h0.
  bool arrived = true;
  const float* const prefix = Schedule::relayed_prefix(p, bh, vt, lasp_gdn_lasp2_tile_floats(DK, p.Dv), arrived);
  if (prefix || from_h0) {
    if (prefix)
      tile.template load<Source::kLanded>(prefix, 64);
    else
      tile.load(f.h0 + (int64_t)bh * DK * f.Dv + vt * 64, f.Dv);
    auto relay_block = [&](int jb) { return relay_a + jb * DK * 64; };
    if (p.chain == LASP2_CHAIN_DESCENDING)
      tile.template apply_transposed<Source::kLanded>(relay_block, own, 64);
    else
      tile.template apply<Source::kLanded>(relay_block, own, 64);
    tile.store(own, 64);
  }
  __syncthreads();  // the tile is complete before it is published
  // A CTA whose predecessor never sent sends nothing: its successor then names this PE.
  if (!arrived) return;
  Schedule::publish(p, epoch, own, static_cast<uint64_t>(blocks) * DK * 64 * 4, bh, vt, sent_credits);
}

template <class Schedule>
__device__ __forceinline__ void lasp2_summary(const lasp_gated_delta_lasp2_params& p) {
  if (p.Dk == 128)
    lasp2_summary_tile<128, Schedule>(p);
  else
    lasp2_summary_tile<64, Schedule>(p);
}

// Kernel 4, one CTA per (Dv tile vt, head): the state entering the shard, P = h0 (or 0) and then
// P = A_u P + b_u for the earlier PEs in chain order (A from every tile of the head, b from tile
// vt), into start_state where set, then the states entering the shard's segments, into ws_p. The same
// fold in every mode.
template <int DK, class Schedule>
__device__ __forceinline__ void lasp2_fold(const lasp_gated_delta_lasp2_params& p) {
  __shared__ __align__(16) float s_tile[DK * 64];
  const lasp_gated_delta_params& f = p.fwd;
  const int vt = blockIdx.x, bh = blockIdx.y;
  AffineTile<DK> tile(s_tile);
  // Under the pipelined chain only its first PE starts from h0: the relayed prefix holds it.
  tile.load(f.h0 && Schedule::starts_from_h0(p) ? f.h0 + (int64_t)bh * DK * f.Dv + vt * 64 : nullptr, f.Dv);
  if (!fold_landed<DK, Schedule, false>(p, tile, bh, vt)) return;  // the host reports p.diag
  if (p.start_state) tile.store(p.start_state + (int64_t)bh * DK * f.Dv + vt * 64, f.Dv);
  fold_segments<DK>(f, tile, bh, vt);
}

}  // namespace gdn
}  // namespace lasp

// Launched last in every call (all modes): the call's epoch is complete on this PE.
extern "C" __global__ void lasp_gated_delta_lasp2_advance_epoch(const __grid_constant__ lasp_gated_delta_lasp2_params p) {
  lasp::exchange::advance_epoch(p);
}

// Re-synchronises the all-gather's credits after LASP2_NO_COMM calls (the host brackets it with
// barriers). grid (1, 1, 1), block (1, 1, 1).
extern "C" __global__ void lasp_gated_delta_lasp2_grant_credits(
    const __grid_constant__ lasp_gated_delta_lasp2_params p) {
  lasp::exchange::Exchange::grant_credits(p);
}

// The templated kernels are instantiated from kernels/instances.rs (geometry:
// lasp/gated_delta/lasp2_params.h): lasp_gated_delta_lasp2_summary (all-gather schedule) and
// lasp_gated_delta_lasp2_fold_dk*.
