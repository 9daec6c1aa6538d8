// The scalar-decay family's LASP-2 summary kernel, shared by the forward (lasp2_forward.cu) and the
// backward (lasp2_backward.cu), and the exchange's generic kernels instantiated for its params:
//   lasp_lasp2_fold_put        per (Dv tile, b*H+h): the PE's summary tile into its own slot, then
//                              published (credits; LASP2_DEVICE_PUT: put + signal to every later PE)
//   lasp_lasp2_advance_epoch   *epoch += 1, last in every call
//   lasp_lasp2_grant_credits   only when a plan switches from LASP2_NO_COMM to a communicating mode
// Protocol (epochs, parities, credits, why the puts are ordered as they are): kernels/docs/lasp2.md.
#include "lasp/scalar_decay/lasp2_summary.cuh"

// One CTA per (Dv tile vt, head bh = bh_begin + blockIdx.y of the launch's group):
//  - block (0, 0) of the group with bh_begin == 0 (once per call), communicating modes:
//    credit[me] = epoch - 1 on every PE before this one on the chain (this PE finished reading
//    epoch - 1: the kernels that read it precede this call's states kernel, which this launch
//    follows);
//  - the tile, into the own slot [parity][me][bh][vt] (+ trailer):
//      ascending chain (forward):   M_me = fold over s ascending of (M_s, Lambda_s) from ZERO,
//                                   Lambda_me = sum_s Lambda_s;
//      descending chain (backward): the segments are the shard's tokens from last to first, so the
//                                   fold is the reversed pass from zero, R = sum_t e^{G_t - G_0} q_t^T do_t
//                                   (G the shard's inclusive cumsum of a). The gradient with respect
//                                   to the state entering the shard, from the shard's own tokens, is
//                                   dM = sigma e^{a_0} R, and its carry Lambda = sum_s Lambda_s + a_0
//                                   (the reversed pass skips a_0). The chain's first PE (the last
//                                   one) has h0 = dht and sends e^{Lambda} dht + dM, so every other
//                                   PE folds from zero;
//  - LASP2_DEVICE_CHAIN: the tile above is folded into the relayed prefix (the predecessor's tile,
//    waited for; h0 or dht at the chain's first PE) and carries a zero log-decay, so the successor
//    starts from it as it is;
//  - LASP2_DEVICE_PUT: wait for every later PE's credit for epoch - 2 (bounded), then a put of
//    the contiguous tile to every later PE on the chain (same offset), one nvshmem_quiet for all of
//    them, and the signals [parity][me][bh*ntiles + vt] := epoch (the chain: to its successor).
// Exported as lasp_lasp2_fold_put for the all-gather schedule (kernels/instances.rs): grid
// lasp2_fold_put_grid, block LASP2_FOLD_THREADS, no smem.
namespace lasp {
namespace l2 {
template <class Schedule>
__device__ __forceinline__ void fold_put(const lasp_lasp2_params& p) {
  const uint64_t epoch = lasp::exchange::call_epoch(p);
  const int parity = static_cast<int>(epoch & 1);
  const int vt = blockIdx.x, bh = p.bh_begin + blockIdx.y;
  const int tid = threadIdx.x;
  const int S = p.num_segments;
  const bool descending = p.chain == LASP2_CHAIN_DESCENDING;

  // One thread sends the credits and later quiets them (with this CTA's puts, if any).
  const bool sent_credits = Schedule::send_credits(p, epoch, bh, vt);

  // Lambda_me, summed in segment order by every thread (the descending tile needs it).
  const float* const lam = p.ws_lambda + (int64_t)bh * S;
  float lambda = 0.f;
  for (int s = 0; s < S; ++s) lambda += lam[s];
  float boundary = 1.f;  // descending: sigma e^{a_0}
  if (descending) {
    const float a0 = p.g[(int64_t)(bh / p.H) * p.T * p.H + bh % p.H];
    boundary = p.scale * lasp::sd::exp_nonpos(a0);
    lambda += a0;
  }
  const int64_t state_elems = (int64_t)p.Dk * p.Dv;

  // The fold of all S segments from zero, then into the own slot tile (rows of 64 floats). The
  // tile is written after the loop rather than from its last step, so that the slot and h0
  // pointers are not live across the batched loads (which spilled at 512 threads' 128 registers).
  float4 acc[lasp::l2::FoldLane::kMaxRows];
  lasp::l2::fold_segments(p, bh, vt, S, acc, [](int, float4, int, int) {});
  const lasp::l2::FoldLane ln(p.Dk);
  // What the tile is folded into: the chain's relayed prefix (from the predecessor, or h0 at the
  // chain's first PE), else the backward's dht on its first PE, else nothing. The chain's tile
  // then carries a zero log-decay: it is the whole prefix. The own segments are folded before
  // the wait, so a hop of the chain costs one fold and one put.
  const bool relays = lasp::exchange::relays_prefix(p);
  bool arrived = true;
  const float* const prefix = Schedule::relayed_prefix(p, bh, vt, lasp2_slot_tile_floats(p.Dk), arrived);
  const float* const h0_tile = p.h0 ? p.h0 + bh * state_elems + vt * LASP2_TILE_V : nullptr;
  const bool chain_start = relays && lasp::exchange::chain_position(p) == 0;
  const float* const start = prefix ? prefix : (chain_start || descending) ? h0_tile : nullptr;
  const int64_t start_ld = prefix ? LASP2_TILE_V : p.Dv;
  float* const own = p.slots + lasp2_slot_tile_offset(parity, p.me, bh, vt, p.npes, p.B, p.H, p.Dv, lasp2_slot_tile_floats(p.Dk));
#pragma unroll
  for (int j = 0; j < lasp::l2::FoldLane::kMaxRows; ++j) {
    if (j >= ln.rows) continue;
    const int d = ln.row(j);
    float4 x = acc[j];
    if (descending) x = make_float4(boundary * x.x, boundary * x.y, boundary * x.z, boundary * x.w);
    if (start) {
      const float4 h = __ldcg(reinterpret_cast<const float4*>(start + (int64_t)d * start_ld + ln.c));
      x = make_float4(lasp::sd::fold_step(h.x, lambda, x.x), lasp::sd::fold_step(h.y, lambda, x.y),
                      lasp::sd::fold_step(h.z, lambda, x.z), lasp::sd::fold_step(h.w, lambda, x.w));
    }
    *reinterpret_cast<float4*>(own + d * LASP2_TILE_V + ln.c) = x;
  }
  if (tid == 0)
    *reinterpret_cast<float4*>(own + p.Dk * LASP2_TILE_V) = make_float4(relays ? 0.f : lambda, 0.f, 0.f, 0.f);
  // A CTA whose predecessor never sent sends nothing: its successor's wait then expires naming
  // this PE, and this PE's diag names the predecessor.
  if (!arrived) return;

  Schedule::publish(p, epoch, own, lasp2_slot_tile_floats(p.Dk) * 4u, bh, vt, sent_credits);
}
}  // namespace l2
}  // namespace lasp

// Launched last in every call (all modes): the call's epoch is complete on this PE.
// grid (1, 1, 1), block (1, 1, 1).
extern "C" __global__ void lasp_lasp2_advance_epoch(const __grid_constant__ lasp_lasp2_params p) {
  lasp::exchange::advance_epoch(p);
}

// Re-synchronises the all-gather's credits after LASP2_NO_COMM calls
// (lasp::exchange::Exchange::grant_credits); the host brackets it with
// nvshmemx_barrier_all_on_stream. grid (1, 1, 1), block (1, 1, 1).
extern "C" __global__ void lasp_lasp2_grant_credits(const __grid_constant__ lasp_lasp2_params p) {
  lasp::exchange::Exchange::grant_credits(p);
}
