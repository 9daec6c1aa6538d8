// The LASP-2 exchange along the chain (lasp/lasp2_params.h, "The chain"), shared by the forward
// (lasp2_fwd.cu) and the backward (lasp2_bwd.cu):
//   lasp_lasp2_fold_put        per (Dv tile, b*H+h): the PE's tile into its own slot; credits;
//                              LASP2_DEVICE_PUT: put the tile + signal to every later PE on the chain
//   lasp_lasp2_advance_epoch   *epoch += 1, last in every call
//   lasp_lasp2_grant_credits   only when a plan switches from LASP2_NO_COMM to a communicating mode
// Protocol (epochs, parities, credits, why the puts are ordered as they are): kernels/docs/lasp2.md.
// Only the put / signal API touches remote memory, so the same code runs over NVLink and InfiniBand.
#include <nvshmem.h>
#include <nvshmemx.h>

#include "lasp/lasp2_chain.cuh"

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
//  - LASP2_DEVICE_PUT: wait for every later PE's credit for epoch - 2 (bounded), then a put of
//    the contiguous tile to every later PE on the chain (same offset), one nvshmem_quiet for all of
//    them, and the signals [parity][me][bh*ntiles + vt] := epoch.
// grid lasp2_fold_put_grid, block LASP2_FOLD_THREADS, no smem.
extern "C" __global__ void __launch_bounds__(LASP2_FOLD_THREADS)
    lasp_lasp2_fold_put(const __grid_constant__ lasp_lasp2_params p) {
  const uint64_t epoch = lasp::l2::call_epoch(p);
  const int parity = static_cast<int>(epoch & 1);
  const int vt = blockIdx.x, bh = p.bh_begin + blockIdx.y;
  const int tid = threadIdx.x;
  const int S = p.num_segments;
  const bool comm = p.exchange_mode != LASP2_NO_COMM;
  const bool descending = p.chain == LASP2_CHAIN_DESCENDING;
  const int position = lasp::l2::chain_position(p);

  // One thread sends the credits and later quiets them (with this CTA's puts, if any).
  const bool sends_credits = comm && bh == 0 && vt == 0 && tid == 0 && position > 0;
  if (sends_credits)
    for (int pos = 0; pos < position; ++pos)
      nvshmemx_signal_op(p.credit + p.me, epoch - 1, NVSHMEM_SIGNAL_SET, lasp::l2::chain_pe(p, pos));

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
  const float* const start = descending && p.h0 ? p.h0 + bh * state_elems + vt * LASP2_TILE_V : nullptr;

  // The fold of all S segments from zero, then into the own slot tile (rows of 64 floats). The
  // tile is written after the loop rather than from its last step, so that the slot and h0
  // pointers are not live across the batched loads (which spilled at 512 threads' 128 registers).
  float4 acc[lasp::l2::FoldLane::kMaxRows];
  lasp::l2::fold_segments(p, bh, vt, S, acc, [](int, float4, int, int) {});
  const lasp::l2::FoldLane ln(p.Dk);
  float* const own = p.slots + lasp2_slot_tile_offset(parity, p.me, bh, vt, p.npes, p.B, p.H, p.Dk, p.Dv);
#pragma unroll
  for (int j = 0; j < lasp::l2::FoldLane::kMaxRows; ++j) {
    if (j >= ln.rows) continue;
    const int d = ln.row(j);
    float4 x = acc[j];
    if (descending) {
      x = make_float4(boundary * x.x, boundary * x.y, boundary * x.z, boundary * x.w);
      if (start) {
        const float4 h = *reinterpret_cast<const float4*>(start + (int64_t)d * p.Dv + ln.c);
        x = make_float4(lasp::sd::fold_step(h.x, lambda, x.x), lasp::sd::fold_step(h.y, lambda, x.y),
                        lasp::sd::fold_step(h.z, lambda, x.z), lasp::sd::fold_step(h.w, lambda, x.w));
      }
    }
    *reinterpret_cast<float4*>(own + d * LASP2_TILE_V + ln.c) = x;
  }
  if (tid == 0) *reinterpret_cast<float4*>(own + p.Dk * LASP2_TILE_V) = make_float4(lambda, 0.f, 0.f, 0.f);

  const uint64_t stamps = lasp2_timeline_put(bh, vt, p.Dv);
  const int later = p.npes - 1 - position;  // PEs after this one on the chain
  if (p.exchange_mode != LASP2_DEVICE_PUT || later == 0) {
    if (sends_credits) nvshmem_quiet();
    lasp::l2::stamp(p, stamps + 0);
    lasp::l2::stamp(p, stamps + 1);
    return;
  }
  auto reader = [&](int k) { return lasp::l2::chain_pe(p, position + 1 + k); };  // k < later

  // The tile is complete in this PE's memory before the NIC (over InfiniBand) reads it for the
  // puts. A peer NVSHMEM reaches by load/store gets its copy from this CTA's threads, for which
  // the barrier below is enough; skipping the fence there matters, because a system-scope fence
  // waits tens of microseconds while the GPUs stream the kernels' traffic (kernels/docs/lasp2.md).
  bool nic_reads = false;
  for (int k = 0; k < later; ++k) nic_reads |= nvshmem_ptr(own, reader(k)) == nullptr;
  if (nic_reads) __threadfence_system();
  int ok = 1;
  if (epoch > 2) {
    // Slot [parity] of reader pe was last read at epoch - 2: wait for its credit, one thread per reader.
    const lasp::WaitSite site{p.diag, p.timeout_ns, p.me};
    for (int k = tid; k < later; k += blockDim.x) {
      const int pe = reader(k);
      ok &= lasp::wait_signal_ge(site, p.credit + pe, epoch - 2, pe, pe, LASP_WAIT_CREDIT);
    }
  }
  // A CTA that gave up on a credit sends nothing: the readers then time out on this epoch's data,
  // and this PE's diag names the peer whose credit never came.
  if (!__syncthreads_and(ok)) return;
  lasp::l2::stamp(p, stamps + 0);

  // Every put first, then one quiet for all of them, then the signals: a put-with-signal per peer
  // would wait for its own completion (a system-scope fence) before the next peer's copy starts,
  // and such a fence waits long while the GPUs stream the output kernel's traffic.
  const uint64_t bytes = lasp2_slot_tile_floats(p.Dk) * 4u;
  uint64_t* const sig = p.signals + lasp2_signal_index(parity, p.me, bh, vt, p.npes, p.B, p.H, p.Dv);
  const int first = (blockIdx.y * gridDim.x + blockIdx.x) % later;  // staggered: every link busy at once
  auto peer = [&](int k) { return reader((first + k) % later); };
  for (int k = 0; k < later; ++k) nvshmemx_putmem_nbi_block(own, own, bytes, peer(k));
  __syncthreads();
  if (tid == 0) {
    nvshmem_quiet();  // the CTA's puts have landed: the signals may follow
    for (int k = 0; k < later; ++k) nvshmemx_signal_op(sig, epoch, NVSHMEM_SIGNAL_SET, peer(k));
    lasp::l2::stamp(p, stamps + 1);
    nvshmem_quiet();
  }
}

// Launched last in every call (all modes): the call's epoch is complete on this PE.
// grid (1, 1, 1), block (1, 1, 1).
extern "C" __global__ void lasp_lasp2_advance_epoch(const __grid_constant__ lasp_lasp2_params p) {
  if (threadIdx.x == 0 && blockIdx.x == 0) *p.epoch += 1;
}

// Re-synchronises credits after LASP2_NO_COMM calls (which send none), before the first call of a
// communicating mode: credit[me] = *epoch (every epoch so far is finished here) on every PE before
// this one on the chain.
// Host: nvshmemx_barrier_all_on_stream; this kernel (grid (1, 1, 1), block (1, 1, 1));
// nvshmemx_barrier_all_on_stream (every credit is in place before any writer waits for one).
extern "C" __global__ void lasp_lasp2_grant_credits(const __grid_constant__ lasp_lasp2_params p) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  const uint64_t done = *p.epoch;
  for (int pos = 0; pos < lasp::l2::chain_position(p); ++pos)
    nvshmemx_signal_op(p.credit + p.me, done, NVSHMEM_SIGNAL_SET, lasp::l2::chain_pe(p, pos));
  nvshmem_quiet();
}
